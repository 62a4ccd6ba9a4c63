"""Measure the reference scores of examples/suite.toml: each task's random and heuristic policy.

Prints one ``normalise`` table per task (random = score 0, heuristic = score 1), in suite order,
to paste into the suite file. Usage: python examples/suite_references.py [EPISODES] [OUTPUT]
"""

from __future__ import annotations

import sys

from evalfleet.models import EvalRequest
from evalfleet.suite import load_suite
from flows.suite import evaluate_suite


def main(episodes: int = 1000, output: str = "results/suite-references") -> None:
    suite = load_suite("examples/suite.toml")
    suite = suite.model_copy(update={"tasks": [
        t.model_copy(update={"episodes": episodes, "normalisation": None}) for t in suite.tasks]})
    report = evaluate_suite(suite, EvalRequest.build(
        policy="envs.suite_policies:heuristic", baseline="envs.suite_policies:random",
        output=output, seed=0, concurrency=500))
    assert report.baseline is not None
    for task, random in zip(report.tasks, report.baseline["task_means"], strict=True):
        print(f"# {task['name']}: {episodes} episodes, seed 0")
        print(f"normalise = {{ random = {random:.4f}, reference = {task['mean_return']:.4f} }}")


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
