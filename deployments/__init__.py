"""The evaluation service: the served deployment, the webhook receiver and ``evalfleet serve``.

Incoming webhooks are a Prefect Cloud feature, so evalfleet runs its own receiver
(``deployments/webhook/``) in front of an open-source Prefect server: it checks signatures,
validates, de-duplicates, and creates flow runs of the deployment served by
``deployments/serve.py``. ``deployments/cli.py`` starts all of it with one command.

Nothing here imports Prefect at import time, so the receiver starts fast.
"""

from __future__ import annotations

import argparse
import os

#: The served flow and its deployment (``FLOW_NAME/DEPLOYMENT_NAME`` in Prefect's API and UI).
FLOW_NAME = "evalfleet-service"
DEPLOYMENT_NAME = "evaluate"
DEPLOYMENT = f"{FLOW_NAME}/{DEPLOYMENT_NAME}"
#: Scheduler address of the service's Dask cluster, read by the served flow.
DASK_ADDRESS_ENV = "EVALFLEET_DASK_ADDRESS"
#: Secret the trainer signs webhooks with (and its predecessor, accepted during a rotation).
WEBHOOK_SECRET_ENV = "EVALFLEET_WEBHOOK_SECRET"
WEBHOOK_PREVIOUS_SECRET_ENV = "EVALFLEET_WEBHOOK_SECRET_PREVIOUS"


def resolve_secret(env_var: str, block: str | None = None) -> str:
    """A secret from the environment variable ``env_var``, else from a Prefect Secret block.

    Secrets never live in the repository: set the variable, or create the block once with
    ``Secret(value=...).save(block)`` (or in the UI) and pass its name. Returns '' if neither
    is set.
    """
    value = os.environ.get(env_var, "")
    if value or not block:
        return value
    from prefect.blocks.system import Secret

    secret: str = Secret.load(block).get()  # type: ignore[union-attr]
    return secret


def at_least_one(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (``--workers``, ``--limit``).

    ``evalfleet serve --workers 0`` came up "ready" with no workers: every webhook was answered
    202, then its run failed 50 s later; ``--limit 0`` served a deployment that runs nothing.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def poll_seconds(text: str) -> int:
    """An ``argparse`` type: ``--poll``, whole seconds >= 1 (Prefect's runner polls in whole seconds).

    A fraction was rounded without a word, and anything below 1 s became 1 s.
    """
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 1 and value.is_integer()):
        raise argparse.ArgumentTypeError(
            f"expected whole seconds >= 1, got {text!r}: Prefect's runner polls for scheduled runs "
            "every whole number of seconds, at least 1 (pass e.g. 1)")
    return int(value)
