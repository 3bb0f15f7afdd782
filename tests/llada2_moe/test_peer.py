"""LLaDA-2 interchange with mlx-vlm 0.7.10 (skipped unless the peer is installed in .peer).

* dlm loads mlx-vlm's own conversion (``language_model.`` prefix, quantized
  embeddings and head) and computes the same logits and greedy tokens;
* mlx-vlm loads dlm's float conversion and generates the same greedy tokens
  where its rule equals the reference (steps == block length).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime import api
from tests import PEER
from tests.builders import build_llada2

pytestmark = pytest.mark.skipif(not (PEER / "mlx_vlm").is_dir(), reason="mlx-vlm peer not installed in .peer")
IDS = [list(range(5, 40))]

_PEER_RUN = """
import json, sys
import mlx.core as mx, numpy as np
from mlx_vlm import load
model, _ = load(sys.argv[1])
lm = model.language_model
ids = mx.array(json.loads(sys.argv[2]))
out = lm(ids)
np.save(sys.argv[3], np.array(getattr(out, "logits", out).astype(mx.float32)))
gen = lm.generate(ids, block_length=16, steps=16, gen_length=40, threshold=0.9, eos_id=-1, mask_id=255)
print(json.dumps(gen[0].tolist()))
"""


def peer_run(model_dir: Path, out_npy: Path) -> list[int]:
    env = dict(os.environ, PYTHONPATH=str(PEER), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", _PEER_RUN, str(model_dir), json.dumps(IDS), str(out_npy)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def dlm_run(model_dir: Path):
    loaded = api.load(model_dir)
    logits = np.array(loaded.model(mx.array(IDS)))
    # mlx-vlm (like the hub) may commit the mask id as a prediction; dlm never
    # does by default, so allow it here to compare the same rule. No stop token
    # on either side (mlx-vlm runs with eos_id=-1): both fill the whole budget.
    res = api.generate(loaded, IDS[0], {"max_tokens": 40, "block_length": 16, "max_denoising_steps": 16,
                                        "threshold": 0.9}, suppress_mask=False, stop_ids=[])
    return logits, res.token_ids


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    path = tmp_path_factory.mktemp("l2peer") / "hf"
    build_llada2(path, "base", dtype="bfloat16")
    return path


def test_dlm_loads_mlx_vlm_conversion(hub, tmp_path):
    theirs = tmp_path / "vlm"
    env = dict(os.environ, PYTHONPATH=str(PEER), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-m", "mlx_vlm", "convert", "--hf-path", str(hub), "--mlx-path",
                          str(theirs), "-q", "--q-bits", "4", "--dtype", "float32"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    keys = mx.load(str(theirs / "model.safetensors"))
    assert any(k.startswith("language_model.model.layers.1.mlp.switch_mlp.") for k in keys)
    assert "language_model.lm_head.scales" in keys  # mlx-vlm quantizes the head at --q-bits
    their_tokens = peer_run(theirs, tmp_path / "vlm.npy")
    logits, tokens = dlm_run(theirs)
    want = np.load(tmp_path / "vlm.npy")
    assert np.abs(logits - want).max() < 1e-3
    assert tokens == their_tokens


def test_mlx_vlm_loads_dlm_conversion(hub, tmp_path):
    ours = tmp_path / "dlm"
    convert(ConvertOptions(source=str(hub), output=str(ours), dtype="float32", progress=False), echo=lambda s: None)
    their_tokens = peer_run(ours, tmp_path / "vlm.npy")
    logits, tokens = dlm_run(ours)
    assert np.abs(logits - np.load(tmp_path / "vlm.npy")).max() < 1e-4
    assert tokens == their_tokens
