"""Stage 6: aggregate."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import Collected, Planned, Received, summarize


@task(name="aggregate", cache_policy=NO_CACHE)
def aggregate(
    request: EvalRequest, received: Received, planned: Planned, collected: Collected
) -> EvalReport:
    """Statistics, failure accounting and alarms over the episode table."""
    return summarize(request, received, planned, collected)
