"""Receiving, hashing, validating and loading policies.

Three formats:

- ``torchscript``: a file written by ``torch.jit.save``.
- ``state_dict``: a file written by ``torch.save(module.state_dict())`` plus a factory
  ``module:function`` that builds the ``nn.Module`` (loaded with ``weights_only=True``).
- ``callable``: ``module:function`` taking a float32 observation batch ``(B, *obs_shape)`` and
  returning actions ``(B,)`` (Discrete) or ``(B, *shape)`` (Box) as a numpy array.

A torch policy maps a float32 batch ``(B, *obs_shape)`` to logits ``(B, n)`` for ``Discrete``
spaces (deterministic action = argmax, stochastic = a categorical sample) or to actions
``(B, *shape)`` for ``Box`` spaces. The policy hash is the sha256 of the policy's bytes (the file,
or for a callable the source file of its module). Code that turns those bytes into actions is
identified as well: a state_dict's factory by the sha256 of its reference, its module's source and
the source of the module that defines the function (``factory_sha256``), and the code versions
(``evalfleet.provenance``: a wheel's version, or the source of every file of an editable, path or
uninstalled package) of the factory's or callable's top-level package and of every package its
code imports, followed through the packages identified by their source (``code``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from gymnasium import spaces

from evalfleet.errors import PolicyError
from evalfleet.provenance import imported_code

logger = logging.getLogger(__name__)

FORMATS = ("torchscript", "state_dict", "callable")
DUMMY_BATCH = 4
#: The dtype observations are fed to the policy in (``_torch_fn``); part of the cache key.
INFERENCE_DTYPE = "float32"
#: Most rows of one forward of a torch policy: a batch is cut into blocks of at most this many
#: (``forward_in_blocks``), each padded with copies of its last row to a multiple of its
#: policy's ``pad_rows``. Math libraries choose their kernels by a batch's row count, and a row's
#: outputs differ in the last bits between counts (an MLP on this machine's CPU: rows 249-250 of a
#: 250-row batch differ from the same rows in a 256-row one; a 3-row batch differs from a 4-row one
#: in every row). Padded so, a row's action depends on its observation alone, not on how many envs
#: a shard runs: the episode table is the same for any worker count and concurrency, and a replay
#: (one row) reproduces its row bit for bit. Part of the cache key.
FORWARD_ROWS = 256
#: The padding multiple of a CPU policy whose rows come out the same at every multiple of it up to
#: ``FORWARD_ROWS`` (``pad_rows`` checks); any other policy, and every CUDA one, pads each block to
#: ``FORWARD_ROWS``.
PAD_ROWS = 8
#: How far a row's outputs may move with the other rows of its batch, relative to their magnitude
#: (at least 1), before the policy is refused (``rows_apart``): well above the last bits a kernel
#: changes (~1e-7), far below what BatchNorm over the batch moves them (a CartPole controller's
#: logit traced in training mode: 0.09 alone, 7.9 in a batch of 8).
ROW_TOLERANCE = 1e-4
#: Rows of the batch ``rows_apart`` compares, and how many of them it also runs alone.
ROWS_BATCH, ROWS_ALONE = 8, 4
#: Seconds a callable policy's rows check may take (plus 20 dummy batches' time) before it is
#: given up: its code may hang or crawl on rows other than the dummy batch's zeros.
CALLABLE_ROWS_CHECK_S = 2.0


def import_object(ref: str, what: str) -> Any:
    """Import ``module:attr`` with an error that says what was expected."""
    if ref.count(":") != 1:
        raise PolicyError(f"{what} must look like 'module:function' (got {ref!r}).")
    module_name, attr = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PolicyError(
            f"{what} {ref!r}: cannot import module {module_name!r} ({err}); make it importable "
            "(pip install your package) on this machine and every worker."
        ) from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise PolicyError(f"{what} {ref!r}: module {module_name!r} has no {attr!r}.") from err


def module_source(ref: str) -> bytes:
    """The bytes a callable policy is hashed by: its reference, then its module's source.

    The reference is part of it because two functions of one module are two policies.
    """
    module = importlib.import_module(ref.split(":")[0])
    try:
        return f"callable {ref}\n".encode() + inspect.getsource(module).encode()
    except (OSError, TypeError) as err:
        raise PolicyError(
            f"callable policy {ref!r}: the source of its module cannot be read ({err}); "
            "evalfleet hashes a callable policy by its module's source."
        ) from err


def factory_source(ref: str) -> bytes:
    """The bytes a state_dict's factory is identified by: its reference and the source it runs.

    The module named by ``ref``, and the module that defines the function when it is imported
    from elsewhere (``from my_pkg.nets import build``).
    """
    fn = import_object(ref, "policy factory")
    modules = [ref.split(":")[0]]
    defined_in = getattr(fn, "__module__", None)
    if isinstance(defined_in, str) and defined_in not in modules:
        modules.append(defined_in)
    parts = [f"factory {ref}\n".encode()]
    for name in modules:
        try:
            parts.append(inspect.getsource(importlib.import_module(name)).encode())
        except (OSError, TypeError, ImportError) as err:
            raise PolicyError(
                f"policy factory {ref!r}: the source of module {name!r} cannot be read ({err}); "
                "evalfleet identifies a factory by its source so that an edited factory never "
                "reuses cached episodes."
            ) from err
    return b"\n".join(parts)


def code_versions(ref: str, what: str) -> tuple[tuple[str, str], ...]:
    """``(top-level module, code version)`` pairs of the code a ``module:function`` runs, sorted.

    The module named by ``ref``, the module that defines the function, and every package their
    source imports (``evalfleet.provenance.imported_code``): a factory's network class from a
    module beside it, a callable's helper module; and, as for an env's code, the packages an
    installed package reaches from the module imported of it (a policy library on top of another
    distribution: upgrading that one changes the actions under the same library version).
    """
    fn = import_object(ref, what)
    modules = [ref.split(":")[0]]
    defined_in = getattr(fn, "__module__", None)
    if isinstance(defined_in, str) and defined_in not in modules:
        modules.append(defined_in)
    return tuple(imported_code(modules, versioned_imports=True).items())


def inference_device(device: str, fmt: str) -> str:
    """The kind of device inference runs on, as it goes into the cache key: 'cpu' or 'cuda'.

    A callable policy always runs on the CPU; 'auto' is resolved here, where the request is
    received (a local cluster's workers see the same devices).
    """
    if fmt == "callable":
        return "cpu"
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class PolicyArtifact:
    """Stage-1 output: validated policy bytes and what they are."""

    sha256: str
    format: str
    source: str
    payload: bytes
    factory: str | None
    output_kind: str
    factory_sha256: str | None = None
    code: tuple[tuple[str, str], ...] | None = None

    @property
    def nbytes(self) -> int:
        """Size of the bytes distributed to workers."""
        return len(self.payload)

    def summary(self) -> dict[str, Any]:
        """Small JSON-ready description (no payload)."""
        return {
            "sha256": self.sha256,
            "format": self.format,
            "source": self.source,
            "factory": self.factory,
            "factory_sha256": self.factory_sha256,
            "code": dict(self.code) if self.code else None,
            "nbytes": self.nbytes,
            "output_kind": self.output_kind,
        }


def sha256_bytes(blob: bytes) -> str:
    """Hex sha256 of ``blob``."""
    return hashlib.sha256(blob).hexdigest()


def detect_format(policy: str, factory: str | None) -> str:
    """Which of ``FORMATS`` a ``--policy`` value denotes."""
    if factory is not None:
        return "state_dict"
    if os.path.exists(policy):
        return "torchscript"
    if policy.count(":") == 1 and not policy.endswith((".pt", ".pth", ".ts")):
        return "callable"
    raise PolicyError(
        f"policy file {policy!r} does not exist. Expected a TorchScript file, a state_dict file "
        "with --policy-factory module:function, or a callable 'module:function'."
    )


class LoadedPolicy:
    """A policy ready for batched inference on one device: ``act(obs_batch) -> actions``."""

    def __init__(
        self,
        fn: Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]],
        action_space: spaces.Space[Any],
        *,
        is_torch: bool,
        deterministic: bool,
        device: str,
    ) -> None:
        self._fn = fn
        self.action_space = action_space
        self.is_torch = is_torch
        self.deterministic = deterministic
        self.device = device

    def raw(self, obs: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """The policy's raw output for a batch (logits for torch+Discrete, else actions)."""
        return np.asarray(self._fn(obs))

    def act(
        self, obs: npt.NDArray[np.float32], rngs: list[np.random.Generator] | None = None
    ) -> npt.NDArray[Any]:
        """Actions for a batch; ``rngs`` (one per row) are used only when sampling."""
        out = self.raw(obs)
        space = self.action_space
        if self.is_torch and isinstance(space, spaces.Discrete):
            check_logits(out)
            if self.deterministic or rngs is None:
                return np.asarray(out.argmax(axis=1), dtype=np.int64) + int(space.start)
            return sample_actions(out, rngs) + int(space.start)
        return np.asarray(out)


def sample_actions(logits: npt.NDArray[Any], rngs: list[np.random.Generator]) -> npt.NDArray[np.int64]:
    """One action per row, drawn from the softmax of its logits with that row's generator.

    In float64, by the inverse CDF over unnormalised weights (``c[i] > u * total``): a masked
    action (``-inf``, weight 0) is never drawn. The float32 CDF that it replaces ended short of 1
    (by up to ~5e-6 for hundreds of actions), and a draw past its end became the last action,
    masked or not.
    """
    w = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    c = w.cumsum(axis=1)
    u = np.array([g.random() for g in rngs]) * c[:, -1]
    idx = (c <= u[:, None]).sum(axis=1)
    last = w.shape[1] - 1 - np.argmax(w[:, ::-1] > 0, axis=1)  # u * total rounded up to total
    return np.asarray(np.minimum(idx, last), dtype=np.int64)


def check_logits(out: npt.NDArray[Any]) -> None:
    """Raise ``ValueError`` unless every row of ``out`` is logits an action can be chosen from.

    A NaN anywhere, a ``+inf`` or no finite maximum (every logit ``-inf``) is no distribution:
    numpy's argmax of such a row is an index the policy never chose (0, for a NaN in it), and the
    softmax is NaN. ``-inf`` beside a finite maximum is a masked action and fine. The runner
    then narrows the batch down to the rows that raise and ends those episodes as the policy's
    error, with their return so far, instead of stepping them with an action nobody chose.
    """
    if out.ndim != 2 or not out.size:
        return  # a shape the argmax itself refuses, or an empty batch
    with np.errstate(invalid="ignore"):
        bad = np.isnan(out).any(axis=1) | ~np.isfinite(out.max(axis=1))
    if bad.any():
        row = out[int(np.flatnonzero(bad)[0])]
        raise ValueError(
            f"policy returned logits with no finite maximum or a NaN for {int(bad.sum())} of "
            f"{len(out)} rows (e.g. {np.array2string(row[:8], precision=4)}): no action can be "
            "chosen from them")


def forward_in_blocks(
    run: Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]], obs: npt.NDArray[Any], pad: int
) -> npt.NDArray[Any]:
    """``run`` over ``obs`` in blocks of ``FORWARD_ROWS``, each padded to a multiple of ``pad``.

    Padding rows are copies of the block's last row; their outputs are dropped.
    """
    x = np.ascontiguousarray(obs, dtype=np.float32)
    n = len(x)
    outs = []
    for start in range(0, max(n, 1), FORWARD_ROWS):
        block = x[start:start + FORWARD_ROWS]
        k = len(block)
        rows = -(-k // pad) * pad
        if rows > k and k:
            padded = np.empty((rows, *x.shape[1:]), dtype=np.float32)
            padded[:k] = block
            padded[k:] = block[-1]
            block = padded
        try:
            out = run(block)
        except Exception:
            if rows > k:  # raised as the real rows raise it: its text names their count, not ours
                run(x[start:start + k])
            raise
        if rows > k:
            if out.ndim == 0 or len(out) != rows:
                raise ValueError(f"policy returned {out.shape} for a batch of {rows} rows: expected "
                                 "one output row per observation row")
            out = out[:k]
        outs.append(out)
    return outs[0] if len(outs) == 1 else np.concatenate(outs)


def check_rows(shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """The fixed batch a policy's rows are checked on: ``FORWARD_ROWS`` rows uniform in [0, 1)."""
    return np.random.default_rng(0).random((FORWARD_ROWS, *shape), dtype=np.float32)


def _moved(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> float:
    """How far ``b`` is from ``a``, relative to their magnitude (at least 1).

    Infinite where a non-finite element (a masked logit) is not the same in both.
    """
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb) or not np.array_equal(a[~fa], b[~fb], equal_nan=True):
        return math.inf
    if not fa.any():
        return 0.0
    scale = max(1.0, float(np.abs(a[fa]).max()), float(np.abs(b[fb]).max()))
    return float(np.abs(a[fa] - b[fb]).max()) / scale


def rows_apart(run: Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]],
               x: npt.NDArray[np.float32]) -> str | None:
    """None if each of the first rows of ``x`` gets its outputs alone as in the batch ``x``.

    Alone is among copies of itself, as a torch policy's one-row forward is padded: both
    forwards have ``len(x)`` rows, so no kernel chosen by the row count tells them apart, and a
    difference above ``ROW_TOLERANCE`` is the other rows' doing (BatchNorm or Dropout in training
    mode, a normalisation over the batch). Else what was seen, with the numbers, its likely
    causes and what to do.
    """
    together = np.asarray(run(x))
    if together.ndim == 0 or len(together) != len(x):
        return None  # no row per observation: the shape checks say so
    for i in range(min(len(x), ROWS_ALONE)):
        alone = np.asarray(run(np.repeat(x[i:i + 1], len(x), axis=0)))
        if alone.shape != together.shape:
            return None
        moved = _moved(together[i].astype(np.float64), alone[0].astype(np.float64))
        if moved > ROW_TOLERANCE:
            return (
                "a row's outputs depend on the other rows of its batch: row "
                f"{i}'s outputs alone are {np.array2string(alone[0].ravel()[:8], precision=4)}, "
                f"in a batch of {len(x)} rows {np.array2string(together[i].ravel()[:8], precision=4)} "
                f"(a difference of {moved:.3g} relative to their magnitude or 1, whichever is "
                f"larger; at most {ROW_TOLERANCE:g} is allowed). Its actions would change with "
                "--concurrency and with how many envs a shard runs. Likely causes: BatchNorm or "
                "Dropout in training mode in a traced or scripted module (module.eval() does not "
                "reach into a graph traced in training mode), or a normalisation over the batch in "
                "forward (x - x.mean(0)). Call module.eval() before torch.jit.trace, "
                "torch.jit.script or torch.save and export it again; normalise each observation "
                "on its own.")
    return None


class RowsApart(ValueError):
    """A policy's outputs for a row depend on the other rows of its batch (``rows_apart``).

    Raised by the first forward of a loaded torch policy (``pad_rows``): padding would hide it.
    Stage 1 refuses such a policy (``PolicyError``); on a worker it is the policy's error.
    """


def pad_rows(run: Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]], shape: tuple[int, ...]
             ) -> int:
    """``PAD_ROWS`` if ``run`` gives each row the same outputs in blocks of any multiple of it.

    Checked once per loaded policy on a fixed batch of ``FORWARD_ROWS`` rows (``check_rows``),
    whole and in blocks of 8, 24, 40 and 184 rows: a kernel that depends on the row count shows.
    Else (or if the check raises) ``FORWARD_ROWS``: every block padded to the full size, the same
    for any batch. Rows that depend on the other rows of their batch (``rows_apart``) are no
    kernel's last bits, and padding would hide them: ``RowsApart``.
    """
    x = check_rows(shape)
    try:
        whole = np.asarray(run(x))
        cuts = np.cumsum([0, 8, 24, 40, FORWARD_ROWS - 72])
        parts = np.concatenate([np.asarray(run(x[a:b])) for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
        same = whole.shape == parts.shape and bool(np.array_equal(whole, parts, equal_nan=True))
        seen = None if same else rows_apart(run, x[:ROWS_BATCH])
    except Exception:
        return FORWARD_ROWS
    if seen is not None:
        raise RowsApart(seen)
    return PAD_ROWS if same else FORWARD_ROWS


def _torch_fn(module: Any, device: str) -> Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]]:
    import torch

    module.eval()
    if torch.device(device).type == "cpu":
        # No device copies: the batch is shared with numpy in, the output tensor shared out.
        def run(x: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
            return np.asarray(module(torch.from_numpy(x)).numpy())
    else:
        def run(x: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
            return np.asarray(module(torch.from_numpy(x).to(device)).detach().to("cpu").numpy())

    pad: list[int] = []  # decided at the first batch, when the observations' shape is known
    apart: list[str] = []  # or what ``pad_rows`` found instead: every forward raises it

    def fn(obs: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        with torch.inference_mode():
            if apart:
                raise RowsApart(apart[0])
            if not pad:
                try:
                    pad.append(pad_rows(run, tuple(np.shape(obs)[1:]))
                               if torch.device(device).type == "cpu" else FORWARD_ROWS)
                except RowsApart as err:
                    apart.append(str(err))
                    raise
            return forward_in_blocks(run, obs, pad[0])

    return fn


def resolve_device(device: str) -> str:
    """Map 'auto' to 'cuda' when a GPU is visible, else 'cpu'; validate 'cuda[:N]'.

    'cpu' imports nothing: a worker running a non-torch policy never imports torch (~3 CPU-s
    and ~200 MB of a worker's first shard, measured on Acrobot with a numpy policy).
    """
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise PolicyError(
                f"device {device!r} requested but torch sees no CUDA device here; use --device cpu "
                "or run on a worker with a GPU (dask worker --resources GPU=1)."
            )
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise PolicyError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible."
            )
    return device


def load_policy(
    fmt: str,
    payload: bytes,
    factory: str | None,
    source: str,
    action_space: spaces.Space[Any],
    *,
    device: str = "cpu",
    deterministic: bool = True,
) -> LoadedPolicy:
    """Build a ``LoadedPolicy`` from an artifact's bytes (on the driver or a worker)."""
    if fmt == "callable":
        fn = import_object(source, "callable policy")
        if not callable(fn):
            raise PolicyError(f"callable policy {source!r} is a {type(fn).__name__}, not callable.")
        return LoadedPolicy(
            fn, action_space, is_torch=False, deterministic=deterministic, device="cpu"
        )
    import torch

    if fmt == "torchscript":
        try:
            module = torch.jit.load(io.BytesIO(payload), map_location=device)
        except Exception as err:
            raise PolicyError(
                f"policy {source!r} is not a loadable TorchScript file ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}). Save it with torch.jit.save, or "
                "pass a state_dict with --policy-factory module:function."
            ) from err
    elif fmt == "state_dict":
        if factory is None:
            raise PolicyError(f"state_dict policy {source!r} needs --policy-factory module:function.")
        build = import_object(factory, "policy factory")
        try:
            state = torch.load(io.BytesIO(payload), map_location=device, weights_only=True)
        except Exception as err:
            raise PolicyError(
                f"policy {source!r} is not a loadable state_dict ({type(err).__name__}: {err}). "
                "Save it with torch.save(module.state_dict(), path)."
            ) from err
        if not isinstance(state, dict):
            raise PolicyError(
                f"policy {source!r} holds a {type(state).__name__}, expected a state_dict (dict)."
            )
        module = build()
        try:
            module.load_state_dict(state)
        except Exception as err:
            raise PolicyError(
                f"state_dict {source!r} does not fit the module built by {factory!r}: {err}"
            ) from err
        module = module.to(device)
    else:
        raise PolicyError(f"Unknown policy format {fmt!r}. Choose one of {', '.join(FORMATS)}.")
    for name, tensor in module.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise PolicyError(
                f"policy {source!r} has non-finite weights in {name!r} (NaN/inf); refusing to "
                "evaluate a diverged checkpoint."
            )
    return LoadedPolicy(
        _torch_fn(module, device),
        action_space,
        is_torch=True,
        deterministic=deterministic,
        device=device,
    )


def check_outputs(
    policy: LoadedPolicy, observation_space: spaces.Space[Any], source: str
) -> str:
    """Run one dummy batch and check the output against the action space; returns output kind."""
    shape = observation_space.shape or ()
    obs = np.zeros((DUMMY_BATCH, *shape), dtype=np.float32)
    space = policy.action_space
    t0 = time.perf_counter()
    try:
        raw = np.asarray(policy.raw(obs))
    except RowsApart as err:  # seen by the first forward (``pad_rows``)
        raise PolicyError(f"policy {source!r}: {err}") from err
    except Exception as err:
        raise PolicyError(
            f"policy {source!r} failed on a dummy float32 batch of shape {obs.shape} (the env's "
            f"observations have shape {tuple(shape)}): {type(err).__name__}: {_last_line(err)}"
        ) from err
    if isinstance(space, spaces.Discrete):
        if policy.is_torch:
            expected: tuple[int, ...] = (DUMMY_BATCH, int(space.n))
            what = "logits"
        else:
            expected, what = (DUMMY_BATCH,), "integer actions"
    else:
        expected, what = (DUMMY_BATCH, *(space.shape or ())), "actions"
    if raw.shape != expected:
        raise PolicyError(
            f"policy {source!r} output has shape {raw.shape} for a batch of {DUMMY_BATCH}, "
            f"expected {what} of shape {expected} for action space {space}. "
            "Fix the policy's output layer (or pick the matching env)."
        )
    logits = policy.is_torch and isinstance(space, spaces.Discrete)
    if logits:  # -inf beside a finite logit masks an action; NaN, +inf or all -inf is refused
        try:
            check_logits(raw.astype(np.float64))
        except ValueError as err:
            raise PolicyError(f"policy {source!r} on a dummy batch: {err}.") from err
    elif not np.all(np.isfinite(raw.astype(np.float64))):
        raise PolicyError(f"policy {source!r} produced non-finite outputs on a dummy batch.")
    # A callable too (this check runs in a child process: the calls it may count end with it),
    # when it repeats itself on one batch: one that does not (it draws or counts) is no row's
    # doing, and the determinism audit reports it. One normalising over its batch scored
    # differently with --concurrency, with no alarm.
    x = check_rows(tuple(shape))[:ROWS_BATCH]
    if policy.is_torch:
        seen = _rows_seen(lambda: rows_apart(policy.raw, x))
    else:  # a callable's code may hang or crawl on rows other than zeros: a bounded look
        bound = CALLABLE_ROWS_CHECK_S + 20 * (time.perf_counter() - t0)
        seen = _within(bound, lambda: _rows_seen(
            lambda: rows_apart(policy.raw, x) if _repeats(policy.raw, x) else None))
    if seen is not None:
        raise PolicyError(f"policy {source!r}: {seen}")
    return "logits" if logits else "actions"


def _rows_seen(look: Callable[[], str | None]) -> str | None:
    """``rows_apart``'s finding; None where the policy cannot take the rows (the zeros passed)."""
    try:
        return look()
    except Exception:  # noqa: BLE001 - no finding: the run stage meets what the rows raise
        return None


def _within(seconds: float, look: Callable[[], str | None]) -> str | None:
    """``look()`` on a daemon thread, or None if it takes more than ``seconds``.

    Stage 1 runs in a process of its own that ends after it: a call still running there goes
    with it (the run stage bounds such calls with ``--policy-timeout``).
    """
    found: list[str | None] = [None]
    thread = threading.Thread(target=lambda: found.__setitem__(0, look()), daemon=True,
                              name="evalfleet-rows-check")
    thread.start()
    thread.join(seconds)
    return None if thread.is_alive() else found[0]


def _repeats(run: Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]],
             x: npt.NDArray[np.float32]) -> bool:
    """True if ``run`` gives ``x`` the same outputs twice in a row."""
    return bool(np.array_equal(np.asarray(run(x)), np.asarray(run(x)), equal_nan=True))


def output_kind(fmt: str, action_space: spaces.Space[Any]) -> str:
    """What a policy of format ``fmt`` outputs for ``action_space``: 'logits' or 'actions'."""
    return "logits" if fmt != "callable" and isinstance(action_space, spaces.Discrete) else "actions"


def read_policy(
    policy: str,
    factory: str | None,
    action_space: spaces.Space[Any],
    deterministic: bool = True,
) -> PolicyArtifact:
    """Stage 1 without the load: read and hash the policy, check what needs no torch.

    Everything the cache key holds is known here; ``check_policy`` then loads the policy and runs
    a dummy batch. A request the cache answers whole needs no load: the same bytes, factory code
    and versions were loaded and checked when those episodes ran.
    """
    fmt = detect_format(policy, factory)
    if fmt == "callable":
        import_object(policy, "callable policy")
        payload = module_source(policy)
    else:
        try:
            with open(policy, "rb") as fh:
                payload = fh.read()
        except OSError as err:
            raise PolicyError(f"policy file {policy!r} cannot be read: {err}") from err
        if not payload:
            raise PolicyError(f"policy file {policy!r} is empty; expected a saved torch policy.")
    if not deterministic and (fmt == "callable" or not isinstance(action_space, spaces.Discrete)):
        raise PolicyError(
            "deterministic=False samples from a torch policy's logits over a Discrete action "
            f"space; this is a {fmt} policy with {action_space}. Use deterministic=True."
        )
    code = None  # a TorchScript file holds its code
    if fmt == "callable":
        code = code_versions(policy, "callable policy")
    elif factory is not None:
        code = code_versions(factory, "policy factory")
    return PolicyArtifact(
        sha256=sha256_bytes(payload),
        format=fmt,
        source=policy,
        payload=payload,
        factory=factory,
        output_kind=output_kind(fmt, action_space),
        factory_sha256=sha256_bytes(factory_source(factory)) if factory else None,
        code=code,
    )


def _last_line(err: BaseException) -> str:
    """An error's message; a TorchScript one's last line (the cause, under ~25 lines of trace).

    ``RuntimeError: The following operation failed in the TorchScript interpreter.`` is followed
    by two tracebacks before the line that says what went wrong (``mat1 and mat2 shapes cannot
    be multiplied (4x4 and 8x2)``).
    """
    text = str(err)
    if "TorchScript interpreter" not in text:
        return text
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].split(": ", 1)[-1] if lines else text


def check_policy(
    artifact: PolicyArtifact,
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    deterministic: bool = True,
) -> None:
    """Load ``artifact`` on the CPU and check its output on a dummy batch (``PolicyError``)."""
    loaded = load_policy(artifact.format, artifact.payload, artifact.factory, artifact.source,
                         action_space, device="cpu", deterministic=deterministic)
    kind = check_outputs(loaded, observation_space, artifact.source)
    if kind != artifact.output_kind:  # the key was fixed from output_kind(): they must agree
        raise PolicyError(
            f"policy {artifact.source!r} outputs {kind} where its format {artifact.format!r} "
            f"implies {artifact.output_kind}; report this as an evalfleet bug."
        )


#: How long a policy's stage-1 check may take in its own process before it is an error.
CHECK_TIMEOUT_S = 600.0


def check_policy_apart(
    artifact: PolicyArtifact,
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    deterministic: bool = True,
    timeout_s: float = CHECK_TIMEOUT_S,
    start_method: str = "fork",
) -> None:
    """``check_policy`` in a child process, so this one imports no torch for it.

    A driver that dispatches the run stage has no use for torch then (~140 MiB resident): its
    workers load the policy. The child answers ``None`` or the error by pipe; a policy whose load
    kills the process (a segfault in a factory) is a ``PolicyError`` here, not a dead driver.

    ``start_method="fork"``: a child forked from this process; where that is not safe or not
    useful (torch imported already, other threads running, no ``fork``), the check runs in this
    process. ``"forkserver"``: a child of the running fork server (``cluster.fork_server_for_check``),
    which has imported what the check needs, torch included, while this process went on.
    """
    import multiprocessing
    import sys
    import threading

    if start_method == "fork" and (
            "torch" in sys.modules or threading.active_count() > 1
            or "fork" not in multiprocessing.get_all_start_methods()):
        check_policy(artifact, observation_space, action_space, deterministic)
        return
    ctx: Any = multiprocessing.get_context(start_method)
    answer, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_check_child, name="evalfleet-policy-check", daemon=True,
                        args=(send, artifact, observation_space, action_space, deterministic))
    child.start()
    send.close()
    try:
        if not answer.poll(timeout_s):
            raise PolicyError(f"policy {artifact.source!r}: loading it and running a dummy batch "
                              f"took more than {timeout_s:.0f} s; check what its code does on load.")
        error = answer.recv()
    except EOFError:
        child.join(5)
        raise PolicyError(
            f"policy {artifact.source!r}: the process loading it for the stage-1 check died "
            f"(exit code {child.exitcode}: a negative code is the signal); its code or "
            "weights crash the interpreter where they are loaded.") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        answer.close()
    if error is not None:
        raise error


def _check_child(send: Any, *args: Any) -> None:
    """The child of ``check_policy_apart``: the check, and its answer on ``send``."""
    try:
        check_policy(*args)
        send.send(None)
    except BaseException as err:  # noqa: BLE001 - every outcome is the parent's to raise
        try:
            send.send(err)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            send.send(PolicyError(f"{type(err).__name__}: {err}"))
    finally:
        send.close()


def receive_policy(
    policy: str,
    factory: str | None,
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    deterministic: bool = True,
) -> PolicyArtifact:
    """Stage 1: read, hash, load and validate the policy against the env's spaces."""
    artifact = read_policy(policy, factory, action_space, deterministic)
    check_policy(artifact, observation_space, action_space, deterministic)
    return artifact
