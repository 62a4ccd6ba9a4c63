"""The worker plugin that installs a policy's bytes on every Dask worker (``cluster.distribute``).

A module of its own, so that ``evalfleet.cluster`` imports ``distributed`` only where a cluster is
used: a cache hit from the CLI starts none, and its process is spared the import (~0.2 s).
"""

from __future__ import annotations

import uuid
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from evalfleet import cluster
from evalfleet.errors import PolicyIntegrityError
from evalfleet.policy import sha256_bytes


class PolicyInstaller(WorkerPlugin):
    """Installs one policy's bytes on every worker, including workers that join or restart later.

    The bytes travel once per worker; ``setup`` verifies their sha256 on arrival. Each evaluation
    registers a plugin of its own name: two evaluations of the same bytes at once (one checkpoint
    on two envs) shared one name, so the second's registration and the first's release tore
    down the policy the other was still running.
    """

    def __init__(self, sha256: str, payload: bytes) -> None:
        self.sha256 = sha256
        self.payload = payload
        self.name = f"evalfleet-policy-{sha256[:16]}-{uuid.uuid4().hex[:12]}"

    def setup(self, worker: Any) -> None:
        """Verify and keep the bytes in this worker process."""
        digest = sha256_bytes(self.payload)
        if digest != self.sha256:
            raise PolicyIntegrityError(
                f"policy bytes arrived on worker {worker.name} hashing to {digest[:12]}, expected "
                f"{self.sha256[:12]}: the transfer was corrupted"
            )
        with cluster._lock:
            cluster._installed[self.sha256] = self.payload
            cluster._holders.setdefault(self.sha256, set()).add(self.name)

    def teardown(self, worker: Any) -> None:
        """Forget the bytes and their loaded policies, unless another evaluation still uses them."""
        with cluster._lock:
            holders = cluster._holders.get(self.sha256, set())
            holders.discard(self.name)
            if holders:
                return
            cluster._holders.pop(self.sha256, None)
            cluster._installed.pop(self.sha256, None)
            for key in [k for k in cluster._loaded if k[0] == self.sha256]:
                del cluster._loaded[key]
