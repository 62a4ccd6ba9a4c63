"""evalfleet: the evaluation half of an RL training loop.

The core package is Prefect-free: models, seed ledger, policy loading, sandboxes, the episode
runner, statistics, storage and tracking. The Prefect flow in ``flows/eval.py`` wires the seven
stages over a Dask cluster.
"""

from evalfleet.errors import (
    EnvSpecError,
    EvalfleetError,
    IsolationUnavailable,
    PolicyError,
    RequestError,
)
from evalfleet.models import EndReason, EvalReport, EvalRequest
from evalfleet.seeds import SeedLedger, ledger

__version__ = "0.1.0"

__all__ = [
    "EndReason",
    "EnvSpecError",
    "EvalReport",
    "EvalRequest",
    "EvalfleetError",
    "IsolationUnavailable",
    "PolicyError",
    "RequestError",
    "SeedLedger",
    "__version__",
    "ledger",
]
