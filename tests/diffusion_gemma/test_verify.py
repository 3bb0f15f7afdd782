"""dlm-verify --parity end to end on tiny conversions: correct float32, bf16 and
4-bit conversions pass; the recorded-bundle path agrees with the live path;
CLI, report and model card."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dlm.verify import bundle as B  # noqa: E402
from dlm.verify.suite import Options, record, run_parity  # noqa: E402
from tests.builders import FAST_VERIFY, NO_TORCH_VERIFY, TINY_DRIFT, convert_dir, record_bundle, verify_options  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def conversions(tiny_dg_dir, tiny_dg_q4_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_conversions")
    return {
        "f32": convert_dir(tiny_dg_dir, root / "f32"),
        "bf16": convert_dir(tiny_dg_dir, root / "bf16", dtype="bfloat16"),
        "q4": tiny_dg_q4_dir,  # the session's (read-only)
    }


@pytest.fixture(scope="module")
def reference_bundle(tiny_dg_dir, tmp_path_factory):
    """The tiny reference recorded once (built-in prompts incl. the long one)."""
    return record_bundle(tiny_dg_dir, tmp_path_factory.mktemp("verify_bundle") / "bundle")


def statuses(report) -> dict:
    return {c.name: c.status for c in report.checks}


def test_float32_conversion_passes_live(conversions):
    # Default reference: the source the converter recorded in config.json.
    report = run_parity(conversions["f32"], verify_options())
    assert report.passed, report.table()
    assert statuses(report) == {"logits": "pass", "implementation": "pass", "implementation_layers": "pass",
                                "drift": "skip", "commit_stream": "pass"}
    logits = report.check("logits").metrics
    assert logits["max_abs"] < 1e-4 and logits["top1"] == 1.0 and logits["kl_mean"] < 1e-9
    assert logits["cases"] == report.cases >= 16
    case_names = set(report.check("logits").details["cases"])
    assert {"p0.arange", "p0.arange.sc", "p0.debug", "p0.debug.sc", "p0.next"} <= case_names
    stream = report.check("commit_stream")
    assert stream.metrics["identical_fraction"] == 1.0 and stream.metrics["tokens"] == 2 * 8


def test_bf16_conversion_passes(conversions, reference_bundle, monkeypatch):
    # Computing in bf16 (--compute-dtype native, what Metal/CUDA do by default):
    monkeypatch.setenv("DLM_COMPUTE_DTYPE", "native")
    report = run_parity(conversions["bf16"], verify_options(bundle=str(reference_bundle)))
    assert report.passed, report.table()
    assert report.precision["compute_dtype"] == "bfloat16"
    impl = report.check("implementation")
    # bf16 rounding: clearly not float32-exact, yet within the half-precision bounds.
    assert 1e-4 < impl.metrics["mean_abs"] < 0.1 and impl.precision_class == "half"
    # The CPU default upcasts the bf16 weights and computes in float32: the same
    # weights then agree to float32 precision, and the report says so.
    monkeypatch.delenv("DLM_COMPUTE_DTYPE")
    report = run_parity(conversions["bf16"], verify_options(bundle=str(reference_bundle)))
    assert report.passed, report.table()
    assert report.precision["compute_dtype"] == "bfloat16"  # what is stored sets the logits bounds
    assert report.check("implementation").metrics["max_abs"] < 1e-4
    assert any("computed in float32" in n for n in report.notes)


def test_q4_conversion_passes_with_tight_implementation_parity(conversions, reference_bundle):
    report = run_parity(conversions["q4"], verify_options(bundle=str(reference_bundle)))
    assert report.passed, report.table()
    assert report.precision["bits"] == 4 and report.precision["compute_dtype"] == "float32"
    assert report.precision["device"] == "cpu" and report.precision["float32_matmul"].startswith("full float32")
    assert "on MLX's cpu backend, float32 matmuls full float32" in report.card_markdown()
    impl = report.check("implementation").metrics
    assert impl["max_abs"] < 1e-4 and impl["top1"] == 1.0  # same weights: float32-exact
    logits = report.check("logits").metrics
    assert logits["mean_abs"] > 1e-3  # quantization error is there and measured
    drift = report.check("drift")
    assert drift.status == "pass" and drift.metrics["mlx_steps_per_canvas"] > 0
    assert 0.0 <= drift.metrics["commit_match"] <= 1.0
    assert report.check("commit_stream").metrics["identical_fraction"] == 1.0


def test_q4_drift_is_gated_with_default_thresholds(conversions, reference_bundle):
    # The real-checkpoint drift bounds flag the chaotic tiny model: the gate works.
    report = run_parity(conversions["q4"], Options(**{**FAST_VERIFY, "bundle": str(reference_bundle)}))
    assert statuses(report)["drift"] == "fail"
    assert any("commit_match" in f or "top1" in f for f in report.check("drift").failures)


def test_bundle_verdict_matches_live(conversions, tiny_dg_dir, reference_bundle):
    live = run_parity(conversions["q4"], verify_options(reference=str(tiny_dg_dir)))
    recorded = run_parity(conversions["q4"], verify_options(bundle=str(reference_bundle)))
    assert statuses(live) == statuses(recorded)
    assert live.passed == recorded.passed
    for name in ("logits", "implementation", "drift"):
        a, b = live.check(name).metrics, recorded.check(name).metrics
        for key in ("max_abs", "top1", "kl_mean", "commit_match"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (name, key)


def test_bundle_roundtrip_and_matched_section(conversions, tiny_dg_dir, tmp_path):
    data = record(str(tiny_dg_dir), Options(reference=str(tiny_dg_dir), long_prompt=False, **FAST_VERIFY),
                  mlx_dir=conversions["q4"])
    out = B.save(data, tmp_path / "b")
    loaded = B.load(out)
    assert [c.name for c in loaded.cases] == [c.name for c in data.cases]
    for name, value in data.original.logits.items():
        np.testing.assert_array_equal(loaded.original.logits[name], value)
    for case, again in zip(data.cases, loaded.cases):
        assert case.prompt_ids == again.prompt_ids
        for key in case.arrays:
            np.testing.assert_array_equal(case.arrays[key], again.arrays[key])
    s0, s1 = data.original.streams[0], loaded.original.streams[0]
    assert s0.tokens == s1.tokens and s0.steps_per_block == s1.steps_per_block
    np.testing.assert_array_equal(s0.blocks[0].topk_logits, s1.blocks[0].topk_logits)
    # Each step's entropies and accepted positions (acceptance near-ties) travel too.
    assert s0.blocks[0].step_scores.shape == s0.blocks[0].step_argmax.shape
    np.testing.assert_array_equal(s0.blocks[0].step_scores, s1.blocks[0].step_scores)
    np.testing.assert_array_equal(s0.blocks[0].step_accept, s1.blocks[0].step_accept)
    assert s1.blocks[0].step_accept.dtype == bool and s1.blocks[0].step_accept[0].any()
    assert loaded.matched is not None and loaded.matched.meta["fingerprint"]
    # The matched section is used (no live torch reference needed) for these exact weights.
    report = run_parity(conversions["q4"], verify_options(bundle=str(out)))
    assert "recorded in the bundle" in report.check("implementation").note
    assert report.passed, report.table()


def test_cli_report_and_model_card(conversions, reference_bundle, tmp_path):
    from click.testing import CliRunner

    from dlm.verify.cli import main

    model = tmp_path / "model"
    import shutil

    shutil.copytree(conversions["f32"], model)
    thresholds = tmp_path / "thr.json"
    thresholds.write_text(json.dumps(TINY_DRIFT))
    report_path = tmp_path / "out" / "report.json"
    result = CliRunner().invoke(main, [
        "--parity", str(model), "--bundle", str(reference_bundle), "--report", str(report_path),
        "--update-card", "--thresholds", str(thresholds), "--steps", "8", "--stream-prompts", "1", "--quiet",
    ])
    assert result.exit_code == 0, result.output
    assert "RESULT: PASS" in result.output and "implementation" in result.output
    data = json.loads(report_path.read_text())
    assert data["passed"] is True
    assert set(data["checks"]) == {"logits", "implementation", "implementation_layers", "drift", "commit_stream"}
    for check in data["checks"].values():
        assert {"metrics", "thresholds", "status", "passed"} <= set(check)
    assert data["checks"]["logits"]["thresholds"]["max_abs"] == ["<=", 1e-3]
    card = (model / "README.md").read_text()
    assert "<!-- dlm-verify:begin -->" in card and "dlm-verify passed" in card
    assert "Not verified yet" not in card and "Implementation parity" in card
    # Rerun replaces the section instead of appending a second one.
    again = CliRunner().invoke(main, [str(model), "--bundle", str(reference_bundle), "--update-card",
                                      "--thresholds", str(thresholds), "--steps", "8",
                                      "--stream-prompts", "1", "--no-implementation", "--quiet"])
    assert again.exit_code == 0, again.output
    assert (model / "README.md").read_text().count("<!-- dlm-verify:begin -->") == 1




def test_bundle_compare_on_a_machine_without_torch(conversions, tiny_dg_dir, tmp_path):
    """Record once with torch (plus the same-weights reference for this q4
    conversion), compare in a process where torch cannot be imported."""
    import subprocess
    import sys

    from click.testing import CliRunner

    from dlm.verify.cli import main

    bundle = tmp_path / "bundle"
    r = CliRunner().invoke(main, ["record", "--reference", str(tiny_dg_dir), "-o", str(bundle), "--mlx",
                                  str(conversions["q4"]), "--steps", "8", "--stream-prompts", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "with the MLX weights' reference" in r.output
    thresholds = tmp_path / "t.json"
    thresholds.write_text(json.dumps(TINY_DRIFT))
    script = tmp_path / "no_torch.py"
    script.write_text(NO_TORCH_VERIFY)
    out = subprocess.run(
        [sys.executable, str(script), "--parity", str(conversions["q4"]), "--bundle", str(bundle),
         "--thresholds", str(thresholds), "--report", str(tmp_path / "r.json"), "--quiet"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert {k: v["status"] for k, v in data["checks"].items()} == {
        "logits": "pass", "implementation": "pass", "implementation_layers": "pass", "drift": "pass",
        "commit_stream": "pass"}
    assert "recorded in the bundle" in data["checks"]["implementation"]["note"]
