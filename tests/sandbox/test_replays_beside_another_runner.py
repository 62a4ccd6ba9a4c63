"""Stage 7's sandboxed replays beside another runner of the same process, and replays cut short.

Two ``Evaluator``s in one process share its fork servers. ``shutdown()`` of one stopped all of
them, so the other's replay ended ``crashed`` mid-episode; that was compared with its row as a
``replay_nondeterminism`` finding, and the correct cache entry was dropped. Now a runner's close
stops only the servers no open slots use, and a replay a clock or the harness ended is not
compared: it is a recording that is not whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from evalfleet.envspec import resolve_env
from evalfleet.policy import LoadedPolicy
from evalfleet.replay import ReplaySandbox, record_episodes
from evalfleet.sandbox import forkclient
from evalfleet.sandbox.isolation import resolve_isolation

from . import faulty_envs as fe

MAX_STEPS = 200


def _policy(fn: Any = fe.balance) -> LoadedPolicy:
    return LoadedPolicy(fn, spaces.Discrete(2), is_torch=False, deterministic=True, device="cpu")


def _sandbox(env_id: str) -> ReplaySandbox:
    try:
        resolve_isolation("process")
    except Exception as err:  # this machine has no process sandboxes: nothing to replay in
        pytest.skip(f"process isolation unavailable: {err}")
    env = resolve_env(env_id, {}, MAX_STEPS)
    return ReplaySandbox("process", 60.0, env.fingerprint.as_dict(), obs_shape=(4,))


def _recorded(seed: int) -> tuple[list[tuple[int, int]], dict[int, tuple[float, int]], dict[int, str]]:
    """(episodes, expected, end reasons) of CartPole-v1 under ``balance``, replayed here."""
    here = record_episodes("CartPole-v1", {}, MAX_STEPS, _policy(), [(0, seed)], video_dir=None,
                           trajectories=False)
    [ep] = here.episodes
    assert ep.end_reason in ("terminated", "truncated") and ep.length > 30
    return [(0, seed)], {0: (ep.episode_return, ep.length)}, {0: ep.end_reason}


def test_another_runners_close_leaves_this_replays_sandbox_running() -> None:
    from flows.local_runner import LocalFlowRunner

    episodes, expected, reasons = _recorded(11)
    calls = []

    def act_then_close_the_other_runner(obs: np.ndarray) -> np.ndarray:
        calls.append(1)
        if len(calls) == 20:  # mid-episode, the other Evaluator of this process shuts down
            LocalFlowRunner(workers=1).close()
        return fe.balance(obs)

    there = record_episodes("CartPole-v1", {}, MAX_STEPS, _policy(act_then_close_the_other_runner),
                            episodes, video_dir=None, trajectories=True,
                            expected=expected, end_reasons=reasons, sandbox=_sandbox("CartPole-v1"))
    [ep] = there.episodes
    # Before: "replayed 19.0 over 19 steps (crashed), recorded ... (truncated)", a mismatch.
    assert there.mismatches == ()
    assert (ep.end_reason, ep.length, ep.episode_return, ep.matches) == (
        reasons[0], expected[0][1], expected[0][0], True), ep.error
    assert len(calls) == expected[0][1] and there.interrupted == {}
    assert there.trajectory_episodes == (0,) and there.trajectories.num_rows == expected[0][1]
    # Its slots closed, the server is unused: the next close stops it.
    assert forkclient._servers
    forkclient.shutdown_unused_fork_servers()
    assert not forkclient._servers


def test_a_replay_the_harness_ended_is_no_determinism_finding() -> None:
    # Planted: the recorded episode (seed 3) ended normally; its replay's sandbox is killed by
    # SIGSEGV at step 5 (``Segfault`` is CartPole that does so on seeds 3 mod 10). Before, the
    # crash was a mismatch: replay_nondeterminism, and the cache entry dropped.
    seed = 3
    assert fe.is_faulty(seed)
    episodes, expected, reasons = _recorded(seed)
    result = record_episodes(fe.env_id("Segfault"), {}, MAX_STEPS, _policy(), episodes,
                             video_dir=None, trajectories=True, expected=expected,
                             end_reasons=reasons, sandbox=_sandbox(fe.env_id("Segfault")))
    [ep] = result.episodes
    assert (ep.end_reason, ep.length) == ("crashed", fe.FAULT_STEP - 1)
    assert result.mismatches == () and ep.matches is None
    assert list(result.interrupted) == [0]
    assert result.interrupted[0].startswith(f"its replay ended crashed at step {fe.FAULT_STEP - 1}: ")
    assert result.interrupted[0].endswith(f"(the harness, not the env; recorded {reasons[0]}): "
                                          "not compared, no recording")
    # Not a whole trajectory: none is counted (the review's recording_incomplete says why).
    assert result.trajectory_episodes == () and result.trajectories.num_rows == 0
    assert [n for n in result.notes() if n.startswith("episode 0 not replayed whole: ")]
    # A recorded crash replayed as one is what was asked to see: kept, not compared, as before.
    crashed = record_episodes(fe.env_id("Segfault"), {}, MAX_STEPS, _policy(), episodes,
                              video_dir=None, trajectories=True, expected=expected,
                              end_reasons={0: "crashed"}, sandbox=_sandbox(fe.env_id("Segfault")))
    assert crashed.interrupted == {} and crashed.trajectory_episodes == (0,)
