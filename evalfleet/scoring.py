"""Which episodes count in the headline: the one rule every statistic and comparison applies.

- *Completed* episodes (``terminated``, ``truncated``) count with their return.
- *Policy-attributable* failures (``invalid_action``, ``policy_error``, ``policy_timeout``) are
  what the evaluated policy produced: they count in every headline figure with their return up to
  the end (the row's ``return``, a partial sum), their length up to the end, and ``success`` false.
  Leaving them out would reward a policy for breaking on its hardest seeds.
- *Harness* failures (``timeout``, ``crashed``, ``oom``, ``env_error``, ``invalid_reward`` and any
  reason this version does not know) say nothing about the policy: they are left out, and the
  report states ``coverage`` = scored episodes / planned episodes.

A policy-attributable row whose return is not a finite number cannot be scored (the runner records
the partial sum, and NaN for an episode a hung forward left unstarted, length 0): it is left out
of the scored episodes, so coverage drops, and ``aggregate`` raises an alarm naming how many.
Where rewards are negative, a partial return flatters: ``report.flattering_failures`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from evalfleet.models import EndReason

__all__ = ["Outcomes", "outcomes", "row_kinds", "scored_returns"]

BoolArray = npt.NDArray[np.bool_]


def _kind(reason: str) -> str:
    try:
        r = EndReason(reason)
    except ValueError:  # an unknown reason is neither a normal ending nor the policy's doing
        return "harness"
    if not r.is_failure:
        return "completed"
    return "policy" if r.is_policy_attributable else "harness"


@dataclass(frozen=True)
class Outcomes:
    """Per-row masks of one episode table, in the table's row order."""

    completed: BoolArray
    """The episode terminated or was truncated."""
    policy: BoolArray
    """The episode ended by a failure the policy caused (it still counts in the headline)."""
    harness: BoolArray
    """The episode ended by a failure of the env, the sandbox or the infrastructure (left out)."""
    scored: BoolArray
    """The episode counts in the headline: completed, or policy-attributable with a finite return."""

    @property
    def planned(self) -> int:
        """Episodes in the table: every planned episode has a row, failures included."""
        return int(self.completed.size)

    @property
    def unscorable(self) -> BoolArray:
        """Policy-attributable rows without a finite return (never produced by this runner)."""
        return self.policy & ~self.scored

    @property
    def coverage(self) -> float:
        """Scored episodes / planned episodes (1.0 for an empty table: nothing was left out)."""
        return int(self.scored.sum()) / self.planned if self.planned else 1.0


def row_kinds(reasons: pa.ChunkedArray | pa.Array) -> npt.NDArray[np.object_]:
    """Per row, ``"completed"``, ``"policy"`` or ``"harness"``: its end reason's kind.

    Each distinct reason is classified once and the rows look theirs up (a table holds a
    handful of reasons over up to millions of rows). A null or unknown reason is ``"harness"``.
    """
    distinct = pc.unique(reasons)
    kinds = np.array([_kind(r) for r in distinct.to_pylist()] + ["harness"], dtype=object)
    where = pc.index_in(reasons, value_set=distinct, skip_nulls=False)
    picked: npt.NDArray[np.object_] = kinds[np.asarray(
        pc.fill_null(where, len(distinct)).to_numpy(zero_copy_only=False), dtype=np.intp)]
    return picked


def outcomes(table: pa.Table) -> Outcomes:
    """Classify every row of an episode table (columns ``end_reason`` and ``return``)."""
    kinds = row_kinds(table.column("end_reason"))
    returns = np.asarray(table.column("return").to_numpy(zero_copy_only=False), dtype=np.float64)
    completed = kinds == "completed"
    policy = kinds == "policy"
    return Outcomes(
        completed=completed,
        policy=policy,
        harness=kinds == "harness",
        scored=completed | (policy & np.isfinite(returns)),
    )


def scored_returns(table: pa.Table) -> npt.NDArray[np.float64]:
    """Returns of the scored episodes (completed and policy-attributable), in row order."""
    returns: npt.NDArray[Any] = np.asarray(
        table.column("return").to_numpy(zero_copy_only=False), dtype=np.float64
    )
    return returns[outcomes(table).scored]
