"""dlm-verify: prove a converted model faithful to its PyTorch reference.

    dlm-verify --parity MLX_DIR [--reference HF_REPO_OR_DIR] [--prompts FILE]
               [--report report.json] [--update-card] [--bundle BUNDLE]
    dlm-verify record --reference HF_REPO_OR_DIR -o BUNDLE [--mlx MLX_DIR]

Exit status: 0 all checks passed, 1 a check failed, 2 bad input or the
reference could not be loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dlm.runtime.cli.console import Group, echo_environment_notes
from dlm.runtime.platform.errors import DlmError

from .budget import BUDGET, budget_help
from .protocol import REFERENCE_DTYPES



class _Group(Group):
    """A group whose default invocation is the parity run: ``dlm-verify
    --parity DIR`` (or ``dlm-verify DIR``), with ``record`` as a subcommand."""

    def parse_args(self, ctx, args):
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["--parity"] + list(args)
        return super().parse_args(ctx, args)


def _common(f):
    options = [
        click.option("--revision", help="Hub revision of the reference (branch, tag or commit)."),
        click.option("--reference-dtype", type=click.Choice(REFERENCE_DTYPES), default="float32", show_default=True,
                     help="dtype the PyTorch reference computes in (on CPU)."),
        click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False),
                     help="Extra prompts: one per line, plain text or JSON {prompt|messages|ids}."),
        click.option("--no-builtin-prompts", is_flag=True, help="Use only --prompts."),
        *(click.option(f"--{b.name.replace('_', '-')}", type=click.IntRange(b.minimum), default=None,
                       help=budget_help(b)) for b in BUDGET),
        click.option("--stream-layers/--no-stream-layers", default=None,
                     help="Run the PyTorch reference layer by layer, each layer's weights read from disk "
                     "for every forward pass (peak memory flat in depth) [default: when a whole-model run "
                     "would hold over half the memory budget: the reference and, for the implementation check, "
                     "the dequantized weights it is loaded from]."),
        click.option("--no-images", is_flag=True,
                     help="Skip the image rows (models with a vision tower: built-in images through the "
                     "vision tower, prompts with images, an image commit stream)."),
        click.option("--trust-remote-code", is_flag=True,
                     help="Allow checkpoint code (never run otherwise)."),
        click.option("--torch-threads", type=click.IntRange(1), default=None,
                     help="torch CPU threads (1 is often fastest for small models)."),
        click.option("--quiet", is_flag=True, help="No progress lines on stderr."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _setup(torch_threads, quiet) -> bool:
    if torch_threads:
        try:
            import torch

            torch.set_num_threads(torch_threads)
        except ImportError:
            pass
    return not quiet  # a bar on a terminal, plain lines otherwise (suite._tqdm)


def _budget(given: dict) -> dict:
    """The budget options (dlm.verify.budget): unset ones stay "auto" (the mode's default)."""
    return {b.name: "auto" if given.get(b.name) is None else given[b.name] for b in BUDGET}


def _fail(exc: Exception, code: int = 2):
    click.echo(f"error: {exc}", err=True)
    sys.exit(code)


@click.group(cls=_Group, invoke_without_command=True, error_code=2)
@click.version_option(package_name="dlm", prog_name="dlm-verify")
@click.option("--parity", "mlx_dir", type=click.Path(file_okay=False),
              help="Converted MLX model directory to verify.")
@click.option("--reference", help="Original checkpoint: Hub repo id or directory "
              "[default: the source recorded in MLX_DIR/config.json].")
@click.option("--bundle", type=click.Path(file_okay=False),
              help="Compare with a recorded bundle instead of a live reference.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Write the results as JSON.")
@click.option("--update-card", is_flag=True, help="Write the results into MLX_DIR/README.md.")
@click.option("--upload-repo", metavar="ORG/NAME", default=None,
              help="With --update-card: upload the model card (and --report) to this Hub repo.")
@click.option("--thresholds", type=click.Path(dir_okay=False),
              help='JSON overrides {check: {metric: value | [op, value] | null}} (null: informational).')
@click.option("--no-implementation", is_flag=True,
              help="Skip the implementation-parity check (reference with the MLX weights).")
@click.option("--no-layer-local", is_flag=True,
              help="Skip its layer-local row (each MLX layer fed the reference's input, so rounding cannot "
                   "compound: one more reference and MLX pass of the first case).")
@click.option("--trace-dir", type=click.Path(file_okay=False), default=None,
              help="On a commit-stream divergence, write a side-by-side HTML trace (reference | MLX, "
                   "every denoising step, the first difference highlighted) per diverging prompt here.")
@_common
@click.pass_context
def main(ctx, mlx_dir, reference, bundle, report_path, update_card, upload_repo, thresholds, no_implementation,
         no_layer_local, trace_dir, revision, reference_dtype, prompts_file, no_builtin_prompts, stream_layers,
         no_images, trust_remote_code, torch_threads, quiet, **budget):
    """Check a converted MLX model against its PyTorch reference (logits,
    implementation parity, quantization drift, debug-canvas commit streams;
    with a vision tower also the same on built-in images).

    
      dlm-verify --parity MLX_DIR [--reference REPO_OR_DIR] [--report r.json] [--update-card]
      dlm-verify MLX_DIR --bundle BUNDLE      (compare with a recorded bundle)
      dlm-verify record --reference REPO_OR_DIR -o BUNDLE [--mlx MLX_DIR]

    Exit status: 0 passed, 1 a check failed, 2 bad input / reference not loadable."""
    echo_environment_notes()
    if ctx.invoked_subcommand is not None:
        return
    if not mlx_dir:
        click.echo(ctx.get_help())
        ctx.exit(2)
    from .suite import Options, run_parity
    from .thresholds import load_overrides

    progress = _setup(torch_threads, quiet)
    try:
        if upload_repo is not None and not update_card:
            raise DlmError("--upload-repo uploads the model card: give --update-card too")
        if upload_repo is not None:  # '' is an error, not "no upload"
            from dlm.convert.upload import check_repo_id

            upload_repo = check_repo_id(upload_repo)
        if bundle and reference:
            raise DlmError("--bundle and --reference are exclusive (the bundle names its reference)")
        options = Options(
            reference=reference, revision=revision, reference_dtype=reference_dtype,
            prompts_file=prompts_file, builtin_prompts=not no_builtin_prompts, bundle=bundle,
            **_budget(budget), stream_layers=stream_layers,
            implementation=not no_implementation, local=not no_layer_local, images=not no_images,
            trust_remote_code=trust_remote_code,
            thresholds=load_overrides(thresholds), progress=progress, trace_dir=trace_dir,
        )
        report = run_parity(Path(mlx_dir), options)
        if report_path:
            report.write_json(report_path)
        if update_card:
            from dlm.convert.card import update_card_section

            update_card_section(Path(mlx_dir) / "README.md", report.card_markdown())
        if upload_repo is not None:
            from dlm.convert.upload import upload

            files = ["README.md"]
            if report_path:
                import shutil

                shutil.copyfile(report_path, Path(mlx_dir) / "dlm-verify-report.json")
                files.append("dlm-verify-report.json")
            upload(Path(mlx_dir), upload_repo, files, message="dlm-verify parity report", echo=click.echo)
    except DlmError as exc:
        _fail(exc)
    click.echo(report.table())
    if report_path:
        click.echo(f"report: {report_path}")
    if update_card:
        click.echo(f"model card: {Path(mlx_dir) / 'README.md'}")
    sys.exit(0 if report.passed else 1)


@main.command()
@click.option("--reference", help="Original checkpoint: Hub repo id or directory "
              "[default: the source recorded in --mlx's config.json].")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Bundle directory.")
@click.option("--mlx", "mlx_dir", type=click.Path(exists=True, file_okay=False),
              help="Also record the reference with this converted model's own weights "
              "(implementation parity without torch later).")
@_common
def record(reference, output, mlx_dir, revision, reference_dtype, prompts_file, no_builtin_prompts,
           stream_layers, no_images, trust_remote_code, torch_threads, quiet, **budget):
    """Record reference logits and commit streams into a bundle (needs torch
    and the original weights; the comparison later needs neither)."""

    from . import bundle as B
    from dlm.runtime.checkpoint import read_json

    from .source import recorded_source
    from .suite import Options
    from .suite import record as run_record

    progress = _setup(torch_threads, quiet)
    try:
        if not reference and mlx_dir:
            config = read_json(Path(mlx_dir) / "config.json", "config.json")
            reference, recorded_rev = recorded_source(config)
            revision = revision or recorded_rev
        if not reference:
            raise DlmError("pass --reference HF_REPO_OR_DIR (or --mlx DIR whose config.json records it)")
        options = Options(
            reference=reference, revision=revision, reference_dtype=reference_dtype,
            prompts_file=prompts_file, builtin_prompts=not no_builtin_prompts,
            **_budget(budget), stream_layers=stream_layers, images=not no_images,
            trust_remote_code=trust_remote_code, progress=progress,
        )
        data = run_record(reference, options, Path(mlx_dir) if mlx_dir else None)
        out = B.save(data, Path(output))
    except DlmError as exc:
        _fail(exc)
    except ImportError as exc:
        _fail(f"recording needs torch and transformers ({exc})")
    images = data.images
    click.echo(
        f"recorded {len(data.cases)} logit cases and {len(data.original.streams)} commit streams "
        f"({len(data.prompts)} prompts) from {reference} into {out}"
        + (f"; images: {len(images.images)} built-in images, {len(images.cases)} image logit cases, "
           f"{len(images.stream_prompts)} image commit streams" if images is not None else "")
        + (" (with the MLX weights' reference)" if data.matched else "")
    )
    if images is None and data.image_note:
        click.echo(f"no image cases: {data.image_note}")


if __name__ == "__main__":  # pragma: no cover
    main()
