import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Tests never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_dg_dir(tmp_path_factory):
    """A tiny random DiffusionGemma checkpoint (hub config form), shared by tests."""
    from tiny_checkpoints import build_diffusion_gemma

    out = tmp_path_factory.mktemp("tiny_dg")
    build_diffusion_gemma(out, form="hub")
    return out


@pytest.fixture(scope="session")
def tiny_dg_mlx_dir(tiny_dg_dir, tmp_path_factory):
    """``tiny_dg_dir`` converted by dlm-convert (float32, text-only layout)."""
    from runtime_helpers import convert_dir

    return convert_dir(tiny_dg_dir, tmp_path_factory.mktemp("tiny_dg_mlx") / "f32")


@pytest.fixture(scope="session")
def tiny_dg_torch(tiny_dg_dir):
    """``tiny_dg_dir`` loaded by transformers (float32, eval): the reference."""
    from runtime_helpers import load_hf

    return load_hf(tiny_dg_dir)
