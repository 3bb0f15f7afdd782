"""dlm-verify catches real bugs: deliberately broken conversions each fail a
named check.

Converter bugs (tensors broken on disk) must fail ``logits`` (vs the original
weights) while ``implementation`` (the reference run with the very same broken
weights) still passes: the suite says *where* the bug is. A runtime bug (a RoPE
frequency off, monkeypatched into the MLX model) fails ``implementation``.
"""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dlm.verify.suite import run_parity  # noqa: E402
from tests.builders import convert_dir, mutate, record_bundle, verify_options  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def good(tiny_dg_dir, tmp_path_factory):
    return convert_dir(tiny_dg_dir, tmp_path_factory.mktemp("mutants") / "good")


@pytest.fixture(scope="module")
def bundle(tiny_dg_dir, tmp_path_factory):
    # One prompt with a short commit stream is enough to show each bug.
    return record_bundle(tiny_dg_dir, tmp_path_factory.mktemp("mutants_bundle") / "b",
                         builtin_prompts=True, long_prompt=False)




def layers(tensors: dict, suffix: str) -> list[str]:
    return sorted(k for k in tensors if k.startswith("model.decoder.layers.") and k.endswith(suffix))


def swap_gate_up(t):
    for k in layers(t, "experts.gate_up_proj.weight"):
        half = t[k].shape[1] // 2
        t[k] = np.concatenate([t[k][:, half:], t[k][:, :half]], axis=1)


def swap_layer_scalars(t):
    for k in layers(t, ".layer_scalar"):
        enc = k.replace("model.decoder.", "model.encoder.language_model.")
        t[k], t[enc] = t[enc].copy(), t[k].copy()


def drop_router_scale(t):
    # What a converter that forgot router.scale leaves: the module's init value 1.
    for k in layers(t, "router.scale"):
        t[k] = np.ones_like(t[k])


def permute_one_expert(t):
    # Layer 0's experts 0 and 1 trade weights: the router still picks by index.
    for proj in ("gate_up_proj", "down_proj"):
        k = f"model.decoder.layers.0.experts.{proj}.weight"
        t[k] = t[k][[1, 0] + list(range(2, t[k].shape[0]))]


@pytest.mark.parametrize("edit", [swap_gate_up, swap_layer_scalars, drop_router_scale, permute_one_expert],
                         ids=lambda f: f.__name__)
def test_converter_bug_fails_logits_check(edit, good, bundle, tmp_path):
    mutant = mutate(good, tmp_path / edit.__name__, edit)
    report = run_parity(mutant, verify_options(bundle=str(bundle)))
    assert not report.passed
    logits = report.check("logits")
    assert logits.status == "fail", report.table()
    assert logits.metrics["max_abs"] > 1e-2 and any("max_abs" in f for f in logits.failures)
    # Same weights on both sides: the runtime is not to blame.
    assert report.check("implementation").status == "pass", report.table()


def test_runtime_rope_bug_fails_implementation_check(good, bundle, monkeypatch):
    from dlm.runtime.models.diffusion_gemma import layers as layers_mod

    real = layers_mod.make_rope_freqs

    def off_by_one_frequency(head_dim, params, where):
        periods = np.array(real(head_dim, params, where))
        periods[1] *= 1.5  # one rotary frequency off
        import mlx.core as mx

        return mx.array(periods)

    monkeypatch.setattr(layers_mod, "make_rope_freqs", off_by_one_frequency)
    report = run_parity(good, verify_options(bundle=str(bundle)))
    impl = report.check("implementation")
    assert impl.status == "fail", report.table()
    assert impl.metrics["max_abs"] > 1e-2
    assert report.check("logits").status == "fail"


def test_cli_exit_status_on_a_broken_conversion(good, bundle, tmp_path):
    from click.testing import CliRunner

    from dlm.verify.cli import main

    mutant = mutate(good, tmp_path / "broken", swap_gate_up)
    result = CliRunner().invoke(main, ["--parity", str(mutant), "--bundle", str(bundle), "--steps", "8",
                                       "--stream-prompts", "1", "--quiet"])
    assert result.exit_code == 1, result.output
    assert "RESULT: FAIL" in result.output and "✗ logits: max_abs" in result.output
