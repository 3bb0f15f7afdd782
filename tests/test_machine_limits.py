"""scripts/bench/machine_limits.py's step bound counts a DiffusionGemma decoder
pass's matrix-product FLOPs from the loaded model as the spec has them
(checked here against a count from the config alone). The tool runs as users
run it, ``python -m scripts.bench.machine_limits`` (tests import nothing from
scripts/); ``--rates`` makes it print the FLOPs and the bound without measuring."""

import json
import os
import subprocess
import sys

import pytest

from tests import ROOT

pytest.importorskip("mlx.core")


def _limits(model, prefix: int, rates: dict) -> dict:
    """``{"flops": step_flops, "bound": step_bound}`` as the tool prints them."""
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.machine_limits", "--model", str(model),
                           "--prefix", str(prefix), "--rates", json.dumps(rates)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_step_flops_match_the_spec_count(tiny_dg_mlx_dir):
    config = json.loads((tiny_dg_mlx_dir / "config.json").read_text())
    t = config["text_config"]
    L, P = int(config.get("canvas_length", 256)), 20
    H, I, V = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    E, k, M = t["num_experts"], t["top_k_experts"], t["moe_intermediate_size"]
    nh, W = t["num_attention_heads"], t["sliding_window"]
    attn = mlp = experts = router = scores = 0
    for kind in t["layer_types"]:
        full = kind == "full_attention"
        hd, kv = (t["global_head_dim"], t["num_global_key_value_heads"]) if full else (
            t["head_dim"], t["num_key_value_heads"])
        # q, k, o (+ v on sliding layers: full layers use k as v)
        attn += 2 * L * H * (nh * hd + kv * hd + (0 if full else kv * hd)) + 2 * L * nh * hd * H
        mlp += 2 * L * 3 * H * I
        router += 2 * L * H * E
        experts += 2 * L * k * (2 * M * H + H * M)
        scores += 4 * L * nh * hd * ((P + L) if full else min(W, P + L))
    mlp += 2 * L * 3 * H * I  # the self-conditioning block's MLP
    # Each piece at its own rate (GFLOP/s): the bound is their sum.
    out = _limits(tiny_dg_mlx_dir, P, {"dense float32": 1e-3, "experts float32": 2e-3})
    got = {p: v["flops"] for p, v in out["flops"].items()}
    assert got["attention projections"] == attn
    assert got["dense MLPs"] == mlp
    assert got["router"] == router
    assert got["routed experts"] == experts
    assert got["attention scores"] == scores
    assert got["head over the vocab"] == got["self-conditioning @ embedding"] == 2 * L * V * H
    bound = out["bound"]
    assert bound["seconds"] == pytest.approx(
        (attn + mlp + router + scores + 4 * L * V * H) / 1e6 + experts / 2e6, rel=1e-3)
