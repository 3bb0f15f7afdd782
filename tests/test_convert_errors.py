"""dlm-convert on bad input: a clear error naming the problem, and no output at all."""

from __future__ import annotations

import errno
import json
import os

import pytest
from click.testing import CliRunner

from dlm.convert import pipeline, writer
from dlm.convert.cli import main
from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime.platform.errors import DlmError
from tests.builders import copy_checkpoint, leftovers, reshard


@pytest.fixture
def ckpt(tiny_dg_dir, tmp_path):
    return copy_checkpoint(tiny_dg_dir, tmp_path / "src")


def fails(source, out, match, **kw):
    """Convert, expect a DlmError matching ``match``, and check nothing was left behind."""
    with pytest.raises(DlmError, match=match):
        convert(ConvertOptions(source=str(source), output=str(out), progress=False, **kw),
                echo=lambda s: None)
    assert leftovers(out.parent, out) == []


def edit_config(ckpt, fn):
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def test_unknown_model_type_lists_supported(ckpt, tmp_path):
    edit_config(ckpt, lambda c: c.update(model_type="gemma4"))
    fails(ckpt, tmp_path / "out", r"unsupported model_type 'gemma4'.*diffusion_gemma.*llada2_moe")


def test_missing_config(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    fails(ckpt, tmp_path / "out", r"has no config\.json")


def test_invalid_config_json(ckpt, tmp_path):
    (ckpt / "config.json").write_text("{not json")
    fails(ckpt, tmp_path / "out", r"config\.json is not valid JSON")


def test_missing_tokenizer(ckpt, tmp_path):
    (ckpt / "tokenizer.json").unlink()
    fails(ckpt, tmp_path / "out", r"has no tokenizer")


def test_missing_shard_is_named(ckpt, tmp_path):
    src = reshard(ckpt, tmp_path / "sharded", 3)
    (src / "model-00002-of-00003.safetensors").unlink()
    fails(src, tmp_path / "out", r"missing from .*model-00002-of-00003\.safetensors")


def test_truncated_shard_is_named(ckpt, tmp_path):
    src = reshard(ckpt, tmp_path / "sharded", 3)
    shard = src / "model-00003-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 1000)
    fails(src, tmp_path / "out", r"shard model-00003-of-00003\.safetensors is truncated")


def test_truncated_header(ckpt, tmp_path):
    os.truncate(ckpt / "model.safetensors", 4)
    fails(ckpt, tmp_path / "out", r"model\.safetensors is truncated or not a safetensors file")


def test_shape_disagreeing_with_config_is_named(ckpt, tmp_path):
    # hub form without global_head_dim means 512-wide full-attention heads: the tiny layer 5 is 32
    edit_config(ckpt, lambda c: c["text_config"].pop("global_head_dim"))
    fails(ckpt, tmp_path / "out", r"model\.decoder\.layers\.5\.self_attn\.q_proj\.weight has shape \[128, 64\]")


def test_missing_tensor_is_named(ckpt, tmp_path):
    edit_config(ckpt, lambda c: c["text_config"].update(num_hidden_layers=7, layer_types=None))
    fails(ckpt, tmp_path / "out", r"missing tensor model\.decoder\.layers\.6\.")


def test_pickle_weights_are_refused(ckpt, tmp_path):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    fails(ckpt, tmp_path / "out", r"only pickle weights \(pytorch_model\.bin\).*reads only safetensors")


def test_source_that_is_neither_dir_nor_repo(tmp_path):
    fails("./no/such/dir", tmp_path / "out", r"not a directory and not a Hugging Face Hub repo id")


def test_revision_with_a_local_directory(ckpt, tmp_path):
    fails(ckpt, tmp_path / "out", r"--revision applies to Hub repo ids", revision="main")


def test_repo_not_in_offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    fails("google/not-cached", tmp_path / "out", r"not in the Hugging Face cache and HF_HUB_OFFLINE is set")


def test_bad_quantization_flags(ckpt, tmp_path):
    fails(ckpt, tmp_path / "out", r"--q-mode mxfp4 is fixed at 4 bits", q_bits=3, q_mode="mxfp4")
    fails(ckpt, tmp_path / "out", r"--q-group-size 16 is not supported", q_group_size=16)


def test_existing_output_is_refused_unless_overwrite(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(DlmError, match="already exists; pass --overwrite"):
        convert(ConvertOptions(source=str(ckpt), output=str(out), progress=False), echo=lambda s: None)
    assert (out / "config.json").read_text() == "{}"
    convert(ConvertOptions(source=str(ckpt), output=str(out), overwrite=True, progress=False),
            echo=lambda s: None)
    assert (out / "model.safetensors").is_file() and json.loads((out / "config.json").read_text())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_overwrite_refuses_a_directory_that_is_not_a_model(ckpt, tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(DlmError, match="does not look like a model directory"):
        convert(ConvertOptions(source=str(ckpt), output=str(out), overwrite=True, progress=False),
                echo=lambda s: None)
    assert (out / "notes.txt").read_text() == "precious"


def test_output_replacing_the_source_is_refused(ckpt):
    with pytest.raises(DlmError, match="would replace the source"):
        convert(ConvertOptions(source=str(ckpt), output=str(ckpt), overwrite=True, progress=False),
                echo=lambda s: None)
    assert (ckpt / "model.safetensors").is_file()


def test_unwritable_output(ckpt, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DlmError, match="is not a directory"):
        convert(ConvertOptions(source=str(ckpt), output=str(blocker / "out"), progress=False),
                echo=lambda s: None)


def test_not_enough_disk_space(ckpt, tmp_path, monkeypatch):
    real = pipeline.shutil.disk_usage
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    fails(ckpt, tmp_path / "out", r"not enough free space .* needs 0\.\d+ GB")


def test_disk_full_while_writing(ckpt, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = os.pwrite

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    fails(ckpt, tmp_path / "out", r"disk full while writing .*model\.safetensors")


def test_interrupted_run_leaves_nothing(ckpt, tmp_path, monkeypatch):
    real = pipeline.run_job
    calls = {"n": 0}

    def run_job(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "run_job", run_job)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert(ConvertOptions(source=str(ckpt), output=str(out), progress=False), echo=lambda s: None)
    assert leftovers(tmp_path, out) == []


def test_cli_reports_errors_without_traceback(ckpt, tmp_path):
    edit_config(ckpt, lambda c: c.update(model_type="mystery"))
    res = CliRunner().invoke(main, [str(ckpt), "-o", str(tmp_path / "out"), "--no-progress"])
    assert res.exit_code == 1
    assert res.output.startswith("error: ") and "mystery" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(main, [str(ckpt), "--hf-path", "other/repo"])
    assert res.exit_code == 2 and "not both" in res.output


# -- broken checkpoints that used to convert (issue: hardening) -------------------------


def _edit_tensors(ckpt, fn):
    from safetensors.numpy import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("key, value, match", [
    ("vocab_size", "abc", r"vocab_size must be an integer, got 'abc'"),
    ("hidden_size", 64.5, r"hidden_size must be an integer, got 64\.5"),
    ("top_k_experts", 9, r"top_k_experts=9 exceeds num_experts=4"),
    ("sliding_window", -4, r"sliding_window must be >= 2"),
    ("num_experts", 0, r"num_experts must be >= 1"),
    ("rms_norm_eps", "tiny", r"rms_norm_eps must be a finite number"),
])
def test_config_values_are_typed_and_range_checked(ckpt, tmp_path, key, value, match):
    edit_config(ckpt, lambda c: c["text_config"].update({key: value}))
    fails(ckpt, tmp_path / "out", match)


def test_canvas_length_zero_is_refused(ckpt, tmp_path):
    edit_config(ckpt, lambda c: c.update(canvas_length=0))
    fails(ckpt, tmp_path / "out", r"canvas_length must be >= 1")


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_corrupt_json_sidecars_are_refused(ckpt, tmp_path, name):
    (ckpt / name).write_text("{corrupt")
    fails(ckpt, tmp_path / "out", rf"{name.replace('.', '[.]')}.*not valid JSON")


def test_non_float_weights_are_refused_naming_the_tensor(ckpt, tmp_path):
    import numpy as np

    name = "model.decoder.layers.0.router.scale"
    _edit_tensors(ckpt, lambda t: t.update({name: t[name].astype(np.int32)}))
    fails(ckpt, tmp_path / "out", rf"tensor {name} has dtype I32; model weights must be floating point")


def test_non_finite_weights_are_an_error_naming_tensor_and_count(ckpt, tmp_path):
    import numpy as np

    name = "model.decoder.layers.1.mlp.up_proj.weight"

    def poison(t):
        w = t[name].copy()
        w[0, :3] = [np.nan, np.inf, -np.inf]
        t[name] = w

    _edit_tensors(ckpt, poison)
    fails(ckpt, tmp_path / "out", rf"tensor {name} has 3 non-finite value\(s\)")
    fails(ckpt, tmp_path / "q4", rf"tensor {name} has 3 non-finite", quantize=True, q_bits=4)
    # An explicit flag downgrades it to a warning (and converts).
    r = CliRunner().invoke(main, [str(ckpt), "-o", str(tmp_path / "kept"), "--allow-non-finite", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert f"warning: tensor {name} has 3 non-finite" in r.output
    assert (tmp_path / "kept" / "config.json").is_file()


def test_overlapping_tensor_byte_ranges_are_refused(ckpt, tmp_path):
    import struct

    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = names[0], names[1]
    size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    start = header[a]["data_offsets"][0]
    if header[a]["data_offsets"][1] - start < size:  # make the overlap fit the first tensor
        a, b = b, a
        start = header[a]["data_offsets"][0]
        size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    header[b]["data_offsets"] = [start, start + size]  # b now reads a's bytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (n - len(body)) if len(body) <= n else b""
    assert len(body) == n, "the edited header must keep its length"
    path.write_bytes(raw[:8] + body + raw[8 + n:])
    fails(ckpt, tmp_path / "out", r"overlap in the file.*header is corrupt")


def test_a_sidecar_linking_outside_the_checkpoint_is_refused(ckpt, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any model")
    (ckpt / "tokenizer.model").symlink_to(secret)
    fails(ckpt, tmp_path / "out", r"tokenizer\.model is a symbolic link to .*secret\.txt, outside the checkpoint")


def test_leftovers_of_killed_conversions_are_removed(ckpt, tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    out = tmp_path / "out"
    stale = [tmp_path / f".out.dlm-partial-{dead.pid}", tmp_path / f".out.dlm-old-{dead.pid}"]
    for d in stale:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 10)
    alive = tmp_path / f".out.dlm-partial-{os.getpid()}-x"  # not ours: no pid suffix match
    alive.mkdir()
    lines = []
    convert(ConvertOptions(source=str(ckpt), output=str(out), progress=False), echo=lines.append)
    assert not any(d.exists() for d in stale)
    assert alive.exists()
    assert sum("left by an interrupted conversion" in line for line in lines) == 2


def test_leftovers_of_sigkilled_conversions_are_removed_live_ones_kept(ckpt, tmp_path):
    """A conversion SIGKILLed by a parent that has not reaped it yet (a zombie,
    which kill(pid, 0) still finds) left its partial directory for good; the
    next run removes it, and never a running conversion's."""
    import subprocess
    import time

    out = tmp_path / "out"
    zombie = subprocess.Popen(["sleep", "30"])
    zombie.kill()  # not waited for: a zombie until the end of this test
    time.sleep(0.2)
    killed = tmp_path / f".out.dlm-partial-{zombie.pid}"
    killed.mkdir()
    live = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.1)
        running = tmp_path / f".out.dlm-partial-{live.pid}"
        running.mkdir()
        (running / "model.safetensors").write_bytes(b"x" * 10)
        lines = []
        convert(ConvertOptions(source=str(ckpt), output=str(out), progress=False), echo=lines.append)
        assert not killed.exists(), "a SIGKILLed (unreaped) conversion's partial output was kept"
        assert running.exists(), "a running conversion's partial output was removed"
        assert sum("left by an interrupted conversion" in line for line in lines) >= 1
    finally:
        live.kill()
        live.wait()
        zombie.wait()


def test_overwrite_through_a_symlinked_output_keeps_the_link(ckpt, tmp_path):
    real = tmp_path / "models" / "tiny"
    convert(ConvertOptions(source=str(ckpt), output=str(real), progress=False), echo=lambda s: None)
    link = tmp_path / "tiny-link"
    link.symlink_to(real, target_is_directory=True)
    convert(ConvertOptions(source=str(ckpt), output=str(link), progress=False, overwrite=True,
                           quantize=True, q_bits=4), echo=lambda s: None)
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert "quantization" in json.loads((real / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir() if ".dlm-" in p.name) == []
    assert sorted(p.name for p in real.parent.iterdir() if ".dlm-" in p.name) == []


@pytest.mark.parametrize("repo_id", ["", " ", "a/..", "org/na--me", "org/name\n", "org/na\tme", "name",
                                     "a/b/c", "org/name.git", "org/-name", "o/" + "n" * 100])
def test_a_bad_upload_repo_is_refused_before_any_conversion(ckpt, tmp_path, repo_id):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, [str(ckpt), "-o", str(out), "--no-progress", "--upload-repo", repo_id])
    assert r.exit_code == 1, r.output
    assert "is not a Hub repo id" in r.output
    assert not out.exists() and leftovers(tmp_path, out) == []


def test_good_upload_repo_ids_pass_the_check():
    from dlm.convert.upload import check_repo_id

    for repo_id in ("me/tiny-4bit", "Org_1/Name.v2", "a/b"):
        assert check_repo_id(repo_id) == repo_id
