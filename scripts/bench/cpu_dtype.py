"""A bf16 checkpoint on MLX's CPU backend: computing in bf16 (``--compute-dtype
native``) vs the default float32 upcast (not a test).

Builds a random DiffusionGemma in bf16 (hub layout, transformers' own class),
converts it with dlm-convert, and times the same seeded generation both ways,
interleaved, in one process; prints seconds per denoising step (median).

    .venv/bin/python -m scripts.bench.cpu_dtype                  # hidden 512, 4 layers, vocab 32768
    .venv/bin/python -m scripts.bench.cpu_dtype --hidden 1024 --layers 6 --repeats 2
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from dlm.runtime import api
from scripts.bench import harness
from tests.builders import build_diffusion_gemma, convert_dir


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--canvas", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dlm-bench-dtype-"))
    text = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4, global_head_dim=a.hidden // 2,
                num_global_key_value_heads=1, num_experts=8, top_k_experts=2, moe_intermediate_size=a.hidden // 2)
    build_diffusion_gemma(root / "hf", text_overrides=text, canvas_length=a.canvas, dtype="bfloat16")
    mlx_dir = convert_dir(root / "hf", root / "mlx")
    models = {mode: api.load(mlx_dir, compute_dtype=mode) for mode in ("native", "auto")}
    opts = {"max_tokens": a.canvas, "max_denoising_steps": a.steps, "diffusion_full_canvas": True, "seed": 0,
            "diffusion_sampler": "confidence-threshold", "diffusion_threshold": 1.0}
    prompt = [2] + list(range(10, 40))

    def per_step(generate, r) -> float:  # seconds per denoising step
        t, result = harness.timed(generate, evaluate=False)
        return t / max(1, result.stats.forwards)

    runs = {mode: (lambda loaded=loaded: api.generate(loaded, prompt, opts)) for mode, loaded in models.items()}
    times = harness.interleave(runs, a.repeats, warmup=1, run=per_step)  # the first round warms up
    out = {m: statistics.median(v) for m, v in times.items()}
    for mode, loaded in models.items():
        print(f"{mode:6s} computes in {loaded.compute_dtype:8s}: {out[mode] * 1e3:9.1f} ms/step")
    print(f"float32 upcast is {out['native'] / out['auto']:.1f}x faster per step")
    print(json.dumps({"command": harness.command(), "ms_per_step":
                      {m: v * 1e3 for m, v in out.items()}}))


if __name__ == "__main__":
    main()
