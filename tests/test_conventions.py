"""What users of mlx-lm, mlx-vlm and the OpenAI API expect of dlm's three tools."""

from __future__ import annotations

import json
import os
import re
import stat

import httpx
import openai
import pytest
from click.testing import CliRunner

from dlm.convert.cli import main as convert_main
from dlm.runtime import api
from dlm.runtime.cli.main import main as run_main
from dlm.runtime.server.app import create_app
from dlm.verify.cli import main as verify_main
from tests import ROOT

DEMO = ROOT / "demo" / "diffusion_gemma_sort"
TOOLS = {"dlm-convert": convert_main, "dlm-verify": verify_main, "dlm-run": run_main}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_help_and_version_everywhere(tool):
    for flag in ("-h", "--help"):
        r = CliRunner().invoke(TOOLS[tool], [flag])
        assert r.exit_code == 0 and "Usage:" in r.output, (tool, flag)
    r = CliRunner().invoke(TOOLS[tool], ["--version"])
    assert r.exit_code == 0 and tool in r.output and "version" in r.output


def test_subcommands_take_h_too():
    for sub in ("generate", "serve"):
        r = CliRunner().invoke(run_main, [sub, "-h"])
        assert r.exit_code == 0 and "Usage:" in r.output
    r = CliRunner().invoke(verify_main, ["record", "-h"])
    assert r.exit_code == 0 and "Usage:" in r.output


def test_one_meaning_per_short_flag():
    """A short flag means the same in every tool that has it (-q: quantize, as in mlx_lm.convert)."""
    meaning: dict[str, set[str]] = {}

    def walk(cmd):
        for p in cmd.params:
            for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", []):
                if len(opt) == 2 and opt.startswith("-"):
                    meaning.setdefault(opt, set()).add(p.name)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    for cmd in TOOLS.values():
        walk(cmd)
    clashes = {k: v for k, v in meaning.items() if len(v) > 1}
    assert not clashes, clashes


def _generate(args):
    r = CliRunner().invoke(run_main, ["generate", "--model", str(DEMO), "--prompt", "sort 3",
                                      "--max-tokens", "8", "--seed", "0", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_special_tokens_are_left_out_of_the_text_by_default():
    out = _generate([])
    kept = _generate(["--no-skip-special-tokens"])
    assert out["token_ids"] == kept["token_ids"]  # the ids are the same either way
    assert 0 in out["token_ids"]  # this prompt commits <pad> after its answer
    assert "<pad>" in kept["text"] and "<pad>" not in out["text"]
    assert kept["text"].replace("<pad>", "") == out["text"]


def test_a_flag_that_cannot_take_effect_is_an_error():
    r = CliRunner().invoke(run_main, ["generate", "--model", str(DEMO), "--prompt", "x",
                                      "--diffusion-threshold", "0.5"])
    assert r.exit_code == 1
    assert "error: --diffusion-threshold takes effect only with --diffusion-sampler confidence-threshold" in r.output
    r = CliRunner().invoke(run_main, ["generate", "--model", str(DEMO), "--prompt", "sort 21", "--max-tokens", "4",
                                      "--diffusion-sampler", "confidence-threshold", "--diffusion-threshold", "0.5"])
    assert r.exit_code == 0, r.output


def test_openai_clients_default_fields_are_accepted(serving):
    loaded = api.load(DEMO)
    app = create_app(loaded, {"max_tokens": 8, "seed": 0}, api_key="k")
    with serving(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "sort 31"}]
        plain = client.chat.completions.create(model="m", messages=msgs)
        neutral = client.chat.completions.create(
            model="m", messages=msgs, presence_penalty=0, frequency_penalty=0, logprobs=False, n=1,
            user="someone", response_format={"type": "text"}, tools=[], tool_choice="auto",
            parallel_tool_calls=True, logit_bias={}, store=False)
        assert neutral.choices[0].message.content == plain.choices[0].message.content != ""
        with pytest.raises(openai.BadRequestError, match="'presence_penalty' must be 0"):
            client.chat.completions.create(model="m", messages=msgs, presence_penalty=0.5)
        text = client.completions.create(model="m", prompt="sort 31", echo=False, best_of=1)
        assert text.choices[0].text is not None
        # Health probes carry no key; the API does.
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/v1/models").status_code == 401


def test_verify_shows_progress_and_writes_files_with_the_usual_mode(tiny_dg_mlx_dir, tiny_dg_dir, tmp_path):
    report = tmp_path / "report.json"
    r = CliRunner().invoke(verify_main, [str(tiny_dg_mlx_dir), "--reference", str(tiny_dg_dir), "--report",
                                         str(report), "--steps", "4", "--stream-prompts", "1",
                                         "--torch-threads", "1"])
    assert r.exit_code in (0, 1), r.output
    # Not a terminal: plain progress lines on stderr, with the time each part took.
    assert "reference: logits: 0/" in r.stderr and "done in" in r.stderr, r.stderr
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(report.stat().st_mode) == 0o666 & ~mask


def test_dlm_run_takes_a_hub_repo_id_from_the_offline_cache(tiny_dg_mlx_dir, tmp_path, monkeypatch):
    from tests.builders import install_in_hf_cache

    cache = tmp_path / "hub"
    install_in_hf_cache(tiny_dg_mlx_dir, cache, "mlx-community/tiny-dg-4bit", revision="b" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    args = ["--prompt-ids", "2,10,11", "--max-tokens", "4", "--max-denoising-steps", "2", "--seed", "1", "--json"]
    by_id = CliRunner().invoke(run_main, ["generate", "--model", "mlx-community/tiny-dg-4bit", *args])
    assert by_id.exit_code == 0, by_id.output
    by_dir = CliRunner().invoke(run_main, ["generate", "--model", str(tiny_dg_mlx_dir), *args])
    assert json.loads(by_id.stdout)["token_ids"] == json.loads(by_dir.stdout)["token_ids"]
    missing = CliRunner().invoke(run_main, ["generate", "--model", "mlx-community/not-cached", *args])
    assert missing.exit_code == 1 and "HF_HUB_OFFLINE" in missing.output and "Traceback" not in missing.output


def test_reconverting_an_mlx_conversion_says_so_and_dequantize_goes_back_to_float(tiny_dg_dir, tmp_path):
    import mlx.core as mx
    import numpy as np

    from tests.builders import convert_dir, dequantized_twin

    q4 = convert_dir(tiny_dg_dir, tmp_path / "q4", quantize=True, q_bits=4)
    r = CliRunner().invoke(convert_main, [str(q4), "-o", str(tmp_path / "again"), "--no-progress"])
    assert r.exit_code == 1 and "is a quantized MLX conversion, not a Hugging Face checkpoint" in r.output
    assert "--dequantize" in r.output and not (tmp_path / "again").exists()

    r = CliRunner().invoke(convert_main, [str(q4), "-o", str(tmp_path / "float"), "--dequantize", "--no-progress"])
    assert r.exit_code == 0, r.output
    twin = dequantized_twin(q4, tmp_path / "twin")  # the tests' own dequantization
    ours = {}
    for f in (tmp_path / "float").glob("*.safetensors"):
        ours.update(mx.load(str(f)))
    theirs = mx.load(str(twin / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name in theirs:
        assert np.array_equal(np.array(ours[name].astype(mx.float32)), np.array(theirs[name].astype(mx.float32))), name
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    assert "quantization" not in config and config["dlm"]["source"] == str(tiny_dg_dir.resolve())
    assert config["dlm"]["dequantized_from"] == str(q4.resolve())
    # ... and --q-bits on top re-quantizes it; the result runs.
    r = CliRunner().invoke(convert_main, [str(q4), "-o", str(tmp_path / "q8"), "--dequantize", "--q-bits", "8",
                                          "--no-progress"])
    assert r.exit_code == 0, r.output
    loaded = api.load(tmp_path / "q8")
    assert api.generate(loaded, [2, 10, 11], {"max_tokens": 4, "max_denoising_steps": 2, "seed": 0}).token_ids


class _DirectoryHub:
    """A stand-in for huggingface_hub.HfApi backed by a local directory (no Hub here)."""

    def __init__(self, root):
        self.root, self.commits = root, []

    def create_repo(self, repo_id, repo_type="model", private=False, exist_ok=False):
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, folder_path, repo_id, repo_type="model", commit_message=""):
        import shutil

        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True)
        self.commits.append((repo_id, commit_message))

    def upload_file(self, path_or_fileobj, path_in_repo, repo_id, repo_type="model", commit_message=""):
        import shutil

        shutil.copyfile(path_or_fileobj, self.root / repo_id / path_in_repo)
        self.commits.append((repo_id, commit_message))


def test_upload_after_convert_and_after_verify(tiny_dg_dir, tmp_path, monkeypatch):
    import huggingface_hub

    hub = _DirectoryHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: hub)
    out = tmp_path / "tiny-4bit"
    r = CliRunner().invoke(convert_main, [str(tiny_dg_dir), "-o", str(out), "--q-bits", "4", "--no-progress",
                                          "--upload-repo", "me/tiny-4bit"])
    assert r.exit_code == 0, r.output
    assert "Uploaded" in r.output and "https://huggingface.co/me/tiny-4bit" in r.output
    uploaded = hub.root / "me" / "tiny-4bit"
    assert sorted(p.name for p in uploaded.iterdir()) == sorted(p.name for p in out.iterdir())
    report = tmp_path / "report.json"
    r = CliRunner().invoke(verify_main, [str(out), "--reference", str(tiny_dg_dir), "--update-card", "--report",
                                         str(report), "--steps", "4", "--stream-prompts", "1", "--quiet",
                                         "--upload-repo", "me/tiny-4bit", "--torch-threads", "1"])
    assert r.exit_code in (0, 1), r.output
    assert "<!-- dlm-verify:begin -->" in (uploaded / "README.md").read_text()
    assert "Not verified yet" not in (uploaded / "README.md").read_text()
    assert json.loads((uploaded / "dlm-verify-report.json").read_text())["checks"]
    # A bad repo id is refused before any work.
    r = CliRunner().invoke(convert_main, [str(tiny_dg_dir), "-o", str(tmp_path / "x"), "--upload-repo", "nope"])
    assert r.exit_code == 1 and "not a Hub repo id" in r.output and not (tmp_path / "x").exists()


@pytest.mark.parametrize("fixture", ["tiny_dg_mlx_dir", "tiny_llada2_mlx_dir"])
def test_a_kept_prefix_cache_gives_the_same_turn_as_a_fresh_one(request, fixture):
    from dlm.runtime.generation.progress import PrefixState

    loaded = api.load(request.getfixturevalue(fixture))
    opts = {"max_tokens": 8, "max_denoising_steps": 3, "seed": 3, "temp": 0.0}
    if "llada2" in fixture:
        opts["block_length"] = 4
    state = PrefixState()
    turn1 = [{"role": "user", "content": "first question, long enough to fill a few blocks"}]
    first = api.generate(loaded, api.encode_prompt(loaded, messages=turn1), opts, prefix=state)
    assert state.ids and state.cache is not None
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}]
    ids2 = api.encode_prompt(loaded, messages=turn2)
    kept = api.generate(loaded, ids2, opts, prefix=state)
    fresh = api.generate(loaded, ids2, opts)
    assert kept.stats.cached_prompt_tokens > 0  # the second turn reused the first one's cache
    assert kept.token_ids == fresh.token_ids and kept.steps_per_block == fresh.steps_per_block


def test_chat_keeps_the_conversation_and_the_cache():
    r = CliRunner().invoke(run_main, ["chat", "--model", str(DEMO), "--max-tokens", "16", "--seed", "0",
                                      "--profile"], input="sort 31\nsort 9081726354\n/reset\nsort 21\n/exit\nnot read\n")
    assert r.exit_code == 0, r.output
    answers = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(answers) == 3
    # The second turn answers the whole conversation, as a fresh run of it does.
    loaded = api.load(DEMO)
    conversation = [{"role": "user", "content": "sort 31"}, {"role": "assistant", "content": answers[0]},
                    {"role": "user", "content": "sort 9081726354"}]
    fresh = api.generate(loaded, api.encode_prompt(loaded, messages=conversation), {"max_tokens": 16, "seed": 0})
    assert answers[1] == fresh.text
    prompt_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("Prompt:")]
    assert len(prompt_lines) == 3
    assert "from the kept cache" not in prompt_lines[0] and "from the kept cache" in prompt_lines[1]
    assert "(conversation reset)" in r.stderr and "from the kept cache" not in prompt_lines[2]


@pytest.mark.parametrize("fixture, label", [("tiny_dg_mlx_dir", "[canvas 1 step 1]"),
                                            ("tiny_llada2_mlx_dir", "[block 1 step 1]")])
def test_verbose_shows_every_step(request, fixture, label):
    path = request.getfixturevalue(fixture)
    extra = ["--block-length", "8"] if "llada2" in fixture else []
    r = CliRunner().invoke(run_main, ["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "12",
                                      "--max-denoising-steps", "4", "--seed", "5", "--verbose", *extra])
    assert r.exit_code == 0, r.output
    steps = [ln for ln in r.stderr.splitlines() if ln.startswith("[")]
    assert steps and steps[0].startswith(label)
    assert len(steps) == sum(json.loads(CliRunner().invoke(run_main, [
        "generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "12", "--max-denoising-steps", "4",
        "--seed", "5", "--json", *extra]).stdout)["steps_per_canvas"])  # one line per denoising step
    if "llada2" in fixture:
        second = next(ln for ln in steps if ln.startswith("[block 2 step 1]"))
        assert "_" in second  # a block's first step still shows masked positions


# Spelled in pieces so that this file does not match itself.
_PRIVATE_CITATION = re.compile("shared" + "/reference" + r"|\breference/[\w.-]+\.md" + "|\u00a7")


def test_comments_cite_upstream_sources_not_private_notes():
    """Code cites what a reader can open (transformers' or a hub repo's modeling
    file, mlx-vlm, a paper, a config field), never notes kept outside the
    repository or their section numbers."""
    found = []
    for folder in ("runtime", "convert", "quantize", "verify", "model_cards", "tests", "scripts", "demo"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _PRIVATE_CITATION.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
