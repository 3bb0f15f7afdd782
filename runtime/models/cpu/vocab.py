"""Full-vocabulary row math on MLX's CPU backend, through numpy's vector loops.

MLX's CPU backend computes ``exp`` and ``tanh`` one entry at a time (on Linux
x86 its ``simd::exp<float, 1>``, a scalar polynomial calling libm's ``fmaf``:
14-31 ns an entry on one thread here), while numpy's AVX2/AVX-512 loops take
1-2 ns. At the released DiffusionGemma geometry a denoising step runs two such
passes over [256, 262144] entries, the softcap and the scores (scores.py):
~2.4 s of an 8.5 s float32 step (README, "Where dlm's float32 step goes");
LLaDA-2's sampler makes one over each block's [32, 157184] logits.

So on the CPU backend, for arrays of at least ``MIN_ENTRIES`` entries, these
functions evaluate their input, run numpy over row pieces on a thread pool (one
thread per core; numpy releases the GIL inside its loops) and hand back MLX
arrays. ``python -m scripts.bench.vocab`` measures both paths side by side.

Exactness: every row is computed on its own (elementwise loops, and reductions
and argmax along each row), so a row gets the same bits in any batch and any
piece split (tests/test_cpu_vocab.py); against MLX's path the values differ in
the last bits of ``exp``/``tanh``, as either differs from torch's; the argmax
is the same up to ties. Off on Metal/CUDA, below ``MIN_ENTRIES`` (a small step
stays one lazy MLX graph: there the numpy path's host sync and copies back
cost more than it saves; forced on the tiny DiffusionGemma, a step of one
request took 28.6 vs 20.7 ms and of four 52.1 vs 38.1 ms, ``DLM_CPU_VOCAB=
numpy|mlx python -m scripts.bench.batch --tiny --steps-only --sizes 1,4``) and
with ``DLM_CPU_VOCAB=mlx``; ``DLM_CPU_VOCAB=numpy`` takes it at every size
(tests).
A step that takes it reads its logits on the host, so the generation loops
build the next step only after the stop flag says to go on (``speculates``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ...platform import settings
from .streams import cores

# Entries from which numpy pays for the host sync and the copies back: at 16
# positions of a 262144 vocabulary (or 256 of 16384) a pass is ~60 ms in MLX.
MIN_ENTRIES = 1 << 22
PIECE_BYTES = 32 << 20  # rows per task: its temporaries stay this small
_F32_MIN = np.float32(np.finfo(np.float32).min)
_pool: Optional[tuple[ThreadPoolExecutor, int]] = None


def _mode() -> str:
    return settings.CPU_VOCAB.get()


def takes(entries: int) -> bool:
    """Whether an array of ``entries`` goes through numpy: the CPU backend, at size."""
    mode = _mode()
    if mode == "mlx" or mx.default_device() != mx.cpu:
        return False
    return mode == "numpy" or entries >= MIN_ENTRIES


def wanted(x: mx.array) -> bool:
    """Whether ``x``'s rows go through numpy: ``takes`` one sequence's size
    (``x`` [B, L, V]: one of B; [L, V]: all), so a batch takes the path each of
    its sequences takes alone, and gets the same bits."""
    return takes(x[0].size if x.ndim > 2 else x.size)


def _threads() -> tuple[ThreadPoolExecutor, int]:
    """The thread pool (one thread per core, or ``DLM_CPU_STREAMS``) and its size."""
    global _pool
    if _pool is None:
        n = cores()
        _pool = (ThreadPoolExecutor(max_workers=n, thread_name_prefix="dlm-vocab"), n)
    return _pool


def _host(x: mx.array) -> np.ndarray:
    """``x`` as float32 rows [N, V] in host memory (evaluated; no copy when it is contiguous)."""
    x = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    mx.eval(x)
    return np.ascontiguousarray(np.asarray(x))


def _over_rows(task: Callable[[slice], None], rows: int, vocab: int) -> None:
    """``task(rows slice)`` over pieces of at most PIECE_BYTES (and at least one
    per thread), on the thread pool."""
    pool, threads = _threads()
    step = max(1, min(PIECE_BYTES // (4 * max(vocab, 1)), -(-rows // threads)))
    pieces = [slice(a, min(a + step, rows)) for a in range(0, rows, step)]
    if len(pieces) == 1:
        task(pieces[0])
        return
    for f in [pool.submit(task, p) for p in pieces]:
        f.result()


def softcap(x: mx.array, cap: float) -> mx.array:
    """float32 ``tanh(x / cap) * cap`` (the model's softcap)."""
    a = _host(x)
    out = np.empty_like(a)
    c = np.float32(cap)

    def task(r: slice) -> None:
        o = out[r]
        np.divide(a[r], c, out=o)
        np.tanh(o, out=o)
        np.multiply(o, c, out=o)

    _over_rows(task, *a.shape)
    return mx.array(out).reshape(x.shape)


def score_rows(logits: mx.array, t) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """scores.py's pass over float32 ``logits`` [N, V] at temperature ``t`` (a
    float, or one per row [N, 1]): (argmax [N] int32, entropy [N], softmax [N, V],
    Σ exp [N, 1]), with the same formulas (z = proc - max, clamped at float32's
    lowest so -inf weighs 0)."""
    a = _host(logits)
    rows, vocab = a.shape
    probs = np.empty_like(a)
    argmax = np.empty(rows, dtype=np.int32)
    entropy = np.empty(rows, dtype=np.float32)
    total = np.empty(rows, dtype=np.float32)
    temp = np.float32(t) if np.ndim(t) == 0 else np.asarray(t, dtype=np.float32).reshape(rows, 1)

    def task(r: slice) -> None:
        z = np.divide(a[r], temp if temp.ndim == 0 else temp[r])
        top = z.argmax(axis=-1)
        argmax[r] = top
        z -= z[np.arange(len(top)), top][:, None]
        np.maximum(z, _F32_MIN, out=z)
        e = np.exp(z, out=probs[r])
        s = e.sum(axis=-1)
        np.multiply(e, z, out=z)
        entropy[r] = np.log(s) - z.sum(axis=-1) / s
        total[r] = s
        e /= s[:, None]

    _over_rows(task, rows, vocab)
    return mx.array(argmax), mx.array(entropy), mx.array(probs), mx.array(total)[:, None]


def sample_rows(logits: mx.array, temperature: float, uniforms=None) -> tuple[mx.array, mx.array]:
    """LLaDA-2's sampler (llada2_moe/sampling.py ``sample``, without top-k/top-p)
    over float32 ``logits`` [N, V]: with ``uniforms`` None the argmax and its
    probability (uint32, float32); else softmax(logits / temperature) (as is for
    a temperature of 0 or 1), the first index whose running sum passes u · Σ, and
    its probability (int32, float32)."""
    a = _host(logits)
    rows, vocab = a.shape
    u = None if uniforms is None else np.asarray(uniforms, dtype=np.float32).reshape(rows)
    tok = np.empty(rows, dtype=np.uint32 if u is None else np.int32)
    conf = np.empty(rows, dtype=np.float32)
    temp = np.float32(temperature)

    def task(r: slice) -> None:
        z = np.divide(a[r], temp) if u is not None and temperature > 0 and temperature != 1 else a[r].copy()
        best = z.argmax(axis=-1)
        z -= z[np.arange(len(best)), best][:, None]
        e = np.exp(z, out=z)
        s = e.sum(axis=-1)
        if u is None:  # greedy: p(argmax) = exp(max - logsumexp) = 1 / Σ exp(x - max)
            tok[r] = best
            conf[r] = np.float32(1) / s
            return
        e /= s[:, None]
        cdf = np.cumsum(e, axis=-1)
        for i, row in enumerate(range(r.start, r.stop)):  # cdf is non-decreasing: count(cdf <= target)
            k = min(int(np.searchsorted(cdf[i], u[row] * cdf[i, -1], side="right")), vocab - 1)
            tok[row], conf[row] = k, e[i, k]

    _over_rows(task, rows, vocab)
    return mx.array(tok), mx.array(conf)
