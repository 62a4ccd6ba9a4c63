"""Only tables the determinism checks vouch for are served again, through the real flow.

A table whose replays differ from their rows is dropped from the cache: the determinism audit
re-ran two episodes whose seeds happened to be clean and passed, the store came before the
replays, and the next request was a clean hit whose report had lost ``replay_nondeterminism``.
An entry stored by a ``--no-audit`` run is audited when an audited request is answered from it,
not served as audited with ``determinism_audit_incomplete`` as its only sign.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evalfleet.audit import audit_sample
from evalfleet.errors import OutputsMissing
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import episode_cache, lookup, receive, received_before_flow
from evalfleet.seeds import SeedLedger
from flows.eval import evaluate
from flows.local_runner import LocalFlowRunner
from tests.core import rng_envs

pytestmark = pytest.mark.slow

EPISODES = 32
POLICY = "tests.flows.user_envs:toward_goal"


def _noisy_beyond_the_audit(tmp_path: Path, **fields: object) -> EvalRequest:
    """An env reproducible exactly on the seeds the audit re-runs (one worker, one instance each)."""
    audited = audit_sample(list(range(EPISODES)), 0, reused=[])
    clean = [SeedLedger(0).seed(i) for i in audited]
    return EvalRequest.build(env=rng_envs.env_id("NoisyBeyond"), env_kwargs={"clean": clean},
                             policy=POLICY, episodes=EPISODES, workers=1, concurrency=EPISODES,
                             isolation="inprocess", output=tmp_path / "out", **fields)


def _alarmed(report: EvalReport, name: str) -> bool:
    return any(a.startswith(f"{name}: ") for a in report.alarms)


def test_a_table_its_replays_prove_irreproducible_is_not_served_again(prefect_server, tmp_path):
    request = _noisy_beyond_the_audit(tmp_path)
    first = evaluate(request)
    assert first.audit == {"checked": 2, "mismatches": []}  # the audit saw clean seeds only
    assert _alarmed(first, "replay_nondeterminism"), first.alarms
    assert lookup(request, receive(request)).status == "miss"  # nothing of it was kept
    again = evaluate(request.model_copy(update={"request_id": "again"}))
    assert again.cache["status"] == "miss" and again.cache["reused"] == 0, again.cache
    assert _alarmed(again, "replay_nondeterminism"), again.alarms


def test_the_fast_path_drops_what_its_later_replays_prove_irreproducible(prefect_server, tmp_path):
    # The fast path stores its table before stage 7 replays it on the lane: the lane drops it.
    request = _noisy_beyond_the_audit(tmp_path)
    runner = LocalFlowRunner(workers=1)
    try:
        fast = runner(request)
        assert fast.cache["status"] == "miss" and not _alarmed(fast, "replay_nondeterminism")
        final = runner.final_report(fast.request_id)
        assert final is not None and _alarmed(final.result(timeout=300), "replay_nondeterminism")
        with pytest.raises(OutputsMissing, match="replay_nondeterminism"):
            runner.drain(300)
        assert lookup(request, receive(request)).status == "miss"
        again = runner(request.model_copy(update={"request_id": "again"}))
        assert again.cache["status"] == "miss", again.cache
    finally:
        try:
            runner.close()
        except OutputsMissing:  # the second evaluation's late alarm, as the first's above
            pass


def test_an_audited_request_audits_an_entry_a_no_audit_run_stored(prefect_server, tmp_path):
    # Rewards from the global RNG on every seed; review off, so no replay saw it either.
    request = EvalRequest.build(env=rng_envs.env_id("GlobalNoise"), policy=POLICY, episodes=16,
                                workers=1, isolation="inprocess", output=tmp_path / "out",
                                review=False)
    unaudited = evaluate(request.model_copy(update={"audit": False}))
    assert unaudited.cache["status"] == "miss" and unaudited.audit is None
    audited = evaluate(request.model_copy(update={"request_id": "audited"}))
    assert audited.audit is not None and audited.audit["checked"] == 2, audited.audit
    assert _alarmed(audited, "non_deterministic_env"), audited.alarms
    assert not _alarmed(audited, "determinism_audit_incomplete"), audited.alarms
    assert lookup(request, receive(request)).status == "miss"  # the entry it disproved is gone


def test_an_audited_request_keeps_the_audit_of_an_unaudited_entry_it_ran(prefect_server, tmp_path,
                                                                         example_policy):
    request = EvalRequest.build(policy=example_policy, episodes=16, workers=1,
                                output=tmp_path / "out", review=False)
    evaluate(request.model_copy(update={"audit": False}))
    assert received_before_flow(request)[1] is False  # not a hit: the audit must run
    audited = evaluate(request.model_copy(update={"request_id": "audited"}))
    assert audited.cache["status"] == "hit" and audited.cache["computed"] == 0
    assert audited.audit == {"checked": 2, "mismatches": []}
    assert not _alarmed(audited, "determinism_audit_incomplete"), audited.alarms
    cache = episode_cache(request)
    assert cache.audit(audited.cache["key"]) == audited.audit
    assert received_before_flow(request)[1] is True  # audited now: a hit starts no cluster
    hit = evaluate(request.model_copy(update={"request_id": "hit"}))
    assert hit.cache["status"] == "hit" and hit.audit == audited.audit
    assert hit.alarms == audited.alarms
