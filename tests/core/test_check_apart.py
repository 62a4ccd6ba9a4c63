"""Stage 1's policy check before the flow runs in a child process: the driver never imports torch.

Each case runs in a fresh interpreter (as ``python flows/eval.py`` does), once per way the child
starts: forked from the driver (``fork``: no other thread and no torch imported there), and as a
child of the local workers' fork server, started for the cluster that follows a miss
(``forkserver``: what ``evaluate()`` does). A policy that kills the process loading it is a
``PolicyError`` there, not a dead driver; a failed check leaves no fork server behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

STAGE_ONE = textwrap.dedent("""
    import json, sys
    from evalfleet import cluster
    from evalfleet.errors import PolicyError
    from evalfleet.models import EvalRequest
    from evalfleet.pipeline import received_before_flow

    fields, via = json.loads(sys.argv[1]), sys.argv[2]
    on_miss = (lambda received: ("torch",)) if via == "forkserver" else None
    try:
        received, hit = received_before_flow(EvalRequest.build(**fields), on_miss)
        answer = {"loaded": received.loaded, "hit": hit}
    except PolicyError as err:
        answer = {"error": str(err)}
    answer["torch_here"] = "torch" in sys.modules
    answer["fork_server"] = cluster.fork_server_up()
    cluster.stop_idle_fork_server()
    print(json.dumps(answer))
""")


@pytest.fixture(params=["fork", "forkserver"])
def via(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _stage_one(tmp_path: Path, via: str, **fields: object) -> dict[str, object]:
    fields.setdefault("output", str(tmp_path / "out"))
    done = subprocess.run([sys.executable, "-c", STAGE_ONE, json.dumps(fields), via], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{ROOT}",
                               "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_miss_checks_the_policy_without_importing_torch_here(tmp_path, example_policy, via):
    answer = _stage_one(tmp_path, via, policy=example_policy, episodes=4)
    # The fork server stays up for the cluster that follows the check it served.
    assert answer == {"loaded": True, "hit": False, "torch_here": False,
                      "fork_server": via == "forkserver"}


def test_a_policy_that_does_not_fit_is_refused_with_the_same_error(tmp_path, via):
    net = torch.nn.Linear(4, 3)  # CartPole has 2 actions
    torch.jit.save(torch.jit.script(net), str(tmp_path / "three.pt"))
    answer = _stage_one(tmp_path, via, policy=str(tmp_path / "three.pt"), episodes=4)
    assert "3" in str(answer["error"]) and "three.pt" in str(answer["error"])
    assert answer["torch_here"] is False and answer["fork_server"] is False


def test_a_factory_that_kills_its_process_is_a_policy_error(tmp_path, via):
    (tmp_path / "crashing_factory.py").write_text(textwrap.dedent("""
        import os
        import signal


        def build():
            os.kill(os.getpid(), signal.SIGSEGV)
    """))
    torch.save(torch.nn.Linear(4, 2).state_dict(), tmp_path / "sd.pt")
    answer = _stage_one(tmp_path, via, policy=str(tmp_path / "sd.pt"),
                        policy_factory="crashing_factory:build", episodes=4)
    assert "the process loading it for the stage-1 check died (exit code -11" in str(
        answer["error"])
    assert answer["fork_server"] is False


def test_a_fork_server_is_never_stopped_under_a_check_it_serves(tmp_path):
    """Two evaluations in one process: one failing stage 1 must not kill the server that the
    other's policy check runs in (its check would die, with a wrong error)."""
    script = textwrap.dedent("""
        import json
        from evalfleet import cluster

        seen = []
        with cluster.fork_server_for_check(()):
            cluster.stop_idle_fork_server()  # the other evaluation's stage 1 failed
            seen.append(cluster.fork_server_up())
        seen.append(cluster.fork_server_up())  # up for the cluster that follows the check
        cluster.stop_idle_fork_server()  # none followed
        seen.append(cluster.fork_server_up())
        print(json.dumps(seen))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True, False]


def test_a_stopped_fork_server_is_gone_reaped_and_its_socket_removed(tmp_path):
    """Stopping kills the idle server (its interpreter teardown cost every evaluation ~0.8 s):
    nothing of it may remain, neither a process, a zombie nor its listening socket."""
    script = textwrap.dedent("""
        import json, os, multiprocessing.forkserver as fs
        from evalfleet import cluster

        with cluster.fork_server_for_check(("torch",)):
            pass
        server = fs._forkserver
        pid, address = server._forkserver_pid, server._forkserver_address
        cluster.stop_idle_fork_server()
        try:
            os.waitpid(pid, os.WNOHANG)
            reaped = False
        except ChildProcessError:
            reaped = True
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        print(json.dumps({"up": cluster.fork_server_up(), "reaped": reaped, "alive": alive,
                          "socket": os.path.exists(address)}))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "up": False, "reaped": True, "alive": False, "socket": False}
