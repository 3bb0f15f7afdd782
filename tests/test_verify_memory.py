"""dlm-verify's memory bookkeeping: per-phase resident peaks (verify/memory.py)
and handing the heap that threads freed back to the system."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dlm.verify import memory as M

pytestmark = pytest.mark.skipif(M.rss_bytes() is None, reason="needs /proc/self/statm")


def test_a_phase_records_the_peak_of_what_it_allocated():
    with M.monitoring() as mon:
        with M.phase("outer"):
            with M.phase("big"):
                a = np.ones(300 * 2**20 // 8)  # 300 MiB, touched
                M._active._sample()
                del a
            with M.phase("small"):
                b = np.ones(1000)
                del b
        got = mon.summary()
    assert list(got) == ["outer", "big", "small"]
    assert got["big"]["peak"] - got["small"]["peak"] > 0.25  # GB
    assert got["outer"]["peak"] >= got["big"]["peak"]  # an outer phase sees its inner ones
    assert M._active is None  # monitoring() ends with its block
    with M.phase("none"):  # no monitor: a no-op
        pass


def test_trim_returns_what_threads_freed_in_their_arenas():
    """A layer-streamed reference loads layers from several lockstep threads;
    glibc keeps tensors under its mmap threshold (a 4 MB expert matrix) in
    each thread's arena. After trim() the process holds about what it held
    before the layers (run in a fresh interpreter: nothing else in its heap)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim")
    code = textwrap.dedent("""
        import threading
        import numpy as np
        from dlm.verify import memory as M
        keep = []
        def layer():
            weights = [np.ones((1024, 1024), np.float32) for _ in range(300)]  # 1.2 GB of 4 MB tensors
            keep.extend(np.ones(1000) for _ in range(300))  # survivors between them
            del weights
        start = M.rss_bytes()
        for _ in range(3):
            t = threading.Thread(target=layer)
            t.start()
            t.join()
        M.trim()
        print((M.rss_bytes() - start) / 1e9)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout.strip()) < 0.3, out.stdout
