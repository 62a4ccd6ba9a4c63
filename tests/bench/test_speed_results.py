"""The committed speed results: the markdown table is the JSON's, and the README cites its figures."""

import json
from pathlib import Path

from bench.speed import markdown

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_committed_table_is_rendered_from_the_committed_json():
    result = json.loads((RESULTS / "speed.json").read_text())
    assert (RESULTS / "speed.md").read_text() == markdown(result)


def test_readme_cites_the_committed_figures():
    result = json.loads((RESULTS / "speed.json").read_text())
    readme = (RESULTS.parents[1] / "README.md").read_text()
    fast = result["warm_evaluator"]["fast path"]
    assert "bench/results/speed.md" in readme
    assert f"**{fast['new_weights_median_s']:.2f} s**" in readme
    assert f"**{fast['cache_hit_median_s']:.2f} s**" in readme
    assert f"{result['cli']['server_up']['wall_s']:.1f} s with that server up" in readme


def test_a_merged_section_keeps_the_others_and_reads_against_its_own_yardstick():
    from bench.speed import merged

    before = json.loads((RESULTS / "speed.json").read_text())
    slower = {"cartpole": {"steps_per_s": 82_500.0}, "acrobot": before["calibration"]["acrobot"]}
    cli = {**before["cli"], "cache_hit": {**before["cli"]["cache_hit"], "wall_s": 2.0}}
    now = {"when": "2099-01-01 00:00 UTC", "load_avg_at_start": [0.0, 0.0, 0.0],
           "calibration": slower, "cli": cli}
    out = merged(before, now)
    assert out["acrobot"] == before["acrobot"] and out["when"] == before["when"]
    assert out["section_runs"]["cli"]["when"] == "2099-01-01 00:00 UTC"
    table = markdown(out)
    assert "(measured 2099-01-01 00:00 UTC; bare CartPole loop 82,500 steps/s then)" in table
    assert "| 2.0 s (scaled: 1.0 s) | <= 3 s |" in table  # half the targets' machine's speed
