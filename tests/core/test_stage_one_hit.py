"""Stage 1 before the flow: which full cache hits may skip loading the policy, and which may not."""

import importlib
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from evalfleet.errors import PolicyError
from evalfleet.models import EvalRequest
from evalfleet.pipeline import episode_cache, received_before_flow
from evalfleet.records import EpisodeRecord, records_to_table

EPISODES = 6


def _table(n: int):
    return records_to_table([
        EpisodeRecord("r", "sha", "env", "spec", i, 1000 + i, float(i) + 0.5, 10, "terminated",
                      None, None, 0.1, "w", "s", "inprocess") for i in range(n)])


def _stored(request: EvalRequest) -> None:
    """The request's whole episode range in the cache, under the key stage 1 computes now.

    With the audit an audited run keeps: an entry no audit covered is no hit for an audited
    request (it runs the audit's sample on a cluster).
    """
    received, hit = received_before_flow(request)
    assert not hit
    episode_cache(request).store(received.cache_key, _table(request.episodes),
                                 received.cache_ingredients,
                                 audit={"checked": 2, "mismatches": []})


def test_a_torchscript_hit_loads_no_policy(example_policy, tmp_path):
    request = EvalRequest.build(policy=example_policy, episodes=EPISODES, output=tmp_path)
    _stored(request)
    received, hit = received_before_flow(request)
    assert hit and not received.loaded  # bytes, torch's version and spaces: all in the key


@pytest.fixture
def factory_elsewhere(tmp_path, monkeypatch):
    """A factory whose network class lives in another top-level module beside it."""
    tag = uuid.uuid4().hex[:8]
    net, fact = f"stage1net_{tag}", f"stage1fact_{tag}"
    (tmp_path / f"{net}.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        HIDDEN = 8


        class Net(nn.Sequential):
            def __init__(self):
                super().__init__(nn.Linear(4, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 2))
    """))
    (tmp_path / f"{fact}.py").write_text(f"from {net} import Net\n\n\ndef build():\n    return Net()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    weights = tmp_path / "sd.pt"
    torch.save(importlib.import_module(fact).build().state_dict(), weights)
    yield net, fact, str(weights), tmp_path / f"{net}.py"
    for name in (net, fact):
        sys.modules.pop(name, None)


def test_a_state_dict_hit_still_loads_and_a_factory_that_broke_fails_stage_1(
        factory_elsewhere, tmp_path: Path):
    net, fact, weights, source = factory_elsewhere
    request = EvalRequest.build(policy=weights, policy_factory=f"{fact}:build",
                                episodes=EPISODES, output=tmp_path / "out")
    _stored(request)
    received, hit = received_before_flow(request)
    assert hit and received.loaded  # a factory runs code the key may not hold whole

    # The network's module changes so these weights no longer fit: a policy that cannot load
    # is refused at stage 1, not answered with the episodes of the network it used to build.
    source.write_text(source.read_text().replace("HIDDEN = 8", "HIDDEN = 4"))
    importlib.reload(sys.modules[net])
    importlib.reload(sys.modules[fact])
    with pytest.raises(PolicyError, match="does not fit the module built by"):
        received_before_flow(request)
