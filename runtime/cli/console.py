"""What every dlm command line shares: errors are one line, never a traceback.

``Command`` and ``Group`` are click classes for dlm-convert, dlm-verify and
dlm-run. A ``DlmError`` (bad input: it names the file, tensor, key or flag)
prints ``error: MESSAGE`` and exits with the tool's error status; any other
exception is a dlm bug and prints one line saying so (``DLM_DEBUG=1`` shows the
traceback). Text the user typed is checked to be valid UTF-8 before use.
"""

from __future__ import annotations

import shutil
import sys

import click

from ..platform import backend, blas, precision, settings
from ..platform.errors import DlmError

CONTEXT = {"help_option_names": ["-h", "--help"]}


def fail(message: str, code: int = 1):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class _Guarded:
    """invoke() with the one-line error rule; -h/--help; the tool's error status."""

    def __init__(self, *args, error_code: int = 1, **kwargs):
        kwargs.setdefault("context_settings", CONTEXT)
        super().__init__(*args, **kwargs)
        self.error_code = error_code

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise
        except DlmError as exc:
            fail(str(exc), self.error_code)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Exception as exc:
            if settings.DEBUG.get():
                raise
            from .ranks import peer_lost

            lost = peer_lost(exc)  # under mlx.launch: another rank is gone, not a dlm bug
            if lost is not None:
                fail(lost, self.error_code)
            fail(f"internal error ({type(exc).__name__}: {exc}); this is a dlm bug, please report it "
                 "(DLM_DEBUG=1 shows the traceback)", self.error_code)


class Command(_Guarded, click.Command):
    pass


class Group(_Guarded, click.Group):
    command_class = Command


def model_options(func):
    """--model, --revision, --compute-dtype and --trust-remote-code, for every
    command that loads a model (dlm-run generate, serve, chat)."""
    options = (
        click.option("--model", "model_path", required=True,
                     help="Converted MLX model: a directory or a Hub repo id (org/name, fetched into the HF cache)."),
        click.option("--revision", default=None, metavar="REV", help="Hub branch, tag or commit (repo ids only)."),
        click.option("--compute-dtype", type=click.Choice(["auto", "native", "float32"]), default=None,
                     help="auto: on the CPU backend float32, quantized weights dequantized at load when they "
                          "fit, else per call (its half-precision and quantized kernels are slow); on Metal/CUDA the stored "
                          "dtype. native: the stored dtype and quantized kernels. float32: upcast, quantized "
                          "kernels kept [auto, or DLM_COMPUTE_DTYPE]."),
        click.option("--trust-remote-code", is_flag=True, help="Allow the tokenizer to run checkpoint code."),
    )
    for option in reversed(options):
        func = option(func)
    return func


def check_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode (argv and JSON can carry lone surrogates):
    the check api.encode_inputs makes of every prompt string, named as a flag."""
    from ..generation.inputs import check_text as check

    return check(text, what, label=what)


def read_stdin(what: str = "stdin") -> str:
    """All of stdin, decoded as UTF-8 (strictly: invalid bytes are an error naming the offset)."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        return check_text(sys.stdin.read(), what)
    data = stream.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DlmError(f"{what} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


class LiveView:
    """``--verbose``: the canvas/block after every denoising step, on stderr.
    On a terminal one line is redrawn in place (each finished canvas stays on
    its own line); elsewhere one plain line per step. Masked positions show
    as ``_``. It is the generation loop's ``watch`` hook: nothing runs without it.

    Committed text and reasoning go through ``echo``: while the view redraws a
    terminal line, text bound for a terminal too is held and written by
    ``close`` after the step lines, so the answer reads as one string (written
    between redraws it would land on the step line, cut into pieces)."""

    def __init__(self, tokenizer, block_name: str, mask_token_id=None, stream=None):
        self.tokenizer, self.block_name, self.mask = tokenizer, block_name, mask_token_id
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.index = None
        self.held: list[tuple[str, bool]] = []  # (text, to stderr) held until close()

    def echo(self, text: str, err: bool = False) -> None:
        """Committed answer text (stdout) or reasoning (``err``: stderr)."""
        if not text:
            return
        target = sys.stderr if err else sys.stdout
        if self.tty and (target is self.stream or _isatty(target)):
            self.held.append((text, err))
        else:
            click.echo(text, nl=False, err=err)

    def __call__(self, index: int, step: int, ids: list[int]) -> None:
        pieces = ["_" if t == self.mask else self.tokenizer.decode([t], skip_special_tokens=True) for t in ids]
        line = f"[{self.block_name} {index + 1} step {step + 1}] " + "".join(pieces).replace("\n", "\u23ce")
        if not self.tty:
            print(line, file=self.stream, flush=True)
            return
        if self.index is not None and index != self.index:
            self.stream.write("\n")
        self.index = index
        width = max(20, shutil.get_terminal_size().columns - 1)
        self.stream.write("\r\033[K" + line[:width])
        self.stream.flush()

    def close(self) -> None:
        """End the step display; then the held text, whole."""
        if self.tty and self.index is not None:
            self.stream.write("\n")
            self.stream.flush()
        self.index = None
        held, self.held = self.held, []
        for text, err in held:
            click.echo(text, nl=False, err=err)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def echo_environment_notes() -> None:
    """The one-line notes every CLI prints first: a slow BLAS with a faster one
    to install, several MLX backends overwriting each other's library."""
    for note in (blas.hint(), backend.conflict()):
        if note:
            click.echo(note, err=True)


_PLURAL = {"canvas": "Canvases", "block": "Blocks"}


def live_view(loaded) -> LiveView:
    return LiveView(loaded.tokenizer, loaded.family.generation.Session.block_name, loaded.args.mask_token_id)


def profile_lines(stats, loaded=None) -> list[str]:
    steps = stats.steps_per_block
    mean = sum(steps) / len(steps) if steps else 0.0
    cached = f" ({stats.cached_prompt_tokens} from the kept cache)" if stats.cached_prompt_tokens else ""
    images = []
    if stats.image_tokens:  # the vision encoder apart from the text prefill (prompt_seconds excludes it)
        cached += f", {stats.image_tokens} of them image soft tokens"
        images = [f"Vision encoder: {stats.vision_seconds:.3f} s for {stats.image_tokens} image soft tokens"]
    rate = f"{stats.prompt_tps:.3f} tokens-per-sec"
    if stats.deferred_prompt_tokens:  # computed with the first block's forwards, not in the prefill's time
        prefilled = stats.prompt_tokens - stats.cached_prompt_tokens - stats.deferred_prompt_tokens
        rate = (f"{stats.deferred_prompt_tokens} in the first block's forwards, "
                + (f"{prefilled / stats.prompt_seconds:.3f} tokens-per-sec for the {prefilled} prefilled"
                   if prefilled > 0 and stats.prompt_seconds else "none prefilled"))
    return images + [
        f"Prompt: {stats.prompt_tokens} tokens{cached}, {rate}",
        f"Generation: {stats.completion_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec",
        f"{_PLURAL.get(stats.block_name, stats.block_name)}: {len(steps)}, denoising steps per {stats.block_name}: "
        f"{steps} (mean {mean:.1f}), "
        f"stopped early: {stats.early_stops}",
        f"Tokens per forward: {stats.tokens_per_forward:.3f} ({stats.forwards} forwards)",
        f"Peak memory: {stats.peak_memory_gb:.3f} GB",
        f"BLAS: {blas.STATUS if blas.STATUS not in ('off', 'reference') else 'MLX default'}",
        f"MLX backend: {backend.describe()}; float32 matmuls: {precision.describe()}",
    ] + ([compute_line(loaded)] if loaded is not None else [])


def compute_line(loaded) -> str:
    notes = []
    if loaded.upcast:
        notes.append("half-precision weights upcast")
    if loaded.dequantized:
        notes.append(f"{loaded.dequantized} quantized modules dequantized at load")
    if getattr(loaded, "per_call", 0):
        notes.append(f"{loaded.per_call} quantized modules dequantized per call")
    if getattr(loaded, "relaid", 0):
        notes.append(f"{loaded.relaid} weights stored [in, out]")
    return f"Compute: {loaded.compute_dtype}" + (f" ({', '.join(notes)}, for the CPU backend)" if notes else "")
