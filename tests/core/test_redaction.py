"""The scrubber: secret-like variables' values (and registered ones) never leave in a text."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from evalfleet import redaction
from evalfleet.records import EPISODE_SCHEMA, EpisodeRecord, records_to_table
from evalfleet.redaction import (
    redact,
    redact_json,
    redact_keys,
    redact_table,
    register_secret,
    scrubbed_exception,
    secret_values,
)
from evalfleet.sandbox.base import error_text

AWS = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture(autouse=True)
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS)
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", 'cb"secret\\with-quotes')
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "short")  # < 8 characters: left alone
    monkeypatch.setenv("HOME", "/home/someone-long")  # not a secret-like name
    monkeypatch.setattr(redaction, "_registered", {})


def test_secret_like_names_and_lengths() -> None:
    found = secret_values()
    assert found[AWS] == "AWS_SECRET_ACCESS_KEY"
    assert "short" not in found and "/home/someone-long" not in found


def test_values_are_replaced_by_their_name() -> None:
    text = f"boom: key={AWS} home=/home/someone-long token=short"
    assert redact(text) == ("boom: key=[redacted:AWS_SECRET_ACCESS_KEY] home=/home/someone-long "
                            "token=short")


def test_repr_and_json_spellings_are_caught() -> None:
    import os

    env = {"EVALFLEET_CALLBACK_SECRET": os.environ["EVALFLEET_CALLBACK_SECRET"]}
    for text in (repr(env), json.dumps(env), str(env)):
        out = redact(text)
        assert "secret\\" not in out.replace("[redacted:EVALFLEET_CALLBACK_SECRET]", "")
        assert "[redacted:EVALFLEET_CALLBACK_SECRET]" in out, out


def test_registered_secret_outlives_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    register_secret("EVALFLEET_WEBHOOK_SECRET", "removed-from-environ-123")
    monkeypatch.delenv("EVALFLEET_WEBHOOK_SECRET", raising=False)
    assert redact("x removed-from-environ-123 y") == "x [redacted:EVALFLEET_WEBHOOK_SECRET] y"


def test_error_text_is_scrubbed_before_it_is_cut() -> None:
    try:
        raise RuntimeError("x" * 480 + AWS)
    except RuntimeError as err:
        text = error_text(err)
    assert AWS[:8] not in text and len(text) <= 500


def test_nested_json_and_metric_names() -> None:
    doc = {"alarms": [f"leak {AWS}"], AWS: {"n": 1, "s": (AWS,)}}
    assert AWS not in json.dumps(redact_json(doc), default=str)
    assert redact_keys({f"K={AWS}": 1.0}) == {"K=[redacted:AWS_SECRET_ACCESS_KEY]": 1.0}


def test_table_error_and_metrics_columns() -> None:
    rec = EpisodeRecord("r", "0" * 64, "e", "h", 0, 1, 1.0, 1, "env_error", f"boom {AWS}", None,
                        0.1, "w", "s", "inprocess", metrics={f"AWS={AWS}": 1.0, "ok": 2.0})
    table = redact_table(records_to_table([rec, rec]))
    assert table.schema.equals(EPISODE_SCHEMA)
    rows = table.to_pylist()
    assert AWS not in repr(rows)
    assert rows[0]["error"] == "boom [redacted:AWS_SECRET_ACCESS_KEY]"
    assert dict(rows[0]["metrics"]) == {"AWS=[redacted:AWS_SECRET_ACCESS_KEY]": 1.0, "ok": 2.0}
    empty = redact_table(EPISODE_SCHEMA.empty_table())
    assert isinstance(empty, pa.Table) and empty.num_rows == 0


def test_exceptions_leaving_a_worker_are_scrubbed() -> None:
    from evalfleet.errors import EnvSpecError

    clean = scrubbed_exception(EnvSpecError(f"cannot make env: {AWS}"))
    assert isinstance(clean, EnvSpecError)
    assert str(clean) == "cannot make env: [redacted:AWS_SECRET_ACCESS_KEY]"
    assert scrubbed_exception(ValueError("nothing secret")) is None
