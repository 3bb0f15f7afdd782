"""Fidelity benchmark on a trained demo model: does a conversion still do the task?

For one bundled demo checkpoint (demo/diffusion_gemma_sort or demo/llada2_sort)
it measures, on the held-out digit-sorting prompts of demo/task.py:

* task accuracy (exact answer, ended by a stop token) and, for multi-canvas /
  multi-block answers, separately;
* DiffusionGemma: mean denoising steps per canvas and the share of canvases the
  early-stop rule ended; LLaDA-2: tokens per forward (and forwards per block);
* KL(reference float32 || variant) and top-1 agreement of the logits on task
  states (per prompt: first canvas/block from noise or masks, the same with
  self-conditioning, the next canvas/block after the true first one, a
  half-noised/half-masked true answer), computed by the family's dlm-verify
  adapter so the inputs are exactly what the parity suite would feed;

for the PyTorch reference in float32 and bf16 (transformers' generate for
DiffusionGemma, dlm's PyTorch reference generate for LLaDA-2, each with the
family's default sampler) and for dlm-convert outputs: float32, bf16, 8-bit
(uniform affine g64), 4-bit mixed, 4-bit uniform, mxfp4 (mixed), and, to show
where the recipes separate, 3-bit uniform, 2-bit mixed and 2-bit uniform. Quantized
variants keep bf16 for their unquantized tensors, as a conversion of a bf16
Hub checkpoint would.

Run from the repository root, as a module (it shares code with demo/ and tests/):

    .venv/bin/python -m scripts.bench.fidelity --model demo/diffusion_gemma_sort --n 200
    .venv/bin/python -m scripts.bench.fidelity --model demo/llada2_sort --n 200

Prints a Markdown table (and writes JSON with --json). CPU-only is fine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from demo import task as demo_task
from scripts.bench.harness import ROOT

VARIANTS = {
    "float32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "8-bit": dict(quantize=True, q_bits=8, recipe="uniform", dtype="bfloat16"),
    "4-bit mixed": dict(quantize=True, q_bits=4, recipe="mixed", dtype="bfloat16"),
    "4-bit uniform": dict(quantize=True, q_bits=4, recipe="uniform", dtype="bfloat16"),
    "mxfp4": dict(quantize=True, q_mode="mxfp4", recipe="mixed", dtype="bfloat16"),
    # Below 4 bits: where the recipes separate on these models.
    "3-bit uniform": dict(quantize=True, q_bits=3, recipe="uniform", dtype="bfloat16"),
    "2-bit mixed": dict(quantize=True, q_bits=2, recipe="mixed", dtype="bfloat16"),
    "2-bit uniform": dict(quantize=True, q_bits=2, recipe="uniform", dtype="bfloat16"),
}


# ---------------------------------------------------------------------------
# Task states compared by the logits metrics
# ---------------------------------------------------------------------------


def dg_cases(config: dict, tokenizer, digits_list: list[str], seed: int = 0):
    from dlm.verify.protocol import LogitCase

    L = int(config["canvas_length"])
    V = int(config["text_config"]["vocab_size"])
    gc = json.loads((Path(config["_path"]) / "generation_config.json").read_text())
    rng = np.random.default_rng(seed)
    eos = _first_eos(gc)
    cases = []
    for i, d in enumerate(digits_list):
        prompt = _chat_ids(tokenizer, d)
        ans = _answer_ids(tokenizer, d, eos, L, pad=int(gc.get("pad_token_id", 0)))
        noise = rng.integers(0, V, L)
        cases.append(LogitCase(f"q{i}.noise", prompt, {"canvas": noise}, {"canvas": "uniform"}))
        cases.append(LogitCase(f"q{i}.noise.sc", prompt, {"canvas": noise},
                               {"canvas": "uniform", "sc_from": f"q{i}.noise",
                                "sc_temperature": float(gc.get("t_max", 0.8))}))
        half = np.where(rng.random(L) < 0.5, rng.integers(0, V, L), ans[:L])
        cases.append(LogitCase(f"q{i}.half", prompt, {"canvas": half}, {"canvas": "half-noised answer"}))
        if len(ans) > L:
            cases.append(LogitCase(f"q{i}.next", prompt, {"committed": ans[:L], "canvas": rng.integers(0, V, L)},
                                   {"canvas": "uniform", "committed": "answer"}))
    return cases


def llada_cases(config: dict, tokenizer, digits_list: list[str], seed: int = 0):
    from dlm.verify.protocol import LogitCase

    gc = json.loads((Path(config["_path"]) / "generation_config.json").read_text())
    bl, mask = int(gc["block_length"]), int(gc["mask_token_id"])
    eos = _first_eos(gc)
    rng = np.random.default_rng(seed)
    cases = []
    for i, d in enumerate(digits_list):
        prompt = _chat_ids(tokenizer, d)
        P = len(prompt)
        full = np.asarray(prompt + _answer_ids(tokenizer, d, eos, 1, pad=eos).tolist(), np.int64)
        first, last = P // bl, (len(full) - 1) // bl
        for b in sorted({first, min(first + 1, last)}):
            end = (b + 1) * bl
            window = np.concatenate([full, np.full(max(0, end - len(full)), eos)])[:end].copy()
            gen = np.arange(end) >= max(P, b * bl)
            all_masked = np.where(gen, mask, window)
            half = np.where(gen & (rng.random(end) < 0.5), mask, window)
            meta = {"kind": "block", "block_length": bl}
            cases.append(LogitCase(f"q{i}.b{b}.masked", prompt, {"window": all_masked}, dict(meta)))
            cases.append(LogitCase(f"q{i}.b{b}.half", prompt, {"window": half}, dict(meta)))
    return cases


def _first_eos(gc: dict) -> int:
    eos = gc.get("eos_token_id")
    return int(eos[0] if isinstance(eos, list) else eos)


def _chat_ids(tokenizer, digits: str) -> list[int]:
    text = tokenizer.apply_chat_template(demo_task.messages(digits), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _answer_ids(tokenizer, digits: str, end_id: int, multiple: int, pad: int) -> np.ndarray:
    ids = list(tokenizer.encode(demo_task.answer_text(digits), add_special_tokens=False)) + [end_id]
    ids += [pad] * (-len(ids) % multiple)
    return np.asarray(ids, np.int64)


# ---------------------------------------------------------------------------
# Task runs
# ---------------------------------------------------------------------------


def run_torch(kind: str, ref, tokenizer, digits_list: list[str], seed: int) -> dict:
    """The PyTorch reference's own generate with the family's default sampler."""
    import torch

    if kind == "diffusion_gemma":
        from demo import train_diffusion_gemma as T

        data = T.Data(tokenizer, 0)
        torch.manual_seed(seed)
        ev = T.evaluate(ref.model, data, digits_list)
        return dict(accuracy=ev["accuracy"], multi=ev["multi_canvas_accuracy"],
                    steps=ev["steps_per_canvas"], early=ev["early_stop_rate"], tpf=None)
    from demo import train_llada2 as T

    data = T.Data(tokenizer, 0)
    ev = T.evaluate(ref.model, data, digits_list)
    return dict(accuracy=ev["accuracy"], multi=ev["multi_block_accuracy"],
                steps=ev["forwards_per_block"], early=None, tpf=ev["tokens_per_forward"])


def run_mlx(kind: str, model_dir: Path, digits_list: list[str], seed: int) -> dict:
    """dlm's runtime (dlm.runtime.api) with the checkpoint's default sampler."""
    from dlm.runtime import api

    loaded = api.load(model_dir)
    gc = loaded.generation_config or {}
    cap = int(gc.get("max_denoising_steps") or gc.get("steps") or 0)
    L = int(loaded.config.get("canvas_length") or gc.get("block_length") or 8)
    ok = multi = multi_ok = tokens = forwards = 0
    steps: list[int] = []
    early = 0
    for i, d in enumerate(digits_list):
        ids = api.encode_prompt(loaded, demo_task.prompt_text(d))
        res = api.generate(loaded, ids, {"seed": seed + i})
        good = demo_task.is_correct(d, res.text) and res.finish_reason == "stop"
        ok += good
        if _multi(kind, len(ids), d, L):
            multi += 1
            multi_ok += good
        steps += res.stats.steps_per_block
        early += res.stats.early_stops
        forwards += res.stats.forwards
        tokens += len(res.token_ids) + (res.finish_reason == "stop")
    n = len(digits_list)
    out = dict(accuracy=ok / n, multi=multi_ok / max(multi, 1), steps=sum(steps) / max(len(steps), 1),
               early=None, tpf=None)
    if kind == "diffusion_gemma":
        out["early"] = sum(s < cap for s in steps) / max(len(steps), 1)
    else:
        out["tpf"] = tokens / max(forwards, 1)
    return out


def _multi(kind: str, prompt_len: int, digits: str, L: int) -> bool:
    if kind == "diffusion_gemma":
        return demo_task.num_blocks(digits, L) > 1
    return (prompt_len + len(digits)) // L > prompt_len // L


# ---------------------------------------------------------------------------


def logits_table(adapter, ref, cases, done_ref: dict, fn) -> dict:
    from dlm.verify.metrics import logits_metrics

    kl, top1, pos = [], [], []
    done: dict = {}
    for case in cases:
        out = fn(case, done)
        done[case.name] = out
        m = logits_metrics(done_ref[case.name], out)
        kl.append(m["kl_mean"] * m["positions"])
        top1.append(m["top1"] * m["positions"])
        pos.append(m["positions"])
    total = sum(pos)
    return dict(kl=sum(kl) / total, top1=sum(top1) / total, positions=total)


def convert_variant(model: Path, out: Path, opts: dict):
    """dlm-convert's pipeline (what the CLI runs); returns its ConvertResult."""
    from dlm.convert.pipeline import ConvertOptions, convert

    return convert(ConvertOptions(source=str(model), output=str(out), overwrite=True, progress=False, **opts),
                   echo=lambda *a, **k: None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "demo" / "diffusion_gemma_sort")
    ap.add_argument("--n", type=int, default=200, help="held-out prompts for accuracy")
    ap.add_argument("--cases", type=int, default=24, help="held-out prompts for the logits metrics")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--no-torch-bf16", action="store_true", help="skip the bf16 PyTorch reference row")
    ap.add_argument("--work", type=Path, default=None, help="where conversions go (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import PreTrainedTokenizerFast

    from dlm.runtime.registry import family_for_config
    from dlm.verify.protocol import adapter_for

    torch.set_num_threads(args.threads)
    model = args.model.resolve()
    config = json.loads((model / "config.json").read_text())
    family = family_for_config(config)
    kind = family.name
    adapter = adapter_for(family)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model))
    heldout = demo_task.heldout_set(args.n)
    case_digits = heldout[:: max(1, len(heldout) // args.cases)][: args.cases]
    config["_path"] = str(model)
    cases = (dg_cases if kind == "diffusion_gemma" else llada_cases)(config, tokenizer, case_digits, args.seed)

    work = args.work or Path(tempfile.mkdtemp(prefix="dlm-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.time()

    ref32 = adapter.load_reference(model, dtype="float32")
    done_ref: dict = {}
    for case in cases:
        done_ref[case.name] = adapter.reference_logits(ref32, case, done_ref)
    row = dict(name="PyTorch float32 (reference)", bpw=32.0, kl=0.0, top1=1.0)
    row.update(run_torch(kind, ref32, tokenizer, heldout, args.seed))
    rows.append(row)
    print(_fmt_row(row, kind), file=sys.stderr, flush=True)
    if not args.no_torch_bf16:
        ref16 = adapter.load_reference(model, dtype="bfloat16")
        row = dict(name="PyTorch bf16", bpw=16.0)
        row.update(logits_table(adapter, ref16, cases, done_ref,
                                lambda c, done: adapter.reference_logits(ref16, c, done)))
        row.update(run_torch(kind, ref16, tokenizer, heldout, args.seed))
        rows.append(row)
        print(_fmt_row(row, kind), file=sys.stderr, flush=True)

    from dlm.runtime import api

    for name in args.variants:
        result = convert_variant(model, work / name.replace(" ", "-"), VARIANTS[name])
        out = result.output
        loaded = api.load(out)
        row = dict(name=f"MLX {name}", bpw=result.bits_per_weight)
        row.update(logits_table(adapter, None, cases, done_ref,
                                lambda c, done: adapter.mlx_logits(loaded, c)))
        row.update(run_mlx(kind, out, heldout, args.seed))
        rows.append(row)
        print(_fmt_row(row, kind), file=sys.stderr, flush=True)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)

    print(table(rows, kind, model, len(heldout), len(cases)))
    print(f"\n({time.time() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "n": len(heldout), "rows": rows}, indent=2))


def _fmt_row(r: dict, kind: str) -> str:
    speed = (f"{r['steps']:.2f} | {r['early']:.0%}" if kind == "diffusion_gemma"
             else f"{r['tpf']:.2f} | {r['steps']:.2f}")
    return (f"| {r['name']} | {r['bpw']:.2f} | {r['accuracy']:.1%} | {r['multi']:.1%} | {speed} | "
            f"{r['kl']:.2e} | {r['top1']:.2%} |")


def table(rows: list[dict], kind: str, model: Path, n: int, n_cases: int) -> str:
    if kind == "diffusion_gemma":
        head = ("| variant | bits/weight | accuracy | multi-canvas acc. | steps/canvas | early stop | "
                "KL vs f32 ref | top-1 agree |")
    else:
        head = ("| variant | bits/weight | accuracy | multi-block acc. | tokens/forward | forwards/block | "
                "KL vs f32 ref | top-1 agree |")
    lines = [f"{model.name}: {n} held-out prompts; logits on {n_cases} task states", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    lines += [_fmt_row(r, kind) for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
