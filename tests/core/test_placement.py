"""Stage 1 places inference: 'cuda' without a usable GPU worker fails at once, 'auto' says so."""

import os
import subprocess
import sys
import time
from pathlib import Path

import dask
import pytest
from distributed import LocalCluster

from evalfleet import cluster as fleet
from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest
from evalfleet.pipeline import receive

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")
needs_no_gpu = pytest.mark.skipif(fleet.gpu_count() > 0, reason="this machine has a CUDA device")


@pytest.fixture
def cpu_cluster():
    """Two in-process workers with no resources: a cluster without a GPU worker."""
    with dask.config.set({"distributed.scheduler.work-stealing": False}), LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0", protocol="tcp",
            host="127.0.0.1") as c:
        yield c
        fleet.forget_client(c.scheduler_address)


@pytest.fixture
def fake_gpu_cluster():
    """Workers that advertise GPU=1 on a machine where torch sees no CUDA device."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                      protocol="tcp", host="127.0.0.1", resources={"GPU": 1}) as c:
        yield c
        fleet.forget_client(c.scheduler_address)


def _request(**fields):
    return EvalRequest.build(**{"policy": POLICY, "episodes": 4, "concurrency": 2, **fields})


@needs_no_gpu
def test_cuda_on_this_gpu_less_machine_is_a_request_error():
    with pytest.raises(RequestError) as err:
        receive(_request(device="cuda"))
    text = str(err.value)
    assert "--device 'cuda' asks for inference on a CUDA GPU" in text
    assert "this machine" in text and "torch sees 0 CUDA device(s)" in text
    assert "--device cpu" in text and "--device auto" in text


@needs_no_gpu
def test_auto_falls_back_to_cpu_and_says_so():
    received = receive(_request(device="auto"))
    assert received.device == "cpu"
    assert received.device_fallback and "no GPU" in received.device_fallback
    assert receive(_request(device="cpu")).device_fallback is None


@pytest.mark.slow
def test_cuda_on_a_cluster_without_gpu_workers_fails_before_any_task(cpu_cluster):
    t0 = time.monotonic()
    with pytest.raises(RequestError) as err:
        receive(_request(device="cuda", dask_address=cpu_cluster.scheduler_address))
    assert time.monotonic() - t0 < 10
    text = str(err.value)
    assert f"the Dask cluster at {cpu_cluster.scheduler_address} has none" in text
    assert "2 worker(s)" in text and "no resources" in text
    assert "--resources GPU=1" in text
    assert not cpu_cluster.scheduler.tasks  # nothing was submitted
    auto = receive(_request(device="auto", dask_address=cpu_cluster.scheduler_address))
    assert auto.device == "cpu" and "no GPU on the Dask cluster" in str(auto.device_fallback)


@pytest.mark.slow
@needs_no_gpu  # where torch sees a CUDA device, the label is true
def test_a_worker_whose_gpu_label_is_false_is_named(fake_gpu_cluster):
    """GPU=1 on a worker where torch sees no CUDA: stage 1 says which, instead of a run-stage error."""
    with pytest.raises(RequestError) as err:
        receive(_request(device="cuda", dask_address=fake_gpu_cluster.scheduler_address))
    text = str(err.value)
    name = next(iter(fake_gpu_cluster.scheduler.workers.values())).name
    assert f"Worker(s) {name} offer a 'GPU' resource but torch sees no CUDA device there" in text
    assert not fake_gpu_cluster.scheduler.tasks
    auto = receive(_request(device="auto", dask_address=fake_gpu_cluster.scheduler_address))
    assert auto.device == "cpu"  # a false label is not a GPU


def _cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PREFECT_API_URL", None)
    return subprocess.run([sys.executable, "flows/eval.py", "--episodes", "4", "--quiet", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.slow
@needs_no_gpu
def test_cli_exits_2_at_once_for_cuda_without_a_gpu(cpu_cluster, tmp_path):
    t0 = time.monotonic()
    done = _cli("--device", "cuda", "--dask-address", cpu_cluster.scheduler_address,
                "--output", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "evalfleet: error: --device 'cuda' asks for inference on a CUDA GPU" in done.stderr
    assert not cpu_cluster.scheduler.tasks
    local = _cli("--device", "cuda", "--output", str(tmp_path / "out"))
    assert local.returncode == 2 and "this machine" in local.stderr, local.stderr[-2000:]
    assert "Scheduler at" not in local.stderr  # no local cluster was started
    assert time.monotonic() - t0 < 100


CALLABLE = "tests.sandbox.faulty_envs:balance"  # a CartPole callable


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_callable_policy_is_never_placed_on_cuda(device, fake_gpu_cluster):
    """A callable runs on the worker's CPU: '--device cuda' for one is refused, whatever the
    cluster has (it was reported as inference on 'cuda', and shards were sent to GPU workers)."""
    for address in (None, fake_gpu_cluster.scheduler_address):
        with pytest.raises(RequestError) as err:
            receive(_request(policy=CALLABLE, device=device, dask_address=address))
        text = str(err.value)
        assert f"--device {device!r} asks for policy inference on a CUDA GPU" in text
        assert f"policy {CALLABLE!r} is a callable" in text and "--device cpu" in text
    assert not fake_gpu_cluster.scheduler.tasks


def test_auto_means_the_cpu_for_a_callable_policy(monkeypatch):
    """'auto' on a GPU machine: a callable's inference is on the CPU, with no fallback to state."""
    monkeypatch.setattr(fleet, "gpu_count", lambda: 1)  # a GPU machine, as stage 1 sees it
    received = receive(_request(policy=CALLABLE, device="auto"))
    assert (received.device, received.device_fallback) == ("cpu", None)
    assert received.cache_ingredients["inference"]["device"] == "cpu"
    torch_policy = receive(_request(device="auto"))  # the placement itself still sees the GPU
    assert torch_policy.device == "cuda"
