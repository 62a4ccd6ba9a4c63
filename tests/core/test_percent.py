"""Shares near all or nothing never round to it: coverage 100.00% beside a harness failure."""

from __future__ import annotations

import pytest

from evalfleet.summary import percent


@pytest.mark.parametrize(("share", "digits", "text"), [
    (19_998 / 20_000, 2, "99.99%"),
    (19_999 / 20_000, 2, ">99.99%"),
    (199_999 / 200_000, 2, ">99.99%"),
    (1 / 200_000, 2, "<0.01%"),
    (1.0, 2, "100.00%"),
    (0.0, 2, "0.00%"),
    (0.5, 2, "50.00%"),
    (1 / 3, 1, "33.3%"),
    (1_999 / 2_000, 1, ">99.9%"),
    (1 / 2_000, 1, "0.1%"),
    (1 / 20_000, 1, "<0.1%"),
])
def test_percent(share: float, digits: int, text: str) -> None:
    assert percent(share, digits) == text
