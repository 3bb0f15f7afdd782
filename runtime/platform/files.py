"""Opening a file the user named, only if it is a regular file.

``open()`` on a FIFO with no writer blocks for ever, and one on a character
device (``/dev/zero``) reads for ever; a path the user gives as an input file
(``--image``, ``--prompts-file``) is opened non-blocking, checked with
``fstat`` on the open descriptor (no window between a check and the open),
and refused unless it is a regular file."""

from __future__ import annotations

import io
import os
import stat


class NotRegularFile(OSError):
    """The path names a FIFO, a device, a socket or a directory."""

    def __str__(self) -> str:
        return self.strerror


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path, mode: str = "rb", encoding: str | None = None):
    """``open(path, mode)`` for reading a regular file; ``NotRegularFile`` (an
    OSError whose ``strerror`` says what the path is) for anything else,
    without blocking on a FIFO."""
    if mode not in ("r", "rb"):
        raise ValueError(f"open_regular reads only ('r' or 'rb'), not {mode!r}")
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            what = _kind(info.st_mode)
            raise NotRegularFile(0, f"{what}, not a regular file" if what != "not a regular file" else what,
                                 os.fspath(path))
        os.set_blocking(fd, True)
        return io.open(fd, mode, encoding=encoding if mode == "r" else None, closefd=True)
    except BaseException:
        os.close(fd)
        raise


def hold_standard_fds() -> None:
    """Put /dev/null on any of fds 0, 1 and 2 that is closed (``dlm-run generate
    0<&-``, a supervisor that closes stdin).

    A closed fd 0 is the lowest free descriptor, so the next file opened gets
    it; MLX's safetensors reader takes descriptor 0 for "not open" (its check
    is ``fd > 0``), and ``mx.load`` of that file failed with "Failed to open
    file". A closed 1 or 2 would likewise hand a model file's descriptor to
    the next print. Called when ``dlm.runtime`` is imported, and again before
    weights are loaded."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)
            except OSError:
                return
            if null != fd:  # (lower ones are open, so this is the lowest free: fd itself)
                os.dup2(null, fd)
                os.close(null)
    # Python leaves sys.stdin (stdout, stderr) None when its fd was closed at
    # startup: an empty stdin (EOF) from now on, and writes that go nowhere.
    import sys

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is None:
            try:
                setattr(sys, name, open(fd, mode, closefd=False))
            except OSError:
                pass
