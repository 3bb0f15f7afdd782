"""Prompt prefills kept across requests: ``dlm-run serve --prefix-cache-gb``,
``api.PrefixCache``.

Requests that share a prefix (a system prompt, tool declarations, the earlier
turns of a conversation re-sent whole) skip its prefill. The promise is the one
batches keep: a request served from the cache gets bit for bit what it gets
without it. On the CPU backend a position's keys and values depend on the shape
of the forward that computed them (dlm.runtime.models.rows: a row's GEMM result
moves with its row count), so the cache keeps whole prefill forwards:

* A prompt's prefill runs in chunks whose boundaries follow from the prompt
  alone (every ``--prefill-step-size`` tokens; LLaDA-2: whole blocks;
  DiffusionGemma: never inside an image). Each chunk's K/V, once evaluated, is
  stored as a segment keyed by (the segment before it, the chunk's symbols): a
  trie over chunks, rooted at the family's computation signature.
* A new prompt walks its own chunks down the trie; the segments it finds are
  exactly the forwards it would run, so its cache is rebuilt from them and its
  prefill runs the chunks that follow: the same forwards it runs without the
  cache. Symbols are token ids; an image's first position holds a digest of its
  pixels, so images are keyed by content.
* Segments are the family's own copies of K/V arrays (MLX arrays are never
  written in place, so a request that extends a restored cache shares nothing
  mutable): concurrent requests share a segment, copy-on-write.
* Bounded: least recently used leaves go first when the segments' bytes would
  pass ``limit_bytes``; a segment that would not fit alone is not stored (nor
  what follows it in that prompt).

Thread-safe (the server reads ``stats`` from its request threads while the
generation thread stores and looks up).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..platform.errors import GenerationError
from ..platform.memory import budget_bytes

# dlm-run serve's cache, unless --prefix-cache-gb says: this share of the memory budget (a
# released DiffusionGemma holds ~0.24 MB a prompt position in bf16, LLaDA2.0-mini ~0.04 MB:
# at 10% of a 64 GB Mac's budget, a few dozen 2 k-token system prompts).
DEFAULT_SHARE = 0.1


def sized(gb: Optional[float], memory_budget: Optional[float] = None) -> Optional["PrefixCache"]:
    """The cache ``--prefix-cache-gb`` asks for: ``gb`` GB, or DEFAULT_SHARE of the
    memory budget; None when that is 0 (off)."""
    if gb is not None and gb < 0:
        raise GenerationError(f"--prefix-cache-gb must be >= 0 (0 turns the cache off), got {gb}")
    limit = int(gb * 1e9) if gb is not None else int(DEFAULT_SHARE * budget_bytes(memory_budget))
    return PrefixCache(limit) if limit else None


@dataclass(eq=False)
class Segment:
    """One stored prefill chunk: positions [start, end) of the prompts that share its path."""

    node: int  # this segment's id (its children are keyed by it)
    parent: Optional["Segment"]
    start: int
    end: int
    arrays: list  # per layer: (keys, values) of [start, end), the family's own copies
    nbytes: int
    children: int = 0
    used: int = 0  # last use (LRU tick)
    key: tuple = field(default=(), repr=False)


class PrefixCache:
    """Whole prefill chunks of earlier prompts, for the prompts that start with them (module doc)."""

    def __init__(self, limit_bytes: int):
        if limit_bytes < 0:
            raise ValueError(f"the prefix cache's limit must be >= 0 bytes, got {limit_bytes}")
        self.limit = int(limit_bytes)
        self._lock = threading.Lock()
        self._table: dict[tuple, Segment] = {}
        self._roots: dict[Hashable, int] = {}  # computation signature -> root node id
        self._owner = None
        self._next, self._tick = 0, 0
        self.bytes = 0
        self.lookups = self.hits = self.evictions = 0
        self.prompt_tokens = self.cached_tokens = 0

    def bind(self, model) -> None:
        """Tie the cache to the model whose K/V it holds; another model's use is an error."""
        with self._lock:
            if self._owner is None:
                self._owner = model
            elif self._owner is not model:
                raise ValueError("this prefix cache holds another model's prefills; give each model its own")

    def _root(self, signature: Hashable) -> int:
        if signature not in self._roots:
            self._roots[signature] = self._new_id()
        return self._roots[signature]

    def _new_id(self) -> int:
        self._next += 1
        return self._next

    def lookup(self, signature: Hashable, symbols: Sequence, bounds: Sequence[int],
               prompt_tokens: int) -> list[Segment]:
        """The stored segments along this prompt's chunks (``bounds``: its chunk
        ends, ascending), from its first chunk on, as far as they go; counted in
        the stats as one lookup of ``prompt_tokens``."""
        with self._lock:
            self._tick += 1
            node, start, chain = self._root(signature), 0, []
            for end in bounds:
                segment = self._table.get((node, tuple(symbols[start:end])))
                if segment is None:
                    break
                segment.used = self._tick
                chain.append(segment)
                node, start = segment.node, end
            self.lookups += 1
            self.hits += bool(chain)
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += start
            return chain

    def store(self, signature: Hashable, symbols: Sequence, parent: Optional[Segment], start: int, end: int,
              arrays: list) -> Optional[Segment]:
        """Keep the chunk [start, end) that followed ``parent`` (None: the first);
        returns its segment, or None when it does not fit (the caller stops storing
        this prompt's chunks: a segment without its parent is never found)."""
        nbytes = sum(int(k.nbytes) + int(v.nbytes) for k, v in arrays)
        with self._lock:
            node = parent.node if parent is not None else self._root(signature)
            if parent is not None and self._table.get(parent.key) is not parent:
                return None  # the parent was evicted meanwhile
            key = (node, tuple(symbols[start:end]))
            have = self._table.get(key)
            self._tick += 1
            if have is not None:  # another request stored it first (same forwards: same arrays)
                have.used = self._tick
                return have
            if nbytes > self.limit or not self._make_room(nbytes, keep=parent):
                return None
            segment = Segment(self._new_id(), parent, start, end, arrays, nbytes, used=self._tick, key=key)
            self._table[key] = segment
            if parent is not None:
                parent.children += 1
            self.bytes += nbytes
            return segment

    def _make_room(self, nbytes: int, keep: Optional[Segment]) -> bool:
        """Evict least recently used leaves (never ``keep`` or its ancestors) until ``nbytes`` fit."""
        protected = set()
        while keep is not None:
            protected.add(id(keep))
            keep = keep.parent
        while self.bytes + nbytes > self.limit:
            leaves = [s for s in self._table.values() if s.children == 0 and id(s) not in protected]
            if not leaves:
                return False
            victim = min(leaves, key=lambda s: s.used)
            del self._table[victim.key]
            if victim.parent is not None:
                victim.parent.children -= 1
            self.bytes -= victim.nbytes
            self.evictions += 1
        return True

    def stats(self) -> dict:
        """What /health and --profile show: size, use and the token hit rate."""
        with self._lock:
            rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
            return {"limit_bytes": self.limit, "bytes": self.bytes, "segments": len(self._table),
                    "lookups": self.lookups, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                    "cached_tokens": self.cached_tokens, "token_hit_rate": round(rate, 4),
                    "evictions": self.evictions}


class Reuse:
    """One prompt's use of a PrefixCache: the segments found for it (restored into
    ``caches``, the family's per-layer caches, which must hold ``segment(n)``
    and ``restore(parts, offset)``), then each chunk its prefill runs, stored
    once evaluated (``stored``)."""

    def __init__(self, store: PrefixCache, signature: Hashable, symbols: Sequence, bounds: Sequence[int],
                 caches: list):
        self.store, self.signature, self.symbols, self.caches = store, signature, list(symbols), caches
        chain = store.lookup(signature, self.symbols, bounds, len(self.symbols))
        self.start = chain[-1].end if chain else 0  # where the prefill goes on
        if chain:
            for i, cache in enumerate(caches):
                cache.restore([segment.arrays[i] for segment in chain], self.start)
        self.parent: Optional[Segment] = chain[-1] if chain else None
        self.storing = True

    def stored(self, start: int, end: int) -> None:
        """The prefill chunk [start, end) was evaluated into the caches: keep it."""
        if not self.storing or end <= start:
            return
        arrays = [cache.segment(end - start) for cache in self.caches]
        mx.eval(arrays)  # now: the next chunk writes the caches
        self.parent = self.store.store(self.signature, self.symbols, self.parent, start, end, arrays)
        self.storing = self.parent is not None


def shared_store(store: Optional[PrefixCache], prefix, model) -> Optional[PrefixCache]:
    """The PrefixCache a session uses (None when none is given, or its limit is 0),
    tied to ``model``; a run with a kept chat prefix (``prefix``) takes no shared one."""
    if store is None or store.limit == 0:
        return None
    if prefix is not None:
        raise GenerationError("a kept chat prefix (prefix=) and a shared prefix cache (prefix_cache=) "
                              "cannot both serve one run")
    try:
        store.bind(model)
    except ValueError as exc:
        raise GenerationError(str(exc)) from None
    return store


def image_digest(image) -> str:
    """An image's key in the cache: a digest of its preprocessed pixels and patch positions."""
    digest = hashlib.sha256()
    for part in (image.pixel_values, image.position_ids):
        array = np.ascontiguousarray(part)
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
