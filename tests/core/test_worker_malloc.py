"""Dask's nanny malloc setting undone on workers: batch buffers stay in the heap."""

import os
import subprocess
import sys

PROBE = """
import resource, sys
import numpy as np
if sys.argv[1] == "tuned":
    from evalfleet.worker import tune_malloc
    assert tune_malloc()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = np.ones((4096, 64), dtype=np.float32)
before = faults()
for _ in range(200):  # what a hot-path step does: fresh 1 MiB activations, written, dropped
    y = np.tanh(x)
    del y
print(faults() - before)
"""


def _faults(mode: str) -> int:
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="65536")  # what Dask's nanny exports
    done = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_tuned_worker_stops_page_faulting_on_every_batch_buffer():
    plain, tuned = _faults("plain"), _faults("tuned")
    assert plain > 200 * 200, plain  # each 1 MiB buffer mmap-ed anew: ~256 faults per step
    assert tuned < plain / 20, (tuned, plain)
