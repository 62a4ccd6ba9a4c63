"""A source file's imports are parsed once per version of the file, then read from a file.

Parsing the ~100 modules a policy's or an env's code reaches (to key their code) took ~0.7 s of
every cold stage 1, on the path before the workers' fork server starts. The parsed imports are
kept in ``evalfleet_home()`` under each file's module name and sha256: a later process reads them,
an edited file is parsed again, and a store that does not read is parsed around.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evalfleet import provenance


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A home of its own, and this process as a new one: nothing parsed, nothing read yet."""
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(provenance, "_IMPORTS", {})
    monkeypatch.setattr(provenance, "_imports_new", {})
    monkeypatch.setattr(provenance, "_imports_loaded", False)
    pkg = tmp_path / "src" / "planted_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import helpers\n")
    (pkg / "helpers.py").write_text("import json\nfrom planted_pkg import other\n")
    (pkg / "other.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    return pkg


def _as_a_new_process(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Forget what this process parsed; count the sources parsed from here on."""
    monkeypatch.setattr(provenance, "_IMPORTS", {})
    monkeypatch.setattr(provenance, "_imports_loaded", False)
    parsed: list[bytes] = []
    real = provenance._parse_imports

    def counted(source: bytes, package: str) -> tuple[str, ...]:
        parsed.append(source)
        return real(source, package)

    monkeypatch.setattr(provenance, "_parse_imports", counted)
    return parsed


def test_a_later_process_reads_the_imports_instead_of_parsing(fresh, monkeypatch):
    first = provenance.imported_code(["planted_pkg"])
    stored = list((Path(os.environ["EVALFLEET_HOME"]) / "provenance").glob(
        "source-imports-*.json"))
    assert len(stored) == 1
    parsed = _as_a_new_process(monkeypatch)
    assert provenance.imported_code(["planted_pkg"]) == first
    assert parsed == []
    assert provenance._imports("planted_pkg.helpers", fresh / "helpers.py", False) == (
        "json", "planted_pkg", "planted_pkg.other")


def test_an_edited_file_is_parsed_again_and_its_new_imports_followed(fresh, monkeypatch):
    provenance.imported_code(["planted_pkg"])
    (fresh / "other.py").write_text("import planted_extra\n")
    extra = fresh.parent / "planted_extra.py"
    extra.write_text("y = 2\n")
    parsed = _as_a_new_process(monkeypatch)
    versions = provenance.imported_code(["planted_pkg"])
    assert parsed == [b"import planted_extra\n", b"y = 2\n"]  # only the edited and the new file
    assert "planted_extra" in versions


def test_a_store_that_does_not_read_is_parsed_around_and_rewritten(fresh, monkeypatch):
    first = provenance.imported_code(["planted_pkg"])
    (store,) = (Path(os.environ["EVALFLEET_HOME"]) / "provenance").glob(
        "source-imports-*.json")
    store.write_text('{"imports": [["planted_pkg", true]]')  # cut short
    parsed = _as_a_new_process(monkeypatch)
    assert provenance.imported_code(["planted_pkg"]) == first
    assert len(parsed) == 3
    parsed = _as_a_new_process(monkeypatch)
    assert provenance.imported_code(["planted_pkg"]) == first
    assert parsed == []
