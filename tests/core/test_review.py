"""Failure clustering, the choice of episodes to replay, and the report page / markdown."""

import base64
import re

import numpy as np
import pytest

from evalfleet.models import EvalRequest
from evalfleet.plots import render_plots
from evalfleet.records import EpisodeRecord, records_to_table
from evalfleet.report import aggregate
from evalfleet.review import (
    choose_episodes,
    cluster_failures,
    error_signature,
    report_markdown,
    report_page,
)


def _table(rows):
    """rows: (return, length, end_reason, error); seeds are 1000 + index."""
    records = [
        EpisodeRecord("req", "sha", "env", "spec", i, 1000 + i, ret, length, reason, error,
                      None, 0.01, "w0", f"s{i}", "inprocess")
        for i, (ret, length, reason, error) in enumerate(rows)
    ]
    return records_to_table(records)


def _random_table(rng, n, fail_rate):
    rows = []
    for _ in range(n):
        if rng.random() < fail_rate:
            reason = str(rng.choice(["env_error", "policy_error", "timeout", "invalid_reward"]))
            rows.append((float(rng.normal()), int(rng.integers(0, 50)), reason, "X: y (at a.py:1)"))
        else:
            reason = str(rng.choice(["terminated", "truncated"]))
            rows.append((float(rng.integers(0, 20)), int(rng.integers(1, 50)), reason, None))
    return _table(rows)


OK = (10.0, 10, "terminated", None)


def test_errors_differing_only_in_numbers_cluster_together_and_locations_do_not():
    table = _table([
        OK,
        (1.0, 3, "env_error", "RuntimeError: boom at step 3 (at myenv.py:42)"),
        OK,
        (7.5, 17, "env_error", "RuntimeError: boom at step 17 (at myenv.py:42)"),
        (2.0, 4, "env_error", "RuntimeError: boom at step 4 (at other.py:10)"),
        (0.0, 9, "env_error", "RuntimeError: boom at step 9 (at myenv.py:42)"),
        (3.0, 5, "crashed", "killed by signal 11 (SIGSEGV)"),
        (3.0, 8, "crashed", "killed by signal 11 (SIGSEGV)"),
        (3.0, 8, "crashed", "killed by signal 9 (SIGKILL)"),
        (0.0, 0, "timeout", "episode exceeded the 60.0 s wall-clock limit after 1234 steps"),
        (0.0, 0, "timeout", "episode exceeded the 30 s wall-clock limit after 77 steps"),
        (1.0, 1, "invalid_reward", "reward nan at step 2"),
        (1.0, 1, "policy_error", None),
    ])
    clusters = cluster_failures(table, max_examples=2)
    by_key = {(c["reason"], c["signature"]): c for c in clusters}

    same_bug = by_key[("env_error", "RuntimeError at myenv.py:42")]
    assert same_bug["count"] == 3
    assert same_bug["example_indices"] == [1, 3]  # lowest indices, capped at max_examples
    assert same_bug["example_seeds"] == [1001, 1003]
    assert same_bug["example_error"] == "RuntimeError: boom at step 3 (at myenv.py:42)"
    assert by_key[("env_error", "RuntimeError at other.py:10")]["count"] == 1

    assert by_key[("crashed", "killed by signal # (SIGSEGV)")]["count"] == 2
    assert by_key[("crashed", "killed by signal # (SIGKILL)")]["count"] == 1
    timeouts = [c for c in clusters if c["reason"] == "timeout"]
    assert len(timeouts) == 1 and timeouts[0]["count"] == 2
    assert by_key[("policy_error", "(no error text)")]["count"] == 1
    assert sum(c["count"] for c in clusters) == 11  # every failure, no completed episode
    counts = [c["count"] for c in clusters]
    assert counts == sorted(counts, reverse=True)
    assert clusters[0]["signature"] == "RuntimeError at myenv.py:42"


def test_clusters_do_not_depend_on_row_order():
    rng = np.random.default_rng(3)
    table = _random_table(rng, 60, 0.4)
    shuffled = table.take(rng.permutation(table.num_rows))
    assert cluster_failures(shuffled) == cluster_failures(table)
    assert cluster_failures(_table([OK, OK])) == []
    assert cluster_failures(_table([])) == []


@pytest.mark.parametrize(
    "text,signature",
    [
        ("ValueError: bad value 3.5e-3 (at env.py:7)", "ValueError at env.py:7"),
        ("numpy.linalg.LinAlgError: Singular matrix", "numpy.linalg.LinAlgError: Singular matrix"),
        ("KeyError: 'slot 12'", "KeyError: 'slot #'"),
        ("action [1.5, -2] not in Box(-1.0, 1.0, (2,), float32)",
         "action [#, #] not in Box(#, #, (#,), float32)"),
        ("object at 0x7f3a2b1c not callable", "object at 0x# not callable"),
        ("MemoryError: (at big.py:3)", "MemoryError at big.py:3"),
        ("", "(no error text)"),
        (None, "(no error text)"),
    ],
)
def test_error_signature(text, signature):
    assert error_signature(text) == signature


def test_choose_episodes_takes_worst_best_failed_then_a_seeded_sample():
    table = _table([
        (5.0, 5, "terminated", None),
        (1.0, 5, "terminated", None),   # worst
        (9.0, 5, "truncated", None),    # best
        (0.0, 2, "env_error", "E: x"),  # failed (lower return than the worst: not the "worst")
        (1.0, 5, "terminated", None),   # ties with the worst: the lower index wins
        (9.0, 5, "terminated", None),
        (3.0, 5, "terminated", None),
        (4.0, 2, "policy_error", "E: y"),
        (6.0, 5, "terminated", None),
    ])
    assert choose_episodes(table, 4, seed=0) == [1, 2, 3, 7]
    assert choose_episodes(table, 1, seed=0) == [1]
    assert choose_episodes(table, 0, seed=0) == []
    everything = choose_episodes(table, 100, seed=0)
    assert sorted(everything) == list(range(9))
    assert everything[:4] == [1, 2, 3, 7]
    assert everything[4:] == sorted(everything[4:])


@pytest.mark.parametrize("case", range(20))
def test_choose_episodes_properties(case):
    rng = np.random.default_rng(case)
    table = _random_table(rng, int(rng.integers(1, 80)), float(rng.choice([0.0, 0.1, 0.6, 1.0])))
    k = int(rng.integers(1, 30))
    chosen = choose_episodes(table, k, seed=case)
    rows = table.to_pylist()
    failed = [r["episode_index"] for r in rows if r["end_reason"] not in ("terminated", "truncated")]
    done = [r for r in rows if r["end_reason"] in ("terminated", "truncated")]

    assert len(chosen) == min(k, len(rows)) and len(set(chosen)) == len(chosen)
    assert chosen == choose_episodes(table.take(rng.permutation(len(rows))), k, seed=case)
    must = []
    if done:
        must.append(min(done, key=lambda r: (r["return"], r["episode_index"]))["episode_index"])
        must.append(max(done, key=lambda r: (r["return"], -r["episode_index"]))["episode_index"])
    must += failed
    must = list(dict.fromkeys(must))
    assert chosen[: min(k, len(must))] == must[:k]


def _report(table):
    request = EvalRequest(env="evalfleet/Inventory-v0", policy="envs.reference_policies:x",
                          episodes=table.num_rows, seed=0)
    return aggregate(request, table, env_spec={"env_id": request.env}, env_spec_hash="spec",
                     policy={"sha256": "ab" * 32}, isolation="inprocess", timings={"run": 1.0},
                     cache={"status": "miss"}, run_seconds=1.0)


def _failing_table():
    rng = np.random.default_rng(0)
    rows = [(float(rng.normal(100, 10)), int(rng.integers(20, 90)), "terminated", None)
            for _ in range(40)]
    rows[5] = (3.0, 4, "env_error", "RuntimeError: <bad> & boom at step 4 (at inv.py:42)")
    rows[9] = (8.0, 9, "env_error", "RuntimeError: <bad> & boom at step 9 (at inv.py:42)")
    rows[20] = (0.0, 0, "crashed", "killed by signal 11 (SIGSEGV)")
    return _table(rows)


def test_report_page_is_self_contained_with_summary_taxonomy_and_plots(tmp_path):
    table = _failing_table()
    report = _report(table)
    clusters = cluster_failures(table)
    plots = render_plots(table, tmp_path / "plots", ci=report.ci)
    page = report_page(report, clusters, plots, tmp_path / "report.html",
                       notes=["replay mismatch (non-determinism): episode 3"])
    text = page.read_text()

    assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    low, high = report.ci
    for number in (report.returns["mean"], low, high):
        assert f"{number:.4g}" in text
    assert "7.50%" in text  # failure rate 3/40
    assert "harness_failures" in text  # the harness-fault alarm
    assert "left out (harness failure; lowers coverage)" in text and "coverage" in text
    assert "replay mismatch (non-determinism): episode 3" in text
    assert "RuntimeError at inv.py:42" in text and "killed by signal # (SIGSEGV)" in text
    assert "#5 (seed 1005), #9 (seed 1009)" in text
    assert "<bad>" not in text and "&lt;bad&gt; &amp; boom" in text  # error text is escaped
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == len(plots) == 3
    assert all(base64.b64decode(b).startswith(b"\x89PNG") for b in images)
    assert "src=\"plots/" not in text and str(tmp_path) not in text


def test_report_page_links_or_embeds_videos(tmp_path, monkeypatch):
    table = _table([OK, OK])
    report = _report(table)
    gif = tmp_path / "videos" / "episode-000001-seed-1001.gif"
    gif.parent.mkdir()
    gif.write_bytes(b"GIF89a" + b"\0" * 100)
    mp4 = tmp_path / "videos" / "episode-000000-seed-1000.mp4"
    mp4.write_bytes(b"\0" * 100)
    page = report_page(report, [], {}, tmp_path / "report.html", videos={1: gif, 0: mp4})
    text = page.read_text()
    assert "data:image/gif;base64," in text and "data:video/mp4;base64," in text
    assert "No failed episodes" in text and "No alarms." in text

    monkeypatch.setattr("evalfleet.review.EMBED_VIDEO_LIMIT", 10)
    text = report_page(report, [], {}, tmp_path / "r2.html", videos={1: gif}).read_text()
    assert 'src="videos/episode-000001-seed-1001.gif"' in text


def test_report_markdown_has_summary_alarms_and_taxonomy():
    table = _failing_table()
    report = _report(table)
    text = report_markdown(report, cluster_failures(table))
    assert f"{report.returns['mean']:.4g}" in text
    assert "## Alarms" in text and "## Failure taxonomy" in text
    assert "| env_error | `RuntimeError at inv.py:42` | 2 | #5 (seed 1005), #9 (seed 1009) |" in text
    assert "&lt;bad&gt; &amp; boom" in text and "<bad>" not in text
    assert "No failed episodes." in report_markdown(_report(_table([OK])), [])


def test_report_page_escapes_every_user_value(tmp_path):
    table = _failing_table()
    hostile = "<script>alert(1)</script>"
    report = _report(table).model_copy(update={
        "env_id": f"evil/{hostile}-v0", "training_run_id": hostile, "step": 7,
        "alarms": [f"alarm {hostile}"], "manifest": {"config": f"</pre>{hostile}"},
    })
    clusters = cluster_failures(table)
    clusters[0] = {**clusters[0], "signature": hostile, "example_error": hostile}
    text = report_page(report, clusters, {}, tmp_path / "report.html", notes=[hostile]).read_text()
    assert "<script>" not in text and text.count("</pre>") == 1 and "&lt;/pre&gt;" in text
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    # title, heading, meta line, alarm, note, summary (env, alarms), signature, error, manifest
    assert text.count(escaped) == 10, text.count(escaped)
    assert "training run <code>" in text and " · step 7</p>" in text
    assert "<strong>ALARM</strong> alarm &lt;script&gt;" in text


def test_a_long_error_message_keeps_its_location_and_its_cluster():
    """An env raising with an array's repr in its message: the text was cut at 500 characters
    after the location was appended, so the location was lost and every episode's numbers made
    a cluster of its own."""
    from evalfleet.sandbox.slots import ERROR_CHARS, error_text

    def fail(state: np.ndarray) -> None:
        raise ValueError(f"invalid state {state!r}")

    texts = []
    for seed in range(5):
        try:
            fail(np.random.default_rng(seed).normal(size=64))
        except ValueError as err:
            texts.append(error_text(err))
    assert all(len(t) <= ERROR_CHARS and t.endswith(")") and "(at test_review.py:" in t
               for t in texts), texts[0][-80:]
    assert {error_signature(t) for t in texts} == {error_signature(texts[0])}
    assert error_signature(texts[0]).startswith("ValueError at test_review.py:")
