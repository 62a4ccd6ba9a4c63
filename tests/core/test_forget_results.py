"""A released result is gone from the scheduler when ``release`` returns, not ~10 ms later.

``Future.cancel`` queues its message on the client's batched stream; ``done_with`` retires the
workers over another connection, which can arrive first. The scheduler then still wanted the
result when its worker left and ran the task again on a worker still up (seen once in CI: the
replays' key still held at ``done_with``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from distributed import Client, LocalCluster

from tasks.run_episodes import release


class _Wrapper:
    """What Prefect's ``PrefectDaskFuture`` offers ``release``: the Dask future inside."""

    def __init__(self, future: object) -> None:
        self.wrapped_future = future


def _wanted(dask_scheduler) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(str(key) for key, ts in dask_scheduler.tasks.items() if ts.who_wants)


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as dask_client:
        yield dask_client


def test_a_released_result_is_not_wanted_any_more_when_release_returns(client: Client) -> None:
    for round_ in range(20):  # a lost race shows within a few rounds on the old release
        futures = [client.submit(pow, round_, power, key=f"held-{round_}-{power}")
                   for power in range(4)]
        assert client.gather(futures) == [round_ ** power for power in range(4)]
        assert len(client.run_on_scheduler(_wanted)) == 4
        release([_Wrapper(future) for future in futures])
        assert client.run_on_scheduler(_wanted) == [], round_


def test_release_of_a_queued_task_stops_it_from_running(client: Client) -> None:
    gate = client.submit(__import__("time").sleep, 0.5, key="gate", pure=False)
    queued = client.submit(lambda _: 1, gate, key="after-gate")
    release([_Wrapper(queued), _Wrapper(gate)])
    assert client.run_on_scheduler(_wanted) == []
    assert queued.cancelled()


def test_release_with_no_dask_future_inside_is_a_no_op() -> None:
    release([_Wrapper(None), object()])
