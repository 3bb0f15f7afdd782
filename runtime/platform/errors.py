"""Errors dlm reports to users: each names the file, tensor or key at fault."""


class DlmError(Exception):
    """Base class: a problem with the user's input, reported without a traceback."""


class ConfigError(DlmError):
    """A config.json / generation_config.json that dlm cannot use."""


class UnsupportedModelError(DlmError):
    """A model_type that no registered family handles."""


class WeightError(DlmError):
    """A missing, extra, truncated or mis-shaped tensor."""


class GenerationError(DlmError):
    """Bad generation request (flags that do not apply, prompt too long, ...)."""
