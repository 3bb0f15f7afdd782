"""The full-size proof: convert, verify and run a random-weight checkpoint at the RELEASED geometry.

    .venv/bin/python -m scripts.bench.full_scale --family diffusion_gemma --skip-verify
    .venv/bin/python -m scripts.bench.full_scale --family llada2 --skip-verify
    .venv/bin/python -m scripts.bench.full_scale --family llada2 --layers 3 --keep   # a quick dry run

Builds, written tensor by tensor (never the whole model in memory), a bf16 checkpoint in the hub
layout (one shard per decoder layer plus one for the globals, an index, config.json,
generation_config.json and a character tokenizer at the full vocabulary size):

* ``diffusion_gemma``: the google/diffusiongemma-26B-A4B-it **text** geometry (30 layers, 25 sliding +
  5 full, 128 experts x 704, vocab 262144, hidden 2816), built by scripts/bench/convert.py's builder;
  ~50.5 GB. The config is text-only (``vision_config: null``; the release's 0.4 B-parameter vision
  tower is left out) and the tokenizer is tests/builders.py's Gemma-4-style char tokenizer.
* ``llada2``: the inclusionAI/LLaDA2.0-mini geometry (20 layers, layer 0 dense, 256 experts x 512
  top-8 with 8 groups / top-4 groups, 1 shared expert, vocab 157184, hidden 2048), the hub's
  per-expert tensor names taken from the project's own reference (verify/llada2_moe/torch_model.py,
  instantiated on the meta device); 16.256 B parameters, ~32.5 GB. The tokenizer is tests/builders.py's
  LLaDA-2 char tokenizer with its special tokens moved to the released ids (<|endoftext|> 156892,
  <|mask|> 156895) and the config has no mask_token_id, as the hub's has none.

Weights are normal * 0.02 (norms and scalars ~1), which keeps activations finite. Then, each in its
own child process with wall time and peak RSS measured (getrusage of a fresh intermediate process,
as in scripts/bench/convert.py: harness.child_peak):

1. ``dlm-convert SRC -o OUT --q-bits 4`` (the default mixed recipe);
2. ``dlm-verify --parity OUT --reference SRC --report R.json`` (skip with --skip-verify); the checks
   that ran and their verdicts come from the JSON report. Random weights make the quantization
   drift chaotic (near-uniform distributions; a 4-bit perturbation flips argmaxes and commit
   orders freely), so a failed drift check on this checkpoint says nothing about a real model; the
   implementation check (reference run with the MLX weights) is what must hold, and where the stack is deep
   enough to make that chaotic end to end too (DiffusionGemma), its layer-local row ``implementation_layers``;
3. ``dlm-run generate --model OUT --prompt ... --max-tokens 32 --max-denoising-steps 4 --profile --json``
   (peak RSS; seconds per denoising step = generation seconds / forwards from the --json stats).

It checks free disk space first (source bf16 + estimated 4-bit output + --margin-gb) and refuses
when there is not enough; prints a table, writes --json, and deletes the checkpoint and the output
at the end (also after a failure) unless --keep. Run it under ``nice -n 10`` on a shared machine.
Exit status: 0 every command exited 0; 1 one did not (a failed verify check included); 2 refused (disk).

Measured (this 2-core, 24 GiB shared machine, MLX CPU backend; README "Benchmarks" has the table):
DiffusionGemma build 336 s, convert 402 s / 0.20 GB peak RSS -> 15.41 GB, generate 1046 s / 19.0 GB peak RSS,
208 s per denoising step; LLaDA2.0-mini build 558 s, convert 329 s / 1.14 GB -> 9.61 GB, generate 217 s /
12.0 GB, 38.6 s per step. The full-size DiffusionGemma verify with the default streamed budget but one stream
step (``--keep --reuse-output --skip-generate --verify-arg=--steps=1``), the 4-bit model dequantized per call and
the same-weights reference following MLX's routing: 2517 s, peak RSS 21.0 GB (reference logits 521 s, MLX logits
492 s, same-weights logits 675 s; 6459 s before, on the quantized kernels); generate, dequantized per call, 55.3 s
per denoising step against 205.3 s on the quantized kernels (``DLM_CPU_DEQUANTIZE=kernels``), one after the other.
With the layer-local row (same command, CI beside it part of the time): 4329 s, peak RSS 22.8 GB,
``implementation_layers`` pass (every layer within relative max|Δ| 1.65e-5 fed the reference's input, 0 routing flips).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import struct
import sys
import time
from pathlib import Path

from scripts.bench import convert as bench_convert
from scripts.bench import harness

BIN = Path(sys.executable).parent
GB = 1e9
DRIFT_NOTE = ("random weights: logits are near-uniform, so 4-bit quantization drift (KL, top-1, commit order, "
              "steps) is chaotic and a failed drift check here says nothing about a real checkpoint; so are the "
              "end-to-end comparisons of 30+30 layers (transformers' own float32 against float64 ends at top-1 "
              "0.08, scripts/bench/probe_rounding.py): what must hold is the layer-local implementation row "
              "(implementation_layers: each MLX layer fed the same-weights reference's input)")

# The runtime benchmarks' precisions (scripts/bench/runtime.py, llada2.py): dlm-convert options for the
# small test-builder checkpoints and for the random bf16 release-geometry ones built here. bf16 is the Hub
# checkpoints' own dtype, what Metal/CUDA users run (the CPU loader upcasts it).
BENCH_DTYPES = {"f32": {}, "q4": dict(quantize=True, q_bits=4), "bf16": dict(dtype="bfloat16")}
RELEASE_DTYPES = {**BENCH_DTYPES, "f32": dict(dtype="float32")}

# ---------------------------------------------------------------------------
# DiffusionGemma: bench_convert's builder at the released depth
# ---------------------------------------------------------------------------

DG_LAYERS = 30


def dg_shapes(n_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors bench_convert.build writes (for the disk estimate; checked against the index after)."""
    t = bench_convert.TEXT
    H, I, E, M, V = t["hidden_size"], t["intermediate_size"], t["num_experts"], t["moe_intermediate_size"], t["vocab_size"]
    nh = t["num_attention_heads"]
    d = "model.decoder."
    out = [(d + "embed_tokens.weight", (V, H)), (d + "norm.weight", (H,)),
           (d + "self_conditioning.pre_norm.weight", (H,)), (d + "self_conditioning.gate_proj.weight", (I, H)),
           (d + "self_conditioning.up_proj.weight", (I, H)), (d + "self_conditioning.down_proj.weight", (H, I))]
    out += [(f"model.encoder.language_model.layers.{i}.layer_scalar", (1,)) for i in range(n_layers)]
    for i, kind in enumerate(bench_convert.layer_types(n_layers)):
        p = f"{d}layers.{i}."
        hd, kv = (t["global_head_dim"], t["num_global_key_value_heads"]) if kind == "full_attention" else (
            t["head_dim"], t["num_key_value_heads"])
        out += [(p + n + ".weight", (H,)) for n in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
            "pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")]
        out += [(p + "layer_scalar", (1,)), (p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                (p + "mlp.down_proj.weight", (H, I)), (p + "router.proj.weight", (E, H)), (p + "router.scale", (H,)),
                (p + "router.per_expert_scale", (E,)), (p + "experts.gate_up_proj", (E, 2 * M, H)),
                (p + "experts.down_proj", (E, H, M)), (p + "self_attn.q_proj.weight", (nh * hd, H)),
                (p + "self_attn.k_proj.weight", (kv * hd, H)), (p + "self_attn.o_proj.weight", (H, nh * hd)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        if kind == "sliding_attention":
            out.append((p + "self_attn.v_proj.weight", (kv * hd, H)))
    return out


def build_diffusion_gemma(out: Path, n_layers: int, seed: int) -> None:
    from tests.builders import DG_GENERATION, build_diffusion_gemma_tokenizer

    bench_convert.build(out, n_layers, seed=seed)  # one layer in memory at a time
    # The full-vocabulary Gemma-4-style char tokenizer and the released generation config.
    for stale in ("tokenizer.json",):
        (out / stale).unlink(missing_ok=True)
    build_diffusion_gemma_tokenizer(bench_convert.TEXT["vocab_size"], out)
    (out / "generation_config.json").write_text(json.dumps(DG_GENERATION, indent=2))


# ---------------------------------------------------------------------------
# LLaDA2.0-mini: names and shapes from the project's reference, streamed to disk
# ---------------------------------------------------------------------------

LLADA2_MINI = {
    "vocab_size": 157184, "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120, "moe_intermediate_size": 512,
    "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "rope_theta": 600000.0,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 16384,
}
LLADA2_EOS = 156892  # <|endoftext|> (also pad); <|mask|> is 156895 (the runtime's default, no config field)


def llada2_config(n_layers: int) -> dict:
    from tests.builders import llada2_hub_config

    cfg = llada2_hub_config("base", **dict(LLADA2_MINI, num_hidden_layers=n_layers), dtype="bfloat16",
                            pad_token_id=LLADA2_EOS)
    cfg.pop("mask_token_id")  # the hub config has none
    return cfg


def llada2_shapes(n_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from dlm.verify.llada2_moe.torch_model import LLaDA2Reference, RefConfig

    with torch.device("meta"):
        model = LLaDA2Reference(RefConfig.from_dict(llada2_config(n_layers)))
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def write_safetensors_streamed(path: Path, specs: list[tuple[str, tuple[int, ...]]], make) -> int:
    """A bf16 safetensors file whose header is computed from the shapes, then each tensor's bytes
    written as ``make(name, shape)`` yields them in row chunks: one chunk in memory at a time."""
    import torch

    header, off = {}, 0
    for name, shape in specs:
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in specs:
            for chunk in make(name, shape):
                assert chunk.dtype == torch.bfloat16 and chunk.is_contiguous()
                f.write(chunk.view(torch.uint8).numpy().data)
    return off


def build_llada2(out: Path, n_layers: int, seed: int) -> None:
    import torch

    from tests.builders import (
        LLADA2_CHAT_TEMPLATE,
        LLADA2_EOS_ID,
        LLADA2_SPECIAL_TOKENS,
        _build_char_tokenizer,
    )

    gen = torch.Generator().manual_seed(seed)
    chunk_elems = 1 << 25  # 32 M elements (128 MB float32) per generated chunk

    def make(name, shape):
        rows = shape[0]
        per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
        step = max(1, chunk_elems // per_row)
        for r in range(0, rows, step):
            s = (min(step, rows - r),) + tuple(shape[1:])
            if name.endswith("norm.weight") or "layernorm" in name:
                x = 1 + 0.2 * (torch.rand(s, generator=gen) - 0.5)
            elif name.endswith("expert_bias"):
                x = torch.randn(s, generator=gen) * 0.1
            else:
                x = torch.randn(s, generator=gen) * 0.02
            yield x.to(torch.bfloat16).contiguous()

    out.mkdir(parents=True)
    specs = llada2_shapes(n_layers)
    groups: dict[int, list] = {}
    for name, shape in specs:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(int(m.group(1)) + 1 if m else 0, []).append((name, shape))
    n_shards = len(groups)
    weight_map, total = {}, 0
    for i in sorted(groups):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        total += write_safetensors_streamed(out / fname, groups[i], make)
        weight_map.update({k: fname for k, _ in groups[i]})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = llada2_config(n_layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": LLADA2_EOS, "pad_token_id": LLADA2_EOS}))
    offset = LLADA2_EOS - LLADA2_EOS_ID  # the tiny ids, moved to the released ones
    _build_char_tokenizer(out, cfg["vocab_size"], {i + offset: t for i, t in LLADA2_SPECIAL_TOKENS.items()},
                          LLADA2_CHAT_TEMPLATE, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                          unk_token="<unk>", mask_token="<|mask|>")


FAMILIES = {
    "diffusion_gemma": {"layers": DG_LAYERS, "shapes": dg_shapes, "build": build_diffusion_gemma,
                        "label": "google/diffusiongemma-26B-A4B-it text geometry"},
    "llada2": {"layers": LLADA2_MINI["num_hidden_layers"], "shapes": llada2_shapes, "build": build_llada2,
               "label": "inclusionAI/LLaDA2.0-mini geometry"},
}


# ---------------------------------------------------------------------------
# Sizes, disk, memory
# ---------------------------------------------------------------------------

def sizes(specs) -> dict:
    """Parameters, bf16 bytes and an estimate of the 4-bit mixed output (routed experts 4-bit affine g64
    = 4.5 bits/weight, other matrices 8-bit g64 = 8.5 bits/weight, vectors bf16)."""
    params = sum(math.prod(s) for _, s in specs)
    out = 0.0
    for name, s in specs:
        n = math.prod(s)
        if len(s) == 1:
            out += 2 * n
        elif re.search(r"experts\.", name) and "shared_experts" not in name:
            out += n * 4.5 / 8
        else:
            out += n * 8.5 / 8
    return {"tensors": len(specs), "params": params, "source_bytes": 2 * params, "output_bytes_est": int(out)}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def mem_available_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return None


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# ---------------------------------------------------------------------------
# Measured child processes
# ---------------------------------------------------------------------------

def measure(cmd: list[str], logs: Path, label: str, env: dict | None = None, timeout: float | None = None) -> dict:
    """Run ``cmd`` in a process of its own with its wall time and peak RSS (harness.child_peak),
    stdout/stderr to ``logs/label.{out,err}``; rc ``"timeout"`` when it ran past ``timeout`` s."""
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / f"{label}.out", logs / f"{label}.err"
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {' '.join(cmd)}  (MemAvailable {mem_available_gb():.1f} GB, "
          f"load {load()})", flush=True)
    c = harness.child_peak(cmd, stdout=out, stderr=err, env=env, timeout=timeout)
    r = {"rc": c["rc"], "wall_s": c["wall_s"],
         "peak_rss_gb": None if c["peak_rss_kib"] is None else c["peak_rss_kib"] * 1024 / GB}
    if "probe_error" in c:
        r["probe_error"] = c["probe_error"]
    r.update(cmd=cmd, stdout_log=str(out), stderr_log=str(err))
    if r["rc"]:
        tail = err.read_text(errors="replace").strip().splitlines()[-15:] if err.exists() else []
        r["error_tail"] = tail
        if isinstance(r["rc"], int) and r["rc"] < 0:
            r["signal"] = -r["rc"]
            if r["rc"] == -9:
                r["note"] = "killed by SIGKILL (the kernel's OOM killer, most likely)"
    print(f"    rc {r['rc']}, wall {r['wall_s'] and round(r['wall_s'], 1)} s, peak RSS "
          f"{r['peak_rss_gb'] and round(r['peak_rss_gb'], 2)} GB", flush=True)
    for line in r.get("error_tail", []):
        print("    | " + line, flush=True)
    return r


def verify_summary(report: Path) -> dict:
    doc = json.loads(report.read_text())
    checks = {}
    for name, c in doc.get("checks", {}).items():
        checks[name] = {"status": c.get("status"), "failures": c.get("failures", []), "note": c.get("note", ""),
                        "metrics": {k: v for k, v in (c.get("metrics") or {}).items()
                                    if isinstance(v, (int, float, bool)) or v is None}}
    layers = {name: {k: summary.get(k) for k in ("threshold", "first_divergence", "worst", "note")}
              for name, summary in (doc.get("layers") or {}).items()}
    return {"passed": doc.get("passed"), "checks": checks, "layers": layers, "streaming": doc.get("streaming"),
            "timings": doc.get("timings"), "notes": doc.get("notes")}


def generate_summary(stdout: Path, stderr: Path) -> dict:
    doc = json.loads(stdout.read_text().strip().splitlines()[-1])
    st = doc["stats"]
    s_per_step = st["generation_seconds"] / st["forwards"] if st.get("forwards") else None
    profile = [ln for ln in stderr.read_text(errors="replace").splitlines()
               if ln.startswith(("Prompt:", "Generation:", "Canvases:", "Blocks:", "Tokens per", "Peak memory",
                                 "BLAS:", "Compute:"))]
    return {"s_per_step": s_per_step, "forwards": st.get("forwards"), "steps_per_block": doc["steps_per_canvas"],
            "prompt_tokens": st["prompt_tokens"], "prompt_seconds": st["prompt_seconds"],
            "completion_tokens": st["completion_tokens"], "generation_seconds": st["generation_seconds"],
            "mlx_peak_memory_gb": st["peak_memory_gb"], "finish_reason": doc["finish_reason"],
            "text": doc["text"][:200], "profile": profile}


# ---------------------------------------------------------------------------

def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--family", choices=sorted(FAMILIES), required=True)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers [the release's: 30 / 20]")
    ap.add_argument("--work", type=Path, default=harness.WORK / "full_scale")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the conversion")
    ap.add_argument("--skip-verify", action="store_true", help="no dlm-verify --parity step")
    ap.add_argument("--skip-generate", action="store_true", help="no dlm-run generate step")
    ap.add_argument("--reuse-output", action="store_true",
                    help="keep an existing conversion in WORK (from an earlier --keep run) instead of converting again")
    ap.add_argument("--verify-arg", action="append", default=[],
                    help="extra dlm-verify argument (repeatable), e.g. --verify-arg=--reference-dtype=bfloat16")
    ap.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-denoising-steps", type=int, default=4)
    ap.add_argument("--margin-gb", type=float, default=5.0, help="disk kept free on top of source + output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="results file [WORK/FAMILY-NL.json]")
    args = ap.parse_args()

    fam = FAMILIES[args.family]
    n = args.layers or fam["layers"]
    # ("llada2-mini-": a directory named llada2-1... would read as LLaDA2.1 to the runtime's name heuristic.)
    tag = f"{'llada2-mini' if args.family == 'llada2' else args.family}-{n}L"
    src, out, logs = args.work / f"src-{tag}", args.work / f"out-{tag}-q4", args.work / f"logs-{tag}"
    json_path = args.json or args.work / f"{tag}.json"
    args.work.mkdir(parents=True, exist_ok=True)

    specs = fam["shapes"](n)
    sz = sizes(specs)
    have_src = (src / "model.safetensors.index.json").is_file()
    have_out = args.reuse_output and (out / "config.json").is_file()
    need = (0 if have_src else sz["source_bytes"]) + (0 if have_out else sz["output_bytes_est"]) + args.margin_gb * GB
    free = shutil.disk_usage(args.work).free
    print(f"{fam['label']}, {n} layers: {sz['tensors']} tensors, {sz['params'] / 1e9:.3f} B parameters\n"
          f"disk: needs {need / GB:.1f} GB = source bf16 {sz['source_bytes'] / GB:.1f} GB"
          f"{' (already built)' if have_src else ''} + 4-bit output ~{sz['output_bytes_est'] / GB:.1f} GB "
          f"{'(kept from an earlier run)' if have_out else '(estimate)'} "
          f"+ margin {args.margin_gb:.0f} GB; free on {args.work}: {free / GB:.1f} GB", flush=True)
    if free < need:
        print(f"refused: not enough disk space ({free / GB:.1f} GB free, {need / GB:.1f} GB needed). Free some, "
              f"point --work at a bigger disk, or try fewer --layers.", file=sys.stderr)
        return 2
    print(f"memory: MemAvailable {mem_available_gb():.1f} GB; the 4-bit model needs ~"
          f"{sz['output_bytes_est'] / GB:.1f} GB resident to generate", flush=True)

    result = {"family": args.family, "geometry": fam["label"], "layers": n, **sz, "disk_free_before_gb": free / GB,
              "machine": {"cpus": os.cpu_count(), "mem_total_gb": os.sysconf("SC_PAGE_SIZE") *
                          os.sysconf("SC_PHYS_PAGES") / GB}, "note": DRIFT_NOTE, "steps": {}}
    if args.family == "diffusion_gemma":
        result["config_note"] = "text-only config (vision_config null): the release's vision tower is not built"
    try:
        if not have_src:
            shutil.rmtree(src, ignore_errors=True)
            t = time.perf_counter()
            fam["build"](src, n, args.seed)
            result["build"] = {"wall_s": time.perf_counter() - t,
                               "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB}
            print(f"built {src} in {result['build']['wall_s']:.0f} s (builder peak RSS "
                  f"{result['build']['peak_rss_gb']:.2f} GB)", flush=True)
        index = json.loads((src / "model.safetensors.index.json").read_text())
        result["source_gb"] = dir_bytes(src) / GB
        result["source_index_tensors"] = len(index["weight_map"])
        # (bench_convert's index counts the shard files' bytes, headers included: compare the tensor count.)
        if len(index["weight_map"]) != sz["tensors"]:
            print(f"warning: the index has {len(index['weight_map'])} tensors, expected {sz['tensors']}", flush=True)
        logs.mkdir(exist_ok=True)

        if have_out:
            result["steps"]["convert"] = {"skipped": f"--reuse-output ({out})", "output_gb": dir_bytes(out) / GB}
        else:
            conv = measure([str(BIN / "dlm-convert"), str(src), "-o", str(out), "--q-bits", "4", "--no-progress",
                            "--overwrite"], logs, "convert")
            conv["output_gb"] = dir_bytes(out) / GB
            result["steps"]["convert"] = conv
            result["disk_free_after_convert_gb"] = shutil.disk_usage(args.work).free / GB
            if conv["rc"]:
                raise SystemExit(1)

        if args.skip_verify:
            result["steps"]["verify"] = {"skipped": "--skip-verify"}
        else:
            report = logs / "verify_report.json"
            report.unlink(missing_ok=True)
            ver = measure([str(BIN / "dlm-verify"), "--parity", str(out), "--reference", str(src),
                           "--report", str(report), *args.verify_arg], logs, "verify")
            if report.is_file():  # rc 1 with a report: a check failed, which the report says
                ver.update(verify_summary(report))
                ver.pop("error_tail", None)
                for name, c in ver["checks"].items():
                    print(f"    {name}: {c['status']}" + (f" ({'; '.join(c['failures'])})" if c["failures"] else ""))
                for name, lay in ver["layers"].items():
                    print(f"    per-layer ({name}): threshold {lay['threshold']}, first divergence "
                          f"{lay['first_divergence']}, worst {lay['worst']}")
                print(f"    modes: {ver['streaming']}")
            result["steps"]["verify"] = ver

        if args.skip_generate:
            result["steps"]["generate"] = {"skipped": "--skip-generate"}
            return 0 if all(not st.get("rc") for st in result["steps"].values()) else 1
        gen = measure([str(BIN / "dlm-run"), "generate", "--model", str(out), "--prompt", args.prompt,
                       "--max-tokens", str(args.max_tokens), "--max-denoising-steps", str(args.max_denoising_steps),
                       "--seed", str(args.seed), "--profile", "--json"], logs, "generate")
        if not gen["rc"]:
            gen.update(generate_summary(Path(gen["stdout_log"]), Path(gen["stderr_log"])))
            for line in gen["profile"]:
                print("    " + line)
        result["steps"]["generate"] = gen
    finally:
        if not args.keep:
            for p in (src, out):
                shutil.rmtree(p, ignore_errors=True)
            result["deleted"] = [str(src), str(out)]
        result["disk_free_end_gb"] = shutil.disk_usage(args.work).free / GB
        json_path.write_text(json.dumps(result, indent=2))
        print_table(result)
        print(f"\nwrote {json_path}; {'kept' if args.keep else 'deleted'} {src} and {out}")
    return 0 if all(not s.get("rc") for s in result["steps"].values()) else 1


def print_table(r: dict) -> None:
    def f(x, d=1):
        return "-" if x is None else f"{x:.{d}f}"

    print(f"\n{r['geometry']}, {r['layers']} layers, {r['params'] / 1e9:.3f} B parameters, source "
          f"{f(r.get('source_gb'))} GB bf16")
    print("| step | rc | wall s | peak RSS GB | notes |\n|---|---|---|---|---|")
    if "build" in r:
        print(f"| build (in-process) | 0 | {f(r['build']['wall_s'])} | {f(r['build']['peak_rss_gb'], 2)} | |")
    for name, s in r["steps"].items():
        if "skipped" in s:
            print(f"| {name} | - | - | - | skipped ({s['skipped']}) |")
            continue
        notes = []
        if name == "convert" and s.get("output_gb"):
            notes.append(f"output {s['output_gb']:.2f} GB")
        if name == "verify" and s.get("checks"):
            notes.append(", ".join(f"{k} {c['status']}" for k, c in s["checks"].items()))
        if name == "generate" and s.get("s_per_step") is not None:
            notes.append(f"{s['s_per_step']:.2f} s/step ({s['forwards']} forwards, steps {s['steps_per_block']}), "
                         f"prompt {s['prompt_tokens']} tok in {s['prompt_seconds']:.1f} s, "
                         f"MLX peak {s['mlx_peak_memory_gb']:.2f} GB")
        if s.get("note"):
            notes.append(s["note"])
        if s.get("rc") and s.get("error_tail"):  # no report / no JSON: the command's own last words
            notes.append("error: " + s["error_tail"][-1])
        print(f"| {name} | {s.get('rc')} | {f(s.get('wall_s'))} | {f(s.get('peak_rss_gb'), 2)} | {'; '.join(notes)} |")
    print(f"\nNote: {r['note']}.")


if __name__ == "__main__":
    sys.exit(main())
