"""The byte formats between a worker, its fork server and its sandboxes.

Frames on a sandbox's stream socket are a 4-byte little-endian length and a body.

- worker → sandbox and worker → fork server: pickle. The worker is the trusted side; a sandbox
  that reads a pickle can only hurt itself.
- sandbox → worker and fork server → worker: never pickle (unpickling is code execution, and the
  sending side runs untrusted env code). Sandbox replies are a fixed binary layout with numeric
  observations as raw bytes and a small JSON part; the fork server answers in JSON.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Result kinds in a sandbox reply.
OK, ENV_ERROR, OOM = 0, 1, 2

_LEN = struct.Struct("<I")
_RESULT = struct.Struct("<BBBddII")  # kind, terminated, truncated, reward, seconds, meta, obs
_NUMERIC_KINDS = frozenset("biuf")
#: A reply larger than this is a protocol violation (a hostile sandbox cannot exhaust the worker).
MAX_FRAME = 256 * 1024 * 1024


class ProtocolError(Exception):
    """A peer sent bytes that do not follow the format."""


def frame(body: bytes) -> bytes:
    """Prefix ``body`` with its length."""
    return _LEN.pack(len(body)) + body


def split_frames(buf: bytearray) -> list[bytes]:
    """Remove and return every complete frame at the start of ``buf``."""
    out = []
    pos = 0
    while len(buf) - pos >= 4:
        (size,) = _LEN.unpack_from(buf, pos)
        if size > MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
        if len(buf) - pos - 4 < size:
            break
        out.append(bytes(buf[pos + 4 : pos + 4 + size]))
        pos += 4 + size
    if pos:
        del buf[:pos]
    return out


@dataclass(slots=True)
class Result:
    """One env's answer to a reset or step."""

    kind: int
    obs: Any = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, float] | None = None
    error: str | None = None
    seconds: float = 0.0  # wall clock the env's call took inside the sandbox


_meta_cache: dict[tuple[str, tuple[int, ...]], bytes] = {}


def encode_result(r: Result) -> bytes:
    """Sandbox side: one result's bytes (raises TypeError for a non-numeric observation)."""
    if r.kind == OK:
        # asarray, not ascontiguousarray: that makes a 0-d observation (a Discrete space's int)
        # 1-d, and the policy got (B, 1) rows in a sandbox, (B,) in-process. tobytes is C order.
        obs = np.asarray(r.obs)
        if obs.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"observation of dtype {obs.dtype} cannot leave the sandbox")
        if r.info is None:  # the common step: same dtype and shape every time
            key = (obs.dtype.str, obs.shape)
            meta = _meta_cache.get(key)
            if meta is None:
                meta = _meta_cache[key] = json.dumps([key[0], list(key[1]), None]).encode()
        else:
            meta = json.dumps([obs.dtype.str, list(obs.shape), r.info]).encode()
        data = obs.tobytes()
    else:
        meta = json.dumps(r.error).encode()
        data = b""
    head = _RESULT.pack(r.kind, r.terminated, r.truncated, r.reward, r.seconds, len(meta),
                        len(data))
    return head + meta + data


def pack_results(parts: list[bytes]) -> bytes:
    """Sandbox side: the framed reply carrying encoded results."""
    body = _LEN.pack(len(parts)) + b"".join(parts)
    return _LEN.pack(len(body)) + body


def _info(raw: Any) -> dict[str, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError("info is not an object")
    out = {}
    for key, value in raw.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ProtocolError(f"info value for {key!r} is not a number")
        out[str(key)] = float(value)
    return out


_layout_cache: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], int]] = {}


def _layout(meta: bytes, obs_len: int) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """dtype, shape and element count of an observation described by ``meta`` (info-free)."""
    dtype_str, shape_raw, _ = json.loads(meta)
    dtype = np.dtype(str(dtype_str))
    shape = tuple(int(d) for d in shape_raw)
    count = math.prod(shape)
    if dtype.kind not in _NUMERIC_KINDS or count < 0 or count * dtype.itemsize != obs_len:
        raise ProtocolError(f"observation {dtype_str!r}{shape} of {obs_len} bytes")
    return dtype, shape, count


def decode_results(body: bytes) -> list[Result]:
    """Worker side: parse a reply body; anything malformed raises ``ProtocolError``."""
    try:
        (count,) = _LEN.unpack_from(body, 0)
        pos = 4
        out = []
        for _ in range(count):
            kind, term, trunc, reward, seconds, meta_len, obs_len = _RESULT.unpack_from(body, pos)
            if not seconds >= 0.0:  # NaN or negative: a sandbox cannot shrink its own bill
                seconds = math.inf
            pos += _RESULT.size
            meta = body[pos : pos + meta_len]
            pos += meta_len
            if kind == OK:
                layout = _layout_cache.get(meta)
                info = None
                if layout is None:
                    layout = _layout(meta, obs_len)
                    info = _info(json.loads(meta)[2])
                    if info is None and len(_layout_cache) < 64:
                        _layout_cache[meta] = layout
                dtype, shape, n = layout
                if n * dtype.itemsize != obs_len:
                    raise ProtocolError(f"observation of {obs_len} bytes for {shape} {dtype}")
                obs = np.frombuffer(body, dtype, count=n, offset=pos).reshape(shape)
                out.append(Result(OK, obs, reward, bool(term), bool(trunc), info, None, seconds))
            elif kind in (ENV_ERROR, OOM):
                out.append(Result(kind, error=str(json.loads(meta))[:2000], seconds=seconds))
            else:
                raise ProtocolError(f"unknown result kind {kind}")
            pos += obs_len
        if pos != len(body):
            raise ProtocolError(f"{len(body) - pos} trailing bytes")
        return out
    except ProtocolError:
        raise
    except (struct.error, ValueError, TypeError) as err:
        raise ProtocolError(f"{type(err).__name__}: {err}") from err
