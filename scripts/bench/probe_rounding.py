"""How fast a checkpoint amplifies float32 rounding: the reference against itself in float64.

    .venv/bin/python -m scripts.bench.probe_rounding --model .bench/full_scale/src-diffusion_gemma-30L

The control experiment for dlm-verify's implementation check on random weights. It runs transformers'
DiffusionGemma reference (layer-streamed, as dlm-verify does) twice on the first logits case of the suite
(``p0.arange``: the first built-in prompt's prefill and one decoder step on the arange canvas), once in float64
and once in float32, with the per-layer hidden states captured, and prints per layer what dlm-verify's
per-layer diagnostic prints (relative max |Δ|, 1 - cosine min / mean, positions below 0.9999), float32 vs
float64 (and the token routings whose top-k set differs). The same float32 implementation, differing from exact arithmetic only by its own rounding: if its
error grows through the layers as MLX-vs-reference does, the growth is the checkpoint's (random weights
amplify any rounding), not either implementation's. ``--json`` writes the rows. Streamed float64 holds about
two float32 layers' worth of memory more than float32 (7 GB a layer at the released size).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dlm.runtime.checkpoint import read_json
from dlm.verify import layers as L
from dlm.verify import protocol
from dlm.verify.diffusion_gemma import adapter as A
from dlm.verify.prompts import suite_prompts


def hidden_states(model: Path, dtype: str, prompt: list[int]) -> tuple[dict, np.ndarray, float]:
    """Per-layer outputs ``{stack: [arrays]}`` (captured as float32, as dlm-verify does: 6e-8 relative),
    the logits and the seconds of one pass."""
    import torch

    torch.set_num_threads(2)
    t = time.perf_counter()
    ref = A.load_reference(model, dtype=dtype, stream=True)
    ref.streamer.bar.enabled = False
    if dtype == "float64":  # torch's grouped_mm has no float64 kernel: the per-expert loop
        for cfg in {id(c): c for c in (ref.model.config, ref.model.config.get_text_config())}.values():
            cfg._experts_implementation = "eager"
    case = A.logit_cases(ref.config, [prompt], read_json(model / "generation_config.json", "generation config")
                         if (model / "generation_config.json").exists() else {})[0]
    stacks = {**A.reference_layers(ref), **A.reference_routers(ref)}
    with torch.no_grad(), L.capture(stacks) as calls:
        logits = A.reference_logits(ref, case, {})
    out = L.result(calls, stacks)
    ref.streamer.close()
    return out, np.asarray(logits, np.float64), time.perf_counter() - t


def ref_config(model: Path) -> dict:
    config = read_json(model / "config.json", "config")
    return config.get("text_config") or config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a DiffusionGemma checkpoint directory")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    prompt = suite_prompts(args.model, None)[0]
    # float64 is a control here, not a --reference-dtype users get (its rows would be judged as half).
    protocol.REFERENCE_DTYPES = (*protocol.REFERENCE_DTYPES, "float64")
    exact, exact_logits, t64 = hidden_states(args.model, "float64", prompt)
    f32, f32_logits, t32 = hidden_states(args.model, "float32", prompt)
    print(f"prompt {len(prompt)} tokens; float64 pass {t64:.0f} s, float32 pass {t32:.0f} s")
    rows = []
    print(f"{'stack':8} {'layer':>5} {'rel max|d|':>11} {'1-cos min':>10} {'1-cos mean':>10} {'below':>6} {'flips':>6}")
    for stack, layers in exact.items():
        if stack.endswith(L.ROUTES):
            continue
        routers = exact[stack + L.ROUTES]
        for i, (a, b) in enumerate(zip(layers, f32[stack])):
            if a is None or b is None:
                continue
            m = L.layer_metrics(a, b, 0.9999)
            p64, p32 = routers[i], f32[stack + L.ROUTES][i]
            k = int(ref_config(args.model)["top_k_experts"])
            m["route_flips"] = len(L.route_flips(p64, np.argsort(-p32, axis=-1, kind="stable")[:, :k]))
            rows.append(dict(stack=stack, layer=i, **m))
            print(f"{stack:8} {i:5d} {m['rel_max']:11.2e} {1 - m['cosine_min']:10.1e} {1 - m['cosine_mean']:10.1e} "
                  f"{m['positions_below']:3d}/{m['positions']} {m['route_flips']:6d}")
    d = np.abs(exact_logits - f32_logits)
    print(f"logits float32 vs float64: max|d| {d.max():.3g}, mean|d| {d.mean():.3g}, top-1 "
          f"{(exact_logits.argmax(-1) == f32_logits.argmax(-1)).mean():.3f}")
    if args.json:
        args.json.write_text(json.dumps(dict(prompt_tokens=len(prompt), seconds={"float64": t64, "float32": t32},
                                             rows=rows, logits_max_abs=float(d.max()),
                                             logits_mean_abs=float(d.mean())), indent=1))


if __name__ == "__main__":
    main()
