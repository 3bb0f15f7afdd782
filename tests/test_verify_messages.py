"""What dlm-verify prints says what happened (issue 42): transformers' expected
noise is silenced by name while real warnings still show; the precision line
names what MLX computed in; a checkpoint that is not a conversion is called
that; --trace-dir says when it wrote nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import ROOT
from tests.builders import build_diffusion_gemma, build_llada2, convert_dir

torch = pytest.importorskip("torch")

UNTYPED = "to instantiate a model of type ``"
ROPE = "`rope_scaling` is deprecated"
FAST = ["--torch-threads", "1", "--no-layer-local", "--logits-prompts", "1", "--stream-prompts", "1",
        "--canvases", "1", "--no-builtin-prompts"]

# Runs dlm-verify's CLI with the tokenizer load made to emit one real transformers
# warning and one real FutureWarning of its own beside transformers' expected noise.
SCRIPT = textwrap.dedent("""
    import logging, sys, warnings
    import transformers
    real = transformers.AutoTokenizer.from_pretrained.__func__

    def loud(cls, *a, **k):
        logging.getLogger("transformers.configuration_utils").warning("a REAL transformers warning")
        warnings.warn("a REAL FutureWarning", FutureWarning)
        return real(cls, *a, **k)

    transformers.AutoTokenizer.from_pretrained = classmethod(loud)
    from dlm.verify.cli import main
    sys.argv = ["dlm-verify"] + sys.argv[1:]
    main()
""")


def run_cli(*args, loud=False):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", SCRIPT, *args] if loud else [sys.executable, "-m", "dlm.verify.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=str(ROOT))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_messages")
    build_llada2(root / "l2hf", "base")
    build_diffusion_gemma(root / "dghf", form="hub")
    (root / "prompts.txt").write_text(json.dumps({"ids": [2, 10, 11, 12, 13]}) + "\n")
    return {"root": root, "l2": convert_dir(root / "l2hf", root / "l2mlx"),
            "dg_bf16": convert_dir(root / "dghf", root / "dgbf16", dtype="bfloat16"), "dghf": root / "dghf"}


def test_llada2_verify_drops_transformers_expected_noise_and_keeps_real_warnings(models):
    r = run_cli("--parity", str(models["l2"]), "--quiet", "--prompts", str(models["root"] / "prompts.txt"),
                *FAST, loud=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert UNTYPED not in r.stderr and ROPE not in r.stderr, r.stderr
    assert "a REAL transformers warning" in r.stderr and "a REAL FutureWarning" in r.stderr


def test_dg_bf16_verify_quiet_has_no_loading_bar_and_names_what_mlx_computed_in(models):
    r = run_cli("--parity", str(models["dg_bf16"]), "--quiet", "--no-images",
                "--prompts", str(models["root"] / "prompts.txt"), *FAST)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Loading weights" not in r.stderr, r.stderr
    if "were upcast at load" in r.stdout:  # the CPU backend: the header no longer claims bf16 compute
        assert "precision bfloat16 (stored in bfloat16, MLX computed in float32)" in r.stdout
        assert "computes in bfloat16" not in r.stdout
    else:  # a GPU backend computes in the stored bfloat16
        assert "precision bfloat16 (computes in bfloat16)" in r.stdout


def test_parity_on_an_original_checkpoint_says_it_is_not_a_conversion(models):
    r = run_cli("--parity", str(models["dghf"]), "--quiet")
    assert r.returncode == 2
    assert "is not a dlm-convert conversion" in r.stderr and "dlm-convert" in r.stderr
    assert "records no source" not in r.stderr


def test_parity_on_a_hub_repo_id_says_to_convert_it():
    r = run_cli("--parity", "some-org/some-model", "--quiet")
    assert r.returncode == 2
    assert "no such directory" in r.stderr and "dlm-convert some-org/some-model -o MLX_DIR" in r.stderr


def test_trace_dir_says_when_nothing_diverged(models, tmp_path):
    traces, report = tmp_path / "traces", tmp_path / "report.json"
    r = run_cli("--parity", str(models["l2"]), "--quiet", "--prompts", str(models["root"] / "prompts.txt"),
                "--trace-dir", str(traces), "--report", str(report), *FAST)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not traces.exists()
    note = f"--trace-dir {traces}: no page written: the commit stream agrees with the PyTorch reference"
    assert note in r.stdout and any(n.startswith(note) for n in json.loads(report.read_text())["notes"])
