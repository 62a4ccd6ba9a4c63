"""Deliberately broken environments, registered for the sandbox tests only.

Each is CartPole-v1 that misbehaves at step ``FAULT_STEP`` of the episodes whose reset seed is
``FAULT_RESIDUE`` modulo 10 (about 10% of ledger seeds); every other episode is exactly
CartPole-v1's, so its row must equal a fault-free run's.

Ids are registered under the ``evalfleet-test/`` namespace with entry points in this module,
named by ``__name__`` so that they resolve however the test runner imported it; use
:func:`env_id` for the ``module:id`` form that workers and sandboxes import on their own.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import sys
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

FAULT_RESIDUE = 3
FAULT_STEP = 5
FORK_BOMB_MAX = 200  # a bound of its own, so an uncapped sandbox does not take the machine down
SLEEPY_S = 0.8  # ``Sleepy``'s slow step
SLUGGISH_S, SLUGGISH_STEPS = 0.3, 3
W = np.array([0.0, -0.1, 1.0, 0.1], dtype=np.float32)


def is_faulty(seed: int) -> bool:
    """True for the seeds whose episodes misbehave."""
    return seed % 10 == FAULT_RESIDUE


def env_id(name: str) -> str:
    """``module:evalfleet-test/Name-v0``: importable in any process."""
    return f"{__name__}:evalfleet-test/{name}-v0"


def balance(obs: np.ndarray) -> np.ndarray:
    """A deterministic linear policy that balances CartPole well (a callable policy)."""
    return (np.asarray(obs, dtype=np.float32) @ W > 0).astype(np.int64)


class _Faulty(CartPoleEnv):
    """CartPole that calls ``fault()`` at step ``FAULT_STEP`` of faulty seeds."""

    def __init__(self, render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self._faulty = False
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        self._faulty = seed is not None and is_faulty(seed)
        self._t = 0
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        self._t += 1
        if self._faulty and self._t == FAULT_STEP:
            reward = self.fault(reward)
        return obs, reward, terminated, truncated, info

    def fault(self, reward: float) -> float:
        raise NotImplementedError


class RaiseOnStep(_Faulty):
    """Raises in ``step``."""

    def fault(self, reward: float) -> float:
        raise RuntimeError(f"deliberate failure at step {self._t}")


class Hang(_Faulty):
    """Sleeps for an hour in ``step``."""

    def fault(self, reward: float) -> float:
        time.sleep(3600)
        return reward


class Segfault(_Faulty):
    """Kills its own process with SIGSEGV."""

    def fault(self, reward: float) -> float:
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(10)  # the signal is asynchronous
        return reward


class NaNReward(_Faulty):
    """Returns a NaN reward."""

    def fault(self, reward: float) -> float:
        return float("nan")


class MemoryHog(_Faulty):
    """Allocates (and touches) 32 MiB blocks until allocation fails."""

    def fault(self, reward: float) -> float:
        self._hoard = []
        while True:
            self._hoard.append(bytearray(32 * 1024 * 1024))


class RaiseMemoryError(_Faulty):
    """Raises MemoryError in ``step`` (an allocation that failed), without allocating anything."""

    def fault(self, reward: float) -> float:
        raise MemoryError("planted: no memory left for this step")


class Connect(_Faulty):
    """Opens a TCP connection to 127.0.0.1:``port`` and sends a line."""

    def __init__(self, port: int = 0, render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.port = port

    def fault(self, reward: float) -> float:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
            conn.sendall(b"escaped\n")
        return reward


class WriteOutside(_Faulty):
    """Appends a line to ``target``, a path outside its sandbox folder."""

    def __init__(self, target: str = "/nonexistent", render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.target = target

    def fault(self, reward: float) -> float:
        with open(self.target, "a") as fh:
            fh.write(f"escaped from pid {os.getpid()}\n")
        return reward


class ReadFiles(_Faulty):
    """Reads each of ``targets`` and raises with what it found: the text, or the error's name.

    A target written ``read:PATH`` names PATH without the request naming it (as env code that
    knows where secrets lie): a ``process`` sandbox may read the files the request's kwargs name.
    """

    def __init__(self, targets: tuple[str, ...] = (), render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.targets = tuple(targets)

    def fault(self, reward: float) -> float:
        found = []
        for target in self.targets:
            try:
                with open(target.removeprefix("read:")) as fh:
                    found.append(f"{target} -> read {fh.read()!r}")
            except OSError as err:
                found.append(f"{target} -> {type(err).__name__}")
        raise RuntimeError("; ".join(found))


class ForkBomb(_Faulty):
    """Forks sleeping children until fork fails (at most ``FORK_BOMB_MAX``), then raises."""

    def fault(self, reward: float) -> float:
        n = 0
        try:
            while n < FORK_BOMB_MAX:
                if os.fork() == 0:
                    time.sleep(120)
                    os._exit(0)
                n += 1
        except OSError as err:
            raise RuntimeError(f"fork bomb stopped after {n} forks: {err}") from err
        raise RuntimeError(f"fork bomb was not stopped: {n} forks")


class CpuBurner(_Faulty):
    """Spins in ``step`` forever."""

    def fault(self, reward: float) -> float:
        while True:
            pass


class Daemon(_Faulty):
    """Double-forks a CPU-burning daemon (own session, ``marker`` in its argv), then goes on.

    The episode itself ends normally; its info says ``daemon_started`` = 1 once the daemon had
    exec'd (it reports through a pipe first).
    """

    def __init__(self, marker: str = "evalfleet-daemon", render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.marker = marker
        self.started = 0.0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        self.started = 0.0
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {**info, "daemon_started": self.started}

    def fault(self, reward: float) -> float:
        r, w = os.pipe()
        first = os.fork()
        if first == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(w, b"1")
                os.execv(sys.executable, [sys.executable, "-c", "while True: pass", self.marker])
            os._exit(0)
        os.close(w)
        os.waitpid(first, 0)
        self.started = float(os.read(r, 1) == b"1")
        os.close(r)
        return reward


class CrashOnce(_Faulty):
    """Segfaults at the first attempt of each faulty seed only (a flaky host, not a broken env).

    The first attempt leaves ``<marker_dir>/<seed>`` behind before it crashes; a retry finds it
    and runs the seed's plain CartPole episode. ``marker_dir`` must be writable by anyone
    (sandboxes run under uids of their own).
    """

    def __init__(self, marker_dir: str = "/nonexistent", render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.marker_dir = marker_dir
        self.seed_of_episode: int | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        self.seed_of_episode = seed
        return super().reset(seed=seed, options=options)

    def fault(self, reward: float) -> float:
        try:
            fd = os.open(os.path.join(self.marker_dir, str(self.seed_of_episode)),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            return reward  # a retry: the host is fine now
        os.close(fd)
        os.kill(os.getpid(), signal.SIGSEGV)
        return reward


class Introspect(CartPoleEnv):
    """Healthy CartPole whose reset info describes the process it runs in (for tests)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        facts: dict[str, float] = {
            "pid": os.getpid(),
            "own_group": float(os.getpgid(0) == os.getpid()),
            "uid": os.getuid(),
            "as_limit": resource.getrlimit(resource.RLIMIT_AS)[0],
            "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "fsize_limit": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
            "core_limit": resource.getrlimit(resource.RLIMIT_CORE)[0],
            "cwd_is_home": float(os.getcwd() == os.environ.get("HOME")),
            "netns": os.stat("/proc/self/ns/net").st_ino,
        }
        try:
            socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
            facts["inet_socket"] = 1.0
        except OSError:
            facts["inet_socket"] = 0.0
        try:
            os.kill(os.getppid(), 0)
            facts["signal_parent"] = 1.0
        except OSError:
            facts["signal_parent"] = 0.0
        return obs, {**info, **facts}


class FrozenClock(_Faulty):
    """Stops its sandbox's clock, then takes 0.3 s per step for 15 steps: 4.5 s of the wall
    clock that the sandbox measures as none (an episode budget charged by it never runs out)."""

    def fault(self, reward: float) -> float:
        frozen = time.monotonic()
        # The fork server's module (``python -m``: ``__main__``) times each request.
        for server in (sys.modules.get("__main__"), sys.modules.get("evalfleet.sandbox.forkserver")):
            if server is None or not hasattr(server, "_Sandbox"):
                continue

            class _Clock:
                def __getattr__(self, name: str) -> Any:
                    return getattr(time, name)

                @staticmethod
                def monotonic() -> float:
                    return frozen

            server.time = _Clock()  # type: ignore[attr-defined]
        self._slow = 15
        return reward

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        if getattr(self, "_slow", 0) > 0:
            self._slow -= 1
            time.sleep(0.3)
        return super().step(action)


class SlowStep(CartPoleEnv):
    """Healthy CartPole whose steps take 2 ms: shards last long enough to lose a worker mid-way."""

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        time.sleep(0.002)
        return super().step(action)


class Sleepy(_Faulty):
    """Takes ``SLEEPY_S`` for its step ``FAULT_STEP``, then goes on as CartPole."""

    def fault(self, reward: float) -> float:
        time.sleep(SLEEPY_S)
        return reward


class Sluggish(CartPoleEnv):
    """Healthy CartPole whose first ``SLUGGISH_STEPS`` steps take ``SLUGGISH_S`` each."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        self._t = 0
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        self._t += 1
        if self._t <= SLUGGISH_STEPS:
            time.sleep(SLUGGISH_S)
        return super().step(action)


def _burn() -> None:
    import hashlib

    block = b"x" * (1 << 20)
    while True:
        hashlib.sha256(block).digest()  # releases the GIL: the threads burn CPUs in parallel


class LiftCpu(CartPoleEnv):
    """Lifts its own RLIMIT_CPU at reset, then burns CPU in 2 threads while answering each step
    in 50 ms: 100 steps, then terminated. Its info says the soft CPU limit it ended with."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        import threading

        resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        if not getattr(self, "_burning", False):
            for _ in range(2):
                threading.Thread(target=_burn, daemon=True).start()
            self._burning = True
        self._t = 0
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        time.sleep(0.05)
        self._t += 1
        obs, _, _, _, _ = super().step(action)
        done = self._t >= 100
        info = {"cpu_soft_limit": float(resource.getrlimit(resource.RLIMIT_CPU)[0])} if done else {}
        return obs, 1.0, done, False, info


class Metadata(CartPoleEnv):
    """Changes the mode, times, xattrs and owner of ``marker`` and of a file in its own folder.

    ``marker``: a file of the worker's outside the sandbox's folder. Each change is reported in
    the first step's info: 1.0 allowed, 0.0 refused (``target_chmod``, ``own_utime``, ...).
    """

    def __init__(self, marker: str = "/nonexistent", render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        self.target = marker

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, _, truncated, info = super().step(action)
        own = os.path.join(os.environ["HOME"], "own.txt")
        with open(own, "w") as fh:
            fh.write("mine")
        changes = {"chmod": lambda p: os.chmod(p, 0o666), "utime": lambda p: os.utime(p, (0, 0)),
                   "setxattr": lambda p: os.setxattr(p, "user.evalfleet", b"1"),
                   "chown": lambda p: os.chown(p, os.getuid(), os.getgid())}
        for name, change in changes.items():
            for where, path in (("target", self.target), ("own", own)):
                try:
                    change(path)
                    info[f"{where}_{name}"] = 1.0
                except OSError:
                    info[f"{where}_{name}"] = 0.0
        return obs, reward, True, truncated, info


FAULTY = ("RaiseOnStep", "Hang", "Segfault", "NaNReward", "MemoryHog", "Connect", "WriteOutside",
          "ReadFiles", "ForkBomb", "CpuBurner", "Daemon")

for _name in (*FAULTY, "Introspect", "SlowStep", "CrashOnce", "FrozenClock", "LiftCpu", "Sleepy",
              "Sluggish", "RaiseMemoryError", "Metadata"):
    gym.register(id=f"evalfleet-test/{_name}-v0", entry_point=f"{__name__}:{_name}",
                 max_episode_steps=500)
