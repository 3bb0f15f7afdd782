"""``dlm-convert``: Hugging Face checkpoint (Hub id or directory) -> MLX safetensors."""

from __future__ import annotations

import signal
import sys

import click

from ..runtime.models.quant_modes import MODES
from ..runtime.cli.console import Command
from ..runtime.platform.errors import DlmError

EPILOG = """\b
Examples:
  dlm-convert google/diffusiongemma-26B-A4B-it --q-bits 4
      -> ./diffusiongemma-26B-A4B-it-4bit (mixed recipe: 8-bit attention,
         embeddings, dense MLP and router; 4-bit routed experts)
  dlm-convert google/diffusiongemma-26B-A4B-it -q --q-mode mxfp4 --text-only
  dlm-convert ./my-finetune --dtype bfloat16 -o ./my-finetune-mlx
  dlm-convert --hf-path inclusionAI/LLaDA2.0-mini --mlx-path ./llada2-4bit -q

\b
Hub downloads use the standard Hugging Face cache (HF_HUB_CACHE / HF_HOME)
and fetch only config, tokenizer and safetensors files; set HF_HUB_OFFLINE=1
to use the cache without network. Pickle weights (.bin/.pt) are refused.
"""


def _on_sigterm(signum, frame):  # run the cleanup path, as for Ctrl-C
    raise KeyboardInterrupt


@click.command(
    cls=Command,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EPILOG,
)
@click.version_option(package_name="dlm", prog_name="dlm-convert")
@click.argument("source", required=False, metavar="SOURCE")
@click.option("--hf-path", "hf_path", metavar="SOURCE",
              help="Same as SOURCE (the mlx_lm.convert / mlx_vlm.convert spelling).")
@click.option("-o", "--output", "--mlx-path", "output", metavar="DIR",
              help="Output directory. Default: ./<name>-<label>, e.g. ./diffusiongemma-26B-A4B-it-4bit.")
@click.option("-q", "--quantize", is_flag=True,
              help="Quantize. Implied by --q-bits, --q-group-size, a non-affine --q-mode or --recipe uniform; "
                   "without any of them the weights stay in float.")
@click.option("--q-bits", type=click.Choice(["2", "3", "4", "5", "6", "8"]),
              help="Bits of the bulk weights (routed experts...). Default: 4 (mxfp8: 8).")
@click.option("--q-group-size", type=click.Choice(["16", "32", "64", "128"]),
              help="Weights per scale. Default: affine 64, mxfp4/mxfp8 32, nvfp4 16.")
@click.option("--q-mode", type=click.Choice(MODES), default="affine",
              show_default=True, help="Quantization format of the bulk weights.")
@click.option("--recipe", type=click.Choice(["mixed", "uniform"]), default="mixed", show_default=True,
              help="mixed: precision-sensitive modules (embeddings, attention, dense MLP, router) at "
                   "8-bit affine g64, the rest at --q-bits. uniform: everything eligible at --q-bits.")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
              help="Cast float tensors (and quantization scales) to this dtype. Default: as stored.")
@click.option("--revision", metavar="REV", help="Hub branch, tag or commit (Hub sources only).")
@click.option("--text-only", is_flag=True,
              help="Drop the vision tower and write a text-only config.")
@click.option("--quantize-vision", is_flag=True,
              help="Also quantize the vision tower's attention/MLP linears (8-bit affine g64; default: float). "
                   "Implies quantizing; check the image rows of dlm-verify --parity.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--dequantize", is_flag=True,
              help="SOURCE is an MLX conversion (dlm, mlx-community): write it back in float "
                   "(with --q-bits: re-quantize it).")
@click.option("--upload-repo", metavar="ORG/NAME", default=None,
              help="Upload the converted folder to this Hugging Face Hub repo (created if needed).")
@click.option("--private", is_flag=True, help="With --upload-repo: create the repo private.")
@click.option("--allow-non-finite", is_flag=True,
              help="Convert weights holding NaN/Inf with a warning (default: an error naming the tensor).")
def main(source, hf_path, output, quantize, q_bits, q_group_size, q_mode, recipe, dtype, revision,
         text_only, quantize_vision, overwrite, no_progress, dequantize, upload_repo, private, allow_non_finite):
    """Convert a Hugging Face checkpoint to MLX safetensors, optionally quantized.

    SOURCE is a Hugging Face Hub repo id (org/name) or a local checkpoint
    directory (config.json, *.safetensors, tokenizer). The output directory gets
    5 GB shards plus model.safetensors.index.json, config.json (with the
    quantization block and a "dlm" provenance block), tokenizer files, chat
    template, generation_config.json and a README.md model card. It is written
    to a hidden sibling directory and renamed into place when complete.
    """
    if source and hf_path and source != hf_path:
        raise click.UsageError("give SOURCE or --hf-path, not both")
    source = source or hf_path
    if not source:
        raise click.UsageError("missing SOURCE (a Hub repo id or a local directory)")
    from .pipeline import ConvertOptions, convert

    opts = ConvertOptions(
        source=source,
        output=output,
        quantize=quantize,
        q_bits=int(q_bits) if q_bits else None,
        q_group_size=int(q_group_size) if q_group_size else None,
        q_mode=q_mode,
        recipe=recipe,
        dtype=dtype,
        revision=revision,
        text_only=text_only,
        quantize_vision=quantize_vision,
        overwrite=overwrite,
        progress=not no_progress,
        allow_non_finite=allow_non_finite,
        dequantize=dequantize,
    )
    if upload_repo is not None:  # '' is an error, not "no upload"
        from .upload import check_repo_id

        upload_repo = check_repo_id(upload_repo)  # before hours of conversion, not after
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        result = convert(opts, echo=click.echo)
        if upload_repo is not None:
            from .upload import upload

            upload(result.output, upload_repo, private=private, echo=click.echo,
                   message=f"dlm-convert {source}")
    except DlmError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
