"""Suite figures and page: the plotted data is the report's, names are escaped."""

import numpy as np
import pytest

from evalfleet.aggregates import summary
from evalfleet.plots import suite_figures
from evalfleet.suite import SuiteReport
from evalfleet.suite_report import suite_markdown, suite_page


def _report(baseline: bool = True) -> SuiteReport:
    rng = np.random.default_rng(0)
    scores = [rng.normal(0.5, 0.2, 20), rng.normal(0.9, 0.1, 30)]
    mine = summary(scores, reps=200)
    theirs = summary([s - 0.4 for s in scores], reps=200, taus=mine["profile"]["taus"])
    tasks = [{"name": name, "env": "CartPole-v1", "env_kwargs": {}, "episodes": len(s), "scored": len(s),
              "mean_return": float(s.mean()), "ci": [float(s.mean()) - 0.1, float(s.mean()) + 0.1],
              "normalisation": None, "score_mean": float(s.mean()),
              "score_ci": [float(s.mean()) - 0.1, float(s.mean()) + 0.1], "cache": "miss",
              "harness_fault": False, "request_id": "r", "report": "", "mlflow_run_id": ""}
             for name, s in zip(["a<b>", "c"], scores, strict=True)]
    return SuiteReport(suite="s", request_id="r", policy_sha256="ab" * 32, normalised=True, tasks=tasks,
                       aggregates=mine["aggregates"], profile=mine["profile"], gamma=1.0,
                       baseline={"policy": "b", **theirs} if baseline else None,
                       probability_of_improvement={"point": 0.9, "ci": [0.8, 1.0]} if baseline else None)


def test_figures_plot_the_report() -> None:
    report = _report()
    figs = suite_figures(report.model_dump(mode="json"))
    assert set(figs) == {"performance_profile", "aggregate_intervals", "task_scores"}
    ax = figs["performance_profile"].axes[0]
    lines = ax.get_lines()
    assert len(lines) == 2  # policy and baseline
    np.testing.assert_allclose(lines[0].get_ydata(), report.profile["point"])
    np.testing.assert_allclose(lines[0].get_xdata(), report.profile["taus"])
    assert len(ax.collections) == 2  # one CI band each
    panels = figs["aggregate_intervals"].axes
    assert [p.get_title() for p in panels] == ["Mean", "Median", "IQM", "Optimality gap"]
    iqm_bar = [b for b in panels[2].patches][0]  # policy row: [low, high]
    assert iqm_bar.get_x() == pytest.approx(report.aggregates["iqm"]["ci"][0])
    assert iqm_bar.get_x() + iqm_bar.get_width() == pytest.approx(report.aggregates["iqm"]["ci"][1])
    bars = figs["task_scores"].axes[0].patches
    assert [b.get_height() for b in bars] == pytest.approx([t["score_mean"] for t in report.tasks])


def test_page_and_markdown(tmp_path) -> None:
    from evalfleet.plots import render_suite_plots

    report = _report()
    plots = render_suite_plots(report.model_dump(mode="json"), tmp_path / "plots")
    page = suite_page(report, plots, tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    assert "a&lt;b&gt;" in page and "a<b>" not in page
    assert "0.900" in page  # probability of improvement
    md = suite_markdown(_report(baseline=False))
    assert "| policy |" in md and "baseline" not in md and "data:image" not in md
    outputs = {f"plot_{k}": str(v) for k, v in plots.items()}
    pictured = suite_markdown(report.model_copy(update={"outputs": outputs}), pictures=True)
    assert pictured.count("](data:image/png;base64,") == 3


def test_suite_outputs_not_produced_are_alarms_and_exit_5(tmp_path, monkeypatch, capsys) -> None:
    import socket
    from pathlib import Path

    from evalfleet.cli import EXIT_OUTPUT_MISSING, build_parser, run_suite
    from evalfleet.models import EvalRequest
    from evalfleet.suite_report import suite_feed_back

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", "k")
    monkeypatch.setenv("EVALFLEET_ALLOWED_HOSTS", f"127.0.0.1:{port}")
    monkeypatch.setenv("EVALFLEET_CALLBACK_ATTEMPTS", "1")
    (tmp_path / "not-a-dir").write_text("")
    base = EvalRequest.build(env="CartPole-v1", policy="p.pt", output=tmp_path / "out",
                             mlflow_uri=f"sqlite:///{tmp_path / 'not-a-dir' / 'mlflow.db'}",
                             callback_url=f"http://127.0.0.1:{port}/cb")
    report = _report().model_copy(update={"alarms": ["r1: output_missing: the MLflow run (x)"]})
    final = suite_feed_back(report, base)
    missing = [a for a in final.alarms if a.startswith("output_missing: ")]
    assert [m.split(":")[1].strip() for m in missing] == [
        "the suite's MLflow parent run", "the callback to the trainer"]
    assert final.outputs["callback"].startswith("failed after 1 attempt")
    html = Path(final.outputs["report_html"]).read_text()  # both alarms came after the page
    assert "output_missing: the suite&#39;s MLflow parent run" in html
    assert "output_missing: the callback to the trainer" in html
    suite = Path(__file__).resolve().parents[2] / "examples" / "suite.toml"
    args = build_parser().parse_args(["--suite", str(suite), "--output", str(tmp_path / "cli")])
    assert run_suite(lambda suite, request: final, args) == EXIT_OUTPUT_MISSING
    err = capsys.readouterr().err
    assert "r1: the MLflow run (x)" in err and "the suite's MLflow parent run" in err


def test_a_failed_suite_callback_reaches_the_parent_run_and_the_page(tmp_path, monkeypatch) -> None:
    """A callback answered 500 is an output_missing alarm on every sink, not in suite_report.json alone.

    The page and the MLflow parent run were written before the callback: they said one alarm
    (``suite/alarm_count`` 1, no ``evalfleet.alarm.output_missing`` tag, no output_missing in
    report.html nor in the run's copy of suite_report.json) where suite_report.json said two.
    """
    import json
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from evalfleet.models import EvalRequest
    from evalfleet.suite_report import suite_feed_back
    from tests.callback_receiver import callback_receiver

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    report = _report().model_copy(update={"alarms": ["aggregate_intervals_unreliable: few episodes"]})
    with callback_receiver(monkeypatch, 500) as (url, posts):
        base = EvalRequest.build(env="CartPole-v1", policy="p.pt", output=tmp_path / "out",
                                 mlflow_uri=uri, callback_url=url)
        final = suite_feed_back(report, base)

    assert len(posts) == 1 and posts[0]["alarms"] == ["aggregate_intervals_unreliable: few episodes"]
    assert [a.split(":")[0] for a in final.alarms] == ["aggregate_intervals_unreliable", "output_missing"]
    assert final.alarms[1].startswith("output_missing: the callback to the trainer: failed after 1 attempt")
    assert "mlflow_alarms_error" not in final.outputs
    saved = json.loads(Path(final.outputs["report"]).read_text())
    assert saved["alarms"] == final.alarms
    html = Path(final.outputs["report_html"]).read_text()
    assert "output_missing: the callback to the trainer" in html and "aggregate_intervals_unreliable" in html

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(final.outputs["mlflow_run_id"])
    assert run.data.tags["evalfleet.alarm.output_missing"] == "true"
    assert run.data.tags["evalfleet.alarm.aggregate_intervals_unreliable"] == "true"
    assert run.data.metrics["suite/alarm_count"] == 2.0  # the latest value
    assert [m.value for m in client.get_metric_history(run.info.run_id, "suite/alarm_count")] == [1.0, 2.0]
    logged = Path(client.download_artifacts(run.info.run_id, "suite_report.json", str(tmp_path / "dl")))
    assert json.loads(logged.read_text())["alarms"] == final.alarms
    page = Path(client.download_artifacts(run.info.run_id, "report.html", str(tmp_path / "dl")))
    assert "output_missing: the callback to the trainer" in page.read_text()
