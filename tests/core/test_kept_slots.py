"""A worker hands a shard's in-process env instances on to the same request's next shard.

A 20,000-episode evaluation runs as ~1,000-episode pieces (``checkpointed``); every piece built
all its slots' envs again, 6 % of a worker's time on evalfleet/Recommend-v0. Kept, the rows are
the same (each episode starts from ``reset(seed=...)``), the determinism audit still gets fresh
instances, envs a hung policy forward may still touch are never handed on, and another request
or ``idle_s`` without a shard closes them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from evalfleet import cluster, pipeline
from evalfleet.models import EvalRequest, Shard
from evalfleet.planning import plan_shards
from evalfleet.worker import KeptSlots, _kept_slots, execute_shard
from tests.core import faulty_policies as fp
from tests.core.counted_envs import COUNTED, Counted

POLICY = "tests.core.faulty_policies:angle"


def _pieces(request: EvalRequest, n: int, slots: int, cap: int) -> list[Shard]:
    plan = plan_shards(request.request_id, request.seed, range(n), slots, 1)
    return list(pipeline.checkpointed(plan, request.model_copy(update={"shard_episodes": cap})).shards)


def _run(request: EvalRequest, shards: list[Shard]) -> list[dict[str, Any]]:
    handle = cluster.distribute(pipeline.receive(request).artifact, None, "cpu", True)
    rows: list[dict[str, Any]] = []
    for shard in shards:
        rows += execute_shard(shard, handle, request, "inprocess").to_pylist()
    return sorted(rows, key=lambda r: r["episode_index"])


def _key(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["episode_index"], r["seed"], r["return"], r["length"], r["end_reason"]) for r in rows]


def test_pieces_of_one_request_build_each_slot_once_and_give_the_same_rows() -> None:
    request = EvalRequest.build(env=COUNTED, policy=POLICY, episodes=48, concurrency=6, seed=3,
                                isolation="inprocess")
    pieces = _pieces(request, 48, 6, 12)
    assert [len(p.episode_indices) for p in pieces] == [12, 12, 12, 12]
    _kept_slots.close()
    handle = cluster.distribute(pipeline.receive(request).artifact, None, "cpu", True)
    before = Counted.made
    rows = execute_shard(pieces[0], handle, request, "inprocess").to_pylist()
    built = Counted.made - before
    assert built in (6, 7)  # the first piece builds its six slots (and the worker resolves once)
    for piece in pieces[1:]:
        rows += execute_shard(piece, handle, request, "inprocess").to_pylist()
    assert Counted.made - before == built  # and the next three build none (they built 6 each)
    rows.sort(key=lambda r: r["episode_index"])
    assert [r["episode_index"] for r in rows] == list(range(48))
    # The same episodes as one unsplit shard of fresh instances.
    whole = EvalRequest.build(env=COUNTED, policy=POLICY, episodes=48, concurrency=6, seed=3,
                              isolation="inprocess", audit=False)
    _kept_slots.close()
    assert _key(_run(whole, list(plan_shards(whole.request_id, 3, range(48), 6, 1).shards))) == _key(rows)
    _kept_slots.close()


def test_the_audit_shard_and_another_request_never_take_kept_instances() -> None:
    request = EvalRequest.build(env=COUNTED, policy=POLICY, episodes=12, concurrency=6, seed=1,
                                isolation="inprocess")
    [piece] = _pieces(request, 12, 6, 12)
    _kept_slots.close()
    handle = cluster.distribute(pipeline.receive(request).artifact, None, "cpu", True)
    other = request.model_copy(update={"request_id": request.request_id + "-other"})
    execute_shard(piece, handle, other, "inprocess")  # resolved here once, slots kept for it
    before = Counted.made
    execute_shard(piece, handle, request, "inprocess")
    assert Counted.made - before == 6  # another request's kept instances are not taken
    audit = Shard(shard_id=1, episode_indices=[0, 5, 7, 9, 10, 11], seeds=piece.seeds[:6], slots=6,
                  audit=True)
    execute_shard(audit, handle, request, "inprocess")
    assert Counted.made - before == 12  # fresh instances for the audit, though six are kept
    execute_shard(piece, handle, request, "inprocess")
    assert Counted.made - before == 12  # the kept ones, for the request's next shard
    _kept_slots.close()


@pytest.fixture
def release_hung() -> Any:
    fp.RELEASE.clear()
    yield
    fp.RELEASE.set()


def test_instances_of_a_shard_whose_policy_forward_hung_are_not_handed_on(release_hung: None) -> None:
    request = EvalRequest.build(env=COUNTED, policy="tests.core.faulty_policies:angle_hangs_far",
                                episodes=24, concurrency=4, seed=0, isolation="inprocess",
                                policy_timeout_s=0.3)
    pieces = _pieces(request, 24, 4, 12)
    _kept_slots.close()
    handle = cluster.distribute(pipeline.receive(request).artifact, None, "cpu", True)
    before = Counted.made
    rows = execute_shard(pieces[0], handle, request, "inprocess").to_pylist()
    assert "policy_timeout" in {r["end_reason"] for r in rows}
    built = Counted.made - before
    assert built >= 4
    execute_shard(pieces[1], handle, request, "inprocess")
    assert Counted.made - before >= built + 4  # the hung piece's instances were not handed on
    _kept_slots.close()


class _Box:
    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_kept_slots_close_on_another_request_and_after_idle_s() -> None:
    kept = KeptSlots(idle_s=0.3)
    a, b, c = _Box(), _Box(), _Box()
    kept.put(("r1", "h", "inprocess", 4), a)
    kept.put(("r1", "h", "inprocess", 2), b)
    assert kept.take(("r1", "h", "inprocess", 4)) is a
    assert kept.take(("r1", "h", "inprocess", 4)) is None  # taken once
    assert not b.closed.is_set()
    assert kept.take(("r2", "h", "inprocess", 2)) is None  # another request: r1's are closed
    assert b.closed.is_set() and not a.closed.is_set()
    kept.put(("r2", "h", "inprocess", 2), c)
    started = time.monotonic()
    assert c.closed.wait(5)
    assert time.monotonic() - started >= 0.25
    assert kept.take(("r2", "h", "inprocess", 2)) is None
