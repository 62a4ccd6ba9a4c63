"""Prefect flows of evalfleet."""
