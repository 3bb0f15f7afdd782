"""The MLX quantization modes dlm writes and reads: mode -> (default group size, bits).

One table for the recipes (dlm.quantize), the runtime's expert layers and the
verify dequantizer, so a new mode is added in one place.
"""

MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
MODES = tuple(MODE_DEFAULTS)


def mode_defaults(mode: str, group_size=None, bits=None) -> tuple[int, int]:
    """(group_size, bits) for ``mode``, each taken from the table when not given."""
    if mode not in MODE_DEFAULTS:
        raise ValueError(f"unknown quantization mode {mode!r}; choose from {', '.join(MODES)}")
    g, b = MODE_DEFAULTS[mode]
    return group_size or g, bits or b
