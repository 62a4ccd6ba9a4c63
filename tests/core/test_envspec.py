"""The env fingerprint: its providing package (the fast lookup agrees with the full scan) and the
exact forms of kwargs."""

import importlib.metadata
import json

import numpy
import pytest

from evalfleet import envspec
from evalfleet.errors import EnvSpecError
from evalfleet.provenance import RECORD_MARK, SOURCE_PREFIX


@pytest.mark.parametrize("module", ["gymnasium.envs.classic_control.cartpole", "numpy.random",
                                    "envs.inventory", "yaml"])
def test_providing_package_matches_a_full_scan(module):
    top = module.split(".", 1)[0]
    scanned = importlib.metadata.packages_distributions().get(top, [])
    name, version = envspec._package_of(module)
    assert name == scanned[0]  # envs.* comes from this project's distribution, yaml from PyYAML
    # envs.* comes from an editable install of this project: its version names no code, so the
    # source of its files is appended; a wheel's, the digest of its installed-file record
    # (evalfleet.provenance: a wheel rebuilt under its version is other code).
    expected = importlib.metadata.version(scanned[0])
    assert version.startswith(f"{expected}+{SOURCE_PREFIX}" if top == "envs" else f"{expected}{RECORD_MARK}")


def test_module_without_a_distribution_is_hashed_by_source():
    name, version = envspec._package_of("tests.flows.user_envs")
    assert name == "tests" and version.startswith("source-sha256:")


# --- what the fingerprint makes of kwargs ------------------------------------------------------

def test_plain_json_kwargs_pass_and_the_rest_is_refused_with_its_path():
    envspec.check_env_kwargs("X-v0", {"a": [1, 2.5, None, True, {"b": "c"}], "d": 1e308})
    with pytest.raises(EnvSpecError) as err:
        envspec.check_env_kwargs("X-v0", {"a": [1, {"b": (1, 2)}]})
    message = str(err.value)
    assert "env 'X-v0': env kwarg 'a'[1]['b'] must be a JSON value" in message
    assert "got builtins.tuple: (1, 2)" in message and "a list for a tuple" in message


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_kwargs_are_refused_with_their_path(bad):
    # NaN is not JSON: the env got NaN (truthy) while the key, report and params held null.
    with pytest.raises(EnvSpecError, match=r"env kwarg 'a'\[0\]\['b'\] must be a JSON value "
                       r"\(.*finite float.*got builtins.float: (nan|inf|-inf)\)"):
        envspec.check_env_kwargs("X-v0", {"a": [{"b": bad}]})


class _Opaque:
    pass


def test_the_exact_form_of_spec_kwargs_tells_values_apart_and_is_stable():
    forms = [envspec._spec_value(v, set()) for v in (
        [1, 2], (1, 2), {"__tuple__": [1, 2]}, 1.0, 1, numpy.float64(1.0), numpy.float32(1.0), True,
        numpy.ones(3), numpy.ones(3, dtype=numpy.float32), numpy.ones((3, 1)), {1: "a"}, {"1": "a"},
    )]
    blobs = [json.dumps(f, sort_keys=True) for f in forms]  # JSON-ready: no default= needed
    assert len(set(blobs)) == len(blobs), blobs
    changed = numpy.ones(2000)
    changed[500] = 2.0
    assert envspec._spec_value(changed, set()) != envspec._spec_value(numpy.ones(2000), set())
    # Two objects with a default repr (a memory address each) get one form; their class is keyed.
    modules: set[str] = set()
    assert envspec._spec_value(_Opaque(), modules) == envspec._spec_value(_Opaque(), modules)
    assert "0x" not in json.dumps(envspec._spec_value(_Opaque(), modules))
    assert envspec._spec_value(numpy.float32, modules) == {"__object__": "numpy:float32"}
    assert modules == {__name__, "numpy"}
