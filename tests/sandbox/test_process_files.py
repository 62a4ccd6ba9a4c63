"""A ``process`` sandbox opens only what running its env needs (Landlock), as the jail shows.

A root worker's sandboxes keep CAP_DAC_READ_SEARCH so a Python installed under a private home
still imports: it let env code read every file of the machine (a key under the home, another
evaluation's results, a secret beside the project). A non-root worker's sandboxes share its uid,
so they read what it reads, ``/proc/<pid>/environ`` of the worker and the driver included. The
planted env reads each plant and writes outside its folder; envs that only run still return
exactly what they return in-process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from envs import reference_policies as rp
from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest
from evalfleet.sandbox.forkserver import confined_hint
from evalfleet.sandbox.isolation import available_levels
from evalfleet.sandbox.limits import SandboxLimits, landlock_abi

from . import faulty_envs as fe
from .test_jail import _run_repo_env
from .test_process_slots import outcomes, run_direct

pytestmark = [
    pytest.mark.skipif(available_levels()["process"] is not None,
                       reason=f"process level unavailable: {available_levels()['process']}"),
    pytest.mark.skipif(landlock_abi() == 0, reason="this kernel has no Landlock"),
]


def test_a_process_sandbox_reads_no_planted_secret(secrets: dict[str, str]) -> None:
    environ = f"/proc/{os.getpid()}/environ"  # the worker's own environment
    records, _ = run_direct("process", fe.env_id("ReadFiles"), 12, 3,
                            kwargs={"targets": [f"read:{path}" for path in (
                                *secrets, environ, "/etc/shadow", "/proc/self/status")]})
    probes = [r for r in records if fe.is_faulty(r.seed)]
    assert probes and all(r.end_reason == "env_error" for r in probes)
    for r in probes:
        text = r.error or ""
        for path, content in secrets.items():
            assert content not in text
            assert f"{path} -> PermissionError" in text, text
        assert f"{environ} -> PermissionError" in text, text
        assert "/etc/shadow -> PermissionError" in text, text
        assert "/proc/self/status -> read 'Name:" in text, text  # its own, not the worker's
    healthy = [r for r in records if not fe.is_faulty(r.seed)]
    assert healthy and all(r.end_reason in ("terminated", "truncated") for r in healthy)


def test_a_process_sandbox_writes_only_its_own_folder(outside_dir: Path) -> None:
    for target in (Path("/tmp") / f"evalfleet-test-escape-{os.getpid()}", outside_dir / "x"):
        records, _ = run_direct("process", fe.env_id("WriteOutside"), 12, 3,
                                kwargs={"target": str(target)})
        probes = [r for r in records if fe.is_faulty(r.seed)]
        assert probes and all(r.end_reason == "env_error" for r in probes)
        assert all("PermissionError" in (r.error or "") for r in probes), probes[0].error
        assert all((r.error or "").endswith(confined_hint(str(target))) for r in probes), \
            probes[0].error
        assert not target.exists()


@pytest.mark.parametrize(("env_id", "policy"), [
    ("evalfleet/Recommend-v0", rp.recommend_heuristic),
    ("evalfleet/Inventory-v0", rp.inventory_heuristic),
    ("evalfleet/ConnectFour-v0", rp.connect_four_heuristic),
])
def test_envs_that_only_run_return_what_they_return_in_process(env_id: str, policy: object
                                                               ) -> None:
    sandboxed = _run_repo_env("process", env_id, policy)
    assert all(row["end_reason"] in ("terminated", "truncated") for row in sandboxed), sandboxed
    assert sandboxed == _run_repo_env("inprocess", env_id, policy)


def test_cartpole_from_a_module_imported_inside_the_sandbox_matches() -> None:
    env = fe.env_id("Introspect")  # tests.sandbox.faulty_envs: imported after confinement
    sandboxed, _ = run_direct("process", env, 6, 2)
    here, _ = run_direct("inprocess", env, 6, 2)
    assert [o["return"] for o in outcomes(sandboxed)] == [o["return"] for o in outcomes(here)]


def test_paths_the_request_allows_are_read_and_written(outside_dir: Path) -> None:
    data = outside_dir / "data.txt"
    data.write_text("env data")
    records, _ = run_direct("process", fe.env_id("ReadFiles"), 12, 3,
                            kwargs={"targets": [f"read:{data}"]},
                            limits=SandboxLimits(readable=(str(outside_dir),)))
    probes = [r for r in records if fe.is_faulty(r.seed)]
    assert probes and all(f"{data} -> read 'env data'" in (r.error or "") for r in probes)
    # A file the request's kwargs name is read without a grant (it is in the cache key).
    records, _ = run_direct("process", fe.env_id("ReadFiles"), 12, 3,
                            kwargs={"targets": [str(data)]})
    probes = [r for r in records if fe.is_faulty(r.seed)]
    assert probes and all(f"{data} -> read 'env data'" in (r.error or "") for r in probes)
    records, _ = run_direct("process", fe.env_id("ReadFiles"), 12, 3,
                            kwargs={"targets": [f"read:{data}"]})
    probes = [r for r in records if fe.is_faulty(r.seed)]
    assert probes and all(f"{data} -> PermissionError" in (r.error or "") for r in probes)
    target = outside_dir / "written.txt"
    target.touch()
    target.chmod(0o666)  # a root worker's sandboxes run under uids of their own
    records, _ = run_direct("process", fe.env_id("WriteOutside"), 12, 3,
                            kwargs={"target": str(target)},
                            limits=SandboxLimits(writable=(str(outside_dir),)))
    probes = [r for r in records if fe.is_faulty(r.seed)]
    assert probes and all(r.end_reason in ("terminated", "truncated") for r in probes), probes[0]
    assert target.read_text().count("escaped from pid") == len(probes)


def test_allowed_paths_are_absolute_and_for_process_sandboxes() -> None:
    with pytest.raises(RequestError, match="'readable' paths must be absolute"):
        SandboxLimits(readable=("data",))
    with pytest.raises(RequestError, match="'sandbox_write' entries must be absolute paths"):
        EvalRequest.build(env="CartPole-v1", policy="x", sandbox_write=["out"])
    with pytest.raises(RequestError, match="'sandbox_read' applies to process sandboxes"):
        EvalRequest.build(env="CartPole-v1", policy="x", isolation="bwrap",
                          sandbox_read=["/data"])


SELF_GRANTING = '''
import gymnasium as gym
from tests.sandbox.faulty_envs import ReadFiles

gym.register(id="{env_id}", entry_point="tests.sandbox.faulty_envs:ReadFiles",
             max_episode_steps=500, kwargs={{"targets": [{secret!r}]}})
'''


def test_an_env_module_cannot_grant_itself_a_file_through_its_registered_kwargs(
        tmp_path: Path, outside_dir: Path, monkeypatch) -> None:
    # The files the request's kwargs name are readable; the registered spec's kwargs are the
    # env module's own word, and naming a secret there must not open it.
    secret = outside_dir / "token"
    secret.write_text("planted-token")
    name = f"selfgrant_{os.getpid()}"
    env_id = f"SelfGrant{os.getpid()}-v0"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / f"{name}.py").write_text(
        SELF_GRANTING.format(env_id=env_id, secret=str(secret)))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    # Its entry point lives in another package (tests): the request grants that one by name.
    tests_folder = str(Path(fe.__file__).resolve().parents[1])
    records, _ = run_direct("process", f"{name}:{env_id}", 12, 3,
                            limits=SandboxLimits(readable=(tests_folder,)))
    probes = [r for r in records if fe.is_faulty(r.seed)]
    assert probes and all(f"{secret} -> PermissionError" in (r.error or "") for r in probes), \
        probes[0].error
    assert not any("planted-token" in (r.error or "") for r in records)
