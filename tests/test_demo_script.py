"""scripts/demo.sh, the README's main job: convert the bundled DiffusionGemma
demo to 4-bit, verify parity, answer a task prompt — offline, end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT


@pytest.mark.slow
def test_demo_script_converts_verifies_and_answers(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", DLM_SKIP_SETUP="1", HF_HOME=str(tmp_path / "hf"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = tmp_path / "demo-4bit"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), str(out), "3141592653589793"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "RESULT: PASS" in proc.stdout
    assert "1123334555678999" in lines  # the answer, on its own line, spanning 3 canvases
    assert (out / "config.json").is_file() and "quantization" in (out / "config.json").read_text()
