"""transformers' messages that are expected while dlm-verify builds its references,
silenced by name and only around the call that makes them; every other warning
still shows.

- Loading a tokenizer for a ``model_type`` transformers does not know (LLaDA-2's
  ``llada2_moe`` ships its own code), ``AutoTokenizer`` reads config.json into a
  bare ``PreTrainedConfig`` and logs "You are using a model of type `llada2_moe`
  to instantiate a model of type `` ... can yield errors", and that config's
  ``rope_scaling`` key raises transformers' deprecation ``FutureWarning``. The
  tokenizer uses nothing of that config, and dlm-verify's LLaDA-2 reference reads
  config.json itself (``rope_scaling`` is the checkpoint's own key, so the checkpoint's
  code reading it warns the same).
- ``from_pretrained``'s "Loading weights" bar, under ``--quiet`` (no progress lines).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

# The untyped-config message of transformers.configuration_utils (the empty model type).
UNTYPED_CONFIG = "to instantiate a model of type ``."
ROPE_SCALING = r"`rope_scaling` is deprecated"


class _Drop(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


@contextlib.contextmanager
def expected_config_messages():
    """Around a tokenizer or config load of a checkpoint whose model type
    transformers does not know: drop exactly the two messages above."""
    logger = logging.getLogger("transformers.configuration_utils")
    drop = _Drop(UNTYPED_CONFIG)
    logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=ROPE_SCALING, category=FutureWarning)
            yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def loading_bars(shown: bool):
    """transformers' own progress bars ("Loading weights") on or off for the
    duration (``shown``: the run's progress setting), restored afterwards."""
    if shown:
        yield
        return
    try:
        from transformers.utils import logging as tlog
    except ImportError:  # a torch-less compare never builds a reference
        yield
        return
    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tlog.enable_progress_bar()
