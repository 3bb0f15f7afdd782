"""What the benchmarks share: timing, variants run side by side, the mlx-vlm peer.

* Timing. ``timed(fn)`` / ``seconds(fn)``: one call, its result evaluated
  (``mx.eval``: MLX is lazy, a call that only builds a graph times nothing);
  ``repeat(fn, n, warmup=1)``: untimed warm-up calls, then ``n`` timed ones;
  ``median_seconds``; ``spread`` / ``spread_text``: the median and the range.
  ``peak_bytes(fn)``: the MLX memory a call holds at its peak; ``child_peak(cmd)``:
  a command's wall time and peak RSS, in a process of its own.
* Interleaving. ``interleave(variants, rounds)`` runs A, B, A, B, ... (a shared
  machine drifts over minutes; runs seconds apart share most of the drift),
  ``warmup`` rounds first and dropped, ``alternate`` to reverse every other
  round (``run=returned`` for variants that measure themselves); ``paired(a, b)``:
  each round's ratio, its median and range.
* The peer. mlx-vlm, the tool the benchmarks compare with, is installed outside
  the environment (``pip install --no-deps --target .peer mlx-vlm==0.7.10 ...``,
  and for its server mlx-audio and cryptography: docs/benchmarks.md) so dlm's own
  dependencies stay as pinned: ``load_mlx_vlm(peer_dir)`` and ``warm_up(tools)``.
* The command line. ``parser(doc)``; ``add_options(ap, "work", "peer", "json")``;
  ``command()``, this run's command; ``finish(meta, results, path)``.

MLX is imported only where a function needs it: a benchmark imports dlm.runtime
first, which loads the optimized BLAS before MLX (dlm.runtime.platform.blas).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parents[2]  # the repository root
WORK = ROOT / ".bench"  # built checkpoints and conversions, kept between runs
PEER = ROOT / ".peer"  # mlx-vlm 0.7.10, installed apart


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def timed(fn: Callable[[], Any], evaluate: bool = True) -> tuple[float, Any]:
    """``(seconds, result)`` of one call of ``fn``, its result evaluated (``mx.eval``;
    whatever in it is not an MLX array is left alone) unless ``evaluate`` is off."""
    start = time.perf_counter()
    out = fn()
    if evaluate:
        import mlx.core as mx

        mx.eval(out)
    return time.perf_counter() - start, out


def seconds(fn: Callable[[], Any]) -> float:
    """The seconds of one call of ``fn``, its result evaluated."""
    return timed(fn)[0]


def repeat(fn: Callable[[], Any], repeats: int, *, warmup: int = 1) -> tuple[list[float], Any]:
    """``warmup`` untimed calls (compilation, first touch), then ``repeats`` timed ones, each
    result evaluated: the seconds of each and the last result."""
    out = None
    for _ in range(warmup):
        _, out = timed(fn)
    times = []
    for _ in range(repeats):
        t, out = timed(fn)
        times.append(t)
    return times, out


def median_seconds(fn: Callable[[], Any], repeats: int, *, warmup: int = 1) -> float:
    """The median seconds of ``repeats`` calls after ``warmup`` untimed ones."""
    return statistics.median(repeat(fn, repeats, warmup=warmup)[0])


def spread(values, unit: str = "s") -> dict:
    """``{"median_s": ..., "range_s": [min, max]}`` of times in seconds (``unit="ms"``:
    ``median_ms`` / ``range_ms``, in milliseconds)."""
    scale = {"s": 1, "ms": 1000}[unit]
    v = [scale * x for x in values]
    return {f"median_{unit}": statistics.median(v), f"range_{unit}": [min(v), max(v)]}


def spread_text(values) -> str:
    """Times in seconds as ``median s [min-max]``."""
    return f"{statistics.median(values):.3f} s [{min(values):.3f}-{max(values):.3f}]"


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Bytes of MLX memory one call of ``fn`` (its result evaluated, then dropped) holds at its
    peak beyond what was live before it (the cache cleared first)."""
    import mlx.core as mx

    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = fn()
    mx.eval(out)
    del out
    return mx.get_peak_memory() - base


# A fresh intermediate process runs the command: its RUSAGE_CHILDREN maxrss is then the
# command's own peak RSS (KiB on Linux). argv: timeout ('' for none), stdout and stderr
# files ('' for nowhere), the command.
_CHILD_PEAK = (
    "import json, resource, subprocess, sys, time\n"
    "timeout = float(sys.argv[1]) if sys.argv[1] else None\n"
    "out, err = (open(p, 'w') if p else subprocess.DEVNULL for p in sys.argv[2:4])\n"
    "t = time.perf_counter()\n"
    "try:\n"
    "    rc = subprocess.run(sys.argv[4:], stdout=out, stderr=err, timeout=timeout).returncode\n"
    "except subprocess.TimeoutExpired:\n"
    "    rc = 'timeout'\n"
    "wall = time.perf_counter() - t\n"
    "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "print(json.dumps({'rc': rc, 'wall_s': wall, 'peak_rss_kib': rss}))\n"
)


def child_peak(cmd: list[str], *, stdout: Path | None = None, stderr: Path | None = None,
               env: dict | None = None, timeout: float | None = None) -> dict:
    """Run ``cmd`` in a process of its own, its stdout and stderr to those files (else nowhere):
    ``{"rc", "wall_s", "peak_rss_kib"}``, rc ``"timeout"`` when it ran past ``timeout`` seconds;
    where the measuring process itself failed, wall and peak are None and ``probe_error`` says why."""
    res = subprocess.run([sys.executable, "-c", _CHILD_PEAK, "" if timeout is None else str(timeout),
                          str(stdout or ""), str(stderr or ""), *cmd], capture_output=True, text=True, env=env,
                         check=False)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"rc": res.returncode, "wall_s": None, "peak_rss_kib": None, "probe_error": res.stderr[-2000:]}


# ---------------------------------------------------------------------------
# Variants side by side
# ---------------------------------------------------------------------------


def interleave(variants: Mapping[Any, Callable], rounds: int, *, warmup: int = 0, alternate: bool = False,
               run: Callable[[Callable, int], Any] | None = None) -> dict[Any, list]:
    """Run ``variants`` side by side, round after round, each once a round (A, B, A, B, ...;
    ``alternate``: every other round backwards, B, A, so that none always goes first), the
    ``warmup`` rounds first and their samples dropped: ``{variant: [sample of each round]}``.
    A sample is ``run(fn, r)``, ``r`` the round counted from 0 over the warm-up rounds too; by
    default the seconds of ``fn()``, its result evaluated."""
    run = run or (lambda fn, r: seconds(fn))
    names = list(variants)
    samples: dict[Any, list] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for name in names[::-1] if alternate and r % 2 else names:
            sample = run(variants[name], r)
            if r >= warmup:
                samples[name].append(sample)
    return samples


def returned(fn: Callable[[], Any], r: int) -> Any:
    """``interleave``'s ``run`` for variants that measure themselves: the sample is what ``fn()`` returns."""
    return fn()


def paired(a, b) -> dict:
    """Each round's ``a / b`` (the two runs of a round are seconds apart, where the medians of
    ``a`` and ``b`` may be minutes apart: the steadiest ratio on a noisy machine), as
    ``{"median": ..., "range": [min, max]}``."""
    ratios = sorted(x / y for x, y in zip(a, b))
    return {"median": statistics.median(ratios), "range": [ratios[0], ratios[-1]]}


# ---------------------------------------------------------------------------
# The peer
# ---------------------------------------------------------------------------


def load_mlx_vlm(peer_dir: str):
    """``(mlx_vlm.load, its version)`` from ``peer_dir``, or ``(None, None)``
    with a line on stderr when it is not installed there (dlm is timed alone)."""
    import dlm.runtime  # noqa: F401  (before mlx-vlm imports MLX: the optimized BLAS, dlm.runtime.platform.blas)

    if peer_dir not in sys.path:
        sys.path.append(peer_dir)
    try:
        import mlx_vlm
        from mlx_vlm import load
    except Exception as exc:  # pragma: no cover - depends on the machine
        print(f"mlx-vlm unavailable ({exc}); timing dlm only", file=sys.stderr)
        return None, None
    return load, getattr(mlx_vlm, "__version__", "?")


def warm_up(tools: dict, call=lambda fn: fn()) -> None:
    """One untimed run of each tool through ``call``. A peer that cannot run this
    model here (mlx-vlm's bf16 experts on MLX's CPU backend: gather_mm is
    float32-only there) is dropped from ``tools`` with a line on stderr, so the
    row is dlm's alone; dlm's own errors propagate."""
    for name, fn in list(tools.items()):
        try:
            call(fn)
        except Exception as exc:
            if name == "dlm":
                raise
            print(f"{name} failed on this model ({type(exc).__name__}: {exc}); timing dlm only", file=sys.stderr)
            del tools[name]


def offline() -> None:
    """No Hub access and no tokenizer threads (unless the environment says otherwise)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------

_OPTIONS = {
    "work": dict(default=str(WORK), help="where built checkpoints and conversions are kept"),
    "peer": dict(default=str(PEER), help="where mlx-vlm 0.7.10 is installed (without it dlm is timed alone)"),
    "json": dict(default=None, help="write the results here"),
}


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser showing ``doc`` (the benchmark's docstring) as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_options(ap: argparse.ArgumentParser, *names: str) -> None:
    """The options several benchmarks share, in the order given: ``work`` (--work, default
    .bench/), ``peer`` (--peer, default .peer/), ``json`` (--json, the results file)."""
    for name in names:
        ap.add_argument(f"--{name}", **_OPTIONS[name])


def command() -> str:
    """This run's command line, to keep beside its numbers."""
    exe = Path(sys.executable)
    exe = os.path.relpath(exe) if exe.is_relative_to(Path.cwd()) else exe.name
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return " ".join([str(exe), *(["-m", spec.name] if spec else [sys.argv[0]]), *sys.argv[1:]])


def finish(meta: dict, results, path: str | None) -> None:
    """Print ``meta`` as a JSON line; with ``path``, write ``{"meta", "results"}`` there."""
    print(json.dumps(meta))
    if path:
        Path(path).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
