"""``done_with``: the workers of ``evaluate()``'s own cluster stop before stages 6-7, no others."""

from __future__ import annotations

import time

from evalfleet.cluster import client_for, done_with, fleet_cluster


def _workers(address: str) -> int:
    return len(client_for(address).scheduler_info(n_workers=-1)["workers"])


def test_a_single_use_clusters_workers_stop_and_no_other_clusters_do():
    assert done_with(None) is False
    with fleet_cluster(None, 2, single_use=True) as address:
        assert _workers(address) == 2
        assert done_with(address) is True
        deadline = time.monotonic() + 60
        while _workers(address) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _workers(address) == 0
        assert done_with(address) is False  # told once
    with fleet_cluster(None, 2) as address:  # a kept cluster (the Evaluator's): left as it is
        assert done_with(address) is False
        time.sleep(1.0)
        assert _workers(address) == 2
