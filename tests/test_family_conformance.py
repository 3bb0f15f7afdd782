"""What every registered family must do, parametrized over the registry.

A new family passes this suite by adding its tiny-checkpoint builder to
``builders.FAMILY_KITS``; nothing here names a family. Each test compares with
the family's real reference (transformers' class or dlm's independent PyTorch
model) through the dlm-verify adapter protocol, never with dlm's own earlier
output.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from dlm.verify.protocol import adapter_for
from dlm.convert.reader import CheckpointReader
from dlm.runtime import api
from dlm.runtime.checkpoint import read_generation_config, read_json
from dlm.runtime.platform.errors import GenerationError
from dlm.runtime.registry import all_options, families, request_options
from dlm.runtime.server.requests import ModelCaps, RequestError, parse_chat

from .builders import FAMILY_KITS, convert_dir, dequantized_twin

NAMES = [f.name for f in families()]
PROMPTS = [[2, 10, 11, 12, 13, 14, 15]]


def test_every_registered_family_has_a_kit():
    assert sorted(FAMILY_KITS) == sorted(NAMES)


@pytest.fixture(scope="module", params=NAMES)
def family_case(request, tmp_path_factory):
    """(family, kit, hub-layout float32 checkpoint, its float32 MLX conversion)."""
    family = next(f for f in families() if f.name == request.param)
    kit = FAMILY_KITS[family.name]
    root = tmp_path_factory.mktemp(family.name)
    src = root / "hf"
    kit.build(src)
    mlx_dir = convert_dir(src, root / "mlx")
    return family, kit, src, mlx_dir


# -- config ---------------------------------------------------------------------


def test_every_config_form_parses_to_the_same_geometry(family_case):
    family, kit, src, _ = family_case
    config = read_json(src / "config.json", "config.json")
    forms = kit.config_forms(config)
    assert len(forms) >= 2, "a family declares every on-disk config form it reads"
    ignored = set(kit.form_dependent_fields)
    parsed = {}
    for name, form in forms.items():
        args = family.config.from_config(form, f"{name} form")
        parsed[name] = {k: v for k, v in dataclasses.asdict(args).items() if k not in ignored}
    first = next(iter(parsed.values()))
    for name, fields in parsed.items():
        assert fields == first, f"{family.name}: the {name} form parses differently"


# -- weights ----------------------------------------------------------------------


def test_hf_to_mlx_to_hf_round_trip_is_exact(family_case):
    family, kit, src, _ = family_case
    config = read_json(src / "config.json", "config.json")
    args = family.config.from_config(config)
    original = {}
    for f in sorted(src.glob("*.safetensors")):
        original.update(load_file(str(f)))
    with CheckpointReader(src) as reader:
        plans = family.weights.plan_weights(args, reader.metadata(), True)
        mlx = {}
        for plan in plans:
            arrays = [reader.read(n) for n in plan.sources]
            mlx[plan.name] = plan.combine(arrays) if plan.combine else arrays[0]
    back = family.weights.to_hf(mlx)
    assert len(back) > 0
    for name in back:
        assert name in original, f"to_hf produced {name}, which the checkpoint does not have"
        got = np.array(back[name])
        assert got.dtype == original[name].dtype and np.array_equal(got, original[name]), name
    # What the plan leaves out (tied copies, rotary buffers) the reference
    # rebuilds from what it keeps: loaded with the round-tripped weights, it
    # holds every other original tensor, exactly.
    ref = adapter_for(family).load_reference(src, weights={k: np.array(v) for k, v in back.items()})
    state = ref.model.state_dict()
    dropped = [n for n in set(original) - set(back) if not n.startswith(kit.not_converted)]
    for name in dropped:
        if name in state:
            assert np.array_equal(state[name].float().numpy(), original[name].astype(np.float32)), name


# -- logits and commit streams against the reference ---------------------------------


def test_the_model_declares_its_product_rows(family_case):
    """The CPU weight layout (runtime/models/cpu/layout.py) reads how many rows a
    denoising forward gives the linears and each routed expert."""
    rows = api.load(family_case[3]).model.product_rows()
    assert set(rows) == {"linear", "experts"} and all(v > 0 for v in rows.values())


def test_float32_logits_match_the_reference(family_case):
    family, _, src, mlx_dir = family_case
    adapter = adapter_for(family)
    config = read_json(src / "config.json", "config.json")
    cases = adapter.logit_cases(config, PROMPTS, read_generation_config(src, config))
    assert cases
    ref = adapter.load_reference(src)
    loaded = api.load(mlx_dir)
    done: dict = {}
    for case in cases:
        want = np.asarray(adapter.reference_logits(ref, case, done), dtype=np.float32)
        done[case.name] = want  # later cases may build on it (the protocol)
        got = np.asarray(adapter.mlx_logits(loaded, case), dtype=np.float32)
        assert got.shape == want.shape, case.describe()
        assert np.abs(got - want).max() < 1e-4, case.describe()


def test_deterministic_commit_stream_matches_the_reference(family_case):
    family, _, src, mlx_dir = family_case
    adapter = adapter_for(family)
    config = read_json(src / "config.json", "config.json")
    settings = adapter.stream_settings(config, read_generation_config(src, config), blocks=2, steps=4)
    ref = adapter.load_reference(src)
    loaded = api.load(mlx_dir)
    for prompt in PROMPTS:
        want = adapter.reference_commit_stream(ref, prompt, settings)
        got = adapter.mlx_commit_stream(loaded, prompt, settings)
        assert want.tokens, "the reference committed nothing"
        assert got.tokens == want.tokens
        assert got.steps_per_block == want.steps_per_block


def test_structured_output_and_forced_tool_calls_validate(family_case):
    """Every family runs its canvases/blocks under a grammar (its structured.py)
    and declares its tool-call syntax (its tools.py)."""
    import jsonschema

    from dlm.runtime.structured.tools import ToolSyntax, parse_tools

    family, _, _, mlx_dir = family_case
    assert isinstance(family.tool_syntax, ToolSyntax)
    loaded = api.load(mlx_dir)
    ids = api.encode_prompt(loaded, "JSON please")
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}},
              "required": ["k", "n"], "additionalProperties": False}
    result = api.generate(loaded, ids, {"max_tokens": 64, "seed": 0},
                          response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), schema)
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}], "required")
    result = api.generate(loaded, api.encode_prompt(loaded, "call f", tools=tools), {"max_tokens": 64, "seed": 0},
                          tools=tools)
    assert result.finish_reason == "tool_calls" and [c.name for c in result.tool_calls] == ["f"]
    jsonschema.validate(json.loads(result.tool_calls[0].arguments), schema)


def test_quantized_model_matches_its_dequantized_float_twin(family_case, tmp_path):
    family, kit, src, _ = family_case
    adapter = adapter_for(family)
    q_dir = convert_dir(src, tmp_path / "q4", quantize=True, q_bits=4, q_group_size=kit.q_group_size,
                        recipe="uniform")
    twin_dir = dequantized_twin(q_dir, tmp_path / "twin")
    config = read_json(src / "config.json", "config.json")
    cases = adapter.logit_cases(config, PROMPTS, read_generation_config(src, config))
    twin = api.load(twin_dir)
    # MLX's quantized kernels, and the CPU default (dequantized to float32 at load).
    for quantized in (api.load(q_dir, compute_dtype="float32"), api.load(q_dir)):
        for case in cases:
            q = np.asarray(adapter.mlx_logits(quantized, case), dtype=np.float32)
            f = np.asarray(adapter.mlx_logits(twin, case), dtype=np.float32)
            assert np.abs(q - f).max() < 1e-3, case.describe()


# -- options: declared once, accepted everywhere, foreign ones refused by name --------


def _sample(option):
    """A valid, non-neutral value of a declared option."""
    if option.type == "bool":
        return True
    if option.choices:
        return option.choices[-1]
    if option.type == "str":
        return "constant" if option.metavar and "constant" in option.metavar else "x"
    low = option.minimum if option.minimum is not None else 0
    if option.type == "int":
        return int(low) + 1
    high = option.maximum if option.maximum is not None else low + 2.0
    return (low + high) / 2


def _cli_options(loaded_path, flag_args):
    """What `dlm-run generate` hands the runtime for these flags (parsed by click)."""
    from dlm.runtime.cli.main import generate

    ctx = generate.make_context("generate", ["--model", str(loaded_path), *flag_args])
    return {k: v for k, v in ctx.params.items() if v is not None}


def test_every_declared_option_is_accepted_by_the_api_the_cli_and_the_server(family_case):
    family, _, _, mlx_dir = family_case
    loaded = api.load(mlx_dir)
    fields = {o.name: f for f, o in request_options().items()}
    caps = ModelCaps(family=family.name, text_only=True)
    for option in family.options:
        if option.refused:
            continue
        value = _sample(option)
        # An option that takes effect only with another one's value gets it.
        context = {option.requires[0]: option.requires[1]} if option.requires else {}
        loaded.settings({**context, option.name: value})
        args = [option.flag] if option.type == "bool" else [option.flag, str(value)]
        for name, required in context.items():
            args += [next(o.flag for o in family.options if o.name == name), str(required)]
        parsed = _cli_options(mlx_dir, args)
        assert parsed[option.name] == value, option.flag
        options = {k: parsed[k] for k in (option.name, *context)}
        loaded.settings(options)
        if option.name in fields:
            body = {"messages": [{"role": "user", "content": "hi"}], fields[option.name]: value}
            body.update({fields[k]: v for k, v in context.items()})
            req = parse_chat(body, caps)
            loaded.settings(req.options)
        if option.requires:  # ... and alone, it is refused naming both flags
            with pytest.raises(GenerationError, match=f"{option.flag} takes effect only with"):
                loaded.settings({option.name: value})


def test_a_foreign_option_is_refused_with_a_message_naming_it(family_case):
    family, _, _, mlx_dir = family_case
    loaded = api.load(mlx_dir)
    own = {o.name for o in family.options}
    foreign = {o.name: o for f, o in all_options() if o.name not in own}
    assert foreign, "with two families, each has options the other refuses"
    for name, option in foreign.items():
        with pytest.raises(GenerationError, match=option.flag):
            loaded.settings({name: _sample(option)})
    with pytest.raises(GenerationError, match="frobnicate"):
        loaded.settings({"frobnicate": 1})
    # The CLI says the same, in one line, exit status 1.
    from dlm.runtime.cli.main import main

    name, option = next(iter(foreign.items()))
    value = _sample(option)
    flag_args = [option.flag] if option.type == "bool" else [option.flag, str(value)]
    r = CliRunner().invoke(main, ["generate", "--model", str(mlx_dir), "--prompt", "x", *flag_args])
    assert r.exit_code == 1 and f"error: {option.flag} does not apply to {family.title}" in r.output
    assert "Traceback" not in r.output


def test_request_fields_with_bad_values_are_refused_naming_the_field():
    caps = ModelCaps(family="any", text_only=True)
    for field, option in request_options().items():
        with pytest.raises(RequestError, match=f"'{field}'"):
            parse_chat({"messages": [{"role": "user", "content": "hi"}], field: [1]}, caps)


def test_declared_option_defaults_are_the_settings_defaults(family_case):
    """Each default is written once, in the option's declaration: with no option
    given and an empty generation_config, the family's Settings hold exactly it."""
    import functools

    from dlm.runtime.registry import settings

    family, kit, _, mlx_dir = family_case
    loaded = api.load(mlx_dir)
    built = settings(family, {}, loaded.args, {})
    declared = {o.name: o for o in family.options}
    numeric = {n for n, o in declared.items() if o.default is not None and o.type in ("int", "float")}
    assert numeric <= set(kit.settings_fields), "every numeric default is checked"
    for name, path in kit.settings_fields.items():
        assert functools.reduce(getattr, path.split("."), built) == declared[name].default, name
