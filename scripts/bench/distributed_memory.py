"""Peak RSS per rank of one LLaDA2.0-flash-geometry model over N = 1, 2, 3 ranks on
loopback (``mlx.launch --backend ring``), against the expected share (not a test).

The released LLaDA2.0-flash geometry (hidden 4096, 32 heads / 4 KV heads of 128,
256 experts x 1024 top-8 with one shared expert, vocab 157184; layer 0 dense) with
``--layers`` layers and random bf16 weights (scripts/bench/full_scale.py's streamed
builder), converted to 4-bit. Each rank loads it as ``dlm-run`` does (``api.load``: its
share kept, the quantized weights kept, ``native``), then reports its peak resident
memory (``VmHWM``: ``ru_maxrss`` would carry a parent's peak across ``exec``).
Expected per rank: the replicated tensors (norms, routers) plus 1/N of the others,
plus a process's own base (Python, MLX, transformers imported). Generation is left
out: a one-token generation at N = 1 on MLX's CPU quantized kernels ran over ten
minutes here, and its activations are small next to the weights.

    .venv/bin/python -m scripts.bench.distributed_memory
    .venv/bin/python -m scripts.bench.distributed_memory --layers 2 --ranks 1 2 3 --json out.json
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench import full_scale, harness

harness.offline()

BIN = Path(sys.executable).parent
# inclusionAI/LLaDA2.0-flash's config.json (the fields that set the tensors' shapes).
FLASH = {"vocab_size": 157184, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 4,
         "head_dim": 128, "intermediate_size": 9216, "moe_intermediate_size": 1024, "first_k_dense_replace": 1,
         "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1, "n_group": 8, "topk_group": 4}
REPLICATED = re.compile(r"norm|\.gate\.|expert_bias")  # what the LLaDA-2 shard keeps whole on every rank
# Run on every rank: load the model (sharded under mlx.launch), then this rank's peak
# resident memory into OUT/rank<r>.json.
RSS = """
import json, os, sys
from dlm.runtime import api
loaded = api.load(sys.argv[2], compute_dtype="native")
rank = os.environ.get("MLX_RANK", "0")
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
peak = int(status["VmHWM"].split()[0]) * 1024
open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w").write(json.dumps({"rank": int(rank), "peak": peak,
                                                                          "notes": loaded.shard_notes}))
"""


def build(work: Path, layers: int) -> Path:
    from dlm.convert.pipeline import ConvertOptions, convert

    hf, out = work / f"llada2-flash-{layers}L-hf", work / f"llada2-flash-{layers}L-q4"
    if not (hf / "config.json").exists():
        # full_scale builds the mini geometry from this table: the flash one, for this run
        full_scale.LLADA2_MINI = {**full_scale.LLADA2_MINI, **FLASH}
        full_scale.build_llada2(hf, layers, seed=0)
    if not (out / "config.json").exists():
        convert(ConvertOptions(source=str(hf), output=str(out), progress=False, quantize=True, q_bits=4),
                echo=lambda s: None)
    return out


def tensor_bytes(model: Path) -> tuple[int, int]:
    """(replicated, split) bytes of the checkpoint's tensors, from the safetensors headers."""
    replicated = split = 0
    for path in model.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            size = spec["data_offsets"][1] - spec["data_offsets"][0]
            if REPLICATED.search(name):
                replicated += size
            else:
                split += size
    return replicated, split


def peaks(model: Path, ranks: int) -> list[dict]:
    """Each rank's peak resident memory once it has loaded its share over ``ranks`` ranks."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-c", RSS, out, str(model)]
        if ranks > 1:
            port = 20000 + (os.getpid() * 64 + ranks * 16) % 30000
            command = [str(BIN / "mlx.launch"), "-n", str(ranks), "--backend", "ring", "--starting-port",
                       str(port), *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.getcwd()})
        found = sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.json")), key=lambda r: r["rank"])
    if len(found) != ranks:
        raise SystemExit(f"{ranks} ranks: {found}\n{done.stderr}")
    return found


def base_rss() -> int:
    """A process's own peak resident memory with dlm and transformers imported, nothing loaded."""
    code = ("import dlm.runtime.api, dlm.runtime.cli.main, transformers; "
            "print([int(x.split()[1]) * 1024 for x in open('/proc/self/status') if x.startswith('VmHWM')][0])")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (layer 0 is dense)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--work", default=None, help="keep the checkpoints here (default: a temporary folder)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build(work, a.layers)
        replicated, split = tensor_bytes(model)
        base = base_rss()
        results = []
        for n in a.ranks:
            for r in peaks(model, n):
                row = {"ranks": n, "rank": r["rank"], "peak_gb": r["peak"] / 1e9,
                       "expected_gb": (base + replicated + split / n) / 1e9, "notes": r["notes"]}
                results.append(row)
                print(json.dumps(row), flush=True)
    harness.finish({"layers": a.layers, "replicated_gb": replicated / 1e9, "split_gb": split / 1e9,
                    "base_gb": base / 1e9, "command": harness.command()}, results, a.json)


if __name__ == "__main__":
    main()
