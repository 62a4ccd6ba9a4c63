"""Stage 6: aggregate."""

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from evalfleet.audit import RoundSchedule
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import Collected, Received, summarize


@task(name="aggregate", cache_policy=NO_CACHE)
def aggregate(
    request: EvalRequest, received: Received, schedule: RoundSchedule, collected: Collected,
    baseline: tuple[pa.Table, str] | None = None,
) -> EvalReport:
    """Statistics, failure accounting, audits, alarms and the comparison with a baseline."""
    return summarize(request, received, schedule, collected, baseline)
