"""Benchmark dlm-convert (and, side by side, mlx-vlm 0.7.10's converter) on the released geometry.

Builds synthetic DiffusionGemma checkpoints with the google/diffusiongemma-26B-A4B-it
text geometry (vocab 262144, hidden 2816, 128 experts x 704, 16 heads, full layers
with 512-wide heads and 2 KV heads) but only a few layers, random bf16 weights in
the hub layout (one shard per layer, an index), written with safetensors directly.
Each conversion runs in its own child process; we record wall time and the
child's peak RSS (getrusage of a fresh intermediate process: harness.child_peak).

    .venv/bin/python -m scripts.bench.convert --layers 1 3
    .venv/bin/python -m scripts.bench.convert --layers 2 6 --peer .peer --q-bits 4

Peak RSS should not grow with the layer count: dlm-convert holds one 64 MB
row chunk of one tensor at a time.

Measured (Linux, 2 shared vCPU, 23 GB RAM, mlx 0.32.4 CPU, `--layers 2 6 --peer .peer`):

| tool | layers | source GB | wall s | peak RSS MB |
|---|---|---|---|---|
| dlm q4 | 2 | 4.8 | 50.6 | 153 |
| mlx-vlm 0.7.10 q4 | 2 | 4.8 | 78.8 | 4986 |
| dlm q4 | 6 | 11.31 | 85.4 | 153 |
| mlx-vlm 0.7.10 q4 | 6 | 11.31 | 111.8 | 6081 |

Both tools wrote bit-identical tensors and the same quantization block (1-layer check).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import harness

TEXT = dict(
    vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
    num_experts=128, top_k_experts=8, moe_intermediate_size=704, sliding_window=1024,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, max_position_embeddings=262144,
    model_type="diffusion_gemma_text", use_bidirectional_attention="vision",
    final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=2,
    eos_token_id=1, dtype="bfloat16",
    rope_parameters={
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
)


def layer_types(n: int) -> list[str]:
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    types[-1] = "full_attention"
    return types


def build(out: Path, n_layers: int, seed: int = 0) -> None:
    """A hub-layout checkpoint: globals in shard 1, one decoder layer per further shard."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    torch.manual_seed(seed)
    out.mkdir(parents=True)
    H, I, E, M = TEXT["hidden_size"], TEXT["intermediate_size"], TEXT["num_experts"], TEXT["moe_intermediate_size"]
    nh = TEXT["num_attention_heads"]
    bf = torch.bfloat16

    def w(*shape):
        return (torch.randn(*shape, dtype=torch.float32) * 0.02).to(bf)

    def ones(*shape):
        return (torch.rand(*shape) + 0.5).to(bf)

    types = layer_types(n_layers)
    n_shards = n_layers + 1
    weight_map = {}

    def save(i, tensors):
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    d = "model.decoder."
    glob = {d + "embed_tokens.weight": w(TEXT["vocab_size"], H), d + "norm.weight": ones(H),
            d + "self_conditioning.pre_norm.weight": ones(H),
            d + "self_conditioning.gate_proj.weight": w(I, H), d + "self_conditioning.up_proj.weight": w(I, H),
            d + "self_conditioning.down_proj.weight": w(H, I)}
    for i in range(n_layers):
        glob[f"model.encoder.language_model.layers.{i}.layer_scalar"] = ones(1)
    save(0, glob)
    del glob
    for i, kind in enumerate(types):
        p = f"{d}layers.{i}."
        hd, kv = (512, 2) if kind == "full_attention" else (256, 8)
        t = {p + n + ".weight": ones(H) for n in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")}
        t[p + "layer_scalar"] = ones(1)
        t.update({p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
                  p + "mlp.down_proj.weight": w(H, I), p + "router.proj.weight": w(E, H),
                  p + "router.scale": ones(H), p + "router.per_expert_scale": ones(E),
                  p + "experts.gate_up_proj": w(E, 2 * M, H), p + "experts.down_proj": w(E, H, M),
                  p + "self_attn.q_proj.weight": w(nh * hd, H), p + "self_attn.k_proj.weight": w(kv * hd, H),
                  p + "self_attn.o_proj.weight": w(H, nh * hd), p + "self_attn.q_norm.weight": ones(hd),
                  p + "self_attn.k_norm.weight": ones(hd)})
        if kind == "sliding_attention":
            t[p + "self_attn.v_proj.weight"] = w(kv * hd, H)
        save(i + 1, t)
        del t
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    text = dict(TEXT, num_hidden_layers=n_layers, layer_types=types)
    config = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
              "text_config": text, "vision_config": None, "canvas_length": 256, "boi_token_id": 255999,
              "eoi_token_id": 258882, "image_token_id": 258880, "eos_token_id": [1, 106],
              "tie_word_embeddings": True, "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"max_denoising_steps": 48, "eos_token_id": [1, 106, 50]}))
    Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}, unk_token="<unk>")).save(
        str(out / "tokenizer.json"))


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """``cmd``'s wall time and peak RSS, run in a process of its own (harness.child_peak), and the tail of its stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        err = Path(tmp) / "stderr"
        r = harness.child_peak(cmd, stderr=err, env=env)
        tail = err.read_text(errors="replace")[-2000:] if err.exists() else ""
    return {"rc": r["rc"], "wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_kib"] / 1024, "err": tail}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--work", type=Path, default=harness.WORK)
    ap.add_argument("--q-bits", type=int, default=4)
    ap.add_argument("--peer", type=Path, default=None, help="site dir holding mlx-vlm 0.7.10 (e.g. .peer)")
    ap.add_argument("--float", action="store_true", help="also time an unquantized (bf16) conversion")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and outputs")
    args = ap.parse_args()

    dlm_convert = str(Path(sys.executable).parent / "dlm-convert")
    rows = []
    for n in args.layers:
        src = args.work / f"dg26b-{n}L"
        if not (src / "config.json").is_file():
            shutil.rmtree(src, ignore_errors=True)
            t = time.perf_counter()
            build(src, n)
            print(f"built {src} in {time.perf_counter() - t:.0f} s", flush=True)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
        runs = [("dlm q%d" % args.q_bits, [dlm_convert, str(src), "--q-bits", str(args.q_bits), "--no-progress",
                                           "-o", str(args.work / f"out-dlm-{n}L"), "--overwrite"], None)]
        if args.float:
            runs.append(("dlm bf16", [dlm_convert, str(src), "--no-progress", "-o",
                                      str(args.work / f"out-dlm-f-{n}L"), "--overwrite"], None))
        if args.peer:
            env = dict(os.environ, PYTHONPATH=str(args.peer.resolve()), HF_HUB_OFFLINE="1")
            peer_out = args.work / f"out-vlm-{n}L"
            shutil.rmtree(peer_out, ignore_errors=True)
            runs.append(("mlx-vlm 0.7.10 q%d" % args.q_bits,
                         [sys.executable, "-m", "mlx_vlm", "convert", "--hf-path", str(src), "--mlx-path",
                          str(peer_out), "-q", "--q-bits", str(args.q_bits)], env))
        for label, cmd, env in runs:
            r = measure(cmd, env)
            row = {"tool": label, "layers": n, "source_gb": round(size, 2), "wall_s": round(r["wall_s"], 1),
                   "peak_rss_mb": round(r["peak_rss_mb"]), "rc": r["rc"]}
            if r["rc"]:
                row["error"] = r["err"].strip().splitlines()[-1] if r["err"].strip() else "?"
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not args.keep:
            for p in args.work.glob(f"out-*-{n}L"):
                shutil.rmtree(p, ignore_errors=True)
    print("\n| tool | layers | source GB | wall s | peak RSS MB |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tool']} | {r['layers']} | {r['source_gb']} | {r['wall_s']} | {r['peak_rss_mb']} |"
              + (f" error: {r['error']}" if r.get("error") else ""))


if __name__ == "__main__":
    main()
