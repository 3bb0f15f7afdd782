"""Structured output on the bundled demo models: task accuracy and cost with
the answer requested as JSON vs as plain text.

    .venv/bin/python -m scripts.bench.structured [--n 40] [--seed 0]

For each demo model (DiffusionGemma, LLaDA-2) and each of N sort prompts
(demo/task.py), interleaved: the plain answer (scored as the demo scores it), and
the same prompt with ``response_format`` ``{"sorted": "<digits>"}`` (JSON
Schema: a string of digits, at most the prompt's length; scored on the parsed
field). Reports accuracy, validity (json + jsonschema), forwards and tokens
per run and median wall seconds per run. The demo models were trained on
plain answers only: JSON mode pins ``{"sorted":"`` in front of the answer, a
context they never saw, so the accuracy gap is the cost of that shift on a
model that knows no JSON, not of the constraint machinery.

Then the grammar's own cost at the released vocabulary (262144 tokens: a
synthetic byte-level table of random 2-8 character tokens, since no real
Gemma tokenizer is on this machine): building llguidance's tokenizer, one
token mask inside a JSON string, one validity check, and one closing-cost
simulation (frontier.py), each the median of repeats.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from demo import task as demo_task
from scripts.bench import harness
from scripts.bench.harness import ROOT

MODELS = {"DiffusionGemma": ROOT / "demo" / "diffusion_gemma_sort", "LLaDA-2": ROOT / "demo" / "llada2_sort"}


def schema_for(digits: str) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["sorted"],
            "properties": {"sorted": {"type": "string", "pattern": "^[0-9]*$", "maxLength": len(digits)}}}


def run(loaded, digits: str, seed: int, structured: bool) -> dict:
    from dlm.runtime import api

    ids = api.encode_prompt(loaded, messages=demo_task.messages(digits))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema_for(digits)}}
    start = time.perf_counter()
    result = api.generate(loaded, ids, {"max_tokens": 64, "seed": seed},
                          **({"response_format": fmt} if structured else {}))
    wall = time.perf_counter() - start
    valid, answer = True, result.text
    if structured:
        import jsonschema

        try:
            value = json.loads(result.text)
            jsonschema.validate(value, schema_for(digits))
            answer = value["sorted"]
        except Exception:
            valid, answer = False, ""
    return {"correct": demo_task.is_correct(digits, answer), "valid": valid, "wall": wall,
            "forwards": result.stats.forwards, "tokens": len(result.token_ids),
            "finish": result.finish_reason}


def grammar_cost(vocab: int = 262144, repeats: int = 20) -> None:
    import llguidance
    import numpy as np

    from dlm.runtime.structured import json_schema
    from dlm.runtime.structured.grammar import Constraint, compile_grammar

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'\"{}[]()-_/\n"
    tokens = [b"<pad>", b"<eos>"] + [bytes([i]) for i in range(256)]
    seen = set(tokens)
    while len(tokens) < vocab:
        t = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))).encode()
        if t not in seen:
            seen.add(t)
            tokens.append(t)

    class Table:
        eos_token_id, bos_token_id, special_token_ids = 1, None, [0, 1]

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text):
            return [2 + b for b in (text.encode() if isinstance(text, str) else text)]

    start = time.perf_counter()
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Table()), n_vocab=vocab, eos_token=1)
    build = time.perf_counter() - start
    schema = {"type": "object", "required": ["answer", "n", "tags"], "properties": {
        "answer": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}
    closers = {t: 2 + ord(t) for t in '"}],0[{'}
    c = Constraint(ll, compile_grammar(json_schema(schema)), vocab, [1], closers=closers)
    c.forced()
    masks, checks, costs = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        allowed = c.mask()
        masks.append(time.perf_counter() - t0)
        ids = np.nonzero(allowed)[0]
        token = int(ids[rng.randrange(len(ids))])
        t0 = time.perf_counter()
        c.allows(token)
        checks.append(time.perf_counter() - t0)
        c.consume(token)
        t0 = time.perf_counter()
        c.closing_cost(200)
        costs.append(time.perf_counter() - t0)
    print(f"\ngrammar at vocab {vocab}: tokenizer build {build:.2f} s; per position (median of {repeats}): "
          f"mask {statistics.median(masks) * 1e3:.3f} ms, validity check {statistics.median(checks) * 1e3:.3f} ms, "
          f"closing-cost simulation {statistics.median(costs) * 1e3:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from dlm.runtime import api

    rng = random.Random(args.seed)
    prompts = [demo_task.sample_digits(rng) for _ in range(args.n)]
    print(f"{args.n} sort prompts (seed {args.seed}), max_tokens 64, interleaved plain / JSON")
    print("| model | mode | accuracy | valid | finish stop | forwards/run | tokens/run | wall s/run (median) |")
    print("|---|---|---|---|---|---|---|---|")
    for title, path in MODELS.items():
        loaded = api.load(path)
        run(loaded, prompts[0], 0, True)  # warm-up: tokenizer tables, compiled graphs
        # Round i: prompt i, plain then JSON.
        rows = harness.interleave(
            {structured: (lambda i, structured=structured: run(loaded, prompts[i], args.seed + i, structured))
             for structured in (False, True)}, len(prompts), run=lambda fn, i: fn(i))
        for structured, label in ((False, "plain text"), (True, "JSON schema")):
            r = rows[structured]
            n = len(r)
            print(f"| {title} | {label} | {sum(x['correct'] for x in r) / n:.0%} | "
                  f"{sum(x['valid'] for x in r) / n:.0%} | {sum(x['finish'] == 'stop' for x in r) / n:.0%} | "
                  f"{statistics.mean(x['forwards'] for x in r):.1f} | {statistics.mean(x['tokens'] for x in r):.1f} | "
                  f"{statistics.median(x['wall'] for x in r):.3f} |")
    grammar_cost()
    return 0


if __name__ == "__main__":
    sys.exit(main())
