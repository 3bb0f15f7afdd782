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


# -- odd text, line checks shared with the server, the output file (issue 42) ---------

@pytest.mark.parametrize("line, message", [
    ('{"prompt": "sort \\ud800"}', "line 1: 'prompt' is not valid UTF-8 text (lone surrogate at position 5)"),
    ('{"prompt": "sort 2", "system": "\\udfff"}', "line 1: 'system' is not valid UTF-8 text"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null, "tool_calls": '
     '[{"type": "function", "function": {"name": "f", "arguments": "{\\"x\\": \\"\\\\ud800\\"}"}}]}, '
     '{"role": "user", "content": "b"}]}',
     "line 1: 'messages[1].tool_calls[0].function.arguments.x' is not valid UTF-8 text"),
    # The server's own checks and messages (dlm.runtime.server.requests), naming the field.
    ('{"messages": [{"role": "robot", "content": "a"}]}', "line 1: 'messages[0].role' must be one of"),
    ('{"prompt": "a", "system": 5}', "line 1: 'system' must be a string, got int"),
    ('{"prompt": "a", "chat_template": "yes"}', "line 1: 'chat_template' must be true or false, got str"),
    ('{"prompt": "a", "thinking": 1}', "line 1: 'thinking' must be true or false, got int"),
    ('{"prompt": 5}', "line 1: 'prompt' must be a string, got int"),
    ('{"prompt": "a", "temperature": "hot"}', "line 1: 'temperature' must be a number, got 'hot'"),
    ('{"messages": [{"role": "user", "content": "a", "mood": "x"}]}', "unsupported field(s) in 'messages[0]'"),
    ('{"messages": [{"role": "user", "content": ""}]}', "line 1: the prompt is empty"),
])
def test_bad_lines_are_refused_as_the_server_refuses_them(tmp_path, line, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(line + "\n")
    r = run(["--prompts-file", str(prompts), "--max-tokens", "4"], tmp_path)
    assert r.exit_code == 1 and message in r.output, r.output
    assert "internal error" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_output_is_checked_before_the_run(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"sort 2 1"\n')
    r = run(["--prompts-file", str(prompts), "-o", str(tmp_path / "missing" / "o.jsonl")], tmp_path)
    assert r.exit_code == 1 and "does not exist" in r.output and "generating" not in r.output, r.output
    r = run(["--prompts-file", str(prompts), "-o", str(tmp_path)], tmp_path)
    assert r.exit_code == 2 and "is a directory" in r.output and "generating" not in r.output, r.output
    link = tmp_path / "same.jsonl"
    link.hardlink_to(prompts)
    for output in (str(prompts), str(tmp_path / "." / "p.jsonl"), str(link)):
        r = run(["--prompts-file", str(prompts), "-o", output], tmp_path)
        assert r.exit_code == 1 and "is the --prompts-file" in r.output and "generating" not in r.output, r.output
    assert prompts.read_text() == '"sort 2 1"\n'


def test_output_goes_through_a_temporary_sibling(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"sort 2 1"\n"sort 4 3"\n')
    out = tmp_path / "o.jsonl"
    out.write_text("old\n")
    r = run(["--prompts-file", str(prompts), "-o", str(out), "--max-tokens", "4", "--seed", "0"], tmp_path)
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "p.jsonl"]


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_device_is_a_one_line_error(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"sort 2 1"\n')
    r = run(["--prompts-file", str(prompts), "-o", "/dev/full", "--max-tokens", "4"], tmp_path)
    assert r.exit_code == 1 and "--output /dev/full: writing failed" in r.output, r.output
    assert "No space left on device" in r.output and "internal error" not in r.output, r.output


def test_a_full_disk_mid_run_keeps_what_was_written_and_says_where(tmp_path, monkeypatch):
    import errno
    import io

    from dlm.runtime.cli import batch

    class Full(io.StringIO):  # room for one result line
        def __init__(self, path):
            super().__init__()
            self.path, self.lines = path, 0

        def write(self, text):
            if self.lines:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.lines += 1
            with open(self.path, "a", encoding="utf-8") as f:
                return f.write(text)

    opened = []

    def fake_open(path, mode="r", *args, **kwargs):
        if "w" not in mode:
            return open(path, mode, *args, **kwargs)
        opened.append(path)
        return Full(path)

    monkeypatch.setattr(batch, "open", fake_open, raising=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"sort 2 1"\n"sort 4 3"\n')
    out = tmp_path / "o.jsonl"
    r = run(["--prompts-file", str(prompts), "-o", str(out), "--max-tokens", "4", "--seed", "0",
             "--max-batch", "1"], tmp_path)
    assert r.exit_code == 1, r.output
    (tmp,) = opened
    assert f"--output {out}: writing failed after 1 of 2 results (No space left on device)" in r.output, r.output
    assert str(tmp) in r.output and "internal error" not in r.output, r.output
    assert not out.exists() and [json.loads(line)["index"] for line in open(tmp)] == [0]
