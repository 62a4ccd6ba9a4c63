"""Stage 1's policy check before the flow runs in a forked child: the driver never imports torch.

Each case runs in a fresh interpreter (as ``python flows/eval.py`` does): one with no other thread
and no torch imported, where the check is forked. A policy that kills the process loading it is
a ``PolicyError`` there, not a dead driver.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

STAGE_ONE = textwrap.dedent("""
    import json, sys
    from evalfleet.errors import PolicyError
    from evalfleet.models import EvalRequest
    from evalfleet.pipeline import received_before_flow

    fields = json.loads(sys.argv[1])
    try:
        received, hit = received_before_flow(EvalRequest.build(**fields))
        answer = {"loaded": received.loaded, "hit": hit}
    except PolicyError as err:
        answer = {"error": str(err)}
    answer["torch_here"] = "torch" in sys.modules
    print(json.dumps(answer))
""")


def _stage_one(tmp_path: Path, **fields: object) -> dict[str, object]:
    fields.setdefault("output", str(tmp_path / "out"))
    done = subprocess.run([sys.executable, "-c", STAGE_ONE, json.dumps(fields)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{ROOT}",
                               "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_miss_checks_the_policy_without_importing_torch_here(tmp_path, example_policy):
    answer = _stage_one(tmp_path, policy=example_policy, episodes=4)
    assert answer == {"loaded": True, "hit": False, "torch_here": False}


def test_a_policy_that_does_not_fit_is_refused_with_the_same_error(tmp_path):
    net = torch.nn.Linear(4, 3)  # CartPole has 2 actions
    torch.jit.save(torch.jit.script(net), str(tmp_path / "three.pt"))
    answer = _stage_one(tmp_path, policy=str(tmp_path / "three.pt"), episodes=4)
    assert "3" in str(answer["error"]) and "three.pt" in str(answer["error"])
    assert answer["torch_here"] is False


def test_a_factory_that_kills_its_process_is_a_policy_error(tmp_path):
    (tmp_path / "crashing_factory.py").write_text(textwrap.dedent("""
        import os
        import signal


        def build():
            os.kill(os.getpid(), signal.SIGSEGV)
    """))
    torch.save(torch.nn.Linear(4, 2).state_dict(), tmp_path / "sd.pt")
    answer = _stage_one(tmp_path, policy=str(tmp_path / "sd.pt"),
                        policy_factory="crashing_factory:build", episodes=4)
    assert "the process loading it for the stage-1 check died (exit code -11" in str(
        answer["error"])
