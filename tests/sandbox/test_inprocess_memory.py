"""An in-process env's MemoryError is what a sandbox's is: ``oom``, retried, never cached."""

from __future__ import annotations

from pathlib import Path

from evalfleet.cache import EpisodeCache
from evalfleet.records import records_to_table

from . import faulty_envs as fe
from .test_process_slots import outcomes, run_direct


def test_an_inprocess_memory_error_is_oom_retried_and_not_cached(tmp_path: Path) -> None:
    # It was an ``env_error`` (deterministic for its seed): stored, and served as a hit ever
    # after, a transient allocation failure made a permanent exclusion.
    records, _ = run_direct("inprocess", fe.env_id("RaiseMemoryError"), 20, 4)
    reference, _ = run_direct("inprocess", "CartPole-v1", 20, 4)
    faulty = [r for r in records if fe.is_faulty(r.seed)]
    assert faulty
    for r in faulty:
        assert (r.end_reason, r.retried, r.length) == ("oom", 2, fe.FAULT_STEP - 1)
        assert "MemoryError: planted" in (r.error or "") and "worker process" in (r.error or "")
    healthy = [i for i, r in enumerate(records) if not fe.is_faulty(r.seed)]
    assert outcomes([records[i] for i in healthy]) == outcomes([reference[i] for i in healthy])
    cache = EpisodeCache(tmp_path)
    assert cache.store("m" * 64, records_to_table(records), {}) == len(healthy)
    assert cache.lookup("m" * 64, range(20)).missing == sorted(r.episode_index for r in faulty)
