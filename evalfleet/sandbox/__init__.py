"""Sandboxes: where environment instances live while the runner steps them.

The runner never touches an env directly; it talks to an :class:`EnvSlots` backend that owns
``n`` env instances ("slots") at one isolation level. The policy stays with the runner: the backend
returns observations, the runner makes one batched forward pass, the backend applies the actions.
"""

from evalfleet.sandbox.base import open_slots
from evalfleet.sandbox.slots import EnvSlots, SlotOutcome

__all__ = ["EnvSlots", "SlotOutcome", "open_slots"]
