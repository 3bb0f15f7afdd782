"""The CPU backend's weight layout (runtime/models/cpu/layout.py): large float
weights stored [in, out] give the same values, the same products to the last
bit, and a model that generates what the reference does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it
from dlm.runtime.models.cpu import experts as cpu_experts
from dlm.runtime.models.cpu import layout
from dlm.runtime.models.diffusion_gemma import Model as DGModel, ModelArgs as DGArgs
from dlm.runtime.models.llada2_moe import generate as G
from dlm.runtime.models.llada2_moe.model import Model as LLModel
from dlm.runtime.models.llada2_moe.config import ModelArgs as LLArgs
from dlm.runtime.models.switch import SwitchLinear
from dlm.verify.llada2_moe import torch_generate as RG
from tests.builders import LLADA2_EOS_ID, LLADA2_MASK_ID, build_llada2

import mlx.core as mx  # noqa: E402  (isort: skip)
import mlx.nn as nn  # noqa: E402  (isort: skip)


def test_relaid_keeps_values_and_shape_and_products_bit_for_bit():
    """At a released expert's size (LLaDA2.0-mini's 512 x 2048) the products
    keep their bits (OpenBLAS's small-matrix kernels, at tiny sizes, do not)."""
    mx.random.seed(0)
    w = mx.random.normal((6, 512, 2048))
    v = layout.relaid(w)
    assert v.shape == w.shape and v.dtype == w.dtype and bool(mx.array_equal(v, w))
    x = mx.random.normal((4, 3, 2048))
    idx = mx.array([5, 0, 5, 2], dtype=mx.uint32)
    for a, b in [(x @ w[1].T, x @ v[1].T),
                 (mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx),
                  mx.gather_mm(x, v.swapaxes(-1, -2), rhs_indices=idx))]:
        assert bool(mx.array_equal(a, b))


def _released_llada2():
    return LLArgs.from_config(dict(
        model_type="llada2_moe", vocab_size=157184, hidden_size=2048, intermediate_size=5120,
        num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=512, first_k_dense_replace=1, num_experts=256, num_experts_per_tok=8,
        num_shared_experts=1, n_group=8, topk_group=4, max_position_embeddings=8192))


def test_what_is_relaid_follows_each_familys_rows():
    """At the released geometries (lazy zeros: nothing is allocated): LLaDA2.0-mini's
    head and experts (a block gives an expert ~1 token copy), not DiffusionGemma's
    experts (a canvas gives each 16) nor its tied head; nothing quantized or in bf16."""
    ll = LLModel(_released_llada2())
    rows = ll.product_rows()
    assert rows == {"linear": 32, "experts": 1.0}
    assert layout.wants(ll.lm_head, rows)
    moe = ll.model.layers[1].mlp.switch_mlp
    assert all(layout.wants(p, rows) for p in (moe.gate_proj, moe.up_proj, moe.down_proj))
    assert not layout.wants(ll.model.layers[0].attention.query_key_value, rows)  # a layer's projection
    assert not layout.wants(moe.gate_proj.to_quantized(group_size=64, bits=4), rows)
    half = nn.Linear(2048, 157184, bias=False)
    half.weight = half.weight.astype(mx.bfloat16)
    assert not layout.wants(half, rows)

    dg = DGModel(DGArgs.from_config(dict(
        model_type="diffusion_gemma_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112,
        num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        global_head_dim=512, num_global_key_value_heads=2, sliding_window=1024, num_experts=128,
        top_k_experts=8, moe_intermediate_size=704, max_position_embeddings=262144, canvas_length=256)))
    rows = dg.product_rows()
    assert rows == {"linear": 256, "experts": 16.0}
    assert not any(layout.wants(m, rows) for _, m in dg.named_modules())


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    path = tmp_path_factory.mktemp("layout_llada2")
    return build_llada2(path, "base"), path


def _relay_tiny(monkeypatch):
    """Make the tiny model's linears and experts count as large, with few copies each."""
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 1)
    monkeypatch.setattr(layout, "MIN_LINEAR", 1)
    monkeypatch.setattr(layout, "MAX_EXPERT_COPIES", 1000)
    monkeypatch.setattr(layout.blas, "STATUS", "/an/optimized/libopenblas.so.0")  # as setup.sh leaves it


def test_relaid_llada2_generates_the_references_tokens(hub, monkeypatch):
    """The tiny model relaid (its sizes made to count as large): every step's
    logits within float32 rounding of the checkpoint's layout, the hub's tokens."""
    ref, path = hub
    _relay_tiny(monkeypatch)
    monkeypatch.setenv("DLM_CPU_LAYOUT", "native")
    native = api.load(path)
    monkeypatch.delenv("DLM_CPU_LAYOUT")
    laid = api.load(path)
    model = laid.model
    experts = [m for _, m in model.named_modules() if isinstance(m, SwitchLinear)]
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert native.relaid == 0 and laid.relaid == len(experts) + len(linears) > 1
    assert all(getattr(m, "relaid", False) for m in experts + [model.lm_head])

    ids = np.random.RandomState(3).randint(0, 240, 11).tolist()
    kw = dict(mask_token_id=LLADA2_MASK_ID, eos_token_ids=(LLADA2_EOS_ID,), editing_threshold=None,
              stop_on_role_end=False, max_tokens=40, block_length=16, steps=8, threshold=0.9,
              temperature=0.7, seed=2)
    runs = []
    for loaded in (native, laid):
        logits = []
        s = G.Settings(**kw, on_step=lambda b, st, x: logits.append(np.array(x)))
        tokens = [t for e in list(G.stream_generate(loaded, ids, s))[:-1] for t in e.token_ids]
        runs.append((tokens, logits))
    (want_tokens, want_logits), (tokens, logits) = runs
    assert tokens == want_tokens and len(logits) == len(want_logits) >= 4
    assert max(np.abs(a - b).max() for a, b in zip(logits, want_logits)) < 1e-4
    out = RG.generate(ref, torch.tensor(ids), temperature=0.7, block_length=16, steps=8, gen_length=40,
                      threshold=0.9, eos_id=[LLADA2_EOS_ID], mask_id=LLADA2_MASK_ID, hub_sampler=False,
                      uniforms=G.UniformStream(2), suppress_mask=True).tolist()
    assert tokens == [t for t in out if t != LLADA2_EOS_ID]


def test_relaying_keeps_memory_flat(hub, monkeypatch):
    """One weight at a time, and the relaid weight is a view of one buffer: the
    model's memory does not grow."""
    _relay_tiny(monkeypatch)
    monkeypatch.setenv("DLM_CPU_LAYOUT", "native")
    loaded = api.load(hub[1])
    monkeypatch.delenv("DLM_CPU_LAYOUT")
    mx.clear_cache()
    before = mx.get_active_memory()
    largest = max(m["weight"].nbytes for _, m in loaded.model.named_modules() if layout.wants(
        m, loaded.model.product_rows()))
    mx.reset_peak_memory()
    assert layout.cpu_layout(loaded.model) > 1
    mx.clear_cache()
    assert mx.get_active_memory() <= before
    assert mx.get_peak_memory() <= before + 2 * largest


def test_a_bad_layout_setting_is_named(hub, monkeypatch):
    from dlm.runtime.platform.errors import ConfigError

    monkeypatch.setenv("DLM_CPU_LAYOUT", "transposed")
    with pytest.raises(ConfigError, match="DLM_CPU_LAYOUT='transposed': choose auto"):
        api.load(hub[1])
