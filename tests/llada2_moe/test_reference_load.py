"""The whole-model LLaDA-2 reference load: no weight initialisation, tensors
read one at a time (peak memory the reference plus one tensor, measured),
values bit-identical to a ``load_state_dict`` of the whole checkpoint, and
clear errors for checkpoints that do not match their config."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm.runtime.platform.errors import WeightError
from dlm.verify.llada2_moe import adapter as A
from dlm.verify.llada2_moe import torch_model as R
from tests.builders import build_llada2
from tests.rss import RSS_PRELUDE

torch.set_num_threads(1)


def _state_dict_load(path, dtype):
    """What the loader did before: a float32 model (initialised), the whole
    checkpoint in memory, ``load_state_dict``, then ``.to(dtype)``."""
    cfg = json.loads((path / "config.json").read_text())
    model = R.LLaDA2Reference(R.RefConfig.from_dict(cfg))
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.word_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.is_floating_point():
        t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.numpy()


def _assert_same(got, want):
    g, w = got.state_dict(), want.state_dict()
    assert list(g) == list(w)
    for name in w:
        assert g[name].dtype == w[name].dtype, name
        assert np.array_equal(_bits(g[name]), _bits(w[name])), name
    ids = torch.tensor([[1, 5, 9, 200, 255, 255, 17, 3]])
    assert np.array_equal(_bits(got(ids)), _bits(want(ids)))


@pytest.mark.parametrize("stored,dtype", [("float32", "float32"), ("bfloat16", "float32"), ("float32", "bfloat16"),
                                          ("bfloat16", "bfloat16"), ("float16", "bfloat16"),
                                          ("float32", "float16")])
def test_whole_load_is_bit_identical_to_a_state_dict_load(tmp_path, stored, dtype):
    build_llada2(tmp_path, "base", dtype=stored, shards=2)
    want = _state_dict_load(tmp_path, getattr(torch, dtype))
    ref = A.load_reference(tmp_path, dtype=dtype)
    _assert_same(ref.model, want)


def test_tied_head_is_the_embedding(tmp_path):
    build_llada2(tmp_path, "flat", tie_word_embeddings=True)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    del state["lm_head.weight"]
    save_file(state, str(f), metadata={"format": "pt"})
    want = _state_dict_load(tmp_path, torch.float32)
    model = R.load_reference(tmp_path)
    assert model.lm_head.weight is model.model.word_embeddings.weight
    _assert_same(model, want)


def test_the_module_is_built_without_initialising_weights(tmp_path, monkeypatch):
    build_llada2(tmp_path, "flat")
    devices = []
    real = torch.nn.init.kaiming_uniform_

    def spy(tensor, *args, **kwargs):
        devices.append(tensor.device.type)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy)
    R.load_reference(tmp_path)
    A.load_reference(tmp_path, weights=load_file(str(tmp_path / "model.safetensors")))
    assert devices and set(devices) == {"meta"}  # nn.Linear's init ran on no data


def _rewrite(path, edit):
    f = path / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("model.layers.1.attention.dense.weight"), "no tensor model.layers.1.attention.dense.weight"),
    (lambda s: s.update(extra=torch.zeros(2)), "tensor extra has no counterpart"),
    (lambda s: s.update({"model.norm.weight": torch.ones(3)}), "model.norm.weight has shape [3]"),
])
def test_a_checkpoint_that_does_not_match_its_config(tmp_path, edit, message):
    build_llada2(tmp_path, "flat")
    _rewrite(tmp_path, edit)
    with pytest.raises(WeightError, match="does not match its config") as err:
        A.load_reference(tmp_path)
    assert message in str(err.value)


def test_a_truncated_checkpoint(tmp_path):
    build_llada2(tmp_path, "flat")
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(WeightError, match="cannot read the checkpoint: .* do not fit"):
        A.load_reference(tmp_path)


# Peak RSS increment of the whole-model load, per (checkpoint, reference
# dtype), in one subprocess (tests/rss.py).
_CHILD = r"""
from dlm.verify.llada2_moe import adapter as A

out = {}
for path, dtype in json.loads(sys.stdin.readline()):  # sent once the checkpoints are written
    before = reset_peak()
    ref = A.load_reference(path, dtype=dtype)
    unique = {id(t): t for t in ref.model.state_dict(keep_vars=True).values()}.values()
    out[path + "/" + dtype] = dict(peak=rss("VmHWM") - before,
                                   reference=sum(t.numel() * t.element_size() for t in unique),
                                   largest=max(t.numel() * t.element_size() for t in unique))
    del ref
print(json.dumps(out))
"""

# Wide experts (~26 MB per layer in float32), every layer sparse.
_WIDE = {"hidden_size": 256, "num_experts": 16, "moe_intermediate_size": 512, "first_k_dense_replace": 0,
         "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset the peak RSS")
def test_whole_load_peak_memory_is_the_reference_plus_one_tensor(tmp_path):
    """Before: the initialised float32 model and the whole checkpoint state
    dict at once (2x the reference for a float32 checkpoint). Now: the
    reference in its dtype and one tensor, at any depth and checkpoint dtype."""
    # The child (tests/rss.py's prelude and environment) imports while the
    # checkpoints are built; it reads its phases from stdin once they are.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    child = subprocess.Popen([sys.executable, "-c", RSS_PRELUDE + _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
    try:
        dirs = {}
        for stored, n in (("float32", 2), ("float32", 8), ("bfloat16", 8)):
            dirs[(stored, n)] = tmp_path / f"{stored}{n}"
            build_llada2(dirs[(stored, n)], "base", dtype=stored, num_hidden_layers=n, **_WIDE)
        phases = [(str(dirs[("float32", 2)]), "float32")]  # warm-up (first-call allocations), overwritten
        phases += [(str(dirs[k]), dtype) for k in dirs for dtype in ("float32", "bfloat16")]
        stdout, stderr = child.communicate(json.dumps(phases) + "\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, stderr[-3000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got[f"{dirs[('float32', 8)]}/float32"]["reference"] > 200e6  # the test can tell 1x from 2x
    for key, m in got.items():
        # Slack for the interpreter's own allocations; the old loader was over by the checkpoint's size.
        assert m["peak"] <= m["reference"] + 2 * m["largest"] + 8e6, (key, got)
    grown = {dtype: got[f"{dirs[('float32', 8)]}/{dtype}"]["peak"] - got[f"{dirs[('float32', 2)]}/{dtype}"]["peak"]
             for dtype in ("float32", "bfloat16")}
    held = {dtype: got[f"{dirs[('float32', 8)]}/{dtype}"]["reference"]
            - got[f"{dirs[('float32', 2)]}/{dtype}"]["reference"] for dtype in ("float32", "bfloat16")}
    for dtype, more in grown.items():
        assert more < 1.1 * held[dtype], (dtype, got)
