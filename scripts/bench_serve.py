"""Benchmark dlm-run serve on loopback: serial latency, concurrent load (queueing
included), and cancellation latency after a client hangs up mid-stream.

Run from the repository root, as a module (it shares code with scripts/ or tests/):

    .venv/bin/python -m scripts.bench_serve --model path/to/mlx-model
    .venv/bin/python -m scripts.bench_serve --tiny          # a tiny random DiffusionGemma

Numbers depend on the machine, the model and the prompt; the serial worker means
concurrency adds queueing, not throughput.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import uvicorn

from dlm.runtime import api
from dlm.runtime.server import create_app
from tests.builders import build_diffusion_gemma, convert_dir


def start(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def tiny_model(root: Path) -> Path:
    build_diffusion_gemma(root / "hf", form="hub")
    return convert_dir(root / "hf", root / "tiny-dg", text_only=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="converted MLX model directory")
    p.add_argument("--tiny", action="store_true", help="build and serve a tiny random DiffusionGemma")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="max_denoising_steps")
    p.add_argument("--serial", type=int, default=10, help="serial requests")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="requests per concurrent client")
    p.add_argument("--queue-size", type=int, default=16)
    p.add_argument("--cancels", type=int, default=3, help="streams hung up after the first commit")
    args = p.parse_args()
    if not args.model and not args.tiny:
        p.error("give --model DIR or --tiny")
    model = Path(args.model) if args.model else tiny_model(Path(tempfile.mkdtemp()))

    loaded = api.load(model)
    app = create_app(loaded, {"max_tokens": args.max_tokens, "max_denoising_steps": args.steps},
                     queue_size=args.queue_size)
    worker = app.state.worker
    server, thread, base = start(app)
    msgs = [{"role": "user", "content": "Explain why the sky is blue in two sentences."}]
    out: dict = {"model": str(model), "max_tokens": args.max_tokens, "max_denoising_steps": args.steps}
    try:
        with httpx.Client(base_url=base, timeout=600) as h:
            h.post("/v1/chat/completions", json={"messages": msgs, "seed": 0})  # warm-up
            lat, toks = [], 0
            for i in range(args.serial):
                t = time.perf_counter()
                r = h.post("/v1/chat/completions", json={"messages": msgs, "seed": i}).json()
                lat.append(time.perf_counter() - t)
                toks += r["usage"]["completion_tokens"]
        out["serial"] = {"requests": args.serial, "p50_s": statistics.median(lat), "max_s": max(lat),
                         "completion_tokens_per_s": toks / sum(lat)}

        def client(c):
            res = []
            with httpx.Client(base_url=base, timeout=600) as h:
                for k in range(args.requests):
                    t = time.perf_counter()
                    r = h.post("/v1/chat/completions", json={"messages": msgs, "seed": c * 100 + k})
                    res.append((r.status_code, time.perf_counter() - t,
                                r.json().get("timings", {}).get("queue_seconds", 0.0),
                                r.json().get("usage", {}).get("completion_tokens", 0)))
            return res

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            res = [x for f in [pool.submit(client, c) for c in range(args.clients)] for x in f.result()]
        wall = time.perf_counter() - t0
        ok = [r for r in res if r[0] == 200]
        out["concurrent"] = {
            "clients": args.clients, "requests": len(res), "ok": len(ok),
            "rejected_429": sum(r[0] == 429 for r in res), "wall_s": wall,
            "requests_per_s": len(ok) / wall, "completion_tokens_per_s": sum(r[3] for r in ok) / wall,
            "p50_latency_s": statistics.median(r[1] for r in ok),
            "mean_queue_s": statistics.mean(r[2] for r in ok), "max_queue_s": max(r[2] for r in ok),
        }

        cancels = []
        for i in range(args.cancels):
            with httpx.Client(base_url=base, timeout=600) as h:
                body = {"messages": msgs, "seed": i, "stream": True, "max_tokens": 1024}
                with h.stream("POST", "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                            break
            worker.wait_idle(600)
            job = worker.last_job
            if (job.cancelled_at is None or job.polls <= job.polls_after_cancel
                    or getattr(job.last_item, "finish_reason", None) not in (None, "cancelled")):
                continue  # ended on its own (EOS) before the hang-up was seen
            step = (job.cancelled_at - job.started_at) / (job.polls - job.polls_after_cancel)
            cancels.append({"mean_step_ms": step * 1e3,
                            "cancel_to_free_ms": (job.finished_at - job.cancelled_at) * 1e3,
                            "polls_after_cancel": job.polls_after_cancel})
        out["cancel"] = cancels
    finally:
        server.should_exit = True
        thread.join(30)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
