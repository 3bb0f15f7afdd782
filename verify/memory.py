"""Resident memory of a verify run: per-phase peaks, and handing freed heap back.

``Monitor`` samples this process's resident set (``/proc/self/statm``) on a
background thread and keeps the peak and the last value of each named phase,
for the report's timings: a run's peak RSS alone does not say which phase
set it. The kernel's own high-water mark (VmHWM) is left alone: resetting it
would also lower the peak that ``getrusage`` reports to a parent measuring
this process.

``trim()`` calls glibc's ``malloc_trim(0)``. A layer-streamed reference frees
a layer's worth of tensors on every layer; glibc keeps tensors under its mmap
threshold (up to 32 MB, e.g. LLaDA-2's per-expert matrices) in per-thread
arenas and returns little of that to the system, and lockstep passes
(``lockstep.py``) load layers from several threads, so each thread's arena can
end up holding a layer. ``malloc_trim`` releases the free pages of every arena
(4–62 ms after a thread freed 1.2 GB of 4 MB arrays, next to seconds of
reading a layer). Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc = None


def trim() -> None:
    """Return free heap pages to the system (glibc); a no-op elsewhere."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def rss_bytes() -> int | None:
    """This process's resident set now, or None where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class Monitor:
    """Peak and end resident memory per phase, sampled every ``interval`` s."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.phases: dict[str, dict[str, float]] = {}
        self._current: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if rss_bytes() is not None:
            self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        rss = rss_bytes()
        if rss is None:
            return
        with self._lock:
            for name in self._current:
                p = self.phases[name]
                p["peak"] = max(p["peak"], rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Count the samples taken while the block runs towards phase ``name``
        (phases nest: an outer phase sees its inner ones' samples)."""
        if self._thread is None:
            yield
            return
        with self._lock:
            self.phases.setdefault(name, {"peak": 0, "end": 0})
            self._current.append(name)
        self._sample()
        try:
            yield
        finally:
            self._sample()
            with self._lock:
                self._current.remove(name)
                self.phases[name]["end"] = rss_bytes() or 0

    def summary(self) -> dict:
        """``{phase: {"peak": GB, "end": GB}}``, in the order the phases began."""
        with self._lock:
            return {k: {"peak": round(v["peak"] / 1e9, 3), "end": round(v["end"] / 1e9, 3)}
                    for k, v in self.phases.items()}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


_active: Monitor | None = None


@contextlib.contextmanager
def phase(name: str):
    """A phase of the active monitor (``monitoring()``); nothing without one."""
    if _active is None:
        yield
        return
    with _active.phase(name):
        yield


@contextlib.contextmanager
def monitoring():
    """Make a fresh Monitor the active one for the block; yields it. Nested
    calls reuse the outer monitor (``record`` inside ``run_parity``)."""
    global _active
    if _active is not None:
        yield _active
        return
    _active = Monitor()
    try:
        yield _active
    finally:
        _active.close()
        _active = None
