"""The same-weights reference's fast paths: torch-threaded dequantization
(bit-identical to mx.dequantize) and lockstep passes over a layer-streamed
reference (each layer read once for all independent passes, errors raised)."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

from dlm.runtime.platform.errors import WeightError  # noqa: E402
from dlm.verify import dequant  # noqa: E402
from dlm.verify.streaming import LayerStreamer, MappingSource, empty_parameters  # noqa: E402


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_fast_dequantize_is_bit_identical_to_mlx(bits, group_size):
    rng = np.random.default_rng(bits * 1000 + group_size)
    w = mx.array(rng.standard_normal((3, 40, 256)).astype(np.float32) * 0.05)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    # The runtime's upcast scales (float32) from stored bfloat16 ones, as dlm-verify uses them.
    scales = scales.astype(mx.bfloat16).astype(mx.float32)
    biases = biases.astype(mx.bfloat16).astype(mx.float32)
    want = np.array(mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits))
    assert dequant.supported(bits, "affine", packed, scales, biases)
    got = dequant.dequantize(packed, scales, biases, group_size, bits)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want)


def test_other_layouts_are_left_to_mlx():
    w = mx.zeros((4, 128))
    for bits in (3, 6):
        packed, scales, biases = mx.quantize(w, group_size=64, bits=bits)
        assert not dequant.supported(bits, "affine", packed, scales, biases)
    packed, scales, biases = mx.quantize(w, group_size=64, bits=4)
    assert not dequant.supported(4, "affine", packed, scales.astype(mx.bfloat16), biases)
    assert dequant.maybe_dequantize(packed, scales, None, {"bits": 4, "group_size": 64}) is None


class _Stack(torch.nn.Module):
    def __init__(self, n: int, width: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _streamed(n=4, width=8, drop=None):
    rng = np.random.default_rng(0)
    weights = {f"layers.{i}.weight": rng.standard_normal((width, width)).astype(np.float32) for i in range(n)}
    whole = _Stack(n, width)
    whole.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    if drop:
        del weights[drop]
    with empty_parameters():
        model = _Stack(n, width)
    streamer = LayerStreamer(model, MappingSource(weights), torch.float32, {"layers": list(model.layers)},
                             optional=lambda name: True)
    return whole, model, streamer


def test_lockstep_reads_each_layer_once_and_matches_passes_run_alone():
    whole, model, streamer = _streamed()
    inputs = [torch.randn(2 + i, 8, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    got = streamer.lockstep([lambda x=x: model(x) for x in inputs])
    assert streamer.layer_loads == 4  # not 5 passes x 4 layers
    for x, y in zip(inputs, got):
        with torch.no_grad():
            assert torch.equal(whole(x), y)
    # A job that raises: its error comes out, the others still finish (no deadlock).
    def bad():
        raise ValueError("boom")
    with pytest.raises(ValueError, match="boom"):
        streamer.lockstep([lambda: model(inputs[0]), bad, lambda: model(inputs[1])])
    streamer.close()


def test_lockstep_missing_tensor_fails_every_waiting_pass_naming_it():
    _, model, streamer = _streamed(drop="layers.2.weight")
    x = torch.randn(3, 8)
    with pytest.raises(WeightError, match="layers.2.weight"):
        streamer.lockstep([lambda: model(x), lambda: model(x), lambda: model(x)])
    streamer.close()


class _Tied(torch.nn.Module):
    """Two stacks over the same parameters (as DiffusionGemma's encoder and decoder layers)."""

    def __init__(self, n: int, width: int):
        super().__init__()
        self.enc = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(n))
        self.dec = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(n))
        for e, d in zip(self.enc, self.dec):
            d.weight = e.weight

    def forward(self, x, stacks: str):
        for name in stacks:  # "ed": an encoder pass, then a decoder pass
            for layer in self.enc if name == "e" else self.dec:
                x = torch.tanh(layer(x))
        return x


def test_layers_with_the_same_parameters_share_one_load_in_lockstep():
    """A pass one stack ahead of another (the 'next' case: an extra encoder pass)
    goes through encoder layer i together with the others' decoder layer i."""
    n, width = 3, 8
    rng = np.random.default_rng(1)
    weights = {f"enc.{i}.weight": rng.standard_normal((width, width)).astype(np.float32) for i in range(n)}
    whole = _Tied(n, width)
    whole.load_state_dict({**{k: torch.from_numpy(v) for k, v in weights.items()},
                           **{k.replace("enc", "dec"): torch.from_numpy(v) for k, v in weights.items()}})
    with empty_parameters():
        model = _Tied(n, width)
    streamer = LayerStreamer(model, MappingSource(weights), torch.float32,
                             {"enc": list(model.enc), "dec": list(model.dec)})
    x = torch.randn(2, width)
    # Prefill + decode, twice, and prefill + committed-canvas encode + decode: without
    # sharing, 4 stack loads (the second encoder pass waits for the decoder's); with it, 3.
    plans = ("ed", "ed", "eed")
    got = streamer.lockstep([lambda p=p: model(x, p) for p in plans])
    assert streamer.layer_loads == 3 * n
    with torch.no_grad():
        for y, plan in zip(got, plans):
            assert torch.equal(whole(x, plan), y)
    streamer.close()
