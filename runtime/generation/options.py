"""Generation options, declared once.

Each family declares its options in ``runtime/models/<family>/options.py`` as
``Option`` values (name, type, range, default and where it comes from, help).
Everything that takes options is built from those declarations:

* the ``dlm-run generate`` and ``dlm-run serve`` flags (``click_options``);
* the server's request-field validation (``Option.check`` on each field);
* the check every family's ``Settings.from_options`` starts with (``resolve``):
  types and ranges, and a clear refusal, naming the flag and the reason, of an
  option that belongs to another family or to nothing dlm runs.

Option names are the snake_case spelling of the CLI flag (``max_denoising_steps``
is ``--max-denoising-steps``); a request field may differ (``temperature`` sets
``temp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ..platform.errors import GenerationError

INT, FLOAT, BOOL, STR = "int", "float", "bool", "str"


class OptionError(GenerationError):
    """A value an option refuses; ``option`` is the declaration at fault."""

    def __init__(self, message: str, option: "Option"):
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class Option:
    name: str
    type: str  # INT | FLOAT | BOOL | STR
    help: str
    default: Any = None  # the value used when neither the request nor the checkpoint sets it
    # How help states the default when the value alone does not ("generation_config, else {default}").
    default_help: str = ""
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    min_open: bool = False  # minimum excluded
    choices: tuple[str, ...] = ()
    metavar: Optional[str] = None
    short: Optional[str] = None  # "-m"
    field: Optional[str] = None  # request field when it is not ``name``
    request: bool = True  # a server request may set it (else: a serve-time default only)
    neutral: Any = None  # a value that changes nothing, accepted even where the option does not apply
    refused: Optional[str] = None  # declared only to be refused, with this reason
    negatable: bool = False  # BOOL: a --x/--no-x pair on the command line
    # (option, value, its default): this option takes effect only when that one
    # has that value; setting it otherwise is an error, not a silent no-op.
    requires: Optional[tuple[str, Any, Any]] = None
    # another option of the family this one may not exceed when both are set
    # (a family's Settings checks it against that option's checkpoint default)
    at_most: Optional[str] = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def request_field(self) -> str:
        return self.field or self.name

    def is_neutral(self, value) -> bool:
        if value is None or (self.type == BOOL and value is False):
            return True
        return self.neutral is not None and value == self.neutral

    def check(self, value, label: Optional[str] = None):
        """``value`` converted to the option's type, or OptionError saying what is wrong.
        ``label`` names it in the message (default: the flag)."""
        label = label or self.flag
        if self.type == BOOL:
            if not isinstance(value, bool):
                raise OptionError(f"{label} must be true or false, got {value!r}", self)
            return value
        if self.type == STR:
            if not isinstance(value, str):
                raise OptionError(f"{label} must be a string, got {type(value).__name__}", self)
            if self.choices and value not in self.choices:
                raise OptionError(f"{label} must be one of {', '.join(self.choices)} (got {value!r})", self)
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            what = "an integer" if self.type == INT else "a number"
            raise OptionError(f"{label} must be {what}, got {value!r}", self)
        if self.type == INT:
            if isinstance(value, float):
                if not value.is_integer():
                    raise OptionError(f"{label} must be an integer, got {value!r}", self)
                value = int(value)
        else:
            if not math.isfinite(value):
                raise OptionError(f"{label} must be a finite number, got {value!r}", self)
            value = float(value)
        if self.minimum is not None and (value < self.minimum or (self.min_open and value == self.minimum)):
            raise OptionError(f"{label} must be {'>' if self.min_open else '>='} {_num(self.minimum)}, "
                              f"got {value}", self)
        if self.maximum is not None and value > self.maximum:
            raise OptionError(f"{label} must be <= {_num(self.maximum)}, got {value}", self)
        return value

    def help_text(self) -> str:
        shown = self.default_help.format(default=self.default) if self.default_help else (
            "" if self.default is None or self.default is False else str(self.default))
        return f"{self.help} [{shown}]" if shown else self.help


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Options no family runs: declared so every interface refuses them by name.
REFUSED = (
    Option("draft_model", STR, "Speculative draft model (refused: diffusion models unmask blocks "
           "natively).", request=False,
           refused="diffusion models already unmask whole canvases/blocks; a speculative draft "
                   "model is not supported"),
)
# Keys about the prompt and the output rather than the generation loop: callers
# handle them before generation, and a family's settings accept and ignore them.
PROMPT_KEYS = frozenset({"enable_thinking", "stop", "system", "chat_template", "profile", "json",
                         "verbose", "stream"})


def resolve(own: Iterable[Option], options: dict, title: str, refused: Optional[dict],
            catalogue: list[tuple[str, Option]]) -> dict:
    """The family's own options from ``options``, checked and converted; unset
    (None) values dropped. Refused, naming the flag: an option of another family
    or of nothing dlm runs (unless its value is neutral), and unknown keys.
    ``refused`` maps option names to the family's own reason for refusing them;
    ``catalogue`` is every family's (title, option) (dlm.runtime.registry)."""
    own = {o.name: o for o in own}
    by_field = {o.request_field: o for o in own.values() if o.field}
    foreign = {o.name: o for _, o in catalogue if o.name not in own}
    foreign.update({o.name: o for o in REFUSED})
    refused = refused or {}
    out: dict = {}
    for key, value in (options or {}).items():
        if value is None or key in PROMPT_KEYS:
            continue
        option = own.get(key) or by_field.get(key)
        if option is not None and key not in refused:
            out[option.name] = option.check(value)
            continue
        if key in refused:
            if value is False or (isinstance(value, (list, tuple, str)) and not value):
                continue
            flag = foreign[key].flag if key in foreign else f"--{key.replace('_', '-')}"
            raise GenerationError(f"{flag} does not apply to {title} models: {refused[key]}")
        other = foreign.get(key)
        if other is None:
            raise GenerationError(f"option {key!r} is not a dlm generation option")
        if other.is_neutral(value):
            continue
        why = other.refused or f"it is an option of {_owners(key, catalogue)}"
        raise GenerationError(f"{other.flag} does not apply to {title} models: {why}")
    for name in out:
        if own[name].requires is None:
            continue
        other, value, default = own[name].requires
        if out.get(other, default) != value:
            raise GenerationError(f"{own[name].flag} takes effect only with {own[other].flag} {value} "
                                  f"(this run uses {out.get(other, default)})")
    for name in out:
        other = own[name].at_most
        if other is not None and out.get(other) is not None and out[name] > out[other]:
            raise GenerationError(f"{own[name].flag} {out[name]} exceeds {own[other].flag} {out[other]}")
    return out


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def _owners(name: str, catalogue) -> str:
    return " and ".join(title for title, o in catalogue if o.name == name) or "another family"


# -- interfaces built from the declarations ---------------------------------


def merged(catalogue: list[tuple[str, Option]]) -> list[tuple[Option, str]]:
    """Each option of ``catalogue`` (every family's (title, option)) once, the
    first declaration winning for type and range, with help that says which
    family it applies to when not all of them take it."""
    seen: dict[str, list] = {}
    for title, option in catalogue:
        seen.setdefault(option.name, []).append((title, option))
    families = len({title for title, _ in catalogue})
    out = []
    for entries in seen.values():
        option = entries[0][1]
        helps = {o.help_text() for _, o in entries}
        if len(entries) == families and len(helps) == 1:
            text = option.help_text()
        else:
            text = " ".join(f"{title}: {_lower_first(o.help_text())}" for title, o in entries)
        out.append((option, text))
    out.extend((o, o.help_text()) for o in REFUSED if o.name not in seen)
    return out


def click_options(catalogue: list[tuple[str, Option]], exclude: Iterable[str] = (), help_prefix: str = ""):
    """A decorator adding one click option per declared option (None when unset)."""
    import click

    exclude = set(exclude)
    decorators = []
    for option, text in merged(catalogue):
        if option.name in exclude:
            continue
        names = [option.flag] + ([option.short] if option.short else [])
        # An option declared only to be refused keeps its flag (refused by name,
        # saying why) but is not listed in --help.
        kwargs: dict[str, Any] = dict(default=None, help=help_prefix + text, hidden=bool(option.refused))
        if option.type == BOOL and option.negatable:
            names[0] = f"{option.flag}/--no-{option.flag[2:]}"
        elif option.type == BOOL:
            kwargs["is_flag"] = True
        elif option.choices:
            kwargs["type"] = click.Choice(option.choices)
        elif option.type == INT:
            kwargs["type"] = click.IntRange(min=option.minimum, max=option.maximum,
                                            min_open=option.min_open)
        elif option.type == FLOAT:
            kwargs["type"] = click.FloatRange(min=option.minimum, max=option.maximum,
                                              min_open=option.min_open)
        if option.metavar:
            kwargs["metavar"] = option.metavar
        decorators.append(click.option(*names, option.name, **kwargs))

    def apply(func):
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def request_options(catalogue: list[tuple[str, Option]]) -> dict[str, Option]:
    """Request field -> option, for the fields a server request may set."""
    return {o.request_field: o for o, _ in merged(catalogue) if o.request and not o.refused}


def defaults(options: Iterable[Option]) -> dict[str, Any]:
    """Option name -> its declared default value (None: unset unless the checkpoint sets it)."""
    return {o.name: o.default for o in options}


# -- options every family declares alike -------------------------------------

MAX_TOKENS = Option("max_tokens", INT, "Most tokens to generate.", 256,
                    "generation_config max_new_tokens, else {default}", minimum=1, short="-m")
SEED = Option("seed", INT, "Seed for the run's randomness (same seed, same machine: same output).",
              default_help="random", minimum=0, maximum=2**64 - 1)
MEMORY_BUDGET = Option("memory_budget", FLOAT, "Refuse, before allocating, a generation whose KV cache, "
                       "canvas/block and logits would need more than this many GB.",
                       default_help="80% of the machine's memory less the model", minimum=0.0, min_open=True,
                       request=False)
SKIP_SPECIAL_TOKENS = Option("skip_special_tokens", BOOL, "Leave special tokens (<pad>, <eos>, ...) out "
                             "of the text (--json keeps every id).", True, "on", negatable=True)
# 512: no slower than 2048 on the CPU backend (docs/benchmarks.md), and the prefix cache
# (generation/prefix_cache.py) reuses whole prefill forwards, so it sets the reuse granularity.
PREFILL_STEP_SIZE = Option("prefill_step_size", INT, "Prompt tokens per prefill forward (a shared prefix "
                           "is reused from the prefix cache in whole forwards).", 512,
                           minimum=1, request=False)
