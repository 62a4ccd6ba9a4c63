"""The env fingerprint's providing package: the fast lookup agrees with the full scan."""

import importlib.metadata

import pytest

from evalfleet import envspec


@pytest.mark.parametrize("module", ["gymnasium.envs.classic_control.cartpole", "numpy.random",
                                    "envs.inventory", "yaml"])
def test_providing_package_matches_a_full_scan(module):
    top = module.split(".", 1)[0]
    scanned = importlib.metadata.packages_distributions().get(top, [])
    name, version = envspec._package_of(module)
    assert name == scanned[0]  # envs.* comes from this project's distribution, yaml from PyYAML
    # envs.* comes from an editable install of this project: its version names no code, so the
    # source of its files is appended (evalfleet.provenance).
    expected = importlib.metadata.version(scanned[0])
    assert version == expected or version.startswith(f"{expected}+source-sha256:")
    assert (version != expected) == (top == "envs")


def test_module_without_a_distribution_is_hashed_by_source():
    name, version = envspec._package_of("tests.flows.user_envs")
    assert name == "tests" and version.startswith("source-sha256:")
