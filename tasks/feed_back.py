"""Stage 7: feed back (and its replays, run ahead on a worker)."""

from dataclasses import replace

import pyarrow as pa
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from evalfleet.cluster import annotated
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import Collected, Received, review_skipped
from evalfleet.pipeline import feed_back as write_results
from evalfleet.policy import PolicyArtifact
from evalfleet.review import report_markdown
from evalfleet.review_replays import ReviewReplays, review_replays
from evalfleet.summary import summary_rows
from flows.api_ledger import best_effort, key_part
from tasks.run_episodes import release


@task(name="feed-back", cache_policy=NO_CACHE)
def feed_back(
    request: EvalRequest, received: Received, report: EvalReport, collected: Collected
) -> EvalReport:
    """Parquet, cache, report.json and MLflow, then the Prefect artifacts the UI shows."""
    final = write_results(request, received, report, collected)
    key = artifact_key(final)
    rows, markdown = summary_rows(final), report_markdown(final, final.failure_clusters)
    with best_effort("the summary artifact"):  # the UI's copy: the result is written above
        create_table_artifact(rows, key=key, description=f"evalfleet {final.env_id}")
    with best_effort("the report artifact"):
        create_markdown_artifact(markdown, key=f"{key}-report")
    return final


def artifact_key(report: EvalReport) -> str:
    """The key of an evaluation's Prefect artifacts: ``eval-<sha12>``, then its suite task's name.

    Prefect keeps one latest artifact per key: a suite's tasks (one policy) under one key
    replaced each other's summary in the catalogue. A key allows lowercase letters, digits and
    dashes: a name that needs more (``connect-four[opponent_depth=2]``) also gets a hash of
    itself, so two names never meet in one key.
    """
    key = f"eval-{report.policy_sha256[:12].lower()}"
    task = report.suite_task
    if task is None:
        return key
    return f"{key}-task-{key_part(task)}"  # never a single evaluation's "-report" key


@task(name="replay-episodes", cache_policy=NO_CACHE)
def replay_episodes(request: EvalRequest, artifact: PolicyArtifact, isolation: str,
                    table: pa.Table, device: str) -> ReviewReplays:
    """The review's replays (``review_replays``), where the task runner puts them."""
    return review_replays(request, artifact, isolation, table, device)


def replays_ahead(request: EvalRequest, received: Received, collected: Collected,
                  address: str | None, resources: dict[str, int]) -> Collected:
    """``collected`` with stage 7's replays, run now as a task on a worker of the cluster.

    Before ``done_with`` stops the workers: one has the policy loaded the way its episodes ran
    (its libraries imported, on their device, ``resources`` as the run stage asked), so the
    driver imports no torch for stage 7. Nothing to review, or no cluster (a cache hit with
    recordings asked: stage 7 replays them here, on a device this process has): ``collected``
    as it is. A task that fails (its worker lost) is the replays' error in the report, never
    the evaluation's.
    """
    if address is None or review_skipped(request, collected) is not None:
        return collected
    with annotated(resources):
        future = replay_episodes.submit(request, received.artifact, received.isolation,
                                        collected.table, received.device)
    try:
        replays = future.result()
    except Exception as err:  # noqa: BLE001 - the review reports it, with the shortfall
        replays = ReviewReplays(received.device, error=f"{type(err).__name__}: {err}")
    finally:  # here now: a worker stopping later must not make the scheduler run it again
        release([future])
    return replace(collected, replays=replays)
