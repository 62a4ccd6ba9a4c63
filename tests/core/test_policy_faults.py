"""Policy faults end only the episodes that trigger them: raises are isolated, hangs are bounded.

The planted policies (``tests.core.faulty_policies``) are clean policies plus a fault that fires
when one row's cart is far right, a state only some episodes reach. Their episode tables are
compared row by row with the clean policy's, under ``inprocess`` (native vector CartPole and
env instances) and ``process`` sandboxes (the policy runs in the worker at every level).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from evalfleet.cli import build_parser, request_from_args
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest
from evalfleet.policy import LoadedPolicy, load_policy, receive_policy
from evalfleet.records import OUTCOME_COLUMNS, EpisodeRecord, records_to_table
from evalfleet.runner import FIRST_FORWARD_FACTOR, EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.sandbox.base import EnvSlots, InProcessSlots
from evalfleet.seeds import SeedLedger
from tests.core import faulty_policies as fp

ENV = "CartPole-v1"
CTX = EpisodeContext("req", "sha", ENV, "spec", "w0")
#: (label, how the slots are opened): the native vector path, env instances, process sandboxes.
BACKENDS = ("native", "instances", "process")


def _policy(name: str) -> LoadedPolicy:
    ref = f"tests.core.faulty_policies:{name}"
    resolved = resolve_env(ENV, {}, None)
    art = receive_policy(ref, None, resolved.observation_space, resolved.action_space)
    return load_policy(art.format, art.payload, None, art.source, resolved.action_space)


def _slots(backend: str, n: int) -> EnvSlots:
    if backend in ("native", "instances"):
        return InProcessSlots(env_thunk(ENV, {}, None), n, native_vector=backend == "native")
    resolved = resolve_env(ENV, {}, None)
    return open_slots(backend, env_thunk(ENV, {}, None), n, episode_timeout_s=30.0,
                      env_spec=resolved.fingerprint.as_dict())


def _run(backend: str, policy: LoadedPolicy, indices: range, slots: int,
         timeout_s: float | None = 30.0) -> list[EpisodeRecord]:
    ledger = SeedLedger(0)
    box = _slots(backend, slots)
    try:
        return run_shard([(i, ledger.seed(i)) for i in indices], box, policy, CTX,
                         policy_timeout_s=timeout_s)
    finally:
        box.close()


def _rows(records: list[EpisodeRecord]) -> dict[int, dict[str, Any]]:
    table = records_to_table(records).select(list(OUTCOME_COLUMNS))
    return {row["episode_index"]: row for row in table.to_pylist()}


def _first_far(clean: str, index: int, threshold: float) -> int | None:
    """Steps episode ``index`` has taken when the clean policy first sees a far cart (or None)."""
    env = gym.make(ENV)
    obs, _ = env.reset(seed=SeedLedger(0).seed(index))
    fn = getattr(fp, clean)
    steps, done = 0, False
    while not done:
        if fp.far(obs, threshold):
            return steps
        action = int(fn(np.asarray(obs, dtype=np.float32)[None])[0])
        obs, _, terminated, truncated, _ = env.step(action)
        steps += 1
        done = terminated or truncated
    return None


def _shard_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("evalfleet-shard-")]


@pytest.fixture
def release_hung() -> Iterator[None]:
    """Lets abandoned forwards return after the test, and checks their threads then exit."""
    fp.RELEASE.clear()
    yield
    fp.RELEASE.set()
    deadline = time.monotonic() + 10
    while _shard_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _shard_threads(), "an abandoned shard thread did not exit once its forward returned"
    fp.RELEASE.clear()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clean,faulty,threshold,episodes,slots", [
    ("angle", "angle_raises_far", fp.ANGLE_FAR, 24, 6),
    ("mlp", "mlp_raises_far", fp.MLP_FAR, 16, 8),
])
def test_a_raising_row_ends_only_its_own_episode(backend: str, clean: str, faulty: str,
                                                 threshold: float, episodes: int,
                                                 slots: int) -> None:
    reference = _rows(_run(backend, _policy(clean), range(episodes), slots))
    rows = _rows(_run(backend, _policy(faulty), range(episodes), slots))
    assert sorted(rows) == list(range(episodes))
    triggered = {i: _first_far(clean, i, threshold) for i in range(episodes)}
    far = {i for i, t in triggered.items() if t is not None}
    assert 0 < len(far) < episodes // 2, "the planted condition should hit only some episodes"
    for i in range(episodes):
        if i not in far:
            assert rows[i] == reference[i], f"episode {i} never triggers the fault but changed"
            continue
        row, steps = rows[i], triggered[i]
        assert row["end_reason"] == "policy_error", f"episode {i}"
        assert row["error"].startswith(f"RuntimeError: cart past {threshold}"), row["error"]
        # The partial episode up to the failing forward: CartPole pays 1.0 per step.
        assert (row["length"], row["return"], row["success"]) == (steps, float(steps), None)
        assert steps is not None and steps < reference[i]["length"]


@pytest.mark.parametrize("backend", ("native", "process"))
def test_a_misshapen_action_ends_only_its_own_episode(backend: str) -> None:
    # A batch holding a far row got one action too few, and that row alone an action of shape
    # (1, 2): joining the sub-batches' actions raised out of the shard (exit 1, no report, the
    # other episodes lost).
    episodes, slots = 24, 6
    reference = _rows(_run(backend, _policy("angle"), range(episodes), slots))
    rows = _rows(_run(backend, _policy("angle_misshapes_far"), range(episodes), slots))
    assert sorted(rows) == list(range(episodes))
    triggered = {i: _first_far("angle", i, fp.ANGLE_FAR) for i in range(episodes)}
    far = {i for i, t in triggered.items() if t is not None}
    assert 0 < len(far) < episodes // 2
    for i in range(episodes):
        if i not in far:
            assert rows[i] == reference[i], f"episode {i} never triggers the fault but changed"
            continue
        assert rows[i]["end_reason"] == "policy_error", f"episode {i}"
        assert rows[i]["error"].startswith(
            "ValueError: policy returned actions of shape (1, 2) for 1 row(s); Discrete(2) takes "
            "one action of shape () per row"), rows[i]["error"]
        assert rows[i]["length"] == triggered[i]


@pytest.mark.parametrize("backend", ("native", "process"))
def test_a_hung_forward_ends_the_shard_as_policy_timeout_in_bounded_time(
        backend: str, release_hung: None) -> None:
    # Episodes 6..9 run first and end before any cart gets far; episode 11 hangs the policy.
    indices = range(6, 24)
    reference = _rows(_run(backend, _policy("angle"), indices, 4))
    started = time.monotonic()
    records = _run(backend, _policy("angle_hangs_far"), indices, 4, timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert elapsed < 10, f"a hung forward held the shard for {elapsed:.1f} s"
    rows = _rows(records)
    assert sorted(rows) == list(indices)
    finished = [i for i in indices if rows[i]["end_reason"] != "policy_timeout"]
    not_run = [r.episode_index for r in records if r.sandbox == "not-started"]
    hung = [i for i in indices if rows[i]["end_reason"] == "policy_timeout" and i not in not_run]
    assert finished and hung and not_run
    for i in finished:
        assert rows[i] == reference[i], f"episode {i} ended before the hang but changed"
    triggering = []
    for i in hung:
        row = rows[i]
        assert row["error"].startswith("policy forward did not return within 0.5 s"), row["error"]
        assert f"at step {row['length']} of this episode" in row["error"]
        assert row["return"] == float(row["length"]) and row["length"] < reference[i]["length"]
        if row["length"] == _first_far("angle", i, fp.ANGLE_FAR):
            triggering.append(i)
    assert triggering, "the episode whose cart went far should be among the hung batch"
    for i in not_run:
        assert rows[i]["end_reason"] == "policy_timeout"
        assert rows[i]["length"] == 0 and math.isnan(rows[i]["return"])  # never played
        assert rows[i]["error"].startswith("not run: a policy forward in this shard did not return")
    # The abandoned thread returns once released and leaves the shard's rows alone.
    count = len(records)
    fp.RELEASE.set()
    deadline = time.monotonic() + 10
    while _shard_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(records) == count


def test_the_first_forward_of_a_shard_gets_a_longer_bound() -> None:
    calls = []

    def slow_start(obs: np.ndarray) -> np.ndarray:
        calls.append(len(obs))
        if len(calls) == 1:
            time.sleep(0.8)  # one-off warm-up: over the bound, within FIRST_FORWARD_FACTOR of it
        return fp.angle(obs)

    assert 0.8 < 0.5 * FIRST_FORWARD_FACTOR - 0.5
    space = gym.spaces.Discrete(2)
    policy = LoadedPolicy(slow_start, space, is_torch=False, deterministic=True, device="cpu")
    rows = _rows(_run("native", policy, range(8), 4, timeout_s=0.5))
    reference = _rows(_run("native", _policy("angle"), range(8), 4))
    assert rows == reference


def test_unbounded_forwards_run_in_the_calling_thread() -> None:
    seen = []

    def where(obs: np.ndarray) -> np.ndarray:
        seen.append(threading.current_thread())
        return fp.angle(obs)

    policy = LoadedPolicy(where, gym.spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    rows = _rows(_run("native", policy, range(4), 2, timeout_s=None))
    assert set(seen) == {threading.current_thread()}
    assert rows == _rows(_run("native", _policy("angle"), range(4), 2))


def test_policy_timeout_is_a_validated_request_option() -> None:
    args = build_parser().parse_args(["--policy-timeout", "5"])
    assert request_from_args(args).policy_timeout_s == 5.0
    assert EvalRequest.build(policy="m:f").policy_timeout_s == 30.0
    for bad in (0, -1, float("nan")):
        with pytest.raises(RequestError, match="'policy_timeout_s' must be > 0 and at most"):
            EvalRequest.build(policy="m:f", policy_timeout_s=bad)
    # 1e-6 s was accepted: every episode ended policy_timeout at step 0, the policy's fault, exit 0.
    with pytest.raises(RequestError, match=r"'policy_timeout_s' must be at least 0.01 seconds "
                       r"\(got 1e-06\): no policy forward returns that fast"):
        EvalRequest.build(policy="m:f", policy_timeout_s=1e-6)
    assert EvalRequest.build(policy="m:f", policy_timeout_s=0.01).policy_timeout_s == 0.01


@pytest.mark.slow
def test_on_a_dask_worker_the_request_bound_applies_and_progress_still_flows(
        release_hung: None) -> None:
    """``execute_shard`` on a real worker: ``policy_timeout_s`` reaches the runner, the shard
    thread's rows come back in bounded time, and its progress events (published through Dask's
    ``get_worker``, a context variable) still reach the driver."""
    from evalfleet import cluster, pipeline
    from evalfleet.planning import plan_shards
    from evalfleet.progress import topic
    from evalfleet.worker import execute_shard

    events: dict[str, list[Any]] = {}
    with cluster.fleet_cluster(None, 1) as address:
        client = cluster.client_for(address)
        for name, timeout_s in (("angle_raises_far", 30.0), ("angle_hangs_far", 0.5)):
            request = EvalRequest.build(env=ENV, policy=f"tests.core.faulty_policies:{name}",
                                        episodes=24, concurrency=6, seed=0,
                                        policy_timeout_s=timeout_s)
            client.subscribe_topic(topic(request.request_id), events.setdefault(name, []).append)
            handle = cluster.distribute(pipeline.receive(request).artifact, address, "cpu", True)
            [shard] = plan_shards(request.request_id, 0, range(24), 6, 1).shards
            started = time.monotonic()
            table = client.submit(execute_shard, shard, handle, request, "inprocess",
                                  pure=False).result(timeout=120)
            assert time.monotonic() - started < 30
            reasons = dict(zip(table.column("episode_index").to_pylist(),
                               table.column("end_reason").to_pylist(), strict=True))
            assert sorted(reasons) == list(range(24))
            if name == "angle_raises_far":
                far = {i for i in range(24) if _first_far("angle", i, fp.ANGLE_FAR) is not None}
                assert {i for i, r in reasons.items() if r == "policy_error"} == far
            else:
                assert {"policy_timeout", "terminated"} <= set(reasons.values())
                client.run(fp.release)  # the worker's hung forward may go
        deadline = time.monotonic() + 10
        while len(events.get("angle_raises_far", [])) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    done = [e[1]["done"] for e in events.get("angle_raises_far", [])]
    assert 24 in done, f"no final progress event of the shard (got {done})"
    # The first finished episode publishes at once, from the shard thread: mid-shard progress.
    assert any(d < 24 for d in done), f"no progress event from inside the shard (got {done})"


class _AngleLogits(torch.nn.Module):
    """``fp.angle`` as TorchScript logits; with ``poison``, rows past ``fp.ANGLE_FAR`` get it."""

    def __init__(self, poison: float | None, masked: bool = False, everywhere: bool = False
                 ) -> None:
        super().__init__()
        self.poison = poison
        self.masked = masked
        self.threshold = float("-inf") if everywhere else fp.ANGLE_FAR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.stack([torch.zeros_like(x[:, 2]), x[:, 2]], dim=1)
        if self.masked:  # action 0 masked out everywhere: a legitimate -inf logit
            logits = torch.stack([torch.full_like(x[:, 2], float("-inf")), x[:, 2]], dim=1)
        if self.poison is not None:
            far = (x[:, 0] > self.threshold).unsqueeze(1).expand_as(logits)
            logits = torch.where(far, torch.full_like(logits, self.poison), logits)
        return logits


def _torchscript(module: torch.nn.Module, deterministic: bool = True) -> LoadedPolicy:
    import io

    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buf)
    space = resolve_env(ENV, {}, None).action_space
    return load_policy("torchscript", buf.getvalue(), None, "angle.pt", space,
                       deterministic=deterministic)


@pytest.mark.parametrize("backend", ("native", "instances"))
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_logits_no_action_can_be_chosen_from_end_the_episode_as_the_policys_error(
        backend: str, poison: float) -> None:
    # Before, argmax(NaN row) was action 0 and argmax(+inf, +inf) too: episodes went on with an
    # action the policy never chose, and the report carried their returns with no alarm.
    episodes, slots = 24, 6
    reference = _rows(_run(backend, _torchscript(_AngleLogits(None)), range(episodes), slots))
    rows = _rows(_run(backend, _torchscript(_AngleLogits(poison)), range(episodes), slots))
    triggered = {i: _first_far("angle", i, fp.ANGLE_FAR) for i in range(episodes)}
    far = {i for i, t in triggered.items() if t is not None}
    assert 0 < len(far) < episodes // 2
    for i in range(episodes):
        if i not in far:
            assert rows[i] == reference[i], f"episode {i} never sees bad logits but changed"
            continue
        row, steps = rows[i], triggered[i]
        assert row["end_reason"] == "policy_error", (i, row)
        assert "no finite maximum or a NaN" in row["error"], row["error"]
        assert (row["length"], row["return"]) == (steps, float(steps))


def test_sampled_actions_refuse_bad_logits_and_a_masked_action_is_no_fault() -> None:
    episodes, slots = 24, 6
    # NaN logits on every row: a softmax of them is NaN, and the cumulative sum drew action 0.
    sampled = _rows(_run("instances", _torchscript(_AngleLogits(float("nan"), everywhere=True),
                                                   False), range(episodes), slots))
    assert [(r["end_reason"], r["length"]) for r in sampled.values()] == [
        ("policy_error", 0)] * episodes
    masked = _rows(_run("instances", _torchscript(_AngleLogits(None, masked=True), False),
                        range(episodes), slots))
    # -inf beside a finite logit masks that action: every step takes action 1, nobody fails.
    assert {r["end_reason"] for r in masked.values()} <= {"terminated", "truncated"}


def test_stage_one_takes_masked_logits_and_refuses_ones_no_action_comes_from() -> None:
    from evalfleet.errors import PolicyError
    from evalfleet.policy import check_outputs

    space = resolve_env(ENV, {}, None).observation_space
    # -inf for a masked action was refused at stage 1 as "non-finite outputs" before.
    assert check_outputs(_torchscript(_AngleLogits(None, masked=True)), space, "m.pt") == "logits"
    with pytest.raises(PolicyError, match=r"policy 'n.pt' on a dummy batch: policy returned "
                       "logits with no finite maximum or a NaN for 4 of 4 rows"):
        check_outputs(_torchscript(_AngleLogits(float("nan"), everywhere=True)), space, "n.pt")
