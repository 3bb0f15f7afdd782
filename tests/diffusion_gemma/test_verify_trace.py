"""``dlm-verify --parity ... --trace-dir DIR``: a broken conversion's commit
stream diverges, and the side-by-side page shows both frameworks' steps with
the report's first divergence."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from dlm.runtime.trace import html as trace_html  # noqa: E402
from dlm.verify.cli import main  # noqa: E402
from tests.builders import convert_dir, mutate, record_bundle  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tiny_dg_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_trace")
    prompts = root / "prompts.txt"
    prompts.write_text(json.dumps({"ids": [2, 10, 11, 12, 13]}) + "\n")
    bundle = record_bundle(tiny_dg_dir, root / "bundle", builtin_prompts=False, prompts_file=str(prompts),
                           long_prompt=False)
    return convert_dir(tiny_dg_dir, root / "good"), bundle


def swap_gate_up(t):
    for k in sorted(t):
        if k.startswith("model.decoder.layers.") and k.endswith("experts.gate_up_proj.weight"):
            half = t[k].shape[1] // 2
            t[k] = np.concatenate([t[k][:, half:], t[k][:, :half]], axis=1)


def verify(model, bundle, traces, report):
    # Without the same-weights reference the commit streams are compared with the original weights.
    return CliRunner().invoke(main, ["--parity", str(model), "--bundle", str(bundle), "--no-implementation",
                                     "--trace-dir", str(traces), "--report", str(report), "--quiet"])


def test_divergence_page(setup, tmp_path):
    good, bundle = setup
    mutant = mutate(good, tmp_path / "broken", swap_gate_up)
    r = verify(mutant, bundle, tmp_path / "traces", tmp_path / "report.json")
    assert r.exit_code == 1, r.output
    page = tmp_path / "traces" / "commit-stream-prompt0.html"
    report = json.loads((tmp_path / "report.json").read_text())
    row = report["checks"]["commit_stream"]["details"]["prompts"][0]
    assert row["divergence"] is not None
    assert any(str(page) in note for note in report["notes"])
    data = trace_html.read(page)
    assert data["format"] == "dlm-trace-pair/1" and data["divergence"] == row["divergence"]
    ref, mlx = data["sides"]
    assert [c["steps"] for c in ref["canvases"]] == row["reference_steps"]
    assert [c["steps"] for c in mlx["canvases"]] == row["mlx_steps"]
    assert ref["token_ids"] == [t for c in ref["canvases"] for t in c["committed"]]
    d = data["divergence"]
    left, right = ref["canvases"][d["block"]]["records"], mlx["canvases"][d["block"]]["records"]
    assert d["step"] is not None and d["position"] >= 0  # the broken experts flip an argmax
    assert left[d["step"]]["pred"][d["position"]] == d["reference_token"]
    assert right[d["step"]]["pred"][d["position"]] == d["mlx_token"]
    assert left[d["step"]]["pred"][: d["position"]] == right[d["step"]]["pred"][: d["position"]]
    assert all(a["pred"] == b["pred"] for a, b in zip(left[: d["step"]], right))
    assert data["sides"][0]["vocab"]  # decoded with the converted model's tokenizer


def test_no_page_for_a_faithful_conversion(setup, tmp_path):
    good, bundle = setup
    r = verify(good, bundle, tmp_path / "traces", tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    check = report["checks"]["commit_stream"]
    assert check["status"] == "pass" and check["details"]["prompts"][0]["divergence"] is None, r.output
    assert not (tmp_path / "traces").exists()
