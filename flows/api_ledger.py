"""What the Prefect API did not record of an evaluation: a server down or restarting mid-run.

The Prefect server watches an evaluation; it never holds its result. Episodes, statistics,
Parquet, the cache, report.json and MLflow do not depend on it. So:

- every call this package makes to the API for the UI alone (the progress artifact, the summary
  and report artifacts) is best-effort (``best_effort``): one that fails, the API down or the
  call refused, is recorded here, and the evaluation goes on;
- a flow whose body returned but whose final state could not be recorded (Prefect's client
  retries for about a minute, enough for a restart) still hands back its result
  (``run_recorded``), and the state it should have ended in is queued under
  ``EVALFLEET_HOME/prefect-pending``: the next evaluation records it (``replay_pending``), so
  the run does not stay Running in the UI, nor get marked Crashed by the reaper;
- the report says what was lost and when the API was unreachable (``outputs['prefect_lost']``
  in report.json and the summary; ``settle``).

Task-run states are events: Prefect's events client keeps the ones the server did not confirm
and sends them again when it reconnects, so they are not counted here.
"""

from __future__ import annotations

import contextvars
import datetime
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
from pydantic import BaseModel

from evalfleet.models import FAILURE_ALARM_RATE
from evalfleet.server import evalfleet_home
from evalfleet.storage import write_json
from evalfleet.summary import percent_beyond

logger = logging.getLogger(__name__)

R = TypeVar("R")
Report = TypeVar("Report", bound=BaseModel)

#: Queued final states older than this whose flow run no server knows are dropped.
PENDING_MAX_AGE_S = 7 * 24 * 3600


@dataclass
class ApiLedger:
    """The Prefect API calls of one evaluation that failed: when, what, why."""

    lost: list[tuple[float, str, str]] = field(default_factory=list)
    #: Of ``lost``, the calls Prefect answered with a refusal (a 4xx, a value its client rejects).
    refused: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, what: str, err: BaseException) -> None:
        """Note that ``what`` was not recorded by the API because of ``err``."""
        down = api_error(err)
        with self._lock:
            first = not any(i not in self.refused for i in range(len(self.lost)))
            if not down:
                self.refused.add(len(self.lost))
            self.lost.append((time.time(), what, f"{type(err).__name__}: {err}"[:300]))
        if down and first:  # one line in the log; the report says the rest
            logger.warning("the Prefect API did not answer (%s: %s); the evaluation goes on and "
                           "its report will say what the UI lacks", type(err).__name__, err)

    def summary(self) -> str | None:
        """One line for the report: what was not recorded, and when the API failed."""
        with self._lock:
            down = [e for i, e in enumerate(self.lost) if i not in self.refused]
            refused = [e for i, e in enumerate(self.lost) if i in self.refused]
        parts = []
        if down:
            parts.append(f"the Prefect API failed ({down[-1][2]}) at {_when(down)} UTC; not recorded "
                         f"there: {_items(down)}")
        if refused:  # it answered: nothing is re-sent later
            parts.append(f"Prefect refused {_items(refused)} ({refused[-1][2]}) at {_when(refused)} "
                         "UTC; those are not in the UI")
        if not parts:
            return None
        tail = (". The results (Parquet, cache, report.json, MLflow) are complete"
                + ("; task-run states sent meanwhile are re-sent by Prefect when it reconnects, "
                   "those of the last moments may be missing" if down else ""))
        return "; ".join(parts) + tail


def _items(lost: list[tuple[float, str, str]]) -> str:
    counts = Counter(what for _, what, _ in lost)
    return "; ".join(f"{n} {what}" if n > 1 else what for what, n in counts.items())


def _when(lost: list[tuple[float, str, str]]) -> str:
    first, last = _clock(lost[0][0]), _clock(lost[-1][0])
    return first if first == last else f"{first} to {last}"


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%H:%M:%S")


_LEDGER: contextvars.ContextVar[ApiLedger | None] = contextvars.ContextVar(
    "evalfleet_api_ledger", default=None)
_SLOT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "evalfleet_flow_slot", default=None)


@contextmanager
def api_ledger() -> Iterator[ApiLedger]:
    """A ledger for the evaluation in this block (threads started with its context share it)."""
    ledger = ApiLedger()
    token = _LEDGER.set(ledger)
    try:
        yield ledger
    finally:
        _LEDGER.reset(token)


def current_ledger() -> ApiLedger:
    """The ledger of the evaluation in this context (a throwaway one outside ``api_ledger``)."""
    return _LEDGER.get() or ApiLedger()


def api_error(err: BaseException) -> bool:
    """True when ``err`` (or what caused it) is the API not answering, not a fault of ours."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, httpx.TransportError | ConnectionError):
            return True
        if isinstance(seen, httpx.HTTPStatusError) and seen.response.status_code >= 500:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def key_part(text: str) -> str:
    """``text`` as a part of a Prefect artifact key, which allows lowercase letters, digits, dashes.

    Text that must change to fit (``my_run.1``, ``connect-four[opponent_depth=2]``, or past 48
    characters) also gets a hash of itself, so two texts (``My-Run``, ``my-run``) never share a key.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48]
    if slug != text:
        slug = "-".join(filter(None, [slug, hashlib.sha256(text.encode()).hexdigest()[:8]]))
    return slug


@contextmanager
def best_effort(what: str) -> Iterator[None]:
    """Run a call made for the UI alone: when it fails, record ``what`` and go on.

    Any error, not only the API's: Prefect's client refusing a call (an artifact key, a value
    its schema rejects) costs the UI as much, and the evaluation's result is no less complete.
    So the block holds the Prefect call alone; what it is given is computed before, where an
    error of ours is raised.
    """
    try:
        yield
    except Exception as err:
        if not api_error(err):  # not the API down: say what refused it, once each
            logger.warning("%s was not recorded by Prefect (%s: %s); the evaluation goes on",
                           what, type(err).__name__, err)
        current_ledger().record(what, err)


def kept(result: R) -> R:
    """Called by a flow body with what it returns: ``run_recorded`` keeps it for its caller.

    The flow run ends in the state ``final_state`` gives it; its caller gets ``result`` as is.
    """
    slot = _SLOT.get()
    state = final_state(result)
    if slot is not None:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        slot["result"] = result
        slot["flow_run_id"] = str(ctx.flow_run.id) if ctx and ctx.flow_run else None
        if state is not result:  # a named Completed: queued as such if it cannot be recorded now
            named = cast(Any, state)
            slot["state_name"], slot["state_message"] = named.name, named.message
    return state


def final_state(result: R) -> R:
    """``result``, or a Completed state named for what makes the CLI exit non-zero on it.

    A report with outputs asked for and not produced (``missing_outputs``: the CLI exits 5, or 3
    for a recording) or a harness fault (exit 3) ended its flow run plain "Completed" in the
    Prefect UI, the run list a service is watched by. Its run now ends Completed (it has results:
    nothing that waits on a completed run changes) under the name "Outputs missing" or "Harness
    fault", with what failed as the state's message. Prefect hands a flow's caller the data of
    the Completed state its body returns: the report itself.
    """
    missing = list(getattr(result, "missing_outputs", None) or [])
    if missing:
        name, message = "Outputs missing", "; ".join(missing)
    elif getattr(result, "harness_fault", False):
        alarms = list(getattr(result, "alarms", None) or [])
        name = "Harness fault"
        coverage = float(getattr(result, "coverage", 1.0))  # as the alarms: never "95.0%" of "< 95%"
        message = f"coverage {percent_beyond(coverage, 1 - FAILURE_ALARM_RATE)}; " + "; ".join(alarms)
    else:
        return result
    from prefect.states import Completed

    return cast(R, Completed(name=name, message=message[:2000], data=result))


def run_recorded(call: Callable[[], R], name: str) -> R:
    """``call()`` a flow whose body ends with ``kept``; its result even when only the API failed.

    When the body returned and then Prefect could not record the run's final state (after its
    own retries), the result is returned, the loss recorded in the ledger, and the Completed
    state queued for the next evaluation to record. Any other failure is raised as it was.
    """
    slot: dict[str, Any] = {}
    token = _SLOT.set(slot)
    try:
        return call()
    except Exception as err:
        if "result" not in slot or not api_error(err):
            raise
        run_id = slot.get("flow_run_id")
        state_name = slot.get("state_name") or "Completed"
        queued = (queue_final_state(run_id, name, state_name, slot.get("state_message"))
                  if run_id else None)
        current_ledger().record(
            f"{name}'s final state ({state_name}"
            + (f"; queued in {queued} for the next evaluation to record)" if queued else ")"), err)
        return slot["result"]  # type: ignore[no-any-return]
    finally:
        _SLOT.reset(token)


def pending_dir() -> Path:
    """Where final states the API could not record wait for the next evaluation."""
    return evalfleet_home() / "prefect-pending"


def queue_final_state(flow_run_id: str, name: str, state_name: str = "Completed",
                      state_message: str | None = None) -> Path | None:
    """Queue 'flow run ``flow_run_id`` ended Completed' for ``replay_pending``; None on failure.

    ``state_name`` and ``state_message``: those ``final_state`` gave it ("Outputs missing" and
    what was not produced, "Harness fault"), replayed with it: a plain "Completed" recorded late
    hid from the UI and the webhook a run the CLI would have exited non-zero on.
    """
    entry = {"flow_run_id": flow_run_id, "name": name, "state": "COMPLETED",
             "state_name": state_name, "state_message": state_message,
             "ended": time.time(), "api_url": os.environ.get("PREFECT_API_URL")}
    try:
        return write_json(entry, pending_dir() / f"{flow_run_id}.json")
    except OSError as err:
        logger.error("could not queue the final state of flow run %s: %s", flow_run_id, err)
        return None


def replay_pending(client: Any) -> list[str]:
    """Record the queued final states with ``client`` (a sync Prefect client); their run ids.

    Each flow run still Running or Pending is set Completed, under the name and with the message
    it was queued with, and its task runs still Running (their closing events never arrived):
    its body returned, so each of them had finished. A run
    this server does not know stays queued (another server) until it is a week old.
    """
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Completed

    from flows.reaper import end_run

    done: list[str] = []
    live = [StateType.RUNNING, StateType.PENDING]
    for path in sorted(pending_dir().glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            run_id = str(entry["flow_run_id"])
            ended = _clock(float(entry["ended"]))
            state_name = str(entry.get("state_name") or "Completed")  # older entries: plain
            what = entry.get("state_message")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            path.unlink(missing_ok=True)  # unreadable: nothing to replay
            continue
        try:
            run = client.read_flow_run(run_id)
        except ObjectNotFound:
            if time.time() - path.stat().st_mtime > PENDING_MAX_AGE_S:
                path.unlink(missing_ok=True)
            continue
        message = (f"ended {state_name} at {ended} UTC; recorded late by the next evaluation (the "
                   "Prefect API was unreachable when the run ended)")
        if what:  # what failed first, as on a state recorded in time
            message = f"{str(what)[:2000]}; {message}"
        if run.state is not None and run.state.type in live:
            end_run(client, run.id, Completed, message, name=state_name)
            logger.info("flow run %s (%s): %s", run.name, run.id, message)
        path.unlink(missing_ok=True)
        done.append(run_id)
    return done


def settle(report: Report, ledger: ApiLedger) -> Report:
    """``report`` with ``outputs['prefect_lost']`` when the API lost anything; its JSON file too."""
    lost = ledger.summary()
    if lost is None:
        return report
    outputs: dict[str, str] = getattr(report, "outputs")  # noqa: B009 - EvalReport, SuiteReport
    final = report.model_copy(update={"outputs": {**outputs, "prefect_lost": lost}})
    path = outputs.get("report")
    if path:
        try:
            write_json(final.model_dump(mode="json"), Path(path))
        except OSError as err:
            logger.error("could not add the Prefect losses to %s: %s", path, err)
    return final
