"""Worker side of the ``process`` and ``bwrap`` levels: env instances in sandbox processes.

:class:`ProcessSlots` keeps ``ceil(n / envs_per_sandbox)`` sandboxes, forked on demand by this
worker's fork server (:mod:`evalfleet.sandbox.forkclient`, which starts
:mod:`evalfleet.sandbox.forkserver`), and never more: a dead sandbox is
reaped before its replacement is forked. Each step it sends every sandbox its actions first, then
collects the replies with one selector and a deadline per sandbox, so many sandboxes cost about one
round trip, not one each.

Deadlines and what a failure becomes:

- an episode may spend ``episode_timeout_s`` of wall clock inside its env's reset/step calls
  (timed in the sandbox; waiting for the policy or for other sandboxes is not charged), and one
  request may take ``step_timeout_s`` / ``reset_timeout_s`` by the worker's clock. A sandbox that
  does not answer within what is left is killed with its process group → ``timeout`` for every
  episode it hosted;
- death by a signal → ``crashed`` (signal number and name in the error; SIGXCPU → ``timeout``);
- MemoryError under RLIMIT_AS → ``oom`` (the sandbox reports it, or exits with ``EXIT_OOM``);
- an exception in the env → ``env_error`` with its text; the sandbox survives and builds a fresh
  env at that slot's next reset;
- a malformed reply or a closed channel → ``crashed``.

When one sandbox hosts several envs, it serves them one after another: a request may take the sum
of their bounds, and an env that overran its own (by the sandbox's timing of it) ends as
``timeout`` alone. The sandbox's death fails all of their episodes; the ones that were not in the
request that saw it fail at their next step (the runner retries each alone in a sandbox).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import resource
import selectors
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import cloudpickle
import numpy as np

from evalfleet.models import EndReason
from evalfleet.sandbox import wire
from evalfleet.sandbox.environment import PINNED, sandbox_environment
from evalfleet.sandbox.forkclient import (
    PIDS_CGROUP_ROOT,
    ForkServer,
    ForkServerError,
    discard_fork_server,
    fork_server,
    release_fork_server,
    shutdown_fork_servers,
)
from evalfleet.sandbox.limits import EXIT_OOM, SandboxLimits, unconfined_missing
from evalfleet.sandbox.slots import SlotOutcome

# The fork-server client moved to ``forkclient``; these names stay importable from here.
__all__ = ["PIDS_CGROUP_ROOT", "ForkServer", "ForkServerError", "ProcessSlots", "fork_server",
           "env_modules", "preload_modules", "shutdown_fork_servers"]

logger = logging.getLogger(__name__)

_PREFIX = {"process": "proc", "bwrap": "bwrap"}
#: How often (wall seconds, at most) the worker asks the fork server for its sandboxes' CPU time.
CPU_CHECK_S = 1.0


# -- slots -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Box:
    """One live sandbox process, as the worker sees it."""

    sock: socket.socket
    pid: int
    name: str
    rbuf: bytearray = field(default_factory=bytearray)
    wbuf: bytes = b""
    writing: bool = False  # registered for EVENT_WRITE (only while a request is half sent)
    allowed: float = 0.0  # seconds this request may take before the sandbox is killed
    episode_bound: bool = False  # True when ``allowed`` is what is left of an episode's budget
    reply: list[wire.Result] | None = None
    replied: float = 0.0  # this worker's clock when ``reply`` came in
    dead: tuple[str, str] | None = None  # (reason, error) once it is known to be gone


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def env_modules(env_spec: dict[str, Any]) -> list[str]:
    """The modules whose folders a sandbox may read: evalfleet's envs and its id's ``module:``.

    Only what the request names: never what the env reports about itself (its registered entry
    point, the modules its spec names, the import lines of its code, ``code``: those are for the
    cache key only), or env code could grant itself any folder that sits in a ``sys.path``
    entry (another evaluation's results, say) with a line like ``import results``, even dead.
    A bwrap jail shows their package folders (``fork_server``'s ``packages``), and so does a
    ``process`` sandbox's Landlock ruleset (``bwrap.package_paths``: regular packages, and the
    single file of the id's own module with the files beside it its key covers,
    ``bwrap.module_neighbours``).
    """
    from evalfleet.envspec import BUILTIN_ENV_MODULES

    names = list(BUILTIN_ENV_MODULES)
    env_id = str(env_spec.get("env_id", ""))
    if ":" in env_id:
        names.append(env_id.split(":", 1)[0])
    return list(dict.fromkeys(names))


def env_data_files(env_spec: dict[str, Any]) -> tuple[str, ...]:
    """The files and folders the requested kwargs name (``envspec.named_paths``), absolute.

    The request named them (they are in the cache key): a ``process`` sandbox may read them.
    Never the registered spec's own kwargs: an env's module would grant itself any file.
    """
    from evalfleet.envspec import named_paths

    return tuple(os.path.abspath(path)
                 for path in named_paths(dict(env_spec.get("kwargs") or {})).values())


def preload_modules(env_spec: dict[str, Any]) -> list[str]:
    """Of ``env_modules``, those the fork server imports before forking: shipped ones only.

    The server is not confined like its sandboxes (under a root worker it is root with every
    capability) and serves every evaluation of its worker: an env's own module imported there
    ran its code outside any sandbox, could read the worker's memory and patch the server for
    later evaluations. Each sandbox imports it after it is confined (``make``), instead.
    """
    from evalfleet.sandbox.isolation import shipped_env

    # ``shipped_env`` checks where a module lives (another package named ``envs`` is not ours).
    return [m for m in env_modules(env_spec) if shipped_env(f"{m}:_")]


class ProcessSlots:
    """``n`` env slots in sandbox processes (``process`` or ``bwrap`` level); see module doc."""

    def __init__(
        self,
        make: Callable[[], Any],
        n: int,
        *,
        level: str,
        episode_timeout_s: float,
        env_spec: dict[str, Any],
        envs_per_sandbox: int = 1,
        limits: SandboxLimits | None = None,
        env_allow: Sequence[str] = (),
    ) -> None:
        if level not in _PREFIX:
            raise ValueError(f"Unknown sandbox level {level!r}. Choose 'process' or 'bwrap'.")
        if envs_per_sandbox < 1:
            raise ValueError(f"'envs_per_sandbox' must be >= 1 (got {envs_per_sandbox!r}).")
        self.isolation = level
        self.n = n
        self.limits = limits or SandboxLimits()
        if self.limits.required is None:  # not sent by a driver: this machine's probe's promise
            from evalfleet.sandbox.isolation import promised

            self.limits = replace(self.limits, required=promised(level))
        #: Why a sandbox refused to run env code (it could not apply ``limits.required``).
        self.refused: str | None = None
        self._k = envs_per_sandbox
        self._episode_timeout_s = episode_timeout_s
        self._maker_blob = cloudpickle.dumps(make)
        self._packages = env_modules(env_spec)
        self._data = env_data_files(env_spec)
        self._preload = preload_modules(env_spec)
        # Thread caps and hash seed as the fork server has them (``PINNED``); the request's extra
        # names with this worker's values.
        self._environment = dict(sandbox_environment(env_allow), **PINNED)
        self._token = uuid.uuid4().hex
        n_boxes = math.ceil(n / envs_per_sandbox)
        self._boxes: list[_Box | None] = [None] * n_boxes
        self._names = [f"{_PREFIX[level]}{b}" for b in range(n_boxes)]
        # Seconds of env wall-clock time each slot's episode has left. Charged with the time the
        # env's own reset/step calls took (measured in the sandbox), so an episode is not billed
        # for waiting on the policy, on other sandboxes, or for a CPU on a loaded machine; each
        # single request is still bounded by the worker's own clock (step/reset timeout).
        self._budget = [math.inf] * n
        self._lost: dict[int, tuple[str, str]] = {}
        # CPU seconds each box had used when its latest episode began (None: not measured yet),
        # as its fork server reads them from /proc: the sandbox cannot lift this budget (it can
        # raise its own soft RLIMIT_CPU, the first line, to the unlimited hard limit).
        self._cpu_base: dict[int, float | None] = {}
        self._cpu_checked = time.monotonic()
        self._sel = selectors.DefaultSelector()
        self._server: ForkServer | None = None
        self.spawned = 0
        _ensure_fd_room(n_boxes)

    # -- EnvSlots ----------------------------------------------------------------------------------

    def reset(self, slot: int, seed: int) -> SlotOutcome:
        """Reset one slot (see ``reset_many``)."""
        return self.reset_many([(slot, seed)])[0]

    def reset_many(self, items: Sequence[tuple[int, int]]) -> list[SlotOutcome]:
        """Reset slots with their seeds; sandboxes that are missing are forked first."""
        self._ready(items)
        return self._exchange("reset", [(slot, seed) for slot, seed in items],
                              self.limits.reset_timeout_s)

    def describe(self) -> dict[str, Any]:
        """What slot 0's env tells of itself once imported and made (``EnvMaker.facts``).

        Asked of its sandbox: the env's code runs there, confined, never here. Raises
        ``EnvSpecError`` with the env's error, ``SandboxUnconfined`` when the sandbox refused.
        """
        from evalfleet.errors import EnvSpecError, SandboxUnconfined

        self._ready([(0, 0)])
        outcome = self._exchange("describe", [(0, 0)], self.limits.reset_timeout_s)[0]
        if outcome.failure is not None:
            if self.refused is not None:  # no fault of the env's: this worker's
                raise SandboxUnconfined(self.refused)
            raise EnvSpecError(f"{outcome.error}")
        try:
            facts = json.loads(np.asarray(outcome.obs, dtype=np.uint8).tobytes())
        except ValueError as err:
            raise EnvSpecError(f"the env's sandbox answered no description ({err})") from err
        if not isinstance(facts, dict):
            raise EnvSpecError("the env's sandbox answered no description")
        return facts

    def _ready(self, items: Sequence[tuple[int, Any]]) -> None:
        """Before a new episode on each slot of ``items``: its budget whole, its sandbox forked."""
        for slot, _ in items:
            self._budget[slot] = self._episode_timeout_s
            self._cpu_base[slot // self._k] = None
        for attempt in (1, 2):
            missing = sorted({slot // self._k for slot, _ in items
                              if self._boxes[slot // self._k] is None})
            if not missing:
                break
            try:
                self._spawn(missing)
            except ForkServerError as err:
                if attempt == 2:
                    raise
                # One restart: a server that died (e.g. killed from inside a bwrap jail) is
                # replaced; every sandbox it had is gone with it, so all missing ones are forked.
                logger.warning("%s fork server failed (%s); starting a new one", self.isolation,
                               err)
                self._drop_server()
        for slot, _ in items:
            self._lost.pop(slot, None)  # a reset starts from a fresh or healthy sandbox

    def step_many(self, slots: Sequence[int], actions: Sequence[Any]) -> list[SlotOutcome]:
        """Step slots, one action each: all sandboxes at once."""
        return self._exchange("step", list(zip(slots, actions, strict=True)),
                              self.limits.step_timeout_s)

    @property
    def envs_per_sandbox(self) -> int:
        """How many consecutive slots one sandbox hosts (slot ``s`` is in sandbox ``s // k``)."""
        return self._k

    def sandbox_name(self, slot: int) -> str:
        """``proc12-pid3456``: the sandbox hosting ``slot`` (or that hosted it, if it died)."""
        return self._names[slot // self._k]

    def close(self) -> None:
        """Kill and reap every sandbox of these slots; the fork server stays for the next shard."""
        live = [b for b, box in enumerate(self._boxes) if box is not None]
        self._reap(live)
        self._sel.close()
        if self._server is not None and self._server.alive:
            try:
                self._server.call(("forget", self._token), self.limits.start_timeout_s)
            except ForkServerError:
                pass
        if self._server is not None:
            release_fork_server(self._server, self._token)

    # -- internals ---------------------------------------------------------------------------------

    def _ensure_server(self) -> ForkServer:
        # The server these slots started on while it lives: their sandboxes are its children,
        # and the registry may meanwhile hold a newer one (``fork_server`` retires a jail whose
        # env module's files changed).
        server = self._server
        if server is None or not server.alive:
            if server is not None:
                release_fork_server(server, self._token)
            server = fork_server(self.isolation, self.limits.start_timeout_s, self._packages,
                                 user=self._token)
        if self._token not in server.prepared:
            answer = server.call(
                ("prepare", self._token, self._maker_blob, list(sys.path), self._preload,
                 tuple(self._packages), self._data),
                self.limits.start_timeout_s,
            )
            if not answer.get("ok"):
                raise ForkServerError(str(answer.get("error")))
            if answer.get("imports"):
                logger.warning("fork server could not import %s", answer["imports"])
            server.prepared.add(self._token)
        self._server = server
        return server

    def _spawn(self, boxes: list[int]) -> None:
        answers, pairs = self._fork(boxes)
        # Each sandbox's environment goes to it alone, over its own socket: the fork server,
        # shared by every evaluation of this worker, never holds it (--sandbox-env values).
        environment = wire.frame(json.dumps(self._environment).encode())
        for b, ours, answer in zip(boxes, pairs, answers, strict=True):
            ours.settimeout(self.limits.start_timeout_s)
            try:
                ours.sendall(environment)
            except OSError:
                pass  # a sandbox already gone: its first request finds out, as for any death
            ours.setblocking(False)
            pid = int(answer["pid"])
            box = _Box(ours, pid, f"{_PREFIX[self.isolation]}{b}-pid{pid}")
            self._boxes[b] = box
            self._names[b] = box.name
            self._sel.register(ours, selectors.EVENT_READ, b)
        self.spawned += len(boxes)

    def _fork(self, boxes: list[int]) -> tuple[list[dict[str, Any]], list[socket.socket]]:
        server = self._ensure_server()
        netns = self.isolation == "process" and bool(server.hello.get("netns"))
        request = ("spawn", self._token, self._k, self.limits, netns)
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in boxes]
        try:
            answers = server.spawn_many([(request, theirs) for _, theirs in pairs],
                                        self.limits.start_timeout_s)
        except BaseException:
            for ours, _ in pairs:
                ours.close()
            raise
        finally:
            for _, theirs in pairs:
                theirs.close()
        return answers, [ours for ours, _ in pairs]

    def _drop_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            discard_fork_server(server)
        for b in range(len(self._boxes)):
            self._forget(b)

    def _forget(self, b: int) -> None:
        """Drop box ``b`` without asking the server (it is gone, and its children with it)."""
        box = self._boxes[b]
        if box is None:
            return
        self._boxes[b] = None
        try:
            self._sel.unregister(box.sock)
        except (KeyError, ValueError):
            pass
        box.sock.close()
        for slot in range(b * self._k, min(self.n, (b + 1) * self._k)):
            self._lost.setdefault(slot, (EndReason.CRASHED.value, "its fork server died"))

    def _exchange(self, op: str, items: list[tuple[int, Any]], op_timeout: float
                  ) -> list[SlotOutcome]:
        """Send ``op`` to every sandbox concerned, collect every reply or failure."""
        out: list[SlotOutcome | None] = [None] * len(items)
        by_box: dict[int, list[int]] = {}
        for pos, (slot, _) in enumerate(items):
            lost = self._lost.get(slot)
            box = self._boxes[slot // self._k]
            if lost is not None or box is None:
                reason, error = lost or (EndReason.CRASHED.value, "sandbox is gone")
                out[pos] = SlotOutcome(failure=reason, error=error)
                continue
            by_box.setdefault(slot // self._k, []).append(pos)
        now = time.monotonic()
        deadlines: dict[int, float] = {}
        expected = {b: len(positions) for b, positions in by_box.items()}
        for b, positions in by_box.items():
            box = self._boxes[b]
            if box is None:  # filtered above; keeps the type checker informed
                continue
            payload = [(items[p][0] % self._k, items[p][1]) for p in positions]
            box.reply = None
            box.wbuf = wire.frame(pickle.dumps((op, payload), protocol=pickle.HIGHEST_PROTOCOL))
            # The sandbox serves its envs one after another: the request may take each env's own
            # bound (the op's timeout, or what is left of its episode), added up. One deadline of
            # ``op_timeout`` for the lot timed out k healthy envs whose steps each took k-th of
            # it; an env that overruns its own bound is found from its timing (``_late``).
            lefts = [self._budget[items[p][0]] for p in positions]
            box.allowed = sum(min(op_timeout, max(0.0, left)) for left in lefts)
            box.episode_bound = min(lefts) < op_timeout
            deadlines[b] = now + box.allowed
            self._flush(b, box)
        self._collect(deadlines, expected, op, op_timeout)
        self._check_cpu()
        for b, positions in by_box.items():
            box = self._boxes[b]
            if box is not None and box.reply is not None:
                # Each episode is charged its own seconds as the sandbox measured them, but the
                # box's at least as this worker's clock measured the whole exchange: an env can
                # stop the sandbox's clock, not this one.
                share = (box.replied - now) / len(positions)
                for p, result in zip(positions, box.reply, strict=True):
                    slot, seconds = items[p][0], max(result.seconds, share)
                    self._budget[slot] -= seconds
                    late = (self._late(box, op, op_timeout, slot, seconds) if len(positions) > 1
                            else None)
                    out[p] = _outcome(result) if late is None else SlotOutcome(
                        failure=EndReason.TIMEOUT.value, error=late)
                box.reply = None
                continue
            reason, error = self._lost.get(items[positions[0]][0]) or (
                EndReason.CRASHED.value, "sandbox gave no reply")
            for p in positions:
                out[p] = SlotOutcome(failure=reason, error=error)
        return [o if o is not None else SlotOutcome(failure="crashed", error="no reply")
                for o in out]

    def _flush(self, b: int, box: _Box) -> None:
        try:
            sent = box.sock.send(box.wbuf) if box.wbuf else 0
        except BlockingIOError:
            sent = 0
        except OSError as err:
            box.dead = (EndReason.CRASHED.value, f"channel broken: {err}")
            box.wbuf = b""
            return
        box.wbuf = box.wbuf[sent:]
        if bool(box.wbuf) != box.writing:
            box.writing = bool(box.wbuf)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if box.writing else 0)
            self._sel.modify(box.sock, events, b)

    def _collect(self, deadlines: dict[int, float], expected: dict[int, int], op: str,
                 op_timeout: float) -> None:
        pending = {b for b in deadlines if self._boxes[b] is not None}
        doomed: dict[int, tuple[str, str] | None] = {}  # box → (reason, error), None: from status
        for b in list(pending):
            box = self._boxes[b]
            if box is not None and box.dead is not None:
                doomed[b] = box.dead
                pending.discard(b)
        while pending:
            now = time.monotonic()
            for b in [b for b in pending if deadlines[b] <= now]:
                pending.discard(b)
                doomed[b] = (EndReason.TIMEOUT.value, self._timeout_text(b, op, op_timeout))
            if not pending:
                break
            timeout = max(0.0, min(deadlines[b] for b in pending) - now)
            # inf (--step-timeout inf with --episode-timeout inf) is no limit: a select of inf
            # seconds overflowed epoll's int milliseconds and failed the shard.
            for key, mask in self._sel.select(None if timeout == math.inf else timeout):
                b = key.data
                box = self._boxes[b]
                if box is None or b in doomed:
                    continue
                if mask & selectors.EVENT_WRITE:
                    self._flush(b, box)
                if not mask & selectors.EVENT_READ:
                    continue
                try:
                    chunk = box.sock.recv(1 << 20)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    doomed[b] = None
                    pending.discard(b)
                    continue
                box.rbuf.extend(chunk)
                try:
                    frames = wire.split_frames(box.rbuf)
                    if len(frames) > 1 or (frames and b not in pending):
                        raise wire.ProtocolError("reply nobody asked for")
                    if frames:
                        reply = wire.decode_results(frames[0])
                        if len(reply) != expected[b]:
                            raise wire.ProtocolError(f"{len(reply)} results for {expected[b]}")
                        box.reply = reply
                        box.replied = time.monotonic()
                        pending.discard(b)
                except wire.ProtocolError as err:
                    doomed[b] = (EndReason.CRASHED.value, f"sandbox {box.name} broke the protocol "
                                                          f"({err}); killed")
                    pending.discard(b)
        if doomed:
            self._reap(list(doomed), doomed)

    def _check_cpu(self) -> None:
        """Kill the boxes past their episode's CPU budget (at most every ``CPU_CHECK_S``).

        Measured by the fork server from /proc, outside the sandbox; the episode's baseline is
        the first measure after its reset, so up to ``CPU_CHECK_S`` × the CPUs it can use may
        go uncounted. Its slots end as ``timeout``.
        """
        now = time.monotonic()
        server = self._server
        if now - self._cpu_checked < CPU_CHECK_S or server is None or not server.alive:
            return
        self._cpu_checked = now
        live = [(b, box) for b, box in enumerate(self._boxes)
                if box is not None and box.dead is None]
        if not live:
            return
        try:
            answer = server.call(("cpu", [box.pid for _, box in live]),
                                 self.limits.start_timeout_s)
        except ForkServerError as err:
            logger.warning("fork server failed while reading CPU time: %s", err)
            return
        budget = self.limits.cpu_seconds_per_episode
        over: dict[int, tuple[str, str] | None] = {}
        for (b, box), seconds in zip(live, answer.get("seconds") or [], strict=False):
            if seconds is None:
                continue
            base = self._cpu_base.get(b)
            if base is None:
                self._cpu_base[b] = float(seconds)
            elif seconds - base > budget:
                over[b] = (EndReason.TIMEOUT.value,
                           f"sandbox {box.name} used {seconds - base:.1f} s of CPU time in its "
                           f"episode, past its budget of {budget} s (cpu_seconds_per_episode, "
                           "counted from outside the sandbox, threads and child processes "
                           "included); killed with its process group")
        if over:
            self._reap(list(over), over)

    def _late(self, box: _Box, op: str, op_timeout: float, slot: int, seconds: float) -> str | None:
        """Why ``slot``'s answer in a shared sandbox's reply came too late, or None.

        Alone in its sandbox, an env past its bound is killed at the deadline; sharing one, the
        deadline is its neighbours' bounds too, so its own is checked on its timing. Its episode
        ends as ``timeout``; the sandbox and its neighbours' episodes go on, and the slot's env
        is reset by its next episode.
        """
        if seconds > op_timeout:
            return (f"sandbox {box.name} timed out: {op} of this env took {seconds:.2f} s, past "
                    f"{op_timeout} s (step/reset timeout)")
        if self._budget[slot] < 0:
            return (f"sandbox {box.name} timed out: the episode's {self._episode_timeout_s} s of env "
                    f"wall-clock time ran out during this {op}")
        return None

    def _timeout_text(self, b: int, op: str, op_timeout: float) -> str:
        box = self._boxes[b]
        name = box.name if box is not None else self._names[b]
        if box is not None and box.episode_bound:
            limit = (f"the episode's {self._episode_timeout_s} s of env wall-clock time ran out "
                     f"({box.allowed:.2f} s were left for this {op})")
        else:
            limit = f"no answer to {op} within {op_timeout} s"
        return f"sandbox {name} timed out: {limit}; killed with its process group"

    def _reap(self, boxes: list[int], known: dict[int, tuple[str, str] | None] | None = None
              ) -> None:
        """Kill and reap ``boxes`` through the server; mark their slots with the reason."""
        live = [(b, box) for b in boxes if (box := self._boxes[b]) is not None]
        if not live:
            return
        statuses: list[Any] = [None] * len(live)
        server = self._server
        if server is not None and server.alive:
            try:
                # Boxes whose channel closed (known reason None, or broken while sending to
                # them) end on their own: their exit status says why, so the server waits for
                # it before killing.
                exiting = tuple(box.pid for b, box in live if known is not None and (
                    known.get(b) is None or known.get(b) == box.dead))
                answer = server.call(("kill", [box.pid for _, box in live], exiting),
                                     self.limits.start_timeout_s)
                statuses = list(answer["statuses"])
            except ForkServerError as err:
                logger.warning("fork server failed while reaping: %s", err)
        for (b, box), status in zip(live, statuses, strict=True):
            given = (known or {}).get(b)
            reason, error = given if given is not None else _death(box.name, status)
            if status is not None and os.WIFEXITED(status) \
                    and unconfined_missing(os.WEXITSTATUS(status)):
                # It refused to run env code: that says more than the channel it closed.
                reason, error = _death(box.name, status)
                if self.refused is None:
                    logger.error("%s", error)
                self.refused = error
            self._boxes[b] = None
            try:
                self._sel.unregister(box.sock)
            except (KeyError, ValueError):
                pass
            box.sock.close()
            for slot in range(b * self._k, min(self.n, (b + 1) * self._k)):
                self._lost[slot] = (reason, error)


def _death(name: str, status: int | None) -> tuple[str, str]:
    """(reason, error) of a sandbox that closed its channel, from its wait status."""
    if status is None:
        return EndReason.CRASHED.value, f"sandbox {name} is gone (its fork server died)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return EndReason.TIMEOUT.value, f"sandbox {name} exceeded its CPU-time limit (SIGXCPU)"
        return EndReason.CRASHED.value, f"sandbox {name} died from signal {sig} ({_signal_name(sig)})"
    code = os.WEXITSTATUS(status)
    if code == EXIT_OOM:
        return EndReason.OOM.value, f"sandbox {name} ran out of memory (address-space limit)"
    missing = unconfined_missing(code)
    if missing:
        from evalfleet.cluster import worker_name

        return EndReason.CRASHED.value, (
            f"sandbox {name} on worker {worker_name()} refused to run the env: it could not apply "
            f"{', '.join(_MISSING[m] for m in missing)}, which this evaluation's isolation level "
            "promises (the driver's probe, stated in the report's manifest). Nothing ran "
            "unconfined; fix that worker or run on workers that have it.")
    return EndReason.CRASHED.value, f"sandbox {name} exited with status {code}"


#: How a refusing sandbox's missing confinement is named (``limits.MECHANISMS``).
_MISSING = {"landlock": "landlock (Landlock file confinement; Linux >= 5.13 with landlock in "
                        "its LSMs)",
            "netns": "netns (a network namespace of its own)",
            "pidns": "pidns (a pid namespace of its own)",
            "ipcns": "ipcns (an IPC namespace of its own)"}


def _outcome(result: wire.Result) -> SlotOutcome:
    if result.kind == wire.OK:
        return SlotOutcome(obs=result.obs, reward=result.reward, terminated=result.terminated,
                           truncated=result.truncated, info=result.info or {})
    reason = EndReason.OOM.value if result.kind == wire.OOM else EndReason.ENV_ERROR.value
    return SlotOutcome(failure=reason, error=result.error)


def _ensure_fd_room(n_boxes: int) -> None:
    """Raise this process's soft RLIMIT_NOFILE if ``n_boxes`` sockets might not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * n_boxes + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
