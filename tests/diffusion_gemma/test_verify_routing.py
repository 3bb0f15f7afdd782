"""dlm-verify's per-layer diagnostic and layer-local check against MLX bugs
on DiffusionGemma (dlm.verify.layers, dlm.verify.local, dlm.verify.routes):

* an MLX routing flip (one canvas position of one decoder layer sent to an
  expert its router did not pick) is named by the routing record, where the
  hidden states first diverge, and by the layer-local row; the same-weights
  reference of a 4-bit model follows MLX's routing and judges the flip by its
  own router margin;
* a wrong MLX layer fails only that layer in the layer-local row, where the
  end-to-end agreement blames every layer after it too.
"""

import mlx.core as mx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from dlm.verify import layers as L  # noqa: E402
from dlm.verify.suite import run_parity  # noqa: E402
from tests.builders import verify_options  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _flip_decoder_layer_1_position_3(monkeypatch):
    """MLX routes canvas position 3 of decoder layer 1 to an expert it did not
    pick, weighted as its router weighs that choice."""
    from dlm.runtime.models.diffusion_gemma.layers import DecoderLayer, linear, rms_norm

    real = DecoderLayer._mix

    def mix(self, x, attn):
        h, m1, xe, weights, idx = real(self, x, attn)
        if self.index == 1 and idx.shape[0] == 8:  # the decoder's 8-position canvas
            r = self.router
            z = rms_norm(h, None, r.eps) * r["scale"].astype(h.dtype) * r.root
            probs = mx.softmax(linear(r.proj, z).astype(mx.float32), axis=-1).reshape(idx.shape[0], -1)
            n = probs.shape[-1]
            present = (mx.arange(n)[:, None] == idx[3][None, :]).any(axis=1)
            other = mx.argmin(present).astype(idx.dtype)  # the first expert position 3 does not use
            k = idx.shape[1]
            at = (mx.arange(8)[:, None] == 3) & (mx.arange(k)[None, :] == k - 1)
            idx = mx.where(at, other, idx)  # (inside mx.compile: no host reads)
            w = mx.take_along_axis(probs, idx, axis=-1)
            weights = w / w.sum(axis=-1, keepdims=True) * r["per_expert_scale"][idx].astype(mx.float32)
        return h, m1, xe, weights, idx

    monkeypatch.setattr(DecoderLayer, "_mix", mix)


@pytest.fixture(scope="module")
def f32_reports(one_torch_thread, tiny_dg_dir, tiny_dg_mlx_dir):
    """The float32 conversion's reports as is and with the flip (the same
    options): the two tests below read different parts of the same runs."""
    options = verify_options(reference=str(tiny_dg_dir), long_prompt=False, stream_prompts=0, stream_layers=True)
    plain = run_parity(tiny_dg_mlx_dir, options)
    with pytest.MonkeyPatch.context() as mp:
        _flip_decoder_layer_1_position_3(mp)
        flipped = run_parity(tiny_dg_mlx_dir, options)
    return plain, flipped


def test_layer_diagnostic_finds_a_routing_flip(f32_reports):
    """float32 conversion (the original reference is the same-weights one): the
    routing record names the flipped layer and position, with the reference's
    margin, and it is where the hidden states first diverge. Unflipped, every
    token routing agrees."""
    plain, flipped = f32_reports
    summary = plain.layers["implementation"]
    assert summary["routing"]["flips"] == 0 and summary["routing"]["routed"] > 100
    assert "token routings agree" in L.describe(summary)

    summary = flipped.layers["implementation"]
    first = summary["routing"]["first_flip"]
    assert (first["stack"], first["layer"], first["position"]) == ("decoder", 1, 3)
    assert first["gap"] > 0 and len(first["mlx_only"]) == 1
    div = summary["first_divergence"]
    assert (div["stack"], div["layer"], div["position"], div["positions_below"]) == ("decoder", 1, 3, 1)
    assert "where the hidden states first diverge" in L.describe(summary)


def test_layer_local_check_fails_on_a_clear_routing_flip(f32_reports):
    """The layer-local row (a float32 conversion: from the original reference's
    record) passes as is, and fails on a flip at a clear router margin, naming
    the layer and position; that position is left out of the layer's numbers."""
    plain, flipped = f32_reports
    row = next(c for c in plain.checks if c.name == "implementation_layers")
    assert row.status == "pass" and row.metrics["routing_flips"] == 0 and row.metrics["excused"] == 0

    row = next(c for c in flipped.checks if c.name == "implementation_layers")
    assert row.status == "fail" and row.metrics["routing_flips"] == 1
    assert any("decoder layer 1 position 3" in f for f in row.failures), row.failures
    stage = next(r for r in row.details["cases"]["p0.arange"]["stages"] if r["stage"] == "decoder 1")
    assert stage["excused"] == 1 and stage["cosine_min"] > 0.99999


def test_layer_local_check_names_only_the_wrong_layer(tiny_dg_dir, tiny_dg_vision_dir, tiny_dg_vision_mlx_dir,
                                                      tmp_path, monkeypatch):
    """A bug in one MLX layer (its output off by 1e-3, relative): the end-to-end
    layers after it inherit the error; fed the reference's input, only that
    layer (in the encoder and the decoder, which share its code) fails, every
    other stage agrees to float32 rounding. With images: the image case too."""
    from dlm.runtime.models.diffusion_gemma.layers import DecoderLayer

    real = DecoderLayer.__call__

    def wrong(self, x, *args, **kwargs):
        out = real(self, x, *args, **kwargs)
        if self.index == 2 and out is not None:
            out = out * (1 + 1e-3 * mx.sin(mx.arange(out.shape[-1], dtype=out.dtype)))
        return out

    monkeypatch.setattr(DecoderLayer, "__call__", wrong)
    report = run_parity(tiny_dg_vision_mlx_dir, verify_options(reference=str(tiny_dg_vision_dir),
                                                               long_prompt=False, stream_prompts=0))
    row = next(c for c in report.checks if c.name == "implementation_layers")
    assert row.status == "fail" and any("rel_max" in f for f in row.failures), row.failures
    cases = row.details["cases"]
    assert any(c.startswith("image.") for c in cases), list(cases)
    for case, c in cases.items():
        bad = {r["stage"] for r in c["stages"] if r["rel_max"] > 1e-4}
        assert bad == {"encoder 2", "decoder 2"}, (case, bad)
        assert max(r["rel_max"] for r in c["stages"] if r["stage"] not in bad) < 1e-5, case
    # End to end, the layers after it carry the error on.
    later = report.layers["implementation"]["cases"]["p0.arange"]["stacks"]["encoder"][3]
    assert later["rel_max"] > 1e-4


def test_the_same_weights_reference_follows_mlx_routing(tiny_dg_dir, tiny_dg_q4_dir, monkeypatch):
    """4-bit: the same-weights reference routes as MLX routed (dlm.verify.routes).
    A flip then leaves the logits and hidden states equal, and the check judges
    the reference's own margin for the expert it was made to take: a clear one
    fails the row naming the layer and position, one within the bound passes."""
    q4 = tiny_dg_q4_dir
    # No layer-local row (local=False): nothing here reads it, and the reference's
    # layer-local record runs on its own routing, outside the forced one.
    options = verify_options(reference=str(tiny_dg_dir), long_prompt=False, stream_layers=True, local=False)
    report = run_parity(q4, options)
    impl = report.check("implementation")
    assert impl.status == "pass" and impl.metrics["routing_forced"] > 100 and impl.metrics["routing_flips"] == 0
    assert impl.details["routing"]["unforced"] == 0  # every routing keyed on both sides, streams too
    assert any("followed MLX's routing" in n for n in report.notes)

    _flip_decoder_layer_1_position_3(monkeypatch)
    report = run_parity(q4, options)
    impl = report.check("implementation")
    assert impl.status == "fail" and impl.metrics["max_abs"] < 1e-4  # followed: the logits agree
    assert impl.metrics["routing_flips"] >= 1 and impl.metrics["routing_margin_max"] > 1e-3
    assert any("routing margin_max" in f and "decoder layer 1 position 3" in f for f in impl.failures)
    assert report.check("commit_stream").metrics["identical_fraction"] == 1.0
    layers = report.layers["implementation"]
    assert layers["first_divergence"] is None and layers["routing"]["first_flip"]["layer"] == 1

    # Within the bound: the implementation check alone, on one prompt's logits
    # cases (the flip is in every decoder canvas: no commit streams needed), still
    # with the flip and its clear margin, passes.
    loose = verify_options(reference=str(tiny_dg_dir), long_prompt=False, stream_layers=True, local=False,
                           logits_prompts=1, stream_prompts=0,
                           thresholds={**options.thresholds, "routing": {"margin_max": 100.0}})
    impl = run_parity(q4, loose).check("implementation")
    assert impl.metrics["routing_flips"] >= 1 and impl.metrics["routing_margin_max"] > 1e-3
    assert impl.status == "pass"
