"""The PNG plots: written, named as documented, robust to degenerate tables, no global state."""

import matplotlib
import numpy as np
import pytest

from evalfleet.plots import PLOT_FILES, render_plots
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
