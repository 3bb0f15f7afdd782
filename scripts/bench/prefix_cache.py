"""Benchmark the server's cross-request prefix cache (``dlm-run serve
--prefix-cache-gb``): a workload of ``--requests`` chat requests that share a
``--system-tokens`` system prompt, each with its own short question, sent by 1
and 8 concurrent clients (closed loop), to a server with the cache on and one
with it off (``--prefix-cache-gb 0``), both families.

Run from the repository root, as a module (it shares code with tests/):

    .venv/bin/python -m scripts.bench.prefix_cache                      # small models, both families
    .venv/bin/python -m scripts.bench.prefix_cache --families llada2 --rounds 3
    .venv/bin/python -m scripts.bench.prefix_cache --chunk-sizes 128 256 512 1024 2048   # prefill time per chunk size

Per workload: time to the first committed canvas/block of each request (the
first SSE chunk: the server sends its status line with the first commit),
p50/p95; aggregate committed tokens/s; the prompt tokens the cache served
(``usage.prompt_tokens_details.cached_tokens``) and the bytes it holds after
the workload (/health). Every workload uses a system prompt of its own (a
different first word), so each starts cold: the first request of a workload
misses and the others may hit. The two servers run side by side (one at a
time, alternating within each round); the answers are checked to be equal,
request by request. The models are the ``small`` benchmark geometries
(scripts/bench/runtime.py, scripts/bench/llada2.py), float32, where a 2 k
prompt's prefill takes seconds on this CPU.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from scripts.bench import harness
from scripts.bench.serve import percentile, start

harness.offline()

WORDS = ("the river carries light stones toward a quiet harbor where old boats rest and gulls argue over "
         "bread while the keeper counts tides in a ledger that nobody reads").split()


def build(family: str) -> Path:
    if family == "llada2":
        from scripts.bench import llada2

        return llada2.build(harness.WORK, "small", "f32")
    from scripts.bench import runtime

    return runtime.build(harness.WORK, "small", "f32")


def system_prompt(model: Path, tokens: int, salt: int) -> str:
    """A system prompt of about ``tokens`` tokens for ``model``'s tokenizer, its first word ``salt``'s."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    words, text = [f"workload{salt}"], ""
    while True:
        words.append(WORDS[len(words) % len(WORDS)])
        candidate = " ".join(words)
        if len(tok.encode(candidate, add_special_tokens=False)) > tokens:
            return text
        text = candidate


def one_request(h: httpx.Client, body: dict) -> dict:
    """A streamed chat request: time to its first chunk (the first commit), its answer and usage."""
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    with h.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return {"first_s": first, "seconds": time.perf_counter() - t0, "text": "".join(text), "usage": usage}


def workload(base: str, system: str, clients: int, requests: int, family_extra: dict) -> dict:
    bodies = [{"messages": [{"role": "system", "content": system},
                            {"role": "user", "content": f"Question {k}: what does the keeper count on day {k}?"}],
               "seed": k, "stream": True, "stream_options": {"include_usage": True}, **family_extra}
              for k in range(requests)]

    def client(c):
        with httpx.Client(base_url=base, timeout=900) as h:
            return [(k, one_request(h, bodies[k])) for k in range(c, requests, clients)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = dict(x for f in [pool.submit(client, c) for c in range(clients)] for x in f.result())
    wall = time.perf_counter() - t0
    firsts = [r["first_s"] for r in done.values()]
    completion = sum(r["usage"]["completion_tokens"] for r in done.values())
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in done.values())
    prompt = sum(r["usage"]["prompt_tokens"] for r in done.values())
    health = httpx.get(base + "/health", timeout=30).json()
    return {"first_p50_s": percentile(firsts, 0.5), "first_p95_s": percentile(firsts, 0.95),
            "tokens_per_s": completion / wall, "wall_s": wall, "prompt_tokens": prompt, "cached_tokens": cached,
            "cache_bytes": (health.get("prefix_cache") or {}).get("bytes", 0),
            "answers": [done[k]["text"] for k in sorted(done)]}


def chunk_sizes(family: str, sizes: list[int], tokens: int, rounds: int) -> dict:
    """Seconds of one ``tokens``-token prompt's prefill at each ``--prefill-step-size``
    (in this process; rounds interleave the sizes, the first round is dropped)."""
    from dlm.runtime import api

    loaded = api.load(build(family))
    ids = [10 + i % 4000 for i in range(tokens)]
    times: dict = {size: [] for size in sizes}
    for round_ in range(rounds + 1):
        for size in sizes:
            session = loaded.family.generation.Session(
                loaded, ids, loaded.settings({"max_tokens": 32, "prefill_step_size": size}))
            seconds, _ = harness.timed(session.prefill, evaluate=False)
            if round_:
                times[size].append(seconds)
    return {size: statistics.median(v) for size, v in times.items()}


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--families", nargs="+", default=["diffusion_gemma", "llada2"],
                    choices=["diffusion_gemma", "llada2"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-gb", type=float, default=1.0)
    ap.add_argument("--queue-size", type=int, default=64)
    ap.add_argument("--chunk-sizes", type=int, nargs="+", default=None,
                    help="instead: time one --system-tokens prompt's prefill at each --prefill-step-size")
    harness.add_options(ap, "json")
    args = ap.parse_args()
    if args.chunk_sizes:
        for family in args.families:
            row = {"family": family, "tokens": args.system_tokens,
                   "prefill_s": chunk_sizes(family, args.chunk_sizes, args.system_tokens, args.rounds)}
            print(json.dumps(row), flush=True)
        return
    results, salt = [], 0
    for family in args.families:
        model = build(family)
        extra = {"block_length": 32} if family == "llada2" else {}
        with tempfile.TemporaryDirectory() as tmp:
            servers = {name: start(model, 8, args, Path(tmp) / f"{name}.log", ("--prefix-cache-gb", str(gb)))
                       for name, gb in (("off", 0), ("on", args.cache_gb))}
            try:
                runs: dict = {}
                for _ in range(args.rounds):
                    for clients in args.clients:
                        salt += 1
                        system = system_prompt(model, args.system_tokens, salt)
                        for name in ("off", "on") if salt % 2 else ("on", "off"):
                            runs.setdefault((clients, name), []).append(
                                workload(servers[name][1], system, clients, args.requests, extra))
                        a, b = runs[(clients, "off")][-1], runs[(clients, "on")][-1]
                        if a["answers"] != b["answers"]:
                            raise SystemExit(f"{family}, {clients} clients: answers differ with the cache on")
            finally:
                for proc, _ in servers.values():
                    proc.terminate()
                    proc.wait(30)
        for clients in args.clients:
            row = {"family": family, "clients": clients}
            for name in ("off", "on"):
                rs = runs[(clients, name)]
                for key in ("first_p50_s", "first_p95_s", "tokens_per_s"):
                    row[f"{key}_{name}"] = statistics.median(r[key] for r in rs)
                row[f"cached_share_{name}"] = statistics.median(r["cached_tokens"] / r["prompt_tokens"] for r in rs)
                row[f"cache_bytes_{name}"] = max(r["cache_bytes"] for r in rs)
            results.append(row)
            print(json.dumps(row), flush=True)
    harness.finish({"command": harness.command(), "requests": args.requests, "system_tokens": args.system_tokens,
                    "max_tokens": args.max_tokens, "steps": args.steps, "rounds": args.rounds}, results, args.json)


if __name__ == "__main__":
    main()
