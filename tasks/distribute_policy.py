"""Stage 3: distribute the policy."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest, PolicyHandle
from evalfleet.pipeline import Planned, Received, distribute


@task(name="distribute-policy", cache_policy=NO_CACHE)
def distribute_policy(
    request: EvalRequest, received: Received, planned: Planned, address: str | None
) -> PolicyHandle:
    """Send the policy bytes once per worker (only if there is work); verified on arrival."""
    needed = planned.shards or request.target_ci_halfwidth is not None
    return distribute(request, received, address if needed else None)
