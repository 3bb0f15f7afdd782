"""What a block generator (batch.Member, levenshtein.decode_block, structured.denoise_structured) yields to
whoever drives it, alone or in a batch (batch.py): a window to run through the
model, or an array to read on the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np


@dataclass
class Forward:
    """A window to run: ids [L] at the cache's offset, under ``mask``; the
    head's logits for the block's ``rows`` only (its masked positions), or
    for all its positions (None)."""

    ids: mx.array
    mask: Optional[mx.array]
    rows: Optional[np.ndarray] = None


@dataclass
class Sync:
    """An array to read on the host: ``.tolist()``, or a numpy array with ``host``."""

    value: mx.array
    host: bool = False

    def read(self):
        return np.array(self.value) if self.host else self.value.tolist()
