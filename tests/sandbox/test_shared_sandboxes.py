"""Several envs per sandbox (``envs_per_sandbox`` > 1): the results must not depend on it.

A sandbox steps its envs one after another, and its death ends all of their episodes: neither
may cost an env that did nothing wrong its episode.
"""

from __future__ import annotations

from evalfleet.sandbox.limits import SandboxLimits

from . import faulty_envs as fe
from .test_process_slots import outcomes, run_direct


def test_step_timeout_bounds_each_env_step_not_the_sandbox_batch() -> None:
    # Each step takes at most 0.3 s, under the 0.5 s bound; four per sandbox took 1.2 s a request
    # and every episode ended as ``timeout`` (0 of 4 scored, 4 of 4 alone).
    limits = SandboxLimits(step_timeout_s=0.5)
    alone, _ = run_direct("process", fe.env_id("Sluggish"), 4, 4, k=1, limits=limits)
    shared, _ = run_direct("process", fe.env_id("Sluggish"), 4, 4, k=4, limits=limits)
    reference, _ = run_direct("inprocess", "CartPole-v1", 4, 4)
    assert all(r.end_reason in ("terminated", "truncated") for r in shared), [
        (r.end_reason, r.error) for r in shared]
    assert outcomes(shared) == outcomes(alone) == outcomes(reference)


def test_an_env_past_its_step_timeout_ends_alone_in_a_shared_sandbox() -> None:
    # The faulty seeds' step 5 takes 0.8 s, past the 0.5 s bound: their episodes time out (the
    # first attempt on its own timing, the retries alone in a sandbox, killed at the bound);
    # their neighbours, whose steps took no time, keep theirs. (Two slow envs in one sandbox
    # overrun its deadline, killing it: their neighbour's retry is then not charged.)
    records, _ = run_direct("process", fe.env_id("Sleepy"), 18, 6, k=3,
                            limits=SandboxLimits(step_timeout_s=0.5))
    reference, _ = run_direct("inprocess", "CartPole-v1", 18, 6)
    faulty = [r for r in records if fe.is_faulty(r.seed)]
    assert faulty
    for r in faulty:
        assert (r.end_reason, r.length) == ("timeout", fe.FAULT_STEP - 1), (r.end_reason, r.error)
        assert "0.5 s" in (r.error or "")
    healthy = [i for i, r in enumerate(records) if not fe.is_faulty(r.seed)]
    assert outcomes([records[i] for i in healthy]) == outcomes([reference[i] for i in healthy])
    assert all(records[i].retried <= 1 for i in healthy)


def test_a_crashing_env_costs_its_neighbours_no_episode() -> None:
    # 40 episodes, 8 slots, 4 per sandbox: the segfaulting seeds' sandboxes die with 3 healthy
    # episodes each. Their retries ran together in the freed slots of one fresh sandbox with the
    # crasher's retry, died with it, and 9 healthy episodes ended ``crashed`` (70% coverage).
    records, _ = run_direct("process", fe.env_id("Segfault"), 40, 8, k=4)
    reference, _ = run_direct("inprocess", "CartPole-v1", 40, 8)
    crashed = {r.episode_index for r in records if r.end_reason == "crashed"}
    faulty = {r.episode_index for r in records if fe.is_faulty(r.seed)}
    assert faulty and crashed == faulty
    for r in records:
        if r.episode_index in faulty:
            # The first attempt shared its sandbox (not charged), then the budget of 2, alone.
            assert (r.retried, r.length) == (3, fe.FAULT_STEP - 1)
    healthy = [i for i, r in enumerate(records) if i not in faulty]
    assert outcomes([records[i] for i in healthy]) == outcomes([reference[i] for i in healthy])
    assert all(records[i].retried <= 1 for i in healthy)
