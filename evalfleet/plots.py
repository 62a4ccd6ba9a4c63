"""PNG plots of an evaluation: returns, lengths, returns by episode, actions, adaptive rounds.

Matplotlib's object API on the Agg canvas only: no ``pyplot``, so no global figure registry, no
backend switch and no rcParams change leaks into the caller's process (a Prefect worker or a
training loop that plots too). Every plot has a title, axis labels with units and a legend where
colours mean something.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from evalfleet.review import failed_mask
from evalfleet.scoring import outcomes

__all__ = ["HISTORY_FILE", "PLOT_FILES", "SUITE_PLOT_FILES", "history_figure", "plot_figures",
           "render_history", "render_plots", "render_suite_plots", "suite_figures"]

logger = logging.getLogger(__name__)

#: File name of each plot, by the key ``render_plots`` returns it under.
PLOT_FILES = {
    "returns": "returns_hist.png",
    "lengths": "lengths_hist.png",
    "return_by_episode": "return_by_episode.png",
    "actions": "actions.png",
    "ci_rounds": "ci_halfwidth_by_round.png",
}

_SIZE = (8.0, 4.8)
_DPI = 110
_BLUE = "#1f77b4"
_RED = "#d62728"
_GREY = "#555555"
_ORANGE = "#ff7f0e"
#: Discrete action spaces up to this size get one labelled tick per action.
_MAX_LABELLED_ACTIONS = 20
#: Box actions with more dimensions than this are shown as a box plot instead of violins.
_MAX_VIOLIN_DIMS = 16

FloatArray = npt.NDArray[np.float64]


def _figure(size: tuple[float, float] = _SIZE) -> tuple[Figure, Axes]:
    fig = Figure(figsize=size, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)  # attaches the Agg canvas to this figure only
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)
    return fig, ax


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png", pil_kwargs={"compress_level": 1})  # 5x faster, ~1.3x bigger
    return path


def _legend(fig: Figure, ax: Axes) -> None:
    """One legend row under the plot, so it never hides data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(handles), 4),
                   frameon=False, fontsize=9)


def _headroom(ax: Axes, factor: float = 1.12) -> None:
    """Extra space above the tallest bar for its count label."""
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * factor)


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=12,
            color=_GREY)
    ax.set_xticks([])
    ax.set_yticks([])


def _bins(values: FloatArray, integer: bool) -> list[float] | int:
    """Histogram bin edges: unit bins for small integer ranges, else numpy's 'auto', at most 60."""
    low, high = float(values.min()), float(values.max())
    if low == high:  # a single value (e.g. every CartPole episode at 500) still gets a visible bar
        half = 0.5 if integer or low == 0 else abs(low) * 0.01
        return [low - half, high + half]
    if integer and high - low <= 60:
        return [float(x) for x in np.arange(low - 0.5, high + 1.5, 1.0)]
    edges = np.histogram_bin_edges(values, bins="auto")
    return [float(x) for x in edges] if len(edges) <= 61 else 60


def _single_value_axis(ax: Axes, values: FloatArray, integer: bool) -> None:
    """When every value is the same, widen the axis around it and say so, instead of one wall."""
    low, high = float(values.min()), float(values.max())
    if low != high:
        return
    span = 5.0 if integer or low == 0 else abs(low) * 0.05
    ax.set_xlim(low - span, low + span)
    ax.text(0.02, 0.97, f"all {values.size} episodes: {_fmt(low)}", transform=ax.transAxes,
            ha="left", va="top", fontsize=10, color=_GREY)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _returns_hist(
    returns: FloatArray, scored: npt.NDArray[np.bool_],
    by_policy: npt.NDArray[np.bool_], ci: tuple[float, float] | None,
) -> Figure:
    fig, ax = _figure()
    good = returns[scored]
    ax.set_title(f"Return distribution — {good.size} scored episodes")
    ax.set_xlabel("episode return (sum of rewards, reward units)")
    ax.set_ylabel("episodes")
    if good.size == 0:
        _empty(ax, "no scored episodes: every one failed in the harness (see the failure taxonomy)")
        return fig
    integer = bool(np.all(good == np.round(good)))
    broken = scored & by_policy
    if broken.any():  # they count in the mean: show them, stacked, in their own colour
        ax.hist([returns[scored & ~by_policy], returns[broken]], bins=_bins(good, integer),
                stacked=True, color=[_BLUE, _RED], edgecolor="white",
                label=["completed", "ended by the policy (partial return, counted)"])
    else:
        ax.hist(good, bins=_bins(good, integer), color=_BLUE, edgecolor="white",
                label="completed episodes")
    mean = float(good.mean())
    if ci is not None and all(np.isfinite(ci)):
        ax.axvspan(ci[0], ci[1], color=_RED, alpha=0.18,
                   label=f"95% CI of the mean [{_fmt(ci[0])}, {_fmt(ci[1])}]")
    ax.axvline(mean, color=_RED, linewidth=2, label=f"mean {_fmt(mean)}")
    _single_value_axis(ax, good, integer)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(fig, ax)
    return fig


def _lengths_hist(lengths: FloatArray, failed: npt.NDArray[np.bool_]) -> Figure:
    fig, ax = _figure()
    ax.set_title(f"Episode length — {lengths.size} episodes ({int(failed.sum())} failed)")
    ax.set_xlabel("episode length (env steps)")
    ax.set_ylabel("episodes")
    if lengths.size == 0:
        _empty(ax, "no episodes")
        return fig
    bins = _bins(lengths, integer=True)
    if failed.any():
        ax.hist([lengths[~failed], lengths[failed]], bins=bins, stacked=True, color=[_BLUE, _RED],
                edgecolor="white", label=["completed", "failed (steps before the failure)"])
    else:
        ax.hist(lengths, bins=bins, color=_BLUE, edgecolor="white", label="completed")
    _single_value_axis(ax, lengths, True)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(fig, ax)
    return fig


def _return_by_episode(
    index: FloatArray, returns: FloatArray, failed: npt.NDArray[np.bool_],
    scored: npt.NDArray[np.bool_], ci: tuple[float, float] | None,
) -> Figure:
    fig, ax = _figure()
    ax.set_title("Return by episode index")
    ax.set_xlabel("episode index (its seed = seed ledger(base seed, index))")
    ax.set_ylabel("episode return (reward units)")
    if index.size == 0:
        _empty(ax, "no episodes")
        return fig
    size = 24.0 if index.size <= 200 else 10.0
    ax.scatter(index[~failed], returns[~failed], s=size, color=_BLUE, alpha=0.8,
               label="completed", linewidths=0)
    for mask, colour, what in ((failed & scored, _RED, "ended by the policy, counted"),
                               (failed & ~scored, _GREY, "harness failure, left out")):
        if mask.any():
            ax.scatter(index[mask], returns[mask], s=size * 2.5, color=colour, marker="x",
                       label=f"{what} ({int(mask.sum())}, partial return)")
    good = returns[scored]
    if good.size:
        mean = float(good.mean())
        ax.axhline(mean, color=_GREY, linestyle="--", linewidth=1.2,
                   label=f"mean of {good.size} scored {_fmt(mean)}")
        if ci is not None and all(np.isfinite(ci)):
            ax.axhspan(ci[0], ci[1], color=_GREY, alpha=0.15, label="95% CI of the mean")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(fig, ax)
    return fig


def _actions_discrete(ax: Axes, actions: Mapping[str, Any]) -> None:
    counts = np.asarray(actions["counts"], dtype=np.float64)
    start = int(actions.get("start", 0))
    total = counts.sum()
    if counts.size == 0 or total == 0:
        _empty(ax, "no steps replayed")
        return
    labels = np.arange(start, start + counts.size)
    share = counts / total if total else counts
    ax.bar(labels, share, color=_BLUE, edgecolor="white", width=0.85)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("action (Discrete index)")
    ax.set_ylabel("share of steps")
    if counts.size <= _MAX_LABELLED_ACTIONS:
        ax.set_xticks(labels)
        for x, c, s in zip(labels, counts, share, strict=True):
            if c:
                ax.annotate(f"{int(c)}", (x, s), ha="center", va="bottom", fontsize=8,
                            xytext=(0, 2), textcoords="offset points")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=20))
    ax.set_xlim(start - 0.6, start + counts.size - 0.4)
    _headroom(ax)
    unused = int((counts == 0).sum())
    if unused:
        ax.set_xlabel(f"action (Discrete index) — {unused} of {counts.size} never taken")


def _actions_box(ax: Axes, actions: Mapping[str, Any]) -> None:
    samples = np.asarray(actions["samples"], dtype=np.float64)
    if samples.size == 0:  # before the reshape: numpy cannot size the -1 of an empty (0, dims)
        _empty(ax, "no steps replayed")
        return
    samples = samples.reshape(samples.shape[0], -1) if samples.ndim != 1 else samples[:, None]
    dims = samples.shape[1]
    positions = np.arange(dims)
    columns = [samples[:, d][np.isfinite(samples[:, d])] for d in range(dims)]
    if dims <= _MAX_VIOLIN_DIMS and all(c.size > 1 and np.ptp(c) > 0 for c in columns):
        parts = ax.violinplot(columns, positions=positions, showmedians=True, showextrema=False,
                              widths=0.8)
        for body in parts["bodies"]:  # type: ignore[attr-defined]
            body.set_facecolor(_BLUE)
            body.set_alpha(0.55)
        parts["cmedians"].set_color(_GREY)
    else:
        ax.boxplot(columns, positions=positions, widths=0.6, showfliers=False)
    names = list(actions.get("labels") or [f"dim {d}" for d in range(dims)])
    # Saturation at the bounds is the usual Box-action pathology (a clipped, overconfident policy),
    # so the share of steps at a bound goes under each dimension's name.
    at_bound = np.zeros(dims)
    label = "action-space bounds"
    for key in ("low", "high"):
        if key not in actions:
            continue
        bound = np.broadcast_to(np.asarray(actions[key], dtype=np.float64).reshape(-1), (dims,))
        for d in np.flatnonzero(np.isfinite(bound)):
            ax.hlines(bound[d], d - 0.45, d + 0.45, colors=_RED, linestyles="--", linewidth=1.5,
                      label=label, zorder=3)
            label = "_nolegend_"
            if columns[d].size:
                at_bound[d] += float(np.mean(columns[d] == bound[d]))
    if "low" in actions or "high" in actions:
        names = [f"{n}\n{share:.0%} at a bound" for n, share in zip(names, at_bound, strict=True)]
    ax.set_xticks(positions)
    ax.set_xticklabels(names, rotation=45 if dims > 8 else 0, ha="right" if dims > 8 else "center",
                       fontsize=9)
    ax.set_xlabel("action dimension")
    ax.set_ylabel("action value (action-space units)")


def _actions(actions: Mapping[str, Any]) -> Figure:
    fig, ax = _figure()
    kind = actions.get("kind")
    steps = actions.get("steps")
    episodes = actions.get("episodes")
    detail = ", ".join(
        part for part in (
            f"{steps} steps" if steps is not None else "",
            f"{episodes} replayed episodes" if episodes is not None else "",
        ) if part
    )
    title = "Action distribution" + (f" — {detail}" if detail else "")
    note = actions.get("note")
    if note:
        fig.suptitle(title)
        ax.set_title(str(note), fontsize=9, color=_GREY)
    else:
        ax.set_title(title)
    if kind == "Discrete":
        _actions_discrete(ax, actions)
    elif kind == "Box":
        _actions_box(ax, actions)
    else:
        raise ValueError(f"Unknown action kind {kind!r}. Choose 'Discrete' (counts) or 'Box' (samples).")
    _legend(fig, ax)
    return fig


def _ci_rounds(rounds: Sequence[Mapping[str, Any]], target: float | None) -> Figure:
    fig, ax = _figure()
    ax.set_title("Adaptive evaluation: 95% CI half-width after each round")
    ax.set_xlabel("episodes evaluated (cumulative)")
    ax.set_ylabel("CI half-width of the mean (reward units)")
    if not rounds:
        _empty(ax, "no rounds")
        return fig
    episodes = np.array([float(r["episodes"]) for r in rounds])
    width = np.array([float(r["halfwidth"]) for r in rounds])
    finite = np.isfinite(width)
    ax.plot(episodes[finite], width[finite], marker="o", color=_BLUE, label="CI half-width")
    if not finite.all():
        # A round with fewer than two completed episodes has no interval (infinite half-width).
        ax.scatter(episodes[~finite], np.zeros(int((~finite).sum())), marker="x", color=_GREY,
                   label="no CI yet (< 2 completed episodes)", zorder=3)
    for r, x, y, ok in zip(rounds, episodes, width, finite, strict=True):
        ax.annotate(f"round {r.get('round', '?')}", (x, y if ok else 0.0), xytext=(4, 6),
                    textcoords="offset points", fontsize=8, color=_GREY)
    span = float(episodes.max() - episodes.min()) or max(1.0, float(episodes.max()))
    ax.set_xlim(float(episodes.min()) - 0.06 * span, float(episodes.max()) + 0.12 * span)
    raw_target = target if target is not None else rounds[-1].get("target")
    goal = float(raw_target) if raw_target is not None else math.nan
    if math.isfinite(goal):
        ax.axhline(goal, color=_ORANGE, linestyle="--", label=f"target {_fmt(goal)}")
    top = float(width[finite].max()) if finite.any() else 1.0
    ax.set_ylim(0, max(top, goal if math.isfinite(goal) else 0.0) * 1.15)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(fig, ax)
    return fig


def render_plots(
    table: pa.Table,
    out_dir: Path,
    *,
    actions: Mapping[str, Any] | None = None,
    rounds: Sequence[Mapping[str, Any]] | None = None,
    ci: tuple[float, float] | None = None,
    target_halfwidth: float | None = None,
) -> dict[str, Path]:
    """Write the evaluation's PNG plots to ``out_dir``; returns ``{key: path}`` (see ``PLOT_FILES``).

    The figures are :func:`plot_figures`'s (same arguments), each saved as ``PLOT_FILES[key]``.
    """
    figures = plot_figures(table, actions=actions, rounds=rounds, ci=ci,
                           target_halfwidth=target_halfwidth)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = {key: _save(fig, out_dir / PLOT_FILES[key]) for key, fig in figures.items()}
    logger.debug("wrote %d plots to %s", len(out), out_dir)
    return out


def plot_figures(
    table: pa.Table,
    *,
    actions: Mapping[str, Any] | None = None,
    rounds: Sequence[Mapping[str, Any]] | None = None,
    ci: tuple[float, float] | None = None,
    target_halfwidth: float | None = None,
) -> dict[str, Figure]:
    """The evaluation's plots as matplotlib figures (Agg canvas, no pyplot), by ``PLOT_FILES`` key.

    ``table`` is the episode table (``episode_index``, ``return``, ``length``, ``end_reason`` are
    read). Always drawn: ``returns`` (the scored episodes of ``evalfleet.scoring``: completed
    and ended by the policy, stacked; with the mean and, when ``ci`` =
    ``(low, high)`` is given, the 95% CI of the mean), ``lengths`` (completed and failed stacked)
    and ``return_by_episode`` (failures as red crosses at their partial return).

    ``actions`` adds the ``actions`` plot: ``{"kind": "Discrete", "counts": [...], "start": 0}``
    or ``{"kind": "Box", "samples": array (N, d), "low": ..., "high": ..., "labels": [...]}``,
    optionally with ``steps``, ``episodes`` and ``note`` for the title and a footnote (see
    ``evalfleet.replay.action_summary``). ``rounds`` (``[{"round", "episodes", "halfwidth"}]``,
    cumulative episodes) adds ``ci_rounds``, with ``target_halfwidth`` as a dashed line.
    Tests read the plotted data back from the figures' artists.
    """
    if table.num_rows:
        table = table.sort_by("episode_index")
    index = np.asarray(table.column("episode_index").to_numpy(), dtype=np.float64)
    returns = np.asarray(table.column("return").to_numpy(), dtype=np.float64)
    lengths = np.asarray(table.column("length").to_numpy(), dtype=np.float64)
    failed = failed_mask(table)
    kinds = outcomes(table)
    out: dict[str, Figure] = {
        "returns": _returns_hist(returns, kinds.scored, kinds.policy, ci),
        "lengths": _lengths_hist(lengths, failed),
        "return_by_episode": _return_by_episode(index, returns, failed, kinds.scored, ci),
    }
    if actions is not None:
        out["actions"] = _actions(actions)
    if rounds is not None:
        out["ci_rounds"] = _ci_rounds(rounds, target_halfwidth)
    return out


#: File name of a training run's curve (``render_history``).
HISTORY_FILE = "history.png"
_VERDICT_MARKERS = {"first": ("o", _BLUE), "new_best": ("*", "#2ca02c"),
                    "not_distinguishable": ("o", _GREY), "regression": ("v", _RED),
                    "no_paired_episodes": ("x", _GREY), "protocol_changed": ("s", _ORANGE)}


def _nums(rows: Sequence[Mapping[str, Any]], key: str) -> FloatArray:
    return np.array([math.nan if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


def history_figure(rows: Sequence[Mapping[str, Any]], title: str = "") -> Figure:
    """Return (mean, 95% CI, verdict markers), success rate (CI), failure rate, episode length.

    ``rows`` are curve rows (``evalfleet.history.curve_row``), one per step, in step order.
    """
    fig = Figure(figsize=(9.0, 7.2), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True)
    steps = _nums(rows, "step")
    ax = axes[0][0]
    mean, lo, hi = _nums(rows, "reward"), _nums(rows, "reward_ci_low"), _nums(rows, "reward_ci_high")
    ax.fill_between(steps, lo, hi, color=_BLUE, alpha=0.2, label="95% CI")
    ax.plot(steps, mean, color=_BLUE, label="mean return")
    for verdict, (marker, colour) in _VERDICT_MARKERS.items():
        at = [i for i, r in enumerate(rows) if r.get("verdict") == verdict]
        if at:
            ax.scatter(steps[at], mean[at], marker=marker, color=colour, s=60, zorder=3,
                       label=verdict.replace("_", " "))
    alarmed = [i for i, r in enumerate(rows) if r.get("alarms")]
    if alarmed:
        ax.scatter(steps[alarmed], mean[alarmed], marker="s", facecolors="none", edgecolors=_RED,
                   s=140, zorder=4, label="alarm")
    ax.set_title("return")
    ax.set_ylabel("episode return")
    ax.legend(fontsize=7, loc="best")
    ax = axes[0][1]
    rate = _nums(rows, "success_rate")
    if np.isfinite(rate).any():
        ax.fill_between(steps, _nums(rows, "success_ci_low"), _nums(rows, "success_ci_high"),
                        color="#2ca02c", alpha=0.2, label="95% CI (Wilson)")
        ax.plot(steps, rate, color="#2ca02c", marker="o", label="success rate")
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "the env reports no success", ha="center", va="center",
                transform=ax.transAxes, color=_GREY)
    ax.set_title("success rate")
    ax = axes[1][0]
    fails = _nums(rows, "failure_rate")
    ax.plot(steps, fails, color=_RED, marker="o")
    top = float(np.nanmax(fails)) if np.isfinite(fails).any() else 0.0
    ax.set_ylim(0.0, max(0.05, 1.1 * top))  # a rate: never below 0, 5% visible when all is well
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title("failure rate")
    ax.set_xlabel("training step")
    ax = axes[1][1]
    ax.plot(steps, _nums(rows, "episode_length"), color=_ORANGE, marker="o")
    ax.set_title("mean episode length")
    ax.set_ylabel("steps")
    ax.set_xlabel("training step")
    for a in (axes[0][0], axes[0][1], axes[1][0], axes[1][1]):
        a.grid(True, alpha=0.3)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    return fig


def render_history(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Save ``history_figure(rows)`` as a PNG at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(history_figure(rows, title), path)


#: File name of each suite plot, by the key ``render_suite_plots`` returns it under.
SUITE_PLOT_FILES = {
    "performance_profile": "suite_performance_profile.png",
    "aggregate_intervals": "suite_aggregate_intervals.png",
    "task_scores": "suite_task_scores.png",
}
_AGGREGATE_LABELS = {"mean": "Mean", "median": "Median", "iqm": "IQM", "optimality_gap": "Optimality gap"}


def _profile(curves: Mapping[str, Mapping[str, Any]], score: str) -> Figure:
    """Fraction of runs x tasks scores above each threshold, with 95% bands (one per policy)."""
    fig, ax = _figure()
    for (name, profile), colour in zip(curves.items(), (_BLUE, _ORANGE), strict=False):
        taus = np.asarray(profile["taus"], dtype=np.float64)
        ax.plot(taus, profile["point"], color=colour, label=name)
        ax.fill_between(taus, profile["low"], profile["high"], color=colour, alpha=0.25,
                        label=f"{name}: 95% CI")
    ax.set_ylim(-0.02, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(f"{score} threshold τ")
    ax.set_ylabel("fraction of episodes with score > τ")
    ax.set_title("Performance profile (run-score distribution)")
    _legend(fig, ax)
    return fig


def _intervals(aggregates: Mapping[str, Mapping[str, Any]]) -> Figure:
    """One panel per aggregate: the point and its 95% interval, one row per policy."""
    fig = Figure(figsize=(10.0, 2.2 + 0.4 * len(aggregates)), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(_AGGREGATE_LABELS), sharey=True)
    names = list(aggregates)
    for ax, (key, label) in zip(axes, _AGGREGATE_LABELS.items(), strict=True):
        ax.grid(True, axis="x", alpha=0.3)
        for row, (name, colour) in enumerate(zip(names, (_BLUE, _ORANGE), strict=False)):
            est = aggregates[name][key]
            low, high = est["ci"]
            ax.barh(row, high - low, left=low, height=0.6, color=colour, alpha=0.6)
            ax.plot([est["point"]] * 2, [row - 0.3, row + 0.3], color="black", lw=2)
        ax.set_title(label)
        ax.set_yticks(range(len(names)), names)
    fig.supxlabel("score (95% stratified-bootstrap CI; black: point estimate)")
    return fig


def _task_bars(tasks: Sequence[Mapping[str, Any]], score: str) -> Figure:
    """Each task's mean score with its 95% CI, tasks in suite order."""
    fig, ax = _figure((max(6.0, 0.6 * len(tasks) + 2), 4.8))
    x = np.arange(len(tasks))
    means = np.asarray([t["score_mean"] if t["score_mean"] is not None else np.nan for t in tasks])
    lows = np.asarray([t["score_ci"][0] for t in tasks], dtype=np.float64)
    highs = np.asarray([t["score_ci"][1] for t in tasks], dtype=np.float64)
    err = np.vstack([np.maximum(means - lows, 0), np.maximum(highs - means, 0)])
    ax.bar(x, means, color=_BLUE, alpha=0.8, label="mean score")
    ax.errorbar(x, means, yerr=err, fmt="none", ecolor="black", capsize=4, label="95% CI")
    ax.set_xticks(x, [str(t["name"]) for t in tasks], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(score)
    ax.set_title("Per-task scores")
    _legend(fig, ax)
    return fig


def suite_figures(report: Mapping[str, Any]) -> dict[str, Figure]:
    """The suite's figures (a ``SuiteReport`` as a dict), by ``SUITE_PLOT_FILES`` key.

    ``performance_profile``: the policy's (and the baseline's) run-score distribution with 95%
    bands; ``aggregate_intervals``: mean, median, IQM and optimality gap with their intervals;
    ``task_scores``: per-task mean scores with 95% CIs.
    """
    score = "normalised score" if report["normalised"] else "return (not normalised)"
    curves = {"policy": report["profile"]}
    aggregates = {"policy": report["aggregates"]}
    if report.get("baseline"):
        curves["baseline"] = report["baseline"]["profile"]
        aggregates["baseline"] = report["baseline"]["aggregates"]
    return {
        "performance_profile": _profile(curves, score),
        "aggregate_intervals": _intervals(aggregates),
        "task_scores": _task_bars(report["tasks"], score),
    }


def render_suite_plots(report: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write :func:`suite_figures` to ``out_dir``; returns ``{key: path}``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {key: _save(fig, out_dir / SUITE_PLOT_FILES[key]) for key, fig in suite_figures(report).items()}
