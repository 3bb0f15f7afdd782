"""Taps in the models' layer loops, for dlm-verify's per-layer checks.

The models' forward methods take ``collect``: a list that gets each layer's
output. A ``collect`` with a ``feed`` method also supplies each layer's input
(``layer_input``): dlm-verify's layer-local check (dlm.verify.local) runs
every MLX layer on the reference's own input, so rounding cannot compound
from one layer into the next.
"""

from __future__ import annotations


def layer_input(collect, h):
    """``h``, or what ``collect.feed`` hands the layer instead (it sees ``h`` first)."""
    feed = getattr(collect, "feed", None)
    return h if feed is None else feed(h)
