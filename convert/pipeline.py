"""dlm-convert: a Hugging Face checkpoint in, a finished MLX model directory out.

SOURCE -> local directory (download if needed) -> family (from the registry)
-> the family's weight plan -> per-tensor jobs (cast, quantize) -> shards
planned up front -> tensors streamed in row chunks -> config, tokenizer,
card -> one rename.  Memory stays flat in model size: at any time only one
chunk of one tensor (or one combined tensor, for plans that stack sources)
is held.  The output is built in a hidden sibling directory and renamed into
place only when complete, so an interrupted run never leaves something that
looks like a finished model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ..quantize.recipes import (
    HIGH as VISION_SPEC,
    Decision,
    Recipe,
    bits_per_weight,
    config_block,
    decide,
    make_spec,
)
from ..runtime.checkpoint import check_tokenizer, read_config, read_json
from ..runtime.platform.errors import ConfigError, WeightError
from ..runtime.models.plan import TensorPlan
from ..runtime.registry import Family, family_for_config
from .card import front_matter, recipe_table, render_card, source_license
from .mlx_source import dequantize_plans, mlx_conversion
from .reader import CheckpointReader, row_count
from ..runtime.hub import SIDECAR_FILES, VISION_SIDECARS, ResolvedSource, resolve_source, source_name
from .writer import (
    MAX_SHARD_BYTES,
    OutputError,
    OutTensor,
    ShardWriter,
    describe_os_error,
    plan_shards,
    shards_total_bytes,
    write_text,
)

CHUNK_BYTES = 64 << 20  # float32-equivalent bytes per row chunk
FLOAT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
DTYPE_LABELS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass
class ConvertOptions:
    source: str
    output: Optional[str] = None
    quantize: bool = False
    q_bits: Optional[int] = None
    q_group_size: Optional[int] = None
    q_mode: str = "affine"
    recipe: str = "mixed"
    dtype: Optional[str] = None  # None: keep each tensor's stored float dtype
    revision: Optional[str] = None
    text_only: bool = False
    overwrite: bool = False
    cache_dir: Optional[str] = None  # Hub cache; default HF_HUB_CACHE / the library default
    max_shard_bytes: int = MAX_SHARD_BYTES
    progress: bool = True
    allow_non_finite: bool = False  # NaN/Inf weights: a warning instead of an error
    dequantize: bool = False  # the source is an MLX conversion: write it back in float (then --q-* apply)
    quantize_vision: bool = False  # the vision tower's linears at 8-bit affine g64 (implies quantizing)


@dataclass
class ConvertResult:
    output: Path
    seconds: float
    n_tensors: int
    shards: list[str]
    total_bytes: int
    parameters: int
    bits_per_weight: float
    fallbacks: list[str] = field(default_factory=list)


@dataclass
class Job:
    """One plan entry: its combined shape, dtypes, quantization and output tensors."""

    plan: TensorPlan
    shape: tuple[int, ...]
    out_dtype: mx.Dtype
    decision: Decision
    outputs: list[OutTensor]

    @property
    def rows(self) -> int:
        return row_count(self.shape)

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1


def build_recipe(opts: ConvertOptions) -> Optional[Recipe]:
    """None unless quantization was asked for: -q, --q-bits, --q-group-size, a non-affine
    --q-mode or a non-default --recipe."""
    wanted = (opts.quantize or opts.q_bits is not None or opts.q_group_size is not None
              or opts.q_mode != "affine" or opts.recipe != "mixed" or opts.quantize_vision)
    if not wanted:
        return None
    return Recipe(opts.recipe, make_spec(opts.q_bits, opts.q_group_size, opts.q_mode),
                  VISION_SPEC if opts.quantize_vision else None)


def default_output(opts: ConvertOptions, recipe: Optional[Recipe]) -> Path:
    label = recipe.label if recipe else DTYPE_LABELS.get(opts.dtype or "", "mlx")
    return Path.cwd() / f"{source_name(opts.source)}-{label}"


def command_line(opts: ConvertOptions, recipe: Optional[Recipe]) -> str:
    """The dlm-convert invocation that reproduces this conversion (minus -o)."""
    parts = ["dlm-convert", opts.source]
    if opts.revision:
        parts += ["--revision", opts.revision]
    if recipe:
        low = recipe.low
        parts += ["--q-bits", str(low.bits), "--q-group-size", str(low.group_size)]
        parts += ["--q-mode", low.mode, "--recipe", recipe.name]
        if recipe.vision is not None:
            parts += ["--quantize-vision"]
    if opts.dtype:
        parts += ["--dtype", opts.dtype]
    if opts.text_only:
        parts.append("--text-only")
    return " ".join(parts)


# -- output directory safety --------------------------------------------------


def check_output(out: Path, overwrite: bool) -> None:
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise OutputError(f"{out} already exists; pass --overwrite to replace it")
        if not out.is_dir():
            raise OutputError(f"{out} exists and is not a directory; refusing to replace it")
        if any(out.iterdir()) and not (out / "config.json").is_file():
            raise OutputError(
                f"refusing to replace {out}: it is not empty and does not look like a model "
                "directory (no config.json)"
            )
    if out.parent.exists() and not out.parent.is_dir():
        raise OutputError(f"cannot create {out}: {out.parent} is not a directory")


def _proc_stat(pid: int) -> Optional[tuple[str, float]]:
    """(state, start time as a Unix time) of a process, from Linux's /proc; None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        ticks = os.sysconf("SC_CLK_TCK")
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return fields[0], boot + int(fields[19]) / ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _creator_alive(pid: int, made: float) -> bool:
    """Whether the process that made a leftover directory (named by its ``pid``;
    the directory last changed at ``made``) may still be running. A pid whose
    process is gone, a zombie (killed, not yet reaped by its parent: still there
    for ``kill(pid, 0)``), or a process started after the directory changed (the
    pid reused) did not make it, or is no longer writing it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's: judged by /proc below, else left alone
    except (OverflowError, ValueError):
        return True  # not a pid: leave it alone
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, started = stat
    if state in ("Z", "X"):
        return False
    return started <= made + 2.0  # /proc's boot time is whole seconds


def remove_leftovers(out: Path, echo: Callable[[str], None] = print) -> None:
    """Remove ``.OUT.dlm-partial-PID`` / ``.OUT.dlm-old-PID`` directories that a
    killed conversion of the same output left behind (ours, and their process is
    gone: exited, a zombie, or its pid now another process's); never one whose
    conversion still runs."""
    if not out.parent.is_dir():
        return
    for path in sorted(out.parent.glob(f".{out.name}.dlm-*-*")):
        kind, _, pid = path.name[len(out.name) + 2:].rpartition("-")
        if kind not in ("dlm-partial", "dlm-old") or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            info = path.lstat()
        except OSError:
            continue
        if info.st_uid != os.getuid() or _creator_alive(int(pid), max(info.st_mtime, info.st_ctime)):
            continue
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
        echo(f"Removed {path}, left by an interrupted conversion (process {pid} is gone)")


def make_temp_dir(out: Path, echo: Callable[[str], None] = print) -> Path:
    tmp = out.parent / f".{out.name}.dlm-partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(out, echo)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as exc:
        raise describe_os_error(exc, str(out)) from exc
    return tmp


def finalize(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished directory into place (replacing ``out`` only with --overwrite)."""
    try:
        if out.exists():
            if not overwrite:
                raise OutputError(f"{out} appeared during conversion; not replacing it")
            old = out.parent / f".{out.name}.dlm-old-{os.getpid()}"
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except OSError:
                os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except OSError as exc:
        raise describe_os_error(exc, str(out)) from exc


# -- source checks ------------------------------------------------------------


# -- planning -----------------------------------------------------------------


def plan_jobs(
    plans: list[TensorPlan],
    reader: CheckpointReader,
    recipe: Optional[Recipe],
    quant_class: Callable[[str], Optional[str]],
    dtype: Optional[mx.Dtype],
) -> list[Job]:
    """Shapes, dtypes and output tensors of every plan entry, without reading any data.

    ``combine`` is probed on lazy zeros: MLX builds the graph, so the output
    shape is known while nothing is allocated.
    """
    jobs: list[Job] = []
    seen: set[str] = set()
    for plan in plans:
        for src in plan.sources:
            if src not in reader.tensors:
                raise WeightError(f"checkpoint is missing tensor {src} (needed for {plan.name})")
        if plan.combine is None:
            if len(plan.sources) != 1:
                raise WeightError(f"plan for {plan.name} reads {len(plan.sources)} tensors but has no combine")
            info = reader.tensors[plan.sources[0]]
            shape, src_dtype = info.shape, reader.mx_dtype(info.name)
        else:
            probe = plan.combine([mx.zeros(reader.tensors[s].shape, reader.mx_dtype(s)) for s in plan.sources])
            shape, src_dtype = tuple(probe.shape), probe.dtype
        if not mx.issubdtype(src_dtype, mx.floating):
            bad = next((n for n in plan.sources if not mx.issubdtype(reader.mx_dtype(n), mx.floating)), plan.name)
            raise WeightError(f"tensor {bad} has dtype {reader.tensors[bad].dtype if bad in reader.tensors else src_dtype}; "
                              "model weights must be floating point (F32, F16, BF16)")
        out_dtype = mx.float32 if plan.keep_float32 else (dtype or src_dtype)
        decision = decide(recipe, quant_class, plan.name, shape, out_dtype)
        if decision.spec is not None:
            row = decision.spec.quantize(mx.zeros((1, shape[-1]), out_dtype))
            outputs = [
                OutTensor(f"{decision.path}.{part}", shape[:-1] + (r.shape[-1],), r.dtype)
                for part, r in zip(decision.spec.parts(), row)
            ]
        else:
            outputs = [OutTensor(plan.name, shape, out_dtype)]
        for t in outputs:
            if t.name in seen:
                raise WeightError(f"weight plan writes tensor {t.name} twice")
            seen.add(t.name)
        jobs.append(Job(plan, shape, out_dtype, decision, outputs))
    return jobs


# -- data ---------------------------------------------------------------------


def run_job(job: Job, reader: CheckpointReader, writer: ShardWriter, advance: Callable[[int], None],
            allow_non_finite: bool = False, warn: Callable[[str], None] = print) -> None:
    """Read, cast, quantize and write one plan entry, ``CHUNK_BYTES`` of rows at a time.
    Every chunk is checked for NaN/Inf as it streams through (no second pass)."""
    rows, cols = job.rows, job.cols
    if job.plan.combine is None:
        src = job.plan.sources[0]

        def chunk(a: int, b: int) -> mx.array:
            return reader.read_rows(src, a, b)
    else:
        flat = job.plan.combine([reader.read(s) for s in job.plan.sources]).reshape(rows, cols)
        mx.eval(flat)

        def chunk(a: int, b: int) -> mx.array:
            return flat[a:b]

    step = max(1, CHUNK_BYTES // max(1, cols * 4))
    spec = job.decision.spec
    non_finite = 0
    for a in range(0, rows, step):
        b = min(rows, a + step)
        x = chunk(a, b)
        if x.dtype != job.out_dtype:
            x = x.astype(job.out_dtype)
        parts = spec.quantize(x) if spec is not None else (x,)
        bad = (~mx.isfinite(x)).sum()
        mx.eval(*parts, bad)
        non_finite += int(bad.item())
        for out, part in zip(job.outputs, parts):
            writer.write_rows(out.name, a, part)
            advance(part.nbytes)
        del x, parts
    mx.clear_cache()
    if non_finite:
        what = (f"tensor {job.plan.sources[0]}" if len(job.plan.sources) == 1
                else f"tensor {job.plan.name} (from {job.plan.sources[0]}, ...)")
        message = f"{what} has {non_finite} non-finite value(s) (NaN/Inf) after casting to {job.out_dtype}"
        if not allow_non_finite:
            raise WeightError(f"{message}; the checkpoint is broken (or --dtype overflows it); "
                              "--allow-non-finite converts it anyway")
        warn(f"warning: {message}")


def write_weights(reader, jobs: list[Job], writer: ShardWriter, progress: bool,
                  allow_non_finite: bool = False, warn: Callable[[str], None] = print) -> None:
    from tqdm.auto import tqdm

    total = sum(t.nbytes for j in jobs for t in j.outputs)
    last_job_of_shard = {j.outputs[-1].shard: i for i, j in enumerate(jobs)}
    with tqdm(total=total, unit="B", unit_scale=True, desc="Converting", disable=not progress) as bar:
        try:
            for i, job in enumerate(jobs):
                run_job(job, reader, writer, bar.update, allow_non_finite, warn)
                shard = job.outputs[-1].shard
                if last_job_of_shard[shard] == i:
                    writer.close_shard(shard)
        finally:
            writer.abort()


# -- the pipeline -------------------------------------------------------------


def convert(opts: ConvertOptions, echo: Callable[[str], None] = print) -> ConvertResult:
    start = time.perf_counter()
    recipe = build_recipe(opts)
    if opts.dtype is not None and opts.dtype not in FLOAT_DTYPES:
        raise ConfigError(f"unknown --dtype {opts.dtype!r}; choose from {', '.join(FLOAT_DTYPES)}")
    dtype = FLOAT_DTYPES.get(opts.dtype or "")
    out = Path(opts.output).expanduser().absolute() if opts.output else default_output(opts, recipe)
    if out.is_symlink() and out.is_dir():
        # Replace what the link points at (the link stays valid); work next to it.
        out = Path(os.path.realpath(out))
    check_output(out, opts.overwrite)
    tmp = make_temp_dir(out, echo)
    try:
        src = resolve_source(opts.source, opts.revision, opts.cache_dir, opts.progress)
        if src.path == out or out in src.path.parents:
            raise OutputError(f"{out} would replace the source checkpoint {src.path}")
        config = read_config(src.path)
        family = family_for_config(config, str(src.path / "config.json"))
        args = family.config.from_config(config, str(src.path / "config.json"))
        if family.image_processor is None:  # a family that never has a vision tower
            for flag, on in (("--text-only", opts.text_only), ("--quantize-vision", opts.quantize_vision)):
                if on:
                    raise ConfigError(f"{flag} does not apply to {family.title} checkpoints: "
                                      f"{family.title} is text-only (it has no vision tower)")
        check_tokenizer(src.path)
        text_only = opts.text_only or not config.get("vision_config")
        with CheckpointReader(src.path) as reader:
            kind = mlx_conversion(config, reader.metadata())
            if opts.dequantize:
                if kind is None:
                    raise ConfigError(f"--dequantize takes an MLX conversion; {src.display} is a Hugging Face "
                                      "checkpoint (convert it without --dequantize)")
                plans = dequantize_plans(config, reader.metadata())
            elif kind is not None:
                raise ConfigError(
                    f"{src.display} is {kind}, not a Hugging Face checkpoint: it runs as it is "
                    f"(dlm-run generate --model {src.display}); --dequantize converts it back to a float "
                    "MLX model (and --q-bits on top of that re-quantizes it)")
            else:
                plans = family.weights.plan_weights(args, reader.metadata(), opts.text_only)
            jobs = plan_jobs(plans, reader, recipe, family.weights.quant_class, dtype)
            shards = plan_shards([j.outputs for j in jobs], opts.max_shard_bytes)
            need, free = shards_total_bytes(shards), shutil.disk_usage(tmp).free
            if need + (16 << 20) > free:
                raise OutputError(
                    f"not enough free space in {out.parent}: the converted model needs "
                    f"{need / 1e9:.2f} GB, {free / 1e9:.2f} GB are free"
                )
            echo(f"Converting {src.display}{f' @ {src.commit}' if src.commit else ''} "
                 f"({family.name}, {len(reader.tensors)} source tensors in {len(reader.shards)} "
                 f"file(s)) -> {out}")
            echo(_recipe_line(recipe, opts.dtype))
            writer = ShardWriter(tmp, shards)
            write_weights(reader, jobs, writer, opts.progress, opts.allow_non_finite, echo)
        parameters = sum(math.prod(j.shape) for j in jobs)
        writer.write_index(parameters)
        stored = sum(s.data_bytes for s in shards)
        bpw = bits_per_weight(stored, parameters)
        decisions = [j.decision for j in jobs]
        fallbacks = [d.path for d in decisions if d.fallback]

        out_config = _output_config(family, config, opts, recipe, decisions, src, text_only)
        write_text(tmp / "config.json", json.dumps(out_config, indent=4, sort_keys=True) + "\n")
        _copy_sidecars(src.path, tmp, text_only)
        card = _card_context(out, src, family, config, opts, recipe, jobs, shards, bpw, parameters,
                             fallbacks, text_only)
        write_text(tmp / "README.md", render_card(card, f"{family.name}.md"))
        finalize(tmp, out, opts.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    if fallbacks:
        echo(f"Kept {len(fallbacks)} module(s) in float: input size not divisible by the group size "
             f"({', '.join(fallbacks[:4])}{', ...' if len(fallbacks) > 4 else ''})")
    if recipe:
        echo(f"Quantized model with {bpw:.3f} bits per weight.")
    echo(f"Wrote {len(shards)} shard(s), {human_size(stored)}, to {out} in {seconds:.1f} s")
    return ConvertResult(out, seconds, sum(len(j.outputs) for j in jobs), [s.file for s in shards],
                         stored, parameters, bpw, fallbacks)


def _recipe_line(recipe: Optional[Recipe], dtype: Optional[str]) -> str:
    d = f"dtype {dtype}" if dtype else "dtype as stored"
    if recipe is None:
        return f"No quantization ({d})"
    low = recipe.low
    text = f"Quantizing: {recipe.name} recipe, {low.bits}-bit {low.mode} group {low.group_size}"
    if recipe.name == "mixed":
        text += " (sensitive modules at 8-bit affine group 64)"
    if recipe.vision is not None:
        text += "; vision tower linears at 8-bit affine group 64"
    return f"{text}; {d}"


def _output_config(family, config: dict, opts: ConvertOptions, recipe: Optional[Recipe],
                   decisions: list[Decision], src: ResolvedSource, text_only: bool) -> dict:
    out = family.output_config(config, opts.text_only)
    out.pop("_name_or_path", None)
    out.pop("quantization", None)
    out.pop("quantization_config", None)
    if opts.dtype:
        for cfg in (out, out.get("text_config")):
            for key in ("dtype", "torch_dtype"):
                if isinstance(cfg, dict) and key in cfg:
                    cfg[key] = opts.dtype
    if recipe is not None:
        block = config_block(recipe, decisions)
        out["quantization"] = block
        out["quantization_config"] = dict(block)
    origin = config.get("dlm") if opts.dequantize and isinstance(config.get("dlm"), dict) else {}
    out["dlm"] = {
        # A dequantized conversion keeps its original source: dlm-verify's reference.
        "source": origin.get("source") or src.repo_id or str(src.path),
        "revision": origin.get("revision") if origin else src.revision,
        "commit": origin.get("commit") if origin else src.commit,
        "dlm_version": dlm_version(),
        "recipe": recipe.as_dict() if recipe else None,
        "dtype": opts.dtype,
        "text_only": text_only,
    }
    if opts.dequantize:
        out["dlm"]["dequantized_from"] = src.repo_id or str(src.path)
    return out


def _inside_checkpoint(path: Path, src: Path) -> bool:
    """A sidecar must be the checkpoint's own file: a symbolic link may point
    only inside the checkpoint, or, for a Hub cache snapshot, inside that
    repository's cache folder (its blobs)."""
    if not path.is_symlink():
        return True
    root = src.resolve()
    if src.parent.name == "snapshots":
        root = src.parent.parent.resolve()
    return path.resolve().is_relative_to(root)


def _copy_sidecars(src: Path, dst: Path, text_only: bool) -> None:
    names = SIDECAR_FILES + (() if text_only else VISION_SIDECARS)
    for name in names:
        if (src / name).is_file():
            if not _inside_checkpoint(src / name, src):
                raise ConfigError(f"{src / name} is a symbolic link to {(src / name).resolve()}, outside the "
                                  "checkpoint; refusing to copy it into the output")
            if name.endswith(".json"):
                read_json(src / name, name)  # a corrupt sidecar is an error now, not at run time
            try:
                shutil.copyfile(src / name, dst / name)
            except OSError as exc:
                raise describe_os_error(exc, str(dst / name)) from exc


def _card_context(out: Path, src: ResolvedSource, family: Family, config: dict, opts: ConvertOptions,
                  recipe: Optional[Recipe], jobs: list[Job], shards, bpw: float, parameters: int,
                  fallbacks: list[str], text_only: bool) -> dict:
    stored = sum(s.data_bytes for s in shards)
    float_names = sorted({str(t.dtype).split(".")[-1] for j in jobs for t in j.outputs
                          if mx.issubdtype(t.dtype, mx.floating) and j.decision.spec is None})
    dtype_label = opts.dtype or ", ".join(float_names) or "-"
    has_vision = bool(config.get("vision_config"))
    tags = ["mlx", "dlm", family.name, "diffusion-language-model"]
    if recipe:
        tags.append(recipe.label)
    if src.repo_id:
        source_md = f"[{src.repo_id}](https://huggingface.co/{src.repo_id})"
    else:
        source_md = f"the local checkpoint `{src.path}`"
    params = {j.decision.name: math.prod(j.shape) for j in jobs}
    vision_q = recipe is not None and recipe.vision is not None and has_vision and not text_only
    floats = ("norms and scalars stay in float; the vision tower's linears at 8-bit affine (group 64)"
              if vision_q else "norms, scalars and the vision tower stay in float")
    if recipe is None:
        recipe_text = ""
    elif recipe.name == "mixed":
        recipe_text = (f"the modules {family.name} marks as precision-sensitive stay at 8-bit affine "
                       f"(group 64); the bulk at {recipe.low.bits}-bit {recipe.low.mode} "
                       f"(group {recipe.low.group_size}); {floats}.")
    else:
        recipe_text = (f"every eligible linear and embedding at {recipe.low.bits}-bit {recipe.low.mode} "
                       f"(group {recipe.low.group_size}); {floats}.")
    return {
        "front_matter": front_matter(
            src.repo_id, tags, "image-text-to-text" if has_vision and not text_only else "text-generation",
            source_license(src.path / "README.md")),
        "title": out.name,
        "source_md": source_md,
        "repo_id": src.repo_id,
        "revision": src.revision,
        "commit": src.commit,
        "model_type": config.get("model_type"),
        "config": config,  # a family's template may describe its variant (LLaDA2.2's block routing)
        "family": family.name,
        "dlm_version": dlm_version(),
        "command": command_line(opts, recipe),
        "n_tensors": sum(len(j.outputs) for j in jobs),
        "n_shards": len(shards),
        "size_label": human_size(stored),
        "dtype_label": dtype_label,
        "vision_label": ("kept, linears at 8-bit (--quantize-vision)" if vision_q
                         else "kept, in float" if has_vision and not text_only
                         else "dropped (--text-only)" if has_vision else "none in the source"),
        "recipe": recipe.as_dict() if recipe else None,
        "recipe_text": recipe_text,
        "table": recipe_table([j.decision for j in jobs], params, dtype_label) if recipe else [],
        "bits_per_weight": bpw,
        "parameters": f"{parameters:,}",
        "fallbacks": fallbacks,
        "model_ref": out.name,
    }


def human_size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def dlm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dlm")
    except PackageNotFoundError:
        return "unknown"
