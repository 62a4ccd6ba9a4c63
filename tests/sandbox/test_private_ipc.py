"""What an env keeps in SysV IPC or a POSIX message queue never reaches another sandbox.

SysV shared memory, semaphores and message queues, and POSIX message queues, are no files:
Landlock, the fresh ``/tmp`` and ``/dev/shm`` do not cover them; the IPC namespace does. No
sandbox had one of its own: at ``process`` level they shared the host's, at ``bwrap`` level the
warm jail's. A buggy env that caches the level it generates in a SysV segment (as some C
simulators do) made a later evaluation, with other kwargs, return what the first one's level gave
(3 per episode instead of 9): cached, audited with 0 mismatches, exit 0. Each sandbox now has an
IPC namespace of its own, gone with it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from evalfleet.sandbox.forkclient import fork_server
from evalfleet.sandbox.isolation import probe

from .test_fresh_tmp import _skip_unless, run_evaluation

IPC_ENV = '''
import ctypes
import os
import struct

import gymnasium as gym
import numpy as np

KEY = {key}
QUEUE = b"/{queue}"
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
librt = ctypes.CDLL("librt.so.1", use_errno=True)
IPC_CREAT, IPC_EXCL = 0o1000, 0o2000


def shm_level(difficulty):
    """The gain kept in a SysV shared-memory segment: the first sandbox's, from then on."""
    sid = libc.shmget(KEY, 4096, IPC_CREAT | IPC_EXCL | 0o666)
    fresh = sid >= 0
    if not fresh:
        sid = libc.shmget(KEY, 4096, 0)
    if sid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    addr = libc.shmat(sid, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    cell = (ctypes.c_char * 8).from_address(addr)
    if fresh:
        cell[:] = struct.pack("d", float(difficulty))
    gain = struct.unpack("d", bytes(cell))[0]
    libc.shmdt(ctypes.c_void_p(addr))
    return gain


def mq_level(difficulty):
    """The gain kept as the one message of a POSIX message queue (no path of the sandbox's).

    Landlock refuses mq_open (the queue's file is in no granted folder): nowhere to keep it.
    """
    os.umask(0)  # other sandboxes run under other uids (a root worker's)
    q = librt.mq_open(QUEUE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666, None)
    if q >= 0:
        gain = float(difficulty)
    else:
        q = librt.mq_open(QUEUE, os.O_RDWR)
        if q < 0 and ctypes.get_errno() == 13:  # EACCES
            return float(difficulty)
        if q < 0:
            raise OSError(ctypes.get_errno(), "mq_open")
        buf = ctypes.create_string_buffer(1 << 16)
        if librt.mq_receive(q, buf, len(buf), None) != 8:
            raise OSError(ctypes.get_errno(), "mq_receive")
        gain = struct.unpack("d", buf.raw[:8])[0]
    if librt.mq_send(q, struct.pack("d", gain), 8, 0) != 0:
        raise OSError(ctypes.get_errno(), "mq_send")
    librt.mq_close(q)
    return gain


class Ipc(gym.Env):
    """Buggy, not hostile: caches the level it generates in IPC and reuses it from then on."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, difficulty=1, channel="shm"):
        self.gain = (shm_level if channel == "shm" else mq_level)(difficulty)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {{}}

    def step(self, action):
        self.t += 1
        return np.zeros(4, np.float32), self.gain, self.t >= 3, False, {{}}


gym.register(id="{env_id}", entry_point="{module}:Ipc", max_episode_steps=10)
'''


@pytest.fixture
def ipc_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A single-file env module on ``sys.path`` caching its level under IPC names of its own.

    Whatever an unfixed sandbox leaves in this process's IPC namespace is removed after.
    """
    tag = f"{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    module, name = f"ipcenv_{tag}", f"Ipc{tag}-v0"
    key = 0x45460000 | (hash(tag) & 0xFFFF)
    queue = f"evalfleet-test-{tag}"
    src = tmp_path / "src"
    src.mkdir()
    for path in (tmp_path, src):
        path.chmod(0o755)  # a root worker's process sandboxes run under uids of their own
    (src / f"{module}.py").write_text(IPC_ENV.format(key=key, queue=queue, env_id=name,
                                                     module=module))
    (src / f"{module}.py").chmod(0o644)
    monkeypatch.syspath_prepend(str(src))
    yield f"{module}:{name}", module
    libc = ctypes.CDLL(None, use_errno=True)
    sid = libc.shmget(key, 0, 0)
    if sid >= 0:
        libc.shmctl(sid, 0, None)  # IPC_RMID
    ctypes.CDLL("librt.so.1").mq_unlink(f"/{queue}".encode())


def _returns(level: str, env_id: str, difficulty: int, channel: str) -> list[tuple[str, float]]:
    records = run_evaluation(level, env_id, {"difficulty": difficulty, "channel": channel})
    return [(r.end_reason, r.episode_return) for r in records]


@pytest.mark.parametrize("channel", ["shm", "mq"])
def test_a_process_sandbox_has_its_own_ipc(channel: str, ipc_env: tuple[str, str]) -> None:
    _skip_unless("process")
    if probe().get("ipcns") is not None:
        pytest.skip(f"no IPC namespace per sandbox here: {probe()['ipcns']}")
    env_id, _ = ipc_env
    assert _returns("process", env_id, 1, channel) == [("terminated", 3.0)] * 4
    # 3 steps of 3: the level the first evaluation's sandboxes kept is not in sight.
    assert _returns("process", env_id, 3, channel) == [("terminated", 9.0)] * 4
    assert fork_server("process", 60).hello["ipcns"] is True


@pytest.mark.parametrize("channel", ["shm", "mq"])
def test_a_warm_jail_keeps_no_ipc_of_an_earlier_evaluation(channel: str,
                                                           ipc_env: tuple[str, str]) -> None:
    _skip_unless("bwrap")
    env_id, module = ipc_env
    assert _returns("bwrap", env_id, 1, channel) == [("terminated", 3.0)] * 4
    jail = fork_server("bwrap", 60, ["envs", module]).proc.pid
    assert _returns("bwrap", env_id, 3, channel) == [("terminated", 9.0)] * 4
    # ... and the jail is the same warm one: no start per evaluation.
    assert fork_server("bwrap", 60, ["envs", module]).proc.pid == jail
