"""Quantized kernels split by rows over the CPU streams
(dlm.runtime.models.cpu.streams) give bit-identical results: the kernels
alone, and whole 4-bit models of both families (experts, tied and untied
heads, self-conditioning) with the streams on vs off."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dlm.runtime import api
from dlm.runtime.models.cpu import streams as cpu_streams
from tests.builders import convert_dir


@pytest.fixture
def two_streams(monkeypatch):
    """Two CPU streams and no minimum piece size, whatever this machine has."""
    monkeypatch.setattr(cpu_streams._local, "streams", [mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)], raising=False)
    monkeypatch.setattr(cpu_streams, "MIN_ROWS", 1)


def test_split_kernels_are_bit_identical(two_streams):
    rng = np.random.default_rng(0)
    w = mx.array(rng.normal(size=(8, 96, 128)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.array(rng.normal(size=(37, 1, 1, 128)).astype(np.float32))
    idx = mx.array(rng.integers(0, 8, size=(37, 3)).astype(np.uint32))

    def gq(xs, ids):
        return mx.gather_qmm(xs, q, s, b, rhs_indices=ids, transpose=True, group_size=64, bits=4)

    assert cpu_streams.parallel()
    assert mx.array_equal(cpu_streams.split_rows(gq, x, idx), gq(x, idx))
    qw, qs, qb = mx.quantize(w[0], group_size=64, bits=8)
    h = mx.array(rng.normal(size=(3, 11, 128)).astype(np.float32))

    def qmm(rows):
        return mx.quantized_matmul(rows, qw, qs, qb, transpose=True, group_size=64, bits=8)

    assert mx.array_equal(cpu_streams.split_positions(qmm, h), qmm(h))


def test_light_work_splits_only_into_pieces_big_enough(two_streams):
    """A small vocabulary's rows run whole (a stream hand-off costs more than the
    second core saves); from two pieces of VOCAB_MIN_PIECE_BYTES they split."""
    calls = []

    def fn(rows):
        calls.append(rows.shape[0])
        return rows * 2

    row_bytes = 256 * 4  # a 256-entry float32 vocabulary
    for rows, pieces in [(32, 1), (2 * cpu_streams.VOCAB_MIN_PIECE_BYTES // row_bytes, 2)]:
        calls.clear()
        x = mx.ones((rows, 256))
        out = cpu_streams.split_rows(fn, x, min_piece_bytes=cpu_streams.VOCAB_MIN_PIECE_BYTES)
        assert len(calls) == pieces and mx.array_equal(out, x * 2)
    calls.clear()
    cpu_streams.split_rows(fn, mx.ones((32, 256)))  # heavy work per row (a quantized matmul): split
    assert len(calls) == 2


@pytest.fixture(scope="module")
def q4_models(tiny_dg_dir, tiny_llada2_mlx_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("q4_streams")
    return {"diffusion_gemma": convert_dir(tiny_dg_dir, root / "dg", quantize=True, q_bits=4),
            "llada2_moe": convert_dir(tiny_llada2_mlx_dir.parent / "hf", root / "llada2", quantize=True, q_bits=4)}


def _logits(family: str, path, streams_on: bool, monkeypatch):
    if not streams_on:  # one stream: parallel() is off (an empty list would be refilled)
        monkeypatch.setattr(cpu_streams._local, "streams", [mx.new_stream(mx.cpu)])
    loaded = api.load(path, compute_dtype="native")  # keep the 4-bit kernels (no dequantization at load)
    model = loaded.model
    ids = mx.array([[2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]], dtype=mx.int32)
    if family == "llada2_moe":
        return model(ids)
    cache = model.make_cache()
    model.prefill(ids[0].tolist(), cache, 64)
    canvas = mx.array([[30, 31, 32, 33, 34, 35, 36, 37]], dtype=mx.int32)
    first = model.decode(canvas, cache)
    return mx.concatenate([first, model.decode(canvas, cache, first)], axis=1)


@pytest.mark.parametrize("family", ["diffusion_gemma", "llada2_moe"])
def test_a_4bit_model_is_bit_identical_with_the_streams_on_and_off(q4_models, family, two_streams, monkeypatch):
    splits = []
    real = cpu_streams.split_rows
    def counted(fn, *arrays, **kw):
        if cpu_streams.parallel():  # (the softcap and the scores call it either way)
            splits.append(arrays[0].shape)
        return real(fn, *arrays, **kw)

    from dlm.runtime.models import switch

    monkeypatch.setattr(cpu_streams, "split_rows", counted)  # the heads (split_positions)
    monkeypatch.setattr(switch, "split_rows", counted)  # the experts
    on = _logits(family, q4_models[family], True, monkeypatch)
    assert len(splits) >= 2  # the experts' and the head's kernels ran split
    calls = len(splits)
    with monkeypatch.context() as m:
        off = _logits(family, q4_models[family], False, m)
    assert len(splits) == calls  # (nothing is split with the streams off)
    assert on.shape == off.shape and mx.array_equal(on, off)


def test_each_thread_splits_on_streams_of_its_own():
    """MLX streams belong to the thread that made them: a worker thread (the
    server's) splits on its own after the main thread has made its streams."""
    import threading

    if not cpu_streams.parallel():
        pytest.skip("one CPU core: nothing is split")
    x = mx.array(np.random.default_rng(1).normal(size=(4 * cpu_streams.MIN_ROWS, 64)).astype(np.float32))
    want = mx.exp(x)
    main = cpu_streams.cpu_streams()
    out = {}

    def work():
        try:
            out["streams"] = cpu_streams.cpu_streams()
            out["y"] = cpu_streams.split_rows(mx.exp, x)
            mx.eval(out["y"])
        except Exception as exc:  # noqa: BLE001  (reported below)
            out["error"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert out["streams"] is not main and mx.array_equal(out["y"], want)
