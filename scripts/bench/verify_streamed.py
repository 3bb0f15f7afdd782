"""dlm-verify's layer-streamed reference vs the whole-model one, at the released
DiffusionGemma layer geometry (not a test).

Builds (once, into --out) a random DiffusionGemma checkpoint with the released
text layer geometry (hidden 2816, 128 experts x 704, 16 heads; sliding and full
attention) but ``--layers`` layers and a ``--vocab`` vocabulary, in bf16, then
per mode (whole, streamed), each in a fresh process: the float32 reference's
load, a 64-token prefill and ``--repeats`` decoder passes over a 256-token
canvas (transformers' own encoder/decoder calls, as dlm-verify makes them),
and the process's peak RSS. One JSON line per mode.

    .venv/bin/python -m scripts.bench.verify_streamed --out /tmp/dg-mid [--layers 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RELEASED_LAYER = dict(
    hidden_size=2816, intermediate_size=2112, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    global_head_dim=512, num_global_key_value_heads=2, sliding_window=1024, num_experts=128, top_k_experts=8,
    moe_intermediate_size=704,
)


def _peak_gb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def child(path: Path, mode: str, threads: int, repeats: int) -> dict:
    import torch
    from transformers import DynamicCache

    from dlm.verify.diffusion_gemma import adapter as A

    torch.set_num_threads(threads)
    t = time.perf_counter()
    ref = A.load_reference(path, stream=mode == "streamed")
    load = time.perf_counter() - t
    model = ref.model
    vocab = int(ref.config["text_config"]["vocab_size"])
    with torch.no_grad():
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        t = time.perf_counter()
        pos = A._encode(model, torch.tensor([list(range(10, 74))]), cache, start=0, prefill=True)
        prefill = time.perf_counter() - t
        canvas = torch.from_numpy(A.debug_pattern(0, 256, vocab))[None]
        passes = []
        for _ in range(repeats):
            t = time.perf_counter()
            A._decode(model, canvas, None, cache, pos, 256)
            passes.append(time.perf_counter() - t)
    out = dict(mode=mode, load_s=round(load, 2), prefill64_s=round(prefill, 2),
               decoder_pass_s=[round(x, 2) for x in passes], peak_rss_gb=round(_peak_gb(), 2))
    if ref.streamer is not None:
        out.update(ref.streamer.stats())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory (built when absent)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", choices=("whole", "streamed"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.out, args.child, args.threads, args.repeats)))
        return
    if not (args.out / "config.json").exists():
        from tests.builders import build_diffusion_gemma

        t = time.perf_counter()
        build_diffusion_gemma(args.out, text_overrides=dict(RELEASED_LAYER, num_hidden_layers=args.layers,
                                                             vocab_size=args.vocab),
                              canvas_length=256, dtype="bfloat16")
        print(f"built {args.out} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors")) / 1e9
    print(json.dumps(dict(checkpoint_gb=round(size, 2), layers=args.layers)))
    for mode in ("whole", "streamed"):
        cmd = [sys.executable, "-m", "scripts.bench.verify_streamed", "--out", str(args.out), "--child", mode,
               "--threads", str(args.threads), "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-2000:])
        print(proc.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
