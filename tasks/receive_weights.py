"""Stage 1: receive weights."""

from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest
from evalfleet.pipeline import Received, receive

# Stage 1 results computed before the flow started, by request id: ``evaluate()`` checks the input
# before it spawns anything and hands its result to the flow's stage 1 instead of redoing it.
_checked: dict[str, Received] = {}


@contextmanager
def checked_before(*checked: tuple[EvalRequest, Received]) -> Iterator[None]:
    """Within the block, stage 1 of each ``(request, received)``'s flow run takes ``received``."""
    for request, received in checked:
        _checked[request.request_id] = received
    try:
        yield
    finally:
        for request, _ in checked:
            _checked.pop(request.request_id, None)


@task(name="receive-weights", cache_policy=NO_CACHE)
def receive_weights(request: EvalRequest) -> Received:
    """Load, hash and validate the policy against the env before anything is spawned.

    A flow run started alone (a deployment, a test) does the work here; one started by
    ``evaluate()`` records what it already checked.
    """
    received = _checked.pop(request.request_id, None)
    if received is None:
        received, how = receive(request), "received"
    elif received.loaded:
        how = "checked before the flow"
    else:
        how = "read before the flow; not loaded: the cache holds every episode"
    get_run_logger().info(
        "policy %s (%s, %d bytes) on %s, isolation %s (%s in %.2f s)",
        received.artifact.sha256[:12], received.artifact.format, received.artifact.nbytes,
        request.env, received.isolation, how, received.seconds,
    )
    return received
