"""Benchmark dlm-run serve on loopback: batched (--max-batch N) against serial
(--max-batch 1) serving of the same model and the same requests at 1, 2, 4 and
8 concurrent clients (aggregate committed tokens/s, p50/p95 latency), mlx-vlm's
server beside them where it runs, and the time a server takes to free itself
after a client hangs up mid-stream.

Run from the repository root, as a module (it shares code with tests/):

    .venv/bin/python -m scripts.bench.serve --model path/to/mlx-model
    .venv/bin/python -m scripts.bench.serve --tiny          # a tiny random DiffusionGemma
    .venv/bin/python -m scripts.bench.serve --tiny --family llada2

Both servers are ``dlm-run serve`` processes of their own (the clients here
share no interpreter with them). Each client sends ``--requests`` chat
requests one after the other (a closed loop; every request its own seed, the
same list for both servers). The servers take turns, never running at once, in
``--rounds`` interleaved rounds (serial, batched, serial, ...): a shared
machine drifts, so each figure is the median over the rounds, and
``paired_ratio_median`` the median of each round's batched/serial ratio (the
two runs of a round are seconds apart; the steadiest figure on a noisy
machine). On Linux each server's CPU time a request is reported too (all its
threads: the work a request costs, whatever else the machine runs), and the
share of the machine's CPU time that the hypervisor gave other guests during
the runs (``steal_range``: it stretches wall times, not CPU times). The batched
answers are checked to equal the serial ones, request by request.

mlx-vlm's server (``--peer``, default .peer/: mlx-vlm 0.7.10 and the two
modules its server imports, installed apart as docs/benchmarks.md says)
serves the same model directory in a process of its own, with dlm's optimized
BLAS loaded first as in the other benchmarks, and takes its turn in every
round. It runs diffusion requests one at a time. Every request names its
length and steps in the body (``max_tokens``, ``max_denoising_steps``,
LLaDA-2's ``block_length``, and dlm's default temperature: 1 for
DiffusionGemma, 0 for LLaDA-2), so each server does the same work per step.
Its answers differ (its own draws and stop rules), so each server's
completion tokens a request and requests/s are reported too: where one tool
stops at a stop token and the other does not, requests/s compares the same
blocks of work. mlx-vlm loads DiffusionGemma only with its vision tower, so
``--tiny`` converts the whole checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from dlm.runtime.batch import DEFAULT_MAX_BATCH
from scripts.bench import harness
from tests.builders import build_diffusion_gemma, build_llada2, convert_dir


def start(model: Path, max_batch: int, args, log: Path, extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    """A ``dlm-run serve`` process on a free port (its stderr in ``log``; ``extra``: more
    flags); (process, base URL)."""
    cmd = [str(Path(sys.executable).parent / "dlm-run"), "serve", "--model", str(model), "--port", "0",
           "--max-batch", str(max_batch), "--queue-size", str(args.queue_size), "--log-level", "warning",
           "--max-tokens", str(args.max_tokens), "--max-denoising-steps", str(args.steps), *extra]
    proc = subprocess.Popen(cmd, stderr=log.open("w"), text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if m:
            return proc, m.group(1)
        time.sleep(0.05)
    raise RuntimeError(f"dlm-run serve did not start: {log.read_text()[-2000:]}")


# mlx-vlm's server in a process of its own: dlm's BLAS first (as harness.load_mlx_vlm), then
# mlx-vlm from the peer directory; argv: peer directory, model, port.
PEER_SERVER = """import sys
import dlm.runtime
peer, model, port = sys.argv[1:4]
sys.path.append(peer)
from mlx_vlm.server.cli import main
sys.argv = ["mlx_vlm.server", "--model", model, "--host", "127.0.0.1", "--port", port]
main()
"""


def peer_missing(peer: str):
    """Why mlx-vlm's server cannot start from ``peer`` (None when it can)."""
    probe = "import sys, dlm.runtime; sys.path.append(sys.argv[1]); import mlx_vlm.server.app"
    r = subprocess.run([sys.executable, "-c", probe, peer], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_peer(model: Path, peer: str, log: Path) -> tuple[subprocess.Popen, str]:
    """mlx-vlm's server on ``model``; (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", PEER_SERVER, peer, str(model), str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text()
        if "Application startup failed" in text:
            break
        if "Uvicorn running on" in text:
            return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.05)
    proc.terminate()
    # Its own logger's first error names the cause (a text-only DiffusionGemma: "Missing ... parameters").
    errors = [line.split(" - ERROR - ", 1)[1] for line in log.read_text().splitlines() if " - ERROR - " in line]
    raise RuntimeError(f"mlx-vlm's server did not start ({log}): {errors[0] if errors else log.read_text()[-500:]}")


def tiny_model(root: Path, family: str) -> Path:
    if family == "llada2":
        build_llada2(root / "hf", "base")
    else:
        build_diffusion_gemma(root / "hf", form="hub")
    return convert_dir(root / "hf", root / "tiny")


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def load_test(base, clients: int, requests: int, request: dict) -> dict:
    """``clients`` closed-loop clients, ``requests`` each: wall, tokens, latencies, answers."""

    def client(c):
        out = []
        with httpx.Client(base_url=base, timeout=600) as h:
            for k in range(requests):
                t = time.perf_counter()
                r = h.post("/v1/chat/completions", json={**request, "seed": c * 1000 + k})
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
            "p95_s": percentile(lat, 0.95), "requests_per_s": len(res) / wall,
            "tokens_per_request": sum(r[1] for r in res) / len(res),
            "answers": sorted(r[2] for r in res)}


def cpu_seconds(pid: int):
    """A process's CPU time so far, all its threads (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def steal_ticks():
    """(stolen, all) CPU ticks of the machine so far (Linux /proc/stat; None elsewhere): on a
    shared virtual machine the hypervisor's steal stretches wall times, not CPU times."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[7] if len(fields) > 7 else 0, sum(fields[:8])


def compare(bases: dict, clients_list, requests: int, rounds: int, body: dict, pids: dict) -> list[dict]:
    rows = []
    for clients in clients_list:

        def measured(name: str, clients=clients) -> dict:
            before, ticks = cpu_seconds(pids[name]), steal_ticks()
            run = load_test(bases[name], clients, requests, body)
            if before is not None:  # the server's CPU time a request: steadier than the wall on a shared machine
                run["cpu_ms_per_request"] = (cpu_seconds(pids[name]) - before) / (clients * requests) * 1e3
            if ticks is not None:
                after = steal_ticks()
                run["steal"] = (after[0] - ticks[0]) / max(after[1] - ticks[1], 1)
            return run

        # interleaved: serial, batched, (mlx-vlm,) serial, ...
        runs = harness.interleave({name: functools.partial(measured, name) for name in bases}, rounds,
                                  run=harness.returned)
        answers = {name: r[0]["answers"] for name, r in runs.items()}
        assert answers["batched"] == answers["serial"], "batched answers differ from serial ones"
        row = {"clients": clients, "requests": clients * requests}
        for name, r in runs.items():
            for key in ("tokens_per_s", "p50_s", "p95_s", "requests_per_s", "tokens_per_request"):
                row[f"{name}_{key}"] = statistics.median(x[key] for x in r)
        row["throughput_ratio"] = row["batched_tokens_per_s"] / row["serial_tokens_per_s"]
        if "mlx-vlm" in runs:  # its stop rules differ: requests/s where the tools return different lengths
            row["batched_vs_mlx_vlm"] = row["batched_tokens_per_s"] / row["mlx-vlm_tokens_per_s"]
            row["batched_vs_mlx_vlm_requests"] = row["batched_requests_per_s"] / row["mlx-vlm_requests_per_s"]
        row["p95_ratio"] = row["batched_p95_s"] / row["serial_p95_s"]
        # Each round's batched run against the serial run just before it: a shared
        # machine drifts over minutes, and a pair seconds apart shares most of it.
        paired = harness.paired([b["tokens_per_s"] for b in runs["batched"]],
                                [s["tokens_per_s"] for s in runs["serial"]])
        row["paired_ratio_median"], row["paired_ratio_range"] = paired["median"], paired["range"]
        if "cpu_ms_per_request" in runs["serial"][0]:
            for name, r in runs.items():
                row[f"{name}_cpu_ms_per_request"] = statistics.median(x["cpu_ms_per_request"] for x in r)
        if "steal" in runs["serial"][0]:  # the machine's CPU time taken by other guests while these ran
            row["steal_range"] = [min(x["steal"] for r in runs.values() for x in r),
                                  max(x["steal"] for r in runs.values() for x in r)]
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
    p = harness.parser(__doc__)
    p.add_argument("--model", help="converted MLX model directory")
    p.add_argument("--tiny", action="store_true", help="build and serve a tiny random model")
    p.add_argument("--family", choices=("diffusion_gemma", "llada2"), default="diffusion_gemma",
                   help="the family of --tiny")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="max_denoising_steps")
    p.add_argument("--block-length", type=int, default=32, help="LLaDA-2's block_length")
    p.add_argument("--clients", default="1,2,4,8", help="concurrent clients to compare at")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="the batched server's --max-batch")
    p.add_argument("--queue-size", type=int, default=16)
    p.add_argument("--cancels", type=int, default=3, help="streams hung up after the first commit")
    p.add_argument("--json", dest="json_out", help="also write the results here")
    p.add_argument("--peer", default=str(harness.PEER),
                   help="where mlx-vlm is installed ('' to leave its server out)")
    args = p.parse_args()
    if not args.model and not args.tiny:
        p.error("give --model DIR or --tiny")
    model = Path(args.model) if args.model else tiny_model(Path(tempfile.mkdtemp()), args.family)
    clients = [int(c) for c in args.clients.split(",")]
    logs = Path(tempfile.mkdtemp())
    servers = {"serial": start(model, 1, args, logs / "serial.log"),
               "batched": start(model, args.max_batch, args, logs / "batched.log")}
    missing = peer_missing(args.peer) if args.peer else "--peer ''"
    if missing is None:
        try:
            servers["mlx-vlm"] = start_peer(model, args.peer, logs / "mlx-vlm.log")
        except RuntimeError as exc:
            missing = str(exc).splitlines()[0]
    if missing is not None:
        print(f"mlx-vlm's server left out ({missing})", file=sys.stderr)
    bases = {name: base for name, (_, base) in servers.items()}
    msgs = [{"role": "user", "content": "Explain why the sky is blue in two sentences."}]
    llada = json.loads((model / "config.json").read_text())["model_type"] == "llada2_moe"
    # dlm's defaults named in every request (mlx-vlm's temperature defaults to 0): the same work on all servers.
    body = {"model": str(model), "messages": msgs, "max_tokens": args.max_tokens, "max_denoising_steps": args.steps,
            **({"block_length": args.block_length, "temperature": 0.0} if llada else {"temperature": 1.0})}
    out: dict = {"model": str(model), "max_tokens": args.max_tokens, "max_denoising_steps": args.steps,
                 **({"block_length": args.block_length} if llada else {}), "max_batch": args.max_batch,
                 "requests_per_client": args.requests, "rounds": args.rounds, "mlx_vlm_server": missing or "run"}
    try:
        for base in bases.values():  # warm-up: compile traces for the shapes all will see
            load_test(base, max(clients), 1, body)
        out["compare"] = compare(bases, clients, args.requests, args.rounds, body,
                                 {name: proc.pid for name, (proc, _) in servers.items()})
        out["cancel"] = {name: cancels(base, args.cancels, msgs) for name, base in bases.items()
                         if name != "mlx-vlm"}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    print(json.dumps(out, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
