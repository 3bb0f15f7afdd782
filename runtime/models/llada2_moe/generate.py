"""LLaDA-2 block-diffusion generation (after ``LLaDA2MoeModelLM.generate`` in the hub
``modeling_llada2_moe.py`` of inclusionAI/LLaDA2.0-mini, and of LLaDA2.1-mini for editing).

The sequence is the prompt followed by mask tokens, cut into blocks of
``block_length``. Blocks are generated in order; inside a block every step
runs the model on the active block, samples a token and its confidence per
position, and reveals every masked position whose confidence exceeds the
threshold, and at least the step's quota (``block_length // steps``, the
remainder going to the first steps, as the hub ``generate``), so a block is
always complete after ``steps`` steps: the output never holds a mask token.

KV cache: the prompt's full blocks are prefilled once; a finished block is
written to the cache by the first forward of the next block (the window is
[finished block ; active block] under the block-causal mask), so no forward is
spent only on caching. Attention is block-causal, so this equals the hub's full
recomputation (``kv_cache=False`` runs that instead, for tests).

Sampling: temperature 0 is argmax (the greedy fix); otherwise temperature /
top-k / top-p, drawn by inverse CDF from a seeded uniform stream (numpy PCG64)
so that the PyTorch reference draws the same samples. ``reference_sampling``
reproduces the hub 2.0 sampler (temperature 0 still samples at temperature 1).
LLaDA2.1 checkpoints add token-to-token editing (``editing_threshold``; on by
default at 0.9 when the checkpoint is recognised as 2.1). LLaDA2.2 checkpoints
(``expert_capacity`` in config.json) decode each block with Levenshtein editing
(levenshtein.py: DELETE and SPLIT tokens, the anti-loop rule; greedy only). Unlike the 2.1 hub
code, whose mask is the raw 0/1 matrix (no blocking in effect), attention stays
block-causal, as dllm's fix and the committed-block cache require.

Mask predictions: the hub may commit the mask id as a token; dlm never samples
it (``suppress_mask``), so no output holds a mask token.

Stops: a block is final as soon as no masks remain before its first stop
token (or before the output budget); generation stops after the block holding
a stop token. Stop tokens: the checkpoint's EOS ids plus ``<|role_end|>``
(the chat turn end) when the tokenizer has it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from ...platform.errors import GenerationError
from ...generation.events import GenerationEvent
from ...generation.prefix_cache import Reuse, shared_store
from ...generation.progress import Block, PrefixState, check_prompt, common_prefix, run
from ...platform.memory import check_budget, scores_materialized
from ..base import ConfigReader
from .model import block_causal_mask
from .levenshtein import Rules
from .options import (
    BLOCK_LENGTH,
    DEFAULTS as D,
    EDITING_THRESHOLD_21,
    EDITING_THRESHOLD_22,
    LINEAR_FLOOR,
    MAX_POST_STEPS,
    MAX_STEPS_PER_BLOCK,
    STEPS,
    THRESHOLD,
    THRESHOLD_22,
)
from .sampling import UniformStream, transfer_quota
from .trace import BlockTracer

ROLE_END = "<|role_end|>"


def parse_threshold_schedule(value, threshold: float) -> Optional[float]:
    """'constant' -> None; 'linear' -> floor 0.5; 'linear:F' -> floor F (decay to F over the steps)."""
    if value is None or value == "constant":
        return None
    m = re.fullmatch(r"linear(?::([0-9]*\.?[0-9]+))?", str(value).strip())
    if not m:
        raise GenerationError(
            f"--threshold-schedule must be 'constant', 'linear' or 'linear:FLOOR', not {value!r}"
        )
    floor = float(m.group(1)) if m.group(1) else min(LINEAR_FLOOR, threshold)
    if not 0.0 <= floor <= threshold:
        raise GenerationError(f"--threshold-schedule floor {floor} must be in [0, --threshold={threshold}]")
    return floor


@dataclass
class Settings:
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    max_tokens: int = D["max_tokens"]
    block_length: int = BLOCK_LENGTH
    steps: int = STEPS
    threshold: float = THRESHOLD
    min_threshold: Optional[float] = None  # linear schedule floor; None: constant
    temperature: float = D["temp"]
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    reference_sampling: bool = False
    # None: no editing; "auto": LLaDA2.1 checkpoints edit at 0.9, others do not.
    editing_threshold: Optional[float] | str = "auto"
    max_post_steps: int = MAX_POST_STEPS
    max_steps_per_block: int = MAX_STEPS_PER_BLOCK  # LLaDA2.2
    prefill_step_size: int = D["prefill_step_size"]  # prompt tokens per prefill forward (rounded to blocks)
    memory_budget: Optional[float] = None  # GB; None: the default (dlm.runtime.platform.memory)
    skip_special_tokens: bool = D["skip_special_tokens"]
    # Internal switches (parity suite and tests; not CLI flags).
    kv_cache: bool = True
    suppress_mask: bool = True  # never sample the mask token (the hub does not exclude it)
    early_stop: bool = True  # end a block once its output is final
    stop_on_role_end: bool = True
    uniforms: Optional[Callable[[int], np.ndarray]] = None  # overrides the seeded stream
    on_step: Optional[Callable[[int, int, mx.array], None]] = None  # (block, step, logits [bl, V])
    trace: Optional[list] = None  # (block, step, positions, tokens) per step
    step_trace: Optional[object] = None  # a dlm.runtime.trace.Trace (--trace): every step, summarised

    @classmethod
    def from_options(cls, options: dict, args, generation_config: dict) -> "Settings":
        """Settings from options (already checked: dlm.runtime.registry.settings) over
        generation_config over defaults."""
        # generation_config values are typed and range-checked (a bad one names the key).
        g = ConfigReader(generation_config or {}, "generation_config.json", "generation config")
        vocab = args.vocab_size
        threshold = THRESHOLD_22 if args.block_routing else THRESHOLD
        s = cls(
            mask_token_id=g.int("mask_token_id", args.mask_token_id, minimum=0, maximum=vocab - 1),
            eos_token_ids=tuple(g.token_ids("eos_token_id", list(args.eos_token_ids), vocab=vocab)),
            max_tokens=options.get("max_tokens", g.int("max_new_tokens", D["max_tokens"], minimum=0)),
            block_length=options.get("block_length", g.int("block_length", BLOCK_LENGTH, minimum=1)),
            steps=options.get("max_denoising_steps", g.int("steps", STEPS, minimum=1)),
            threshold=options.get("threshold", g.float("threshold", threshold, minimum=0.0, maximum=1.0)),
            temperature=options.get("temp", g.float("temperature", D["temp"], minimum=0.0)),
            top_k=options.get("top_k"),
            top_p=options.get("top_p"),
            seed=options.get("seed"),
            reference_sampling=bool(options.get("reference_sampling") or False),
            max_post_steps=options.get("max_post_steps", g.int("max_post_steps", MAX_POST_STEPS, minimum=0)),
            max_steps_per_block=options.get("max_steps_per_block",
                                            g.int("max_steps_per_block", MAX_STEPS_PER_BLOCK, minimum=1)),
            prefill_step_size=options.get("prefill_step_size", D["prefill_step_size"]),
            memory_budget=options.get("memory_budget"),
            skip_special_tokens=options.get("skip_special_tokens", D["skip_special_tokens"]),
        )
        if options.get("editing_threshold") is not None:
            s.editing_threshold = float(options["editing_threshold"])
        elif args.block_routing:
            s.editing_threshold = g.float("editing_threshold", EDITING_THRESHOLD_22, minimum=0.0, maximum=1.0)
        s.min_threshold = parse_threshold_schedule(options.get("threshold_schedule"), s.threshold)
        return s

    def step_threshold(self, step: int, steps: int) -> float:
        if self.min_threshold is None:
            return self.threshold
        return self.threshold - (self.threshold - self.min_threshold) * step / max(1, steps - 1)


def is_llada21(loaded) -> bool:
    """LLaDA2.1 shares 2.0's architecture and config; recognise it by name
    (directory or repo id, _name_or_path, dlm source) or by a shipped modeling file whose
    generate() takes editing_threshold (read as text, never executed)."""
    names = [str(getattr(loaded, "path", "")), str(getattr(loaded, "source", "")),
             str(loaded.config.get("_name_or_path", ""))]
    names.append(str((loaded.config.get("dlm") or {}).get("source", "")))
    if any(re.search(r"llada[-_]?2[._-]?1(?![0-9a-z])", n, re.IGNORECASE) for n in names):  # not "llada2-1L"
        return True
    path = getattr(loaded, "path", None)
    if path:
        for f in Path(path).glob("modeling_*.py"):
            try:
                if "editing_threshold" in f.read_text(errors="ignore"):
                    return True
            except OSError:
                pass
    return False


def option_warnings(loaded, options: dict) -> list[str]:
    """--editing-threshold below 1.0 on a LLaDA2.0 checkpoint: editing runs (it
    changes answers) but 2.0 was not trained for it, so say so (one line).
    A LLaDA2.2 config silent on its DELETE/SPLIT ids: say which ids dlm uses."""
    if loaded.args.block_routing:
        silent = [k for k in ("delete_token_id", "split_token_id") if loaded.config.get(k) is None]
        if not silent:
            return []
        return [f"warning: config.json declares no {' / '.join(silent)}; using LLaDA2.2's "
                f"{loaded.args.delete_token_id} (DELETE) and {loaded.args.split_token_id} (SPLIT)"]
    value = options.get("editing_threshold")
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value >= 1.0:
        return []
    if is_llada21(loaded):
        return []
    return [f"warning: --editing-threshold {value}: this checkpoint is not LLaDA2.1; LLaDA2.0 was not trained "
            "for token-to-token editing, so editing changes its answers, likely for the worse "
            "(1.0 or unset: off)"]


# ---------------------------------------------------------------------------
# The block loop
# ---------------------------------------------------------------------------


def stop_ids(loaded, s: Settings) -> set[int]:
    ids = set(s.eos_token_ids)
    tok = getattr(loaded, "tokenizer", None)
    if s.stop_on_role_end and tok is not None:
        rid = tok.convert_tokens_to_ids(ROLE_END)
        if isinstance(rid, int) and rid != getattr(tok, "unk_token_id", None) and rid >= 0:
            ids.add(rid)
    return ids


_HOOKS = (
    "on_step", "trace", "step_trace", "uniforms", "kv_cache", "suppress_mask", "early_stop",
    "stop_on_role_end", "editing_threshold",
)
# Hooks of the session itself rather than of Settings.
_SESSION_HOOKS = ("prefix", "watch", "structured", "prefix_cache")


def stream_generate(
    loaded, prompt_ids: list[int], settings: Settings, cancel: Optional[Callable[[], bool]] = None,
    *, stop_ids: Optional[list[int]] = None, **hooks,
) -> Iterator[GenerationEvent]:
    """Events: one per finished block (its new tokens and text, in sequence
    order), then the final event with finish_reason and stats.

    ``hooks`` override the internal Settings switches (parity suite, tests):
    on_step(block, step, logits), trace, step_trace (a dlm.runtime.trace.Trace:
    --trace), uniforms, kv_cache, suppress_mask, early_stop, stop_on_role_end,
    editing_threshold (None: 2.0 decoding);
    ``stop_ids`` replaces the stop-token set; ``watch(block_index, step, token_ids)``
    sees the block after every step (--verbose); ``prefix`` is a PrefixState kept
    across runs (chat); ``structured`` (a dlm.runtime.structured.Structured): the
    output follows its grammar; ``prefix_cache``: a
    dlm.runtime.generation.prefix_cache.PrefixCache shared across requests."""
    if hooks.pop("images", None):
        raise GenerationError("image input is not supported: LLaDA-2 is text-only")
    unknown = sorted(set(hooks) - set(_HOOKS) - set(_SESSION_HOOKS))
    if unknown:
        raise GenerationError(f"unknown LLaDA-2 generation hook(s): {', '.join(unknown)}")
    extra = {k: hooks.pop(k) for k in _SESSION_HOOKS if k in hooks}
    if hooks:
        settings = replace(settings, **hooks)
    session = BlockSession(loaded, list(prompt_ids), settings, cancel, stops=stop_ids, **extra)
    return run(session, loaded, session.prompt, cancel)


class BlockSession:
    """LLaDA-2's step for the shared loop (dlm.runtime.generation.progress): the prompt's
    full blocks into the cache, then one block per ``next_block``, denoised
    (2.0) or drafted and edited (2.1)."""

    block_name = "block"

    def __init__(self, loaded, prompt_ids, s: Settings, cancel: Optional[Callable[[], bool]] = None,
                 prefix: Optional[PrefixState] = None, watch: Optional[Callable] = None,
                 structured=None, stops: Optional[list[int]] = None, prefix_cache=None):
        """``structured``: a dlm.runtime.structured.Structured (the output follows its
        grammar); ``stops``: replaces the stop-token set (None: ``stop_ids``)."""
        self.model, self.s, self.cancel = loaded.model, s, cancel
        self.prefix, self.watch, self.cached_tokens = prefix, watch, 0
        self.store = shared_store(prefix_cache, prefix, self.model)  # a PrefixCache shared across requests
        self.frontier = None  # structured output: a dlm.runtime.structured.Frontier
        self.tracer: Optional[BlockTracer] = None  # --trace: the current block's
        self.skip_special_tokens = s.skip_special_tokens
        self.prompt = prompt_ids
        self.P, self.bl = len(prompt_ids), s.block_length
        vocab = loaded.args.vocab_size
        check_prompt(prompt_ids, loaded.args, s.max_tokens)
        if not 0 <= s.mask_token_id < vocab:
            raise GenerationError(f"mask token id {s.mask_token_id} is outside the vocabulary (size {vocab})")
        ctx = loaded.args.max_position_embeddings
        if self.bl > ctx:
            raise GenerationError(f"--block-length {self.bl} exceeds the model context of {ctx} tokens")
        self.budget = min(s.max_tokens, ctx - self.P)
        check_budget(self.memory_bytes(loaded.args), s.memory_budget,
                     "KV cache, block logits and attention scores",
                     "lower --max-tokens, --block-length or --prefill-step-size, or shorten the prompt")
        self.editing = s.editing_threshold
        if self.editing == "auto":
            self.editing = (EDITING_THRESHOLD_22 if loaded.args.block_routing
                            else EDITING_THRESHOLD_21 if is_llada21(loaded) else None)
        self.rules = self._rules(loaded.args) if loaded.args.block_routing else None
        # hub 2.0/2.1: min(steps, gen_length // minimal_topk); 2.2 spreads a block's masks over ``steps``
        self.steps = s.steps if self.rules else max(1, min(s.steps, s.max_tokens))
        self.quota = transfer_quota(self.bl, self.steps)
        self.uniforms = s.uniforms or UniformStream(s.seed)
        self.needs_uniforms = s.temperature > 0 or s.reference_sampling
        self.logit_bias = None
        if s.suppress_mask:
            self.logit_bias = mx.where(mx.arange(vocab) == s.mask_token_id, -mx.inf, 0.0)
        self.set_stops(stop_ids(loaded, s) if stops is None else stops)
        if structured is not None:  # the grammar's frontier over this run's blocks
            if s.step_trace is not None:
                raise GenerationError("--trace does not apply to structured output (response_format / "
                                      "--json-schema); trace the unconstrained run")
            self.frontier = structured.frontier(loaded.tokenizer, vocab, self.stop_ids, self.budget)
            if self.rules is not None:  # a constrained block never edits: DELETE/SPLIT would be text
                ids = mx.arange(vocab)
                bias = mx.where((ids == loaded.args.delete_token_id) | (ids == loaded.args.split_token_id),
                                -mx.inf, 0.0)
                self.logit_bias = bias if self.logit_bias is None else self.logit_bias + bias

    def _rules(self, args) -> Rules:
        """LLaDA2.2's decoding (levenshtein.py); what it does not implement is refused by name."""
        s = self.s
        refused = [name for name, on in (
            ("--temp > 0", s.temperature > 0), ("--top-k", bool(s.top_k)),
            ("--top-p", s.top_p is not None and s.top_p < 1), ("--reference-sampling", s.reference_sampling),
            ("--threshold-schedule linear", s.min_threshold is not None)) if on]
        if refused:
            raise GenerationError(f"{', '.join(refused)}: not implemented for LLaDA2.2, whose decoding dlm runs "
                                  "greedily (temperature 0, its generate() default)")
        if self.bl % args.block_size:
            raise GenerationError(f"--block-length {self.bl} is not a multiple of this LLaDA2.2 checkpoint's "
                                  f"routing block_size {args.block_size}")
        special = {s.mask_token_id: "MASK", args.delete_token_id: "DELETE", args.split_token_id: "SPLIT"}
        held = sorted({special[t] for t in self.prompt if t in special})
        if held:
            raise GenerationError(f"the prompt holds LLaDA2.2's {', '.join(held)} token: decoding tokens, not text")
        editing = float("inf") if self.editing is None else float(self.editing)  # None: no token edits
        return Rules(mask_id=s.mask_token_id, delete_id=args.delete_token_id, split_id=args.split_token_id,
                     steps=s.steps, threshold=s.threshold, editing_threshold=editing,
                     max_post_steps=s.max_post_steps, max_steps_per_block=s.max_steps_per_block)

    def memory_bytes(self, args) -> int:
        """Upper estimate: the KV cache at its capacity, a step's float32 block
        logits (with the sampler's sorted copies), and, on the CPU, the widest attention-score
        matrix (a prefill chunk or the [finished; active] window over the cache)."""
        bl = self.bl
        capacity = -(-(self.P + self.budget) // bl) * bl
        item = 4 if self.model.dtype == mx.float32 else 2
        kv = args.num_hidden_layers * capacity * args.num_key_value_heads * args.head_dim * 2 * item
        logits = 8 * bl * args.vocab_size * 4
        rows = max(min(self.s.prefill_step_size, self.P), 2 * bl)
        scores = 2 * args.num_attention_heads * rows * capacity * 4 if scores_materialized() else 0
        return kv + logits + scores

    def set_stops(self, ids) -> None:
        self.stops = self.stop_ids = frozenset(int(i) for i in ids)
        self.stop_arr = mx.array(sorted(self.stops), dtype=mx.int32) if self.stops else None

    # -- model calls -------------------------------------------------------

    def _prefill(self, upto: int) -> None:
        """The prompt's full blocks into the cache, a whole number of blocks per
        forward, after the whole blocks a kept PrefixState already holds."""
        if self.cache is None:
            return
        bl = self.bl
        chunk = max(bl, self.s.prefill_step_size // bl * bl)
        shared = None
        if self.store is not None:  # generation/prefix_cache.py: whole chunks, the same forwards
            bounds = [min(upto, a + chunk) for a in range(0, upto, chunk)]
            shared = Reuse(self.store, ("llada2_moe", bl), self.prompt, bounds, self.cache)
            start = self.cached_tokens = shared.start
        else:
            start = self._reuse(upto)
        for a in range(start, upto, chunk):
            b = min(upto, a + chunk)
            ids = mx.array(self.prompt[a:b], dtype=mx.int32)[None]
            logits = self.model(ids, self.cache, block_causal_mask(a, b - a, a, bl), last=1)
            mx.eval(logits, [(c.keys, c.values) for c in self.cache])
            for c in self.cache:
                c.commit(b - a)
            if shared is not None:
                shared.stored(a, b)

    def _reuse(self, upto: int) -> int:
        """Copy the kept cache's whole blocks that this prompt shares into the new
        cache (block attention makes them exact); returns where prefill starts."""
        state = self.prefix
        if state is None or state.cache is None:
            return 0
        old = state.cache
        keep = min(common_prefix(state.ids, self.prompt), old[0].offset, upto) // self.bl * self.bl
        if keep and old[0].keys is not None:
            for new, kept in zip(self.cache, old):
                new.adopt(kept, keep)
        self.cached_tokens = keep if old[0].keys is not None else 0
        return self.cached_tokens

    def _remember(self) -> None:
        if self.prefix is not None and self.cache is not None:
            self.prefix.cache, self.prefix.ids = self.cache, self.x[: self.cache[0].offset].tolist()

    def _trace(self, b: int, s: int, start: int, write, tok, block, conf=None, edit=None) -> None:
        if self.tracer is not None:
            self.tracer.step(s, write, tok, conf, block, edit)
        if self.watch is not None:  # the block as it stands (masks included)
            self.watch(b - self.first_block, s, block.tolist())
        if self.s.trace is not None:
            w = np.nonzero(np.array(write))[0]
            self.s.trace.append((b, s, [int(start + i) for i in w], np.array(tok)[w].tolist()))

    # -- the session -------------------------------------------------------

    def prefill(self) -> None:
        s, bl, P = self.s, self.bl, self.P
        self.limit = P + self.budget
        self.n_blocks = -(-self.limit // bl)
        self.next_index = self.first_block = P // bl  # the first block holding generated positions
        self.cache = self.model.make_cache(self.n_blocks * bl) if s.kv_cache else None
        self.pending = None
        self.x = np.full(self.n_blocks * bl, s.mask_token_id, dtype=np.int32)
        self.x[:P] = self.prompt
        self.committed = mx.array(self.x[: self.next_index * bl])
        self.deferred_prompt_tokens = P - self.next_index * bl  # the partial block's: its forwards compute them
        self._prefill(self.next_index * bl)
        self._remember()

    def next_block(self, remaining: int) -> Block:
        """One block, run alone (batch.Member: the same code batches run)."""
        from .batch import Member, run_alone

        return run_alone(Member(self), remaining)


Session = BlockSession
