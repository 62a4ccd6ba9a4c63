"""Which isolation levels this machine allows, detected once per process."""

from __future__ import annotations

from evalfleet.errors import IsolationUnavailable, RequestError

LEVELS = ("inprocess", "process", "bwrap")


def available_levels() -> dict[str, str | None]:
    """Each level mapped to ``None`` when available, else the reason it is not."""
    return {"inprocess": None, "process": "not implemented yet", "bwrap": "not implemented yet"}


def resolve_isolation(requested: str) -> str:
    """The level to use for ``requested``; 'auto' = strongest available. Never less than asked."""
    levels = available_levels()
    if requested == "auto":
        return next(level for level in reversed(LEVELS) if levels[level] is None)
    if requested not in levels:
        raise RequestError(f"Unknown isolation {requested!r}. Choose one of {', '.join(LEVELS)}, auto.")
    reason = levels[requested]
    if reason is not None:
        raise IsolationUnavailable(
            f"isolation {requested!r} cannot be had on this machine: {reason}. Choose a level "
            f"that is available ({', '.join(k for k, v in levels.items() if v is None)}) or fix it."
        )
    return requested
