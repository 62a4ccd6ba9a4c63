"""Feed back across training: the evaluations of one training run over its steps.

Every evaluation with a ``training_run_id`` and a ``step`` is an MLflow run tagged with both
(``evalfleet.tracking``), with the cache key of its episodes and a protocol id (env spec, seed,
step cap, deterministic flag, and what the env sees of the environment: the cache key's
``environment`` ingredient): evaluations with the same protocol ran on the same seeds under the
same env inputs. Read back with MLflow's client (``checkpoints``), they give:

- **The verdict** of a new evaluation against the *best earlier checkpoint* of the run (the
  latest earlier one whose own verdict made it best, ``first`` or ``new_best``): both policies'
  episodes paired by index and seed (common random numbers; the earlier episodes come from the
  episode cache by the earlier run's key when it holds them all, else from its MLflow
  artifact), compared with ``audit.compare_with_baseline`` (``stats.paired_comparison``'s
  interval of the paired differences under the headline rules of ``scoring``). ``new_best``
  when the 95% CI of the paired difference of returns is above 0, ``regression`` when below,
  else ``not_distinguishable``; ``first`` for the first checkpoint of a run;
  ``no_paired_episodes`` when every earlier checkpoint was a harness fault (none is trusted to
  compare with), or when the best checkpoint's episodes are gone (not whole in the cache,
  which keeps no episode the policy's runtime or the infrastructure ended, and no artifact) or
  fewer than ``stats.MIN_PAIRS`` pairs remain: an alarm line (``alarm_lines``), and ``--gate``
  does not pass it.
- **Out of step order**: a checkpoint evaluated after later steps of its run were judged is
  judged against the earlier steps only, never tagged best, and raises ``history_out_of_order``
  naming the later steps (their verdicts were made without it). Each evaluation's MLflow run
  records which earlier steps its verdict read (``TAG_SEEN``, ``encode_steps``): a later step
  that was judged before an earlier one was logged, and logged after it, did not see it however
  the two were logged. While a checkpoint judged best
  that way sits below a higher best judged without it, which one is the run's best is undecided:
  later verdicts are ``no_paired_episodes`` with ``history_out_of_order`` until the higher steps
  are evaluated again (``unsettled_best``).
- **One step, two policies**: a step evaluated with different weights (``policy_sha256``)
  would be whichever evaluation finished last in the history. Its verdict and every later one
  are ``no_paired_episodes`` with ``history_step_ambiguous`` (``ambiguous_steps``) until the
  MLflow runs of the wrong weights are deleted. Re-evaluations of the same weights are retries.
- **Alarms** against the *previous* checkpoint (the largest earlier step), each with its
  statistic, threshold and the two steps compared:

  * ``reward_outcome_divergence``: the paired return difference's CI is above 0 while the task
    outcome (the success rate, or the final-info metric the request names in
    ``outcome_metric``) falls significantly (its paired CI below 0) or does not rise (paired mean
    difference <= 0). An outcome equal on every pair (e.g. a success rate at 1.0 on both sides)
    says nothing and raises nothing;
  * ``action_distribution_shift``: total variation distance between the two checkpoints' action
    shares (``Discrete`` spaces, from the per-episode ``action_counts``) above
    ``ACTION_TV_THRESHOLD``, or the action entropy falling below ``ENTROPY_COLLAPSE_RATIO`` times
    the previous one (from at least ``ENTROPY_FLOOR`` nats);
  * ``episode_length_shift``: the paired mean length difference's CI excludes 0 and the change
    is more than ``LENGTH_SHIFT_RATIO`` of the previous mean length;
  * ``failure_rate_jump``: the failure rate (every non-normal ending) rises by more than
    ``FAILURE_JUMP`` and the new rate's Wilson 95% interval lies above the previous rate.
"""

from __future__ import annotations

import hashlib
import logging
import math
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from evalfleet import stats
from evalfleet.audit import compare_with_baseline, harness_pairs_alarm, policy_pairs_alarm
from evalfleet.cache import EpisodeCache
from evalfleet.errors import EvalfleetError
from evalfleet.models import OUTPUT_MISSING
from evalfleet.records import EPISODE_SCHEMA
from evalfleet.scoring import outcomes

logger = logging.getLogger(__name__)

__all__ = [
    "ACTION_TV_THRESHOLD",
    "ENTROPY_COLLAPSE_RATIO",
    "FAILURE_JUMP",
    "LENGTH_SHIFT_RATIO",
    "VERDICTS",
    "Checkpoint",
    "HistoryError",
    "action_shares",
    "ambiguous_steps",
    "assess",
    "best_checkpoint",
    "checkpoints",
    "curve_row",
    "decode_steps",
    "drift_alarms",
    "encode_steps",
    "episodes_of",
    "evaluations",
    "feed_back_history",
    "logged_episodes",
    "never_best",
    "protocol_id",
    "report_protocol",
    "saw_step",
    "unsettled_best",
]

VERDICTS = ("first", "new_best", "not_distinguishable", "regression", "no_paired_episodes",
            "protocol_changed")
#: Verdicts that made a checkpoint the best of the steps before it when it was evaluated.
BEST_VERDICTS = ("first", "new_best")
#: Total variation distance between consecutive checkpoints' action shares that raises the alarm.
ACTION_TV_THRESHOLD = 0.25
#: The action entropy collapses when it falls below this fraction of the previous checkpoint's...
ENTROPY_COLLAPSE_RATIO = 0.5
#: ...when the previous one had at least this many nats (a near-deterministic policy can't collapse).
ENTROPY_FLOOR = 0.1
#: Relative change of the mean episode length (with a paired CI excluding 0) that raises the alarm.
LENGTH_SHIFT_RATIO = 0.5
#: Rise of the failure rate (absolute) that raises the alarm, with the new rate's CI above the old.
FAILURE_JUMP = 0.05
#: ``outcome_unreported``: share of the seeds whose outcome the previous checkpoint reported and
#: this one does not (its episodes end where the env reports none, e.g. at the step cap).
OUTCOME_SILENT_SHARE = 0.1

TAG_RUN = "evalfleet.training_run_id"
TAG_STEP = "evalfleet.step"
TAG_KEY = "evalfleet.cache_key"
TAG_PROTOCOL = "evalfleet.protocol"
TAG_VERDICT = "evalfleet.verdict"
TAG_BEST = "evalfleet.best"
TAG_REQUEST = "evalfleet.request_id"
TAG_SHA = "evalfleet.policy_sha256"
TAG_HARNESS = "evalfleet.harness_fault"
TAG_WITHHELD = "evalfleet.best_withheld"
#: The steps (same protocol, below its own) of the evaluations its verdict read (``encode_steps``).
TAG_SEEN = "evalfleet.history_seen"
#: Longest ``TAG_SEEN`` value (MLflow takes tag values up to 8,000 characters).
SEEN_BUDGET = 6000


class HistoryError(EvalfleetError):
    """The history of a training run cannot be read (bad run id, unreachable store)."""


def protocol_id(env_spec_hash: str, seed: int, max_steps: int | None, deterministic: bool,
                environment: str | None = None) -> str:
    """What makes two evaluations' episodes pairable: same env spec, seeds, step cap and env inputs.

    ``environment``: the digest of what the env sees of the process environment
    (``cache.environment_digest``: the ``--sandbox-env`` grants by value hash, the
    ``--sandbox-read`` contents, the isolation class). Without it a worse checkpoint run with
    ``HUNT_GAIN=3`` granted was paired with one run at 1, became ``new_best`` and passed ``--gate``.
    None for a report written before the manifest recorded it: its id is the one it was tagged
    with then, which no report recording it has (the history calls that a changed protocol).
    """
    blob = f"{env_spec_hash}|{seed}|{max_steps}|{deterministic}"
    if environment is not None:
        blob += f"|{environment}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def report_protocol(report: dict[str, Any]) -> str:
    """``protocol_id`` of a report (as JSON): its env spec hash and manifest protocol."""
    proto = (report.get("manifest") or {}).get("protocol") or {}
    environment = proto.get("environment_sha256")
    return protocol_id(str(report.get("env_spec_hash")), int(proto.get("seed", 0)),
                       proto.get("max_steps"), bool(proto.get("deterministic", True)),
                       None if environment is None else str(environment))


@dataclass(frozen=True)
class Checkpoint:
    """One evaluation of a training run's checkpoint, as MLflow holds it."""

    mlflow_run_id: str
    """The evaluation's MLflow run."""
    step: int
    """Training step of the evaluated weights."""
    request_id: str
    """The evaluation's request id."""
    policy_sha256: str
    """sha256 of the evaluated weights."""
    cache_key: str | None
    """Cache key of its episodes (where the paired comparison finds them)."""
    protocol: str | None
    """``protocol_id`` of the evaluation; None for runs logged before it was tagged."""
    metrics: dict[str, float]
    """Its ``eval/`` metrics (at the step)."""
    verdict: str | None
    """Its own verdict against the best checkpoint before it."""
    best: bool
    """True when it was the run's best checkpoint once evaluated (verdict first or new_best)."""
    harness_fault: bool
    """True when the evaluation was a harness fault (never a best checkpoint)."""
    start_time: int = 0
    """MLflow start time (ms): the latest evaluation of a step wins."""
    alarms: tuple[str, ...] = field(default=())
    """Names of the alarms it raised."""
    withheld: bool = False
    """Its return made it best, but its reward may be gamed (``best_withheld``): never a best."""
    seen: str | None = None
    """``TAG_SEEN``: the earlier steps its verdict read; None for runs logged before it was tagged."""


def _search_filter(training_run_id: str) -> str:
    if "'" in training_run_id or "\\" in training_run_id:
        raise HistoryError(
            f"training run id {training_run_id!r} cannot be searched for: quotes and backslashes "
            "are not allowed in a training_run_id"
        )
    return f"tags.`{TAG_RUN}` = '{training_run_id}'"


def checkpoints(tracking_uri: str, training_run_id: str, *, protocol: str | None = None,
                runs: list[Checkpoint] | None = None) -> list[Checkpoint]:
    """The run's evaluated checkpoints, one per step (the latest evaluation of a step), by step.

    ``protocol`` keeps only evaluations on the same seeds and env spec (``protocol_id``).
    ``runs``: ``evaluations(tracking_uri, training_run_id)`` read already.
    """
    by_step: dict[int, Checkpoint] = {}
    for cp in evaluations(tracking_uri, training_run_id) if runs is None else runs:
        if protocol is not None and cp.protocol != protocol:
            continue
        if cp.step not in by_step or cp.start_time >= by_step[cp.step].start_time:
            by_step[cp.step] = cp
    return [by_step[s] for s in sorted(by_step)]


def evaluations(tracking_uri: str, training_run_id: str) -> list[Checkpoint]:
    """Every evaluation of the run's checkpoints logged in MLflow, under any protocol."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
        runs = client.search_runs(experiments, _search_filter(training_run_id),
                                  run_view_type=ViewType.ACTIVE_ONLY, max_results=50_000)
    except HistoryError:
        raise
    except Exception as err:  # MLflow raises its own exception types
        raise HistoryError(f"cannot read evaluations of {training_run_id!r} from {tracking_uri}: "
                           f"{type(err).__name__}: {err}") from err
    out: list[Checkpoint] = []
    for run in runs:
        tags = run.data.tags
        try:
            step = int(tags[TAG_STEP])
        except (KeyError, ValueError):
            continue
        out.append(Checkpoint(
            mlflow_run_id=run.info.run_id, step=step, request_id=tags.get(TAG_REQUEST, ""),
            policy_sha256=tags.get(TAG_SHA, ""), cache_key=tags.get(TAG_KEY),
            protocol=tags.get(TAG_PROTOCOL), metrics=dict(run.data.metrics),
            verdict=tags.get(TAG_VERDICT), best=tags.get(TAG_BEST) == "true",
            harness_fault=tags.get(TAG_HARNESS) == "true", start_time=int(run.info.start_time or 0),
            alarms=tuple(sorted(k.removeprefix("evalfleet.alarm.") for k in tags
                                if k.startswith("evalfleet.alarm."))),
            withheld=bool(tags.get(TAG_WITHHELD)), seen=tags.get(TAG_SEEN),
        ))
    return out


#: Alarms of an evaluation whose policy failures flattered its return: never a best checkpoint.
FLATTERED = frozenset({"policy_failures_flatter", "history_pairs_policy_flatter"})


def gamed(alarms: list[dict[str, Any]]) -> list[str]:
    """The history alarms that say the reward may be gamed: no best checkpoint, no pass.

    ``outcome_unreported``, and ``reward_outcome_divergence`` when the outcome fell significantly.
    One that merely did not rise stays advisory: an honest gain in efficiency (the goal reached
    sooner, a higher return at the same success rate) raises it too.
    """
    return sorted({a["alarm"] for a in alarms if a["alarm"] == "outcome_unreported"
                   or (a["alarm"] == "reward_outcome_divergence" and a.get("falls"))})


def _usable(earlier: list[Checkpoint]) -> list[Checkpoint]:
    return [c for c in earlier if not c.harness_fault and not c.withheld
            and not FLATTERED.intersection(c.alarms)]


def _marked(earlier: list[Checkpoint]) -> list[Checkpoint]:
    """The usable checkpoints judged best against the steps before them when evaluated.

    A checkpoint evaluated out of step order is never tagged best, but its verdict counts: once
    the later steps are evaluated again (``unsettled_best``), they are judged with it.
    """
    return [c for c in _usable(earlier) if c.best or c.verdict in BEST_VERDICTS]


def best_checkpoint(earlier: list[Checkpoint]) -> Checkpoint | None:
    """The latest earlier checkpoint that was best when evaluated; else the highest mean return.

    Harness faults never count, nor checkpoints whose policy failures flattered them
    (``FLATTERED``) or whose reward may be gamed (``withheld``): their gate did not pass. The
    fallback covers runs logged before verdicts were tagged. Undecided while ``unsettled_best``
    says so: ``assess`` then fails closed instead of asking.
    """
    marked = _marked(earlier)
    if marked:
        return max(marked, key=lambda c: c.step)
    scored = [c for c in _usable(earlier) if math.isfinite(c.metrics.get("eval/reward", math.nan))]
    return max(scored, key=lambda c: c.metrics["eval/reward"]) if scored else None


def encode_steps(steps: Iterable[int], budget: int = SEEN_BUDGET) -> str:
    """``steps`` as a ``TAG_SEEN`` value: comma-separated ``a`` or ``a:b:d`` (a, a+d, ..., b).

    Checkpoints evaluated every N steps take a few characters. ``none`` for no step. When the
    runs do not fit in ``budget`` characters the lowest are left out and the value starts with
    ``from F;`` (F: the lowest step it covers; below it, ``saw_step`` does not know).
    """
    s = sorted(set(steps))
    tokens: list[tuple[int, str]] = []
    i = 0
    while i < len(s):
        j = i
        if i + 2 < len(s) and s[i + 1] - s[i] == s[i + 2] - s[i + 1]:
            d, j = s[i + 1] - s[i], i + 2
            while j + 1 < len(s) and s[j + 1] - s[j] == d:
                j += 1
        tokens.append((s[i], str(s[i]) if j == i else f"{s[i]}:{s[j]}:{s[i + 1] - s[i]}"))
        i = j + 1
    text = ",".join(t for _, t in tokens) or "none"
    while len(text) > budget:
        tokens = tokens[max(1, len(tokens) // 10):]
        text = f"from {tokens[0][0]};" + ",".join(t for _, t in tokens)
    return text


@lru_cache(maxsize=4096)
def decode_steps(text: str) -> tuple[frozenset[int], int | None] | None:
    """``encode_steps``'s value as (steps, lowest step covered or None for all); None if unreadable."""
    floor: int | None = None
    try:
        if text.startswith("from "):
            head, text = text.split(";", 1)
            floor = int(head.removeprefix("from "))
        steps: set[int] = set()
        for token in [] if text == "none" else text.split(","):
            a, _, rest = token.partition(":")
            if not rest:
                steps.add(int(a))
                continue
            b, d = (int(x) for x in rest.split(":"))
            if d <= 0 or (b - int(a)) % d:
                return None
            steps.update(range(int(a), b + 1, d))
    except ValueError:
        return None
    return frozenset(steps), floor


def saw_step(seen: str | None, step: int) -> bool:
    """Whether a verdict whose ``TAG_SEEN`` is ``seen`` read an evaluation of ``step``.

    True where it is not known (no tag: an older evalfleet; below a truncated value's floor):
    the caller then goes by when the runs were logged.
    """
    decoded = None if seen is None else decode_steps(seen)
    if decoded is None:
        return True
    steps, floor = decoded
    return step in steps or (floor is not None and step < floor)


def judged_without(step: int, policy_sha256: str, later: list[Checkpoint],
                   evaluated: list[Checkpoint]) -> list[Checkpoint]:
    """The checkpoints of ``later`` above ``step`` whose verdicts were made without these weights.

    A later step saw them when its verdict read an evaluation of ``step`` (its ``TAG_SEEN``) and
    one of the same weights at ``step`` was logged before it (a re-evaluation, a retry, is not
    late). When it was logged is not enough: a verdict is made at its history read, and its
    MLflow run is logged later (after the review): an earlier step logged in between was taken
    for seen, both steps were tagged best and the gate passed a regression against the lower
    one. ``evaluated``: every evaluation of the run under the protocol, also those
    ``checkpoints`` leaves out.
    """
    return [hi for hi in later if hi.step > step and not (saw_step(hi.seen, step) and any(
        e.step == step and e.policy_sha256 == policy_sha256 and e.start_time < hi.start_time
        for e in evaluated))]


def _steps(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps[:5]) + (", ..." if len(steps) > 5 else "")


def ambiguous_steps(evaluated: list[Checkpoint], step: int,
                    policy_sha256: str = "") -> dict[str, Any] | None:
    """Steps up to ``step`` evaluated with different weights, None when there are none.

    ``checkpoints`` keeps a step's latest evaluation: with two policies at one step, the history
    (and so every later verdict) would depend on which finished last. ``policy_sha256``: this
    evaluation's weights at ``step``.
    """
    runs: dict[int, dict[str, list[str]]] = {}
    for c in evaluated:
        if c.step <= step and c.policy_sha256:
            where = f"MLflow run {c.mlflow_run_id}"
            runs.setdefault(c.step, {}).setdefault(c.policy_sha256, []).append(where)
    if policy_sha256:
        runs.setdefault(step, {}).setdefault(policy_sha256, []).append("this evaluation")
    both = {s: by for s, by in sorted(runs.items()) if len(by) > 1}
    if not both:
        return None
    listed = "; ".join(f"step {s}: " + ", ".join(f"{sha[:12]} ({', '.join(where)})"
                                                 for sha, where in sorted(by.items()))
                       for s, by in both.items())
    return {"steps": sorted(both), "message": (
        f"step{'s' if len(both) > 1 else ''} {_steps(sorted(both))} of this training run "
        f"{'were' if len(both) > 1 else 'was'} evaluated with different weights ({listed}): the "
        "history would hold whichever evaluation finished last, so no verdict is made. Delete the "
        "MLflow runs of the wrong weights (the history reads active runs only), then evaluate "
        "again")}


def unsettled_best(earlier: list[Checkpoint], evaluated: list[Checkpoint]) -> dict[str, Any] | None:
    """Why the best of ``earlier`` is undecided, None when it is not.

    A checkpoint judged best against the steps before it, logged after a higher step that was
    judged best without it (evaluated out of step order, or logged so by an older evalfleet that
    tagged both best): which of the two is the run's best is unknown until the higher steps are
    evaluated again. ``best_checkpoint`` would pick the higher one, and a regression against the
    lower one would pass the gate.
    """
    marked = _marked(earlier)
    late = {lo.step: [hi.step for hi in judged_without(lo.step, lo.policy_sha256, marked, evaluated)]
            for lo in sorted(marked, key=lambda c: c.step)}
    late = {lo: his for lo, his in late.items() if his}
    if not late:
        return None
    stale = sorted({s for his in late.values() for s in his})
    lows = ", ".join(f"step {lo} after step{'s' if len(his) > 1 else ''} {_steps(his)}"
                     for lo, his in late.items())
    return {"late_steps": sorted(late), "stale_steps": stale, "message": (
        f"checkpoints of this training run were evaluated out of step order: {lows}. The lower "
        "step was judged best against the steps before it, the higher one was judged best "
        "without it: which is the best checkpoint is undecided. Evaluate "
        f"step{'s' if len(stale) > 1 else ''} {_steps(stale)} again (the new evaluation is "
        "judged with the earlier steps), and evaluate a run's checkpoints in step order")}


def _read_any(path: Path) -> pa.Table:
    """An episode table of this or an older schema (missing later columns come back null)."""
    import pyarrow.parquet as pq

    raw = pq.read_table(path)
    cols = [raw.column(f.name).cast(f.type) if f.name in raw.column_names
            else pa.nulls(raw.num_rows, f.type) for f in EPISODE_SCHEMA]
    return pa.Table.from_arrays(cols, schema=EPISODE_SCHEMA)


def _ran(cp: Checkpoint, indices: range) -> range:
    """The indices among ``indices`` the checkpoint's evaluation ran (all, when not recorded)."""
    episodes = cp.metrics.get("eval/episodes")
    if episodes is None or not math.isfinite(episodes):
        return indices
    return range(indices.start, max(indices.start, min(indices.stop, int(episodes))))


def _artifact_episodes(tracking_uri: str, mlflow_run_id: str) -> pa.Table | None:
    """The ``episodes.parquet`` an MLflow run logged (every row it ran), None when it is gone."""
    from mlflow.tracking import MlflowClient

    try:
        with tempfile.TemporaryDirectory(prefix="evalfleet-history-") as tmp:
            local = MlflowClient(tracking_uri=tracking_uri).download_artifacts(
                mlflow_run_id, "episodes.parquet", tmp)
            return _read_any(Path(local))
    except Exception as err:  # an artifact store that lost the file: said by the caller
        logger.warning("episodes.parquet of MLflow run %s cannot be read: %s", mlflow_run_id, err)
        return None


def _among(table: pa.Table, indices: range) -> pa.Table:
    wanted = set(indices)
    keep = [i for i, x in enumerate(table.column("episode_index").to_pylist()) if x in wanted]
    return table.take(pa.array(keep, pa.int64())).sort_by("episode_index")


def episodes_of(cp: Checkpoint, cache: EpisodeCache | None, tracking_uri: str,
                indices: range) -> pa.Table | None:
    """The checkpoint's episodes among ``indices``: from the cache by its key, else its artifact.

    The cache answers only when it holds every one of those episodes the checkpoint ran: it keeps
    no episode the policy's runtime or the infrastructure ended (policy_error, policy_timeout,
    timeout, crashed, oom), and pairing without them would leave out exactly the episodes where
    the policy broke. Otherwise the evaluation's ``episodes.parquet`` artifact (every row) is
    read; None when that is gone too (a partial table is never returned).
    """
    ran = _ran(cp, indices)
    partial = None
    if cache is not None and cp.cache_key:
        found = cache.lookup(cp.cache_key, ran)
        if found.stored.num_rows and not found.missing:
            return found.stored
        partial = found.stored.num_rows
    table = _artifact_episodes(tracking_uri, cp.mlflow_run_id)
    if table is None:
        held = (f"the cache holds {partial} of its {len(ran)} episodes (none of those the policy "
                "or the infrastructure ended) and " if partial else "")
        logger.warning("episodes of step %s (run %s) not found whole: %sthe MLflow artifact is "
                       "gone", cp.step, cp.mlflow_run_id, held)
        return None
    return _among(table, indices)


def logged_episodes(tracking_uri: str, cache_key: str, indices: range) -> pa.Table | None:
    """Episodes among ``indices`` of the latest MLflow run under ``cache_key`` that holds them all.

    From its ``episodes.parquet``; None when no run does. Where a table the episode cache
    returned is partial (see ``episodes_of``), this is the whole one of the same policy, env and
    protocol.
    """
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    if not cache_key or any(c not in "0123456789abcdef" for c in cache_key):
        return None
    db = tracking_uri.removeprefix("sqlite:///")
    if db != tracking_uri and not Path(db).exists():
        return None  # no store yet (and reading one would create it)
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
        runs = client.search_runs(experiments, f"tags.`{TAG_KEY}` = '{cache_key}'",
                                  run_view_type=ViewType.ACTIVE_ONLY, max_results=20,
                                  order_by=["attributes.start_time DESC"])
    except Exception as err:  # MLflow raises its own exception types; the caller says what's missing
        logger.warning("cannot search %s for episodes of cache key %s: %s", tracking_uri,
                       cache_key[:12], err)
        return None
    for run in runs:
        table = _artifact_episodes(tracking_uri, run.info.run_id)
        if table is not None:
            rows = _among(table, indices)
            if rows.num_rows == len(indices):
                return rows
    return None


# ----------------------------------------------------------------------------- per-table figures


def action_shares(table: pa.Table) -> list[float] | None:
    """Share of each action over the scored episodes' steps (None: no action counts recorded)."""
    kinds = outcomes(table)
    counts = [c for c, ok in zip(table.column("action_counts").to_pylist(), kinds.scored, strict=True)
              if ok and c is not None]
    if not counts or len({len(c) for c in counts}) != 1:
        return None
    total = np.asarray(counts, dtype=np.float64).sum(axis=0)
    steps = float(total.sum())
    return None if steps == 0 else [float(x) for x in total / steps]


def _entropy(shares: list[float]) -> float:
    p = np.asarray(shares, dtype=np.float64)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def outcome_values(table: pa.Table, metric: str | None, *, broken_fail: bool = True
                   ) -> dict[int, float]:
    """Per scored episode (by index): 1/0 success, or the named final-info metric.

    An episode the policy broke counts as not successful (``broken_fail=False``: it is left out,
    leaving only what the env itself reported); a metric it never reported is left out.
    """
    kinds = outcomes(table)
    out: dict[int, float] = {}
    rows = table.select(["episode_index", "success", "metrics"]).to_pylist()
    for row, scored, broken in zip(rows, kinds.scored, kinds.policy, strict=True):
        if not scored or (broken and not broken_fail):
            continue
        if metric is None:
            value: float | None = 0.0 if broken else (None if row["success"] is None
                                                      else float(row["success"]))
        else:
            value = dict(row["metrics"] or []).get(metric)
        if value is not None and math.isfinite(value):
            out[int(row["episode_index"])] = float(value)
    return out


def current_figures(table: pa.Table, outcome_metric: str | None) -> dict[str, Any]:
    """What later evaluations compare with: action shares and entropy, the outcome's mean."""
    shares = action_shares(table)
    values = outcome_values(table, outcome_metric)
    outcome: dict[str, Any] = {"name": outcome_metric or "success",
                               "mean": float(np.mean(list(values.values()))) if values else None,
                               "n": len(values)}
    if outcome_metric is not None and not values:  # what the env does report, for the alarm
        seen: set[str] = set()
        for pairs in table.column("metrics").to_pylist():
            seen.update(k for k, _ in pairs or [])
        outcome["keys_seen"] = sorted(seen)[:20]
    return {
        "action_shares": shares,
        "action_entropy": _entropy(shares) if shares is not None else None,
        "outcome": outcome,
    }


# ----------------------------------------------------------------------------- alarms


def _paired(new: dict[int, float], old: dict[int, float], seed: int) -> stats.PairedComparison | None:
    common = sorted(set(new) & set(old))
    if len(common) < stats.MIN_PAIRS:  # a drift alarm from a handful of pairs is a coin toss
        return None
    return stats.paired_comparison(np.array([new[i] for i in common]),
                                   np.array([old[i] for i in common]), seed=seed)


def _alarm(name: str, statistic: str, value: float, threshold: str, steps: tuple[int, int],
           message: str, **extra: Any) -> dict[str, Any]:
    return {"alarm": name, "statistic": statistic, "value": value, "threshold": threshold,
            "steps": list(steps), "message": message, **extra}


def _by_index(table: pa.Table, column: str) -> dict[int, float]:
    kinds = outcomes(table)
    idx = table.column("episode_index").to_pylist()
    vals = table.column(column).to_pylist()
    return {int(i): float(v) for i, v, ok in zip(idx, vals, kinds.scored, strict=True) if ok}


def drift_alarms(new: pa.Table, old: pa.Table, steps: tuple[int, int], *, seed: int,
                 outcome_metric: str | None = None) -> list[dict[str, Any]]:
    """The alarms of ``new`` against the previous checkpoint's ``old`` (see the module docstring)."""
    alarms: list[dict[str, Any]] = []
    prev, cur = steps
    ret = _paired(_by_index(new, "return"), _by_index(old, "return"), seed)
    name = outcome_metric or "success rate"
    new_out, old_out = outcome_values(new, outcome_metric), outcome_values(old, outcome_metric)
    out = _paired(new_out, old_out, seed)
    scored_new = _by_index(new, "return")
    # Seeds whose outcome the old side's env reported, and that the new side played out.
    asked = [i for i in outcome_values(old, outcome_metric, broken_fail=False) if i in scored_new]
    silent = sum(i not in new_out for i in asked)
    if len(asked) >= stats.MIN_PAIRS and silent > OUTCOME_SILENT_SHARE * len(asked):
        # The outcome check pairs only the seeds both sides reported: episodes that now end
        # where the env says nothing (stalling to the step cap) left it with none, or with the
        # flattering rest, and a reward-gaming checkpoint was new_best with no alarm.
        alarms.append(_alarm(
            "outcome_unreported", f"share of seeds whose {name} is no longer reported",
            silent / len(asked), f"> {OUTCOME_SILENT_SHARE}", steps,
            f"{name} was reported on {len(asked)} seeds at step {prev}; at step {cur} {silent} of "
            f"them end with none (e.g. at the step cap), so the outcome check sees only the "
            f"other {len(asked) - silent}: a policy can hide its failures that way; look at the "
            "episodes before promoting", outcome=name, silent=silent, reported_before=len(asked)))
    if ret is not None and ret.ci.low > 0 and out is not None:
        constant = out.ci.low == out.ci.high == out.mean_diff == 0.0
        falls = out.ci.high < 0
        if falls or (out.mean_diff <= 0 and not constant):
            how = "falls" if falls else "does not rise"
            alarms.append(_alarm(
                "reward_outcome_divergence", f"paired difference of {name}", out.mean_diff,
                "return's paired 95% CI above 0 while the outcome's CI is below 0 or its paired "
                "mean difference is <= 0", steps,
                f"return rose {ret.mean_diff:+.4g} (paired 95% CI [{ret.ci.low:.4g}, "
                f"{ret.ci.high:.4g}]) from step {prev} to {cur} while {name} {how}: "
                f"{out.mean_baseline:.4g} -> {out.mean_new:.4g} (paired difference "
                f"{out.mean_diff:+.4g}, 95% CI [{out.ci.low:.4g}, {out.ci.high:.4g}]); the reward "
                "may be gamed: look at the episodes before promoting",
                outcome=name, falls=falls, return_diff=ret.mean_diff,
                return_ci=[ret.ci.low, ret.ci.high], outcome_ci=[out.ci.low, out.ci.high]))
    p, q = action_shares(new), action_shares(old)
    if p is not None and q is not None and len(p) == len(q):
        tv = 0.5 * float(np.abs(np.subtract(p, q)).sum())
        h_new, h_old = _entropy(p), _entropy(q)
        if tv > ACTION_TV_THRESHOLD:
            alarms.append(_alarm(
                "action_distribution_shift", "total variation distance of action shares", tv,
                f"> {ACTION_TV_THRESHOLD}", steps,
                f"action shares moved by TV {tv:.3f} (> {ACTION_TV_THRESHOLD}) from step {prev} "
                f"({_fmt_shares(q)}) to {cur} ({_fmt_shares(p)})",
                shares=[q, p], entropy=[h_old, h_new]))
        elif h_old >= ENTROPY_FLOOR and h_new < ENTROPY_COLLAPSE_RATIO * h_old:
            alarms.append(_alarm(
                "action_distribution_shift", "action entropy (nats)", h_new,
                f"< {ENTROPY_COLLAPSE_RATIO} x previous ({h_old:.3f})", steps,
                f"action entropy collapsed from {h_old:.3f} to {h_new:.3f} nats between step "
                f"{prev} and {cur}", shares=[q, p], entropy=[h_old, h_new]))
    length = _paired(_by_index(new, "length"), _by_index(old, "length"), seed)
    if length is not None and length.mean_baseline > 0:
        rel = length.mean_diff / length.mean_baseline
        if abs(rel) > LENGTH_SHIFT_RATIO and (length.ci.low > 0 or length.ci.high < 0):
            alarms.append(_alarm(
                "episode_length_shift", "relative change of mean episode length", rel,
                f"|change| > {LENGTH_SHIFT_RATIO:.0%} with the paired 95% CI excluding 0", steps,
                f"mean episode length {length.mean_baseline:.4g} -> {length.mean_new:.4g} "
                f"({rel:+.0%}) from step {prev} to {cur}"))
    rate_new, rate_old = _failure_rate(new), _failure_rate(old)
    if new.num_rows and rate_new - rate_old > FAILURE_JUMP:
        fails = round(rate_new * new.num_rows)
        ci = stats.wilson_interval(fails, new.num_rows)
        if ci.low > rate_old:
            alarms.append(_alarm(
                "failure_rate_jump", "failure rate difference", rate_new - rate_old,
                f"> {FAILURE_JUMP} with the new rate's Wilson 95% CI above the previous rate",
                steps, f"failure rate {rate_old:.1%} -> {rate_new:.1%} (95% CI [{ci.low:.1%}, "
                f"{ci.high:.1%}]) from step {prev} to {cur}"))
    return alarms


def _fmt_shares(shares: list[float]) -> str:
    return ", ".join(f"{i}: {s:.2f}" for i, s in enumerate(shares))


def _failure_rate(table: pa.Table) -> float:
    kinds = outcomes(table)
    return float((~kinds.completed).sum()) / table.num_rows if table.num_rows else 0.0


# ----------------------------------------------------------------------------- the assessment


def assess(
    table: pa.Table, *, step: int, seed: int, earlier: list[Checkpoint],
    episodes: Callable[[Checkpoint], pa.Table | None], outcome_metric: str | None = None,
    policy_sha256: str = "", other_protocols: list[Checkpoint] | None = None,
    evaluated: list[Checkpoint] | None = None, judged_in_flight: list[int] | None = None,
) -> dict[str, Any]:
    """The ``history`` section of a report: verdict, best checkpoint, alarms.

    ``earlier`` are the run's checkpoints with the same protocol (``checkpoints``); those at
    ``step`` or later are not compared with. ``episodes(cp)`` gives a checkpoint's episodes on
    this evaluation's indices (``episodes_of``) or None when they are gone. ``other_protocols``:
    the run's evaluations under another protocol. With none of the same protocol before ``step``
    but some of another, the verdict is ``protocol_changed``, not ``first``: this checkpoint
    cannot be compared with them, so it is neither tagged best nor passed by a gate.
    ``evaluated``: every evaluation under the protocol (default ``earlier``). A step up to
    this one evaluated with other weights too (``ambiguous_steps``) gives ``no_paired_episodes``
    and ``step_ambiguous``. Later steps
    logged without these weights (``judged_without``) make this checkpoint late: judged against
    the earlier steps, never the best, ``out_of_order`` names them; so do
    ``judged_in_flight``, later steps whose verdicts were made without this one and whose MLflow
    runs are not logged yet (``claims.later_judged``). A best of the earlier steps that
    ``unsettled_best`` calls undecided gives ``no_paired_episodes``.
    """
    evaluated = list(earlier) if evaluated is None else evaluated
    later = sorted({c.step for c in judged_without(step, policy_sha256, earlier, evaluated)}
                   | {s for s in judged_in_flight or [] if s > step})
    earlier = [c for c in earlier if c.step < step]
    out: dict[str, Any] = {"step": step, "checkpoints_before": len(earlier),
                           "outcome_metric": outcome_metric or "success",
                           "current": current_figures(table, outcome_metric)}
    if later:  # their verdicts were made without this one: it cannot be the best after them
        out.update(later_steps=later, out_of_order=(
            f"step {step} was evaluated after later checkpoints of this training run were "
            f"{'judged' if judged_in_flight else 'logged'} "
            f"(step{'s' if len(later) > 1 else ''} {_steps(later)}): it is judged against the "
            "earlier steps only and is not tagged best, and the later steps' verdicts were made "
            f"without it. Evaluate step{'s' if len(later) > 1 else ''} {_steps(later)} again to "
            "judge them with it, and evaluate a run's checkpoints in step order"))
    ambiguous = ambiguous_steps(evaluated, step, policy_sha256)
    if ambiguous:  # which weights the history holds at a step is unknown: no verdict, no pass
        return dict(out, verdict="no_paired_episodes", best_step=None, best_policy_sha256=None,
                    compared_with=None, comparison=None, alarms=[], note=ambiguous["message"],
                    ambiguous_steps=ambiguous["steps"], step_ambiguous=ambiguous["message"])
    before = sorted({c.step for c in other_protocols or [] if c.step < step})
    if not earlier and before:
        return dict(out, verdict="protocol_changed", best_step=None, best_policy_sha256=None,
                    compared_with=None, comparison=None, alarms=[], other_protocol_steps=before,
                    note=(f"{len(before)} earlier checkpoints of this training run (steps "
                          f"{_steps(before)}) were evaluated under another protocol (env code or "
                          "spec, seed, step cap, determinism, or what the env sees of the "
                          "environment: isolation, --sandbox-env values, --sandbox-read "
                          "contents): this one is not compared with them"))
    if not earlier:
        return dict(out, verdict="first", best_step=None if later else step,
                    best_policy_sha256=None if later else policy_sha256,
                    compared_with=None, comparison=None, alarms=[],
                    note=("no earlier checkpoint of this training run, but later ones were "
                          "evaluated before it" if later else
                          "first evaluated checkpoint of this training run"))
    unsettled = unsettled_best(earlier, evaluated)
    best = None if unsettled else best_checkpoint(earlier)
    cache: dict[str, pa.Table | None] = {}

    def table_of(cp: Checkpoint) -> pa.Table | None:
        if cp.mlflow_run_id not in cache:
            cache[cp.mlflow_run_id] = episodes(cp)
        return cache[cp.mlflow_run_id]

    comparison: dict[str, Any] | None = None
    note = None
    if unsettled:  # which earlier checkpoint is the best is unknown: no verdict, no pass
        verdict, note = "no_paired_episodes", unsettled.pop("message")
        out.update(unsettled_best=unsettled, out_of_order="; ".join(
            m for m in (out.get("out_of_order"), note) if m))
    elif best is None:  # earlier checkpoints, none trusted: nothing to compare with, no pass
        verdict = "no_paired_episodes"
        note = (f"every earlier checkpoint of this training run (steps "
                f"{_steps(sorted(c.step for c in earlier))}) was a harness "
                "fault (more than 5% of its episodes failed in the harness), so none is trusted "
                "to compare with")
    else:
        best_table = table_of(best)
        if best_table is None or best_table.num_rows == 0:
            verdict = "no_paired_episodes"
            note = (f"the episodes of the best checkpoint (step {best.step}) are neither whole in "
                    "the cache nor in MLflow")
        else:
            comparison = compare_with_baseline(_planned_by(table, best), best_table, seed,
                                               f"step {best.step}")
            verdict = {"better": "new_best", "worse": "regression"}.get(
                str(comparison["verdict"]), "not_distinguishable")
            if comparison["verdict"] == "too few pairs":
                verdict, note = "no_paired_episodes", str(comparison.get("note"))
    is_best = verdict in BEST_VERDICTS
    out.update(
        verdict=verdict,
        best_step=step if is_best else None if best is None else best.step,
        best_policy_sha256=policy_sha256 if is_best else None if best is None else best.policy_sha256,
        compared_with=None if best is None else {"step": best.step, "policy_sha256": best.policy_sha256,
                                                 "mlflow_run_id": best.mlflow_run_id},
        comparison=comparison,
        note=note,
    )
    previous = max(earlier, key=lambda c: c.step)
    prev_table = table_of(previous)
    alarms: list[dict[str, Any]] = []
    if prev_table is not None and prev_table.num_rows:
        alarms = drift_alarms(table, prev_table, (previous.step, step), seed=seed,
                              outcome_metric=outcome_metric)
    else:
        out["alarms_note"] = f"episodes of the previous checkpoint (step {previous.step}) are gone"
    out["previous_step"] = previous.step
    out["alarms"] = alarms
    withheld = gamed(alarms)
    if is_best and (withheld or later):  # the reward may be gamed, or late: the best stays
        out.update(best_step=None if best is None else best.step,
                   best_policy_sha256=None if best is None else best.policy_sha256)
        if withheld:
            out["best_withheld"] = withheld
    return out


def never_best(history: dict[str, Any], reasons: list[str]) -> dict[str, Any]:
    """``history`` with its checkpoint kept from being the best for ``reasons``: the best stays.

    A checkpoint whose verdict (``first``, ``new_best``) would make it the best while the history
    never trusts it as one (a harness fault, failures of the policy that flatter it: ``_usable``)
    keeps the earlier best (the one it was compared with; none for a first), and
    ``best_withheld`` names why. Else, later steps were judged against the earlier best while its
    report, MLflow tags and ``Evaluator.best_step`` called this one the best.
    """
    if not reasons or history.get("verdict") not in BEST_VERDICTS:
        return history
    best = history.get("compared_with") or {}
    out = dict(history, best_withheld=sorted({*(history.get("best_withheld") or []), *reasons}))
    if history.get("best_step") == history.get("step"):
        out.update(best_step=best.get("step"), best_policy_sha256=best.get("policy_sha256"))
    return out


def withheld_for(report: dict[str, Any], history: dict[str, Any]) -> list[str]:
    """Why the history must never take ``report``'s checkpoint as a best (``never_best``).

    ``harness_fault`` (too many episodes unscored, a recording shortfall, inputs that changed
    while it ran) and the alarms of failures that flatter it (``FLATTERED``), the report's and
    the history's own: ``_usable`` drops such a checkpoint when later steps are judged.
    """
    names = {str(a).split(":", 1)[0] for a in [*(report.get("alarms") or []), *alarm_lines(history)]}
    return (["harness_fault"] if report.get("harness_fault") else []) + sorted(names & FLATTERED)


def _planned_by(table: pa.Table, cp: Checkpoint) -> pa.Table:
    """The rows of ``table`` on indices ``cp``'s evaluation also planned: the pairable ones.

    Indices past the checkpoint's episode count were never pairable, so they are not counted as
    dropped; any index dropped then is an anomaly (``alarm_lines``).
    """
    episodes = cp.metrics.get("eval/episodes")
    if episodes is None or not math.isfinite(episodes):
        return table
    keep = np.asarray(table.column("episode_index").to_numpy()) < int(episodes)
    return table if keep.all() else table.filter(pa.array(keep))


def alarm_lines(history: dict[str, Any] | None) -> list[str]:
    """The history's alarms as report alarm lines (``name: message``).

    Besides the drift alarms: ``history_unavailable`` when the history could not be read,
    ``history_not_compared`` when there is no verdict against the best checkpoint,
    ``history_out_of_order`` when checkpoints were evaluated out of step order (this one, or
    the best of the earlier ones is undecided), ``history_step_ambiguous`` when a step was
    evaluated with different weights, ``history_pairs_unmatched`` when pairs were
    dropped for want of a row of the best checkpoint, and ``history_pairs_harness`` when harness
    failures on either side dropped too many. A gate reading the report must not take any of
    them for a pass.
    """
    if not history:
        return []
    lines = []
    if history.get("error"):
        lines.append(f"history_unavailable: the training run's history could not be read "
                     f"({history['error']}); no verdict against the best checkpoint and no drift "
                     "alarms: check the MLflow store (--mlflow-uri) and re-run")
    elif history.get("verdict") == "protocol_changed":
        lines.append(f"history_protocol_changed: {history.get('note')}; the verdict of a new "
                     "protocol's first checkpoint says nothing of a regression: re-evaluate the "
                     "best earlier checkpoint under this protocol (--baseline its policy) to "
                     "compare, or keep the protocol fixed across a training run")
    elif history.get("step_ambiguous"):
        lines.append(f"history_step_ambiguous: {history['step_ambiguous']}")
    elif history.get("verdict") == "no_paired_episodes" and not history.get("unsettled_best"):
        best = (history.get("compared_with") or {}).get("step")
        where = f" (step {best})" if best is not None else ""
        lines.append(f"history_not_compared: no verdict against the best checkpoint{where}: "
                     f"{history.get('note')}; re-evaluate the best checkpoint on the same seeds "
                     "and episode count, or compare with --baseline")
    if history.get("out_of_order"):
        lines.append(f"history_out_of_order: {history['out_of_order']}")
    outcome = (history.get("current") or {}).get("outcome") or {}
    if "keys_seen" in outcome:  # a named outcome no episode reports: the check cannot run
        seen = ", ".join(outcome["keys_seen"]) or "none"
        lines.append(f"{OUTPUT_MISSING}: the reward-hacking check of outcome {outcome['name']!r} "
                     f"(--outcome-metric): no scored episode's final info has that key (keys "
                     f"seen: {seen}); name one the env reports, or drop --outcome-metric to watch "
                     "the success rate")
    c = history.get("comparison") or {}
    if c.get("dropped_unmatched"):
        lines.append(f"history_pairs_unmatched: {c['dropped_unmatched']} episodes had no row of "
                     f"the best checkpoint ({c.get('baseline')}) on the same index and seed and were "
                     f"left out of the verdict ({c.get('n')} pairs left): it may be biased")
    lines += [a for a in (harness_pairs_alarm(c, name="history"),
                          policy_pairs_alarm(c, name="history")) if a]
    return lines + [f"{a['alarm']}: {a['message']}" for a in history.get("alarms") or []]


# ----------------------------------------------------------------------------- the curve


#: The columns of a training run's curve (``curve_rows``), as ``evalfleet history`` prints them.
CURVE_METRICS = {"reward": "eval/reward", "reward_ci_low": "eval/reward_ci_low",
                 "reward_ci_high": "eval/reward_ci_high", "success_rate": "eval/success_rate",
                 "success_ci_low": "eval/success_ci_low", "success_ci_high": "eval/success_ci_high",
                 "failure_rate": "eval/failure_rate", "episode_length": "eval/episode_length",
                 "episodes": "eval/episodes"}


def curve_row(cp: Checkpoint) -> dict[str, Any]:
    """One checkpoint as a row of the curve: step, return with CI, success, failures, length."""
    row: dict[str, Any] = {"step": cp.step}
    for name, key in CURVE_METRICS.items():
        row[name] = cp.metrics.get(key)
    row.update(verdict=cp.verdict, best=cp.best, alarms=list(cp.alarms), protocol=cp.protocol,
               policy_sha256=cp.policy_sha256, mlflow_run_id=cp.mlflow_run_id)
    return row


def report_curve_row(report: dict[str, Any]) -> dict[str, Any]:
    """The evaluation being fed back as a row of the curve (it is not in MLflow yet)."""
    r, success = report["returns"], report.get("success") or {}
    history = report.get("history") or {}
    return {
        "step": report.get("step"), "reward": r.get("mean"),
        "reward_ci_low": r["ci"]["low"], "reward_ci_high": r["ci"]["high"],
        "success_rate": success.get("rate"),
        "success_ci_low": (success.get("ci") or {}).get("low"),
        "success_ci_high": (success.get("ci") or {}).get("high"),
        "failure_rate": report.get("failure_rate"), "episode_length": report["lengths"].get("mean"),
        "episodes": report.get("episodes"), "verdict": history.get("verdict"),
        # What its tags will say (``tracking.history_tags``): not a best withheld, late or faulted.
        "best": history.get("verdict") in BEST_VERDICTS and history.get("best_step") == report.get("step")
        and not history.get("best_withheld") and not report.get("harness_fault"),
        "alarms": [a["alarm"] for a in history.get("alarms") or []],
        "protocol": report_protocol(report),
        "policy_sha256": report.get("policy_sha256"), "mlflow_run_id": None,
    }


def feed_back_history(report: dict[str, Any], table: pa.Table, tracking_uri: str,
                      cache: EpisodeCache | None, outcome_metric: str | None,
                      judged_in_flight: list[int] | None = None) -> dict[str, Any] | None:
    """Stage 7's history: the report's ``history`` section (None without a training run and step).

    Reads the run's earlier checkpoints with the same protocol from MLflow, pairs this
    evaluation with the best of them and checks drift against the previous one; ``curve`` holds
    every earlier checkpoint's row (the report page plots it with this one). ``seen_steps``
    (``encode_steps``, tagged ``TAG_SEEN``) says which earlier steps the verdict read.
    ``judged_in_flight``: see ``assess``.
    """
    run_id, step = report.get("training_run_id"), report.get("step")
    if not run_id or step is None:
        return None
    proto = report_protocol(report)
    every = evaluations(tracking_uri, run_id)
    runs = [c for c in every if c.request_id != report.get("request_id")]
    earlier = checkpoints(tracking_uri, run_id, protocol=proto, runs=runs)
    indices = range(int(max(table.column("episode_index").to_pylist(), default=-1)) + 1)
    seed = int(((report.get("manifest") or {}).get("protocol") or {}).get("seed", 0))
    out = assess(table, step=int(step), seed=seed, earlier=earlier,
                 episodes=lambda cp: episodes_of(cp, cache, tracking_uri, indices),
                 outcome_metric=outcome_metric, policy_sha256=str(report.get("policy_sha256")),
                 other_protocols=[c for c in runs if c.protocol != proto],
                 evaluated=[c for c in every if c.protocol == proto],
                 judged_in_flight=judged_in_flight)
    out["training_run_id"] = run_id
    out["protocol"] = proto
    out["seen_steps"] = encode_steps(c.step for c in every if c.protocol == proto and c.step < int(step))
    out["curve"] = [curve_row(c) for c in earlier if c.step < int(step)]
    return never_best(out, withheld_for(report, out))
