"""``dlm-run generate --prompts-file``: every result equals the prompt run alone,
in the file's order, with per-line options over the flags; bad files and flag
mixes are one-line errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dlm.runtime import api
from dlm.runtime.cli.main import main
from tests import ROOT

DEMO = ROOT / "demo" / "diffusion_gemma_sort"
LINES = [
    '"sort 3 1 2"',
    '{"prompt": "sort 9 4 7 1 5 3", "seed": 1, "id": "second"}',
    "",
    '{"messages": [{"role": "user", "content": "sort 5"}], "max_tokens": 8, "temperature": 0.5}',
    '{"prompt_ids": [2, 10, 11, 12], "seed": 4, "max_denoising_steps": 3}',
    '{"prompt": "sort 8 6 4", "chat_template": false, "debug_canvas": true}',
]


@pytest.fixture(scope="module")
def demo():
    return api.load(DEMO)


def run(args, tmp_path):
    r = CliRunner().invoke(main, ["generate", "--model", str(DEMO), *args])
    return r


def test_results_equal_each_prompt_alone_in_order(demo, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "results.jsonl"
    r = run(["--prompts-file", str(prompts), "--output", str(out), "--max-tokens", "24", "--seed", "0",
             "--max-batch", "3", "--profile"], tmp_path)
    assert r.exit_code == 0, r.output
    assert "generating" in r.stderr and "Batch: 5 prompts" in r.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["index"] for rec in records] == [0, 1, 2, 3, 4] and records[1]["id"] == "second"
    flags = {"max_tokens": 24, "seed": 0}
    alone = [
        (api.encode_prompt(demo, "sort 3 1 2"), flags),
        (api.encode_prompt(demo, "sort 9 4 7 1 5 3"), {**flags, "seed": 1}),
        (api.encode_prompt(demo, messages=[{"role": "user", "content": "sort 5"}]),
         {**flags, "max_tokens": 8, "temp": 0.5}),
        ([2, 10, 11, 12], {**flags, "seed": 4, "max_denoising_steps": 3}),
        (api.encode_prompt(demo, "sort 8 6 4", chat_template=False), {**flags, "debug_canvas": True}),
    ]
    for rec, (ids, options) in zip(records, alone):
        want = api.generate(demo, ids, options)
        assert rec["prompt_ids"] == ids
        assert (rec["token_ids"], rec["text"], rec["finish_reason"], rec["steps_per_canvas"]) == \
            (want.token_ids, want.text, want.finish_reason, want.stats.steps_per_block)
        assert rec["tokens_per_canvas"] == [len(b) for b in want.blocks]
    assert len({tuple(rec["token_ids"]) for rec in records}) == 5


def test_stdout_when_no_output(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"sort 2 1"\n"sort 4 3"\n')
    r = run(["--prompts-file", str(prompts), "--max-tokens", "8", "--seed", "0"], tmp_path)
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["index"] for line in r.stdout.splitlines()] == [0, 1]


@pytest.mark.parametrize("content, args, code, message", [
    ('{"prompt": "a"}\n[1]\n', [], 1, "line 2: expected a JSON string or object, got list"),
    ('{"prompt": "a"\n', [], 1, "line 1: not JSON"),
    ('{"prompt": "a", "messages": []}\n', [], 1, "line 1: give exactly one of prompt, messages, prompt_ids"),
    ('\n\n', [], 1, "no prompts in it"),
    ('"a"\n{"prompt": "b", "top_k": 3}\n', [], 1, "line 2: --top-k does not apply to DiffusionGemma"),
    ('{"prompt_ids": []}\n', [], 1, "line 1: prompt_ids must be a non-empty list"),
    ('{"prompt_ids": [2, 3], "images": ["x.png"]}\n', [], 1, "line 1: images take a prompt or messages"),
    ('"a"\n', ["--prompt", "b"], 2, "--prompts-file takes its prompts from the file; drop --prompt"),
    ('"a"\n', ["--json"], 2, "drop --json"),
])
def test_bad_files_and_flags_are_one_line_errors(tmp_path, content, args, code, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    r = run(["--prompts-file", str(prompts), *args], tmp_path)
    assert r.exit_code == code and message in r.output, r.output


def test_batch_flags_need_a_prompts_file(tmp_path):
    r = run(["--prompt", "x", "--output", str(tmp_path / "o.jsonl")], tmp_path)
    assert r.exit_code == 2 and "--output takes effect only with --prompts-file" in r.output
    r = run(["--prompt", "x", "--max-batch", "2"], tmp_path)
    assert r.exit_code == 2 and "--max-batch takes effect only with --prompts-file" in r.output
