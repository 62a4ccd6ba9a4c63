"""What evalfleet writes and sends as JSON is strict JSON: a number that is not finite is null.

Reports reach the writers as pydantic JSON dumps, which null NaN already; the writers also take
plain dicts (the cache manifest with its audit's rows, the API ledger's entries, a callback body
a caller builds), where Python wrote ``NaN``, which JSON has not: a strict parser (a trainer in
Go or JavaScript, ``jq``) rejects the whole document, and Starlette refuses to send it (a 500).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from starlette.responses import JSONResponse

from evalfleet.callback import canonical_json
from evalfleet.models import EvalRequest
from evalfleet.records import EpisodeRecord, records_to_table
from evalfleet.report import aggregate
from evalfleet.seeds import SeedLedger
from evalfleet.storage import json_safe, write_json


def _strict(text: str | bytes) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _all_failed_report() -> dict:
    """A report with NaN statistics (nothing was scored), as a plain dict."""
    ledger = SeedLedger(0)
    table = records_to_table([EpisodeRecord(
        request_id="r", policy_sha256="p" * 64, env_id="X-v0", env_spec_hash="h", episode_index=i,
        seed=ledger.seed(i), episode_return=0.0, length=3, end_reason="crashed", error="planted",
        success=None, wall_seconds=0.0, worker="w", sandbox="s", isolation="process")
        for i in range(12)])
    report = aggregate(EvalRequest.build(policy="x.pt", episodes=12), table, env_spec={},
                       env_spec_hash="h", policy={"sha256": "p" * 64}, isolation="process",
                       timings={}, cache={}, run_seconds=1.0)
    data = report.model_dump()
    assert math.isnan(data["returns"]["mean"])  # the planted case: nothing was scored
    return data


def test_a_report_with_nan_statistics_is_written_as_strict_json(tmp_path: Path):
    data = _all_failed_report()
    parsed = _strict(write_json(data, tmp_path / "report.json").read_text())  # default=str: paths
    assert parsed["returns"]["mean"] is None and parsed["returns"]["ci"]["low"] is None
    assert parsed["episodes"] == 12


def test_the_callback_body_and_the_webhook_answer_are_strict_json():
    data = _all_failed_report()
    assert _strict(canonical_json(data))["returns"]["mean"] is None
    body = JSONResponse(json_safe({"report": data})).body  # Starlette refused the NaN before
    assert _strict(body)["report"]["returns"]["std"] is None


def test_finite_values_and_other_types_are_left_as_they_are():
    data = {"a": 1.5, "b": [float("inf"), -float("inf"), 2], "c": (float("nan"), "x"), "d": None,
            "e": True}
    assert json_safe(data) == {"a": 1.5, "b": [None, None, 2], "c": [None, "x"], "d": None,
                               "e": True}


def test_a_report_with_nan_statistics_reads_back_and_report_flag_writes_strict_json(tmp_path: Path):
    # The --report copy was written with json.dumps (NaN lengths: not JSON), and the run
    # folder's report.json (null lengths) did not read back as an EvalReport (the deployment's
    # runner reads reports so).
    from evalfleet.cli import write_report
    from evalfleet.models import EvalReport

    report = EvalReport.model_validate(_all_failed_report())
    write_report(str(tmp_path / "copy.json"), report)
    parsed = _strict((tmp_path / "copy.json").read_text())
    assert parsed["lengths"]["mean"] is None and parsed["returns"]["mean"] is None
    again = EvalReport.model_validate_json(write_json(
        report.model_dump(mode="json"), tmp_path / "report.json").read_text())
    assert again.lengths["mean"] is None and again.episodes == 12
