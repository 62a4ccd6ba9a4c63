"""Stage 3: distribute the policy."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalRequest, PolicyHandle
from evalfleet.pipeline import Received, distribute


@task(name="distribute-policy", cache_policy=NO_CACHE)
def distribute_policy(request: EvalRequest, received: Received, address: str) -> PolicyHandle:
    """Broadcast the policy bytes once per worker; workers verify the sha256 on arrival."""
    return distribute(request, received, address)
