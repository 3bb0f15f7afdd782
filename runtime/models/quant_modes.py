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


def module_quantization(q: dict, module: str, has_biases: bool):
    """{group_size, bits, mode} of a module stored quantized, from an MLX
    quantization block; None when the block marks it unquantized. A per-module
    override wins; one without ``mode`` is affine when the module stores biases
    (mlx-vlm writes 8-bit affine overrides inside an mxfp4 block without a mode).
    ValueError on an unknown mode."""
    entry = q.get(module, True)
    if entry is False:
        return None
    mode, group, bits = q.get("mode", "affine"), q.get("group_size"), q.get("bits")
    if isinstance(entry, dict):
        mode = entry.get("mode") or ("affine" if has_biases else mode)
        group, bits = entry.get("group_size", group), entry.get("bits", bits)
    group, bits = mode_defaults(mode, group, bits)
    return {"group_size": group, "bits": bits, "mode": mode}
