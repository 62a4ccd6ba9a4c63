"""The per-episode CPU budget holds against env code that lifts its own RLIMIT_CPU.

The budget was only the sandbox's soft RLIMIT_CPU, set from inside it under an unlimited hard
limit: env code raised it back to infinity and burned CPU without end. The worker now reads the
sandbox's CPU time from outside (its fork server, ``/proc``) and ends the episode as ``timeout``.
"""

from __future__ import annotations

import pytest

from evalfleet.sandbox.isolation import available_levels
from evalfleet.sandbox.limits import SandboxLimits

from . import faulty_envs as fe
from .test_process_slots import run_direct

LEVELS = [lvl for lvl in ("process", "bwrap") if available_levels()[lvl] is None]


@pytest.mark.parametrize("level", LEVELS)
def test_an_env_that_lifts_its_cpu_limit_still_ends_at_its_budget(level: str) -> None:
    records, _ = run_direct(level, fe.env_id("LiftCpu"), 1, 1,
                            limits=SandboxLimits(cpu_seconds_per_episode=1))
    [record] = records
    assert record.end_reason == "timeout", (record.end_reason, record.length, record.metrics)
    assert "CPU time in its episode, past its budget of 1 s" in (record.error or ""), record.error
    assert record.length < 100
