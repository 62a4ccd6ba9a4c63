"""Data an env reads through a symlinked folder, or from a folder a bare kwarg word names, is keyed.

Planted cases: a package whose ``levels`` folder is a symlink to the data (``Path.rglob`` did not
enter it: an edit was a full cache hit on the old episodes), and ``env_kwargs={"level_dir":
"lv"}`` (only a folder written with a separator, ``./lv``, was keyed).
"""

from __future__ import annotations

import os

from evalfleet.envspec import named_files, named_paths
from evalfleet.provenance import tree_digest, tree_files


def test_a_symlinked_data_folder_inside_a_package_is_keyed_and_a_link_loop_ends(tmp_path):
    pkg, data = tmp_path / "symenv", tmp_path / "symdata"
    pkg.mkdir()
    data.mkdir()
    (pkg / "__init__.py").write_text("SCALE_FILE = 'levels/scale.txt'\n")
    (data / "scale.txt").write_text("1.0\n")
    os.symlink(data, pkg / "levels")
    os.symlink(pkg, pkg / "again")  # a loop: walked once
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"")
    assert [name for name, _ in tree_files(pkg)] == ["__init__.py", "levels/scale.txt"]
    before = tree_digest(tree_files(pkg))
    (data / "scale.txt").write_text("10.0\n")
    assert tree_digest(tree_files(pkg)) != before


def test_a_folder_a_bare_kwarg_word_names_is_keyed_but_not_granted_to_sandboxes(tmp_path,
                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lv").mkdir()
    (tmp_path / "lv" / "scale.txt").write_text("1.0\n")
    kwargs = {"level_dir": "lv", "render_mode": "rgb_array", "here": ".", "up": ".."}
    before = named_files(kwargs)
    assert list(before) == ["lv"]
    (tmp_path / "lv" / "scale.txt").write_text("10.0\n")
    assert named_files(kwargs)["lv"] != before["lv"]
    assert named_files({"level_dir": "./lv"})["./lv"] == named_files(kwargs)["lv"]
    # A sandbox is granted what the kwargs name with a separator only: a word is not a path.
    assert named_paths(kwargs) == {}
    assert list(named_paths({"level_dir": "./lv"})) == ["./lv"]
    assert named_files({"root": "/"}) == {}
