"""Load a model directory into MLX: config -> family -> ModelArgs -> Model.

Accepts dlm conversions, mlx-community conversions (same names, a
``quantization`` block with per-module overrides) and, through the family's
``sanitize``, plain Hugging Face checkpoints of a supported family. Weights are
read only from safetensors; tokenizers never run checkpoint code unless
``trust_remote_code``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .checkpoint import check_tokenizer, read_generation_config, read_json, weight_files
from .platform import settings as env
from .platform.errors import ConfigError, DlmError, WeightError
from .registry import Family, family_for_config, settings

@dataclass
class LoadedModel:
    path: Path
    config: dict
    args: Any  # the family's ModelArgs
    family: Family
    model: Any  # the family's mlx.nn.Module
    tokenizer: Any
    generation_config: dict = field(default_factory=dict)
    source: str = ""  # what the user named: the directory or the Hub repo id
    compute_dtype: str = "float32"  # what the model computes in (see COMPUTE_DTYPES)
    upcast: bool = False  # half-precision weights were upcast to float32 for the CPU backend
    dequantized: int = 0  # quantized modules dequantized to float32 at load (CPU backend)
    per_call: int = 0  # quantized modules dequantized per call (CPU backend; models/cpu/dequant.py)
    relaid: int = 0  # float weights stored [in, out] for the CPU's BLAS (models/cpu/layout.py)
    # The family's image processor, built on first use (api.image_processor).
    image_processor: Any = None
    world: Any = None  # the mx.distributed World this rank shares the model with (None: one process)
    shard_notes: list = field(default_factory=list)  # what the family split and what it replicated

    def settings(self, options: dict):
        """The family's generation Settings for ``options`` (checked by name and
        range first) over this checkpoint's generation_config."""
        return settings(self.family, options, self.args, self.generation_config)


def load_weights(path: Path) -> dict:
    import mlx.core as mx

    from .platform.files import hold_standard_fds

    hold_standard_fds()  # MLX's reader takes fd 0 for "not open": never let a weight file get it
    weights: dict = {}
    for f in weight_files(path):
        try:
            weights.update(mx.load(str(f)))
        except Exception as exc:  # truncated / not safetensors
            raise WeightError(f"{f}: cannot read safetensors: {exc}") from None
    return weights


def quantization_block(config: dict) -> Optional[dict]:
    """The MLX quantization block, or None. Other quantization formats are refused."""
    q = config.get("quantization")
    if q is None:
        q = config.get("quantization_config")
        if q is not None and "quant_method" in q and "bits" not in q:
            raise ConfigError(
                f"config.json: quantization_config uses quant_method {q.get('quant_method')!r}; "
                "dlm runs MLX conversions (convert it with dlm-convert first)"
            )
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError("config.json: 'quantization' is not an object")
    return q


def apply_quantization(model, q: dict, weights: dict) -> None:
    """nn.quantize the modules that are stored quantized.

    A module is quantized iff ``<path>.scales`` is in the weights (as mlx-lm
    does); its parameters come from its per-module override in ``q`` if any,
    else from the block's defaults. An override without ``mode`` is affine when
    the module has ``.biases`` (mlx-vlm writes 8-bit affine overrides inside an
    mxfp4 block without a mode), else the block's mode.
    """
    import mlx.nn as nn

    from .models.quant_modes import module_quantization

    def predicate(path: str, module) -> Any:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        params = module_quantization(q, path, f"{path}.biases" in weights)
        if params is None:
            raise WeightError(f"{path}.scales is stored but config.json marks {path} unquantized")
        return params

    try:
        nn.quantize(model, class_predicate=predicate)
    except ValueError as exc:
        raise ConfigError(f"config.json: bad quantization block: {exc}") from None


def check_weights(model, weights: dict) -> None:
    """Names and shapes must match the module tree exactly; say which do not."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    missing = sorted(set(params) - set(weights))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightError(f"missing tensor {missing[0]}{more}")
    extra = sorted(set(weights) - set(params))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise WeightError(f"unexpected tensor {extra[0]}{more}")
    for name, value in weights.items():
        want = tuple(params[name].shape)
        if tuple(value.shape) != want:
            raise WeightError(f"tensor {name} has shape {list(value.shape)}, expected {list(want)}")


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """AutoTokenizer from the directory. transformers' deprecation notices about the
    model config (which it reads on the way) are not the user's business here."""
    import warnings

    check_tokenizer(path)
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        finally:
            hf_logging.set_verbosity(level)
    except Exception as exc:
        raise ConfigError(f"{path}: cannot load the tokenizer: {exc}") from None


# "auto": on the CPU backend, float32 (MLX's CPU bf16/f16 kernels are many times
# slower than float32 with a real BLAS) and quantized modules dequantized to
# float32 at load when that fits half the memory budget (MLX's CPU quantized
# kernels are slower still); on Metal/CUDA, the stored dtype and the quantized
# kernels. "native": the stored dtype and the quantized kernels everywhere.
# "float32": half-precision weights upcast, quantized kernels kept.
# DLM_COMPUTE_DTYPE sets the default. Under auto, quantized weights that do not
# fit as float32 stay quantized and are dequantized per call (models/cpu/dequant.py);
# DLM_CPU_DEQUANTIZE=call does that always, =kernels never (the quantized kernels).
COMPUTE_DTYPES = env.COMPUTE_DTYPE.choices  # ("auto", "native", "float32"), declared with the variable
CPU_DEQUANTIZE = env.CPU_DEQUANTIZE.choices  # ("auto", "call", "kernels")


def compute_in_float32(model, budget: Optional[int] = None) -> bool:
    """Upcast every half-precision parameter (weights, norms, quantization scales
    and biases) to float32, exactly; returns whether anything changed. With
    ``budget`` (bytes), only when the extra memory (as much again as the half
    parameters) fits in it: a full-size bf16 model on a small machine keeps bf16."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    half = [(name, p) for name, p in tree_flatten(model.parameters()) if p.dtype in (mx.bfloat16, mx.float16)]
    if budget is not None and sum(p.nbytes for _, p in half) > budget:
        return False
    updates = [(name, p.astype(mx.float32)) for name, p in half]
    if updates:
        model.load_weights(updates, strict=False)
    return bool(updates)


def dequantized_size(model) -> int:
    """Bytes the quantized modules would take as float32 weights."""
    total = 0
    for _, module in model.named_modules():
        if "scales" in module and "weight" in module and hasattr(module, "bits"):
            total += module["weight"].size * 32 // module.bits * 4
    return total


def dequantize_modules(model) -> int:
    """Replace every quantized module by its float32 twin (weights dequantized
    exactly as the quantized kernels see them); returns how many."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    from .models.switch import QuantizedSwitchLinear, SwitchLinear

    replaced = []
    for name, module in model.named_modules():
        if not ("scales" in module and hasattr(module, "bits")):
            continue
        w = mx.dequantize(module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
                          bits=module.bits, mode=module.mode).astype(mx.float32)
        if isinstance(module, nn.QuantizedEmbedding):
            new = nn.Embedding(w.shape[0], w.shape[1])
        elif isinstance(module, QuantizedSwitchLinear):
            new = SwitchLinear(w.shape[2], w.shape[1], w.shape[0])
        elif isinstance(module, nn.QuantizedLinear):
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in module)
            if "bias" in module:
                new.bias = module["bias"].astype(mx.float32)
        else:  # an unknown quantized kind: leave it quantized
            continue
        new.weight = w
        mx.eval(new.parameters())
        replaced.append((name, new))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)


def resolve_model(source, revision: Optional[str] = None) -> Path:
    """A model directory, or a Hub repo id fetched into the standard Hugging Face
    cache (only the files a model needs; ``HF_HUB_OFFLINE=1`` reads the cache
    alone), as mlx-lm does. The same resolver as dlm-convert's."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = str(source)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ConfigError(f"{path}: not a directory (and not a Hub repo id org/name)")
    from .hub import resolve_source

    return resolve_source(text, revision=revision).path


def load(path, *, trust_remote_code: bool = False, tokenizer: bool = True,
         revision: Optional[str] = None, compute_dtype: Optional[str] = None) -> LoadedModel:
    """Load a model directory or Hub repo id (see module docstring)."""
    import mlx.core as mx

    compute_dtype = compute_dtype or env.COMPUTE_DTYPE.get()
    if compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"--compute-dtype {compute_dtype!r}: choose from {', '.join(COMPUTE_DTYPES)}")
    dequantize = env.CPU_DEQUANTIZE.get()  # another value: a ConfigError naming it

    source = str(path)
    path = resolve_model(path, revision)
    config = read_json(path / "config.json", "config.json")
    family = family_for_config(config, str(path / "config.json"))
    args = family.config.from_config(config, str(path / "config.json"))
    model = family.model(args)
    weights = family.weights.sanitize(load_weights(path), args)
    q = quantization_block(config)
    if q is not None:
        apply_quantization(model, q, weights)
    elif any(k.endswith(".scales") for k in weights):
        raise ConfigError(f"{path}: weights are quantized but config.json has no 'quantization' block")
    check_weights(model, weights)
    model.load_weights(list(weights.items()), strict=True)
    del weights
    world, shard_notes = _shard(path, family, model)
    upcast, dequantized, per_call = False, 0, 0
    on_cpu = mx.default_device() == mx.cpu
    if compute_dtype == "float32" or (compute_dtype == "auto" and on_cpu):
        from .platform.memory import budget_bytes

        # auto: only what fits half the memory budget (the rest is the generation's).
        upcast = compute_in_float32(model, None if compute_dtype == "float32" else budget_bytes() // 2)
        # MLX's CPU quantized kernels run far below float32 matmul with a real BLAS:
        # dequantize at load when the float32 weights fit half the memory budget,
        # else per call (one module, expert or vocabulary slice at a time).
        if compute_dtype == "auto" and q is not None and dequantize != "kernels":
            if dequantize == "auto" and dequantized_size(model) <= budget_bytes() // 2:
                dequantized = dequantize_modules(model)
            else:
                from .models.cpu.dequant import mark

                per_call = mark(model)
    if on_cpu and not upcast:  # the CPU gather_mm is float32-only
        from .models.cpu.experts import cpu_float32_experts

        cpu_float32_experts(model)
    relaid = 0
    if on_cpu:  # large float weights stored [in, out]: the CPU's BLAS runs them untransposed
        from .models.cpu.layout import cpu_layout

        relaid = cpu_layout(model)
    model.eval()
    mx.eval(model.parameters())
    if world is not None:
        from .platform import distributed, memory

        mine = mx.array([memory.budget_bytes()], dtype=mx.int64)
        memory.fix_budget(int(distributed.all_gather(mine, world).min().item()))

    generation_config = read_generation_config(path, config)
    tok = load_tokenizer(path, trust_remote_code) if tokenizer else None
    dtype = str(model.dtype).replace("mlx.core.", "")
    return LoadedModel(path, config, args, family, model, tok, generation_config, source, dtype, upcast,
                       dequantized, per_call, relaid, world=world, shard_notes=shard_notes)


def _shard(path: Path, family: Family, model) -> tuple[Any, list[str]]:
    """Under ``mlx.launch``: every rank checks it loads the same files, then keeps
    its share of the weights (the family's ``shard``), before anything is evaluated."""
    from .platform import distributed

    world = distributed.world()
    if world is None:
        return None, []
    if family.shard is None:
        raise distributed.DistributedError(f"{family.title} does not run over several ranks yet")
    files = sorted([path / "config.json", *weight_files(path)])
    digest = "\n".join(f"{f.name} {f.stat().st_size}" for f in files) + (path / "config.json").read_text()
    distributed.agree("the model files (config.json, weight file names and sizes)", digest, world)
    return world, family.shard(model, world)


__all__ = ["LoadedModel", "load", "DlmError"]
