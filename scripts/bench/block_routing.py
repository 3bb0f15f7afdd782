"""LLaDA2.2 block routing against LLaDA2.0/2.1 token routing, at the released
LLaDA2.2-mini geometry (not a test).

One MLX ``llada2_moe`` model, random weights, ``--layers`` decoder layers (the
first dense, as released), vocabulary 157184, hidden 2048, 256 experts of 512
top-8, 1 shared expert, ``expert_capacity`` 48, ``block_size`` 32. Its two
routings share every weight: the script flips ``gate.capacity`` on each MoE
layer's ``mlp.gate`` (48: block routing, the pool of a block's top 48 experts by
their max score over its 32 tokens; 0: the 2.0/2.1 group-limited gate, 4 of 8
groups) and keeps one set of compiled layer pieces per routing (``capacity`` is
read when a piece is traced, so one set cannot serve both).

The router is random but not flat: embeddings N(0, 1) (each token's identity
dominates its MLP input), gate rows N(0, 1/sqrt(hidden)) on the RMS-normed MLP
input (a logit spread of about 1: scores differ between tokens, and sigmoid does
not saturate, which would leave the choice to the bias) and ``expert_bias``
N(0, 0.01); tokens are independent random ids, so token routing
spreads about as widely as it can (an upper bound for real text).

A step is the runtime's denoising forward (``batch.run_alone``): a 256-token
prompt prefilled into the committed KV cache once per routing (each routing its
own cache), then one 32-token active block over it, ``model(ids, cache, mask,
last=32, compiled=True)``, logits evaluated, nothing committed. Each round draws
a new block (a random number of mask tokens, the rest random ids) and runs it
under both routings, every other round in the other order; the ratio is each
round's token / block, median and range (harness.paired).

Experts touched: the indices each MoE layer's gate returns for the step's 32
tokens (recorded around ``SparseMoe.routed`` in an uncompiled forward of the
same block over the same cache), distinct experts per layer, and the routed
weight bytes that reads (distinct experts x one expert's three projections);
then the routed experts alone (every MoE layer's ``routed`` called again on those
recorded inputs), timed per block, the routings interleaved.

Weights go through the loader's CPU passes (dlm.runtime.loader.load), so
``--dtype bfloat16`` computes in float32 under the default DLM_COMPUTE_DTYPE=auto,
as dlm runs a bf16 checkpoint on the CPU. The CPU weight layout follows
``Model.product_rows``: with ``expert_capacity`` 48 a block gives ~5.3 token copies
per expert, so a 2.2 model keeps its experts [out, in]; a 2.0 model (1 copy an
expert) stores them [in, out] (runtime/models/cpu/layout.py). Float runs are timed in
both layouts, the second after relaying the experts in place. ``--q-bits``:
every linear, embedding and expert quantized (nn.quantize, uniform, group 64, as
the loader's ``apply_quantization``; the router never is), dequantized per call
(DLM_CPU_DEQUANTIZE=call unless set: how the full model runs on a 24 GB machine;
at a few layers ``auto`` would dequantize at load, i.e. the float row). A block's
256 token copies are too few for the experts' per-expert dequantization
(cpu/experts.grouped: 6 copies an expert over all 256), so they run MLX's
``gather_qmm``, split over the CPU streams.

    .venv/bin/python -m scripts.bench.block_routing [--layers 3] [--dtype bfloat16|float32] [--q-bits 4]
                                                     [--rounds 12] [--count 6] [--json out.json]
"""

from __future__ import annotations

import datetime
import os
import platform

from scripts.bench import harness

BLOCK = 32
PROMPT = 256
# inclusionAI/LLaDA2.2-mini's config.json (the 2.0-mini keys, its rope_theta, the block-routing keys).
LLADA2_2_MINI = {
    "model_type": "llada2_moe", "vocab_size": 157184, "hidden_size": 2048, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120, "moe_intermediate_size": 512,
    "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
    "norm_topk_prob": True, "moe_router_enable_expert_bias": True, "router_dtype": "fp32",
    "rope_theta": 3000000, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "use_qk_norm": True,
    "use_qkv_bias": False, "use_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "max_position_embeddings": 32768, "pad_token_id": 156892, "expert_capacity": 48, "block_size": 32,
}
ROUTINGS = {"block": 48, "token": 0}  # name -> gate.capacity


def machine_line() -> str:
    """CPU model, cores, the BLAS dlm loaded, MLX's version, the load and the date."""
    from dlm.runtime.platform import blas

    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{cpu}, {os.cpu_count()} cores, BLAS {blas.STATUS}, MLX {mx.__version__}, load {load}, {day}"


def build(layers: int, dtype: str, q_bits: int | None):
    """The model with random weights in ``dtype`` (quantized to ``q_bits``), through the loader's CPU passes."""
    import mlx.core as mx
    import mlx.nn as nn

    from dlm.runtime.models.llada2_moe import Model, ModelArgs

    args = ModelArgs.from_config(dict(LLADA2_2_MINI, num_hidden_layers=layers), "LLaDA2.2-mini geometry")
    model = Model(args)
    random_weights(model, getattr(mx, dtype))
    if q_bits:
        nn.quantize(model, group_size=64, bits=q_bits)
    as_loaded(model, quantized=bool(q_bits))
    return model


def random_weights(model, dtype, seed: int = 0) -> None:
    """Every parameter drawn one tensor at a time (the peak stays near the model): norms
    near 1, embeddings N(0, 1) and the router spread so that tokens prefer different experts
    (with N(0, 0.02) embeddings the attention output, alike for every query over a random
    prompt, dominated the MLP input: a block's tokens routed to 72 experts, not ~150), the
    rest N(0, 0.02)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    hidden = model.args.hidden_size
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            new = 1 + 0.1 * mx.random.normal(value.shape)
        elif name.endswith("word_embeddings.weight"):  # token identity dominates the MLP input
            new = mx.random.normal(value.shape)
        elif name.endswith("gate.weight"):  # logits spread ~1 on the unit-RMS MLP input: sigmoid unsaturated
            new = hidden ** -0.5 * mx.random.normal(value.shape)
        elif name.endswith("expert_bias"):  # small: a trained bias balances load, it favours no expert much
            new = 0.01 * mx.random.normal(value.shape)
        else:
            new = 0.02 * mx.random.normal(value.shape)
        new = new.astype(mx.float32 if name.endswith("expert_bias") else dtype)
        mx.eval(new)
        model.load_weights([(name, new)], strict=False)


def as_loaded(model, quantized: bool) -> None:
    """The CPU passes dlm.runtime.loader.load runs after loading weights, under the same settings
    (DLM_COMPUTE_DTYPE, DLM_CPU_DEQUANTIZE): float32 compute where it fits, quantized modules
    dequantized at load or per call, float32 experts, the CPU weight layout."""
    import mlx.core as mx

    from dlm.runtime import loader
    from dlm.runtime.models.cpu.dequant import mark
    from dlm.runtime.models.cpu.experts import cpu_float32_experts
    from dlm.runtime.models.cpu.layout import cpu_layout
    from dlm.runtime.platform import settings
    from dlm.runtime.platform.memory import budget_bytes

    compute, dequantize = settings.COMPUTE_DTYPE.get(), settings.CPU_DEQUANTIZE.get()
    upcast = False
    if compute in ("float32", "auto"):
        upcast = loader.compute_in_float32(model, None if compute == "float32" else budget_bytes() // 2)
        if compute == "auto" and quantized and dequantize != "kernels":
            if dequantize == "auto" and loader.dequantized_size(model) <= budget_bytes() // 2:
                loader.dequantize_modules(model)
            else:
                mark(model)
    if not upcast:
        cpu_float32_experts(model)
    cpu_layout(model)
    model.eval()
    mx.eval(model.parameters())


def moe_layers(model) -> list:
    from dlm.runtime.models.llada2_moe.model import SparseMoe

    return [layer for layer in model.layers if isinstance(layer.mlp, SparseMoe)]


def relay_experts(model) -> int:
    """Store the float experts [in, out], as the loader does for a 2.0 model (one token copy an
    expert); returns how many projections moved. Quantized experts keep their order."""
    from dlm.runtime.models.cpu.layout import relaid
    from dlm.runtime.models.switch import SwitchLinear

    n = 0
    for _, module in model.named_modules():
        if isinstance(module, SwitchLinear) and not getattr(module, "relaid", False):
            module.weight = relaid(module["weight"])
            module.relaid = True
            n += 1
    return n


class Routing:
    """One routing of the shared model: its gate capacity, its KV cache over the prompt and
    its own compiled layer pieces."""

    def __init__(self, model, name: str, prompt):
        self.model, self.name, self.capacity = model, name, ROUTINGS[name]
        self.pieces = None
        self.use()
        self.cache = prefill(model, prompt)
        for layer in model.layers:  # fresh pieces, traced under this capacity on first use
            object.__setattr__(layer, "_compiled", None)
            layer.compiled()
        self.pieces = [layer._compiled for layer in model.layers]

    def use(self) -> None:
        for layer in moe_layers(self.model):
            layer.mlp.gate.capacity = self.capacity
        if self.pieces is not None:
            for layer, pieces in zip(self.model.layers, self.pieces):
                object.__setattr__(layer, "_compiled", pieces)

    def step(self, ids, compiled: bool = True):
        """The denoising forward of one active block over the cache, not committed."""
        from dlm.runtime.models.llada2_moe.model import block_causal_mask

        self.use()
        offset = self.cache[0].offset
        mask = block_causal_mask(offset, BLOCK, offset, BLOCK)
        return self.model(ids[None], self.cache, mask, last=BLOCK, compiled=compiled)


def prefill(model, prompt) -> list:
    """The prompt into a fresh committed KV cache, as generate.py's ``_prefill`` (one chunk)."""
    import mlx.core as mx

    from dlm.runtime.models.llada2_moe.model import block_causal_mask

    cache = model.make_cache(PROMPT + BLOCK)
    logits = model(prompt[None], cache, block_causal_mask(0, PROMPT, 0, BLOCK), last=1)
    mx.eval(logits, [(c.keys, c.values) for c in cache])
    for c in cache:
        c.commit(PROMPT)
    return cache


def random_blocks(args, rounds: int, seed: int = 1) -> list:
    """One active block per round: a random number of mask tokens at random positions, the
    rest random ids (a block part way through its denoising)."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(rounds):
        ids = rng.integers(0, args.mask_token_id, BLOCK)
        ids[rng.permutation(BLOCK)[:rng.integers(0, BLOCK + 1)]] = args.mask_token_id
        blocks.append(mx.array(ids.astype(np.int32)))
    return blocks


def routes(routing: Routing, ids) -> tuple[list, object]:
    """What each MoE layer's ``SparseMoe.routed`` gets for the step ``ids`` (its MLP input,
    rows, expert indices [32, k] and weights), and the logits: an uncompiled forward with
    ``routed`` wrapped to keep its arguments."""
    import mlx.core as mx

    seen = []
    layers = moe_layers(routing.model)
    for layer in layers:
        def keep(*args, inner=layer.mlp.routed):
            seen.append((inner, args))
            return inner(*args)

        object.__setattr__(layer.mlp, "routed", keep)
    try:
        logits = routing.step(ids, compiled=False)
        mx.eval(logits, [args for _, args in seen])
    finally:
        for layer in layers:
            object.__delattr__(layer.mlp, "routed")
    return seen, logits


def expert_bytes(layer) -> int:
    """Bytes of one routed expert's three projections (weights, scales, biases)."""
    sw = layer.mlp.switch_mlp
    E = sw.gate_proj["weight"].shape[0]
    return sum(a.nbytes for p in sw.projections for a in (p["weight"], p.get("scales"), p.get("biases"))
               if a is not None) // E


def touched(routings: dict, blocks: list) -> dict:
    """Per routing: distinct experts per MoE layer and step (mean, range), the routed weight MB
    that reads per layer, the compiled step's largest difference from the uncompiled one, and
    the routed experts alone (every MoE layer's ``routed`` on its recorded inputs) timed per
    block, the routings interleaved."""
    import mlx.core as mx
    import numpy as np

    out, calls = {}, {}
    for name, routing in routings.items():
        counts, per_block, diff, calls[name] = [], [], 0.0, []
        for ids in blocks:
            seen, eager = routes(routing, ids)
            layers = [len(np.unique(np.array(args[2]))) for _, args in seen]
            counts += layers
            per_block.append(float(np.mean(layers)))
            calls[name].append(seen)
            diff = max(diff, float(mx.abs(routing.step(ids) - eager).max()))
        mb = np.mean(counts) * expert_bytes(moe_layers(routing.model)[0]) / 1e6
        out[name] = {"experts": float(np.mean(counts)), "range": [min(counts), max(counts)], "mb": mb,
                     "per_block": per_block, "compiled_vs_eager": diff}

    def experts(name):
        return lambda r: harness.seconds(lambda: [fn(*args) for fn, args in calls[name][r]])

    times = harness.interleave({name: experts(name) for name in routings}, len(blocks), alternate=True,
                               run=lambda fn, r: fn(r))
    for name, t in times.items():
        out[name]["experts_ms"] = harness.spread(t, "ms")
    out["experts_token_over_block"] = harness.paired(times["token"], times["block"])
    return out


def timed_rounds(routings: dict, blocks: list) -> dict:
    """Seconds per step of each routing, one block per round, interleaved (every other round
    reversed; the first round a dropped warm-up, which traces each routing's pieces)."""
    def variant(routing):
        return lambda r: harness.seconds(lambda: routing.step(blocks[r]))

    return harness.interleave({name: variant(r) for name, r in routings.items()}, len(blocks) - 1, warmup=1,
                              alternate=True, run=lambda fn, r: fn(r))


def measure(model, prompts: dict, blocks: list, count: int, label: str) -> dict:
    """One layout's row: step times, their paired ratio, experts touched."""
    import numpy as np

    routings = {name: Routing(model, name, prompts[name]) for name in ROUTINGS}
    times = timed_rounds(routings, blocks)
    row = {name: harness.spread(t, "ms") for name, t in times.items()}
    row["token_over_block"] = harness.paired(times["token"], times["block"])
    row["touched"] = touched(routings, blocks[:count])
    row["label"] = label
    for name in ROUTINGS:
        print(f"  {label}, {name}: compiled vs uncompiled logits max |diff| "
              f"{row['touched'][name]['compiled_vs_eager']:.2e}", flush=True)
    masks = [int((np.array(ids) == model.args.mask_token_id).sum()) for ids in blocks[:count]]
    row["masks"] = masks
    for m, b, t in zip(masks, row["touched"]["block"]["per_block"], row["touched"]["token"]["per_block"]):
        print(f"  a block with {m:2d} mask tokens: experts a MoE layer touches, block {b:.1f} / token {t:.1f}")
    return row


def markdown_row(row: dict) -> str:
    b, t, r = row["block"], row["token"], row["token_over_block"]
    tb, tt = row["touched"]["block"], row["touched"]["token"]
    eb, et, er = tb["experts_ms"], tt["experts_ms"], row["touched"]["experts_token_over_block"]
    return (f"| {row['label']} | {b['median_ms']:.0f} [{b['range_ms'][0]:.0f}–{b['range_ms'][1]:.0f}] "
            f"| {t['median_ms']:.0f} [{t['range_ms'][0]:.0f}–{t['range_ms'][1]:.0f}] "
            f"| {r['median']:.2f}× [{r['range'][0]:.2f}–{r['range'][1]:.2f}] "
            f"| {eb['median_ms']:.0f} / {et['median_ms']:.0f} ({er['median']:.2f}× [{er['range'][0]:.2f}–"
            f"{er['range'][1]:.2f}]) "
            f"| {tb['experts']:.1f} / {tt['experts']:.1f} ({tt['experts'] / tb['experts']:.2f}×) "
            f"| {tb['mb']:.0f} / {tt['mb']:.0f} |")


HEADER = ("| weights, expert layout | block ms/step [range] | token ms/step [range] | token / block, paired "
          "| routed experts alone, ms a step, block / token (paired) "
          "| experts a MoE layer touches per step, block / token | routed MB read a layer, block / token |\n"
          "|---|---|---|---|---|---|---|")


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (the first dense)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the weights' stored dtype")
    ap.add_argument("--q-bits", type=int, default=None, help="quantize (uniform, group 64), dequantized per call")
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds (each a new block, both routings)")
    ap.add_argument("--count", type=int, default=6, help="blocks whose routes are counted (an uncompiled forward each)")
    harness.add_options(ap, "json")
    a = ap.parse_args()
    if a.q_bits:
        os.environ.setdefault("DLM_CPU_DEQUANTIZE", "call")

    from dlm.runtime.platform import blas  # first: loads the optimized BLAS ahead of MLX

    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    model = build(a.layers, a.dtype, a.q_bits)
    weights = f"{a.q_bits}-bit per call" if a.q_bits else f"{a.dtype} (computed in {str(model.dtype)[9:]})"
    print(f"LLaDA2.2-mini geometry, {a.layers} layers ({len(moe_layers(model))} MoE), {weights}; random "
          f"router: embeddings N(0, 1), gate N(0, 1/sqrt(2048)), expert_bias N(0, 0.01), random token ids", flush=True)
    rng = np.random.default_rng(0)
    prompts = {name: mx.array(rng.integers(0, model.args.mask_token_id, PROMPT).astype(np.int32))
               for name in ROUTINGS}
    blocks = random_blocks(model.args, a.rounds + 1)
    rows = [measure(model, prompts, blocks, a.count, f"{weights}, experts [out, in] (as 2.2 loads them)")]
    if relay_experts(model):  # float experts: also in the order a 2.0 model is given
        rows.append(measure(model, prompts, blocks, a.count, f"{weights}, experts [in, out] (as 2.0 loads them)"))
    print(HEADER)
    for row in rows:
        print(markdown_row(row))
    print(f"machine: {machine_line()}")
    meta = {"command": harness.command(), "mlx": mx.__version__, "blas": blas.STATUS, "layers": a.layers,
            "dtype": a.dtype, "q_bits": a.q_bits, "rounds": a.rounds, "machine": machine_line()}
    harness.finish(meta, rows, a.json)


if __name__ == "__main__":
    main()
