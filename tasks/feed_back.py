"""Stage 7: feed back."""

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import Collected, Received
from evalfleet.pipeline import feed_back as write_results
from evalfleet.review import report_markdown
from evalfleet.summary import summary_rows
from flows.api_ledger import best_effort


@task(name="feed-back", cache_policy=NO_CACHE)
def feed_back(
    request: EvalRequest, received: Received, report: EvalReport, collected: Collected
) -> EvalReport:
    """Parquet, cache, report.json and MLflow, then the Prefect artifacts the UI shows."""
    final = write_results(request, received, report, collected)
    key = f"eval-{final.policy_sha256[:12]}"
    with best_effort("the summary artifact"):  # the UI's copy: the result is written above
        create_table_artifact(summary_rows(final), key=key, description=f"evalfleet {final.env_id}")
    with best_effort("the report artifact"):
        create_markdown_artifact(report_markdown(final, final.failure_clusters), key=f"{key}-report")
    return final
