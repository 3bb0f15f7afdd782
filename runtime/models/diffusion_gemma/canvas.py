"""Denoise one DiffusionGemma canvas (transformers' ``DiffusionGemmaGenerationMixin._denoising_step``
loop), with the model call injected.

``denoise_canvas(decode, draws, length, config)`` runs up to N steps of:

    logits = decode(canvas, sc_probs)                  # [B, L, V] float32
    proc   = logits / T(cur_step)                      # linear schedule t_max -> t_min
    sample = categorical(proc / temp) (argmax: temp 0 or debug canvas)
    entropy-bound: canvas = where(accept, sample, fresh uniform noise)
    confidence-threshold: revealed positions keep their token; newly revealed
        ones take the sample; the rest get fresh uniform noise
    stop when stable-and-confident (and, for confidence-threshold, all revealed)
    sc_probs = softmax_f32(proc cast to the embedding dtype)

and returns the argmax canvas of the last step (what the reference commits).
The work over the vocabulary (scores, the draw, the self-conditioning softmax)
shares one exponential per entry (scores.py). Work stays lazy; the only host
sync per step is the scalar stop decision.

The loop is one generator per canvas (``Canvas.run``), which yields the step
to build (``Next``) and what to read on the host (``Sync``): ``drive`` runs it
alone (denoise_canvas, generate.py), batch.Batch runs many in shared forwards,
and under a grammar (structured.Grammar) it pins the frozen prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from . import sampling as S
from . import scores as V
from .options import DEFAULTS as D
from .trace import summarise_step


@dataclass
class DenoiseConfig:
    steps: int = D["max_denoising_steps"]
    sampler: str = D["diffusion_sampler"]
    entropy_bound: float = 0.1
    threshold: float = D["diffusion_threshold"]  # confidence-threshold sampler
    t_min: Optional[float] = 0.4  # None (either): no temperature schedule
    t_max: Optional[float] = 0.8
    stability_threshold: Optional[int] = 1  # None (either): no adaptive stop
    confidence_threshold: Optional[float] = 0.005
    temperature: float = D["temp"]  # denoiser sampling temperature on top of the schedule; 0 = argmax
    sc_dtype: mx.Dtype = mx.float32  # self-conditioning logits are cast to the embedding dtype (then softmax_f32)


@dataclass
class CanvasResult:
    tokens: mx.array  # [B, L] argmax canvas of the last step
    steps: int
    stopped_early: bool
    cancelled: bool = False


class RandomDraws:
    """Seeded draws: every call takes a fresh key split from one root key."""

    def __init__(self, vocab: int, seed: int):
        self.vocab = vocab
        self.key = mx.random.key(seed)

    def _key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def state(self):
        return self.key

    def restore(self, state) -> None:
        self.key = state

    def canvas(self, shape: tuple[int, ...]) -> mx.array:
        return mx.random.randint(0, self.vocab, shape, dtype=mx.int32, key=self._key())

    def uniforms(self, shape: tuple[int, ...], temperature: float) -> Optional[mx.array]:
        """The uniforms of a draw at ``temperature`` (one per position); None: the draw is the argmax."""
        return None if temperature == 0 else mx.random.uniform(shape=shape, key=self._key())

    def sample(self, scores: V.Scores, temperature: float) -> mx.array:
        """A draw from softmax(proc / temperature) per position (one uniform each:
        scores.sample); temperature 0: the argmax."""
        return _draw(scores, temperature, self.uniforms(scores.argmax.shape, temperature))


class DebugDraws:
    """Debug-canvas mode (patterns as lablup/mlxcel's ``debug_canvas_pattern``):
    the n-th uniform draw of a generate call is the fixed pattern n, and sampling is argmax. Draws are counted in
    transformers' order: canvas init, then one renoise draw every step
    (including the last and the one that stops early)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.n = 0

    def state(self):
        return self.n

    def restore(self, state) -> None:
        self.n = state

    def canvas(self, shape: tuple[int, ...]) -> mx.array:
        pattern = S.debug_canvas_pattern(self.n, shape[-1], self.vocab)
        self.n += 1
        return mx.broadcast_to(pattern, shape)

    def uniforms(self, shape: tuple[int, ...], temperature: float) -> None:
        return None

    def sample(self, scores: V.Scores, temperature: float) -> mx.array:
        return scores.argmax


def _draw(scores: V.Scores, temperature: float, u: Optional[mx.array]) -> mx.array:
    return scores.argmax if u is None else V.sample(scores, temperature, u)


@mx.compile
def _entropy_bound_step(entropy, sample, noise, bound):
    accept = S.entropy_bound_accept(entropy, bound)
    return mx.where(accept, sample, noise), accept


@mx.compile
def _confidence_step(top1, canvas, revealed, sample, noise, threshold):
    new = S.confidence_accept(top1, revealed, threshold)
    canvas = mx.where(revealed, canvas, mx.where(new, sample, noise))
    return canvas, revealed | new


@mx.compile
def _stable_confident(argmax, history, entropy, threshold):
    return S.stable(argmax, history, len(history)) & S.confident(entropy, threshold)


def _stable_and_confident(argmax, history, entropy, config: "DenoiseConfig") -> Optional[mx.array]:
    """The stop flag per canvas ([B]), or None when the history is too short to be
    stable (no host sync needed)."""
    window = config.stability_threshold
    if window and len(history) < window:
        return None
    return _stable_confident(argmax, history[-window:] if window else [], entropy,
                             config.confidence_threshold)


Decode = Callable[[mx.array, Optional[mx.array]], mx.array]
StepHook = Callable[[int, mx.array, mx.array], None]


@dataclass
class _Step:
    logits: mx.array
    argmax: mx.array
    canvas: mx.array  # the next step's input
    revealed: mx.array
    sc_probs: mx.array  # the next step's self-conditioning input, softmax_f32 (scores.py)
    stop: Optional[mx.array]  # None: cannot stop after this step
    keep: mx.array  # positions the sampler kept this step (accepted / revealed)
    summary: Optional[dict] = None  # --trace only (trace.summarise_step)

    def outputs(self, last: bool = False) -> list[mx.array]:
        """What to evaluate: the last step of a canvas only needs its argmax (the commit)."""
        if last:
            return [self.argmax]
        out = [self.canvas, self.sc_probs, self.argmax, self.revealed]
        return out if self.stop is None else out + [self.stop]


def _build_step(decode, draws, config: DenoiseConfig, canvas, sc_probs, revealed, history,
                cur_step: int, summarise: bool = False) -> _Step:
    """The lazy graph of one denoising step (nothing is evaluated here);
    ``summarise``: also its per-position summary (--trace, trace.py)."""
    return build_steps(decode(canvas, sc_probs), [(draws, history)], config, canvas, revealed, cur_step,
                       summarise)[0]


def build_steps(logits, members, config: DenoiseConfig, canvas, revealed, cur_step: int | list[int],
                summarise: bool = False) -> list[_Step]:
    """The step around ``logits`` [B, L, V] of B canvases that share ``config``
    (batched generation merges the requests that do): ``members`` is one (draws,
    history) per canvas (row), ``canvas`` / ``revealed`` [B, L], ``cur_step`` the
    step of the schedule, one for all or one per canvas (then only the
    temperature differs, a divisor per row). Every op runs row by row and each
    canvas draws from its own draws in its own order, so a canvas gets the very
    step it gets alone; returns one _Step per canvas."""
    revealed_in = revealed
    t = _temperature(config, cur_step)
    scores = V.score(logits, t)
    proc, argmax, entropy = scores.proc, scores.argmax, scores.entropy
    row = canvas.shape if len(members) == 1 else (1,) + canvas.shape[1:]  # one member's rows
    uniforms, noises = [], []
    for draws, _ in members:  # each canvas's draws in the order it takes them alone
        uniforms.append(draws.uniforms(row, config.temperature))
        noises.append(draws.canvas(row))  # drawn every step, as the reference does
    sample = _draw(scores, config.temperature, None if uniforms[0] is None else _rows(uniforms))
    noise = _rows(noises)
    history = [_rows([h[k] for _, h in members]) for k in range(len(members[0][1]))]
    if config.sampler == S.CONFIDENCE_THRESHOLD:
        canvas, revealed = _confidence_step(scores.top1, canvas, revealed, sample, noise, config.threshold)
        keep = revealed
    else:
        canvas, keep = _entropy_bound_step(entropy, sample, noise, config.entropy_bound)
    stop = done = None
    if config.stability_threshold is not None and config.confidence_threshold is not None:
        stop = _stable_and_confident(argmax, history, entropy, config)
    settled = stop
    if config.sampler == S.CONFIDENCE_THRESHOLD:
        done = mx.all(revealed, axis=-1)
        stop = done if stop is None else stop | done
    if config.sc_dtype == mx.float32:
        sc = scores.probs
    else:  # the softmax of the logits as the decoder's dtype holds them (transformers' self-conditioning)
        sc = mx.softmax(proc.astype(config.sc_dtype).astype(mx.float32), axis=-1)
    if len(members) == 1:
        step = _Step(logits, argmax, canvas, revealed, sc, _all(stop), keep)
        if summarise:
            step.summary = summarise_step(config, t, argmax, proc, entropy, canvas, revealed_in, revealed,
                                          _all(settled), _all(done))
        return [step]
    return [_Step(logits[i : i + 1], argmax[i : i + 1], canvas[i : i + 1], revealed[i : i + 1], sc[i : i + 1],
                  _flag(stop, i), keep[i : i + 1]) for i in range(len(members))]


def _temperature(config: DenoiseConfig, cur_step: int | list[int]) -> mx.array:
    """The schedule's temperature at ``cur_step``: a scalar, or [B, 1, 1] for
    canvases at different steps (x / 1.0 == x without a schedule)."""
    if config.t_min is None or config.t_max is None:
        return mx.array(1.0, dtype=mx.float32)
    steps = cur_step if isinstance(cur_step, list) else [cur_step]
    temps = [S.linear_temperature(c, config.steps, config.t_min, config.t_max) for c in steps]
    if len(set(temps)) == 1:
        return mx.array(temps[0], dtype=mx.float32)
    return mx.array(np.array(temps, dtype=np.float32).reshape(-1, 1, 1))


def _rows(arrays: list[mx.array]) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)


def _flag(flags: Optional[mx.array], i: int) -> Optional[mx.array]:
    """Canvas ``i``'s stop flag (a scalar) of the per-canvas flags."""
    if flags is None or flags.ndim == 0:
        return flags
    return flags[i]


def _all(flags: Optional[mx.array]) -> Optional[mx.array]:
    """One member's flag over all its canvases (a scalar)."""
    if flags is None or flags.ndim == 0:
        return flags
    return flags[0] if flags.shape[0] == 1 else mx.all(flags)


@dataclass
class Next:
    """The step to build from ``canvas`` / ``sc_probs`` / ``revealed`` at
    ``cur_step`` of the schedule. ``stop``: the stop flag of the step that ran
    (None: nothing to read); when it is set the driver builds nothing (or
    rewinds the draws of what it built) and answers None, else the step, launched."""

    canvas: mx.array
    sc_probs: Optional[mx.array]
    revealed: mx.array
    cur_step: int
    stop: Optional[mx.array] = None


@dataclass
class Sync:
    """Arrays the canvas reads on the host next (evaluated by the driver; answered None)."""

    values: list


class Canvas:
    """One canvas's denoising loop as a generator (``run``): it yields a ``Next``
    per step and a ``Sync`` where it reads on the host, and returns its
    CanvasResult (the grammar's StructuredCanvas under one). ``drive`` runs it alone, batch.Batch with the
    batch's other canvases, and a ``grammar`` (structured.Grammar) shapes it."""

    def __init__(self, draws, shape: tuple[int, int], config: DenoiseConfig, *,
                 cancel: Optional[Callable[[], bool]] = None, on_step: Optional[StepHook] = None,
                 on_summary: Optional[Callable[[int, dict], None]] = None, grammar=None):
        self.draws, self.shape, self.config, self.grammar = draws, shape, config, grammar
        self.cancel, self.on_step, self.on_summary = cancel, on_step, on_summary
        self.summarise = on_summary is not None  # the driver builds each step's summary (--trace)
        self.history: list[mx.array] = []  # the last steps' argmax (the stability window)

    def run(self):
        return self._shaped() if self.grammar is not None else self._plain()

    def _cancelled(self) -> bool:
        return self.cancel is not None and self.cancel()

    def _remember(self, argmax: mx.array) -> None:
        window = self.config.stability_threshold or 0
        if window:
            self.history = (self.history + [argmax])[-window:]

    def _plain(self):
        if self._cancelled():
            return CanvasResult(mx.zeros(self.shape, dtype=mx.int32), 0, False, cancelled=True)
        step = yield Next(self.draws.canvas(self.shape), None, mx.zeros(self.shape, dtype=mx.bool_),
                          self.config.steps)
        steps = 0
        for cur_step in range(self.config.steps, 0, -1):
            steps += 1
            if self.on_step is not None:
                self.on_step(steps - 1, step.logits, step.argmax)
            if self.summarise:
                self.on_summary(steps - 1, step.summary)
            self._remember(step.argmax)
            if cur_step == 1:
                break
            if self._cancelled():
                return CanvasResult(step.argmax, steps, False, cancelled=True)
            following = yield Next(step.canvas, step.sc_probs, step.revealed, cur_step - 1, step.stop)
            if following is None:  # the step that ran said stop
                return CanvasResult(step.argmax, steps, True)
            step = following
        return CanvasResult(step.argmax, steps, False)

    def _shaped(self):
        """Under a grammar: each step's input has its frozen prefix pinned, and
        each step is read on the host before the next is built."""
        grammar = self.grammar
        grammar.begin(self.shape[-1])
        canvas, sc_probs, revealed = self.draws.canvas(self.shape), None, mx.zeros(self.shape, dtype=mx.bool_)
        steps = 0
        for cur_step in range(self.config.steps, 0, -1):
            if grammar.complete:
                break
            if self._cancelled():
                return grammar.result(steps, cancelled=True)
            step = yield Next(grammar.pin(canvas), sc_probs, revealed, cur_step)
            yield Sync(step.outputs() + [step.keep])
            steps += 1
            self._remember(step.argmax)
            grammar.advance(step, cur_step, steps - 1)
            canvas, sc_probs, revealed = step.canvas, step.sc_probs, step.revealed
        return grammar.result(steps)


def drive(canvas: Canvas, decode: Decode, speculate: bool = True):
    """Run a Canvas alone: every Next is built (``decode`` is its model call) and
    launched, every Sync one evaluation; returns what the canvas returns."""
    gen, answer = canvas.run(), None
    while True:
        try:
            request = gen.send(answer)
        except StopIteration as end:
            return end.value
        if isinstance(request, Sync):
            mx.eval(*request.values)
            answer = None
        else:
            answer = _next_alone(canvas, decode, request, speculate)


def _next_alone(canvas: Canvas, decode: Decode, request: Next, speculate: bool) -> Optional[_Step]:
    """Pipelined (see denoise_canvas): the next step is built before the stop
    flag is read, and its draws rewound if the canvas stopped."""
    stop = request.stop
    if not speculate and stop is not None and stop.item():
        return None
    mark = canvas.draws.state()
    step = _build_step(decode, canvas.draws, canvas.config, request.canvas, request.sc_probs, request.revealed,
                       canvas.history, request.cur_step, canvas.summarise)
    if speculate and stop is not None and stop.item():  # the one host sync of a step
        canvas.draws.restore(mark)  # the step that did not run drew nothing
        return None
    mx.async_eval(*step.outputs(last=request.cur_step == 1))
    return step


def denoise_canvas(
    decode: Decode,
    draws,
    length: int,
    config: DenoiseConfig,
    *,
    batch: int = 1,
    cancel: Optional[Callable[[], bool]] = None,
    on_step: Optional[StepHook] = None,
    on_summary: Optional[Callable[[int, dict], None]] = None,
    speculate: bool = True,
) -> CanvasResult:
    """Run the denoising loop for one canvas of ``length`` positions (a Canvas, driven alone).

    ``on_step(step_index, logits, argmax)`` (optional) sees every step's raw
    float32 logits [B, L, V] and argmax [B, L] (parity traces);
    ``on_summary(step_index, summary)`` (optional, --trace) its per-position
    summary (trace.summarise_step); without it no summary is built.

    Pipelined: step t runs (async_eval) while the host builds step t+1's graph;
    step t+1 is evaluated only once step t's stop flag (the one host sync) says
    to go on, so an early stop wastes no compute and no random draws. (The
    overlap is for Metal/CUDA, whose tasks are command buffers of many ops. On
    MLX's CPU backend async_eval returns only when all but the last ~10 ops of
    the step have run, scripts/bench/probe_async_eval.py, so there the build follows
    the evaluation; kept, as it costs only a discarded build when a canvas stops
    early.) ``speculate=False`` (a step whose build reads on the host and so
    computes: Model.speculates) reads the stop flag first and then builds.
    """
    canvas = Canvas(draws, (batch, length), config, cancel=cancel, on_step=on_step, on_summary=on_summary)
    return drive(canvas, decode, speculate)
