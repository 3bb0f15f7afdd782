"""``dlm-run generate --prompts-file prompts.jsonl --output results.jsonl``:
an offline job of many prompts, generated together (dlm.runtime.batch).

Each line of the prompts file is a JSON string (a prompt) or an object:

    {"prompt": "Why is the sky blue?", "seed": 1, "max_tokens": 64}
    {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.5, "id": "q2"}
    {"prompt_ids": [2, 10, 11]}

``prompt`` / ``messages`` / ``prompt_ids`` (exactly one), optionally
``system``, ``chat_template``, ``thinking``, ``images`` (file paths) and
``id`` (copied to the result); every other key is a generation option (the
snake_case flag names, or the request field names: ``temperature``), over the
command line's flags. Blank lines are skipped. The output has one JSON object
per prompt, in the file's order (each written once it and the ones before it
are done), with the fields of ``dlm-run generate --json`` plus ``index`` and
``id``. Every prompt gets exactly what ``dlm-run generate`` gives it alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import click

from ..platform.errors import DlmError, GenerationError
from ..platform.files import open_regular

PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
OTHER_FIELDS = ("system", "chat_template", "thinking", "images", "id")


def batch_options(func):
    """The batch-mode flags of ``dlm-run generate``."""
    options = (
        click.option("--prompts-file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
                     help="Generate for every prompt of this JSONL file together (one JSON string or "
                          "object per line: prompt / messages / prompt_ids and per-prompt options); "
                          "results go to --output."),
        click.option("--output", "-o", type=click.Path(dir_okay=False, allow_dash=True), default=None,
                     help="With --prompts-file: the results JSONL file ['-': stdout]."),
        click.option("--max-batch", type=click.IntRange(min=1), default=None,
                     help="With --prompts-file: prompts generated together [8]; 1: one at a time."),
        click.option("--prefix-cache-gb", type=click.FloatRange(min=0), default=None,
                     help="With --prompts-file: GB of prompt prefills the prompts share (a prompt skips the "
                          "prefill of a prefix computed before, results unchanged); 0: off "
                          "[10% of the memory budget]."),
    )
    for option in reversed(options):
        func = option(func)
    return func


def read_prompts_everywhere(path: str, world) -> list[tuple[int, dict]]:
    """``read_prompts`` on every rank of an mlx.launch job: stdin is read by rank 0
    and handed to the others; a file is read by each rank, which must all read
    the same prompts (else an error on every rank)."""
    from . import ranks

    if path == "-":
        reader = ranks.read_launched_stdin if ranks.launched() else None
        items = ranks.from_rank0(lambda: read_prompts(path, reader), world)
        return [(number, item) for number, item in items]  # pairs again (JSON made them lists)
    items = read_prompts(path)
    if world is None:
        return items
    ranks.agree_on(f"--prompts-file {path} (its prompts)", json.dumps(items, sort_keys=True), world)
    return items


def read_prompts(path: str, read_stdin=None) -> list[tuple[int, dict]]:
    """(line number, item) for each prompt line; a bad line is a DlmError naming it.
    ``read_stdin``: how to read ``-`` (all of stdin)."""
    try:
        if path == "-":
            text = read_stdin() if read_stdin is not None else sys.stdin.read()
        else:
            with open_regular(path, "r", encoding="utf-8") as fp:  # a FIFO would block open() for ever
                text = fp.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DlmError(f"--prompts-file {path}: cannot read it ({exc})") from None
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"--prompts-file {path} line {number}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise DlmError(f"{where}: not JSON ({exc})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict):
            raise DlmError(f"{where}: expected a JSON string or object, got {type(item).__name__}")
        given = [k for k in PROMPT_FIELDS if k in item]
        if len(given) != 1:
            raise DlmError(f"{where}: give exactly one of {', '.join(PROMPT_FIELDS)}"
                           + (f" (got {', '.join(given)})" if given else ""))
        items.append((number, check_line(item, where)))
    if not items:
        raise DlmError(f"--prompts-file {path}: no prompts in it")
    return items


def check_line(item: dict, where: str) -> dict:
    """``item`` with its prompt fields checked as ``dlm-run serve`` checks the same
    request fields (dlm.runtime.server.requests: the same checks, the same
    messages naming the field) and its messages in the form the server gives
    the chat template; null optional fields are dropped (the flags apply)."""
    from ..server.requests import (ModelCaps, RequestError, bad, check_bool, check_string, parse_messages,
                                   parse_options)

    item = {k: v for k, v in item.items() if not (k in OTHER_FIELDS and k != "id" and v is None)}
    try:
        if "messages" in item:
            caps = ModelCaps(family="", text_only=False, image_files=True)  # the model checks its images later
            item["messages"] = parse_messages(item["messages"], caps, [])
        if "prompt" in item:
            if check_string(item["prompt"], "prompt") == "":
                raise bad("the prompt is empty", "prompt")
        if "system" in item:
            check_string(item["system"], "system")
        for key in ("chat_template", "thinking"):
            if key in item:
                check_bool(item[key], key)
        if "images" in item:
            images = item["images"]
            if not isinstance(images, list):
                raise bad("'images' must be a list of image file paths", "images")
            for i, image in enumerate(images):
                check_string(image, f"images[{i}]")
        parse_options(item)  # those under their request names ('temperature'); the family checks the rest
    except RequestError as exc:
        raise DlmError(f"{where}: {exc.message}") from None
    return item


def check_output(output: Optional[str], prompts_file: str) -> None:
    """--output, checked before the model loads: its folder exists, it is not a
    folder, not the prompts file (by path or inode), and can be written."""
    if output in (None, "-"):
        return
    path = Path(output)
    folder = path.parent
    if not folder.exists():
        raise DlmError(f"--output {output}: its folder {folder} does not exist")
    if not folder.is_dir():
        raise DlmError(f"--output {output}: {folder} is not a folder")
    if path.is_dir():
        raise DlmError(f"--output {output}: that is a folder; give a file name")
    if prompts_file != "-" and path.exists():
        try:
            same = path.resolve() == Path(prompts_file).resolve() or os.path.samefile(path, prompts_file)
        except OSError:
            same = False
        if same:
            raise DlmError(f"--output {output} is the --prompts-file: writing the results would overwrite "
                           "the prompts; give another file")
    regular = not path.exists() or path.is_file()
    if (path.exists() and not os.access(path, os.W_OK)) or (regular and not os.access(folder, os.W_OK)):
        raise DlmError(f"--output {output}: cannot write there (permission denied)")


class Output:
    """The results file: a temporary sibling (``.NAME.PID.part``) written as
    results come and renamed onto --output at the end, so a failed run never
    leaves a truncated --output; stdout for ``-``; a device or pipe
    (``/dev/null``) written in place. A write error is a DlmError naming the
    file and where the results written so far are."""

    def __init__(self, output: Optional[str], total: int):
        self.output, self.total, self.written, self.failed = output, total, 0, False
        self.tmp: Optional[Path] = None
        if output in (None, "-"):
            self.file = sys.stdout
            return
        path = Path(output)
        if path.is_symlink():  # replace the file it points to, not the link
            path = path.resolve()
        self.final = target = path
        if not path.exists() or path.is_file():
            self.tmp = target = path.with_name(f".{path.name}.{os.getpid()}.part")
        try:
            self.file = open(target, "w", encoding="utf-8")
        except OSError as exc:
            raise DlmError(f"--output {output}: cannot write {target} ({exc.strerror or exc})") from None

    def write(self, line: str) -> None:
        try:
            self.file.write(line)
            self.file.flush()
        except OSError as exc:
            self.fail(exc)
        self.written += 1

    def fail(self, exc: OSError):
        self.failed = True
        self._close(quiet=True)
        where = self.tmp if self.tmp is not None else self.output
        kept = (f"; the {self.written} result(s) written before it are in {where} (its last line may be cut)"
                if self.written and self.tmp is not None else
                f"; the {self.written} result(s) written before it went to {where}" if self.written else "")
        if self.tmp is not None and not self.written:
            self.tmp.unlink(missing_ok=True)
        lost = self.total - self.written
        raise DlmError(f"--output {self.output}: writing failed after {self.written} of {self.total} results "
                       f"({exc.strerror or exc}){kept}" + (f"; the other {lost} are lost" if lost else "")) from None

    def _close(self, quiet: bool = False) -> None:
        if self.file is sys.stdout:
            return
        try:
            self.file.close()
        except OSError:
            if not quiet:
                raise

    def finish(self) -> None:
        """Close and rename the temporary file onto --output."""
        try:
            self._close()
            if self.tmp is not None:
                os.replace(self.tmp, self.final)
        except OSError as exc:
            self.fail(exc)

    def abandon(self) -> None:
        """The run failed: keep what was written (saying where), or remove the empty file."""
        self._close(quiet=True)
        if self.tmp is None or self.failed:
            return
        if self.written:
            click.echo(f"note: the {self.written} result(s) written before the error are in {self.tmp}", err=True)
        else:
            self.tmp.unlink(missing_ok=True)


def encode(api, loaded, item: dict, defaults: dict, where: str):
    """The prompt of one item: ids, or PromptInputs with images."""
    try:
        if "prompt_ids" in item:
            if item.get("images"):
                raise GenerationError("images take a prompt or messages, not prompt_ids (raw ids carry no image)")
            ids = item["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise GenerationError("prompt_ids must be a non-empty list of token ids")
            return ids
        template = item.get("chat_template", defaults["chat_template"])
        kwargs = dict(system=item.get("system", defaults["system"]), chat_template=template,
                      enable_thinking=item.get("thinking", defaults["thinking"]))
        text = item.get("prompt")
        messages = item.get("messages")
        if text is not None and not isinstance(text, str):
            raise GenerationError("prompt must be a string")
        if item.get("images"):
            from ..generation.images import open_file

            pictures = [open_file(p, f"images: {p}") for p in item["images"]]
            return api.encode_inputs(loaded, text, messages, images=pictures, **kwargs)
        return api.encode_prompt(loaded, text, messages, **kwargs)
    except DlmError as exc:
        raise DlmError(f"{where}: {exc}") from None


def result_record(index: int, item: dict, prompt_ids: list[int], result) -> dict:
    record = {"index": index}
    if "id" in item:
        record["id"] = item["id"]
    record.update({
        "prompt_ids": prompt_ids, "token_ids": result.token_ids, "text": result.text,
        "reasoning": result.reasoning, "finish_reason": result.finish_reason,
        "steps_per_canvas": result.stats.steps_per_block, "tokens_per_canvas": [len(b) for b in result.blocks],
        "stats": result.stats.to_dict(),
    })
    return record


def check_flags(prompts_file: Optional[str], output, max_batch, single: dict, prefix_cache_gb=None) -> None:
    """--output / --max-batch / --prefix-cache-gb need --prompts-file, which takes
    none of the one-prompt flags in ``single`` (flag -> value given)."""
    if prompts_file is None:
        for flag, value in (("--output", output), ("--max-batch", max_batch),
                            ("--prefix-cache-gb", prefix_cache_gb)):
            if value is not None:
                raise click.UsageError(f"{flag} takes effect only with --prompts-file")
        return
    given = [flag for flag, value in single.items() if value]
    if given:
        raise click.UsageError(f"--prompts-file takes its prompts from the file; drop {', '.join(given)}")
    check_output(output, prompts_file)  # before the model loads, not after the whole run


def run_prompts_file(loaded, path: str, items: list[tuple[int, dict]], output: Optional[str], options: dict,
                     defaults: dict, max_batch: Optional[int], profile: bool,
                     prefix_cache_gb: Optional[float] = None) -> None:
    """The job of ``items`` (read_prompts of ``path``): check every prompt,
    generate, write (see the module doc)."""
    from . import ranks
    from ..generation.prefix_cache import sized

    cache = sized(prefix_cache_gb, options.get("memory_budget"))
    with ranks.watched(getattr(loaded, "world", None)) as dog, ranks.busy(dog):
        _run_prompts(loaded, path, items, output, options, defaults, max_batch, profile, ranks.beating(dog), cache)


def _run_prompts(loaded, path, items, output, options, defaults, max_batch, profile, cancel, cache) -> None:
    from .. import api
    from ..batch import DEFAULT_MAX_BATCH, Batcher

    batcher = Batcher(loaded, max_batch or DEFAULT_MAX_BATCH, options.get("memory_budget"), cache)
    prompts = []
    for index, (number, item) in enumerate(items):
        where = f"--prompts-file {path} line {number}"
        prompt = encode(api, loaded, item, defaults, where)
        own = {k: v for k, v in item.items() if k not in PROMPT_FIELDS + OTHER_FIELDS}
        try:
            entry = batcher.add(prompt, {**options, **own}, cancel=cancel, key=index)
        except DlmError as exc:
            raise DlmError(f"{where}: {exc}") from None
        prompts.append(list(getattr(entry.session, "prompt_ids", None) or entry.session.prompt))
    results = [api.GenerationResult() for _ in items]
    out = Output(output, len(items))
    written, done, tokens, start = 0, 0, 0, time.perf_counter()
    try:
        with click.progressbar(length=len(items), label="generating", file=sys.stderr,
                               show_eta=True, item_show_func=lambda s: s) as bar:
            for entry, event in batcher.run():
                api._take(results[entry.key], event)
                tokens += len(event.token_ids)
                if not event.done:
                    continue
                done += 1
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                bar.update(1, f"{tokens} tokens, {rate:.1f} tokens/s")
                while written < len(items) and results[written].finish_reason is not None:
                    out.write(json.dumps(result_record(written, items[written][1], prompts[written],
                                                       results[written])) + "\n")
                    written += 1
        out.finish()
    except BaseException:
        out.abandon()
        raise
    if profile:
        wall = time.perf_counter() - start
        click.echo(f"Batch: {len(items)} prompts, {tokens} tokens in {wall:.3f} s, "
                   f"{tokens / wall if wall else 0.0:.3f} tokens-per-sec (up to {batcher.max_batch} together)",
                   err=True)
        if cache is not None:
            s = cache.stats()
            click.echo(f"Prefix cache: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens served "
                       f"({100 * s['token_hit_rate']:.1f}%), {s['hits']} of {s['lookups']} prompts hit, "
                       f"{s['bytes'] / 1e6:.1f} MB held of {s['limit_bytes'] / 1e6:.1f} MB, "
                       f"{s['evictions']} evictions", err=True)
