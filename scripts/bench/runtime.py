"""Benchmark dlm's DiffusionGemma runtime against mlx-vlm 0.7.10 (not a test).

Same converted checkpoint (dlm-convert output, which mlx-vlm loads as it is),
same prompt ids, same sampler settings (entropy-bound, the checkpoint's
temperature schedule, temperature 1.0 = categorical sampling, full canvases,
fixed step budget), same process and machine; runs are interleaved and the
median of ``--repeats`` timed runs (after one warm-up each) is reported.

Run from the repository root, as a module (it shares code with scripts/ or tests/):

    .venv/bin/python -m scripts.bench.runtime                  # tiny + small, f32 + q4
    .venv/bin/python -m scripts.bench.runtime --sizes tiny --dtypes f32 --json out.json

mlx-vlm must be importable from ``--peer`` (default .peer/, installed with
``pip install --no-deps --target .peer mlx-vlm==0.7.10 requests certifi
charset-normalizer idna urllib3 pillow``); without it only dlm is timed.

    .venv/bin/python -m scripts.bench.runtime --sizes release --canvases 1 --steps 2 --repeats 3
    .venv/bin/python -m scripts.bench.runtime --sizes small --limits   # + the machine's limits and the step's bound
    .venv/bin/python -m scripts.bench.runtime --sizes release --dtypes f32 --canvases 1 --steps 4 --full-steps --pieces

``release`` is the released 26B-A4B text geometry (vocab 262144, canvas 256, 128 experts top-8) with
``--release-layers`` (2) decoder layers: ~4.8 GB bf16 source, a 9.2 GB float32 conversion, and both
tools hold a float32 copy in one process (~19 GB): run it on an otherwise idle machine.

Metrics: committed tokens/s = generated tokens / (wall time of the call minus
its prefill); ms per denoising step = that time / decoder passes, each run by
its own counts (a run that stops early is divided by its own steps); the
median over the interleaved repeats, with the min-max range.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

from scripts.bench import harness, machine_limits, step_pieces
from scripts.bench.full_scale import BENCH_DTYPES, RELEASE_DTYPES
from tests.builders import build_diffusion_gemma, convert_dir

harness.offline()

SIZES = {
    # The test suite's tiny checkpoint (tests/builders.py DG_TEXT geometry, canvas 8).
    "tiny": dict(canvas=8, text={}),
    # Wider/deeper, real-ish proportions, canvas 32: less dominated by per-step overhead.
    "small": dict(canvas=32, text=dict(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
        num_global_key_value_heads=1, sliding_window=64, num_experts=16, top_k_experts=4,
        moe_intermediate_size=128)),
}
# "release": the released google/diffusiongemma-26B-A4B-it text geometry (vocab 262144, hidden 2816, 128
# experts top-8, canvas 256) with --release-layers decoder layers, random bf16 weights written tensor by
# tensor (scripts/bench/full_scale.py's builder), converted to float32 / 4-bit / bf16.
SIZES["release"] = dict(canvas=256, text=None)


def build(work: Path, size: str, dtype: str, release_layers: int = 2) -> Path:
    if size == "release":
        from scripts.bench.full_scale import build_diffusion_gemma as build_release

        tag = f"release{release_layers}L"
        hf = work / f"{tag}-hf"
        if not (hf / "config.json").exists():
            build_release(hf, release_layers, seed=0)
        out = work / f"{tag}-{dtype}"
        if not (out / "config.json").exists():
            convert_dir(hf, out, **RELEASE_DTYPES[dtype])
        return out
    hf = work / f"{size}-hf"
    if not (hf / "config.json").exists():
        spec = SIZES[size]
        build_diffusion_gemma(hf, form="hub", canvas_length=spec["canvas"], text_overrides=spec["text"])
    out = work / f"{size}-{dtype}"
    if not (out / "config.json").exists():
        convert_dir(hf, out, **BENCH_DTYPES[dtype])
    return out


def without_early_stop(path: Path) -> Path:
    """A sibling of the converted model whose generation_config.json sets
    confidence_threshold 0, so neither tool's stable-and-confident rule ends a
    canvas early (both read it from there) and every run denoises the full
    --steps: the steady-state step, self-conditioning included, on both sides.
    The other files are symbolic links."""
    out = path.with_name(path.name + "-full-steps")
    out.mkdir(exist_ok=True)
    for f in path.iterdir():
        if f.name != "generation_config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((path / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "confidence_threshold": 0.0}, indent=2))
    return out


def run_dlm(loaded, prompt_ids, max_tokens, steps, seed, extra=None):
    from dlm.runtime import api

    start = time.perf_counter()
    res = api.generate(loaded, prompt_ids, {
        "max_tokens": max_tokens, "max_denoising_steps": steps, "diffusion_full_canvas": True,
        "diffusion_sampler": "entropy-bound", "temp": 1.0, "seed": seed, **(extra or {}),
    })
    wall = time.perf_counter() - start
    s = res.stats
    return dict(tokens=len(res.token_ids), steps=s.forwards, gen_seconds=wall - s.prompt_seconds,
                wall=wall, reported_tps=s.generation_tps)


def run_vlm(model, processor, prompt_ids, max_tokens, steps, seed):
    import mlx.core as mx
    from mlx_vlm.generate.diffusion import stream_diffusion_generate

    mx.random.seed(seed)
    tokenizer = getattr(processor, "tokenizer", processor)
    start = time.perf_counter()
    last = None
    for last in stream_diffusion_generate(
        model, processor, tokenizer, mx.array([prompt_ids]), None, None,
        max_tokens=max_tokens, skip_special_token_ids=set(), temperature=1.0,
        max_denoising_steps=steps, diffusion_full_canvas=True, diffusion_sampler="entropy-bound",
    ):
        pass
    wall = time.perf_counter() - start
    prompt_seconds = last.prompt_tokens / last.prompt_tps if last.prompt_tps else 0.0
    return dict(tokens=last.generation_tokens, steps=last.diffusion_denoising_steps,
                gen_seconds=wall - prompt_seconds, wall=wall, reported_tps=last.generation_tps)


def summarize(runs):
    """Each run's own rates (a run that stops early at EOS has fewer steps and
    tokens: its time is divided by its own counts), then the median over the
    runs with the min/max range."""
    per_step = [1000 * r["gen_seconds"] / r["steps"] for r in runs]
    tps = [r["tokens"] / r["gen_seconds"] for r in runs]
    return dict(tokens=statistics.median(r["tokens"] for r in runs), steps=statistics.median(r["steps"] for r in runs),
                ms_per_step=statistics.median(per_step), ms_per_step_range=[min(per_step), max(per_step)],
                tokens_per_s=statistics.median(tps), tokens_per_s_range=[min(tps), max(tps)],
                median_gen_seconds=statistics.median(r["gen_seconds"] for r in runs),
                reported_tps=statistics.median(r["reported_tps"] for r in runs))


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    ap.add_argument("--dtypes", nargs="+", default=["f32", "q4"], choices=list(BENCH_DTYPES))
    ap.add_argument("--canvases", type=int, default=4, help="canvases per run")
    ap.add_argument("--steps", type=int, default=16, help="denoising steps per canvas")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs of each tool first (0 for steps of minutes, as 4-bit mlx-vlm at --sizes release)")
    harness.add_options(ap, "work", "peer", "json")
    ap.add_argument("--release-layers", type=int, default=2, help="decoder layers of --sizes release")
    ap.add_argument("--full-steps", action="store_true",
                    help="no early stop (confidence_threshold 0 for both tools): every canvas runs --steps steps")
    ap.add_argument("--pieces", action="store_true",
                    help="also time the pieces of one steady-state dlm step (scripts/bench/step_pieces.py)")
    ap.add_argument("--limits", action="store_true",
                    help="also measure this machine's limits at each model's shapes (scripts/bench/machine_limits.py) "
                         "and print dlm's step as a multiple of its matrix-product bound")
    a = ap.parse_args()

    import mlx.core as mx

    from dlm.runtime import api

    vlm_load, vlm_version = harness.load_mlx_vlm(a.peer)

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    prompt_ids = [2, 105] + [(37 * i + 11) % 90 + 110 for i in range(40)] + [106, 10, 105]
    results = []
    for size in a.sizes:
        for dtype in a.dtypes:
            path = build(work, size, dtype, a.release_layers)
            if a.full_steps:
                path = without_early_stop(path)
            loaded = api.load(path)
            max_tokens = a.canvases * loaded.args.canvas_length
            # release: mlx-vlm's copy of the model sits in the same process, and dlm's default
            # memory budget (80% of RAM less *all* MLX memory) would count it as dlm's.
            extra = {"memory_budget": 4.0} if size == "release" else None
            tools = {"dlm": lambda seed: run_dlm(loaded, prompt_ids, max_tokens, a.steps, seed, extra)}
            if vlm_load is not None:
                vmodel, vproc = vlm_load(str(path))
                tools["mlx-vlm"] = lambda seed: run_vlm(vmodel, vproc, prompt_ids, max_tokens, a.steps, seed)
            for _ in range(a.warmup):
                harness.warm_up(tools, lambda fn: fn(0))
            runs = harness.interleave(tools, a.repeats, run=lambda fn, r: fn(r + 1))  # round r: seed r + 1
            row = {"size": size, "dtype": dtype, "canvas": loaded.args.canvas_length,
                   **{name: summarize(v) for name, v in runs.items()}}
            if "mlx-vlm" in row:
                # Committed tokens/s compare like for like only when both runs stop at the
                # same point; ms per denoising step always does (random streams differ).
                row["speedup"] = row["dlm"]["tokens_per_s"] / row["mlx-vlm"]["tokens_per_s"]
                row["step_speedup"] = row["mlx-vlm"]["ms_per_step"] / row["dlm"]["ms_per_step"]
            results.append(row)
            line = f"{size:5s} {dtype:3s} canvas {row['canvas']:3d}"
            for name in tools:
                m = row[name]
                lo, hi = m["ms_per_step_range"]
                line += (f" | {name}: {m['tokens_per_s']:8.1f} tok/s {m['ms_per_step']:7.2f} ms/step"
                         f" [{lo:.1f}-{hi:.1f}] ({m['tokens']:g} tok, {m['steps']:g} steps)")
            if "speedup" in row:
                line += f" | dlm/mlx-vlm {row['speedup']:.2f}x tok/s, {row['step_speedup']:.2f}x per step"
            print(line, flush=True)
            if a.pieces:
                rep = step_pieces.report(loaded, prompt_ids)
                row["pieces"] = rep
                print("      pieces of one dlm step: " + step_pieces.format_report(rep), flush=True)
            if a.limits:
                lim = machine_limits.report(loaded, len(prompt_ids), repeats=2)
                lim["dlm_step_over_bound"] = row["dlm"]["ms_per_step"] / 1000 / lim["bound"]["seconds"]
                row["limits"] = lim
                pieces = ", ".join(f"{k} {v['seconds'] * 1000:.0f} ms ({v['rate']})"
                                   for k, v in lim["bound"]["pieces"].items())
                bw = lim["bandwidth_gbs"]
                print(f"      limits: read {bw['read']} GB/s (one MLX op), {bw['host_read']} GB/s (all cores), GFLOP/s "
                      + ", ".join(f"{k} {v}" for k, v in lim["gflops"].items())
                      + f"; matrix-product bound {lim['bound']['seconds'] * 1000:.0f} ms/step ({pieces}); "
                      f"dlm's step = {lim['dlm_step_over_bound']:.2f}x the bound", flush=True)
            del loaded
            mx.clear_cache()

    meta = {"command": harness.command(), "mlx": mx.__version__,
            "mlx_vlm": vlm_version, "device": str(mx.default_device()), "machine": platform.machine(),
            "canvases": a.canvases, "steps": a.steps, "repeats": a.repeats, "warmup": a.warmup,
            "full_steps": a.full_steps}
    harness.finish(meta, results, a.json)


if __name__ == "__main__":
    main()
