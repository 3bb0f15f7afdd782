"""dlm-verify with layer-streamed references (dlm.verify.streaming) and the
per-layer hidden-state diagnostic (dlm.verify.layers), on both families.

* a streamed reference (transformers' DiffusionGemma with and without images,
  dlm's LLaDA-2 reference, a LLaDA-2 checkpoint's own modeling code) computes
  exactly what the whole-model reference computes: logits, vision features,
  commit streams, hidden states and the same-weights run, through bundles;
* the diagnostic names the layer whose weight a converted copy perturbs;
* peak memory of a streamed reference forward is flat in depth, where the
  whole-model reference's grows with it (peak RSS in a subprocess).

MLX routing flips and the layer-local check: tests/diffusion_gemma/test_verify_routing.py.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from dlm.verify import bundle as B  # noqa: E402
from dlm.verify.suite import Options, record, run_parity  # noqa: E402
from tests.builders import (  # noqa: E402
    FAST_VERIFY, build_diffusion_gemma, build_llada2, convert_dir, verify_options,
)
from tests.llada2_remote_code import write_llada2_remote_code  # noqa: E402
from tests.rss import RSS_PRELUDE  # noqa: E402

@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def _record(hf, mlx, streamed: bool, **kw):
    opts = Options(reference=str(hf), long_prompt=False, stream_layers=streamed,
                   **{**FAST_VERIFY, "canvases": 1, "steps": 4, **kw})
    return record(str(hf), opts, mlx_dir=mlx)


def _assert_same_run(a: B.ReferenceRun, b: B.ReferenceRun, tol: float = 1e-6):
    assert sorted(a.logits) == sorted(b.logits) and a.logits
    for name in a.logits:
        assert np.abs(a.logits[name] - b.logits[name]).max() <= tol, name
    for name in a.features:
        assert np.abs(a.features[name] - b.features[name]).max() <= tol, name
    assert sorted(a.image_logits) == sorted(b.image_logits)
    for name in a.image_logits:
        assert np.abs(a.image_logits[name] - b.image_logits[name]).max() <= tol, name
    for sa, sb in zip(a.streams + a.image_streams, b.streams + b.image_streams, strict=True):
        assert sa.tokens == sb.tokens and sa.steps_per_block == sb.steps_per_block
        for x, y in zip(sa.blocks, sb.blocks):
            assert np.array_equal(x.step_argmax, y.step_argmax)
            assert np.abs(x.topk_logits - y.topk_logits).max() <= tol
    assert sorted(a.hidden) == sorted(b.hidden) and a.hidden
    for case in a.hidden:
        for stack, layers in a.hidden[case].items():
            assert len(layers) == len(b.hidden[case][stack])
            for x, y in zip(layers, b.hidden[case][stack]):
                assert (x is None) == (y is None), (case, stack, [v is None for v in layers], [v is None for v in b.hidden[case][stack]])
                if x is not None:
                    assert np.abs(x - y).max() <= tol, (case, stack)


def _same_verdicts(a, b, tol: float = 1e-6):
    assert {c.name: c.status for c in a.checks} == {c.name: c.status for c in b.checks}
    for x, y in zip(a.checks, b.checks):
        for k, v in x.metrics.items():
            if isinstance(v, float):
                assert abs(v - y.metrics[k]) <= tol * max(1.0, abs(v)), (x.name, k)


def test_streamed_diffusion_gemma_equals_whole_through_bundles(tiny_dg_dir, tiny_dg_mlx_dir, tmp_path):
    whole = _record(tiny_dg_dir, tiny_dg_mlx_dir, False)
    streamed = _record(tiny_dg_dir, tiny_dg_mlx_dir, True)
    assert whole.original.meta["mode"] == "whole" and streamed.original.meta["mode"] == "streamed"
    assert streamed.matched.meta["mode"] == "streamed"
    # The logits cases run in lockstep (dlm.verify.lockstep): far fewer layer
    # reads than a decoder pass per case one after the other (6 * 14).
    loads = streamed.original.meta["timings"]["logits_layer_loads"]
    assert loads < 6 * len(streamed.cases)
    # Encoder layer N is decoder layer N: a 'next' case's committed-canvas encode goes
    # through with the other cases' decoder pass (5 passes over the 6 layers; 6 apart).
    assert loads <= 5 * 6 and streamed.matched.meta["timings"]["logits_layer_loads"] <= 5 * 6
    saved = [B.load(B.save(b, tmp_path / name)) for b, name in ((whole, "whole"), (streamed, "streamed"))]
    # A recorded bundle carries each reference phase's resident peak.
    assert saved[1].original.meta["rss_gb"]["reference: logits"]["peak"] > 0
    assert set(saved[1].matched.meta["rss_gb"]) == {"reference (MLX weights): logits",
                                                     "reference (MLX weights): commit streams",
                                                     "reference (MLX weights): layer-local"}
    # The layer-local record (dlm.verify.local): inputs, outputs, routers and logits of the first case.
    local = saved[1].matched.hidden["local:p0.arange"]
    assert {"encoder:inputs", "decoder:inputs", "logits"} <= set(local) and len(local["encoder:inputs"]) == 6
    for a, b in ((whole, streamed), tuple(saved)):
        _assert_same_run(a.original, b.original)
        _assert_same_run(a.matched, b.matched)
    assert set(saved[1].original.hidden["p0.arange"]) == {"encoder", "decoder", "encoder:routes", "decoder:routes"}
    assert len(saved[1].original.hidden["p0.arange"]["encoder"]) == 6  # the last one too (MLX skips it)
    reports = [run_parity(tiny_dg_mlx_dir, verify_options(bundle=str(tmp_path / n))) for n in ("whole", "streamed")]
    _same_verdicts(*reports)
    assert reports[1].passed, reports[1].table()
    assert reports[1].streaming["reference"] == "streamed"
    layers = reports[1].layers["implementation"]
    assert layers["first_divergence"] is None
    assert [r["layer"] for r in layers["cases"]["p0.arange"]["stacks"]["encoder"]] == [0, 1, 2, 3, 4]
    assert len(layers["cases"]["p0.arange"]["stacks"]["decoder"]) == 6
    out = tmp_path / "r.json"
    reports[1].write_json(out)
    doc = json.loads(out.read_text())
    assert doc["streaming"]["implementation"] == "streamed" and "layers" in doc
    assert "Per-layer hidden states" in reports[1].card_markdown()
    assert "layer by layer" in reports[1].table()
    row = next(c for c in reports[1].checks if c.name == "implementation_layers")
    assert row.status == "pass" and row.metrics["stages"] == 2 + 5 + 6 + 1  # two inputs, the layers, the logits
    assert row.metrics["rel_max"] < 1e-5, row.metrics


def test_streamed_diffusion_gemma_with_images_equals_whole(tiny_dg_vision_dir, tiny_dg_vision_mlx_dir):
    whole = _record(tiny_dg_vision_dir, tiny_dg_vision_mlx_dir, False)
    streamed = _record(tiny_dg_vision_dir, tiny_dg_vision_mlx_dir, True)
    assert streamed.original.features and streamed.original.image_streams
    assert any(c.startswith("image.") for c in streamed.original.hidden)
    _assert_same_run(whole.original, streamed.original)
    _assert_same_run(whole.matched, streamed.matched)


def test_streamed_llada2_equals_whole_and_remote_code(tiny_llada2_mlx_dir, tmp_path):
    hf = tiny_llada2_mlx_dir.parent / "hf"
    whole = _record(hf, tiny_llada2_mlx_dir, False)
    streamed = _record(hf, tiny_llada2_mlx_dir, True)
    _assert_same_run(whole.original, streamed.original)
    _assert_same_run(whole.matched, streamed.matched)
    # Every logits case runs through the same layers in lockstep: each layer is read once.
    n_layers = streamed.config["num_hidden_layers"]
    assert streamed.original.meta["timings"]["logits_layer_loads"] == n_layers
    assert streamed.matched.meta["timings"]["logits_layer_loads"] == n_layers
    # The checkpoint's own modeling code, streamed the same way (--trust-remote-code).
    from dlm.verify.llada2_moe import adapter as A

    build_llada2(tmp_path, "flat")
    write_llada2_remote_code(tmp_path, logit_offset=3.0)
    refs = [A.load_reference(tmp_path, trust_remote_code=True, stream=s) for s in (False, True)]
    assert refs[1].streamer is not None and "modeling code" in refs[1].notes[0]
    for case in A.logit_cases(refs[0].config, [[3, 1, 4, 1, 5]], {}):
        got = [A.reference_logits(r, case, {}) for r in refs]
        assert np.abs(got[0] - got[1]).max() <= 1e-6, case.name


def test_cli_stream_layers_uses_the_streamed_budget(tiny_llada2_mlx_dir, tmp_path, monkeypatch):
    """--stream-layers: both references stream, and unset budgets take the
    streamed defaults (logits cases for 1 prompt, 1 canvas of at most 4 steps
    for 1 prompt; dlm.verify.budget); the report
    records the modes and per-phase timings."""
    _run_the_same_weights_reference(monkeypatch)
    from click.testing import CliRunner

    from dlm.verify.cli import main

    out = tmp_path / "r.json"
    args = [str(tiny_llada2_mlx_dir), "--reference", str(tiny_llada2_mlx_dir.parent / "hf"), "--stream-layers",
            "--report", str(out), "--quiet", "--torch-threads", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["streaming"]["reference"] == doc["streaming"]["implementation"] == "streamed"
    assert doc["settings"]["max_denoising_steps"] == 4 and doc["settings"]["stream_prompts"] == 1
    assert doc["prompts"] == 1 and doc["cases"] == 3  # LLaDA-2: first step, later step, bidirectional
    assert doc["settings"]["max_new_tokens"] == 32  # one block of 32
    assert doc["timings"]["reference"]["stream_forwards"] > 0 and "load" in doc["timings"]["implementation"]
    assert "s/forward" in result.output and "layer by layer" in result.output
    rss = doc["timings"]["rss_gb"]  # each phase's resident peak: which one sets the run's
    for phase in ("reference: logits", "reference: commit streams", "MLX: logits",
                  "reference (MLX weights): logits"):
        assert 0 < rss[phase]["end"] <= rss[phase]["peak"], (phase, rss)
    assert "peak RSS" in result.output


def test_auto_mode_and_layer_progress(capsys):
    from dlm.runtime.platform.memory import budget_bytes
    from dlm.verify import streaming as S
    from dlm.verify.progress import LayerBar

    budget = budget_bytes()
    assert S.decide(None, int(0.6 * budget))[0] and not S.decide(None, int(0.4 * budget))[0]
    assert S.decide(True, 1) == (True, "--stream-layers") and not S.decide(False, 10**15)[0]
    bar = LayerBar(True, every=0.0)
    for i in range(3):
        bar.step("reference: decoder layers", i, 3)
    err = capsys.readouterr().err
    assert "reference: decoder layers: layer 3/3" in err and "pass ETA" in err


def test_auto_mode_counts_everything_a_whole_model_run_holds(monkeypatch):
    """``decide`` sums the parts of a whole-model run, names them in the why,
    and adds back what MLX already holds (budget_bytes leaves it out)."""
    from dlm.runtime.platform import memory
    from dlm.verify import streaming as S

    monkeypatch.setattr(memory, "budget_bytes", lambda budget_gb=None: 10 * 10**9)
    parts = {"the MLX model": 2 * 10**9, "its dequantized float32 weights": 2 * 10**9,
             "the reference with its weights in float32": 2 * 10**9}
    # Each part alone is within half the budget; together they are not.
    assert not S.decide(None, {"the reference with its weights in float32": 2 * 10**9})[0]
    stream, why = S.decide(None, parts)
    assert stream
    assert why == ("a whole-model run holds 6.00 GB (the MLX model 2.00 GB + its dequantized float32 weights "
                   "2.00 GB + the reference with its weights in float32 2.00 GB), over 50% of the memory "
                   "budget of 10.00 GB")
    # The MLX model is already allocated: the budget gets it back (12 GB), and 6 GB is within half.
    stream, why = S.decide(None, parts, held=2 * 10**9)
    assert not stream and "within 50% of the memory budget of 12.00 GB" in why
    assert S.decide(None, 6 * 10**9)[1] == "the reference takes 6.00 GB, over 50% of the memory budget of 10.00 GB"
    assert S.decide(False, parts) == (False, "--no-stream-layers")


def test_whole_parts_of_the_same_weights_reference(tiny_llada2_mlx_dir, tiny_dg_mlx_dir):
    """What a whole-model same-weights run holds besides the reference: LLaDA-2's
    to_hf builds a dict (every dequantized tensor at once), DiffusionGemma's is a
    lazy view (one tensor at a time)."""
    from dlm.runtime.registry import family_for_config
    from dlm.verify import streaming as S
    from dlm.verify import weights as W

    def source(mlx_dir):
        config = json.loads((mlx_dir / "config.json").read_text())
        return S.MlxSource(W.dequantized_weights(mlx_dir, config), family_for_config(config, "").weights.to_hf)

    llada = source(tiny_llada2_mlx_dir)
    assert llada.eager
    parts = S.whole_parts(llada, "float32", mlx_bytes=123)
    assert parts == {"the MLX model": 123, "its dequantized float32 weights": 4 * llada.numel(),
                     "the reference with its weights in float32": 4 * llada.numel()}
    dg = source(tiny_dg_mlx_dir)
    assert not dg.eager
    largest = max(int(np.prod(dg.weights.shape(n))) for n in dg.weights)
    assert S.whole_parts(dg, "float32") == {"its largest dequantized float32 tensor, twice": 8 * largest,
                                            "the reference with its weights in float32": 4 * dg.numel()}
    ckpt = S.CheckpointSource(tiny_llada2_mlx_dir.parent / "hf")
    assert S.whole_parts(ckpt, "bfloat16") == {"the reference in bfloat16": 2 * ckpt.numel()}


def _run_the_same_weights_reference(monkeypatch):
    """The tiny float32 conversion holds the checkpoint's weights bit for bit, so
    run_parity would reuse the original reference; these tests need the run."""
    import dlm.verify.suite as suite

    monkeypatch.setattr(suite, "_same_as_original", lambda *a, **k: "")


def test_an_unquantized_conversion_reuses_the_original_reference(tiny_llada2_mlx_dir, tmp_path):
    """Bit-identical weights (float32 in, float32 out): the same-weights reference
    is the original one, not run again; a changed tensor makes it run."""
    hf = tiny_llada2_mlx_dir.parent / "hf"
    report = run_parity(tiny_llada2_mlx_dir, verify_options(reference=str(hf), long_prompt=False, stream_prompts=0))
    impl = {c.name: c for c in report.checks}["implementation"]
    assert impl.status == "pass" and "not run twice" in impl.note, impl.note
    assert {c.name: c for c in report.checks}["implementation_layers"].status == "pass"
    assert "load" not in report.timings["implementation"]  # nothing was loaded for it
    # One weight changed in the MLX copy: now the weights differ, so the reference runs on them.
    import mlx.core as mx

    changed = tmp_path / "changed"
    shutil.copytree(tiny_llada2_mlx_dir, changed)
    weights = mx.load(str(changed / "model.safetensors"))
    name = next(k for k in sorted(weights) if k.endswith("input_layernorm.weight"))
    weights[name] = weights[name] * 1.001
    mx.save_safetensors(str(changed / "model.safetensors"), weights)
    report = run_parity(changed, verify_options(reference=str(hf), long_prompt=False, stream_prompts=0))
    impl = {c.name: c for c in report.checks}["implementation"]
    assert impl.status == "pass" and "reference run with the MLX weights" in impl.note, impl.note
    # Both ways the layer-local row ran (from the original's record, then the same-weights one).
    local = {c.name: c for c in report.checks}["implementation_layers"]
    n = len(next(iter(report.layers["implementation"]["cases"].values()))["stacks"]["layers"])
    assert local.status == "pass" and local.metrics["stages"] == 1 + n + 1 and local.metrics["rel_max"] < 1e-5


def test_auto_mode_streams_the_same_weights_reference_when_all_of_it_does_not_fit(tiny_llada2_mlx_dir,
                                                                                 monkeypatch):
    """The reference alone fits the auto share of the budget, but with the
    dequantized weights beside it (2x the reference) it does not: the original
    reference runs whole, the same-weights one is streamed."""
    from dlm.runtime.platform.memory import budget_bytes
    from dlm.verify import streaming as S

    hf = tiny_llada2_mlx_dir.parent / "hf"
    ref = S.reference_bytes(S.CheckpointSource(hf), "float32")
    monkeypatch.setattr(S, "AUTO_FRACTION", 1.5 * ref / budget_bytes())
    _run_the_same_weights_reference(monkeypatch)
    report = run_parity(tiny_llada2_mlx_dir, verify_options(reference=str(hf), long_prompt=False,
                                                            stream_prompts=0))
    modes = report.streaming
    assert modes["reference"] == "whole" and modes["implementation"] == "streamed", modes
    why = modes["implementation_reason"]
    assert why.startswith("a whole-model run holds") and "over" in why
    assert "its dequantized float32 weights" in why, why
    assert "the MLX model" not in why  # released before the same-weights reference loads


def test_the_mlx_model_is_released_before_the_same_weights_reference(tiny_llada2_mlx_dir, monkeypatch):
    """Phases do not overlap: when the same-weights reference loads, the MLX
    model's weights are gone (at the released scale both do not fit)."""
    _run_the_same_weights_reference(monkeypatch)
    import gc
    import weakref

    from dlm.runtime import loader
    from dlm.verify import suite

    models, alive_at_matched = [], []
    real_load, real_matched = loader.load, suite._matched_run

    def load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        models.append(weakref.ref(loaded.model))
        return loaded

    def matched(*args, **kwargs):
        gc.collect()
        alive_at_matched.append(models[-1]() is not None)
        return real_matched(*args, **kwargs)

    monkeypatch.setattr(loader, "load", load)
    monkeypatch.setattr(suite, "_matched_run", matched)
    hf = tiny_llada2_mlx_dir.parent / "hf"
    report = run_parity(tiny_llada2_mlx_dir, verify_options(reference=str(hf), long_prompt=False,
                                                            stream_prompts=0))
    assert alive_at_matched == [False]
    assert {c.name: c.status for c in report.checks}["implementation"] == "pass"


def _perturb(src: Path, dst: Path, name: str) -> Path:
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    for f in files:
        w = dict(mx.load(str(f)))
        if name in w:
            noise = mx.random.normal(w[name].shape, key=mx.random.key(0)) * mx.std(w[name])
            w[name] = w[name] + 0.5 * noise
            mx.save_safetensors(str(f), w, metadata={"format": "mlx"})
            return dst
    raise AssertionError(f"no tensor {name} in {src}")


def test_layer_diagnostic_names_the_perturbed_layer(tiny_dg_dir, tiny_dg_mlx_dir, tiny_llada2_mlx_dir, tmp_path):
    """One layer's weight perturbed in a converted copy: agreement with the
    original weights holds before it and drops there (DiffusionGemma: in the
    encoder first, then in the decoder that reads its cache)."""
    mutant = _perturb(tiny_dg_mlx_dir, tmp_path / "dg", "model.decoder.layers.3.mlp.gate_proj.weight")
    report = run_parity(mutant, verify_options(reference=str(tiny_dg_dir), long_prompt=False,
                                               implementation=False, stream_prompts=0, stream_layers=True))
    summary = report.layers["original"]
    assert summary["first_divergence"]["stack"] == "encoder" and summary["first_divergence"]["layer"] == 3
    # A wrong weight moves every position the layer computes, not one token.
    first = summary["first_divergence"]
    assert first["positions_below"] == first["positions"] > 1
    bound = summary["threshold"]["cosine_min"]
    for stack in ("encoder", "decoder"):
        rows = {r["layer"]: r for r in summary["cases"]["p0.arange"]["stacks"][stack]}
        assert all(rows[i]["cosine_min"] >= bound for i in range(3)), stack
        assert rows[3]["cosine_min"] < bound, stack
    assert "encoder layer 3" in report.table()

    hf = tiny_llada2_mlx_dir.parent / "hf"
    mutant = _perturb(tiny_llada2_mlx_dir, tmp_path / "l2", "model.layers.1.attention.dense.weight")
    report = run_parity(mutant, verify_options(reference=str(hf), long_prompt=False, implementation=False,
                                               stream_prompts=0))
    first = report.layers["original"]["first_divergence"]
    assert (first["stack"], first["layer"]) == ("layers", 1)
    rows = report.layers["original"]["cases"][first["case"]]["stacks"]["layers"]
    assert rows[0]["cosine_min"] >= report.layers["original"]["threshold"]["cosine_min"]


# The bounded-memory property: one subprocess (tests/rss.py) measures the peak
# RSS increment of a reference forward (one logits case: prefill + decoder
# step) per (weights, mode, depth).
_CHILD = r"""
from dlm.runtime.checkpoint import read_json
from dlm.runtime.registry import family_for_config
from dlm.verify import streaming as S, weights as W
from dlm.verify.diffusion_gemma import adapter as A
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache  # noqa: F401

out = {}
for phase in json.loads(sys.stdin.readline()):  # sent once the checkpoints are written
    kind, mode, path = phase
    before = reset_peak()
    weights = None
    if kind == "mlx":
        config = read_json(path + "/config.json", "config")
        dq = W.dequantized_weights(path, config)
        to_hf = family_for_config(config, path).weights.to_hf
        weights = S.MlxSource(dq, to_hf) if mode == "streamed" else to_hf(dq)
    ref = A.load_reference(path, weights=weights, stream=mode == "streamed")
    case = A.logit_cases(ref.config, [list(range(2, 40))], {})[0]
    logits = A.reference_logits(ref, case, {})
    out["/".join(phase)] = rss("VmHWM") - before
    del ref, weights, logits
print(json.dumps(out))
"""

# Wide experts, every layer full attention (so any depth is a valid model): ~26 MB per layer in float32.
_WIDE = dict(hidden_size=256, num_experts=16, top_k_experts=2, moe_intermediate_size=512, intermediate_size=256)


def test_streamed_reference_peak_memory_is_flat_in_depth(tmp_path):
    # The child (tests/rss.py's prelude and environment) imports while the
    # checkpoints are built; it reads its phases from stdin once they are.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    child = subprocess.Popen([sys.executable, "-c", RSS_PRELUDE + _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
    try:
        peak = _flat_in_depth_phases(tmp_path, child)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    dirs, grown = peak.pop("dirs"), peak.pop("grown")

    def growth(kind, mode):
        return peak[f"{kind}/{mode}/{dirs[(kind, 8)]}"] - peak[f"{kind}/{mode}/{dirs[(kind, 2)]}"]

    for kind in ("hf", "mlx"):
        # The whole-model reference holds every layer: its peak grows with depth (the test can fail) ...
        assert growth(kind, "whole") > 0.6 * grown, (kind, peak)
        # ... the streamed one holds one layer at a time: flat in depth.
        assert growth(kind, "streamed") < 0.15 * grown, (kind, peak)


def _flat_in_depth_phases(tmp_path, child) -> dict:
    dirs = {}
    for n in (2, 8):
        build_diffusion_gemma(tmp_path / f"hf{n}", text_overrides=dict(_WIDE, num_hidden_layers=n,
                                                                      layer_types=["full_attention"] * n))
        dirs[("hf", n)] = tmp_path / f"hf{n}"
        dirs[("mlx", n)] = convert_dir(tmp_path / f"hf{n}", tmp_path / f"mlx{n}")
    size = {n: sum(f.stat().st_size for f in dirs[("hf", n)].glob("*.safetensors")) for n in (2, 8)}
    grown = size[8] - size[2]
    assert grown > 120e6  # 6 more layers of ~26 MB: the models differ by several times a layer
    phases = [(kind, mode, str(dirs[(kind, n)])) for kind in ("hf", "mlx") for mode in ("whole", "streamed")
              for n in (2, 8)]
    # Warm-up phases first (lazy imports and first-call allocations would count
    # against the first measured phase); their numbers are overwritten.
    phases = [("hf", "streamed", str(dirs[("hf", 2)])), ("mlx", "streamed", str(dirs[("mlx", 2)]))] + phases
    stdout, stderr = child.communicate(json.dumps(phases) + "\n", timeout=300)
    assert child.returncode == 0, stderr[-3000:]
    return dict(json.loads(stdout.strip().splitlines()[-1]), dirs=dirs, grown=grown)


def test_logit_store_and_bundle_arrays_match_the_safetensors_library(tmp_path):
    """Logits kept on disk read back unchanged; bundles written one array at a
    time are standard safetensors (the library reads them), and the lazy
    reader reads what the library writes."""
    from safetensors.numpy import load_file, save_file

    from dlm.verify.store import ArrayStore, SafetensorsArrays, write_safetensors

    rng = np.random.default_rng(0)
    arrays = {"logits/p0": rng.standard_normal((8, 512)).astype(np.float32),
              "case/p0/canvas": np.arange(8, dtype=np.int64), "stream/0/0/step_argmax": np.zeros((0, 8), np.int32),
              "x": np.array([1, 2, 3], np.int32)}
    store = ArrayStore()
    for k, v in arrays.items():
        store[k] = v
    assert all(np.array_equal(store[k], v) and store[k].dtype == v.dtype for k, v in arrays.items())
    write_safetensors(tmp_path / "mine.safetensors", store)
    theirs = load_file(str(tmp_path / "mine.safetensors"))
    assert set(theirs) == set(arrays) and all(np.array_equal(theirs[k], arrays[k]) for k in arrays)
    save_file(arrays, str(tmp_path / "lib.safetensors"))
    lazy = SafetensorsArrays(tmp_path / "lib.safetensors")
    assert all(np.array_equal(lazy[k], arrays[k]) and lazy[k].dtype == arrays[k].dtype for k in arrays)
    folder = store._dir
    store.close()
    assert not folder.exists()


def test_streamed_reference_refuses_incomplete_weights_naming_the_tensor(tiny_llada2_mlx_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    from dlm.runtime.platform.errors import WeightError
    from dlm.verify.llada2_moe import adapter as A

    src = tiny_llada2_mlx_dir.parent / "hf"
    for drop, reshape in (("model.layers.1.attention.dense.weight", False),
                          ("model.layers.2.mlp.experts.3.up_proj.weight", True)):
        bad = tmp_path / drop.replace(".", "_")
        shutil.copytree(src, bad)
        tensors = load_file(str(bad / "model.safetensors"))
        if reshape:
            tensors[drop] = tensors[drop][:-1]
        else:
            del tensors[drop]
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(WeightError, match=drop.replace(".", r"\.")) as err:
            A.load_reference(bad, stream=True)
        assert str(bad) in str(err.value)
