"""``dlm-run generate --trace FILE.html`` on both families: the page's embedded
data agrees with the same run's ``--json`` output, and tracing changes nothing."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dlm.runtime.trace import html as trace_html
from dlm.runtime.cli.main import main
from dlm.runtime.trace import EDITED, FIXED, MASKED, STOP_REASONS

DG = ["--prompt", "hello", "--max-tokens", "20", "--seed", "0", "--max-denoising-steps", "6",
      "--diffusion-min-canvas-length", "8", "--diffusion-max-canvas-length", "8"]
LLADA = ["--prompt-ids", "5,9,14,20,33,41,7", "--max-tokens", "30", "--block-length", "8",
         "--max-denoising-steps", "4", "--threshold", "0.9", "--seed", "0"]


def generate(model, args, trace=None):
    extra = ["--trace", str(trace)] if trace else []
    r = CliRunner().invoke(main, ["generate", "--model", str(model), *args, "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r.stderr


def shown(record) -> list[int]:
    """The token each position shows after a step: the one it holds, else the prediction."""
    held = dict((p, t) for p, t in record.get("held", []))
    return [held.get(p, t) for p, t in enumerate(record["pred"])]


def check_against_json(data, out):
    """What every trace must agree on with the run's own --json."""
    assert data["token_ids"] == out["token_ids"]
    assert [c["steps"] for c in data["canvases"]] == out["steps_per_canvas"]
    assert [len(c["records"]) for c in data["canvases"]] == out["steps_per_canvas"]
    assert [len(c["committed"]) for c in data["canvases"]] == out["tokens_per_canvas"]
    assert [t for c in data["canvases"] for t in c["committed"]] == out["token_ids"]
    assert data["answer"] == out["text"] and data["reasoning"] == out["reasoning"]
    assert data["finish_reason"] == out["finish_reason"]
    assert data["stats"]["steps_per_block"] == out["stats"]["steps_per_block"]
    assert data["prompt"]["ids"] == out["prompt_ids"]
    assert all(c["stop_reason"] in STOP_REASONS for c in data["canvases"])
    assert any(line.startswith("Tokens per forward:") for line in data["profile"])
    assert all(str(t) in data["vocab"] for t in out["token_ids"])


def test_diffusion_gemma_trace_matches_json(tiny_dg_mlx_dir, tmp_path):
    page = tmp_path / "dg.html"
    out, err = generate(tiny_dg_mlx_dir, DG, page)
    assert f"trace: {page}" in err
    data = trace_html.read(page)
    assert data["unit"] == "canvas" and data["family"] == "DiffusionGemma"
    check_against_json(data, out)
    assert len(data["canvases"]) == 3  # 20 tokens in canvases of 8
    for canvas in data["canvases"]:
        assert canvas["length"] == 8 and canvas["step_budget"] == 6
        # DiffusionGemma commits the last step's argmax (cut at the budget or an EOS).
        last = canvas["records"][-1]
        assert last["pred"][: len(canvas["committed"])] == canvas["committed"]
        for record in canvas["records"]:
            assert len(record["pred"]) == len(record["status"]) == len(record["entropy"]) == 8
            assert 0.4 <= record["schedule"] <= 0.8 and record["temperature"] == record["schedule"]
        expected = "step-budget" if canvas["steps"] == 6 else "stable-and-confident"
        assert canvas["stop_reason"] == expected
    assert data["canvases"][-1]["ends_output"] == ("eos" if out["finish_reason"] == "stop" else "budget")
    assert data["settings"]["resolved"]["denoise"]["steps"] == 6 and data["settings"]["options"]["seed"] == 0
    assert "sc_dtype" not in data["settings"]["resolved"]["denoise"]  # an internal, no option sets it
    # The trace is an observer: the same run without it commits the same tokens in the same steps.
    plain, _ = generate(tiny_dg_mlx_dir, DG)
    assert plain["token_ids"] == out["token_ids"] and plain["steps_per_canvas"] == out["steps_per_canvas"]


def test_llada2_trace_matches_json(tiny_llada2_mlx_dir, tmp_path):
    page = tmp_path / "llada.html"
    out, _ = generate(tiny_llada2_mlx_dir, LLADA, page)
    data = trace_html.read(page)
    assert data["unit"] == "block" and data["family"] == "LLaDA-2" and data["status_names"][MASKED] == "masked"
    check_against_json(data, out)
    for canvas in data["canvases"]:
        start, lo, hi = canvas["start"], canvas["output_from"], canvas["output_to"]
        final = shown(canvas["records"][-1])
        # The block as it stands after its last step holds what was committed.
        assert final[lo: lo + len(canvas["committed"])] == canvas["committed"]
        for record in canvas["records"]:
            status = [int(c) for c in record["status"]]
            assert all(s == FIXED for s in status[:lo]) and FIXED not in status[lo:]
            assert record["threshold"] == 0.9 and record["temperature"] == 0.0
            assert len(record["confidence"]) == 8
        if canvas["stop_reason"] == "all-revealed":
            assert MASKED not in [int(c) for c in canvas["records"][-1]["status"][lo:hi]]
        assert canvas["length"] == 8 and start % 8 == 0
    assert data["canvases"][0]["output_from"] == 7 % 8  # the prompt's last block holds 7 prompt tokens
    # The page's resolved options are what options set, not the loop's hooks and internal switches.
    resolved = data["settings"]["resolved"]
    assert resolved["steps"] == 4 and resolved["threshold"] == 0.9
    assert not {"on_step", "uniforms", "trace", "step_trace", "kv_cache", "suppress_mask", "early_stop",
                "stop_on_role_end"} & set(resolved)
    plain, _ = generate(tiny_llada2_mlx_dir, LLADA)
    assert plain["token_ids"] == out["token_ids"] and plain["steps_per_canvas"] == out["steps_per_canvas"]


def test_llada2_editing_trace(tiny_llada2_mlx_dir, tmp_path):
    """LLaDA2.1 editing with threshold 0: every changed prediction is an edit,
    until the post-step budget runs out."""
    page = tmp_path / "edit.html"
    args = LLADA + ["--editing-threshold", "0.0", "--max-post-steps", "2"]
    out, _ = generate(tiny_llada2_mlx_dir, args, page)
    data = trace_html.read(page)
    check_against_json(data, out)
    statuses = [int(c) for canvas in data["canvases"] for r in canvas["records"] for c in r["status"]]
    assert EDITED in statuses
    assert {c["stop_reason"] for c in data["canvases"]} <= {"post-step-budget", "edits-settled"}


def test_trace_path_checked_before_the_model_loads(tmp_path):
    r = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "no-model"), "--prompt", "x",
                                  "--trace", str(tmp_path / "missing" / "t.html")])
    assert r.exit_code == 1
    assert f"error: --trace {tmp_path / 'missing' / 't.html'}: folder {tmp_path / 'missing'} does not exist" \
        in r.stderr
    r = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "no-model"), "--prompt", "x",
                                  "--trace", str(tmp_path)])
    assert r.exit_code == 1 and "is a directory" in r.stderr


def test_help_names_the_flags():
    from dlm.verify.cli import main as verify_main

    r = CliRunner().invoke(main, ["generate", "-h"])
    assert "--trace FILE.html" in r.output and "HTML page" in " ".join(r.output.split())
    r = CliRunner().invoke(verify_main, ["-h"])
    assert "--trace-dir DIRECTORY" in r.output and "HTML trace" in " ".join(r.output.split())
