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


def start(n: int, command: list[str], env: dict | None = None) -> subprocess.Popen:
    """``launch`` in the background (a server): stdout and stderr to temporary files
    (``.out`` / ``.err`` on the process), every rank tagged for ``rank_pids``."""
    import tempfile
    import uuid

    port = random.randrange(20000, 60000, 64)
    cmd = [str(MLX_LAUNCH), "-n", str(n), "--backend", "ring", "--starting-port", str(port), *command]
    tag = uuid.uuid4().hex
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                "DLM_TEST_LAUNCH": tag, **(env or {})}
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, env=full_env,
                            cwd=ROOT)
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
# command N's own output. A command given as {"args": [...], "stdin": PATH} reads
# that file as rank 0's stdin (mlx.launch hands every rank all of its own stdin). DLM_TEST_STALL="RANK:kill|hang" makes that rank die
# (SIGKILL) or hang after its first committed canvas/block: a dead or stuck rank.
_MANY = """
import json, os, signal, sys, time
from dlm.runtime import api

rank = int(os.environ.get("MLX_RANK", "0"))
stall = os.environ.get("DLM_TEST_STALL", "")
if stall and int(stall.split(":")[0]) == rank:
    generate = api.stream_generate

    def stalling(*args, **kw):
        for i, event in enumerate(generate(*args, **kw)):
            yield event
            if stall.endswith("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(1)

    api.stream_generate = stalling
from dlm.runtime.cli.main import main

for i, args in enumerate(json.loads(sys.argv[1])):
    if isinstance(args, dict):  # {"args": [...], "stdin": path}: rank 0 reads that file as stdin
        if rank == 0:
            os.dup2(os.open(args["stdin"], os.O_RDONLY), 0)
        args = args["args"]
    try:
        main(args, prog_name="dlm-run", standalone_mode=False)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    sys.stdout.flush()
    if rank == 0:
        sys.__stdout__.write(f"\\n=== {i} exit {code}\\n")
        sys.__stdout__.flush()
"""


def dlm_run_many(n: int, commands: list[list[str]], **kw) -> subprocess.CompletedProcess:
    """Several ``dlm-run`` commands run one after the other in each rank of one launch."""
    import json

    return launch(n, [sys.executable, "-c", _MANY, json.dumps(commands)], **kw)


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

