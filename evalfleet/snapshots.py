"""Training weights on their way to an evaluation: copied off the device, written as a policy file.

``snapshot_weights`` runs on the training thread and only copies tensors to the host (a
non-blocking copy on CUDA, behind a recorded event), so training goes on at once; for a module to
be compiled it also notes the module's structure (``module_structure``), and copies that structure
when it changed. ``PolicyWriter`` runs later, on the evaluator's thread: it waits for that copy and
writes a content-addressed file, a state_dict when a policy factory (``factory_ref``) rebuilds the
module on the workers, else the module compiled to TorchScript.
"""

from __future__ import annotations

import copy
import enum
import functools
import hashlib
import io
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evalfleet.errors import PolicyError

if TYPE_CHECKING:
    import torch


def factory_ref(factory: str | Callable[..., Any]) -> str:
    """``'module:function'`` for a policy factory given as a string or a module-level function.

    A function defined in the script being run (module ``__main__``) is referred to by the
    script's importable name, so that workers can import it (the script must guard its
    training code with ``if __name__ == "__main__":``).
    """
    if isinstance(factory, str):
        if factory.count(":") != 1:
            raise PolicyError(f"'policy_factory' must look like 'module:function' (got {factory!r}).")
        return factory
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", "")
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise PolicyError(
            f"'policy_factory' {factory!r} must be a module-level function (workers import it by "
            "name); lambdas, closures and methods cannot be imported."
        )
    if module == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name and spec.name != "__main__":
            module = spec.name  # python -m pkg.script
        else:
            script = Path(getattr(main, "__file__", "") or "")
            if not script.name or str(script.resolve().parent) not in {
                str(Path(p or ".").resolve()) for p in sys.path
            }:
                raise PolicyError(
                    f"'policy_factory' {qualname!r} lives in __main__ and its script's folder is "
                    "not importable; move it into a module or pass 'module:function'."
                )
            module = script.stem
    return f"{module}:{qualname}"


@dataclass
class WeightSnapshot:
    """Weights copied off the training device at trigger time (maybe still in flight on CUDA)."""

    state: dict[str, torch.Tensor]
    module: torch.nn.Module | None
    events: list[Any]
    extras: dict[str, Any] = field(default_factory=dict)
    """What the module's state_dict leaves out (``module_extras``), copied at trigger time."""
    structure: tuple[Any, ...] | None = None
    """The module's ``module_structure`` at trigger time (None: a state_dict, or not compiled here)."""
    template: torch.nn.Module | None = None
    """A copy of the module's structure at trigger time, holding this snapshot's tensors; None when
    the caller said the structure had not changed since its previous snapshot."""

    def ready(self) -> dict[str, torch.Tensor]:
        """The CPU tensors, after any pending device→host copy has landed."""
        for event in self.events:
            event.synchronize()
        self.events = []
        return self.state


def _scalar(value: Any) -> bool:
    """An immutable value TorchScript keeps as a module attribute, compared with ``==``."""
    import torch

    return value is None or isinstance(
        value, bool | int | float | complex | str | enum.Enum | torch.device | torch.dtype | torch.layout)


def _plain(value: Any) -> bool:
    """A value TorchScript keeps as a module attribute, compared and copied by value here.

    Scalars (``_scalar``), tensors, and lists, tuples and dicts (keys str, int, float or bool)
    of them, nested to any depth.
    """
    import torch

    if _scalar(value) or isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str | int | float | bool) and _plain(v) for k, v in value.items())
    return isinstance(value, list | tuple) and all(_plain(v) for v in value)


def _copied(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)(*(_copied(v) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_copied(v) for v in value)
    return value


def module_extras(module: torch.nn.Module) -> dict[str, Any]:
    """What of ``module``'s state its ``state_dict`` leaves out, by dotted name, copied to CPU.

    Non-persistent buffers and plain attributes (numbers, strings, tensors not registered, lists,
    tuples and dicts of them; see ``_plain``): an observation normaliser's running mean kept as a
    plain tensor, an action scale, a dict of per-key scales, a temperature. A compiled copy keeps
    them as they were when it was compiled. Attributes of other kinds are left out here;
    ``PolicyWriter`` refuses a module whose compiled copy keeps one (``_check_kept``).
    """
    out: dict[str, Any] = {}
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, buf in sub._buffers.items():
            if buf is not None and name in sub._non_persistent_buffers_set:
                out[f"{dot}{name}"] = _copied(buf)
        for name, value in _attributes(sub):
            if _plain(value):
                out[f"{dot}{name}"] = _copied(value)
    return out


def _attributes(sub: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """The attributes of ``sub`` its forward may read besides parameters, buffers and submodules.

    ``nn.Module``'s own bookkeeping is left out, and so are the private attributes of torch's own
    modules (an LSTM's ``_flat_weights`` are its parameters). A private attribute of a module of
    the user's (``self._scale``, ``self._mean``) counts like a public one: a compiled copy keeps it
    the same way.
    """
    internal = _module_internals()
    own = not type(sub).__module__.startswith("torch.")
    for name, value in vars(sub).items():
        if name in internal or (name.startswith("_") and not own):
            continue
        yield name, value


@functools.cache
def _module_internals() -> frozenset[str]:
    """The attributes every ``nn.Module`` sets on itself (``training``, ``_parameters``, hooks...)."""
    import torch

    return frozenset(vars(torch.nn.Module()))


def module_structure(module: torch.nn.Module) -> tuple[Any, ...]:
    """What decides ``module``'s compiled forward besides its state_dict and ``module_extras``.

    Each submodule's name, type and identity, and its forward hooks (TorchScript compiles them):
    a layer swapped in place (``model[1] = nn.Sigmoid()``, same module object, same state_dict
    keys) changes it.
    """
    return tuple((name, type(sub), id(sub), tuple(sub._forward_pre_hooks), tuple(sub._forward_hooks))
                 for name, sub in module.named_modules())


def _structure_copy(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and persistent buffers are ``state``'s CPU tensors.

    Taken on the training thread, without copying the weights again (on the device or off it);
    the compiled copy loads each snapshot's own weights anyway.
    """
    import torch

    memo: dict[int, Any] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name not in state:
            continue
        if isinstance(tensor, torch.nn.Parameter):
            memo[id(tensor)] = torch.nn.Parameter(state[name], requires_grad=tensor.requires_grad)
        else:
            memo[id(tensor)] = state[name]
    return copy.deepcopy(module, memo)


def _same(a: dict[str, Any], b: dict[str, Any] | None) -> bool:
    import torch

    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype and x.shape == y.shape and bool(torch.equal(x, y)))
        if isinstance(x, list | tuple) and isinstance(y, list | tuple):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y, strict=True))
        if isinstance(x, dict) or isinstance(y, dict):
            # Same keys in the same order (a compiled dict keeps its order), same values.
            return (isinstance(x, dict) and isinstance(y, dict)
                    and [(type(k), k) for k in x] == [(type(k), k) for k in y]
                    and all(eq(x[k], y[k]) for k in x))
        return type(x) is type(y) and bool(x == y)

    return b is not None and a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


def _with_extras(module: torch.nn.Module, extras: dict[str, Any]) -> None:
    """Set ``extras`` (``module_extras``) on ``module``, a copy of the module they came from."""
    for path, value in extras.items():
        owner, _, name = path.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if name in sub._buffers:
            sub._buffers[name] = _copied(value)
        else:
            setattr(sub, name, _copied(value))


def _check_kept(template: torch.nn.Module, scripted: Any) -> None:
    """Refuse an attribute the compiled copy keeps but ``module_extras`` cannot carry over.

    Such a value would stay in the compiled copy as it was at its compile while the weights move
    on: later snapshots would be evaluated with it, silently (and, unchanged weights aside, as a
    file identical to an earlier one). Attributes TorchScript leaves out (it cannot type them)
    are no concern: a forward that used one would not have compiled.
    """
    compiled = dict(scripted.named_modules())
    for prefix, sub in template.named_modules():
        twin = compiled.get(prefix)
        if twin is None:
            continue
        for name, value in _attributes(sub):
            if _plain(value):
                continue
            if twin._c.hasattr(name):
                path = f"{prefix}.{name}" if prefix else name
                raise PolicyError(
                    f"attribute {path!r} of {type(template).__name__} holds a "
                    f"{type(value).__module__}.{type(value).__qualname__}, which the compiled "
                    "policy keeps as it was at its compile but evalfleet cannot compare or copy "
                    "from later snapshots (it carries numbers, strings, tensors, torch.device/"
                    "dtype, enums, and lists, tuples and dicts of them); keep that state in a "
                    "buffer or parameter (register_buffer), or pass policy_factory="
                    "'module:function' so the weights travel as a state_dict instead."
                )


def snapshot_weights(weights: Any, extras: bool = True,
                     structure: tuple[Any, ...] | None = None) -> WeightSnapshot:
    """Copy an ``nn.Module``'s or a state_dict's tensors to CPU without waiting on the device.

    ``extras``: also copy what a module's state_dict leaves out (``module_extras``) and note its
    structure (``module_structure``), which only a module compiled here needs; with a policy
    factory the workers build the module themselves. The structure itself is copied too, unless
    it is ``structure``: that of the previous snapshot given to the same ``PolicyWriter``.

    CUDA tensors are copied with ``non_blocking=True`` behind a recorded event (the worker thread
    waits on the event, the training thread does not); the copy is ordered before any later
    optimizer step on the same stream, so it sees exactly the weights of this step.
    """
    import torch

    module = weights if isinstance(weights, torch.nn.Module) else None
    source = weights.state_dict() if module is not None else weights
    if not isinstance(source, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in source.items()
    ):
        raise PolicyError(
            f"weights must be an nn.Module or a state_dict (str -> Tensor); got "
            f"{type(weights).__name__}."
        )
    state: dict[str, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for name, tensor in source.items():
        t = tensor.detach()
        if t.is_cuda:
            devices.add(t.device)
            state[name] = t.to("cpu", non_blocking=True)
        else:
            state[name] = t.clone()
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    if module is None or not extras:
        return WeightSnapshot(state, module, events)
    now = module_structure(module)
    return WeightSnapshot(state, module, events, module_extras(module), now,
                          _structure_copy(module, state) if now != structure else None)


class PolicyWriter:
    """Turns weight snapshots into content-addressed policy files under ``folder``.

    With a factory the file is the state_dict (``torch.save``); without one, the module is
    compiled to TorchScript once and each snapshot is loaded into the compiled copy; it is
    compiled again, from the structure copied at the snapshot's trigger, when a snapshot's
    ``structure`` (submodules, hooks) or ``extras`` (non-persistent buffers, plain attributes)
    differ from those it was compiled with. A module whose compiled copy keeps an attribute of
    another kind is refused (``PolicyError``) rather than written with that attribute's first value.
    """

    def __init__(self, folder: Path, factory: str | None) -> None:
        self.folder = Path(folder)
        self.factory = factory
        self._scripted: Any = None
        self._structure: tuple[Any, ...] | None = None  # what self._scripted was compiled from
        self._extras: dict[str, Any] | None = None
        self._template: torch.nn.Module | None = None  # the latest snapshot's structure copy
        self._template_structure: tuple[Any, ...] | None = None
        self._buffer_keys: set[str] = set()

    def write(self, snapshot: WeightSnapshot) -> Path:
        """Write the snapshot; returns the file path (named by its sha256)."""
        import torch

        state = snapshot.ready()
        buffer = io.BytesIO()
        if self.factory is not None:
            torch.save(state, buffer)
        else:
            if snapshot.module is None:
                raise PolicyError(
                    "a state_dict needs 'policy_factory' ('module:function' building the "
                    "nn.Module); or pass the nn.Module itself."
                )
            with warnings.catch_warnings():
                # torch 2.13 deprecates TorchScript; it is still evalfleet's self-contained format.
                warnings.simplefilter("ignore", DeprecationWarning)
                torch.jit.save(self._script(snapshot, state), buffer)
        blob = buffer.getvalue()
        digest = hashlib.sha256(blob).hexdigest()
        path = self.folder / f"{digest}.pt"
        if not path.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, path)
        return path

    def _script(self, snapshot: WeightSnapshot, state: dict[str, torch.Tensor]) -> Any:
        import torch

        module, extras, structure = snapshot.module, snapshot.extras, snapshot.structure
        if snapshot.template is not None:
            self._template, self._template_structure = snapshot.template, structure
        if (self._scripted is None or structure is None or structure != self._structure
                or not _same(extras, self._extras)):
            # Compiled once, and again whenever the structure or what the state_dict leaves out
            # changed (a compiled copy keeps both as they were); the weights come from each
            # snapshot below. The structure is the one copied at trigger time: the module may
            # have changed since.
            if self._template is None or structure is None or structure != self._template_structure:
                raise PolicyError(
                    f"the snapshot of {type(module).__name__} carries no copy of its structure at "
                    "trigger time; take it with snapshot_weights(module) (without 'structure', or "
                    "with the previous snapshot's) before handing it to this PolicyWriter."
                )
            template = copy.deepcopy(self._template).to("cpu").eval()
            _with_extras(template, extras)
            try:
                scripted = torch.jit.script(template)
            except Exception as err:
                raise PolicyError(
                    f"cannot compile {type(module).__name__} to TorchScript ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}); pass policy_factory="
                    "'module:function' so the weights travel as a state_dict instead."
                ) from err
            _check_kept(template, scripted)
            self._scripted = scripted
            self._structure = structure
            self._extras = extras
            # A compiled module lists its non-persistent buffers in its state_dict too.
            self._buffer_keys = set(self._scripted.state_dict()) - set(state)
        self._scripted.load_state_dict(
            {**{k: extras[k] for k in self._buffer_keys if k in extras}, **state})
        return self._scripted


__all__ = ["PolicyWriter", "WeightSnapshot", "factory_ref", "module_extras", "module_structure",
           "snapshot_weights"]
