"""The PNG plots: written, named as documented, robust to degenerate tables, no global state."""

import matplotlib
import numpy as np
import pytest
from matplotlib.colors import to_hex

from evalfleet.plots import PLOT_FILES, plot_figures, render_plots
from evalfleet.records import EpisodeRecord, records_to_table

PNG = b"\x89PNG\r\n\x1a\n"


def _table(rows):
    return records_to_table(
        EpisodeRecord("req", "sha", "env", "spec", i, 7 + i, ret, length, reason, error, None, 0.0,
                      "w", "s", "inprocess")
        for i, (ret, length, reason, error) in enumerate(rows)
    )


def _episodes(n=120, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        if i % 17 == 5:
            rows.append((float(rng.normal(20, 5)), int(rng.integers(1, 30)), "env_error", "E: x"))
        else:
            rows.append((float(rng.normal(100, 15)), int(rng.integers(30, 200)), "terminated", None))
    return _table(rows)


def _is_png(path):
    data = path.read_bytes()
    return data.startswith(PNG) and len(data) > 5_000


def test_every_plot_is_a_png_with_its_documented_name(tmp_path):
    actions = {"kind": "Discrete", "counts": [5, 0, 40, 12], "steps": 57, "episodes": 3}
    rounds = [{"round": r, "episodes": 50 * r, "halfwidth": 8.0 / r ** 0.5} for r in (1, 2, 3)]
    plots = render_plots(_episodes(), tmp_path, actions=actions, rounds=rounds, ci=(95.0, 104.0),
                         target_halfwidth=4.0)
    assert set(plots) == set(PLOT_FILES)
    for key, path in plots.items():
        assert path == tmp_path / PLOT_FILES[key]
        assert _is_png(path), key


def test_only_the_always_plots_without_actions_or_rounds(tmp_path):
    plots = render_plots(_episodes(), tmp_path / "new" / "dir")
    assert set(plots) == {"returns", "lengths", "return_by_episode"}
    assert all(_is_png(p) for p in plots.values())


def test_box_actions_and_many_discrete_actions(tmp_path):
    rng = np.random.default_rng(1)
    samples = np.clip(rng.normal(0, 1, size=(500, 3)), -1, 1)
    box = {"kind": "Box", "samples": samples, "low": [-1, -1, -1], "high": [1, 1, 1]}
    assert _is_png(render_plots(_episodes(), tmp_path / "box", actions=box)["actions"])
    wide = {"kind": "Box", "samples": rng.normal(size=(50, 24))}  # box plot, no bounds
    assert _is_png(render_plots(_episodes(), tmp_path / "wide", actions=wide)["actions"])
    many = {"kind": "Discrete", "counts": list(rng.integers(0, 9, size=50)), "note": "biased sample"}
    assert _is_png(render_plots(_episodes(), tmp_path / "many", actions=many)["actions"])
    with pytest.raises(ValueError, match="Unknown action kind 'MultiBinary'"):
        render_plots(_episodes(), tmp_path / "bad", actions={"kind": "MultiBinary"})


@pytest.mark.parametrize(
    "rows",
    [
        [],
        [(0.0, 3, "env_error", "E: x")] * 4,                     # nothing completed
        [(500.0, 500, "truncated", None)] * 30,                  # one value everywhere
        [(1.0, 1, "terminated", None)],
    ],
    ids=["empty", "all-failed", "constant", "single"],
)
def test_degenerate_tables_still_give_plots(tmp_path, rows):
    plots = render_plots(_table(rows), tmp_path, ci=(float("nan"), float("nan")),
                         actions={"kind": "Discrete", "counts": [0, 0]}, rounds=[])
    assert all(_is_png(p) for p in plots.values())


def test_adaptive_rounds_without_an_interval_yet(tmp_path):
    rounds = [{"round": 1, "episodes": 1, "halfwidth": float("inf")},
              {"round": 2, "episodes": 40, "halfwidth": 3.5}]
    plots = render_plots(_episodes(), tmp_path, rounds=rounds, target_halfwidth=2.0)
    assert _is_png(plots["ci_rounds"])
    only = render_plots(_episodes(), tmp_path / "inf", rounds=rounds[:1])
    assert _is_png(only["ci_rounds"])


def test_no_pyplot_figures_or_backend_change_leak(tmp_path):
    import matplotlib.pyplot as plt

    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    render_plots(_episodes(), tmp_path, actions={"kind": "Discrete", "counts": [1, 2]})
    assert plt.get_fignums() == figures
    assert matplotlib.get_backend() == backend


# --- What the plots show: the data read back from the figures' artists -----------------------


def _columns(table):
    rows = table.sort_by("episode_index").to_pylist()
    index = np.array([r["episode_index"] for r in rows], dtype=float)
    returns = np.array([r["return"] for r in rows])
    lengths = np.array([r["length"] for r in rows], dtype=float)
    reasons = np.array([r["end_reason"] for r in rows])
    return index, returns, lengths, reasons


def _bars(container):
    """(heights, bottoms, edges) of one histogram's bars."""
    patches = list(container)
    heights = np.array([p.get_height() for p in patches])
    bottoms = np.array([p.get_y() for p in patches])
    edges = np.array([p.get_x() for p in patches] + [patches[-1].get_x() + patches[-1].get_width()])
    return heights, bottoms, edges


def _labelled(artists, start):
    [artist] = [a for a in artists if a.get_label().startswith(start)]
    return artist


def test_returns_histogram_counts_the_scored_returns_with_mean_and_ci():
    table = _episodes()
    _, returns, _, reasons = _columns(table)
    scored = returns[reasons == "terminated"]  # env_error is a harness failure: left out
    ax = plot_figures(table, ci=(95.0, 104.0))["returns"].axes[0]
    [bars] = ax.containers
    heights, _, edges = _bars(bars)
    np.testing.assert_allclose(edges, np.histogram_bin_edges(scored, bins="auto"))
    np.testing.assert_array_equal(heights, np.histogram(scored, bins=edges)[0])
    assert heights.sum() == scored.size == 113
    [mean] = ax.lines
    np.testing.assert_array_equal(mean.get_xdata(), [scored.mean(), scored.mean()])
    assert mean.get_label() == f"mean {scored.mean():.4g}"
    span = _labelled(ax.patches, "95% CI of the mean")
    assert (span.get_x(), span.get_x() + span.get_width()) == (95.0, 104.0)
    assert ax.get_title() == "Return distribution — 113 scored episodes"


def test_returns_histogram_stacks_policy_failures_on_top():
    rng = np.random.default_rng(2)
    rows = [(float(rng.integers(0, 30)), 10, "terminated", None) for _ in range(40)]
    rows += [(float(rng.integers(0, 10)), 3, "policy_error", "E: p") for _ in range(6)]
    rows += [(99.0, 3, "env_error", "E: e")]  # left out: no bar at 99
    _, returns, _, reasons = _columns(_table(rows))
    ax = plot_figures(_table(rows))["returns"].axes[0]
    done, broken = ax.containers
    done_h, _, edges = _bars(done)
    broken_h, broken_y, _ = _bars(broken)
    scored = returns[reasons != "env_error"]
    # unit bins for integer returns
    np.testing.assert_allclose(edges, np.arange(scored.min() - 0.5, scored.max() + 1.0, 1.0))
    np.testing.assert_array_equal(done_h, np.histogram(returns[reasons == "terminated"], bins=edges)[0])
    np.testing.assert_array_equal(broken_h, np.histogram(returns[reasons == "policy_error"], bins=edges)[0])
    np.testing.assert_array_equal(broken_y, done_h)  # stacked
    [mean] = ax.lines
    assert mean.get_xdata()[0] == returns[reasons != "env_error"].mean()


def test_lengths_histogram_stacks_failed_on_completed():
    table = _episodes()
    _, _, lengths, reasons = _columns(table)
    failed = reasons != "terminated"
    ax = plot_figures(table)["lengths"].axes[0]
    done, bad = ax.containers
    done_h, _, edges = _bars(done)
    bad_h, bad_y, _ = _bars(bad)
    np.testing.assert_array_equal(done_h, np.histogram(lengths[~failed], bins=edges)[0])
    np.testing.assert_array_equal(bad_h, np.histogram(lengths[failed], bins=edges)[0])
    np.testing.assert_array_equal(bad_y, done_h)
    assert (done_h.sum(), bad_h.sum()) == (113, 7)
    assert ax.get_title() == "Episode length — 120 episodes (7 failed)"


def test_return_by_episode_places_every_episode_and_the_mean():
    table = _episodes()
    index, returns, _, reasons = _columns(table)
    ok = reasons == "terminated"
    ax = plot_figures(table, ci=(95.0, 104.0))["return_by_episode"].axes[0]
    completed = _labelled(ax.collections, "completed")
    np.testing.assert_array_equal(completed.get_offsets(), np.column_stack([index[ok], returns[ok]]))
    harness = _labelled(ax.collections, "harness failure, left out (7")
    np.testing.assert_array_equal(harness.get_offsets(), np.column_stack([index[~ok], returns[~ok]]))
    [mean] = ax.lines
    np.testing.assert_array_equal(mean.get_ydata(), [returns[ok].mean()] * 2)
    span = _labelled(ax.patches, "95% CI of the mean")
    assert (span.get_y(), span.get_y() + span.get_height()) == (95.0, 104.0)


def test_discrete_actions_show_shares_and_counts():
    actions = {"kind": "Discrete", "counts": [5, 0, 40, 12], "start": 2, "steps": 57, "episodes": 3}
    ax = plot_figures(_episodes(), actions=actions)["actions"].axes[0]
    heights, _, _ = _bars(ax.containers[0])
    np.testing.assert_allclose(heights, np.array([5, 0, 40, 12]) / 57)
    assert [p.get_x() + p.get_width() / 2 for p in ax.containers[0]] == [2, 3, 4, 5]
    assert [t.get_text() for t in ax.texts] == ["5", "40", "12"]  # no label on the unused action
    assert ax.get_xlabel() == "action (Discrete index) — 1 of 4 never taken"
    assert ax.get_title() == "Action distribution — 57 steps, 3 replayed episodes"


def test_box_actions_show_each_dimension_and_the_share_at_its_bounds():
    rng = np.random.default_rng(1)
    samples = np.clip(rng.normal(0, 1, size=(500, 3)), -1, 1)
    box = {"kind": "Box", "samples": samples, "low": [-1, -1, -1], "high": [1, 1, 1]}
    ax = plot_figures(_episodes(), actions=box)["actions"].axes[0]
    at_bound = [np.mean(samples[:, d] == -1) + np.mean(samples[:, d] == 1) for d in range(3)]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        f"dim {d}\n{share:.0%} at a bound" for d, share in enumerate(at_bound)]
    bounds = [c for c in ax.collections  # the dashed red bound markers (not the medians)
              if type(c).__name__ == "LineCollection" and to_hex(c.get_color()[0]) == "#d62728"]
    levels = sorted(float(seg[0][1]) for c in bounds for seg in c.get_segments())
    assert levels == [-1.0] * 3 + [1.0] * 3
    bodies = [c for c in ax.collections if "PolyCollection" in type(c).__name__]
    assert len(bodies) == 3  # one violin per dimension


def test_ci_rounds_plot_the_halfwidths_and_the_target():
    rounds = [{"round": 1, "episodes": 1, "halfwidth": float("inf")},
              {"round": 2, "episodes": 40, "halfwidth": 3.5},
              {"round": 3, "episodes": 80, "halfwidth": 2.5}]
    ax = plot_figures(_episodes(), rounds=rounds, target_halfwidth=2.0)["ci_rounds"].axes[0]
    width = _labelled(ax.lines, "CI half-width")
    np.testing.assert_array_equal(width.get_xdata(), [40, 80])
    np.testing.assert_array_equal(width.get_ydata(), [3.5, 2.5])
    np.testing.assert_array_equal(_labelled(ax.lines, "target 2").get_ydata(), [2.0, 2.0])
    pending = _labelled(ax.collections, "no CI yet")
    np.testing.assert_array_equal(pending.get_offsets(), [[1.0, 0.0]])
    assert [t.get_text() for t in ax.texts] == ["round 1", "round 2", "round 3"]


def test_a_constant_return_is_one_bar_and_said_in_words():
    ax = plot_figures(_table([(500.0, 500, "truncated", None)] * 30))["returns"].axes[0]
    [bars] = ax.containers
    heights, _, edges = _bars(bars)
    assert heights.tolist() == [30] and edges.tolist() == [499.5, 500.5]
    assert [t.get_text() for t in ax.texts] == ["all 30 episodes: 500"]
