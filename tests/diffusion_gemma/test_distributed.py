"""DiffusionGemma over 2 and 3 ranks (``mlx.launch --backend ring`` on loopback):
experts split (2+1+1 over 3 ranks), sliding-layer attention split by KV head
where the heads divide (the full layer's single KV head replicated), dense MLP
features and the vocabulary split; token-identical to the single-process run
(greedy, seeded, batched, structured; float and 4-bit; a prompt with an image at
2 ranks), logits of a plain and a self-conditioned forward within float32
tolerance; every rank the same. Wall time is mostly each rank's start (importing
transformers for the tokenizer), not the generation."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from dlm.runtime import api
from dlm.runtime.models.diffusion_gemma import shard as dg_shard
from dlm.runtime.platform.distributed import DistributedError, World
from tests import ROOT
from tests.builders import convert_dir
from tests.diffusion_gemma import distributed_checks
from tests.distributed import launch

SCRIPT = str(ROOT / "tests" / "diffusion_gemma" / "distributed_checks.py")


@pytest.fixture(scope="module")
def targets(tiny_dg_dir, tiny_dg_mlx_dir, tiny_dg_vision_mlx_dir, tmp_path_factory):
    """Float, 4-bit (groups of 32 everywhere: o_proj splits at a head boundary) and
    the vision model with an image."""
    q4 = convert_dir(tiny_dg_dir, tmp_path_factory.mktemp("dg_dist") / "q4", quantize=True, q_bits=4,
                     q_group_size=32, recipe="uniform")
    return [str(tiny_dg_mlx_dir), str(q4), f"{tiny_dg_vision_mlx_dir}+image"]


@pytest.fixture(scope="module")
def alone(targets):
    """The checks in this process (no group), as the ranks write them (JSON)."""
    return json.loads(json.dumps(distributed_checks.run(targets)))


def _launched(n: int, targets: list[str], tmp_path) -> list:
    out = tmp_path / "ranks"
    r = launch(n, [sys.executable, SCRIPT, str(out), *targets], timeout=300)
    files = [tmp_path / f"ranks.{rank}.json" for rank in range(n)]
    assert all(f.exists() for f in files), r.stdout[-2000:] + r.stderr[-4000:]
    return [json.loads(f.read_text()) for f in files]


def _same(alone: dict, ranks: dict) -> None:
    for key in ("greedy", "seeded", "batch", "json", "image"):
        assert ranks.get(key) == alone.get(key), key
    for want, got in zip(alone["logits"], ranks["logits"]):
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-4


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_equal_one_process(n, targets, alone, tmp_path):
    count = len(targets) if n == 2 else 1  # 4-bit and the image at 2 ranks only: time
    ranks = _launched(n, targets[:count], tmp_path)
    for rank in ranks:
        assert len(rank) == count
        for want, got in zip(alone, rank):
            _same(want, got)
    notes = ranks[0][0]["notes"]
    assert notes == ranks[-1][0]["notes"]
    if n == 2:
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
