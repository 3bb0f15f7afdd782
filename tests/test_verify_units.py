"""dlm-verify pieces that no family owns: metrics, divergence reports,
thresholds, dequantization, the drift and commit-stream checks, and clear
errors for bad input (the DiffusionGemma adapter's own pieces are in
diffusion_gemma/test_verify_adapter.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dlm.runtime.platform.errors import ConfigError, DlmError  # noqa: E402
from dlm.verify import metrics as M  # noqa: E402
from dlm.verify import thresholds as T  # noqa: E402
from dlm.verify.protocol import BlockTrace, CommitStream, TraceRecorder  # noqa: E402
from tests.builders import build_llada2, convert_dir, install_in_hf_cache, record_bundle  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- metrics and divergence ----------------------------------------------------


def test_logits_metrics_numbers():
    ref = np.array([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]], np.float32)
    same = M.logits_metrics(ref, ref.copy())
    assert same["max_abs"] == 0 and same["top1"] == 1 and same["kl_mean"] == pytest.approx(0, abs=1e-12)
    mlx = np.array([[0.0, 2.05, 2.0], [3.0, 0.0, 0.5]], np.float32)
    m = M.logits_metrics(ref, mlx, tie_tolerance=1.1)
    assert m["max_abs"] == pytest.approx(1.05) and m["top1"] == 0.5
    assert m["top1_tol"] == 1.0  # ref margin of the flipped pair is 1.0 <= 1.1
    assert M.logits_metrics(ref, mlx, tie_tolerance=0.5)["top1_tol"] == 0.5
    p = np.exp(ref[1] - np.log(np.exp(ref[1]).sum()))
    lq = mlx[1] - np.log(np.exp(mlx[1]).sum())
    kl1 = float((p * (np.log(p) - lq)).sum())
    assert m["kl_max"] >= kl1 - 1e-9


def _stream(argmax_rows, topk_ids, topk_vals, tokens):
    a = np.array(argmax_rows, np.int32)
    block = BlockTrace(tokens, len(a), a, np.array(topk_ids, np.int32), np.array(topk_vals, np.float32))
    return CommitStream([1, 2], [block], "length")


def test_first_divergence_names_canvas_step_position_and_logits():
    ids = [[[5, 7]], [[5, 7]]]
    r = _stream([[5], [5]], ids, [[[1.0, 0.95]], [[2.0, 1.0]]], [5])
    m = _stream([[5], [7]], [[[5, 7]], [[7, 5]]], [[[1.0, 0.9]], [[1.8, 1.7]]], [7])
    div = M.first_divergence(r, m)
    assert (div.block, div.step, div.position, div.reference_token, div.mlx_token) == (0, 1, 0, 5, 7)
    assert div.reference_logits["5"] == 2.0 and div.reference_logits["7"] == 1.0
    assert div.mlx_logits["7"] == pytest.approx(1.8) and div.mlx_logits["5"] == pytest.approx(1.7)
    assert "canvas 0, step 2, position 0" in div.describe()
    assert not div.near_tie(0.5) and div.near_tie(1.0)
    assert M.first_divergence(r, r) is None
    assert M.stream_metrics(r, m)["token_match"] == 0.0


def test_trace_recorder_topk():
    rec = TraceRecorder([1])
    rec.step(np.array([[0.1, 0.9, 0.5], [2.0, 1.0, 3.0]], np.float32))
    rec.commit([1, 2])
    b = rec.stream.blocks[0]
    assert b.steps == 1 and b.step_argmax.tolist() == [[1, 2]]
    assert b.topk_ids[0, 0].tolist() == [1, 2, 0] and b.topk_logits[0, 1].tolist() == [3.0, 2.0, 1.0]


# -- thresholds ----------------------------------------------------------------


def test_threshold_classes_and_overrides(tmp_path):
    assert T.thresholds_for("implementation", "q4", "float32", 4)[0] == "float32"
    assert T.thresholds_for("logits", "q4", "float32", 4)[0] == "q4"
    assert T.thresholds_for("logits", "bfloat16", "bfloat16", None)[0] == "half"
    cls, bounds, tol = T.thresholds_for("logits", "float32", "float32", None,
                                        {"logits": {"max_abs": 0.5, "top1": [">=", 0.2], "tie_tolerance": 0.1}})
    assert bounds["max_abs"] == ("<=", 0.5) and bounds["top1"] == (">=", 0.2) and tol == 0.1
    assert T.evaluate({"max_abs": 0.6, "top1": 0.3}, {"max_abs": ("<=", 0.5), "top1": (">=", 0.2)}) == (
        False, ["max_abs 0.6 (want <= 0.5)"])
    assert T.evaluate({}, {"x": ("<=", None)}) == (True, [])
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"nonsense": {}}))
    with pytest.raises(ConfigError, match="unknown check"):
        T.load_overrides(bad)


# -- dequantization ------------------------------------------------------------


def test_dequantized_weights_reproduce_the_quantized_matmul(tiny_dg_dir, tmp_path):
    import mlx.core as mx

    from dlm.runtime.api import load
    from dlm.verify.weights import dequantized_weights, precision

    q4 = convert_dir(tiny_dg_dir, tmp_path / "q4", quantize=True, q_bits=4, q_group_size=32)
    prec = precision(q4)
    assert (prec.label, prec.bits, prec.compute_dtype) == ("mixed-q4", 4, "float32")
    weights = dequantized_weights(q4)
    assert not any(k.endswith((".scales", ".biases")) for k in weights)
    loaded = load(q4)
    proj = loaded.model.model.decoder.layers[0].self_attn.q_proj
    x = mx.array(np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32))
    want = np.array(proj(x))
    got = np.array(x) @ weights["model.decoder.layers.0.self_attn.q_proj.weight"].T
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.fixture(scope="module")
def bf16_q4(tiny_dg_dir, tmp_path_factory):
    """``tiny_dg_dir`` converted to bfloat16, 4-bit (bf16 scales and biases)."""
    return convert_dir(tiny_dg_dir, tmp_path_factory.mktemp("bf16_q4") / "q4", dtype="bfloat16", quantize=True,
                       q_bits=4, q_group_size=32)


def test_dequantized_weights_are_the_runtimes_upcast_weights(bf16_q4):
    """A bf16 4-bit conversion on the CPU backend: the runtime upcasts the
    scales and biases to float32 before dequantizing, so the same-weights
    reference must get the float32 dequantization, bit for bit (with the
    stored bf16 scales every weight is computed and rounded in bfloat16)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dlm.runtime.models.quant_modes import module_quantization
    from dlm.runtime.loader import load
    from dlm.verify.weights import dequantized_weights

    q4 = bf16_q4
    raw = mx.load(str(q4 / "model.safetensors"))
    name = "model.decoder.layers.0.self_attn.q_proj"
    assert raw[name + ".scales"].dtype == mx.bfloat16
    loaded = load(q4, tokenizer=False, compute_dtype="auto")
    assert loaded.upcast  # the CPU backend computes in float32
    runtime = dict(tree_flatten(loaded.model.parameters()))

    weights = dequantized_weights(q4, upcast=loaded.upcast)
    assert weights.scales_dtype == "float32"
    q = json.loads((q4 / "config.json").read_text())["quantization"]

    def params(module):
        p = module_quantization(q, module, True)
        return {"group_size": p["group_size"], "bits": p["bits"], "mode": p["mode"]}

    want = mx.dequantize(raw[name + ".weight"], raw[name + ".scales"].astype(mx.float32),
                         raw[name + ".biases"].astype(mx.float32), **params(name))
    assert np.array_equal(weights[name + ".weight"], np.array(want))
    # Every tensor, quantized or not, is exactly what the loaded model holds.
    got = weights.take(list(weights))
    quantized = [n for n in got if n[: -len(".weight")] + ".scales" in raw]
    assert quantized
    for n, value in got.items():
        held = runtime[n]
        if n[: -len(".weight")] + ".scales" in runtime:  # a module the loader kept quantized
            module = n[: -len(".weight")]
            held = mx.dequantize(held, runtime[module + ".scales"], runtime.get(module + ".biases"),
                                 **params(module))
        assert np.array_equal(value, np.array(held.astype(mx.float32))), n
    # The stored-precision dequantization is the bf16-rounded one: not what MLX multiplies by.
    stored = dequantized_weights(q4)
    assert stored.scales_dtype == "bfloat16"
    low = stored[name + ".weight"]
    assert not np.array_equal(low, got[name + ".weight"])
    def bf16_exact(a):
        return not (a.view(np.uint32) & 0xFFFF).any()

    assert bf16_exact(low) and not bf16_exact(got[name + ".weight"])
    # bf16 arithmetic (q * scale + bias, each rounded): off by about a bf16 ulp of the bias.
    np.testing.assert_allclose(low, got[name + ".weight"], rtol=0, atol=1e-3)


def test_implementation_check_uses_the_weights_mlx_multiplies_by(bf16_q4, tiny_dg_dir):
    """End to end: the same-weights reference of a bf16 4-bit model gets the
    float32-scale dequantization the CPU runtime computes with, so only float32
    compute differences are left (with the bf16-scale weights, max |dlogit|
    was 0.31 on this model)."""
    from dlm.verify.suite import run_parity
    from tests.builders import verify_options

    report = run_parity(bf16_q4, verify_options(reference=str(tiny_dg_dir), long_prompt=False, stream_prompts=0,
                                                images=False))
    impl = next(c for c in report.checks if c.name == "implementation")
    assert impl.status == "pass" and impl.metrics["max_abs"] < 1e-4, impl.metrics
    assert impl.metrics["top1"] == 1.0
    assert report.layers["implementation"]["first_divergence"] is None


def test_bundle_same_weights_run_in_other_scales_is_noted(bf16_q4):
    """A bundle's same-weights run (``record --mlx``: no MLX model loaded, the
    stored bf16 scales) compared with a runtime that upcast them says so."""
    from dlm.verify import bundle as B
    from dlm.verify.suite import _scales_mismatch

    config = json.loads((bf16_q4 / "config.json").read_text())
    recorded = B.ReferenceRun(meta={"scales_dtype": "bfloat16"})
    assert _scales_mismatch(recorded, bf16_q4, config, upcast=False) == ""
    note = _scales_mismatch(recorded, bf16_q4, config, upcast=True)
    assert "bfloat16 scales" in note and "float32 ones" in note
    # Bundles from before the record dequantized in the stored dtype.
    assert _scales_mismatch(B.ReferenceRun(), bf16_q4, config, upcast=True) == note
    assert _scales_mismatch(B.ReferenceRun(meta={"scales_dtype": "float32"}), bf16_q4, config, upcast=True) == ""


# -- errors --------------------------------------------------------------------


def _cli(args):
    from click.testing import CliRunner

    from dlm.verify.cli import main

    return CliRunner().invoke(main, args)


@pytest.fixture(scope="module")
def f32(tiny_dg_dir, tmp_path_factory):
    return convert_dir(tiny_dg_dir, tmp_path_factory.mktemp("verify_err") / "f32")


def test_error_when_reference_cannot_be_loaded(f32, tmp_path):
    r = _cli(["--parity", str(f32), "--reference", str(tmp_path / "missing"), "--quiet"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "Traceback" not in r.output
    # A directory without safetensors (pickles are never loaded).
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for f in f32.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, pickled / f.name)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    r = _cli(["--parity", str(f32), "--reference", str(pickled), "--quiet"])
    assert r.exit_code == 2 and "safetensors" in r.output


def test_error_without_recorded_source(f32, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(f32, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("dlm")
    (model / "config.json").write_text(json.dumps(cfg))
    r = _cli([str(model), "--quiet"])
    assert r.exit_code == 2 and "--reference" in r.output


def test_error_on_incompatible_bundle_and_bad_flags(f32, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('Hello there\n{"ids": [2, 40, 41, 42]}\n')
    bundle = record_bundle(f32, tmp_path / "b", builtin_prompts=False, prompts_file=str(prompts),
                           stream_prompts=0)
    doc = json.loads((bundle / "bundle.json").read_text())
    assert len(doc["prompts"]) == 2 and doc["prompts"][1] == [2, 40, 41, 42]
    doc["config"]["text_config"]["vocab_size"] = 1024
    (bundle / "bundle.json").write_text(json.dumps(doc))
    r = _cli([str(f32), "--bundle", str(bundle), "--quiet"])
    assert r.exit_code == 2 and "vocab_size" in r.output
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "bundle.json").write_text(json.dumps({"format": "something-else"}))
    r = _cli([str(f32), "--bundle", str(fake), "--quiet"])
    assert r.exit_code == 2 and "not a dlm-verify bundle" in r.output
    r = _cli([str(f32), "--bundle", str(fake), "--reference", "x/y", "--quiet"])
    assert r.exit_code == 2 and "exclusive" in r.output
    r = _cli([])
    assert r.exit_code == 2 and "--parity" in r.output


def test_record_requires_a_reference(tmp_path):
    r = _cli(["record", "-o", str(tmp_path / "b")])
    assert r.exit_code == 2 and "--reference" in r.output
    with pytest.raises(DlmError):
        from dlm.verify.source import resolve_reference

        resolve_reference(str(tmp_path / "nope"))


def test_reference_from_the_hf_cache_offline(tiny_dg_dir, tmp_path, monkeypatch):
    """A repo id resolves through the Hugging Face cache with HF_HUB_OFFLINE set."""
    from dlm.verify.suite import Options, record

    install_in_hf_cache(tiny_dg_dir, tmp_path / "hub", "tiny-org/tiny-dg")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "p.txt"
    prompts.write_text('{"ids": [2, 30, 31, 32, 33]}\n')
    data = record("tiny-org/tiny-dg", Options(reference="tiny-org/tiny-dg", builtin_prompts=False,
                                              prompts_file=str(prompts), stream_prompts=0, progress=False))
    assert data.original.meta["source"] == "tiny-org/tiny-dg" and len(data.cases) == 5
    with pytest.raises(DlmError, match="HF_HUB_OFFLINE|cache"):
        record("tiny-org/absent", Options(reference="tiny-org/absent", progress=False))


def test_logits_prompts_keeps_the_first_prompts_in_order(tiny_dg_dir, tmp_path):
    """--logits-prompts N: logits cases for the first N prompts (the file's,
    then the built-ins, then the long one), whatever the mode."""
    from dlm.verify.prompts import BUILTIN
    from dlm.verify.suite import Options, record

    prompts = tmp_path / "p.txt"
    prompts.write_text('{"ids": [2, 30, 31, 32, 33]}\n')
    data = record(str(tiny_dg_dir), Options(reference=str(tiny_dg_dir), prompts_file=str(prompts), long_prompt=False,
                                            logits_prompts=2, stream_prompts=0, progress=False))
    assert len(data.prompts) == 2 and data.prompts[0] == [2, 30, 31, 32, 33]
    assert data.prompts[1] != data.prompts[0] and len(BUILTIN) > 1
    assert sorted({c.name.split(".")[0] for c in data.cases}) == ["p0", "p1"]


def test_drift_check_flags_extra_denoising_steps():
    """Quantized logits that make the entropy-bound sampler run longer (mlx-vlm
    PR #1359) fail the drift check on steps per canvas."""
    from dlm.verify.checks import check_drift
    from dlm.verify.weights import Precision

    logits = {"c": np.array([[0.0, 5.0, 1.0]], np.float32)}
    ref = _stream([[1]] * 3, [[[1, 2]]] * 3, [[[5.0, 1.0]]] * 3, [1])
    slow = _stream([[1]] * 9, [[[1, 2]]] * 9, [[[5.0, 1.0]]] * 9, [1])
    q4 = Precision("q4", "float32", 4, "affine")
    result = check_drift(logits, logits, [ref], [slow], q4)
    assert result.status == "fail" and result.metrics["steps_ratio"] == 3.0
    assert result.metrics["steps_delta"] == 6.0 and result.metrics["commit_match"] == 1.0
    assert any("steps_ratio" in f for f in result.failures)
    assert check_drift(logits, logits, [ref], [ref], q4).status == "pass"
    unquantized = Precision("float32", "float32", None, None)
    assert check_drift(logits, logits, [ref], [slow], unquantized).status == "skip"


def test_error_when_reference_is_another_family(f32, tmp_path):
    build_llada2(tmp_path / "llada2")
    r = _cli([str(f32), "--reference", str(tmp_path / "llada2"), "--quiet"])
    assert r.exit_code == 2 and "llada2_moe" in r.output and "diffusion_gemma" in r.output


def test_commit_stream_gates_steps_in_float32_and_explains_stop_decisions_in_half():
    from dlm.verify.checks import check_commit_stream
    from dlm.verify.weights import Precision

    ref = _stream([[1], [1]], [[[1, 2]]] * 2, [[[5.0, 1.0]]] * 2, [1])
    late = _stream([[1], [1], [1]], [[[1, 2]]] * 3, [[[5.0, 1.0]]] * 3, [1])  # stopped one step later
    div = M.first_divergence(ref, late)
    assert div.stop_decision and "reference ran 2 steps and MLX 3" in div.describe()
    f32 = check_commit_stream([ref], [late], Precision("float32", "float32", None, None))
    assert f32.status == "fail" and f32.metrics["identical_fraction"] == 1.0
    assert f32.metrics["steps_match_fraction"] == 0.0
    half = check_commit_stream([ref], [late], Precision("bfloat16", "bfloat16", None, None))
    assert half.status == "pass" and half.metrics["explained_fraction"] == 1.0
    wrong = _stream([[2], [2]], [[[2, 1]]] * 2, [[[9.0, 1.0]]] * 2, [2])  # a confident, different token
    assert check_commit_stream([ref], [wrong], Precision("bfloat16", "bfloat16", None, None)).status == "fail"


def test_two_empty_commit_streams_match_completely():
    # A prompt answered with an immediate EOS in both frameworks is agreement, not drift.
    empty = CommitStream([1, 2], [], "stop")
    assert M.stream_metrics(empty, CommitStream([1, 2], [], "stop"))["token_match"] == 1.0
    one = _stream([[5]], [[[5, 7]]], [[[1.0, 0.5]]], [5])
    assert M.stream_metrics(empty, one)["token_match"] == 0.0


def test_layer_diagnostic_counts_the_positions_that_diverge():
    """A per-token event (one position of ten moves) is told apart from a wrong
    layer (every position moves): the first divergence says how many positions."""
    from dlm.verify import layers as LY
    from dlm.verify.weights import Precision

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((10, 32))
    one = ref.copy()
    one[4] = rng.standard_normal(32)
    every = ref + 0.8 * rng.standard_normal((10, 32))
    prec = Precision(label="float32", compute_dtype="float32", bits=None, mode=None)
    for got, below in ((one, 1), (every, 10)):
        summary = LY.agreement({"c": {"s": [ref, ref]}}, {"c": {"s": [ref, got]}}, prec)
        first = summary["first_divergence"]
        assert (first["layer"], first["positions"], first["positions_below"]) == (1, 10, below)
        assert f"at {below} of 10 positions" in LY.describe(summary)


def test_layer_local_feed_hands_each_layer_its_recorded_rows_and_names_a_mismatch():
    import mlx.core as mx

    from dlm.verify.local import Feed

    inputs = [np.arange(12, dtype=np.float32).reshape(3, 4), -np.arange(12, dtype=np.float32).reshape(3, 4)]
    feed = Feed("layers", inputs)
    own = mx.full((1, 2, 4), 7.0)
    got = feed.feed(own)  # layer 0 of the first call: rows 0-1
    assert np.array_equal(np.array(got[0]), inputs[0][:2])
    assert np.array_equal(np.array(feed.feed(got)[0]), inputs[1][:2])  # layer 1
    got = feed.feed(mx.zeros((1, 1, 4)))  # a second call (a chunk): the next row of layer 0
    assert np.array_equal(np.array(got[0]), inputs[0][2:])
    assert feed.first_input().shape == (3, 4) and (feed.first_input()[:2] == 7).all()  # MLX's own inputs
    with pytest.raises(DlmError, match=r"layers layer 1 takes \[1, 2, 4\] but the reference recorded 1 rows"):
        feed.feed(mx.zeros((1, 2, 4)))
