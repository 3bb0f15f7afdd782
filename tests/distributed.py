"""Running a command over N ranks on loopback with ``mlx.launch --backend ring``,
for the distributed tests: ``launch(n, [args...])`` returns the finished process
(stdout of every rank, interleaved; stderr likewise). mlx.launch exits 0 even when
a rank fails: check the output. Each launch takes its own
random port range, so concurrent test processes do not collide."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from tests import ROOT

MLX_LAUNCH = Path(sys.executable).parent / "mlx.launch"
DLM_RUN = Path(sys.executable).parent / "dlm-run"


def launch(n: int, command: list[str], timeout: float = 240.0, env: dict | None = None,
           cwd: Path = ROOT, input: str | None = None) -> subprocess.CompletedProcess:
    """``mlx.launch -n N --backend ring COMMAND`` (an executable and its arguments:
    ``[sys.executable, "script.py", ...]``, or ``dlm_run``'s)."""
    import uuid

    port = random.randrange(20000, 60000, 64)
    cmd = [str(MLX_LAUNCH), "-n", str(n), "--backend", "ring", "--starting-port", str(port), *command]
    tag = uuid.uuid4().hex  # rank_pids(done) finds any rank still running afterwards
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "DLM_TEST_LAUNCH": tag,
                **(env or {})}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd,
                          input=input)
    done.tag = tag
    return done


def start(n: int, command: list[str], env: dict | None = None, input: str | None = None) -> subprocess.Popen:
    """``launch`` in the background (a server): stdout and stderr to temporary files
    (``.out`` / ``.err`` on the process), every rank tagged for ``rank_pids``;
    ``input`` is the job's stdin (none by default)."""
    import tempfile
    import uuid

    port = random.randrange(20000, 60000, 64)
    cmd = [str(MLX_LAUNCH), "-n", str(n), "--backend", "ring", "--starting-port", str(port), *command]
    tag = uuid.uuid4().hex
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                "DLM_TEST_LAUNCH": tag, **(env or {})}
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    stdin = subprocess.DEVNULL
    if input is not None:
        stdin = tempfile.TemporaryFile("w+")
        stdin.write(input)
        stdin.flush()
        stdin.seek(0)
    proc = subprocess.Popen(cmd, stdin=stdin, stdout=out, stderr=err, text=True, env=full_env, cwd=ROOT)
    proc.out, proc.err, proc.tag = out, err, tag
    return proc


def read(stream) -> str:
    stream.seek(0)
    return stream.read()


def rank_pids(proc) -> dict[int, int]:
    """rank -> pid of the ranks of a ``start`` or ``launch`` job still running (found by their tag)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):  # gone, not ours, or not text
            continue
        if env.get("DLM_TEST_LAUNCH") == proc.tag and "MLX_RANK" in env and state != "Z":
            found[int(env["MLX_RANK"])] = int(entry.name)
    return found


def dlm_run(n: int, args: list[str], **kw) -> subprocess.CompletedProcess:
    """``mlx.launch -n N --backend ring dlm-run ARGS``, as a user runs it."""
    return launch(n, [str(DLM_RUN), *args], **kw)


# Several dlm-run commands in one launch (each launch loads MLX and transformers on
# every rank: seconds on a small machine). Rank 0 prints "=== N exit CODE" after
# command N's own output, and "=== N start SECONDS" (time.time()) to stderr before it.
# A command given as a dict {"args": [...], ...} may add: "stdin": PATH, a file rank 0
# reads as its stdin (mlx.launch hands every rank all of its own stdin); "env": {NAME:
# VALUE}, set on every rank for that command; "stall": "RANK:kill|hang", that rank dies
# (SIGKILL) or hangs after its first committed canvas/block: a dead or stuck rank (it
# ends the job, so such a command comes last). DLM_TEST_STALL="RANK:kill|hang" in the
# environment stalls every command so.
_MANY = """
import json, os, signal, sys, time
from dlm.runtime import api

rank = int(os.environ.get("MLX_RANK", "0"))
generate = api.stream_generate


def stalling(stall):
    def stream_generate(*args, **kw):
        for i, event in enumerate(generate(*args, **kw)):
            yield event
            if stall.endswith("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(1)

    return stream_generate


from dlm.runtime.cli.main import main

for i, args in enumerate(json.loads(sys.argv[1])):
    stall, env = os.environ.get("DLM_TEST_STALL", ""), {}
    if isinstance(args, dict):
        if rank == 0 and "stdin" in args:
            os.dup2(os.open(args["stdin"], os.O_RDONLY), 0)
        stall, env = args.get("stall", stall), args.get("env", {})
        args = args["args"]
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    api.stream_generate = stalling(stall) if stall and int(stall.split(":")[0]) == rank else generate
    if rank == 0:
        sys.__stderr__.write(f"=== {i} start {time.time()}\\n")
        sys.__stderr__.flush()
    try:
        main(args, prog_name="dlm-run", standalone_mode=False)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name)
        else:
            os.environ[name] = value
    sys.stdout.flush()
    if rank == 0:
        sys.__stdout__.write(f"\\n=== {i} exit {code}\\n")
        sys.__stdout__.flush()
"""


def dlm_run_many(n: int, commands: list, **kw) -> subprocess.CompletedProcess:
    """Several ``dlm-run`` commands run one after the other in each rank of one launch."""
    import json

    return launch(n, [sys.executable, "-c", _MANY, json.dumps(commands)], **kw)


def start_many(n: int, commands: list, **kw) -> subprocess.Popen:
    """``dlm_run_many`` in the background (``start``)."""
    import json

    return start(n, [sys.executable, "-c", _MANY, json.dumps(commands)], **kw)


def started(stderr: str) -> dict[int, float]:
    """``dlm_run_many``'s rank-0 stderr: command index -> when it started (time.time())."""
    found = {}
    for line in stderr.splitlines():
        if line.startswith("=== ") and " start " in line:
            index, when = line[4:].split(" start ")
            found[int(index)] = float(when)
    return found


def run_many_alone(commands: list, input: str | None = None, timeout: float = 240.0):
    """``dlm_run_many``'s commands in one plain process (no mlx.launch): the reference."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-c", _MANY, json.dumps(commands)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, input=input)


def outputs(stdout: str) -> dict[int, tuple[int, str]]:
    """``dlm_run_many``'s rank-0 stdout: command index -> (exit code, its output)."""
    found, text = {}, ""
    for line in stdout.splitlines(keepends=True):
        if line.startswith("=== ") and " exit " in line:
            index, code = line[4:].split(" exit ")
            found[int(index)] = (int(code), text.rstrip("\n"))
            text = ""
        else:
            text += line
    return found



# -- both families' checks, one launch per rank count ------------------------------
#
# tests/llada2_moe/test_distributed.py and tests/diffusion_gemma/test_distributed.py
# compare the ranks with one process at 2 and at 3 ranks. Each launch pays every
# rank's start (Python, MLX, transformers and torch, the tokenizer) on a small
# machine, so one launch per rank count runs both families' checks
# (llada2_moe/distributed_run.results, diffusion_gemma/distributed_checks.run), each
# rank writing OUT.<rank>.json; whichever test comes first launches it, the other
# reads the same results. The single-process twins are computed in this process
# while the ranks run, once per model directory.
_FAMILIES = """
import json, sys
from pathlib import Path
import dlm.runtime  # before MLX: the optimized BLAS
from dlm.runtime.platform import distributed
from tests.diffusion_gemma import distributed_checks
from tests.llada2_moe import distributed_run

spec = json.loads(sys.argv[1])
got = {"llada2": {d: distributed_run.results(d) for d in spec["llada2"]},
       "dg": distributed_checks.run(spec["dg"])}
w = distributed.world()
Path(f"{spec['out']}.{0 if w is None else w.rank}.json").write_text(json.dumps(got))
"""

_MODELS: dict = {}
_TWINS: dict = {}  # (family, model dir or target) -> its single-process results (as JSON gives them back)
_RANKS: dict = {}  # (n, llada2 dirs, dg targets) -> [each rank's results] or the failure's text


def family_models(tmp_path_factory, tiny_dg_dir, tiny_dg_mlx_dir, tiny_dg_vision_mlx_dir) -> dict:
    """{"llada2": {"float", "q4", "v22": dir}, "dg": [float, 4-bit, "vision+image" targets]},
    built once per session: LLaDA-2 float and 4-bit, LLaDA2.2; DiffusionGemma float,
    4-bit (groups of 32 everywhere: o_proj splits at a head boundary) and the vision
    model with an image."""
    if not _MODELS:
        from tests.builders import build_llada2, build_llada22, convert_dir

        root = tmp_path_factory.mktemp("l2dist")
        build_llada2(root / "hf")
        build_llada22(root / "hf22")
        q4 = convert_dir(tiny_dg_dir, tmp_path_factory.mktemp("dg_dist") / "q4", quantize=True, q_bits=4,
                         q_group_size=32, recipe="uniform")
        _MODELS.update(
            llada2={"float": convert_dir(root / "hf", root / "f32"),
                    "q4": convert_dir(root / "hf", root / "q4", quantize=True, q_bits=4, q_group_size=32),
                    "v22": convert_dir(root / "hf22", root / "v22")},
            dg=[str(tiny_dg_mlx_dir), str(q4), f"{tiny_dg_vision_mlx_dir}+image"])
    return _MODELS


def family_ranks(n: int, models: dict, tmp_path_factory) -> dict:
    """Both families over ``n`` ranks in one launch: {"llada2": (twins, ranks), "dg":
    (twins, ranks)}, twins as the ranks' results are laid out (llada2: {dir: results};
    dg: [results per target]), ranks one per rank. Over 2 ranks: every model (4-bit,
    LLaDA2.2 and the image too); over 3: the float models (time)."""
    import json

    from tests.diffusion_gemma import distributed_checks
    from tests.llada2_moe import distributed_run

    l2 = [str(models["llada2"][k]) for k in (("float", "q4", "v22") if n == 2 else ("float",))]
    dg = list(models["dg"] if n == 2 else models["dg"][:1])
    key = (n, tuple(l2), tuple(dg))
    if key not in _RANKS:
        out = tmp_path_factory.mktemp(f"families{n}") / "ranks"
        proc = start(n, [sys.executable, "-c", _FAMILIES, json.dumps({"llada2": l2, "dg": dg, "out": str(out)})])
        try:  # the twins meanwhile
            for d in l2:
                if ("llada2", d) not in _TWINS:
                    _TWINS["llada2", d] = json.loads(json.dumps(distributed_run.results(d)))
            for t in dg:
                if ("dg", t) not in _TWINS:
                    _TWINS["dg", t] = json.loads(json.dumps(distributed_checks.run([t])[0]))
            proc.wait(timeout=600)
        finally:
            proc.kill()
            proc.wait()
        files = [out.parent / f"ranks.{rank}.json" for rank in range(n)]
        if all(f.exists() for f in files):
            _RANKS[key] = [json.loads(f.read_text()) for f in files]
        else:
            _RANKS[key] = read(proc.out)[-2000:] + read(proc.err)[-4000:]
    ranks = _RANKS[key]
    assert not isinstance(ranks, str), ranks
    return {"llada2": ({d: _TWINS["llada2", d] for d in l2}, [r["llada2"] for r in ranks]),
            "dg": ([_TWINS["dg", t] for t in dg], [r["dg"] for r in ranks])}
