"""LLaDA-2 over 2 and 3 ranks (``mlx.launch --backend ring`` on loopback): experts
split, heads and MLP features split where they divide, the vocabulary split;
token-identical to the single-process run (greedy, seeded, batched, structured;
float, 4-bit and LLaDA2.2), logits within float32 tolerance."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from dlm.runtime.models.llada2_moe.shard import shard
from dlm.runtime.platform.distributed import DistributedError, World
from tests import ROOT
from tests.builders import build_llada2, build_llada22, convert_dir
from tests.distributed import read, start
from tests.llada2_moe import distributed_run

SCRIPT = str(ROOT / "tests" / "llada2_moe" / "distributed_run.py")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("l2dist")
    build_llada2(root / "hf")
    build_llada22(root / "hf22")
    return {"float": convert_dir(root / "hf", root / "f32"),
            "q4": convert_dir(root / "hf", root / "q4", quantize=True, q_bits=4, q_group_size=32),
            "v22": convert_dir(root / "hf22", root / "v22")}


def _same(alone: dict, ranks: dict) -> None:
    assert ranks["generate"] == alone["generate"]
    assert ranks["batch"] == alone["batch"]
    assert ranks["structured"] == alone["structured"]
    assert np.abs(np.array(ranks["logits"]) - np.array(alone["logits"])).max() < 1e-4


def _compared(n: int, dirs: list, out) -> dict:
    """The ranks' results ({dir: results}); the single-process twins are computed
    meanwhile, in this process, and checked against them."""
    proc = start(n, [sys.executable, SCRIPT, *map(str, dirs), str(out)])
    alone = {str(d): distributed_run.results(str(d)) for d in dirs}
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert out.exists(), read(proc.err)[-3000:]
    got = json.loads(out.read_text())
    for d in dirs:
        _same(alone[str(d)], got[str(d)])
    return got


def test_two_ranks_equal_one_process(models, tmp_path):
    got = _compared(2, [models["float"], models["q4"], models["v22"]], tmp_path / "two.json")
    notes = got[str(models["float"])]["notes"]
    assert "attention heads split (2 query / 1 KV heads per rank)" in notes
    assert "experts split (8 of 16 on rank 0); router replicated" in notes
    assert "vocabulary split (128 of 256 rows of the head and the embedding per rank)" in notes


def test_three_ranks_split_unevenly(models, tmp_path):
    got = _compared(3, [models["float"]], tmp_path / "three.json")
    notes = got[str(models["float"])]["notes"]
    assert "attention replicated (4 query / 2 KV heads over 3 ranks)" in notes  # 2 KV heads: no 3-way split
    assert "experts split (6 of 16 on rank 0); router replicated" in notes  # 6, 5, 5


def test_a_model_that_cannot_split_is_refused_naming_it(models):
    from dlm.runtime import api

    loaded = api.load(models["float"])
    with pytest.raises(DistributedError, match="16 experts do not split over 32 ranks"):
        shard(loaded.model, World(group=None, rank=0, size=32))
