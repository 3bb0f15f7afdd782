"""How much of a graph ``mx.async_eval`` leaves running when it returns (not a test).

dlm's denoising loops build step t+1 while step t evaluates (canvas.py,
each family's batch.py). That overlap needs ``async_eval`` to return before
the graph has run. On MLX's CPU backend it does not: every CPU op is a
scheduler task, and MLX's ``eval_impl`` waits while more than
``MAX_ACTIVE_TASKS`` (10, a compile-time constant in mlx/transforms.cpp) are
in flight, so ``async_eval`` returns when all but the last ~10 ops have run.
On Metal/CUDA a task is a command buffer of many ops, and it returns early.

    .venv/bin/python -m scripts.bench.probe_async_eval [--ops 400] [--size 64] [--device cpu|gpu]

Prints, for a chain of ``--ops`` small matmul+tanh ops, the ms until
``async_eval`` returned and until the result was ready (median of 5).
"""

from __future__ import annotations

import statistics
import time

from dlm.runtime.platform import blas  # noqa: F401  (the optimized BLAS ahead of MLX)

import mlx.core as mx  # noqa: E402  (isort: skip)

from scripts.bench import harness  # noqa: E402


def chain(x: mx.array, ops: int) -> mx.array:
    for _ in range(ops):
        x = mx.tanh(x @ x * 0.01)
    return x


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--ops", type=int, default=400)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--device", choices=("cpu", "gpu"), default=None)
    args = p.parse_args()
    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    x = mx.ones((args.size, args.size))
    mx.eval(x)
    returned, ready = [], []
    for _ in range(5):
        y = chain(x, args.ops)
        t = time.perf_counter()
        mx.async_eval(y)
        returned.append(time.perf_counter() - t)
        mx.eval(y)
        ready.append(time.perf_counter() - t)
    r, d = statistics.median(returned) * 1e3, statistics.median(ready) * 1e3
    print(f"{mx.default_device()}: {2 * args.ops} ops; async_eval returned after {r:.1f} ms, "
          f"the result was ready after {d:.1f} ms ({100 * r / d:.0f}% of the graph had run)")


if __name__ == "__main__":
    main()
