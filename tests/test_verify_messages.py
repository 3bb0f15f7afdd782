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


def start_cli(*args, loud=False) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", SCRIPT, *args] if loud else [sys.executable, "-m", "dlm.verify.cli", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(ROOT))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_messages")
    build_llada2(root / "l2hf", "base")
    build_diffusion_gemma(root / "dghf", form="hub")
    (root / "prompts.txt").write_text(json.dumps({"ids": [2, 10, 11, 12, 13]}) + "\n")
    return {"root": root, "l2": convert_dir(root / "l2hf", root / "l2mlx"),
            "dg_bf16": convert_dir(root / "dghf", root / "dgbf16", dtype="bfloat16"), "dghf": root / "dghf"}


@pytest.fixture(scope="module")
def runs(models):
    """Every dlm-verify run of this module, started at once (each process pays
    the CLI's imports; none reads another's output), each awaited in full."""
    prompts, traces = str(models["root"] / "prompts.txt"), models["root"] / "trace_dir"
    traces.mkdir()
    started = {
        "l2_loud": start_cli("--parity", str(models["l2"]), "--quiet", "--prompts", prompts, *FAST, loud=True),
        "dg_bf16": start_cli("--parity", str(models["dg_bf16"]), "--quiet", "--no-images", "--prompts", prompts,
                             *FAST),
        "original": start_cli("--parity", str(models["dghf"]), "--quiet"),
        "hub_id": start_cli("--parity", "some-org/some-model", "--quiet"),
        "trace_dir": start_cli("--parity", str(models["l2"]), "--quiet", "--prompts", prompts,
                               "--trace-dir", str(traces / "traces"), "--report", str(traces / "report.json"),
                               *FAST),
    }
    done = {}
    try:
        for name, p in started.items():
            out, err = p.communicate(timeout=300)
            done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    return dict(done, traces=traces)


def test_llada2_verify_drops_transformers_expected_noise_and_keeps_real_warnings(runs):
    r = runs["l2_loud"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert UNTYPED not in r.stderr and ROPE not in r.stderr, r.stderr
    assert "a REAL transformers warning" in r.stderr and "a REAL FutureWarning" in r.stderr


def test_dg_bf16_verify_quiet_has_no_loading_bar_and_names_what_mlx_computed_in(runs):
    r = runs["dg_bf16"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Loading weights" not in r.stderr, r.stderr
    if "were upcast at load" in r.stdout:  # the CPU backend: the header no longer claims bf16 compute
        assert "precision bfloat16 (stored in bfloat16, MLX computed in float32)" in r.stdout
        assert "computes in bfloat16" not in r.stdout
    else:  # a GPU backend computes in the stored bfloat16
        assert "precision bfloat16 (computes in bfloat16)" in r.stdout


def test_parity_on_an_original_checkpoint_says_it_is_not_a_conversion(runs):
    r = runs["original"]
    assert r.returncode == 2
    assert "is not a dlm-convert conversion" in r.stderr and "dlm-convert" in r.stderr
    assert "records no source" not in r.stderr


def test_parity_on_a_hub_repo_id_says_to_convert_it(runs):
    r = runs["hub_id"]
    assert r.returncode == 2
    assert "no such directory" in r.stderr and "dlm-convert some-org/some-model -o MLX_DIR" in r.stderr


def test_trace_dir_says_when_nothing_diverged(runs):
    traces, report = runs["traces"] / "traces", runs["traces"] / "report.json"
    r = runs["trace_dir"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not traces.exists()
    note = f"--trace-dir {traces}: no page written: the commit stream agrees with the PyTorch reference"
    assert note in r.stdout and any(n.startswith(note) for n in json.loads(report.read_text())["notes"])
