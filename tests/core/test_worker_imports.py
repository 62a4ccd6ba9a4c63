"""A worker running a non-torch policy never imports torch.

Importing torch costs a worker ~3 CPU-seconds and ~200 MB inside its first shard: on 2 cores,
an Acrobot evaluation with a numpy policy lost a quarter of its run stage to it. Each case runs
the worker's shard entry point in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

POLICY = textwrap.dedent("""
    import numpy as np

    def lean(obs):
        return (obs[:, 2] > 0).astype(np.int64)
""")

SHARD = textwrap.dedent("""
    import json, sys
    from evalfleet.models import EvalRequest, PolicyHandle, Shard
    from evalfleet.policy import module_source, sha256_bytes
    from evalfleet.seeds import SeedLedger
    from evalfleet.worker import execute_shard

    device, out = sys.argv[1], sys.argv[2]
    ref = "numpy_lean:lean"
    blob = module_source(ref)
    request = EvalRequest.build(env="CartPole-v1", policy=ref, episodes=6, output=out,
                                cache="off", device=device)
    handle = PolicyHandle(sha256=sha256_bytes(blob), format="callable", factory=None,
                          plugin_name=None, nbytes=len(blob), device=device,
                          deterministic=True, distributed_at=0.0)
    indices = list(range(6))
    shard = Shard(shard_id=0, episode_indices=indices,
                  seeds=[SeedLedger(0).seed(i) for i in indices], slots=3)
    table = execute_shard(shard, handle, request, "inprocess")
    print(json.dumps({"rows": table.num_rows,
                      "ends": sorted(set(table.column("end_reason").to_pylist())),
                      "torch": "torch" in sys.modules}))
""")


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_shard_of_a_numpy_policy_imports_no_torch(tmp_path, device):
    (tmp_path / "numpy_lean.py").write_text(POLICY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", SHARD, device, str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["rows"] == 6
    assert answer["ends"] == ["terminated"]
    assert answer["torch"] is False, "the worker imported torch for a numpy policy"
