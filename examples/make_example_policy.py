"""Build the bundled CartPole example policy (evalfleet/data/cartpole_mlp.pt).

A 4-64-64-2 MLP whose logit difference equals the linear controller
``z = -0.1*x_dot + theta + 0.1*theta_dot``: it balances well, with episode lengths that vary
(mean ~390, std ~140 over seeds), which is what an evaluation harness should be exercised with.
The other hidden units carry seeded random weights whose outputs are zeroed, so the network costs
what a real MLP of that size costs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

W = torch.tensor([0.0, -0.1, 1.0, 0.1])


def build() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    with torch.no_grad():
        for layer in (net[0], net[2], net[4]):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.1)
            layer.bias.zero_()
        # Unit 0 carries z through tanh (monotone, sign-preserving); the rest are inert downstream.
        net[0].weight[0] = W
        net[2].weight.zero_()
        net[2].weight[0, 0] = 1.0
        net[2].weight[1, 0] = -1.0
        net[4].weight.zero_()
        net[4].weight[1, 0] = 1.0
        net[4].weight[1, 1] = -1.0
    return net


def main(path: str = "evalfleet/data/cartpole_mlp.pt") -> None:
    scripted = torch.jit.script(build().eval())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(scripted, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
