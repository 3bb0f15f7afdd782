"""Peak-RSS measurements in a child process (Linux /proc), for the
bounded-memory tests: a child script is RSS_PRELUDE + a body that measures
each phase between ``reset_peak()`` and ``rss("VmHWM")`` and prints one JSON
line; ``run_child`` runs it. MALLOC_MMAP_THRESHOLD_ keeps large blocks
mmapped, so what a phase frees goes back to the OS and the next phase's peak
is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

RSS_PRELUDE = r"""
import gc, json, sys
import torch
torch.set_num_threads(1)

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def reset_peak():
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    return rss("VmRSS")
"""


def run_child(body: str, phases: list, cwd, timeout: int) -> dict:
    """Run RSS_PRELUDE + ``body`` with ``phases`` (JSON) as its argument; its last stdout line, parsed."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-c", RSS_PRELUDE + body, json.dumps(phases)], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=str(cwd), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
