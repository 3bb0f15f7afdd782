"""Benchmark dlm-run serve on loopback: batched (--max-batch N) against serial
(--max-batch 1) serving of the same model and the same requests at 1, 2, 4 and
8 concurrent clients (aggregate committed tokens/s, p50/p95 latency), and the
time a server takes to free itself after a client hangs up mid-stream.

Run from the repository root, as a module (it shares code with tests/):

    .venv/bin/python -m scripts.bench_serve --model path/to/mlx-model
    .venv/bin/python -m scripts.bench_serve --tiny          # a tiny random DiffusionGemma
    .venv/bin/python -m scripts.bench_serve --tiny --family llada2

Both servers are ``dlm-run serve`` processes of their own (the clients here
share no interpreter with them). Each client sends ``--requests`` chat
requests one after the other (a closed loop; every request its own seed, the
same list for both servers). The servers take turns, never running at once, in
``--rounds`` interleaved rounds (serial, batched, serial, ...): a shared
machine drifts, so each figure is the median over the rounds, and
``paired_ratio_median`` the median of each round's batched/serial ratio (the
two runs of a round are seconds apart; the steadiest figure on a noisy
machine). On Linux each server's CPU time a request is reported too (all its
threads: the work a request costs, whatever else the machine runs). The batched answers are checked to equal the serial ones, request
by request.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from dlm.runtime.worker import DEFAULT_MAX_BATCH
from tests.builders import build_diffusion_gemma, build_llada2, convert_dir



def start(model: Path, max_batch: int, args, log: Path) -> tuple[subprocess.Popen, str]:
    """A ``dlm-run serve`` process on a free port (its stderr in ``log``); (process, base URL)."""
    cmd = [str(Path(sys.executable).parent / "dlm-run"), "serve", "--model", str(model), "--port", "0",
           "--max-batch", str(max_batch), "--queue-size", str(args.queue_size), "--log-level", "warning",
           "--max-tokens", str(args.max_tokens), "--max-denoising-steps", str(args.steps)]
    proc = subprocess.Popen(cmd, stderr=log.open("w"), text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if m:
            return proc, m.group(1)
        time.sleep(0.05)
    raise RuntimeError(f"dlm-run serve did not start: {log.read_text()[-2000:]}")


def tiny_model(root: Path, family: str) -> Path:
    if family == "llada2":
        build_llada2(root / "hf", "base")
    else:
        build_diffusion_gemma(root / "hf", form="hub")
    return convert_dir(root / "hf", root / "tiny", text_only=family != "llada2")


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def load_test(base, clients: int, requests: int, msgs) -> dict:
    """``clients`` closed-loop clients, ``requests`` each: wall, tokens, latencies, answers."""

    def client(c):
        out = []
        with httpx.Client(base_url=base, timeout=600) as h:
            for k in range(requests):
                t = time.perf_counter()
                r = h.post("/v1/chat/completions", json={"messages": msgs, "seed": c * 1000 + k})
                r.raise_for_status()
                body = r.json()
                out.append((time.perf_counter() - t, body["usage"]["completion_tokens"],
                            (c, k, body["choices"][0]["message"]["content"])))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        res = [x for f in [pool.submit(client, c) for c in range(clients)] for x in f.result()]
    wall = time.perf_counter() - t0
    lat = [r[0] for r in res]
    return {"tokens_per_s": sum(r[1] for r in res) / wall, "p50_s": percentile(lat, 0.5),
            "p95_s": percentile(lat, 0.95), "answers": sorted(r[2] for r in res)}


def cpu_seconds(pid: int):
    """A process's CPU time so far, all its threads (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def compare(bases: dict, clients_list, requests: int, rounds: int, msgs, pids: dict) -> list[dict]:
    rows = []
    for clients in clients_list:
        runs = {name: [] for name in bases}
        for _ in range(rounds):
            for name, base in bases.items():  # interleaved: serial, batched, serial, batched, ...
                before = cpu_seconds(pids[name])
                run = load_test(base, clients, requests, msgs)
                if before is not None:  # the server's CPU time a request: steadier than the wall on a shared machine
                    run["cpu_ms_per_request"] = (cpu_seconds(pids[name]) - before) / (clients * requests) * 1e3
                runs[name].append(run)
        answers = {name: r[0]["answers"] for name, r in runs.items()}
        assert answers["batched"] == answers["serial"], "batched answers differ from serial ones"
        row = {"clients": clients, "requests": clients * requests}
        for name, r in runs.items():
            for key in ("tokens_per_s", "p50_s", "p95_s"):
                row[f"{name}_{key}"] = statistics.median(x[key] for x in r)
        row["throughput_ratio"] = row["batched_tokens_per_s"] / row["serial_tokens_per_s"]
        row["p95_ratio"] = row["batched_p95_s"] / row["serial_p95_s"]
        # Each round's batched run against the serial run just before it: a shared
        # machine drifts over minutes, and a pair seconds apart shares most of it.
        paired = sorted(b["tokens_per_s"] / s["tokens_per_s"] for s, b in zip(runs["serial"], runs["batched"]))
        row["paired_ratio_median"] = statistics.median(paired)
        row["paired_ratio_range"] = [paired[0], paired[-1]]
        if "cpu_ms_per_request" in runs["serial"][0]:
            for name, r in runs.items():
                row[f"{name}_cpu_ms_per_request"] = statistics.median(x["cpu_ms_per_request"] for x in r)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def busy(h) -> bool:
    return h.get("/health").json()["worker"]["busy"]


def cancels(base, n: int, msgs) -> list[dict]:
    """Hang up a long stream after its first committed canvas/block; how long the
    server takes to be idle again (polling /health)."""
    out = []
    with httpx.Client(base_url=base, timeout=600) as h:
        for i in range(n):
            body = {"messages": msgs, "seed": i, "stream": True, "max_tokens": 1024}
            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break
            t = time.perf_counter()
            while busy(h):
                time.sleep(0.001)
            out.append({"hang_up_to_idle_ms": (time.perf_counter() - t) * 1e3})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="converted MLX model directory")
    p.add_argument("--tiny", action="store_true", help="build and serve a tiny random model")
    p.add_argument("--family", choices=("diffusion_gemma", "llada2"), default="diffusion_gemma",
                   help="the family of --tiny")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="max_denoising_steps")
    p.add_argument("--clients", default="1,2,4,8", help="concurrent clients to compare at")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="the batched server's --max-batch")
    p.add_argument("--queue-size", type=int, default=16)
    p.add_argument("--cancels", type=int, default=3, help="streams hung up after the first commit")
    p.add_argument("--json", dest="json_out", help="also write the results here")
    args = p.parse_args()
    if not args.model and not args.tiny:
        p.error("give --model DIR or --tiny")
    model = Path(args.model) if args.model else tiny_model(Path(tempfile.mkdtemp()), args.family)
    clients = [int(c) for c in args.clients.split(",")]
    logs = Path(tempfile.mkdtemp())
    servers = {"serial": start(model, 1, args, logs / "serial.log"),
               "batched": start(model, args.max_batch, args, logs / "batched.log")}
    bases = {name: base for name, (_, base) in servers.items()}
    msgs = [{"role": "user", "content": "Explain why the sky is blue in two sentences."}]
    out: dict = {"model": str(model), "max_tokens": args.max_tokens, "max_denoising_steps": args.steps,
                 "max_batch": args.max_batch, "requests_per_client": args.requests, "rounds": args.rounds}
    try:
        for base in bases.values():  # warm-up: compile traces for the shapes both will see
            load_test(base, max(clients), 1, msgs)
        out["compare"] = compare(bases, clients, args.requests, args.rounds, msgs,
                                 {name: proc.pid for name, (proc, _) in servers.items()})
        out["cancel"] = {name: cancels(base, args.cancels, msgs) for name, base in bases.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    print(json.dumps(out, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
