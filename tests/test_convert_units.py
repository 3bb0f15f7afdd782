"""Units of dlm-convert: the lazy reader, shard planning, quantization specs, row chunking."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dlm.convert import pipeline
from dlm.convert.pipeline import ConvertOptions, convert
from dlm.convert.reader import CheckpointReader
from dlm.convert.writer import OutTensor, plan_shards
from dlm.quantize.recipes import QuantizationError, make_spec
from tests.builders import load_output, mx_bits


def test_reader_reads_bf16_rows_lazily(tmp_path):
    torch.manual_seed(0)
    t = {"a": torch.randn(3, 5, 8).to(torch.bfloat16), "b": torch.randn(7).to(torch.float16),
         "c": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    save_file(t, str(tmp_path / "model.safetensors"))
    with CheckpointReader(tmp_path) as r:
        assert r.metadata() == {"a": ((3, 5, 8), "BF16"), "b": ((7,), "F16"), "c": ((2, 3), "I64")}
        rows = r.read_rows("a", 4, 11)  # rows of the [15, 8] view, across the first axis
        assert rows.dtype == mx.bfloat16 and rows.shape == (7, 8)
        assert np.array_equal(mx_bits(rows), t["a"].reshape(15, 8)[4:11].view(torch.int16).numpy())
        assert np.array_equal(mx_bits(r.read("b")), t["b"].view(torch.int16).numpy())
        assert np.array_equal(np.array(r.read("c")), t["c"].numpy())


def test_plan_shards_keeps_groups_whole_and_isolates_oversize():
    def group(*sizes):
        return [OutTensor(f"t{i}-{s}", (s,), mx.uint8) for i, s in enumerate(sizes)]

    groups = [group(40, 30), group(50), group(500), group(10, 10)]
    shards = plan_shards(groups, max_bytes=100)
    assert [[t.name for t in s.tensors] for s in shards] == [
        ["t0-40", "t1-30"], ["t0-50"], ["t0-500"], ["t0-10", "t1-10"]]
    assert [s.file for s in shards] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert [t.offset for t in shards[0].tensors] == [0, 40]
    assert plan_shards([group(5)])[0].file == "model.safetensors"


@pytest.mark.parametrize("mode,expect", [("affine", (4, 64)), ("mxfp4", (4, 32)), ("nvfp4", (4, 16)),
                                         ("mxfp8", (8, 32))])
def test_mode_defaults(mode, expect):
    spec = make_spec(None, None, mode)
    assert (spec.bits, spec.group_size, spec.mode) == (*expect, mode)
    w = mx.random.normal((4, 64))
    assert len(spec.quantize(w)) == len(spec.parts())


def test_invalid_specs():
    with pytest.raises(QuantizationError, match="fixed at 8 bits"):
        make_spec(4, None, "mxfp8")
    with pytest.raises(QuantizationError, match="--q-bits 7"):
        make_spec(7, None, "affine")


def test_row_chunking_is_exact(tiny_dg_dir, tmp_path, monkeypatch):
    """Tiny tensors fit one chunk; force many (odd-sized) chunks and compare with one-chunk output."""
    whole, chunked = tmp_path / "whole", tmp_path / "chunked"
    convert(ConvertOptions(source=str(tiny_dg_dir), output=str(whole), quantize=True, progress=False),
            echo=lambda s: None)
    monkeypatch.setattr(pipeline, "CHUNK_BYTES", 3 * 64 * 4)  # 3 rows of the 64-wide tensors
    convert(ConvertOptions(source=str(tiny_dg_dir), output=str(chunked), quantize=True, progress=False),
            echo=lambda s: None)
    a, b = load_output(whole), load_output(chunked)
    assert set(a) == set(b)
    for k in a:
        assert np.array_equal(np.array(a[k].view(mx.uint8)), np.array(b[k].view(mx.uint8))), k
