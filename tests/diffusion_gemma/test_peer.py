"""dlm-convert output against mlx-vlm 0.7.10's converter (skipped unless the peer is installed).

Install the peer as /work/main/.peer (mlx-vlm 0.7.10 and the pure-Python packages it imports, without deps):
    pip install --no-deps --target .peer mlx-vlm==0.7.10 requests certifi charset-normalizer idna urllib3 pillow
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from dlm.convert.pipeline import ConvertOptions, convert
from tests import PEER
from tests.builders import load_output

pytestmark = pytest.mark.skipif(not (PEER / "mlx_vlm").is_dir(), reason="mlx-vlm peer not installed in .peer")


def peer(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PEER), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_same_tensors_as_mlx_vlm_and_loadable_by_it(tiny_dg_dir, tmp_path):
    ours, theirs = tmp_path / "dlm", tmp_path / "vlm"
    convert(ConvertOptions(source=str(tiny_dg_dir), output=str(ours), quantize=True, progress=False),
            echo=lambda s: None)
    res = peer(f"from mlx_vlm.convert import main; import sys; sys.argv=['x','--hf-path',{str(tiny_dg_dir)!r},"
               f"'--mlx-path',{str(theirs)!r},'-q','--q-bits','4']; main()")
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = load_output(ours), load_output(theirs)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(np.array(a[k].view(mx.uint8)), np.array(b[k].view(mx.uint8))), k
    qa = json.loads((ours / "config.json").read_text())["quantization"]
    qb = json.loads((theirs / "config.json").read_text())["quantization"]
    # same entries, except that dlm also records the group-size fallbacks as false
    assert {k: v for k, v in qa.items() if v is not False} == qb
    res = peer(f"from pathlib import Path; from mlx_vlm.utils import load_model; load_model(Path({str(ours)!r}))")
    assert res.returncode == 0, res.stderr[-2000:]
