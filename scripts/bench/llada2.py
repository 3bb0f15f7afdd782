"""Benchmark dlm's LLaDA-2 block unmasking against mlx-vlm 0.7.10 (not a test).

Same converted checkpoint (dlm-convert output of a tiny random llada2_moe built
by tests/builders.py; mlx-vlm loads it as it is), same prompt ids, same
settings (greedy, block length, steps, threshold), no stop token (both run the
full budget), same process and machine; runs are interleaved and the median of
``--repeats`` timed runs (after one warm-up each) is reported.

Run from the repository root, as a module (it shares code with scripts/ or tests/):

    .venv/bin/python -m scripts.bench.llada2
    .venv/bin/python -m scripts.bench.llada2 --sizes tiny --steps 32 8 --json out.json
    .venv/bin/python -m scripts.bench.llada2 --sizes release --dtypes f32 q4 --steps 32 --max-tokens 64 --repeats 1

``release`` is the released LLaDA2.0-mini geometry (vocab 157184, hidden 2048, 256 experts top-8, layer 0 dense)
with ``--release-layers`` (2) layers: a ~3.3 GB bf16 source and a ~6.5 GB float32 conversion, which both tools
hold in one process (~13 GB).

Metrics per tool:
  committed tok/s   tokens returned that are not mask tokens / wall time of the call
  tok/forward       committed tokens / model forwards during generation
                    (the prompt's prefill excluded; mlx-vlm's extra per-block
                    cache-writing forward included)
  same tokens       fraction of positions where both tools return the same token
                    (1.00 expected where mlx-vlm's rule equals the reference: steps = block length)
  masks left        mask tokens in the returned text (mlx-vlm has no transfer
                    quota: with steps < block length blocks end half masked)

mlx-vlm must be importable from ``--peer`` (default .peer/: ``pip install
--no-deps --target .peer mlx-vlm==0.7.10 requests certifi charset-normalizer
idna urllib3 pillow``); without it only dlm is timed.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

from scripts.bench import harness
from scripts.bench.full_scale import BENCH_DTYPES, RELEASE_DTYPES
from tests.builders import build_llada2

harness.offline()

SIZES = {
    "tiny": ("base", {}),  # the test suite's geometry
    # Wider and deeper, real-ish proportions (LLaDA2.0-mini / 8).
    "small": ("base", dict(vocab_size=4096, hidden_size=256, intermediate_size=640, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                           moe_intermediate_size=64, num_experts=32, num_experts_per_tok=8,
                           n_group=8, topk_group=4)),
}
# "release": the released inclusionAI/LLaDA2.0-mini geometry (vocab 157184, hidden 2048, 256 experts top-8 in
# 8 groups, 1 shared expert; layer 0 dense) with --release-layers layers, random bf16 weights written tensor by
# tensor (scripts/bench/full_scale.py's builder), converted to float32 / 4-bit / bf16.
SIZES["release"] = (None, None)


def build(work: Path, size: str, dtype: str, release_layers: int = 2) -> Path:
    from dlm.convert.pipeline import ConvertOptions, convert

    if size == "release":
        from scripts.bench.full_scale import build_llada2 as build_release

        # ("llada2-mini-": a directory named llada2-1... would read as LLaDA2.1 to the name heuristic.)
        hf = work / f"llada2-mini-release{release_layers}L-hf"
        if not (hf / "config.json").exists():
            build_release(hf, release_layers, seed=0)
        out, options = work / f"llada2-mini-release{release_layers}L-{dtype}", RELEASE_DTYPES[dtype]
    else:
        geometry, overrides = SIZES[size]
        hf = work / f"llada2-{size}-hf"
        if not (hf / "config.json").exists():
            build_llada2(hf, geometry, **overrides)
        out, options = work / f"llada2-{size}-{dtype}", BENCH_DTYPES[dtype]
    if not (out / "config.json").exists():
        convert(ConvertOptions(source=str(hf), output=str(out), progress=False, **options), echo=lambda s: None)
    return out


def run_dlm(loaded, prompt_ids, s, every_position: bool = False):
    """dlm's block loop; ``every_position``: its head and sampler on every
    position of a block, not only the masked ones (an ``on_step`` hook asks
    for that: as dlm ran before 2026-12-04)."""
    from dlm.runtime.models.llada2_moe.generate import Settings, stream_generate

    settings = Settings(mask_token_id=loaded.args.mask_token_id, eos_token_ids=(), max_tokens=s["max_tokens"],
                        block_length=s["block_length"], steps=s["steps"], threshold=s["threshold"],
                        editing_threshold=None, on_step=(lambda *_: None) if every_position else None)
    start = time.perf_counter()
    tokens, final = [], None
    for event in stream_generate(loaded, prompt_ids, settings, stop_ids=[]):
        tokens.extend(event.token_ids)
        final = event
    wall = time.perf_counter() - start
    mask = loaded.args.mask_token_id
    return dict(committed=sum(t != mask for t in tokens), masks=sum(t == mask for t in tokens),
                forwards=final.stats.forwards, wall=wall, tokens=tokens)


class _ForwardCounter:
    """Counts calls of mlx-vlm's inner model (every forward goes through it)."""

    def __init__(self, module):
        self.cls = type(module)
        self.calls = 0
        self.original = self.cls.__call__
        counter = self

        def counted(inner, *args, **kwargs):
            counter.calls += 1
            return counter.original(inner, *args, **kwargs)

        self.cls.__call__ = counted

    def close(self):
        self.cls.__call__ = self.original


def run_vlm(vmodel, prompt_ids, s, mask_id):
    import mlx.core as mx

    lm = vmodel.language_model
    counter = _ForwardCounter(lm.model)
    try:
        start = time.perf_counter()
        out = lm.generate(mx.array([prompt_ids]), temperature=0.0, block_length=s["block_length"],
                          steps=s["steps"], gen_length=s["max_tokens"], threshold=s["threshold"],
                          eos_id=-1, mask_id=mask_id, eos_early_stop=True)
        tokens = out[0].tolist()
        wall = time.perf_counter() - start
    finally:
        counter.close()
    prefill = len(prompt_ids) // s["block_length"]
    return dict(committed=sum(t != mask_id for t in tokens), masks=sum(t == mask_id for t in tokens),
                forwards=counter.calls - prefill, wall=wall, tokens=tokens)


def summarize(runs):
    wall = statistics.median(r["wall"] for r in runs)
    first = runs[0]
    return dict(committed=first["committed"], masks=first["masks"], forwards=first["forwards"],
                tokens_per_forward=first["committed"] / max(1, first["forwards"]),
                committed_tps=first["committed"] / wall, median_wall=wall)


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    ap.add_argument("--dtypes", nargs="+", default=["f32"], choices=list(BENCH_DTYPES),
                    help="q4: dlm's mixed recipe (mlx-vlm loads the same directory)")
    ap.add_argument("--steps", nargs="+", type=int, default=[32, 8], help="denoising steps per block")
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    harness.add_options(ap, "work", "peer", "json")
    ap.add_argument("--release-layers", type=int, default=2, help="layers of --sizes release (layer 0 is dense)")
    ap.add_argument("--every-position", action="store_true",
                    help="also time dlm with its head on every position of a block (before 2026-12-04)")
    a = ap.parse_args()

    from dlm.runtime import api
    from dlm.runtime.platform import blas  # first: loads the optimized BLAS ahead of MLX

    import mlx.core as mx

    vlm_load, vlm_version = harness.load_mlx_vlm(a.peer)

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    prompt_ids = [(37 * i + 11) % 90 + 5 for i in range(a.prompt_tokens)]
    results = []
    for size in a.sizes:
        for dtype in a.dtypes:
            path = build(work, size, dtype, a.release_layers)
            loaded = api.load(path)
            mask_id = loaded.args.mask_token_id
            vmodel = vlm_load(str(path))[0] if vlm_load is not None else None
            for steps in a.steps:
                s = dict(max_tokens=a.max_tokens, block_length=a.block_length, steps=steps, threshold=a.threshold)
                tools = {"dlm": lambda: run_dlm(loaded, prompt_ids, s)}
                if a.every_position:
                    tools["dlm every position"] = lambda: run_dlm(loaded, prompt_ids, s, every_position=True)
                if vmodel is not None:
                    tools["mlx-vlm"] = lambda: run_vlm(vmodel, prompt_ids, s, mask_id)
                harness.warm_up(tools)
                runs = harness.interleave(tools, a.repeats, run=harness.returned)
                row = {"size": size, "dtype": dtype, **s, **{n: summarize(v) for n, v in runs.items()}}
                if "mlx-vlm" in row:
                    a_tok, b_tok = runs["dlm"][0]["tokens"], runs["mlx-vlm"][0]["tokens"]
                    row["same_tokens"] = sum(x == y for x, y in zip(a_tok, b_tok)) / max(1, len(a_tok))
                    row["speedup"] = row["dlm"]["committed_tps"] / max(row["mlx-vlm"]["committed_tps"], 1e-9)
                results.append(row)
                line = f"{size:5s} {dtype:3s} steps {steps:2d}"
                for name in tools:
                    m = row[name]
                    line += (f" | {name}: {m['committed_tps']:7.1f} committed tok/s, "
                             f"{m['tokens_per_forward']:.2f} tok/forward ({m['committed']} tok, "
                             f"{m['forwards']} fwd, {m['masks']} masks left)")
                if "speedup" in row:
                    line += f" | dlm/mlx-vlm {row['speedup']:.2f}x, same tokens {row['same_tokens']:.2f}"
                print(line, flush=True)
            del loaded, vmodel
            mx.clear_cache()

    meta = {"command": harness.command(), "mlx": mx.__version__, "blas": blas.STATUS,
            "cpu_layout": os.environ.get("DLM_CPU_LAYOUT", "") or "default",
            "mlx_vlm": vlm_version, "device": str(mx.default_device()), "machine": platform.machine(),
            "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens, "repeats": a.repeats}
    harness.finish(meta, results, a.json)


if __name__ == "__main__":
    main()
