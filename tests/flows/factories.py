"""Policy factories for state_dict tests."""

import torch


def linear_4_2() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def linear_4_3() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)
