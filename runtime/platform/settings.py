"""Every ``DLM_*`` environment variable, declared once: its type, default and help.

Modelled on huggingface_hub's ``constants.py``. The code reads a ``DLM_*``
variable only through its declaration here (``CPU_LAYOUT.get()``), and at call
time, not at import: tests and the benchmarks set them in-process. No other
module reads one (tests/test_settings.py checks the source). ``SETTINGS`` are
the variables dlm's Python code reads; ``SHELL`` the ones the set-up scripts
read (they stay read there); ``FOREIGN`` other programs' variables that dlm
sets or reads (read where they are: they belong to those libraries). All are
named here once for docs/environment.md, whose tables
``python -m dlm.runtime.platform.settings`` prints.

A platform module: it imports nothing from the rest of dlm.runtime (and no MLX:
blas.py reads ``DLM_BLAS`` before MLX loads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ConfigError

TRUE_WORDS = ("1", "true", "yes", "on")


def _text(setting: "Setting", raw: str) -> Any:
    """The value, stripped; unset or empty: the default."""
    return raw.strip() or setting.default


def _word(setting: "Setting", raw: str) -> Any:
    """The value, stripped and lower-cased; unset or empty: the default. Another
    word than the choices acts as the default (a benchmark switch: no error)."""
    return raw.strip().lower() or setting.default


def _choice(setting: "Setting", raw: str) -> Any:
    """As ``_word``, and another word than the choices is a ConfigError naming it."""
    value = _word(setting, raw)
    if value not in setting.choices:
        choose = setting.choose or "from " + ", ".join(setting.choices)
        raise ConfigError(f"{setting.name}={value!r}: choose {choose}")
    return value


def _count(setting: "Setting", raw: str) -> Any:
    """A positive integer; anything else (unset, 0, not a number): the default."""
    value = raw.strip()
    return int(value) if value.isdigit() and int(value) > 0 else setting.default


def _present(setting: "Setting", raw: str) -> bool:
    """On when set to any non-empty value (``0`` too)."""
    return bool(raw)


def _yes(setting: "Setting", raw: str) -> bool:
    """On for ``1``, ``true``, ``yes`` or ``on`` (any case, spaces ignored)."""
    return raw.strip().lower() in TRUE_WORDS


def _unless_zero(setting: "Setting", raw: str) -> bool:
    """On unless the value is exactly ``0``."""
    return raw != "0"


# kind -> how get() turns the raw value ("" when unset) into the typed one
KINDS: dict[str, Callable[["Setting", str], Any]] = {
    "text": _text, "word": _word, "choice": _choice, "count": _count,
    "present": _present, "yes": _yes, "unless-0": _unless_zero,
}


@dataclass(frozen=True)
class Setting:
    """One ``DLM_*`` variable read by dlm's Python code.

    ``kind`` (``KINDS``) says how ``get()`` parses it; ``default`` is what
    ``get()`` gives when it is unset or empty; ``shown`` is that default as
    docs/environment.md writes it, ``help`` the doc's "what it does";
    ``choices`` the values a ``word``/``choice`` takes; ``choose`` the text after
    "choose" in a ``choice``'s error (default "from a, b, c")."""

    name: str
    kind: str
    default: Any
    shown: str
    help: str
    choices: tuple[str, ...] = ()
    choose: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}")
        if not self.name.startswith("DLM_"):
            raise ValueError(f"{self.name}: dlm's own variables start with DLM_")

    def raw(self) -> str:
        """The variable as the environment has it now ("" when unset)."""
        return os.environ.get(self.name, "")

    def get(self) -> Any:
        """The typed value, read now; a bad value of a ``choice`` is a ConfigError."""
        return KINDS[self.kind](self, self.raw())


@dataclass(frozen=True)
class Documented:
    """A variable dlm's Python code does not read through ``Setting``: one the
    set-up scripts read, or another program's that dlm sets or reads where it
    stands. ``names``: one or more (one doc row)."""

    names: tuple[str, ...]
    shown: str
    help: str


# --- read by dlm's Python code ------------------------------------------------

API_KEY = Setting(
    "DLM_API_KEY", "text", None, "unset",
    "`dlm-run serve`'s `--api-key`: every request needs `Authorization: Bearer KEY` (except `/health`); "
    "an empty key is refused.")  # read by click (runtime/cli/serve.py: envvar=API_KEY.name)

BLAS = Setting(
    "DLM_BLAS", "text", None,
    "unset: the first OpenBLAS found (Debian/Ubuntu `libopenblas0-pthread`, then the usual Debian, Fedora and "
    "Arch paths)",
    "Linux: the BLAS loaded ahead of MLX when `dlm.runtime` is imported. A path: that library (a warning if it "
    "cannot be loaded); `reference`: MLX's bundled netlib BLAS. See [install.md](install.md#blas-on-linux).")

COMPILE = Setting(
    "DLM_COMPILE", "unless-0", True, "`1`",
    "`0` turns off `mx.compile` of both families' fixed-shape layer pieces (to compare or to debug).")

# Checked by the loader, with --compute-dtype ("--compute-dtype 'x': choose from ..."), not here.
COMPUTE_DTYPE = Setting(
    "DLM_COMPUTE_DTYPE", "text", "auto", "`auto`",
    "the default of `--compute-dtype` (`auto`, `native`, `float32`) for `dlm-run` and `api.load`; another value "
    "is an error. See [install.md](install.md#the-compute-dtype-on-the-cpu-backend).",
    choices=("auto", "native", "float32"))

CPU_DEQUANTIZE = Setting(
    "DLM_CPU_DEQUANTIZE", "choice", "auto", "`auto`",
    "CPU backend, a quantized model under `--compute-dtype auto`: `auto` dequantizes at load when the float32 "
    "weights fit half the memory budget, else per call; `call` always per call; `kernels` keeps MLX's quantized "
    "kernels (split over the CPU streams). Another value is an error naming it.",
    choices=("auto", "call", "kernels"))

CPU_EXPERTS = Setting(
    "DLM_CPU_EXPERTS", "word", "", "unset",
    "CPU backend, for benchmarks: `each` runs large float experts one matmul op per expert (the kernel before "
    "\"by copy count\"); `gather` runs `gather_mm` always (no by-count, per-expert or dense path).",
    choices=("gather", "each"))

CPU_LAYOUT = Setting(
    "DLM_CPU_LAYOUT", "choice", "auto", "`auto`",
    "CPU backend: `auto` keeps large float weights that get few rows [in, out] in memory (with the optimized "
    "BLAS); `native` keeps the checkpoint's order. Another value is an error naming it.",
    choices=("auto", "native"), choose="auto (the default) or native")

CPU_STREAMS = Setting(
    "DLM_CPU_STREAMS", "count", None, "the number of cores",
    "CPU backend: how many CPU streams split the quantized kernels' rows and how many threads run the numpy "
    "vocabulary pass; `1` turns the splits off.")  # None: the caller counts the cores

CPU_VOCAB = Setting(
    "DLM_CPU_VOCAB", "word", "", "unset: numpy from 2^22 entries of one request",
    "CPU backend: where the softcap and the full-vocabulary pass (softmax, entropy, draw) run: `mlx` always in "
    "MLX, `numpy` through numpy at every size (tests).",
    choices=("mlx", "numpy"))

DEBUG = Setting(
    "DLM_DEBUG", "present", False, "unset",
    "set (any value): an internal error prints its traceback instead of the one-line \"this is a dlm bug\" "
    "message.")

DEBUG_CANVAS = Setting(
    "DLM_DEBUG_CANVAS", "yes", False, "unset",
    "`1` (or `true`, `yes`, `on`): as `--debug-canvas` (DiffusionGemma): the reference document's fixed canvas "
    "pattern and argmax sampling, for cross-framework parity.")

DISTRIBUTED_TIMEOUT = Setting(
    "DLM_DISTRIBUTED_TIMEOUT", "count", 300, "`300`",
    "under `mlx.launch`: seconds a rank may make no progress (a dead or stuck peer) before it stops with an "
    "error. See [distributed.md](distributed.md).")

SETTINGS: tuple[Setting, ...] = (API_KEY, BLAS, COMPILE, COMPUTE_DTYPE, CPU_DEQUANTIZE, CPU_EXPERTS, CPU_LAYOUT,
                                 CPU_STREAMS, CPU_VOCAB, DEBUG, DEBUG_CANVAS, DISTRIBUTED_TIMEOUT)

# --- read by the set-up scripts (scripts/*.sh), declared for the docs ----------

SHELL: tuple[Documented, ...] = (
    Documented(("DLM_MLX_BACKEND",), "`cpu`",
               "`scripts/setup.sh` on Linux: `cpu`, `cuda12` or `cuda13` installs `dlm[<backend>]` and removes the "
               "other backend wheels first. Another value stops the script."),
    Documented(("DLM_SKIP_SETUP",), "`0`",
               "`scripts/demo.sh`: `1` skips `scripts/setup.sh` and uses whatever dlm is installed."),
    Documented(("DLM_TORCH_INDEX_URL",), "unset",
               "`scripts/setup.sh`: the pip index torch is installed from (e.g. "
               "`https://download.pytorch.org/whl/cpu`)."),
    Documented(("DLM_TORCH_SPEC",), "`torch==2.13.0`",
               "`scripts/setup.sh`: the torch requirement installed when `.venv` has no torch."),
    Documented(("PYTHON",), "`python3`", "`scripts/setup.sh`: the interpreter that creates `.venv/`."),
    Documented(("TMPDIR",), "`/tmp`",
               "`scripts/demo.sh` writes its conversion under `$TMPDIR/dlm-demo/` unless given a directory."),
)

# --- other programs' variables dlm sets or reads (where they stand) -------------

FOREIGN: tuple[Documented, ...] = (
    Documented(("HF_HUB_OFFLINE",), "unset",  # runtime/hub.py
               "read by dlm's Hub resolver (`dlm-convert`, `dlm-run`, `dlm-verify`, `api.load`): `1` uses the "
               "Hugging Face cache alone and says so when a model is not there. `scripts/demo.sh` and the "
               "benchmarks set it."),
    Documented(("HF_HUB_CACHE",), "huggingface_hub's (under `HF_HOME`)",  # runtime/hub.py
               "where Hub downloads go and are read from."),
    Documented(("HF_HOME",), "huggingface_hub's", "huggingface_hub's home, the cache's parent."),
    Documented(("HF_TOKEN",), "unset",
               "the Hub token for `--upload-repo` (or `hf auth login`), read by huggingface_hub."),
    Documented(("MLX_ENABLE_TF32",), "dlm sets `0` unless set",  # runtime/platform/precision.py
               "MLX: float32 matmuls at TF32 precision on CUDA tensor cores / M5 accelerators when `1` (MLX's own "
               "default). See [install.md](install.md#precision-on-gpus-tf32)."),
    Documented(("MLX_RANK",), "set by `mlx.launch`",  # runtime/platform/distributed.py
               "MLX: this process's rank in an `mlx.launch` job; when set, dlm shards the model over the job's "
               "ranks. See [distributed.md](distributed.md)."),
    Documented(("OPENBLAS_THREAD_TIMEOUT",), "dlm sets `20` unless set (when it loads OpenBLAS)",  # blas.py
               "OpenBLAS: its idle threads spin 2^N cycles after a threaded call before they sleep (OpenBLAS's "
               "default 28, ~0.1 s)."),
    Documented(("OPENBLAS_NUM_THREADS",), "OpenBLAS's (all cores)",
               "OpenBLAS's thread count; dlm leaves it alone (`1` was only measured in a two-stream batching "
               "experiment, [architecture.md](architecture.md#design-notes))."),
    Documented(("TOKENIZERS_PARALLELISM",), "the tokenizers library's",
               "`scripts/demo.sh`, `scripts/bench/cuda_bench.sh`, the trace screenshot script and the benchmarks "
               "set `false`."),
    Documented(("PYTHONUNBUFFERED",), "unset", "`scripts/bench/cuda_bench.sh` sets `1`."),
    Documented(("LD_PRELOAD", "MALLOC_CONF"), "unset",
               "not set by dlm: small models on the CPU backend may preload jemalloc with "
               "`MALLOC_CONF=oversize_threshold:0` (measured 1.1–1.6× faster on the tiny models, slower at the "
               "released geometry)."),
)


def by_name(name: str) -> Setting:
    """The declaration of ``name`` (a KeyError for a variable dlm does not read)."""
    for setting in SETTINGS:
        if setting.name == name:
            return setting
    raise KeyError(name)


def declared_names() -> list[str]:
    """Every variable named here, in table order."""
    return [s.name for s in SETTINGS] + [n for d in SHELL + FOREIGN for n in d.names]


def row(names, shown: str, help: str) -> str:
    """One docs/environment.md table row."""
    names = (names,) if isinstance(names, str) else names
    return f"| {', '.join(f'`{n}`' for n in names)} | {shown} | {help} |"


def rows() -> dict[str, str]:
    """Each declared variable (the first of a row's names) -> its table row."""
    out = {s.name: row(s.name, s.shown, s.help) for s in SETTINGS}
    out.update({d.names[0]: row(d.names, d.shown, d.help) for d in SHELL + FOREIGN})
    return out


def markdown() -> str:
    """docs/environment.md's two tables, with their headings."""
    head = "| variable | default | what it does |\n|---|---|---|\n"
    table = rows()
    first = "".join(table[s.name] + "\n" for s in SETTINGS)
    second = "".join(table[d.names[0]] + "\n" for d in SHELL + FOREIGN)
    return (f"## Read by dlm\n\n{head}{first}\n"
            f"## Set-up scripts, and other programs' variables\n\n{head}{second}")


if __name__ == "__main__":
    print(markdown(), end="")
