"""A run stage left with no Dask worker fails with ClusterLost instead of waiting for ever."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import CancelledError

import pytest
from distributed import Client, LocalCluster

from evalfleet.cluster import WorkersWatch

pytestmark = pytest.mark.slow


def sleepy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.mark.timeout(180)
def test_no_worker_left_cancels_the_wait_with_a_reason():
    # A worker with no nanny: killed, nothing restarts it (as when a nanny gives up).
    with LocalCluster(n_workers=0, dashboard_address=None) as lc, Client(lc) as client:
        worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker",
                                   lc.scheduler_address, "--no-nanny", "--nthreads", "1",
                                   "--no-dashboard"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            client.wait_for_workers(1, timeout=120)
            future = client.submit(sleepy, 600.0, pure=False)
            time.sleep(1.0)
            worker.kill()
            t0 = time.monotonic()
            with WorkersWatch(lc.scheduler_address, lambda: client.cancel([future]),
                              grace_s=2.0, poll_s=0.2) as watch:
                with pytest.raises(CancelledError):  # cancelled: the wait ends
                    future.result()
            assert time.monotonic() - t0 < 60
            assert watch.lost is not None and "has had no worker for 2 s" in watch.lost
        finally:
            worker.kill()
            worker.wait()
