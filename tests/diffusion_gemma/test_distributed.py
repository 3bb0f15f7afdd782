"""DiffusionGemma over 2 and 3 ranks (``mlx.launch --backend ring`` on loopback):
experts split (2+1+1 over 3 ranks), sliding-layer attention split by KV head
where the heads divide (the full layer's single KV head replicated), dense MLP
features and the vocabulary split; token-identical to the single-process run
(greedy, seeded, batched, structured; float and 4-bit; a prompt with an image at
2 ranks), logits of a plain and a self-conditioned forward within float32
tolerance; every rank the same. Wall time is mostly each rank's start (importing
transformers for the tokenizer), not the generation: LLaDA-2's checks share these
launches (tests/distributed.py: family_ranks), one per rank count."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime import api
from dlm.runtime.models.diffusion_gemma import shard as dg_shard
from dlm.runtime.platform.distributed import DistributedError, World
from tests.distributed import family_models, family_ranks


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dg_dir, tiny_dg_mlx_dir, tiny_dg_vision_mlx_dir):
    return family_models(tmp_path_factory, tiny_dg_dir, tiny_dg_mlx_dir, tiny_dg_vision_mlx_dir)


def _same(alone: dict, ranks: dict) -> None:
    for key in ("greedy", "seeded", "batch", "json", "image"):
        assert ranks.get(key) == alone.get(key), key
    for want, got in zip(alone["logits"], ranks["logits"]):
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-4


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_equal_one_process(n, models, tmp_path_factory):
    count = len(models["dg"]) if n == 2 else 1  # 4-bit and the image at 2 ranks only: time
    alone, ranks = family_ranks(n, models, tmp_path_factory)["dg"]
    assert len(alone) == count and len(ranks) == n
    for rank in ranks:
        assert len(rank) == count
        for want, got in zip(alone, rank):
            _same(want, got)
    notes = ranks[0][0]["notes"]
    assert notes == ranks[-1][0]["notes"]
    if n == 2:
        assert "image" in ranks[0][2]
        assert "routed experts: expert parallel, 4 per layer as 2+2 over the ranks (routers replicated)" in notes
        assert "attention: tensor parallel by KV head in layers 0-4 (sliding)" in notes
        assert "attention replicated in layer 5: 1 KV head(s) do not divide over 2 ranks" in notes
        assert "attention: tensor parallel by KV head in layers 0-4 (sliding)" in ranks[0][1]["notes"]  # 4-bit
    else:
        assert "routed experts: expert parallel, 4 per layer as 2+1+1 over the ranks (routers replicated)" in notes
        assert "attention replicated in layers 0-4: 2 KV head(s) do not divide over 3 ranks" in notes
    assert any(line.startswith("vocabulary: tied embedding / output head and self-conditioning product split")
               for line in notes)


def test_a_split_that_cannot_work_is_refused_before_slicing(tiny_dg_mlx_dir):
    loaded = api.load(tiny_dg_mlx_dir)
    table = loaded.model.model.decoder.embed_tokens["weight"].shape
    with pytest.raises(DistributedError, match="routed experts: 4 per layer cannot split over 5 ranks"):
        dg_shard.shard(loaded.model, World(group=None, rank=0, size=5))
    assert loaded.model.model.decoder.embed_tokens["weight"].shape == table  # nothing sliced
    assert loaded.model.model.decoder.vocab_shard is None
