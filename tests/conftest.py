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
