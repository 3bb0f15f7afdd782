"""The token-level automaton: llguidance over the model's own tokenizer.

``Constraint`` is one run's grammar state over the tokens committed so far:
which tokens may come next (``mask``), whether one may (``allows``), what the
grammar forces (``forced``: the schema's fixed skeleton, no model needed), and
whether the output may end (``accepting``) or must (``done``). JSON is compact
(no free whitespace), so a schema's keys, quotes and separators are forced.

The llguidance tokenizer is built once per loaded tokenizer. Tokenizers
llguidance reads natively (byte-level BPE, SentencePiece-style, Gemma's) go
through ``llguidance.hf``; any other one (the character-level test models) is
described to it token by token: each id's decoded bytes, special tokens
marked as such, so a grammar never produces them.
"""

from __future__ import annotations

import copy
import json
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterable, Optional

import numpy as np

from .formats import ResponseFormat, StructuredError

# Compact JSON: every separator fixed, so keys and punctuation are forced tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# What a run short of budget writes (frontier.py) so that any model, even an
# untrained one, finishes: end the string, close the innermost container, go to
# the next required member, or start the shortest value.
STRING_CLOSERS = ('"',)
CONTAINER_CLOSERS = {"{": ("}", ","), "[": ("]", ",")}
VALUE_STARTS = ("0", '"', "false", "null", "[", "{")
CLOSERS = tuple(dict.fromkeys(STRING_CLOSERS + ("}", "]", ",") + VALUE_STARTS))


class JsonCursor:
    """Where committed JSON text stands: inside a string or not, and the open
    containers (enough to choose a closing token; the grammar checks the rest)."""

    def __init__(self):
        self.in_string = self.escape = False
        self.stack: list[str] = []

    def feed(self, data: bytes) -> None:
        for ch in data.decode("utf-8", errors="ignore"):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.stack.append(ch)
            elif ch in "}]" and self.stack:
                self.stack.pop()

    def preferences(self) -> tuple[str, ...]:
        if self.in_string:
            return STRING_CLOSERS
        closers = CONTAINER_CLOSERS.get(self.stack[-1], ()) if self.stack else ()
        return closers + VALUE_STARTS

# The engine's own resource limits are its defaults, except that an error stays
# short: no parser state or grammar dump in a message a client gets.
MAX_ERROR_CHARS = 300
# A grammar is compiled in a thread of its own (never the event loop, never
# under a lock other requests need), at most COMPILE_THREADS at once; a
# compile that outlasts COMPILE_SECONDS is refused (the schema limits,
# limits.py, keep real ones far below it).
COMPILE_SECONDS = 10.0
COMPILE_THREADS = 2
_compile_slots = threading.BoundedSemaphore(COMPILE_THREADS)


def engine_limits():
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def short(message: str) -> str:
    """An engine message on one line, cut to MAX_ERROR_CHARS."""
    line = " ".join(str(message).split())
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS] + "..."


_lock = threading.Lock()
_tokenizers: dict[int, tuple[object, object]] = {}  # id(hf tokenizer) -> (it, LLTokenizer)


class _ByteTable:
    """llguidance's TokenizerWrapper protocol for a tokenizer it cannot parse:
    the bytes of every id, the special ids, and encode()."""

    def __init__(self, tokenizer, eos_id: int):
        special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(token, "special", False):
                special.add(int(tokenizer.convert_tokens_to_ids(token.content)))
        n = len(tokenizer)
        self.tokens = []
        for i in range(n):
            if i in special:
                self.tokens.append(b"\xff" + str(tokenizer.convert_ids_to_tokens(i)).encode("utf-8"))
            else:
                self.tokens.append(tokenizer.decode([i]).encode("utf-8"))
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="ignore")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def ll_tokenizer(tokenizer, vocab: int, eos_id: int):
    """The llguidance tokenizer of ``tokenizer`` (built once, ~1 s for a large vocabulary)."""
    import llguidance
    import llguidance.hf

    with _lock:
        hit = _tokenizers.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        try:
            ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos_id)
        except (ValueError, TypeError):
            table = _ByteTable(tokenizer, eos_id)
            ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), n_vocab=vocab, eos_token=eos_id)
        _tokenizers[id(tokenizer)] = (tokenizer, ll)
        return ll


def compile_grammar(fmt: ResponseFormat) -> str:
    """The llguidance grammar of a response format (StructuredError naming the field)."""
    import llguidance

    if fmt.lark is not None:
        return llguidance.LLMatcher.grammar_from_lark(fmt.lark)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(fmt.schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise StructuredError(f"'{fmt.where}': {short(exc)}", fmt.where) from None


def check_grammar(grammar: str, ll, where: str) -> None:
    import llguidance

    message = llguidance.LLMatcher.validate_grammar(grammar, ll, limits=engine_limits())
    if message:
        param = _schema_param(where)
        raise StructuredError(f"'{param}' cannot be used: {short(message)}", param)


def _schema_param(where: str) -> str:
    """The request field a grammar error names: the schema itself for a response_format."""
    return where if where != "response_format" else "response_format.json_schema.schema"


def check_format(fmt: ResponseFormat, ll=None) -> None:
    """Compile ``fmt`` and build its matcher over ``ll`` (an llguidance
    tokenizer; None: the grammar alone), or StructuredError naming the field."""
    import llguidance

    grammar = compile_grammar(fmt)
    check_grammar(grammar, ll, fmt.where)
    if ll is not None:
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0, limits=engine_limits())
        if matcher.is_error():
            param = _schema_param(fmt.where)
            raise StructuredError(f"'{param}' cannot be used: {short(matcher.get_error())}", param)


def start_compile(work: Callable[[], object]) -> Future:
    """Run ``work`` (grammar compiling) in a daemon thread of its own, at most
    COMPILE_THREADS at once; the Future is cancelled harmlessly while it waits."""
    future: Future = Future()

    def body() -> None:
        with _compile_slots:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(work())
            except BaseException as exc:  # handed to the waiter
                future.set_exception(exc)

    threading.Thread(target=body, name="dlm-grammar", daemon=True).start()
    return future


def too_slow(where: str, seconds: Optional[float] = None) -> StructuredError:
    seconds = COMPILE_SECONDS if seconds is None else seconds
    return StructuredError(f"'{where}': the grammar engine took over {seconds:g} s to compile it "
                           f"(limit {seconds:g} s); simplify the schema", where)


def compile_bounded(work: Callable[[], object], where: str, seconds: Optional[float] = None):
    """``work``'s result, run by start_compile, or StructuredError after ``seconds``
    (default COMPILE_SECONDS)."""
    seconds = COMPILE_SECONDS if seconds is None else seconds
    future = start_compile(work)
    try:
        return future.result(timeout=seconds)
    except FutureTimeout:
        future.cancel()
        raise too_slow(where, seconds) from None


class Constraint:
    """One run's grammar state (see the module docstring). ``stop_ids``: the
    tokens that end the output; they are allowed exactly when the grammar accepts."""

    def __init__(self, ll, grammar: str, vocab: int, stop_ids: Iterable[int], where: str = "response_format",
                 closers: Optional[dict[str, int]] = None):
        import llguidance

        self.vocab, self.ll = vocab, ll
        self.closers = {k: int(t) for k, t in (closers or {}).items() if 0 <= int(t) < vocab}
        self.cursor = JsonCursor()
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.matcher = llguidance.LLMatcher(ll, grammar, log_level=0, limits=engine_limits())
        if self.matcher.is_error():
            raise StructuredError(f"'{where}' cannot be used: {short(self.matcher.get_error())}", where)
        self.committed: list[int] = []

    @property
    def accepting(self) -> bool:
        """The tokens so far are a complete answer (the output may end here)."""
        return self.matcher.is_accepting()

    @property
    def done(self) -> bool:
        """The grammar takes nothing more: the output must end here."""
        return self.matcher.is_stopped()

    def allows(self, token: int) -> bool:
        if token in self.stop_ids:
            return self.accepting
        return self.matcher.validate_tokens([int(token)]) == 1

    def mask(self) -> np.ndarray:
        """bool [vocab]: the tokens that may come next (the stop tokens when accepting)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        if allowed.shape[0] < self.vocab:
            allowed = np.concatenate([allowed, np.zeros(self.vocab - allowed.shape[0], dtype=bool)])
        stops = [t for t in self.stop_ids if t < self.vocab]
        allowed[stops] = self.accepting
        return allowed

    def closing(self, allowed: np.ndarray) -> Optional[int]:
        """The allowed token that brings the answer nearest its end (a stop
        token once it is complete), or None when no closer fits."""
        if self.accepting:
            return min(self.stop_ids) if self.stop_ids else None
        for text in self.cursor.preferences():
            token = self.closers.get(text)
            if token is not None and allowed[token]:
                return token
        return None

    def closing_cost(self, limit: int) -> int:
        """How many tokens closing the answer from here takes (the stop token not
        counted), simulated on a copy with ``closing``'s choices; more than
        ``limit`` means at least that many."""
        clone = copy.copy(self)
        clone.matcher, clone.cursor, clone.committed = self.matcher.deep_copy(), copy.deepcopy(self.cursor), []
        n = 0
        while n <= limit and not clone.accepting:
            forced = clone.forced()
            if forced:
                n += len(forced)
                continue
            allowed = clone.mask()
            token = clone.closing(allowed)
            if token is None:  # no closer fits (a minLength string...): any allowed token
                allowed[list(clone.stop_ids)] = False
                if not allowed.any():
                    return limit + 1
                token = int(np.argmax(allowed))
            clone.consume(token)
            n += 1
        return n

    def forced(self, limit: Optional[int] = None) -> list[int]:
        """Consume and return the tokens the grammar forces next (at most ``limit``)."""
        tokens = [int(t) for t in self.matcher.compute_ff_tokens()]
        if limit is not None:
            tokens = tokens[:max(limit, 0)]
        for t in tokens:
            self.consume(t)
        return tokens

    def consume(self, token: int) -> None:
        token = int(token)
        if not self.matcher.consume_token(token):
            raise StructuredError(f"internal: token {token} does not fit the grammar: {short(self.matcher.get_error())}")
        self.committed.append(token)
        self.cursor.feed(self.ll.decode_bytes([token]))


def build_constraint(fmt: ResponseFormat, tokenizer, vocab: int, stop_ids: Iterable[int]) -> Constraint:
    """A fresh Constraint for one run (the grammar is checked; a bad schema names the field)."""
    stops = sorted(set(int(t) for t in stop_ids))
    if tokenizer is None:
        raise StructuredError("structured output needs the model's tokenizer (none is loaded)")
    ll = ll_tokenizer(tokenizer, vocab, stops[0] if stops else 0)
    grammar = compile_grammar(fmt)
    check_grammar(grammar, ll, fmt.where)
    return Constraint(ll, grammar, vocab, stops, fmt.where, closer_ids(tokenizer))


def closer_ids(tokenizer) -> dict[str, int]:
    """CLOSERS that are single tokens of ``tokenizer``: text -> id."""
    out = {}
    for text in CLOSERS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            out[text] = int(ids[0])
    return out
