"""LLaDA-2 over 2 and 3 ranks (``mlx.launch --backend ring`` on loopback): experts
split, heads and MLP features split where they divide, the vocabulary split;
token-identical to the single-process run (greedy, seeded, batched, structured;
float, 4-bit and LLaDA2.2), logits within float32 tolerance. DiffusionGemma's
checks share the launches (tests/distributed.py: family_ranks), one per rank count."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime.models.llada2_moe.shard import shard
from dlm.runtime.platform.distributed import DistributedError, World
from tests.distributed import family_models, family_ranks


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dg_dir, tiny_dg_mlx_dir, tiny_dg_vision_mlx_dir):
    return family_models(tmp_path_factory, tiny_dg_dir, tiny_dg_mlx_dir, tiny_dg_vision_mlx_dir)


def _same(alone: dict, ranks: dict) -> None:
    assert ranks["generate"] == alone["generate"]
    assert ranks["batch"] == alone["batch"]
    assert ranks["structured"] == alone["structured"]
    assert np.abs(np.array(ranks["logits"]) - np.array(alone["logits"])).max() < 1e-4


def _compared(n: int, models: dict, tmp_path_factory) -> dict:
    """Rank 0's results ({dir: results}), each checked against its single-process twin."""
    alone, ranks = family_ranks(n, models, tmp_path_factory)["llada2"]
    got = ranks[0]
    assert sorted(got) == sorted(alone)
    for d in alone:
        _same(alone[d], got[d])
    return got


def test_two_ranks_equal_one_process(models, tmp_path_factory):
    got = _compared(2, models, tmp_path_factory)
    assert len(got) == 3  # float, 4-bit, LLaDA2.2
    notes = got[str(models["llada2"]["float"])]["notes"]
    assert "attention heads split (2 query / 1 KV heads per rank)" in notes
    assert "experts split (8 of 16 on rank 0); router replicated" in notes
    assert "vocabulary split (128 of 256 rows of the head and the embedding per rank)" in notes


def test_three_ranks_split_unevenly(models, tmp_path_factory):
    got = _compared(3, models, tmp_path_factory)
    notes = got[str(models["llada2"]["float"])]["notes"]
    assert "attention replicated (4 query / 2 KV heads over 3 ranks)" in notes  # 2 KV heads: no 3-way split
    assert "experts split (6 of 16 on rank 0); router replicated" in notes  # 6, 5, 5


def test_a_model_that_cannot_split_is_refused_naming_it(models):
    from dlm.runtime import api

    loaded = api.load(models["llada2"]["float"])
    with pytest.raises(DistributedError, match="16 experts do not split over 32 ranks"):
        shard(loaded.model, World(group=None, rank=0, size=32))
