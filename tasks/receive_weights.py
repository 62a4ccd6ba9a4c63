"""Stage 1: receive weights."""

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest
from evalfleet.pipeline import Received, receive


@task(name="receive-weights", cache_policy=NO_CACHE)
def receive_weights(request: EvalRequest) -> Received:
    """Load, hash and validate the policy against the env before anything is spawned."""
    received = receive(request)
    get_run_logger().info(
        "policy %s (%s, %d bytes) on %s, isolation %s",
        received.artifact.sha256[:12], received.artifact.format, received.artifact.nbytes,
        request.env, received.isolation,
    )
    return received
