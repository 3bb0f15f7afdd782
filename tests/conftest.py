import contextlib
import os

import pytest

# Tests never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# dlm.runtime before any test module: it loads the optimized BLAS ahead of MLX
# (dlm/runtime/blas.py); a module importing mlx.core first would leave the whole
# session on the reference BLAS.
import dlm.runtime  # noqa: E402,F401


@pytest.fixture(scope="session")
def tiny_dg_dir(tmp_path_factory):
    """A tiny random DiffusionGemma checkpoint (hub config form), shared by tests."""
    from tests.builders import build_diffusion_gemma

    out = tmp_path_factory.mktemp("tiny_dg")
    build_diffusion_gemma(out, form="hub")
    return out


@pytest.fixture(scope="session")
def tiny_dg_mlx_dir(tiny_dg_dir, tmp_path_factory):
    """``tiny_dg_dir`` converted by dlm-convert (float32, text-only layout)."""
    from tests.builders import convert_dir

    return convert_dir(tiny_dg_dir, tmp_path_factory.mktemp("tiny_dg_mlx") / "f32")


@pytest.fixture(scope="session")
def tiny_dg_vision_dir(tmp_path_factory):
    """A tiny random multimodal DiffusionGemma (2-layer vision tower, processor files)."""
    from tests.builders import build_diffusion_gemma

    out = tmp_path_factory.mktemp("tiny_dg_vision")
    build_diffusion_gemma(out, form="hub", vision=True, seed=3)
    return out


@pytest.fixture(scope="session")
def tiny_dg_vision_mlx_dir(tiny_dg_vision_dir, tmp_path_factory):
    """``tiny_dg_vision_dir`` converted by dlm-convert (float32, vision tower kept)."""
    from tests.builders import convert_dir

    return convert_dir(tiny_dg_vision_dir, tmp_path_factory.mktemp("tiny_dg_vision_mlx") / "f32")


@pytest.fixture(scope="session")
def tiny_dg_vision_torch(tiny_dg_vision_dir):
    """``tiny_dg_vision_dir`` loaded by transformers (float32, eval): the reference."""
    from tests.builders import load_diffusion_gemma_hf

    return load_diffusion_gemma_hf(tiny_dg_vision_dir)


@pytest.fixture(scope="session")
def tiny_llada2_mlx_dir(tmp_path_factory):
    """A tiny random LLaDA-2 checkpoint converted by dlm-convert (float32)."""
    from tests.builders import build_llada2, convert_dir

    root = tmp_path_factory.mktemp("tiny_llada2")
    build_llada2(root / "hf", "base")
    return convert_dir(root / "hf", root / "f32")


@pytest.fixture(scope="session")
def tiny_dg_torch(tiny_dg_dir):
    """``tiny_dg_dir`` loaded by transformers (float32, eval): the reference."""
    from tests.builders import load_diffusion_gemma_hf

    return load_diffusion_gemma_hf(tiny_dg_dir)


@contextlib.contextmanager
def _serving(app, timeout: float = 30.0):
    """Serve ``app`` with uvicorn on 127.0.0.1 and a free port in a background thread;
    yields the base URL."""
    import threading
    import time

    import uvicorn

    from dlm.runtime.cli.serve import bind

    sock = bind("127.0.0.1", 0)  # as dlm-run serve binds (TCP_NODELAY on its connections)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


@pytest.fixture(scope="session")
def serving():
    """The loopback harness for a dlm server app: ``with serving(app) as base_url: ...``."""
    return _serving


@pytest.fixture(scope="module")
def one_torch_thread():
    """The PyTorch reference on one thread for a module's tests (2 shared cores)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_dg_q4_dir(tiny_dg_dir, tmp_path_factory):
    """``tiny_dg_dir`` converted by dlm-convert to 4 bits (group size 32), converted
    once for the session: read-only (copy it before changing anything in it)."""
    from tests.builders import convert_dir

    return convert_dir(tiny_dg_dir, tmp_path_factory.mktemp("tiny_dg_q4") / "q4", quantize=True, q_bits=4,
                       q_group_size=32)
