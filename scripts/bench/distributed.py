"""One LLaDA-2 model over 2 ranks on loopback (``mlx.launch --backend ring``) against one
process: seconds per denoising step, collectives and bytes per step (not a test).

On this project's 2-core machine both ranks share the cores a single process has, so
the ratio is the overhead of the split (collectives, the ring over loopback, two
Python processes), not a speed-up. The projection for two Macs over Thunderbolt 5
is arithmetic: a rank's share of the single-process step (the sharded weights halve
the reads) plus, per step, the collectives' latency and their bytes over the link,
with the assumptions printed beside it.

Run from the repository root, as a module:

    .venv/bin/python -m scripts.bench.distributed
    .venv/bin/python -m scripts.bench.distributed --sizes tiny small --repeats 3 --json out.json
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench import harness
from scripts.bench.llada2 import build

harness.offline()

BIN = Path(sys.executable).parent
PROFILE = re.compile(r"Distributed: (\d+) ranks, ([\d.]+) collectives per denoising step \(([^)]*)\), "
                     r"([\d.]+) KiB per step")
# Two Macs over Thunderbolt 5 (80 Gb/s): what a step's collectives would cost there.
LINKS = {
    "JACCL (RDMA over TB5)": {"latency_us": 10.0, "gb_per_s": 8.0},
    "ring (TCP over TB5)": {"latency_us": 60.0, "gb_per_s": 4.0},
}


def run(model: Path, ranks: int, args: list[str]) -> dict:
    """One ``dlm-run generate --json --profile``: s per step and the Distributed line."""
    command = [str(BIN / "dlm-run"), "generate", "--model", str(model), *args, "--json", "--profile"]
    if ranks > 1:
        port = 20000 + (os.getpid() * 64) % 30000
        command = [str(BIN / "mlx.launch"), "-n", str(ranks), "--backend", "ring", "--starting-port", str(port),
                   *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    out = json.loads(line)
    steps = sum(out["steps_per_canvas"])
    result = {"s_per_step": out["stats"]["generation_seconds"] / steps, "steps": steps,
              "token_ids": out["token_ids"]}
    found = PROFILE.search(done.stderr)
    if found:
        result.update(collectives=float(found.group(2)), kinds=found.group(3), kib=float(found.group(4)))
    return result


def project(single_s: float, collectives: float, kib: float, ranks: int) -> dict:
    """Step time on ``ranks`` Macs: the single step split evenly, plus each link's cost."""
    out = {}
    for name, link in LINKS.items():
        wire = collectives * link["latency_us"] * 1e-6 + kib * 1024 * 2 * (ranks - 1) / ranks / (link["gb_per_s"] * 1e9)
        out[name] = {"s_per_step": single_s / ranks + wire, "link_s": wire}
    return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    args = ["--prompt-ids", "2,10,11,12", "--max-tokens", str(a.max_tokens), "--block-length", "32",
            "--seed", "0"]
    results = []
    with tempfile.TemporaryDirectory() as work:
        for size in a.sizes:
            model = build(Path(work), size, "f32")
            alone = [run(model, 1, args) for _ in range(a.repeats)]
            split = [run(model, a.ranks, args) for _ in range(a.repeats)]
            one = statistics.median(r["s_per_step"] for r in alone)
            many = statistics.median(r["s_per_step"] for r in split)
            row = {"size": size, "ranks": a.ranks, "single_ms_per_step": one * 1e3,
                   "split_ms_per_step": many * 1e3, "overhead": many / one,
                   "same_tokens": all(r["token_ids"] == alone[0]["token_ids"] for r in split),
                   "collectives_per_step": split[0].get("collectives"), "kinds": split[0].get("kinds"),
                   "kib_per_step": split[0].get("kib")}
            if row["collectives_per_step"] is not None:
                row["projection"] = project(one, row["collectives_per_step"], row["kib_per_step"], a.ranks)
            results.append(row)
            print(json.dumps(row, indent=1), flush=True)
    harness.finish({"links": LINKS, "max_tokens": a.max_tokens}, results, a.json)


if __name__ == "__main__":
    main()
