"""A worker's loaded policies: one per module that the bytes load into, kept while any evaluation runs it.

The worker keyed its loaded policies by the bytes' hash: a state_dict evaluated under a second
factory (the same layers, logits negated) ran the first factory's network, and its episodes were
stored under the second's cache key. And every evaluation of the same bytes registered one plugin
name: the evaluation that ended first took the policy off the workers, and the other's later
shards raised ``PolicyIntegrityError: ... it was released``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from distributed import Client, LocalCluster

from evalfleet import cluster
from evalfleet.models import PolicyHandle
from evalfleet.policy import read_policy

pytestmark = pytest.mark.slow

SPACE = gym.spaces.Discrete(2)
OBS = np.array([[0.1, -0.2, 0.3, 0.4]], dtype=np.float32)


def build_plain() -> torch.nn.Module:
    """Two logits from a CartPole observation."""
    return torch.nn.Sequential(torch.nn.Linear(4, 2))


class _Negate(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -x


def build_negated() -> torch.nn.Module:
    """The same parameters as ``build_plain`` (one state_dict fits both), the logits negated."""
    return torch.nn.Sequential(torch.nn.Linear(4, 2), _Negate())


def raw_on_worker(handle: PolicyHandle, source: str, start: int = 0) -> list[float]:
    """The policy's logits for ``OBS``, loaded as a shard loads it (for ``Discrete(2, start)``)."""
    space = gym.spaces.Discrete(2, start=start)
    return [float(v) for v in cluster.policy_on_worker(handle, source, space).raw(OBS)[0]]


def held_on_worker(sha256: str) -> tuple[bool, int]:
    """Whether this worker holds the bytes, and how many loaded policies of them."""
    return sha256 in cluster._installed, sum(1 for k in cluster._loaded if k[0] == sha256)


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True,
                      dashboard_address=None) as lc, Client(lc) as c:
        yield c


@pytest.fixture(scope="module")
def state_dict(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("policy") / "sd.pt"
    torch.save(build_plain().state_dict(), path)
    return str(path)


def _on_worker(client: Client, fn: Callable[..., Any], *args: object) -> Any:
    return client.submit(fn, *args, pure=False).result(timeout=120)


@pytest.mark.timeout(300)
def test_one_state_dict_under_two_factories_is_two_modules_on_a_worker(client, state_dict) -> None:
    address = client.scheduler.address
    arts = [read_policy(state_dict, f"{__name__}:{name}", SPACE) for name in ("build_plain", "build_negated")]
    assert arts[0].sha256 == arts[1].sha256  # the same bytes
    handles = [cluster.distribute(a, address, "cpu", True) for a in arts]
    try:
        plain, negated = (_on_worker(client, raw_on_worker, h, state_dict) for h in handles)
        expected = build_plain()
        expected.load_state_dict(torch.load(state_dict, weights_only=True))
        want = expected(torch.from_numpy(OBS))[0].tolist()
        assert plain == pytest.approx(want)
        assert negated == pytest.approx([-v for v in want])  # not the first factory's module
        assert _on_worker(client, held_on_worker, arts[0].sha256) == (True, 2)
    finally:
        for h in handles:
            cluster.release(h, address)
    assert _on_worker(client, held_on_worker, arts[0].sha256) == (False, 0)


@pytest.mark.timeout(300)
def test_releasing_one_evaluation_leaves_a_concurrent_one_its_policy(client, state_dict) -> None:
    address = client.scheduler.address
    art = read_policy(state_dict, f"{__name__}:build_plain", SPACE)
    first = cluster.distribute(art, address, "cpu", True)
    second = cluster.distribute(art, address, "cpu", True)  # the same bytes, another evaluation
    try:
        want = _on_worker(client, raw_on_worker, first, state_dict)
        assert _on_worker(client, raw_on_worker, second, state_dict) == want
        cluster.release(second, address)  # the second evaluation ends first
        assert _on_worker(client, raw_on_worker, first, state_dict) == want
        assert _on_worker(client, held_on_worker, art.sha256) == (True, 1)
        # The first goes on, on another space too: loaded from the bytes, which are still there.
        assert _on_worker(client, raw_on_worker, first, state_dict, 1) == want
    finally:
        cluster.release(first, address)
    assert _on_worker(client, held_on_worker, art.sha256) == (False, 0)
