"""One thin Prefect task per stage of an evaluation; the logic lives in ``evalfleet``."""

from flows import client_tls

client_tls.install()  # where tasks run (Dask workers too): one TLS context per CA file, not per task run
