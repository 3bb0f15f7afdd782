"""``dlm-run`` under ``mlx.launch``: every rank runs the same command, only rank 0 speaks.

Every rank loads the model (its share of it) and runs the same generation loop
on the same inputs with the same seed; rank 0 prints the results, streams and
writes files. What only rank 0 can read (stdin) reaches the other ranks through
``distributed.broadcast``. A plain run has no world: everything here is then a
no-op and the command behaves as it always did.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from typing import Any, Callable, Optional

from ..platform import distributed, settings
from ..platform.errors import DlmError

# mlx.launch forwards its stdin to every rank but never closes theirs: a piped
# prompt's end never arrives, so under it the prompt ends after this much quiet.
STDIN_QUIET_SECONDS = 1.0


def rank() -> int:
    """This process's rank under mlx.launch (0 in a plain run), known before the group is joined."""
    try:
        return int(os.environ.get("MLX_RANK", "0"))
    except ValueError:
        return 0


def speaks() -> bool:
    """Rank 0, or a plain run: the one process that prints."""
    return rank() == 0


class _ErrorLines:
    """stderr of a rank other than 0: only its ``error:`` lines pass (each rank says
    why it stops); notes, warnings, reasoning and --profile are rank 0's."""

    def __init__(self, stream):
        self.stream, self.line = stream, ""

    def write(self, text: str) -> int:
        self.line += text
        while "\n" in self.line:
            line, self.line = self.line.split("\n", 1)
            if line.startswith("error:"):
                self.stream.write(line + "\n")
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self.stream, name)


def silence_followers() -> None:
    """On a rank other than 0: stdout goes nowhere and stderr keeps only error
    lines (all of it with DLM_DEBUG, for tracebacks)."""
    if speaks() or isinstance(sys.stderr, _ErrorLines):
        return
    sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if not settings.DEBUG.get():
        sys.stderr = _ErrorLines(sys.stderr)


def launched() -> bool:
    """Whether this process is one rank of an mlx.launch job (even a job of one)."""
    return distributed.launched()


def peer_lost(exc: BaseException) -> Optional[str]:
    """The error line for a collective that failed because another rank went away
    (MLX's backends raise RuntimeError "[ring] ..." and the like), else None."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not text.startswith(("[ring]", "[jaccl]", "[mpi]", "[nccl]")):
        return None
    return (f"rank {rank()}: {text}: another rank died or was stopped (mlx.launch's output says which); "
            "stopping")


def world():
    """The mlx.launch group (None in a plain run)."""
    return distributed.world()


def from_rank0(read: Callable[[], Any], w) -> Any:
    """``read()`` on rank 0, its value (or its DlmError) on every rank."""
    if w is None:
        return read()
    message = None
    value = None
    if w.primary:
        try:
            value = read()
        except DlmError as exc:
            message = str(exc)
    got = distributed.broadcast({"value": value, "error": message} if w.primary else None, w)
    if got["error"] is not None:
        raise DlmError(got["error"])
    return got["value"]


def read_launched_stdin(what: str = "stdin", quiet: float = STDIN_QUIET_SECONDS) -> str:
    """stdin on rank 0 under mlx.launch: up to its end, or ``quiet`` seconds after
    the last bytes came once some did (mlx.launch never closes a rank's stdin)."""
    fd = sys.stdin.fileno()
    chunks: list[bytes] = []
    while True:
        ready, _, _ = select.select([fd], [], [], quiet if chunks else None)
        if not ready:
            break
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DlmError(f"{what} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def agree_on(what: str, value: str, w) -> None:
    """Every rank holds the same ``value`` (an input each rank read itself)."""
    distributed.agree(what, value, w)


@contextlib.contextmanager
def watched(w):
    """A Watchdog for a distributed run (None in a plain run): it ends this rank
    when a peer dies or hangs while it is busy."""
    if w is None:
        yield None
        return
    with distributed.Watchdog(w) as dog:
        yield dog


def beating(dog, cancel: Optional[Callable[[], bool]] = None) -> Optional[Callable[[], bool]]:
    """A ``cancel`` hook (polled once per denoising step) that also beats ``dog``."""
    if dog is None:
        return cancel

    def poll() -> bool:
        dog.beat()
        return bool(cancel()) if cancel is not None else False

    return poll


@contextlib.contextmanager
def busy(dog):
    """``dog`` watches while generating (a peer that stops answering ends this rank)."""
    if dog is None:
        yield
        return
    dog.beat()
    dog.busy = True
    try:
        yield
    finally:
        dog.busy = False


def reset_counts() -> float:
    """Start counting this run's collectives (--profile); returns the start time."""
    distributed.COUNTS.reset()
    return time.perf_counter()


def profile_line(loaded, steps: int) -> list[str]:
    """--profile under mlx.launch: ranks, collectives and bytes per denoising step, and
    what the family split and replicated."""
    w = getattr(loaded, "world", None)
    if w is None:
        return []
    calls, size = distributed.COUNTS.total()
    per = max(steps, 1)
    kinds = ", ".join(f"{k} {n / per:.1f}" for k, n in sorted(distributed.COUNTS.calls.items()))
    line = (f"Distributed: {w.size} ranks, {calls / per:.1f} collectives per denoising step "
            f"({kinds or 'none'}), {size / per / 1024:.1f} KiB per step ({steps} steps)")
    notes = list(getattr(loaded, "shard_notes", []) or [])
    return [line] + ([f"Sharded: {'; '.join(notes)}"] if notes else [])
