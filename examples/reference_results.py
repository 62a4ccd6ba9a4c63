"""Evaluate each use-case env's reference policies with evalfleet (the README's table)."""

from __future__ import annotations

import sys

from evalfleet.models import EvalRequest
from flows.eval import evaluate
from flows.runtime import prefect_api

CASES = [
    ("evalfleet/Recommend-v0", "recommend_random"),
    ("evalfleet/Recommend-v0", "recommend_heuristic"),
    ("evalfleet/Inventory-v0", "inventory_random"),
    ("evalfleet/Inventory-v0", "inventory_heuristic"),
    ("evalfleet/ConnectFour-v0", "connect_four_random"),
    ("evalfleet/ConnectFour-v0", "connect_four_heuristic"),
]


def main(episodes: int = 1000, output: str = "results/reference") -> None:
    print("| env | policy | episodes | mean return [95% CI] | success rate [95% CI] |")
    print("|---|---|---:|---|---|")
    with prefect_api():
        for env, policy in CASES:
            r = evaluate(EvalRequest.build(env=env, policy=f"envs.reference_policies:{policy}",
                                           episodes=episodes, concurrency=500, output=output))
            low, high = r.ci
            s = r.success
            succ = f"{s['rate']:.3f} [{s['ci']['low']:.3f}, {s['ci']['high']:.3f}]" if s else "n/a"
            print(f"| `{env}` | `{policy}` | {r.episodes} | {r.mean:.2f} [{low:.2f}, {high:.2f}] | {succ} |",
                  flush=True)


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
