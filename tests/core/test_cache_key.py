"""Every ingredient of the cache key, planted and changed through the real stage 1 (``receive``).

Each README cache-table row gets a planted change that must be a miss; the execution settings that
must not change results (output folder, workers, concurrency, isolation...) must stay hits.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import gymnasium
import numpy
import pytest
import torch
from gymnasium.envs.registration import WrapperSpec

import evalfleet
import evalfleet.cluster
import evalfleet.pipeline
from evalfleet import cache as cache_mod
from evalfleet.cache import cache_key
from evalfleet.errors import EnvSpecError, RequestError
from evalfleet.models import EvalRequest
from evalfleet.pipeline import Received, receive
from evalfleet.provenance import RECORD_MARK, SOURCE_PREFIX, code_version

ROOT = Path(__file__).resolve().parents[2]


def _received(**fields: Any) -> Received:
    return receive(EvalRequest.build(**fields))


def _key(**fields: Any) -> str:
    return _received(**fields).cache_key


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _drop_modules(prefix: str) -> None:
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[name]


@pytest.fixture
def base(example_policy, tmp_path):
    return dict(policy=example_policy, episodes=10, output=tmp_path / "out")


# --- the state_dict factory -------------------------------------------------------------------

NETS = """
    import torch.nn as nn


    def build():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
"""


@pytest.fixture
def state_dict_policy(tmp_path, monkeypatch):
    """A factory module on sys.path and weights saved from the module it builds."""
    name = _unique("keynets")
    _write(tmp_path, {f"{name}.py": NETS})
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    path = tmp_path / "sd.pt"
    torch.save(module.build().state_dict(), path)
    yield name, str(path), tmp_path / f"{name}.py"
    _drop_modules(name)


def test_editing_the_factory_changes_the_key(state_dict_policy, tmp_path):
    name, weights, source = state_dict_policy
    fields = dict(policy=weights, policy_factory=f"{name}:build", output=tmp_path / "out")
    before = _received(**fields)
    source.write_text(source.read_text().replace("nn.Tanh()", "nn.ReLU()"))
    importlib.reload(sys.modules[name])
    after = _received(**fields)
    assert after.artifact.sha256 == before.artifact.sha256  # same weights...
    assert after.cache_key != before.cache_key  # ...another network: a miss
    assert after.cache_ingredients["policy"]["factory_sha256"] != \
        before.cache_ingredients["policy"]["factory_sha256"]


def test_editing_a_helper_of_the_factory_package_changes_the_key(tmp_path, monkeypatch):
    pkg = _unique("keynetpkg")
    _write(tmp_path, {
        f"{pkg}/__init__.py": "",
        f"{pkg}/layers.py": "import torch.nn as nn\n\nACTIVATION = nn.Tanh\n",
        f"{pkg}/nets.py": f"""
            import torch.nn as nn

            from {pkg}.layers import ACTIVATION


            def build():
                return nn.Sequential(nn.Linear(4, 8), ACTIVATION(), nn.Linear(8, 2))
        """,
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        nets = importlib.import_module(f"{pkg}.nets")
        torch.save(nets.build().state_dict(), tmp_path / "sd.pt")
        fields = dict(policy=str(tmp_path / "sd.pt"), policy_factory=f"{pkg}.nets:build",
                      output=tmp_path / "out")
        key = _key(**fields)
        layers = tmp_path / pkg / "layers.py"
        layers.write_text(layers.read_text().replace("nn.Tanh", "nn.ReLU"))
        assert _key(**fields) != key
    finally:
        _drop_modules(pkg)


def test_factory_imported_from_another_module_is_keyed_by_that_module(tmp_path, monkeypatch):
    impl, alias = _unique("keyimpl"), _unique("keyalias")
    _write(tmp_path, {f"{impl}.py": NETS, f"{alias}.py": f"from {impl} import build  # noqa: F401\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        torch.save(importlib.import_module(impl).build().state_dict(), tmp_path / "sd.pt")
        fields = dict(policy=str(tmp_path / "sd.pt"), policy_factory=f"{alias}:build",
                      output=tmp_path / "out")
        key = _key(**fields)
        (tmp_path / f"{impl}.py").write_text(textwrap.dedent(NETS).replace("nn.Tanh()", "nn.ReLU()"))
        assert _key(**fields) != key
    finally:
        _drop_modules(impl)
        _drop_modules(alias)


# --- code the factory or callable imports from other packages ---------------------------------

SIBLING_NET = """
    import torch.nn as nn

    HIDDEN, ACTIVATION = 8, nn.ReLU


    class Net(nn.Sequential):
        def __init__(self):
            super().__init__(nn.Linear(4, HIDDEN), ACTIVATION(), nn.Linear(HIDDEN, 2))
"""

SIBLING_FACTORY = {
    "top": """
        from {net} import Net


        def build():
            return Net()
    """,
    "inside": """
        def build():
            from {net} import Net

            return Net()
    """,
}


def _sibling_factory(tmp_path: Path, request: pytest.FixtureRequest, where: str = "top"
                     ) -> tuple[dict[str, Any], Path]:
    """A factory whose network class comes from another top-level module beside it (imported at
    the factory module's top or inside the factory); returns request fields and that module."""
    net, factory = _unique("keynetlib"), _unique("keyfactmod")
    root = tmp_path / "sibling"
    _write(root, {f"{net}.py": SIBLING_NET,
                  f"{factory}.py": SIBLING_FACTORY[where].format(net=net)})
    request.getfixturevalue("monkeypatch").syspath_prepend(str(root))
    request.addfinalizer(lambda: (_drop_modules(net), _drop_modules(factory)))
    torch.save(importlib.import_module(factory).build().state_dict(), root / "sd.pt")
    return dict(policy=str(root / "sd.pt"), policy_factory=f"{factory}:build"), root / f"{net}.py"


CALLABLE_WITH_HELPER = """
    import numpy as np

    import {helper}


    def act(obs):
        return ({helper}.GAIN * obs[:, 2] > 0).astype(np.int64)
"""


def _callable_with_helper(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, Path]:
    """A callable policy reading a constant of a helper module beside it: its reference and the
    helper's file."""
    helper, policy = _unique("keycbhelp"), _unique("keycbpol")
    root = tmp_path / "callable"
    _write(root, {f"{helper}.py": "GAIN = 1.0\n",
                  f"{policy}.py": CALLABLE_WITH_HELPER.format(helper=helper)})
    request.getfixturevalue("monkeypatch").syspath_prepend(str(root))
    request.addfinalizer(lambda: (_drop_modules(helper), _drop_modules(policy)))
    return f"{policy}:act", root / f"{helper}.py"


def test_the_packages_a_factory_imports_are_in_the_key(tmp_path, request):
    fields, net = _sibling_factory(tmp_path, request)
    code = _received(**fields, output=tmp_path / "out").cache_ingredients["policy"]["code"]
    assert code[net.stem].startswith(SOURCE_PREFIX)  # not installed: keyed by its source
    # A wheel: by its version and its installed-file record.
    assert code["torch"].startswith(f"{importlib.metadata.version('torch')}{RECORD_MARK}")
    assert list(code) == sorted(code)


def test_code_a_callable_imports_is_keyed_alike_in_a_fresh_process(tmp_path, request):
    """The key does not depend on what the process imported before; an edit still changes it."""
    import json
    import subprocess

    policy, helper = _callable_with_helper(tmp_path, request)
    fields = dict(policy=policy, output=str(tmp_path / "out"))
    here = _key(**fields)
    code = ("import json, sys; "
            "from evalfleet.models import EvalRequest; "
            "from evalfleet.pipeline import receive_unloaded; "
            "print(receive_unloaded(EvalRequest.build(**json.loads(sys.argv[1])))[0].cache_key)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(helper.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    fresh = subprocess.run([sys.executable, "-c", code, json.dumps(fields)], env=env,
                           capture_output=True, text=True, timeout=300, cwd=ROOT, check=True)
    assert fresh.stdout.split()[-1] == here, fresh.stderr[-2000:]
    helper.write_text("GAIN = -1.0\n")
    assert _key(**fields) != here


# --- the env's package ------------------------------------------------------------------------

ENV_PACKAGE = {
    "__init__.py": """
        import gymnasium as gym

        gym.register("{env_id}", entry_point="{pkg}.env:CorridorEnv", max_episode_steps=50)
    """,
    "dynamics.py": """
        DRIFT = 0.25
    """,
    "env.py": """
        import gymnasium as gym
        import numpy as np
        from gymnasium import spaces

        from {pkg}.dynamics import DRIFT


        class CorridorEnv(gym.Env):
            def __init__(self):
                self.observation_space = spaces.Box(-10.0, 10.0, shape=(4,), dtype=np.float32)
                self.action_space = spaces.Discrete(2)
                self._x = 0.0

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                self._x = float(self.np_random.uniform(-1, 1))
                return np.full(4, self._x, dtype=np.float32), {{}}

            def step(self, action):
                self._x += (1.0 if action == 1 else -1.0) * DRIFT
                return np.full(4, self._x, dtype=np.float32), 1.0, abs(self._x) > 5, False, {{}}
    """,
}


def test_editing_a_helper_of_an_uninstalled_env_package_changes_the_key(base, tmp_path, monkeypatch):
    pkg = _unique("keyenvpkg")
    env_id = f"KeyCorridor{uuid.uuid4().hex[:6]}-v0"
    _write(tmp_path / "src", {f"{pkg}/{name}": text.format(pkg=pkg, env_id=env_id)
                              for name, text in ENV_PACKAGE.items()})
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    try:
        fields = {**base, "env": f"{pkg}:{env_id}"}
        before = _received(**fields)
        assert before.cache_ingredients["env"]["package"] == pkg
        assert before.cache_ingredients["env"]["package_version"].startswith(SOURCE_PREFIX)
        helper = tmp_path / "src" / pkg / "dynamics.py"  # not the entry point's module
        helper.write_text(helper.read_text().replace("0.25", "0.5"))
        after = _received(**fields)
        assert after.cache_key != before.cache_key
        assert after.cache_ingredients["policy"] == before.cache_ingredients["policy"]
    finally:
        _drop_modules(pkg)


def test_editing_a_data_file_of_an_uninstalled_env_package_changes_the_key(base, tmp_path,
                                                                          monkeypatch):
    """A level map or table shipped beside the env's code shapes returns as the code does."""
    pkg = _unique("keydatapkg")
    env_id = f"KeyData{uuid.uuid4().hex[:6]}-v0"
    files = {f"{pkg}/{name}": text.format(pkg=pkg, env_id=env_id)
             for name, text in ENV_PACKAGE.items()}
    files[f"{pkg}/levels/corridor.txt"] = "width 5\n"
    _write(tmp_path / "src", files)
    (tmp_path / "src" / pkg / "__pycache__").mkdir()  # compiled caches never count
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    try:
        fields = {**base, "env": f"{pkg}:{env_id}"}
        before = _received(**fields)
        (tmp_path / "src" / pkg / "__pycache__" / "env.cpython-311.pyc").write_bytes(b"\0")
        assert _received(**fields).cache_key == before.cache_key
        (tmp_path / "src" / pkg / "levels" / "corridor.txt").write_text("width 9\n")
        assert _received(**fields).cache_key != before.cache_key
    finally:
        _drop_modules(pkg)


def test_an_editable_install_is_keyed_by_source_a_wheel_by_version():
    # This repository is installed with `pip install -e .`: its envs/ are keyed by their files.
    name, version = code_version("envs.inventory")
    assert name == "evalfleet"
    assert version.startswith(f"{importlib.metadata.version('evalfleet')}+{SOURCE_PREFIX}")
    name, version = code_version("gymnasium.envs.classic_control.cartpole")
    assert (name, version.split(RECORD_MARK)[0]) == ("gymnasium", gymnasium.__version__)
    assert re.fullmatch(r"[0-9a-f]{16}", version.split(RECORD_MARK)[1])  # its installed files


def test_this_repositorys_envs_are_keyed_by_their_source(tmp_path, monkeypatch):
    import envs

    fields = dict(env="evalfleet/Inventory-v0", policy="envs.reference_policies:inventory_heuristic",
                  output=tmp_path / "out")
    key = _key(**fields)
    # A copy of envs/ with one helper edited, imported in its place.
    copy = tmp_path / "copy" / "envs"
    for path in Path(envs.__file__).parent.glob("*.py"):
        copy.parent.mkdir(exist_ok=True)
        copy.mkdir(exist_ok=True)
        (copy / path.name).write_text(path.read_text())
    helper = next(p for p in sorted(copy.glob("*.py")) if p.name not in ("__init__.py", "inventory.py"))
    helper.write_text(helper.read_text() + "\n# edited\n")
    monkeypatch.setattr(envs, "__path__", [str(copy)])
    monkeypatch.setattr(envs.__spec__, "submodule_search_locations", [str(copy)])
    assert _key(**fields) != key


# --- the registered spec and the module that registers it ----------------------------------

REGISTERING_MODULE = """
    import gymnasium as gym

    gym.register("{env_id}", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
                 kwargs={{"sutton_barto_reward": {flag}}}, max_episode_steps=200)
"""


@pytest.fixture
def registering_module(tmp_path, monkeypatch):
    """A module on sys.path that registers a CartPole under its own id with kwargs it sets."""
    name, env_id = _unique("keyregcp"), f"KeyRegCP{uuid.uuid4().hex[:6]}-v0"
    source = tmp_path / "reg" / f"{name}.py"
    _write(tmp_path / "reg", {source.name: REGISTERING_MODULE.format(env_id=env_id, flag=False)})
    monkeypatch.syspath_prepend(str(source.parent))
    yield name, env_id, source
    _drop_modules(name)
    gymnasium.registry.pop(env_id, None)


SCENARIO_MODULE = """
    import json
    import os

    import gymnasium
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv


    class ScenarioCartPole(CartPoleEnv):
        \"\"\"CartPole whose gravity a scenario file (or a folder's level.json) sets.\"\"\"

        def __init__(self, scenario, render_mode=None):
            super().__init__(render_mode=render_mode)
            path = scenario if os.path.isfile(scenario) else os.path.join(scenario, "level.json")
            with open(path) as f:
                self.gravity = json.load(f)["gravity"]


    gymnasium.register(id="{env_id}", entry_point="{name}:ScenarioCartPole",
                       max_episode_steps=50, kwargs={{"scenario": {default!r}}})
"""


@pytest.fixture
def scenario_env(tmp_path, monkeypatch):
    """A registered env reading its gravity from the file or folder its 'scenario' kwarg names.

    Yields the id (``module:EnvId-v0``), the registered default scenario file and a folder
    scenario; the env's code never changes, only the files it reads.
    """
    name, env_id = _unique("keyscenario"), f"KeyScenario{uuid.uuid4().hex[:6]}-v0"
    default, folder = tmp_path / "scenarios" / "default.json", tmp_path / "scenarios" / "hard"
    _write(tmp_path / "scenarios", {"default.json": '{"gravity": 9.8}',
                                    "hard/level.json": '{"gravity": 9.8}'})
    _write(tmp_path / "src", {f"{name}.py": SCENARIO_MODULE.format(
        env_id=env_id, name=name, default=str(default))})
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield f"{name}:{env_id}", default, folder
    _drop_modules(name)
    gymnasium.registry.pop(env_id, None)


def test_a_scenario_file_named_in_the_kwargs_is_keyed_by_its_bytes(scenario_env, base, tmp_path):
    """Editing the file an env reads is a miss; the same bytes under another run are a hit."""
    env, default, _ = scenario_env
    mine = tmp_path / "mine.json"
    mine.write_text('{"gravity": 9.8}')
    fields = {**base, "env": env, "env_kwargs": {"scenario": str(mine)}}
    before = _received(**fields)
    assert before.cache_ingredients["env"]["files"][str(mine)] == hashlib.sha256(
        mine.read_bytes()).hexdigest()
    assert _received(**fields).cache_key == before.cache_key  # nothing changed: a hit
    mine.write_text('{"gravity": 20.0}')
    after = _received(**fields)
    assert after.cache_key != before.cache_key
    assert after.cache_ingredients["env"]["kwargs"] == before.cache_ingredients["env"]["kwargs"]


def test_a_long_lived_worker_resolves_the_env_again_after_its_file_changed(scenario_env, base,
                                                                           tmp_path):
    """Rows carry the env spec hash of the file the episodes read, not of the one first seen."""
    from evalfleet.worker import _resolve

    env, _, _ = scenario_env
    mine = tmp_path / "worker.json"
    mine.write_text('{"gravity": 9.8}')
    request = EvalRequest.build(**base, env=env, env_kwargs={"scenario": str(mine)})
    isolation = receive(request).isolation  # the env's own module: sandboxed, described there
    assert isolation == "process"
    first = _resolve(request, isolation)
    assert _resolve(request, isolation) is first  # unchanged: resolved once
    mine.write_text('{"gravity": 20.0}')
    again = _resolve(request, isolation)
    assert again.fingerprint.spec_hash != first.fingerprint.spec_hash
    assert again.fingerprint.spec_hash == receive(request).env_spec_hash


def test_an_env_without_file_kwargs_keeps_its_key_shape(base):
    """Envs whose kwargs name no file carry no 'files' ingredient: their stored entries still hit."""
    assert "files" not in _received(**base).cache_ingredients["env"]
    assert "files" not in _received(**base, env_kwargs={"sutton_barto_reward": True}
                                    ).cache_ingredients["env"]


def test_the_registering_modules_kwargs_are_in_the_key(registering_module, base):
    """The id's module sets ``kwargs`` that ``gym.make`` passes on: flipping one is a miss."""
    name, env_id, source = registering_module
    fields = {**base, "env": f"{name}:{env_id}"}
    before = _received(**fields)
    # The module edited and imported afresh, as the next process would.
    source.write_text(textwrap.dedent(REGISTERING_MODULE.format(env_id=env_id, flag=True)))
    _drop_modules(name)
    gymnasium.registry.pop(env_id, None)  # registered here only if imported here (inprocess)
    after = _received(**fields)
    assert after.cache_key != before.cache_key
    assert before.cache_ingredients["env"]["spec_kwargs"] == {"sutton_barto_reward": False}
    assert after.cache_ingredients["env"]["spec_kwargs"] == {"sutton_barto_reward": True}


def test_the_registering_modules_code_is_in_the_key(registering_module, base):
    """The entry point is gymnasium's; the module named in the id is keyed by its own source."""
    name, env_id, source = registering_module
    fields = {**base, "env": f"{name}:{env_id}"}
    before = _received(**fields)
    source.write_text(source.read_text() + "\nSCALE = 2.0  # read by nothing yet: still a miss\n")
    assert _key(**fields) != before.cache_key
    assert before.cache_ingredients["env"]["code"][name].startswith(SOURCE_PREFIX)


ARRAY_ENV = """
    import gymnasium as gym
    import numpy as np
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv


    class GainsCartPole(CartPoleEnv):
        def __init__(self, gains=None, **kwargs):
            super().__init__(**kwargs)
            self.gains = np.ones(2000) if gains is None else np.asarray(gains, dtype=float)

        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            return obs, reward * float(self.gains[500]), terminated, truncated, info


    gym.register("{env_id}", entry_point=f"{{__name__}}:GainsCartPole", max_episode_steps=50,
                 kwargs={{"gains": np.ones(2000)}})
"""


@pytest.fixture
def array_env(tmp_path, monkeypatch):
    """An env whose return scales with element 500 of a 2,000-element array kwarg."""
    name, env_id = _unique("keyarrenv"), f"KeyArr{uuid.uuid4().hex[:6]}-v0"
    _write(tmp_path / "arr", {f"{name}.py": ARRAY_ENV.format(env_id=env_id)})
    monkeypatch.syspath_prepend(str(tmp_path / "arr"))
    yield f"{name}:{env_id}"
    _drop_modules(name)
    gymnasium.registry.pop(env_id, None)


@pytest.mark.parametrize("value", [numpy.ones(2000), (1.0, 2.0), numpy.int64(3), numpy.float64(0.5),
                                   [1, {"nested": numpy.ones(3)}], {"inner": {2: "int key"}}])
def test_env_kwargs_json_cannot_carry_are_refused_at_stage_1(array_env, base, value):
    """An array's ``str`` is truncated, a tuple would be keyed as a list: refused, not mis-keyed."""
    with pytest.raises(EnvSpecError, match=r"env kwarg 'gains'.* must be a JSON value .*got "
                                           r"(numpy|builtins)\..*tolist\(\)"):
        _key(**base, env=array_env, env_kwargs={"gains": value})


def test_one_element_of_a_list_kwarg_changes_the_key(array_env, base):
    gains = [1.0] * 2000
    key = _key(**base, env=array_env, env_kwargs={"gains": gains})
    gains[500] = 100.0
    assert _key(**base, env=array_env, env_kwargs={"gains": gains}) != key


def test_one_element_of_a_registered_array_kwarg_changes_the_key(array_env, base, monkeypatch):
    """The spec's kwargs may hold anything: an array is keyed by its bytes, dtype and shape."""
    fields = {**base, "env": array_env, "isolation": "inprocess"}  # its registry, edited here
    before = _received(**fields)
    spec = gymnasium.spec(array_env.split(":", 1)[1])
    changed = spec.kwargs["gains"].copy()
    changed[500] = 100.0
    monkeypatch.setitem(spec.kwargs, "gains", changed)
    assert _key(**fields) != before.cache_key
    monkeypatch.setitem(spec.kwargs, "gains", numpy.ones(2000, dtype=numpy.float32))
    assert _key(**fields) != before.cache_key
    monkeypatch.setitem(spec.kwargs, "gains", numpy.ones(2000))  # equal again: a hit
    assert _key(**fields) == before.cache_key
    gains = before.cache_ingredients["env"]["spec_kwargs"]["gains"]
    assert gains["shape"] == [2000] and "sha256" in gains


@pytest.mark.parametrize("field, value", [
    ("reward_threshold", 1.0), ("nondeterministic", True), ("order_enforce", False),
    ("disable_env_checker", False), ("vector_entry_point", "elsewhere:VectorCartPole"),
])
def test_spec_fields_that_change_no_return_are_hits(field, value, base, monkeypatch):
    key = _key(**base)
    monkeypatch.setattr(gymnasium.spec("CartPole-v1"), field, value)
    assert _key(**base) == key


# --- every README row, and the settings that must not matter --------------------------------

def _readme_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## The episode cache", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[1].strip() for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| ingredient")]


#: README row (start of its first cell) -> planted change of the request or the process.
PLANTED: dict[str, list[str]] = {
    "policy sha256": ["weights"],
    "factory": ["factory_source", "factory_ref", "factory_sibling_module",
                "factory_import_inside_function", "callable_helper_module"],
    "env id": ["env_id", "env_kwargs", "env_max_episode_steps"],
    "registered spec": ["env_spec_kwargs", "env_spec_wrappers", "env_spec_wrapper_kwargs"],
    "a file or folder": ["env_kwarg_file", "env_kwarg_folder", "env_spec_kwarg_file"],
    "code version of the package providing the env": ["env_source", "env_registering_module",
                                                      "env_wrapper_source"],
    "base seed": ["seed", "max_steps", "deterministic"],
    "inference device": ["device", "auto_on_a_gpu_machine", "forward_blocks"],
    "what the env sees of the environment": ["isolation_class", "granted_variable",
                                             "granted_value", "read_grant", "read_grant_contents",
                                             "write_grant", "bwrap_jail", "keyed_variable", "keyed_locale"],
    "evalfleet": ["evalfleet_version", "gymnasium_version", "numpy_version", "torch_version",
                  "python_version", "python_implementation"],
    "episode table schema": ["schema"],
}


def test_every_readme_row_has_a_planted_change():
    rows = _readme_rows()
    assert rows, "the README's cache table was not found"
    for row in rows:
        assert any(row.startswith(k) for k in PLANTED), f"README row {row!r} has no planted change"


@pytest.mark.parametrize("change", [c for cs in PLANTED.values() for c in cs])
def test_each_planted_change_is_a_miss(change, base, tmp_path, monkeypatch, request):
    key = _key(**base)
    fields = dict(base)
    if change == "weights":
        net = torch.jit.load(base["policy"])
        with torch.no_grad():
            next(net.parameters()).add_(0.01)
        torch.jit.save(net, str(tmp_path / "other.pt"))
        fields["policy"] = str(tmp_path / "other.pt")
    elif change in ("factory_source", "factory_ref"):
        name = _unique("keyfactory")
        (tmp_path / f"{name}.py").write_text(
            textwrap.dedent(NETS) + "\n\ndef build_too():\n    return build()\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        torch.save(importlib.import_module(name).build().state_dict(), tmp_path / "sd.pt")
        fields.update(policy=str(tmp_path / "sd.pt"), policy_factory=f"{name}:build")
        key = _key(**fields)
        if change == "factory_ref":
            fields["policy_factory"] = f"{name}:build_too"
        else:
            (tmp_path / f"{name}.py").write_text((tmp_path / f"{name}.py").read_text() + "# edit\n")
    elif change in ("factory_sibling_module", "factory_import_inside_function"):
        where = "inside" if change == "factory_import_inside_function" else "top"
        sibling, net = _sibling_factory(tmp_path, request, where)
        fields.update(sibling)
        key = _key(**fields)
        net.write_text(net.read_text().replace("nn.ReLU", "nn.Tanh"))
    elif change == "callable_helper_module":
        fields["policy"], helper = _callable_with_helper(tmp_path, request)
        key = _key(**fields)
        helper.write_text("GAIN = -1.0\n")
    elif change == "env_id":
        fields["env"] = "CartPole-v0"
    elif change == "env_kwargs":
        fields["env_kwargs"] = {"sutton_barto_reward": True}
    elif change == "env_max_episode_steps":
        spec = gymnasium.spec("CartPole-v1")
        monkeypatch.setattr(spec, "max_episode_steps", 400)
    elif change == "env_source":
        monkeypatch.setattr("evalfleet.envspec.code_version", lambda m: ("gymnasium", "1.4.0+edited"))
    elif change == "env_spec_kwargs":
        monkeypatch.setitem(gymnasium.spec("CartPole-v1").kwargs, "sutton_barto_reward", True)
    elif change in ("env_spec_wrappers", "env_spec_wrapper_kwargs", "env_wrapper_source"):
        spec = gymnasium.spec("CartPole-v1")
        clip = WrapperSpec("ClipReward", "gymnasium.wrappers:ClipReward",
                           {"min_reward": 0.0, "max_reward": 0.5})
        monkeypatch.setattr(spec, "additional_wrappers", (clip,))
        if change != "env_spec_wrappers":
            key = _key(**fields)
        if change == "env_spec_wrapper_kwargs":
            wider = WrapperSpec(clip.name, clip.entry_point, {**clip.kwargs, "max_reward": 0.7})
            monkeypatch.setattr(spec, "additional_wrappers", (wider,))
        elif change == "env_wrapper_source":
            wrappers = _unique("keywrappers")
            (tmp_path / f"{wrappers}.py").write_text("from gymnasium.wrappers import ClipReward  # noqa\n")
            monkeypatch.syspath_prepend(str(tmp_path))
            monkeypatch.setattr(spec, "additional_wrappers",
                                (WrapperSpec(clip.name, f"{wrappers}:ClipReward", clip.kwargs),))
            key = _key(**fields)
            (tmp_path / f"{wrappers}.py").write_text((tmp_path / f"{wrappers}.py").read_text() + "# edit\n")
    elif change in ("env_kwarg_file", "env_kwarg_folder", "env_spec_kwarg_file"):
        fields["env"], default, folder = request.getfixturevalue("scenario_env")
        edited = {"env_kwarg_file": tmp_path / "mine.json", "env_kwarg_folder": folder / "level.json",
                  "env_spec_kwarg_file": default}[change]
        if change == "env_kwarg_file":
            edited.write_text('{"gravity": 9.8}')
            fields["env_kwargs"] = {"scenario": str(edited)}
        elif change == "env_kwarg_folder":
            fields["env_kwargs"] = {"scenario": str(folder) + "/"}
        else:  # a registered default outside the module's folder: granted by name (Landlock)
            fields["sandbox_read"] = [str(default.parent)]
        key = _key(**fields)
        edited.write_text('{"gravity": 3.7}')
    elif change == "env_registering_module":
        name, env_id, source = request.getfixturevalue("registering_module")
        fields["env"] = f"{name}:{env_id}"
        key = _key(**fields)
        source.write_text(source.read_text() + "# edit\n")
    elif change == "forward_blocks":  # c272878 meant it in the key; key_ingredients dropped it
        monkeypatch.setattr(evalfleet.pipeline, "PAD_ROWS", 16)
    elif change == "isolation_class":  # an in-process result was served for a sandboxed request
        fields["isolation"] = "process"
    elif change in ("granted_variable", "granted_value"):
        # A run with HUNT_GAIN=3 granted was served for the request without it (mean 600, truth 200).
        fields["isolation"] = "process"
        monkeypatch.setenv("EVALFLEET_TEST_GAIN", "3")
        if change == "granted_variable":
            key = _key(**fields)
            fields["sandbox_env_allow"] = ["EVALFLEET_TEST_GAIN"]
        else:
            fields["sandbox_env_allow"] = ["EVALFLEET_TEST_GAIN"]
            key = _key(**fields)
            monkeypatch.setenv("EVALFLEET_TEST_GAIN", "4")
    elif change == "read_grant_contents":
        # An env's data folder granted by --sandbox-read, edited between two requests: the
        # second was served the episodes of the old data (only the grant's path was keyed).
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "gain.txt").write_text("1.0")
        fields.update(isolation="process", sandbox_read=[str(tmp_path / "data")])
        key = _key(**fields)
        (tmp_path / "data" / "gain.txt").write_text("3.0")
    elif change in ("read_grant", "write_grant"):
        # A run without --sandbox-read of an env's optional calibration folder (gain 1.0) was
        # served for the request with it (truth: gain 3.0, mean 30.19 against 10.06).
        fields["isolation"] = "process"
        key = _key(**fields)
        fields["sandbox_read" if change == "read_grant" else "sandbox_write"] = [str(tmp_path)]
    elif change == "bwrap_jail":  # a jail shows a single-file module alone, not its neighbours
        fields["isolation"] = "process"
        key = _key(**fields)
        fields["isolation"] = "bwrap"
        monkeypatch.setattr(evalfleet.pipeline, "resolve_isolation", lambda requested, _: requested)
    elif change in ("keyed_variable", "keyed_locale"):  # allow-listed, and they change episodes
        name = "MUJOCO_GL" if change == "keyed_variable" else "LC_ALL"
        fields["isolation"] = "process"
        monkeypatch.setenv(name, "egl" if change == "keyed_variable" else "C.UTF-8")
        key = _key(**fields)
        monkeypatch.setenv(name, "osmesa" if change == "keyed_variable" else "de_DE.UTF-8")
    elif change == "seed":
        fields["seed"] = 1
    elif change == "max_steps":
        fields["max_steps"] = 200
    elif change == "deterministic":
        fields["deterministic"] = False
    elif change == "device":
        # The key is fixed at stage 1, before any GPU is needed; stage 1 checks the (local)
        # cluster has one, so a GPU-less machine is made to look like a GPU machine. On a GPU
        # machine the base ('auto') is CUDA already: the planted change is the CPU there.
        if torch.cuda.is_available():
            fields["device"] = "cpu"
        else:
            fields["device"] = "cuda"
            monkeypatch.setattr(evalfleet.cluster, "gpu_count", lambda: 1)
    elif change == "auto_on_a_gpu_machine":
        fields["device"] = "auto"
        flipped = not torch.cuda.is_available()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: flipped)
        monkeypatch.setattr(evalfleet.cluster, "gpu_count", lambda: int(flipped))
    elif change in ("python_version", "python_implementation"):
        # Another interpreter sharing the cache: 3.12's compensated float sum() gives env returns
        # of its own (sum([0.1] * 10): 1.0 against 3.11's 0.9999999999999999).
        import platform

        monkeypatch.setattr(platform, change, lambda: "3.12.0" if change == "python_version" else "PyPy")
    elif change.endswith("_version"):
        module = {"evalfleet": evalfleet, "gymnasium": gymnasium, "numpy": numpy, "torch": torch}[
            change.removesuffix("_version")]
        monkeypatch.setattr(module, "__version__", "99.0.0")
    elif change == "schema":
        monkeypatch.setattr(cache_mod, "SCHEMA_VERSION", "999")
    else:  # pragma: no cover - a name in PLANTED without a branch
        raise AssertionError(change)
    assert _key(**fields) != key, change


@pytest.mark.parametrize("change", [
    {"output": "elsewhere"},
    {"workers": 1},
    {"workers": 7},
    {"concurrency": 3},
    {"isolation": "inprocess"},  # what auto resolves CartPole to
    {"request_id": "other"},
    {"training_run_id": "t", "step": 9},
    {"episodes": 500},
    {"cache_dir": "cache-elsewhere"},
    {"record_trajectories": 2},
])
def test_execution_settings_are_hits(change, base, tmp_path):
    change = {k: tmp_path / v if k in ("output", "cache_dir") else v for k, v in change.items()}
    assert _key(**base) == _key(**{**base, **change})


@pytest.mark.parametrize("name, value", [
    ("PYTHONHASHSEED", "12345"),  # pinned in every sandbox (a tox run's random one changed episodes)
    ("NUMEXPR_NUM_THREADS", "8"),  # pinned to 1
    ("PATH", "/elsewhere:/usr/bin:/bin"),  # where tools are found: the code is keyed by version
])
def test_allowed_variables_that_change_no_episode_are_hits(name, value, base, monkeypatch):
    fields = {**base, "isolation": "process"}
    key = _key(**fields)
    monkeypatch.setenv(name, value)
    assert _key(**fields) == key


def test_device_auto_on_a_cpu_machine_is_cpu(base, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _key(**{**base, "device": "auto"}) == _key(**{**base, "device": "cpu"})


def test_every_ingredient_is_in_the_key(base):
    """Whatever leaf of the ingredients changes, the key changes (nothing is dropped on the way)."""
    ingredients = _received(**base).cache_ingredients
    key = cache_key(ingredients)

    def leaves(node: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        if isinstance(node, dict) and node:
            return [p for k, v in node.items() for p in leaves(v, (*path, k))]
        return [path]

    for path in leaves(ingredients):
        copy = {**ingredients}
        target = copy
        for part in path[:-1]:
            target[part] = dict(target[part])
            target = target[part]
        target[path[-1]] = ["changed", target[path[-1]]]
        assert cache_key(copy) != key, path
    assert re.fullmatch(r"[0-9a-f]{64}", key)


def test_the_reports_manifest_states_the_harness_code_the_key_names(base):
    """Two development checkouts of evalfleet 0.1.0 computed different numbers under different
    keys, and both reports' manifests said ``evalfleet: 0.1.0``: the key's source digest is stated."""
    from evalfleet.report import aggregate
    from tests.core.episodes import run_in_process

    received = _received(**base)
    keyed = received.cache_ingredients["versions"]
    assert keyed["evalfleet"].startswith(f"{evalfleet.__version__}+{SOURCE_PREFIX}")  # -e install
    table = run_in_process("CartPole-v1", base["policy"], 2, cap=20, slots=2)
    report = aggregate(EvalRequest.build(**{**base, "episodes": 2, "max_steps": 20}), table,
                       env_spec=received.env_spec, env_spec_hash="spec",
                       policy={"sha256": received.artifact.sha256}, isolation="inprocess",
                       timings={"run": 1.0}, cache={"status": "miss"}, run_seconds=1.0)
    stated = report.model_dump(mode="json")["manifest"]["versions"]
    assert stated["evalfleet"] == keyed["evalfleet"]
    assert {k: stated[k] for k in keyed} == keyed


# --- the key is fixed before the policy is loaded ---------------------------------------------

def test_the_key_is_fixed_before_the_policy_is_loaded(base, state_dict_policy, monkeypatch):
    """``receive_unloaded``'s key (what a full cache hit is judged by: no load, no torch import)
    is ``receive()``'s, and only its check loads the policy, for each format."""
    import evalfleet.pipeline as pipeline

    name, weights, _ = state_dict_policy
    loads: list[str] = []
    real = pipeline.check_policy
    monkeypatch.setattr(pipeline, "check_policy", lambda a, *rest: (loads.append(a.format),
                                                                     real(a, *rest))[1])
    for fields in (base, {**base, "policy": weights, "policy_factory": f"{name}:build"},
                   {**base, "policy": "tests.flows.user_envs:toward_goal",
                    "env": "tests.flows.user_envs:Warehouse-v0"}):
        loads.clear()
        unloaded, check = pipeline.receive_unloaded(EvalRequest.build(**fields))
        assert loads == [] and not unloaded.loaded
        checked = check()
        assert len(loads) == 1 and checked.loaded
        assert unloaded.cache_key == checked.cache_key == _key(**fields)
        assert unloaded.artifact.output_kind == checked.artifact.output_kind


def test_torch_version_without_importing_torch_is_torch_version():
    import subprocess

    code = ("import sys; from evalfleet.report import torch_version; v = torch_version(); "
            "print('torch' in sys.modules, v)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, check=True).stdout.split()
    assert out == ["False", torch.__version__]


def test_a_cuda_wheel_is_keyed_alike_imported_or_not(tmp_path):
    """PyPI's CUDA wheels of torch say '2.11.0' in their metadata and '2.11.0+cu130' in
    ``torch.__version__``: the key's torch version must not depend on which one a process read
    (seen on a GPU machine: the CLI, torch not yet imported, and a process that had imported it
    keyed the same request apart)."""
    import subprocess

    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "version.py").write_text(
        "from typing import Optional\n__version__ = '9.1.0+cu999'\ncuda: Optional[str] = '99.9'\n")
    (fake / "torch" / "__init__.py").write_text("from torch.version import __version__\n")
    (fake / "torch-9.1.0.dist-info").mkdir()
    (fake / "torch-9.1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 9.1.0\n")
    code = ("import sys; from evalfleet.report import torch_version; before = torch_version(); "
            "imported = 'torch' in sys.modules; import torch; "
            "print(before, imported, torch_version(), torch.__file__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(fake), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env, check=True).stdout.split()
    assert out[3].startswith(str(fake))  # the planted torch is the one found
    assert out[:3] == ["9.1.0+cu999", "False", "9.1.0+cu999"]


def test_no_gpu_driver_means_torch_sees_no_cuda():
    """Stage 1 says 'no GPU' from the device nodes alone only where torch agrees."""
    if evalfleet.cluster.no_gpu_driver():
        assert not torch.cuda.is_available() and evalfleet.cluster.gpu_count() == 0
    else:  # a GPU machine: torch is asked
        assert evalfleet.cluster.gpu_count() == (torch.cuda.device_count()
                                                if torch.cuda.is_available() else 0)


SIBLING_ENV = {
    "{mod}.py": """
        import gymnasium as gym
        from gymnasium.envs.classic_control.cartpole import CartPoleEnv

        from {phys} import FORCE


        class SiblingCartPole(CartPoleEnv):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.force_mag = FORCE


        gym.register("{env_id}", entry_point="{mod}:SiblingCartPole", max_episode_steps=200)
    """,
    "{phys}.py": """
        FORCE = 10.0
    """,
}


def test_code_the_envs_module_imports_from_another_module_is_in_the_key(base, tmp_path,
                                                                        monkeypatch):
    """An env whose dynamics live in a sibling top-level module (``from physics import FORCE``):
    editing that module is a miss, as for a policy factory's imports."""
    mod, phys = _unique("keysibenv"), _unique("keyphys")
    env_id = f"KeySib{uuid.uuid4().hex[:6]}-v0"
    _write(tmp_path / "sib", {name.format(mod=mod, phys=phys): text.format(
        mod=mod, phys=phys, env_id=env_id) for name, text in SIBLING_ENV.items()})
    monkeypatch.syspath_prepend(str(tmp_path / "sib"))
    try:
        fields = {**base, "env": f"{mod}:{env_id}"}
        before = _received(**fields)
        assert before.cache_ingredients["env"]["code"][phys].startswith(SOURCE_PREFIX)
        physics = tmp_path / "sib" / f"{phys}.py"
        physics.write_text(physics.read_text().replace("10.0", "12.0"))
        assert _key(**fields) != before.cache_key
    finally:
        _drop_modules(mod)
        _drop_modules(phys)
        gymnasium.registry.pop(env_id, None)


def _wheel(site: Path, name: str, version: str, files: dict[str, str], *,
           installer: str = "pip", url: str | None = None) -> None:
    """``name`` as a wheel installs it into ``site``: its files, a dist-info naming an archive, and
    a ``RECORD`` as pip writes it (every file's sha256 and size, a compiled cache's too, a script)."""
    import base64
    import json
    import shutil

    def row(path: Path) -> str:
        blob = path.read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
        return f"{path.relative_to(site).as_posix()},sha256={digest},{len(blob)}\n"

    for old in site.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    shutil.rmtree(site / name, ignore_errors=True)
    (site / name / "__pycache__").mkdir(parents=True)
    for file, text in files.items():
        (site / name / file).write_text(textwrap.dedent(text))
        # A compiled cache as an install writes it: its bytes carry the time it was written.
        (site / name / "__pycache__" / f"{Path(file).stem}.cpython-311.pyc").write_bytes(
            uuid.uuid4().bytes)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "INSTALLER").write_text(f"{installer}\n")
    (info / "REQUESTED").write_text("")
    (info / "direct_url.json").write_text(json.dumps(
        {"url": url or f"file:///wheels/{name}-{version}-py3-none-any.whl", "archive_info": {}}))
    installed = sorted(p for p in [*(site / name).rglob("*"), *info.iterdir()] if p.is_file())
    script = f"../../../bin/{name},sha256={uuid.uuid4().hex},120\n"  # its first line: this python
    (info / "RECORD").write_text(script + "".join(row(p) for p in installed)
                                 + f"{info.name}/RECORD,,\n")


#: An installed env package whose dynamics come from another package (``physics``).
SIM_ENV = """
    import gymnasium as gym
    import numpy as np
    from {physics} import GRAVITY

    class Fall(gym.Env):
        observation_space = gym.spaces.Box(-1e9, 1e9, (1,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.h = 100.0
            return np.array([self.h], np.float32), {{}}

        def step(self, action):
            self.h -= GRAVITY * 0.1
            return np.array([self.h], np.float32), 1.0, self.h <= 0, False, {{}}

    gym.register("{name}/Fall-v0", entry_point="{name}:Fall", max_episode_steps=1000)
"""


def test_a_simulator_an_installed_env_package_imports_is_keyed_by_its_version(tmp_path):
    """An env from an installed wheel whose dynamics come from another wheel (gymnasium's MuJoCo
    envs and ``mujoco``): upgrading that one changed every return under the same key before."""
    import subprocess

    site = tmp_path / "site"
    _wheel(site, "simenv", "1.0", {"__init__.py": SIM_ENV.format(physics="physlib", name="simenv")})
    probe = ("import json; from evalfleet.envspec import resolve_env; "
             "fp = resolve_env('simenv:simenv/Fall-v0', {}, None).fingerprint; "
             "print(json.dumps([fp.package, fp.package_version, fp.code, fp.spec_hash]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    seen = []
    for version, gravity in (("1.0", 9.8), ("2.0", 24.0)):
        _wheel(site, "physlib", version, {"__init__.py": f"GRAVITY = {gravity}\n"})
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path, env=env, check=True).stdout
        seen.append(__import__("json").loads(out.strip().splitlines()[-1]))
    # A wheel: by its version (and its installed-file record, the same: simenv is not rebuilt).
    assert [s[:2] for s in seen] == [["simenv", seen[0][1]]] * 2
    assert seen[0][1].startswith(f"1.0{RECORD_MARK}")
    assert [s[2].get("physlib", "").split("+")[0] for s in seen] == ["1.0", "2.0"]
    assert seen[0][3] != seen[1][3]


def test_what_a_callables_installed_library_imports_is_keyed_by_its_version(tmp_path):
    """A callable policy calling ``polwrap.act`` (a wheel) that returns ``polcore.ACTION`` (another
    wheel): upgrading polcore 1.0 -> 2.0 changed every action under the same key (mean 5.0 served,
    truth 15.0). The policy's code was keyed as ``{module, numpy, polwrap}``; an env's imports were
    followed into the wheels they reach, a callable's and a factory's were not."""
    import json
    import subprocess

    site, mods = tmp_path / "site", tmp_path / "mods"
    _wheel(site, "polwrap", "1.0", {"__init__.py": """
        import numpy as np
        import polcore

        def act(obs):
            return np.full(len(obs), polcore.ACTION, dtype=np.int64)
    """})
    policy = _unique("keypolw")
    _write(mods, {f"{policy}.py": """
        import polwrap

        def act(obs):
            return polwrap.act(obs)
    """})
    probe = ("import json, sys; from evalfleet.policy import code_versions; "
             "print(json.dumps(dict(code_versions(sys.argv[1], 'callable policy'))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(mods), str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    seen = []
    for version, action in (("1.0", 0), ("2.0", 1)):
        _wheel(site, "polcore", version, {"__init__.py": f"ACTION = {action}\n"})
        out = subprocess.run([sys.executable, "-c", probe, f"{policy}:act"], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path, env=env, check=True).stdout
        seen.append(json.loads(out.strip().splitlines()[-1]))
    assert seen[0] != seen[1]  # another policy code: another key
    assert [s.get("polcore", "").split("+")[0] for s in seen] == ["1.0", "2.0"]
    assert seen[0]["polwrap"] == seen[1]["polwrap"] and seen[0][policy].startswith(SOURCE_PREFIX)




def test_a_wheel_rebuilt_under_its_version_is_other_code(tmp_path):
    """A wheel rebuilt (or re-fetched: ``git+...@<new commit>``, an index overwritten) under the
    same version was keyed by that version alone: its old episodes were served for the new build
    (mean 5.0, truth 15.0), and the packages the new build imports were the old build's stored
    ``foreign_imports`` answer. Its installed-file record tells the builds apart; a reinstall of
    the same build (another installer, archive path, compiled caches) is the same code."""
    import json
    import subprocess

    site = tmp_path / "site"
    for physics, gravity in (("physlib", 9.8), ("physlib2", 24.0)):
        _wheel(site, physics, "1.0", {"__init__.py": f"GRAVITY = {gravity}\n"})
    probe = ("import json; from evalfleet.envspec import resolve_env; "
             "fp = resolve_env('rebuilt:rebuilt/Fall-v0', {}, None).fingerprint; "
             "print(json.dumps([fp.package_version, fp.code, fp.spec_hash]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    seen = []
    for physics, installer, url in (("physlib", "pip", None), ("physlib", "uv", "https://idx/r.whl"),
                                    ("physlib2", "pip", None)):
        _wheel(site, "rebuilt", "1.0", {"__init__.py": SIM_ENV.format(physics=physics, name="rebuilt")},
               installer=installer, url=url)
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path, env=env, check=True).stdout
        seen.append(json.loads(out.strip().splitlines()[-1]))
    first, reinstalled, rebuilt = seen
    assert reinstalled == first  # the same build installed again: the same key, no miss
    assert rebuilt[2] != first[2]  # the rebuilt wheel: another env spec and cache key
    assert rebuilt[0] != first[0]  # other code under version 1.0
    assert first[0].startswith(f"1.0{RECORD_MARK}") and rebuilt[0].startswith(f"1.0{RECORD_MARK}")
    assert ("physlib" in first[1], "physlib2" in first[1]) == (True, False)
    assert ("physlib" in rebuilt[1], "physlib2" in rebuilt[1]) == (False, True)  # what it imports now


def test_a_step_cap_spelled_out_as_the_registered_one_is_the_same_key_and_protocol(base):
    """``--max-steps 500`` on CartPole-v1 is its registered cap: the same episodes. It was another
    key (recomputed) and another history protocol, so a regression at step 4 was judged against
    step 2, evaluated the other way, and passed the gate (step 2 had exited 6 as protocol_changed)."""
    from evalfleet.history import report_protocol
    from evalfleet.report import aggregate
    from tests.core.episodes import run_in_process

    implicit, explicit = _received(**base), _received(**base, max_steps=500)
    assert implicit.cache_key == explicit.cache_key
    assert _received(**base, max_steps=499).cache_key != implicit.cache_key
    table = run_in_process("CartPole-v1", base["policy"], 4)
    protocols = {report_protocol(aggregate(
        EvalRequest.build(**base, max_steps=cap), table, env_spec=received.env_spec,
        env_spec_hash=received.env_spec_hash, policy={"sha256": "a" * 64}, isolation="inprocess",
        timings={}, cache={}, run_seconds=1.0).model_dump(mode="json"))
        for cap, received in ((None, implicit), (500, explicit))}
    assert len(protocols) == 1


def test_a_granted_variable_is_keyed_by_its_values_digest_not_its_value(base, monkeypatch):
    monkeypatch.setenv("EVALFLEET_TEST_TOKEN", "s3cret-value")
    fields = {**base, "isolation": "process", "sandbox_env_allow": ["EVALFLEET_TEST_TOKEN"]}
    ingredients = _received(**fields).cache_ingredients
    assert ingredients["environment"]["class"] == "allow-list"
    assert ingredients["environment"]["granted"]["EVALFLEET_TEST_TOKEN"] == hashlib.sha256(
        b"s3cret-value").hexdigest()[:16]
    assert "s3cret-value" not in str(ingredients)
    assert _received(**base).cache_ingredients["environment"] == {"class": "inherited", "granted": {}}


def test_a_relative_path_in_the_kwargs_is_refused_for_sandboxes_before_any_spawns(
        scenario_env, base, tmp_path, monkeypatch):
    """A sandbox runs the env in a folder of its own: ``calib/gain.txt`` was keyed by the file
    here, and the env found nothing there and took its default (mean 10.06 against 30.19), exit 0."""
    env, default, _ = scenario_env
    monkeypatch.chdir(tmp_path)
    relative = str(default.relative_to(tmp_path))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a sandbox was started for a request stage 1 refuses")

    with monkeypatch.context() as patched:
        patched.setattr("evalfleet.sandbox.process.ProcessSlots.__init__", refuse)
        for isolation in ("auto", "process", "bwrap"):
            with pytest.raises(RequestError, match=(
                    rf"name the file or folder '{relative}' by a relative path, but "
                    rf"'{'process' if isolation == 'auto' else isolation}' sandboxes .* Pass an "
                    rf"absolute path such as '{default}'")):
                _received(**base, env=env, env_kwargs={"scenario": relative}, isolation=isolation)
    # In-process the env opens it from the worker's folder, where the key read it.
    assert _received(**base, env=env, env_kwargs={"scenario": relative},
                     isolation="inprocess").isolation == "inprocess"


def test_inputs_changed_during_a_run_name_what_changed(base, tmp_path, monkeypatch):
    """What ``inputs_changed`` reads again (``tests/flows/test_inputs_during_run.py`` runs it)."""
    from evalfleet.pipeline import inputs_changed

    mod = _unique("solo_env")
    env_id = f"Solo{uuid.uuid4().hex[:6]}-v0"
    source = textwrap.dedent(ENV_PACKAGE["env.py"]).replace("from {pkg}.dynamics import DRIFT",
                                                          "DRIFT = 0.25")
    source += f'\n\ngym.register("{env_id}", entry_point="{mod}:CorridorEnv", max_episode_steps=50)\n'
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / f"{mod}.py").write_text(source.replace("{{}}", "{}"))
    (tmp_path / "solo" / "levels.txt").write_text("width 5\n")  # data beside a single-file module
    monkeypatch.syspath_prepend(str(tmp_path / "solo"))
    try:
        request = EvalRequest.build(**{**base, "env": f"{mod}:{env_id}"})
        received = receive(request)
        assert inputs_changed(request, received) == []
        (tmp_path / "solo" / "levels.txt").write_text("width 9\n")  # e.g. an env's own log
        [data] = inputs_changed(request, received)
        assert data.startswith(f"the data files beside module {mod!r} (its code is the same")
        (tmp_path / "solo" / f"{mod}.py").write_text(source.replace("0.25", "0.5").replace("{{}}", "{}"))
        both = inputs_changed(request, received, done=True)  # what was seen before stays named
        assert both[0] == data and both[1].startswith(f"the code of {mod!r} (source-sha256:")
        assert inputs_changed(request, received, done=True)[0].startswith("the code of")  # forgot
    finally:
        _drop_modules(mod)


#: The ways of giving CartPole-v1 one step cap: --max-steps, the env kwarg gym.make takes, both
#: (agreeing), and, at its registered cap 500, none at all (or the kwarg as null).
SPELLINGS = {
    200: [{"max_steps": 200}, {"env_kwargs": {"max_episode_steps": 200}},
          {"max_steps": 200, "env_kwargs": {"max_episode_steps": 200}}],
    500: [{}, {"max_steps": 500}, {"env_kwargs": {"max_episode_steps": 500}},
          {"max_steps": 500, "env_kwargs": {"max_episode_steps": 500}},
          {"env_kwargs": {"max_episode_steps": None}}],
}


@pytest.mark.parametrize("cap", sorted(SPELLINGS))
def test_every_spelling_of_one_step_cap_is_one_key_and_one_protocol(base, cap):
    """``{"max_episode_steps": N}`` in --env-kwargs is the cap gym.make applies, as --max-steps N:
    the same episodes (returns and lengths). It was keyed apart (a miss) and was another history
    protocol: the next checkpoint evaluated the other way was ``protocol_changed``, gate exit 6."""
    from evalfleet.history import report_protocol
    from evalfleet.report import aggregate
    from tests.core.episodes import run_in_process

    keys, protocols, episodes = set(), set(), set()
    for fields in SPELLINGS[cap]:
        received = _received(**base, **fields)
        keys.add(received.cache_key)
        table = run_in_process("CartPole-v1", base["policy"], 6, kwargs=fields.get("env_kwargs"),
                               cap=fields.get("max_steps"))
        episodes.add((tuple(table.column("return").to_pylist()), tuple(table.column("length").to_pylist())))
        protocols.add(report_protocol(aggregate(
            EvalRequest.build(**base, **fields), table, env_spec=received.env_spec,
            env_spec_hash=received.env_spec_hash, policy={"sha256": "a" * 64}, isolation="inprocess",
            timings={}, cache={}, run_seconds=1.0).model_dump(mode="json")))
    [(returns, lengths)] = episodes  # the same episodes, whatever the spelling
    assert max(lengths) == cap  # the cap is reached: it shapes these episodes
    assert len(keys) == 1 and len(protocols) == 1
    other = 200 if cap == 500 else 500
    assert _key(**base, env_kwargs={"max_episode_steps": other}) not in keys  # a cap still counts


CAP_READING_MODULE = """
    import gymnasium as gym
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv


    class CapReadingCartPole(CartPoleEnv):
        \"\"\"CartPole that scales its reward by a cap of its own, if its constructor gets one.\"\"\"

        def __init__(self, max_episode_steps=None, render_mode=None):
            super().__init__(render_mode=render_mode)
            self.scale = 1.0 if max_episode_steps is None else 100.0 / max_episode_steps

        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            return obs, reward * self.scale, terminated, truncated, info


    gym.register("{env_id}", entry_point="{name}:CapReadingCartPole", max_episode_steps=500)
"""


def test_a_step_cap_kwarg_never_reaches_an_env_that_reads_one_so_it_is_the_same_env(
        base, tmp_path, monkeypatch):
    """The kwarg is dropped from the key only because gym.make takes it as its own parameter:
    an env whose constructor reads ``max_episode_steps`` gets none either way (the same returns).
    A ``make`` that passed it on to the env would keep it in the key."""
    import evalfleet.envspec as envspec
    from tests.core.episodes import run_in_process

    name, env_id = _unique("capreading"), f"CapReading{uuid.uuid4().hex[:6]}-v0"
    _write(tmp_path / "src", {f"{name}.py": CAP_READING_MODULE.format(env_id=env_id, name=name)})
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    env = f"{name}:{env_id}"
    try:
        by_kwarg = run_in_process(env, base["policy"], 4, kwargs={"max_episode_steps": 50})
        by_cap = run_in_process(env, base["policy"], 4, cap=50)
        assert by_kwarg.column("return").to_pylist() == by_cap.column("return").to_pylist()
        assert set(by_cap.column("length").to_pylist()) == {50}
        assert _key(**base, env=env, isolation="inprocess", env_kwargs={"max_episode_steps": 50}) == _key(
            **base, env=env, isolation="inprocess", max_steps=50)

        def passes_it_on(id: str, **kwargs: Any) -> Any:  # noqa: A002 - gym.make's own name
            raise AssertionError("not called")

        monkeypatch.setattr(envspec.gym, "make", passes_it_on)
        assert envspec.keyed_kwargs({"max_episode_steps": 50, "x": 1}) == {"max_episode_steps": 50, "x": 1}
    finally:
        _drop_modules(name)
        gymnasium.registry.pop(env_id, None)
