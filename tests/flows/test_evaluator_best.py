"""``Evaluator.best_step`` is what the latest result's history says, never an older best kept."""

from __future__ import annotations

import pytest
import torch

from evalfleet.client import Evaluator
from flows.local_runner import LocalFlowRunner

pytestmark = pytest.mark.slow


def mlp() -> torch.nn.Module:
    """A CartPole policy (module level: the state_dict's factory)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _model(seed: int) -> torch.nn.Module:
    m = mlp()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return m


def test_best_step_is_none_once_the_latest_result_establishes_no_best(prefect_server, tmp_path):
    """Planted: step 1 is evaluated again with other weights (a re-send with fixed weights). The
    history then holds two policies at step 1: no verdict, no best (``history_step_ambiguous``).
    ``best_step`` still said 1, the best the history no longer stood by."""
    with Evaluator(env="CartPole-v1", policy_factory=mlp, num_episodes=12, concurrency=12,
                   output=tmp_path / "out", runner=LocalFlowRunner(workers=1),
                   training_run_id="best-run") as ev:
        first = ev.evaluate(_model(1), step=1)
        assert first["eval/verdict"] == "first" and first["eval/best_step"] == 1
        assert ev.best_step == 1 and ev.best_policy_sha256 == first["report"].policy_sha256

        again = ev.evaluate(_model(2), step=1)
        assert again["report"].policy_sha256 != first["report"].policy_sha256
        assert again["eval/verdict"] == "no_paired_episodes"
        assert "history_step_ambiguous" in again["eval/alarms"]
        assert again["eval/best_step"] is None and again["eval/best_policy_sha256"] is None
        assert ev.best_step is None and ev.best_policy_sha256 is None
