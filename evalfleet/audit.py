"""Adaptive rounds, harness audits and the paired comparison with a baseline (seeds 000, 004).

- Adaptive evaluation: run in rounds (first round = ``episodes``), adding the next ledger indices
  until the CI half-width of the mean is at most the target or ``max_episodes`` ran. Looking at
  the interval after every round and stopping when it is narrow enough inflates the miss rate
  of an unadjusted 95% interval (optional stopping: 79% coverage for 0/1 returns with p = 0.1), so
  each round at least doubles the episodes, which bounds the number of looks by
  ``K = 1 + ceil(log2(max_episodes / episodes))``, and every look uses the interval at level
  ``1 - 0.05 / K`` (Bonferroni): the reported interval, the one of the look that stopped, then
  misses the true mean with probability at most 5% whatever the stopping rule did. A look whose
  returns have no spread (all equal, up to float rounding) never stops early, and neither does one
  of fewer than ``min_stop_episodes(K)`` scored episodes: a near-constant sample (a sparse reward
  plus a little noise) that has not yet shown a rare large outcome has a narrow interval, and
  stopping on it covered 80% (0/500 at p = 0.1 with N(0, 0.01) jitter, first round 16).
- Determinism audit: a seeded sample of episodes (2%, at least 2) runs a second time on the
  cluster; any difference in return or length flags ``non_deterministic_env`` with the seeds.
- Reward integrity: identical returns across episodes of varying length flag a constant or gamed
  reward; many steps exactly on the extreme reward values, while other steps fall strictly
  between them, flag a clipped reward.
- Paired comparison: both policies on the same seeds (common random numbers); a verdict from
  ``stats.MIN_PAIRS`` pairs on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa

from evalfleet import stats
from evalfleet.models import FAILURE_ALARM_RATE, EndReason, EvalRequest, Shard
from evalfleet.scoring import outcomes, row_kinds, scored_returns
from evalfleet.summary import percent_beyond

AUDIT_FRACTION = 0.02
AUDIT_MIN = 2
#: More than this fraction of non-final steps exactly on the (non-zero) extreme rewards looks clipped...
CLIP_FRACTION = 0.2
#: ...when at least this fraction of them fall strictly between the extremes: a reward with only
#: two values (win/loss, a constant per-step cost) is not a clipped one.
CLIP_INTERIOR_MIN = 0.05


def _completed(table: pa.Table) -> np.ndarray[Any, np.dtype[np.bool_]]:
    return np.asarray(row_kinds(table.column("end_reason")) == "completed", dtype=bool)


def completed_returns(table: pa.Table) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Returns of the episodes that did not fail, in episode order (see ``scored_returns``)."""
    ok = _completed(table)
    returns: np.ndarray[Any, np.dtype[np.float64]] = np.asarray(
        table.column("return").to_numpy(), dtype=np.float64
    )[ok]
    return returns


#: Overall confidence level of the reported interval of the mean, fixed-n and adaptive.
LEVEL = 0.95


def max_looks(episodes: int, max_episodes: int) -> int:
    """Most looks an adaptive evaluation can take when every round at least doubles the episodes."""
    looks, n = 1, episodes
    while n < max_episodes:
        n, looks = 2 * n, looks + 1
    return looks


#: Rarest per-episode outcome an early stop must not miss: an adaptive run stops before
#: ``max_episodes`` only once it has scored enough episodes that an outcome of at least this
#: probability would have shown up but for a chance of ``0.05 / K`` (see ``min_stop_episodes``).
#: Rarer outcomes can still be missed by an early stop.
P_RARE = 0.05


def min_stop_episodes(looks: int) -> int:
    """Fewest scored episodes at a look that may stop early: ``ceil(log(0.05/K) / log(1 - P_RARE))``.

    ``K = looks``. An outcome of probability ``P_RARE`` or more is missing from that many
    episodes with probability at most ``0.05 / K``, the error each look's interval is allowed:
    16 returns of "0 plus noise" from a return that is 500 one time in ten gave an interval of
    width 0.03 around 0 (the mean is 50), and the run stopped there in a fifth of runs. 59
    episodes for one look, 99 for the 8 looks of 16 to 2,000.
    """
    return math.ceil(math.log((1.0 - LEVEL) / looks) / math.log1p(-P_RARE))


@dataclass
class RoundSchedule:
    """Decides how many episodes each round asks for, and records why it stopped.

    Adaptive requests get a Bonferroni-adjusted interval at every look (see the module docstring);
    ``interval`` is the one the report must show, at overall level 95%.
    """

    request: EvalRequest
    rounds: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = ""
    interval: stats.Interval | None = None
    """Adaptive only: the interval of the mean at the look that stopped (overall level 95%)."""

    @property
    def adaptive(self) -> bool:
        """True when the request asks for a target CI half-width."""
        return self.request.target_ci_halfwidth is not None

    @property
    def looks(self) -> int:
        """The most looks this schedule can take (1 for a fixed episode count)."""
        r = self.request
        return max_looks(r.episodes, r.max_episodes or r.episodes) if self.adaptive else 1

    @property
    def min_stop(self) -> int:
        """Fewest scored episodes at which the target may stop the run (``min_stop_episodes``)."""
        return min_stop_episodes(self.looks)

    @property
    def look_level(self) -> float:
        """Confidence level of each look's interval: ``1 - 0.05 / looks``."""
        return 1.0 - (1.0 - LEVEL) / self.looks

    def next_episodes(self, table: pa.Table | None) -> int | None:
        """Episodes the next round should cover in total, or None when done."""
        if table is None:
            return self.request.episodes
        return self.observe(scored_returns(table), table.num_rows)

    def observe(self, returns: np.ndarray[Any, np.dtype[np.float64]], n: int) -> int | None:
        """Record a look at the scored ``returns`` of the first ``n`` episodes; plan the next round.

        Pure decision logic (no table), so the coverage simulation runs exactly this.
        """
        r = self.request
        level = self.look_level
        interval = (
            stats.mean_ci(returns, seed=r.seed, level=level) if returns.size else None
        )
        # Values equal up to float rounding (0.1 + 0.2 among 0.3s) are no spread either.
        spread = stats.has_spread(returns)
        halfwidth = interval.halfwidth if interval is not None else math.inf
        self.rounds.append({
            "round": len(self.rounds) + 1, "episodes": n, "scored": int(returns.size),
            "halfwidth": halfwidth, "level": level,
            "mean": float(returns.mean()) if returns.size else math.nan,
            "low": interval.low if interval is not None else math.nan,
            "high": interval.high if interval is not None else math.nan,
            "went_on": None,  # why the run did not stop here (None at the last look)
        })
        if interval is not None and self.adaptive:
            self.interval = stats.Interval(
                interval.low, interval.high, LEVEL,
                f"{interval.method}, Bonferroni over {self.looks} looks "
                f"(per-look level {level:.6g})",
            )
        if r.target_ci_halfwidth is None:
            self.stop_reason = "fixed episode count"
            return None
        # An interval from returns with no spread says nothing about the spread to come; nor
        # does one from too few episodes to have seen an outcome of probability P_RARE.
        narrow = halfwidth <= r.target_ci_halfwidth
        if spread and narrow and returns.size >= self.min_stop:
            self.stop_reason = "target CI half-width reached"
            return None
        cap = r.max_episodes or n
        if n >= cap or len(self.rounds) >= self.looks:
            self.stop_reason = "max episodes reached"
            return None
        self.rounds[-1]["went_on"] = (
            "target CI half-width not reached" if not narrow
            else "no spread in the returns (they do not show the spread to come)" if not spread
            else f"minimum {self.min_stop} episodes before an early stop"
        )
        std = float(returns.std(ddof=1)) if spread else 0.0
        needed = stats.needed_episodes(std, r.target_ci_halfwidth, level) if std > 0 else 0
        # Aim 10% past the normal-approximation estimate; at least double (bounds the looks);
        # when only the minimum count kept the run going, the next look can stop.
        floor = self.min_stop if spread and narrow else 0
        return int(min(cap, max(math.ceil(needed * 1.1), 2 * n, floor)))

    def summary(self) -> dict[str, Any] | None:
        """The adaptive section of the report (None for a fixed-count evaluation)."""
        r = self.request
        if r.target_ci_halfwidth is None:
            return None
        last = self.rounds[-1] if self.rounds else {"halfwidth": math.nan}
        return {
            "target_halfwidth": r.target_ci_halfwidth,
            "max_episodes": r.max_episodes,
            "achieved_halfwidth": last["halfwidth"],
            "rounds": self.rounds,
            "stop_reason": self.stop_reason,
            "max_looks": self.looks,
            "per_look_level": self.look_level,
            "min_episodes_to_stop": self.min_stop,
            "ci": self.interval.to_dict() if self.interval is not None else None,
            "ci_rule": (
                "each look's interval at level 1 - 0.05/max_looks (Bonferroni; rounds at least "
                "double, so there are at most max_looks looks); the reported interval is the "
                "last look's and misses the true mean with probability at most 5%"
            ),
            "stop_rule": (
                f"no early stop below min_episodes_to_stop scored episodes, "
                f"ceil(log(0.05/max_looks) / log(1 - {P_RARE:g})): an outcome of probability "
                f"{P_RARE:g} or more would have shown up but for a chance of 0.05/max_looks; a "
                "rarer one can still be missed by an early stop"
            ),
        }


def audit_size(episodes: int) -> int:
    """How many of ``episodes`` the determinism audit re-runs: 2%, at least 2 (all, of fewer)."""
    return min(episodes, max(AUDIT_MIN, math.ceil(AUDIT_FRACTION * episodes)))


def audit_sample(indices: list[int], seed: int, reused: Sequence[int] = ()) -> list[int]:
    """The episodes the determinism audit re-runs: ``audit_size`` of them, seeded.

    ``reused``: episodes that ran on an env instance an earlier episode of their shard had used
    (``reused_instances``; for rows no shard of this run holds, ``reused_in_rows``). At least one
    of them is among those re-run, each on a fresh instance: an env that carries state from one
    episode to the next (a ``NormalizeObservation`` wrapper's running statistics) gives returns
    that depend on which episodes shared its instance, so on the concurrency and worker count,
    and that audit pair tells. A sample drawn from all indices alone missed them with a
    probability of up to 1 in 20.
    """
    if not indices:
        return []
    rng = np.random.default_rng([seed, 0xA0D17])
    picked = [int(i) for i in rng.choice(np.asarray(indices), size=audit_size(len(indices)),
                                         replace=False)]
    late = sorted(set(reused).intersection(indices))
    if late and not set(late).intersection(picked):
        picked[-1] = int(rng.choice(np.asarray(late)))
    return sorted(picked)


def reused_instances(shards: Sequence[Shard]) -> list[int]:
    """Episodes of ``shards`` that start on an env instance an earlier episode used.

    A shard's ``slots`` instances take its first ``slots`` episodes; each later one takes the
    instance an ended episode freed. (A worker may hand a shard's instances on to the request's
    next shard, ``worker.KeptSlots``: that one's first episodes then start on used instances
    too, so every episode listed here did.)
    """
    return [i for shard in shards for i in shard.episode_indices[shard.slots:]]


def reused_in_rows(table: pa.Table, per_sandbox: int = 1) -> list[int]:
    """Episodes of ``table`` that started on an env instance an earlier row's episode used.

    For rows whose shards are unknown here: rows an interrupted run persisted in shard files, or
    an entry stored with no audit. Rows of one ``(request_id, worker, sandbox)`` ran on the same
    instances (an in-process slot's ``inproc-N``, which ``worker.KeptSlots`` hands on to the
    request's next shard; a sandbox process's ``per_sandbox`` instances), each taking the next
    index as the one before it ended: every episode after the group's first (first
    ``per_sandbox`` for a sandbox) reset an instance an earlier one had used. A failure may have
    discarded the instance (an env error rebuilds the slot's env), so only episodes whose
    predecessor in the group ended normally are listed, and none whose own ending depends on the
    clock (the audit cannot compare it).
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in table.select(["request_id", "worker", "sandbox", "isolation", "episode_index",
                             "end_reason"]).to_pylist():
        groups.setdefault((row["request_id"], row["worker"], row["sandbox"]), []).append(row)
    out = []
    for rows in groups.values():
        rows.sort(key=lambda r: r["episode_index"])
        fresh = 1 if rows[0]["isolation"] == "inprocess" else max(1, per_sandbox)
        out += [row["episode_index"] for before, row in pairwise(rows[fresh - 1:])
                if not EndReason(before["end_reason"]).is_failure
                and not _timing_dependent(row["end_reason"])]
    return sorted(out)


def _timing_dependent(reason: str) -> bool:
    """An ending that depends on the clock or the machine, not on the env and the seed.

    Infrastructure failures, and ``policy_timeout``: a forward that did not return in time (its
    shard's unstarted episodes too, rows without a return) says nothing about the env's
    determinism, and its rerun may well finish.
    """
    r = EndReason(reason)
    return r.is_infrastructural or r is EndReason.POLICY_TIMEOUT


def determinism_audit(table: pa.Table, rerun: pa.Table) -> dict[str, Any]:
    """Compare re-run episodes with the originals: return, length and end reason must match.

    ``checked`` counts the pairs compared. A re-run that cannot be compared (an infrastructure
    failure or a policy timeout on either run says nothing about the env's determinism, or no
    original row) is
    counted in ``skipped``, present only when some were; ``determinism_audit_alarm`` speaks up
    when nothing was compared.
    """
    original = {r["episode_index"]: r for r in table.to_pylist()}
    mismatches = []
    checked = skipped = policy_timeouts = 0
    for row in rerun.to_pylist():
        first = original.get(row["episode_index"])
        if first is None or any(_timing_dependent(r["end_reason"]) for r in (first, row)):
            skipped += 1
            policy_timeouts += first is not None and EndReason.POLICY_TIMEOUT.value in (
                first["end_reason"], row["end_reason"])
            continue
        checked += 1
        if (first["return"], first["length"], first["end_reason"]) != (
            row["return"], row["length"], row["end_reason"]
        ):
            mismatches.append({
                "episode_index": row["episode_index"], "seed": row["seed"],
                "first": [first["return"], first["length"], first["end_reason"]],
                "rerun": [row["return"], row["length"], row["end_reason"]],
            })
    out: dict[str, Any] = {"checked": checked, "mismatches": mismatches}
    if skipped:
        out["skipped"] = skipped
    if policy_timeouts:  # of those skipped: the policy's forward, not the infrastructure
        out["skipped_policy_timeout"] = policy_timeouts
    return out


def determinism_audit_alarm(audit: dict[str, Any] | None) -> str | None:
    """``determinism_audit_incomplete`` when an audit was asked for and compared no episode."""
    if audit is None or audit["checked"] > 0:
        return None
    skipped = int(audit.get("skipped", 0))
    timeouts = int(audit.get("skipped_policy_timeout", 0))
    # A policy_timeout is the policy's forward not returning in time, not the infrastructure's.
    infra, ends = skipped - timeouts, []
    if infra:
        ends.append(f"{'' if infra == skipped else f'{infra} '}in an infrastructure failure "
                    "(timeout, crash, oom)")
    if timeouts:
        ends.append(f"{'' if timeouts == skipped else f'{timeouts} '}in a policy timeout (the "
                    "policy's forward did not return in time)")
    why = (f"all {skipped} re-run episodes ended {' and '.join(ends)} on one of the two runs"
           if skipped else "no episode was re-run")
    return (f"determinism_audit_incomplete: the determinism audit compared no episode ({why}); "
            "the env's determinism is unchecked: re-run the evaluation with --refresh, or look at "
            "the workers' failures first")


def step_rewards(table: pa.Table) -> dict[str, Any] | None:
    """Extremes of the per-step rewards of completed episodes' non-final steps, and their shares.

    Exact whatever the sharding: the extremes are the extremes of the episodes' extremes, and the
    steps on an extreme are summed over the episodes that reach it. None when no completed episode
    has a step before its last.
    """
    ok = _completed(table) & np.asarray(table.column("nonfinal_reward_min").is_valid(), dtype=bool)
    if not ok.any():
        return None
    lo = np.asarray(table.column("nonfinal_reward_min").to_numpy(zero_copy_only=False), dtype=float)[ok]
    hi = np.asarray(table.column("nonfinal_reward_max").to_numpy(zero_copy_only=False), dtype=float)[ok]
    at_lo = table.column("nonfinal_steps_at_min").to_numpy()[ok]
    at_hi = table.column("nonfinal_steps_at_max").to_numpy()[ok]
    steps = int((table.column("length").to_numpy()[ok] - 1).sum())
    gmin, gmax = float(lo.min()), float(hi.max())
    on_min, on_max = int(at_lo[lo == gmin].sum()), int(at_hi[hi == gmax].sum())
    between = steps - on_min - on_max if gmin < gmax else 0
    return {"steps": steps, "min": gmin, "max": gmax,
            "at_min_fraction": on_min / steps, "at_max_fraction": on_max / steps,
            "between_fraction": between / steps}


def clipped_reward_alarm(summary: dict[str, Any] | None) -> str | None:
    """``reward_clipped`` when many non-final steps sit exactly on a non-zero extreme reward.

    Zero is left out as a boundary: a reward that is 0 on most steps is a sparse reward, not a
    clipped one. The alarm asks to check, it does not prove clipping (a reward with a few discrete
    values between its extremes can raise it).
    """
    if summary is None or summary["min"] == summary["max"]:
        return None
    sides = [(side, summary[side], summary[f"at_{side}_fraction"]) for side in ("min", "max")
             if summary[side] != 0.0]
    on_boundary = sum(share for _, _, share in sides)
    if on_boundary <= CLIP_FRACTION or summary["between_fraction"] < CLIP_INTERIOR_MIN:
        return None
    where = " and ".join(f"{share:.1%} exactly the {side} {value!r}" for side, value, share in sides
                         if share > 0)
    return (
        f"reward_clipped: of {summary['steps']} non-final steps, {where}, while "
        f"{summary['between_fraction']:.1%} fall strictly between: the reward looks clipped at "
        f"[{summary['min']!r}, {summary['max']!r}]; evaluate on the unclipped reward (a clipped "
        "reward hides how much better or worse a policy is)"
    )


def reward_integrity(table: pa.Table) -> list[str]:
    """Alarms about the rewards themselves: constant returns over varying lengths, clipping."""
    alarms = []
    ok = _completed(table)
    returns = table.column("return").to_numpy()[ok]
    lengths = table.column("length").to_numpy()[ok]
    if returns.size >= 10 and np.all(returns == returns[0]) and len(np.unique(lengths)) > 1:
        alarms.append(
            f"constant_returns: all {returns.size} episodes returned exactly {returns[0]!r} although "
            f"their lengths range {lengths.min()}..{lengths.max()}: check the reward is not constant "
            "or gamed (expected only for sparse win/loss rewards when one side always wins)"
        )
    clipped = clipped_reward_alarm(step_rewards(table))
    if clipped is not None:
        alarms.append(clipped)
    return alarms


def compare_with_baseline(table: pa.Table, baseline: pa.Table, seed: int, source: str
                          ) -> dict[str, Any]:
    """Paired comparison over the episodes both policies were scored on, matched by index and seed.

    The headline rule of ``evalfleet.scoring`` applies to both sides: an episode a policy broke
    (invalid action, error or hang in its forward) counts with its partial return; a pair where
    either side has a harness failure (or no row for the index, or another seed) is dropped, and
    the result says how many pairs were dropped and why (``unmatched_pairs_alarm``). Below
    ``stats.MIN_PAIRS`` pairs the verdict is ``"too few pairs"``, with a ``note``.
    """
    def scored_rows(t: pa.Table) -> tuple[dict[int, dict[str, Any]], set[int]]:
        kinds = outcomes(t)
        rows = t.to_pylist()
        scored = {r["episode_index"]: r for r, ok in zip(rows, kinds.scored, strict=True) if ok}
        return scored, {r["episode_index"] for r, ok in zip(rows, kinds.scored, strict=True)
                        if not ok}

    new, new_lost = scored_rows(table)
    base, base_lost = scored_rows(baseline)
    indices = set(new) | new_lost
    harness = sorted(indices & (new_lost | base_lost))
    paired = [i for i in indices if i in new and i in base]
    common = sorted(i for i in paired if new[i]["seed"] == base[i]["seed"])
    accounting = {
        "dropped_harness_failures": len(harness),
        "dropped_harness_baseline": len(indices & base_lost),  # of those, the baseline's failures
        "dropped_harness_both": len(indices & base_lost & new_lost),  # of those, failed on both
        "dropped_unmatched": len(indices) - len(harness) - len(common),
        "policy_failures": {
            "new": sum(EndReason(new[i]["end_reason"]).is_policy_attributable for i in common),
            "baseline": sum(EndReason(base[i]["end_reason"]).is_policy_attributable for i in common),
        },
        "one_side_failed": _one_side_failed(common, new, base),
    }
    few = (f"{len(common)} paired episodes: a verdict needs at least {stats.MIN_PAIRS}"
           if len(common) < stats.MIN_PAIRS else None)
    if len(common) < 2:
        return {"baseline": source, "n": len(common), **accounting,
                "verdict": "too few pairs", "note": few}
    result = stats.paired_comparison(
        np.array([new[i]["return"] for i in common]), np.array([base[i]["return"] for i in common]),
        seed=seed,
    )
    out = dict(result.to_dict())
    out.update(accounting)
    out["baseline"] = source
    out["baseline_policy_sha256"] = baseline.column("policy_sha256")[0].as_py()
    if few is not None:
        out["note"] = few
    return out


def _one_side_failed(common: list[int], new: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]]
                     ) -> dict[str, Any]:
    """Pairs where one side's policy ended the episode and the other completed it.

    Per side: how many, and by how much its partial returns exceed the other side's full ones
    on them (``gain``, mean); and the mean difference over the pairs both completed.
    """
    def failed(row: dict[str, Any]) -> bool:
        return EndReason(row["end_reason"]).is_policy_attributable

    out: dict[str, Any] = {}
    for side, mine, other in (("new", new, base), ("baseline", base, new)):
        pairs = [i for i in common if failed(mine[i]) and not failed(other[i])]
        gains = [mine[i]["return"] - other[i]["return"] for i in pairs]
        out[side] = {"n": len(pairs), "gain": float(np.mean(gains)) if gains else None}
    both = [new[i]["return"] - base[i]["return"] for i in common
            if not failed(new[i]) and not failed(base[i])]
    out["both_completed"] = {"n": len(both), "mean_diff": float(np.mean(both)) if both else None}
    return out


def policy_pairs_alarm(comparison: dict[str, Any] | None, name: str = "baseline") -> str | None:
    """``{name}_pairs_policy_flatter`` when a side's policy failures score above the other's episodes.

    A failure counts with its partial return. On the pairs where only one side's policy ended
    the episode, that side is flattered when its partial returns average above the other side's
    full returns (negative rewards: ending early scores higher), and a policy that breaks on its
    hardest seeds comes out better than itself. Unpaired checks compare other seeds and miss it.
    """
    sides = (comparison or {}).get("one_side_failed") or {}
    flattered = [(side, sides[side]) for side in ("new", "baseline")
                 if (sides.get(side) or {}).get("n") and (sides[side].get("gain") or 0.0) > 0.0]
    if not flattered:
        return None
    who = {"new": "this policy", "baseline": f"{comparison.get('baseline')}"} if comparison else {}
    parts = "; ".join(f"on {d['n']} pairs where only {who[side]} was ended by its policy, its partial "
                      f"returns are {d['gain']:.4g} above the other side's full ones on average"
                      for side, d in flattered)
    both = sides.get("both_completed") or {}
    rest = (f"over the {both['n']} pairs both completed the mean difference is {both['mean_diff']:+.4g}"
            if both.get("n") else "no pair was completed by both")
    return (f"{name}_pairs_policy_flatter: {parts}: ending early scores higher here, so the paired "
            f"difference favours the side that breaks ({rest}); --gate does not pass it. Fix the "
            "policy's failures and evaluate again")


def harness_pairs_alarm(comparison: dict[str, Any] | None, name: str = "baseline") -> str | None:
    """``{name}_pairs_harness`` when harness failures dropped more than ``FAILURE_ALARM_RATE`` of the pairs.

    A pair whose episode the env, the sandbox or the infrastructure ended on either side is left
    out; the seeds it fails on are not random ones (an env that times out on its hardest seeds),
    so the difference over the rest may be biased. The evaluated run's own failures raise its
    ``harness_failures`` alarm too; the other side's (a baseline or best checkpoint evaluated
    earlier) showed nowhere but here.
    """
    if not comparison:
        return None
    k = int(comparison.get("dropped_harness_failures") or 0)
    planned = k + int(comparison.get("dropped_unmatched") or 0) + int(comparison.get("n") or 0)
    if not planned or k / planned <= FAILURE_ALARM_RATE:
        return None
    theirs = int(comparison.get("dropped_harness_baseline") or 0)
    both = int(comparison.get("dropped_harness_both") or 0)
    share = percent_beyond(k / planned, FAILURE_ALARM_RATE)
    return (f"{name}_pairs_harness: {k} of {planned} pairs ({share}; > "
            f"{FAILURE_ALARM_RATE:.0%}) were left out of the paired comparison with "
            f"{comparison.get('baseline')} because the harness failed on a side ({theirs - both} "
            f"on its run only, {k - theirs} on this one only, {both} on both: env errors, "
            "timeouts, crashes); the verdict "
            f"stands on the other {int(comparison.get('n') or 0)} pairs and may be biased: fix "
            "the failures and evaluate both on the same seeds again")


def unmatched_pairs_alarm(comparison: dict[str, Any] | None) -> str | None:
    """``baseline_pairs_unmatched`` when episodes were left out for want of a baseline row.

    An index the baseline lacks is not a random one: a table read from the episode cache lacks
    exactly the episodes the policy's runtime or the infrastructure ended, and pairing without
    them biases the difference. The caller makes sure such a table is never used; this alarm
    catches what gets through.
    """
    if not comparison or not comparison.get("dropped_unmatched"):
        return None
    k, n = int(comparison["dropped_unmatched"]), int(comparison.get("n", 0))
    return (f"baseline_pairs_unmatched: {k} episodes had no row of the baseline "
            f"({comparison.get('baseline')}) on the same index and seed and were left out of the "
            f"paired comparison ({n} pairs left): its verdict may be biased; evaluate the "
            "baseline on the same seeds and episode count (pass its policy file)")

