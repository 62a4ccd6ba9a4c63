"""One thin Prefect task per stage of an evaluation; the logic lives in ``evalfleet``."""
