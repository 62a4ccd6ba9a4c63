"""Policy factories the integration tests send as state_dicts ('tests.integration.policies:...')."""

import torch


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def wrong_output() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)
