"""Frequentist check of the reported 95% interval of the mean: simulate many evaluations of a
known return distribution and count how often the interval covers the true mean.

Two procedures, both exactly the production code:

* fixed n: ``mean_ci`` with its default method (what ``summarize`` and the report use);
* adaptive: ``RoundSchedule.observe`` looks after every round, stops when the half-width is at
  most the target, and ``RoundSchedule.interval`` is what the report shows.

Four return shapes of issue 13 (0/1 with p = 0.1, 50 + Exponential(40), a 0/500 bimodal at
p = 0.5 and at p = 0.1, normal) with first rounds of 16 and 32 episodes; for the adaptive
procedure also the 0/500 bimodal at p = 0.1 with N(0, 0.01) jitter on every return (a sparse
reward plus a little noise: 16 episodes without a 500 have spread and a narrow interval, and the
schedule stopped there in 21% of runs, covering 79%, until it needed ``min_stop_episodes``).

Pass rule, per case, over ``SIMULATIONS = 2,000`` evaluations (standard error ~0.5 point): the
coverage is at least 94% AND the lower bound of its one-sided 99% Wilson interval is at least
92.5%. A procedure whose true coverage is 91.5% (the old percentile bootstrap at n ~ 20) passes
the second test with probability below 1e-4; one at 94.5% fails it with probability below 1%.

``python tests/core/test_stats_coverage.py`` prints every cell (the README's table).

The 0/500 bimodal at p = 0.1 declares its bounds (0, 500) in the fixed-n case: 18.5% of 16-episode
samples are all 0, and only a declared range says how far above 0 the mean can be (without it the
interval of a constant sample assumes a scale of max(1, |value|), which covers the 0/1 case).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from evalfleet.audit import RoundSchedule
from evalfleet.models import EvalRequest
from evalfleet.stats import mean_ci

SIMULATIONS = 2_000
MAX_EPISODES = 2_000
Z99 = 2.3263478740408408  # one-sided 99%

Draw = Callable[[np.random.Generator, int], np.ndarray]

# name -> (draw, true mean, declared bounds for the fixed-n interval, adaptive target half-width)
SHAPES: dict[str, tuple[Draw, float, tuple[float, float] | None, float]] = {
    "bernoulli-0.1": (lambda g, n: (g.random(n) < 0.1).astype(float), 0.1, None, 0.05),
    "50+exp(40)": (lambda g, n: 50.0 + g.exponential(40.0, n), 90.0, None, 6.0),
    "bimodal-0/500-p0.5": (lambda g, n: 500.0 * (g.random(n) < 0.5), 250.0, None, 40.0),
    "bimodal-0/500-p0.1": (lambda g, n: 500.0 * (g.random(n) < 0.1), 50.0, (0.0, 500.0), 25.0),
    "normal(100,20)": (lambda g, n: g.normal(100.0, 20.0, n), 100.0, None, 3.0),
}
CASES = [(shape, first) for shape in SHAPES for first in (16, 32)]
#: Adaptive only: a fixed n of 16 from this shape sees no 500 in 18.5% of samples, and a fixed-n
#: interval cannot know (its documented limit); an adaptive run can go on until it could have.
JITTERED = "bimodal-0/500-p0.1+N(0,0.01)"
SHAPES[JITTERED] = (lambda g, n: 500.0 * (g.random(n) < 0.1) + g.normal(0.0, 0.01, n), 50.0, None,
                    25.0)
ADAPTIVE_CASES = [*CASES, (JITTERED, 16), (JITTERED, 32)]
#: Most a fixed-n interval may cover ("not absurdly wide"). Two-valued samples get the hull of
#: Clopper-Pearson and the t interval, which stays valid when a sample shows two values of a wider
#: support; on returns that really are 0/1 at p = 0.1 that costs width on the lower side: exact
#: binomial coverage 99.67% at n = 16 and 32 (Clopper-Pearson alone 98.3% and 98.8%).
MAX_FIXED_COVERAGE: dict[str, float] = {"bernoulli-0.1": 0.999, "bimodal-0/500-p0.1": 0.999}


def wilson_lower(covered: int, n: int, z: float = Z99) -> float:
    """One-sided Wilson lower bound of a proportion."""
    p = covered / n
    center = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (center - spread) / (1 + z * z / n)


def fixed_coverage(shape: str, n: int) -> float:
    draw, mu, bounds, _ = SHAPES[shape]
    covered = 0
    for i in range(SIMULATIONS):
        x = draw(np.random.default_rng([13, n, i]), n)
        ci = mean_ci(x, seed=i, bounds=bounds)
        covered += ci.low <= mu <= ci.high
    return covered / SIMULATIONS


def adaptive_coverage(shape: str, first: int) -> tuple[float, float, int]:
    """Coverage of the adaptive report's interval, and the mean and fewest episodes it used."""
    draw, mu, _, target = SHAPES[shape]
    request = EvalRequest.build(policy="x.pt", episodes=first, target_ci_halfwidth=target,
                                max_episodes=MAX_EPISODES)
    covered, episodes, fewest = 0, 0, MAX_EPISODES
    for i in range(SIMULATIONS):
        # Episode i's return is fixed whatever round runs it, as with the seed ledger.
        x = draw(np.random.default_rng([7, first, i]), MAX_EPISODES)
        schedule = RoundSchedule(request.model_copy(update={"seed": i}))
        n = schedule.next_episodes(None)
        while n is not None:
            last, n = n, schedule.observe(x[:n], n)
        assert schedule.interval is not None
        covered += schedule.interval.low <= mu <= schedule.interval.high
        episodes += last
        fewest = min(fewest, last)
    return covered / SIMULATIONS, episodes / SIMULATIONS, fewest


def check(coverage: float, what: str) -> None:
    covered = round(coverage * SIMULATIONS)
    lower = wilson_lower(covered, SIMULATIONS)
    assert coverage >= 0.94 and lower >= 0.925, (
        f"{what}: coverage {coverage:.4f} (one-sided 99% lower bound {lower:.4f}) below 94%"
    )


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "n"), CASES)
def test_fixed_n_interval_covers_at_least_94_percent(shape: str, n: int) -> None:
    coverage = fixed_coverage(shape, n)
    check(coverage, f"fixed n={n} {shape}")
    # Not absurdly wide either.
    assert coverage <= MAX_FIXED_COVERAGE.get(shape, 0.995), f"fixed n={n} {shape}: coverage {coverage:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "first"), ADAPTIVE_CASES)
def test_adaptive_interval_covers_at_least_94_percent(shape: str, first: int) -> None:
    coverage, _, _ = adaptive_coverage(shape, first)
    check(coverage, f"adaptive first round {first} {shape}")


@pytest.mark.slow
@pytest.mark.parametrize("first", [16, 32])
def test_adaptive_run_on_near_constant_returns_waits_for_the_rare_large_one(first: int) -> None:
    # 80.3% (first round 16) and 96.8% (32) when a stop was accepted at any count: a fifth of the
    # runs from 16 stopped on their first look, before any 500 had come.
    coverage, _, fewest = adaptive_coverage(JITTERED, first)
    assert coverage >= 0.95, f"adaptive first round {first} {JITTERED}: coverage {coverage:.4f}"
    from evalfleet.audit import max_looks, min_stop_episodes  # (the script runs on older code too)

    assert fewest >= min_stop_episodes(max_looks(first, MAX_EPISODES))  # 99 (16 first), 97 (32)


if __name__ == "__main__":  # the README's table: python tests/core/test_stats_coverage.py
    print("| returns | first round | fixed n | adaptive (mean episodes) |")
    for shape, first in ADAPTIVE_CASES:
        fixed = f"{fixed_coverage(shape, first):.1%}"  # (not asserted for the jittered shape)
        coverage, episodes, _ = adaptive_coverage(shape, first)
        print(f"| {shape} | {first} | {fixed} | {coverage:.1%} ({episodes:.0f}) |")
