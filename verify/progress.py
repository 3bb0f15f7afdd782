"""Progress of the parity suite's long loops on stderr."""

from __future__ import annotations

import sys
import time
from typing import Optional


def tqdm(iterable, desc: str, enabled: bool, total: Optional[int] = None):
    """Progress on stderr: a tqdm bar on a terminal, else plain lines (one every
    few seconds, with an ETA, and one with the time taken), so a log shows where
    a long run is."""
    if not enabled:
        return iterable
    if sys.stderr.isatty():
        from tqdm import tqdm as bar

        return bar(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)
    return _lines(iterable, desc, total if total is not None else len(iterable))


def _lines(iterable, desc: str, total: int, every: float = 5.0):
    start = last = time.perf_counter()
    print(f"{desc}: 0/{total}", file=sys.stderr, flush=True)
    for i, item in enumerate(iterable, 1):
        yield item
        now = time.perf_counter()
        if now - last >= every and i < total:
            eta = (now - start) / i * (total - i)
            print(f"{desc}: {i}/{total} ({now - start:.0f} s, ETA {eta:.0f} s)", file=sys.stderr, flush=True)
            last = now
    print(f"{desc}: {total}/{total} done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
