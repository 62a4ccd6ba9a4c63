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
