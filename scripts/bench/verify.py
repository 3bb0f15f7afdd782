"""How long ``dlm-verify --parity`` takes, before and after the CPU set-up (not a test).

Two set-ups of the same installed dlm, each ``dlm-verify`` in its own process with its peak RSS:

* ``before``: MLX's bundled reference BLAS and the stored precision (``DLM_BLAS=reference
  DLM_COMPUTE_DTYPE=native``), what every Linux run got before dlm loaded an optimized BLAS
  and upcast half-precision weights on the CPU backend;
* ``after``: the defaults (OpenBLAS when the machine has it, float32 compute on the CPU).

Models:

* ``demo``: the README's demo job (scripts/demo.sh): the trained DiffusionGemma demo converted to
  4-bit, verified against its own checkpoint with the demo prompts;
* ``bf16``: a random DiffusionGemma in bf16 of about 70 M parameters (hidden 512, 4 layers, vocab
  32768, canvas 64; scripts/bench/cpu_dtype.py's geometry), converted without quantization (bf16).

``--before REV``: ``before`` is instead that git revision of dlm itself (checked out as a worktree
under --work and imported ahead of the installed dlm), with its own defaults: the real before/after
of a change, same models, same interpreter and dependencies.

Runs alternate (before, after, before, ...); ``--timeout`` bounds each run (a run that hits it is
reported as such, not as a time).

    .venv/bin/python -m scripts.bench.verify --models demo bf16 --repeats 2
    .venv/bin/python -m scripts.bench.verify --before c79e3c0^ --models demo bf16
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import harness
from scripts.bench.harness import ROOT

BIN = Path(sys.executable).parent
SETUPS = {
    "before": {"DLM_BLAS": "reference", "DLM_COMPUTE_DTYPE": "native"},
    "after": {},
}


def demo(work: Path) -> list[str]:
    src = ROOT / "demo" / "diffusion_gemma_sort"
    out = work / "demo-4bit"
    if not (out / "config.json").exists():
        subprocess.run([str(BIN / "dlm-convert"), str(src), "-q", "--q-bits", "4", "-o", str(out), "--overwrite",
                        "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    return ["--parity", str(out), "--reference", str(src), "--prompts", str(ROOT / "demo" / "sort_prompts.txt"),
            "--torch-threads", "1", "--quiet"]


def bf16(work: Path) -> list[str]:
    from tests.builders import build_diffusion_gemma, convert_dir

    hf, out = work / "bf16-hf", work / "bf16-mlx"
    if not (out / "config.json").exists():
        text = dict(vocab_size=32768, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=128, global_head_dim=256,
                    num_global_key_value_heads=1, num_experts=8, top_k_experts=2, moe_intermediate_size=256)
        build_diffusion_gemma(hf, text_overrides=text, canvas_length=64, dtype="bfloat16")
        convert_dir(hf, out)
    return ["--parity", str(out), "--reference", str(hf), "--quiet"]


MODELS = {"demo": demo, "bf16": bf16}


CLI = "import sys; sys.argv[0] = 'dlm-verify'; from dlm.verify.cli import main; main()"


def old_tree(rev: str, work: Path) -> Path:
    """A ``dlm`` package of git revision ``rev`` (a worktree plus a shim mapping dlm.* to it, as
    pyproject's package-dir does); the directory to put first on PYTHONPATH."""
    src, shim = work / "before-src", work / "before-shim"
    if not src.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(src), rev], check=True,
                       stdout=subprocess.DEVNULL)
    (shim / "dlm").mkdir(parents=True, exist_ok=True)
    (shim / "dlm" / "__init__.py").write_text("")
    for sub in ("convert", "quantize", "verify", "runtime", "model_cards"):
        link = shim / "dlm" / sub
        if not link.exists() and (src / sub).exists():
            link.symlink_to(src / sub)
    return shim


def run(args: list[str], setup: str, timeout: float, logs: Path, label: str, before: Path | None = None) -> dict:
    """One ``dlm-verify`` in its own process (full_scale.measure: wall, peak RSS, logs in ``logs``)."""
    from scripts.bench.full_scale import measure

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(BIN / "dlm-verify")]
    if setup == "before" and before is not None:
        env["PYTHONPATH"] = str(before)
        cmd = [sys.executable, "-c", CLI]
    else:
        env.update(SETUPS[setup])
    r = measure(cmd + args, logs, label, env=env, timeout=timeout)
    return {k: r[k] for k in ("rc", "wall_s", "peak_rss_gb")}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--before", default=None, help="git revision whose dlm is the 'before' setup")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="dlm-bench-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    before = old_tree(a.before, work) if a.before else None
    rows = []
    for name in a.models:
        args = MODELS[name](work)

        def one(setup: str, i: int, name=name, args=args) -> dict:
            r = run(args, setup, a.timeout, work / "logs", f"{name}-{setup}-{i}", before)
            print(json.dumps({"model": name, "setup": setup, **r}), flush=True)
            return r

        runs: dict[str, list[dict]] = harness.interleave({s: functools.partial(one, s) for s in a.setups}, a.repeats,
                                                         run=lambda fn, i: fn(i))
        row = {"model": name}
        for setup, rs in runs.items():
            done = [r["wall_s"] for r in rs if r["rc"] != "timeout"]
            row[setup] = {"median_s": statistics.median(done) if done else None,
                          "range_s": [min(done), max(done)] if done else None,
                          "timeouts": sum(r["rc"] == "timeout" for r in rs), "rc": [r["rc"] for r in rs],
                          "peak_rss_gb": max(r["peak_rss_gb"] for r in rs)}
        if all(s in row and row[s]["median_s"] for s in SETUPS):
            row["speedup"] = row["before"]["median_s"] / row["after"]["median_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"command": harness.command(), "time": time.ctime(),
            "before": a.before or SETUPS["before"],
            "load": os.getloadavg()}
    print(json.dumps(meta))
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
