"""Imported last by the local workers' fork server: what it preloaded leaves the GC's view.

Every module a worker needs (``cluster.WORKER_MODULES``: Dask, pandas, pyarrow, Prefect, torch
for a torch policy) is imported once, in the server, and the workers are forked from it. Those
~320,000 objects live as long as the worker. Left to the collector, each full collection in a
worker walks all of them, ~0.3 s on a slow day, several times a shard for a pure-Python env
(Recommend-v0 lost up to 10% of a worker's CPU to them), and writes to their pages, which
copy-on-write then copies into the worker. Python's documented recipe for a forking server:
``gc.freeze()`` before the forks.
"""

from __future__ import annotations

import gc

# No ``gc.collect()`` first: it cost ~0.2 s on the path of every cold evaluation (stage 1 waits
# for this server) to free a few dozen import-time cycles, which stay, frozen, instead.
gc.freeze()
