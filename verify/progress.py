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


class LayerBar:
    """Progress over the layers of one streamed forward pass, with an ETA from
    the mean time per layer so far: a tqdm bar on a terminal, else a line every
    few seconds (a tiny model prints nothing)."""

    def __init__(self, enabled: bool, every: float = 5.0):
        self.enabled, self.every = enabled, every
        self._bar = None
        self._desc = ""
        self._start = self._last = None
        self._layers = 0

    def step(self, desc: str, index: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start is None:
            self._start = self._last = now
        self._layers += 1
        per_layer = (now - self._start) / max(1, self._layers - 1)
        eta = per_layer * (total - index)
        if sys.stderr.isatty():
            from tqdm import tqdm as bar

            if self._bar is None:
                self._bar, self._desc = bar(total=total, desc=desc, leave=False, dynamic_ncols=True), desc
            if index == 0 or self._bar.total != total or self._desc != desc:
                self._bar.reset(total=total)
                self._bar.set_description(desc, refresh=False)
                self._desc = desc
            self._bar.n = index + 1
            self._bar.set_postfix_str(f"pass ETA {eta:.0f} s", refresh=True)
        elif now - self._last >= self.every:
            print(f"{desc}: layer {index + 1}/{total} ({per_layer:.1f} s/layer, pass ETA {eta:.0f} s)",
                  file=sys.stderr, flush=True)
            self._last = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
