"""A module compiled once for the Evaluator evaluates each snapshot's values, not the first one's.

``PolicyWriter`` compiles an ``nn.Module`` to TorchScript once and loads each snapshot's
state_dict into the compiled copy. What the state_dict leaves out (non-persistent buffers, plain
attributes such as an observation normaliser's mean kept as a tensor, or an action scale) stayed
as it was at the first compile: later checkpoints were evaluated with stale values, silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from evalfleet.errors import PolicyError
from evalfleet.snapshots import PolicyWriter, module_extras, snapshot_weights


class Normalised(torch.nn.Module):
    def __init__(self, buffer: bool = True) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        # A non-persistent buffer made the compiled copy refuse every snapshot's state_dict.
        self.register_buffer("offset", torch.zeros(2), persistent=not buffer)
        self.mean = torch.zeros(2)  # a plain tensor attribute, as normalisers often keep it
        self.scale = 1.0
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear((x - self.mean) * self.scale + self.offset)


def _out(path: Path, x: torch.Tensor) -> torch.Tensor:
    return torch.jit.load(str(path))(x).detach()


@pytest.mark.parametrize("buffer", [False, True])
def test_each_snapshot_is_compiled_with_its_own_state_outside_the_state_dict(tmp_path, buffer):
    module, x = Normalised(buffer), torch.tensor([[1.0, 2.0]])
    writer = PolicyWriter(tmp_path, None)
    first = writer.write(snapshot_weights(module))
    with torch.no_grad():
        assert torch.equal(_out(first, x), module(x))
        module.mean = torch.tensor([0.5, -0.5])  # training updates what no state_dict carries
        module.scale = 3.0
        module.offset.fill_(0.25)
        snap = snapshot_weights(module)
        module.scale = 7.0  # after the trigger: not this snapshot's
        second = writer.write(snap)
        module.scale = 3.0
        assert torch.equal(_out(second, x), module(x))
        assert not torch.equal(_out(second, x), _out(first, x))
    assert set(module_extras(module)) == {"mean", "scale", "steps", "linear.in_features",
                                          "linear.out_features"} | ({"offset"} if buffer else set())


def test_unchanged_extras_reuse_the_compiled_copy(tmp_path):
    module = Normalised()
    writer = PolicyWriter(tmp_path, None)
    writer.write(snapshot_weights(module))
    compiled = writer._scripted
    with torch.no_grad():
        module.linear.weight.add_(1.0)  # weights only: loaded into the same compiled copy
    writer.write(snapshot_weights(module))
    assert writer._scripted is compiled
    module.steps += 1  # any change outside the state_dict compiles again
    writer.write(snapshot_weights(module))
    assert writer._scripted is not compiled


def test_with_a_factory_the_training_thread_copies_no_extras():
    module = Normalised()
    assert snapshot_weights(module, extras=False).extras == {}
    assert set(snapshot_weights(module).extras) >= {"mean", "scale", "offset"}


class Scaled(torch.nn.Module):
    """Scales kept in dicts, which TorchScript compiles as module attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.scales = {"obs": 1.0}  # Dict[str, float] and Dict[str, List[Tensor]] once compiled
        self.shifts = {"obs": [torch.zeros(2)]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.scales["obs"] + self.shifts["obs"][0])


def test_a_dict_attribute_changed_between_triggers_is_written_with_its_new_values(tmp_path):
    # Dicts were neither compared nor copied: the second trigger wrote the first one's file
    # again (same sha256, so the first step's episodes were reused for the new step).
    module, x = Scaled(), torch.tensor([[1.0, -2.0]])
    writer = PolicyWriter(tmp_path, None)
    first = writer.write(snapshot_weights(module))
    module.scales["obs"] = 100.0  # mutated in place, as training does
    snap = snapshot_weights(module)
    module.scales["obs"] = 7.0  # after the trigger: not this snapshot's
    module.shifts["obs"][0].fill_(7.0)
    second = writer.write(snap)
    module.scales["obs"] = 100.0
    module.shifts["obs"][0].zero_()
    with torch.no_grad():
        assert second != first
        assert torch.equal(_out(second, x), module(x))
        assert not torch.equal(_out(second, x), _out(first, x))
        module.shifts["obs"][0].fill_(0.5)  # a tensor inside a dict, changed in place
        third = writer.write(snapshot_weights(module))
        assert third != second
        assert torch.equal(_out(third, x), module(x))
    compiled = writer._scripted
    writer.write(snapshot_weights(module))  # nothing changed: the compiled copy is reused
    assert writer._scripted is compiled
    assert {"scales", "shifts"} <= set(module_extras(module))


@torch.jit.script
class Counter:
    def __init__(self, n: int) -> None:
        self.n = n


class Bounds(NamedTuple):
    low: float
    high: float


class Keeps(torch.nn.Module):
    def __init__(self, value: object) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.kept = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize("value", [{torch.zeros(1): 1.0}, Counter(1)], ids=["tensor-keyed dict", "object"])
def test_an_attribute_the_compiled_copy_keeps_but_cannot_be_carried_over_is_refused(tmp_path, value):
    # TorchScript keeps these as module attributes; a later snapshot could not update them.
    with pytest.raises(PolicyError, match=r"'kept' of Keeps holds .*register_buffer.*policy_factory"):
        PolicyWriter(tmp_path, None).write(snapshot_weights(Keeps(value)))


def test_other_attributes_are_still_carried_over_or_ignored(tmp_path):
    module, x = Keeps(None), torch.tensor([[1.0, 2.0]])
    module.opaque = object()  # TorchScript cannot type it: left out of the compiled copy
    module.device, module.dtype = torch.device("cpu"), torch.float32
    module.bounds = Bounds(-1.0, 1.0)  # copying a NamedTuple used to raise a TypeError
    writer = PolicyWriter(tmp_path, None)
    with torch.no_grad():
        assert torch.equal(_out(writer.write(snapshot_weights(module)), x), module(x))
    assert {"kept", "device", "dtype", "bounds"} <= set(module_extras(module))
    assert "opaque" not in module_extras(module)


class Private(torch.nn.Module):
    """An action scale and a normaliser's mean kept under private names."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self._scale = 1.0
        self._mean = torch.zeros(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear((x - self._mean) * self._scale)


def test_private_attributes_of_the_users_module_are_carried_over(tmp_path):
    """``self._scale``/``self._mean`` were skipped like ``nn.Module``'s own bookkeeping: the
    second trigger wrote the first one's file (same sha256: a cache hit on step 1's episodes,
    labelled step 2)."""
    module, x = Private(), torch.tensor([[1.0, 2.0]])
    writer = PolicyWriter(tmp_path, None)
    first = writer.write(snapshot_weights(module))
    module._scale, module._mean = 5.0, torch.tensor([3.0, -3.0])
    second = writer.write(snapshot_weights(module))
    with torch.no_grad():
        assert second != first
        assert torch.equal(_out(second, x), module(x))
    assert {"_scale", "_mean"} <= set(module_extras(module))
    # torch's own modules keep their private bookkeeping to themselves: an LSTM still writes.
    lstm = torch.nn.LSTM(2, 3)
    assert not any(k.split(".")[-1].startswith("_") for k in module_extras(lstm))
    PolicyWriter(tmp_path / "lstm", None).write(snapshot_weights(lstm))


def negated(module: torch.nn.Module, inputs: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    """A forward hook (TorchScript compiles it with the module)."""
    return -output


def _layers(path: Path) -> list[str]:
    return [child.original_name for child in torch.jit.load(str(path)).children()]


def test_a_layer_swapped_in_place_is_compiled_again_as_it_was_at_the_trigger(tmp_path):
    # Same module object, same state_dict keys and extras: the compiled copy of the first
    # structure was reused, and step 1 was written as step 0's file (same sha256, old layer).
    module, x = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2)), \
        torch.tensor([[1.0, -2.0]])
    writer = PolicyWriter(tmp_path, None)
    first = writer.write(snapshot_weights(module))
    module[1] = torch.nn.Sigmoid()  # an ablation between two triggers
    snap = snapshot_weights(module)
    module[1] = torch.nn.ReLU()  # after the trigger: not this snapshot's
    second = writer.write(snap)
    module[1] = torch.nn.Sigmoid()
    with torch.no_grad():
        assert second != first
        assert (_layers(first), _layers(second)) == (["Linear", "Tanh", "Linear"],
                                                     ["Linear", "Sigmoid", "Linear"])
        assert torch.equal(_out(second, x), module(x))
        module[2].register_forward_hook(negated)  # a hook decides the forward too
        snap = snapshot_weights(module)
        third = writer.write(snap)
        assert third != second
        assert torch.equal(_out(third, x), module(x))
        assert torch.equal(_out(third, x), -_out(second, x))
        compiled = writer._scripted
        module[0].weight.add_(1.0)  # weights only: no structure copied, none compiled
        unchanged = snapshot_weights(module, structure=snap.structure)
        assert unchanged.template is None
        assert torch.equal(_out(writer.write(unchanged), x), module(x))
        assert writer._scripted is compiled


def test_the_evaluator_copies_the_structure_only_when_it_changed(tmp_path):
    from evalfleet.client import EvaluationFailed, Evaluator

    seen: list[tuple[int, list[str]]] = []

    def runner(request):
        seen.append((request.step, _layers(Path(request.policy))))
        raise RuntimeError("planted: stop here")

    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with Evaluator(output=tmp_path, runner=runner, busy_policy="queue") as ev:
        for step, layer in ((0, None), (1, None), (2, torch.nn.Sigmoid())):
            if layer is not None:
                module[1] = layer
            ev.trigger_eval(module, step)
        snapshots = [job.snapshot for job in ev._triggered]
        for _ in range(3):
            with pytest.raises(EvaluationFailed, match="planted: stop here"):
                ev.wait(timeout=60)
    assert seen == [(0, ["Linear", "Tanh", "Linear"]), (1, ["Linear", "Tanh", "Linear"]),
                    (2, ["Linear", "Sigmoid", "Linear"])]
    # The training thread copied the structure for the first call and after the swap only.
    assert [snap.template is not None for snap in snapshots] == [True, False, True]
