"""What the review replays, and what it compares: rows a clock ended, and a failure at step 0."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from gymnasium import spaces

from evalfleet.envspec import env_thunk
from evalfleet.models import EvalRequest
from evalfleet.pipeline import recording_shortfall
from evalfleet.policy import LoadedPolicy
from evalfleet.records import records_to_table
from evalfleet.replay import _compare, _Episode, record_episodes, replay_inputs
from evalfleet.review import choose_episodes
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger

ENV = "CartPole-v1"


def balance(obs: np.ndarray) -> np.ndarray:
    return (obs[:, 2] + 0.5 * obs[:, 3] > 0).astype(np.int64)


def refuses_some_starts(obs: np.ndarray) -> np.ndarray:
    """Raises on a few first observations: those episodes end as policy_error at step 0."""
    if ((obs[:, 0] > 0.04) & (np.abs(obs).max(axis=1) < 0.05)).any():
        raise RuntimeError("cannot handle this start")
    return balance(obs)


def _table(fn, episodes: int = 50) -> pa.Table:
    policy = LoadedPolicy(fn, spaces.Discrete(2), is_torch=False, deterministic=True, device="cpu")
    ledger, box = SeedLedger(0), InProcessSlots(env_thunk(ENV, {}, None), 4)
    try:
        records = run_shard([(i, ledger.seed(i)) for i in range(episodes)], box, policy,
                            EpisodeContext("r", "sha", ENV, "spec", "w0"))
    finally:
        box.close()
    return records_to_table(records).sort_by("episode_index")


def test_a_policy_timeout_row_is_neither_chosen_nor_replayed():
    """Its forward hung: a replay would hang stage 7 (the policy runs there, with no bound), and
    a bystander of the hung batch replays to another episode than its row, a false
    ``replay_nondeterminism``."""
    table = _table(balance, 12)
    reasons = table.column("end_reason").to_pylist()
    reasons[5] = "policy_timeout"
    table = table.set_column(table.schema.get_field_index("end_reason"), "end_reason",
                             pa.array(reasons, table.schema.field("end_reason").type))
    assert 5 not in choose_episodes(table, 12, seed=0)
    episodes, expected, ends = replay_inputs(table, [5, 6])
    called = []

    def watched(obs: np.ndarray) -> np.ndarray:
        called.append(len(obs))
        return balance(obs)

    policy = LoadedPolicy(watched, spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    result = record_episodes(ENV, {}, None, policy, episodes, video_dir=None, trajectories=False,
                             expected=expected, end_reasons=ends)
    assert "policy_timeout" in result.skipped[5]
    assert [e.episode_index for e in result.episodes] == [6] and result.reproducible


def test_rows_a_clock_ended_are_not_compared_with_their_replay():
    replay = _Episode(3, 7)
    replay.ret, replay.length, replay.reason = 12.0, 12, "timeout"
    for reason in ("timeout", "crashed", "oom", "policy_timeout"):
        assert _compare(replay, (11.0, 11), reason) == (None, None)  # it ran until its own limit
    # Nor is a replay its own clock or sandbox ended: cut short, it says nothing of determinism.
    assert _compare(replay, (11.0, 11), "terminated") == (None, None)
    replay.reason = "truncated"
    assert _compare(replay, (11.0, 11), "terminated")[0] is False


def test_a_failure_at_an_episodes_first_step_is_no_recording_shortfall():
    """An episode the policy broke at step 0 has no trajectory rows: counted as missing, it
    made the evaluation a harness fault (exit 3) with "no reason was given"."""
    table = _table(refuses_some_starts)
    chosen = choose_episodes(table, 3, seed=0)
    zero_step = [r["episode_index"] for r in table.to_pylist()
                 if r["end_reason"] == "policy_error" and r["length"] == 0]
    assert set(zero_step) & set(chosen), (zero_step, chosen)
    episodes, expected, ends = replay_inputs(table, chosen)
    policy = LoadedPolicy(refuses_some_starts, spaces.Discrete(2), is_torch=False,
                          deterministic=True, device="cpu")
    result = record_episodes(ENV, {}, None, policy, episodes, video_dir=None, trajectories=True,
                             expected=expected,
                             end_reasons=ends, trajectories_for=chosen)
    assert sorted(result.trajectory_episodes) == sorted(chosen) and result.reproducible
    request = EvalRequest(env=ENV, policy="x:y", episodes=50, record_trajectories=3)
    assert recording_shortfall(request, table, 0, len(result.trajectory_episodes), []) is None


def test_only_a_module_whose_files_now_say_another_version_counts_as_edited():
    """A distribution's name that is no module (``my-pkg``) reads "unknown" now: counted as an
    edit, it would turn a real ``replay_nondeterminism`` into a note."""
    from evalfleet.pipeline import edited_since
    from evalfleet.provenance import code_version

    gym_now = code_version("gymnasium")[1]
    assert edited_since({"my-pkg": "1.0", "gymnasium": gym_now, "numpy": "unknown"}) == []
    assert edited_since({"gymnasium": "0.0.1"}) == ["gymnasium"]
