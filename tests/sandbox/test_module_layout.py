"""The sandbox package's layout: one idea per module, no import cycle, old import paths kept."""

from __future__ import annotations

import ast
from pathlib import Path

import evalfleet.sandbox

PACKAGE = Path(evalfleet.sandbox.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Module -> sandbox modules it imports (at any depth: function-level imports count too)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        name = path.stem
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "evalfleet.sandbox":
                    deps.update(alias.name for alias in node.names)
                elif node.module.startswith("evalfleet.sandbox."):
                    deps.add(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.Import):
                deps.update(a.name.rsplit(".", 1)[1] for a in node.names
                            if a.name.startswith("evalfleet.sandbox."))
        graph[name] = deps - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path, node, dep]
            if dep not in state and (found := visit(dep, [*path, node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_no_import_cycle_between_sandbox_modules():
    graph = _imports()
    assert "process" not in graph["base"] or "base" not in graph["process"]
    cycle = _cycle({k: v for k, v in graph.items() if k != "__init__"})
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def _touches_cartpole_internals(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "gymnasium.envs.classic_control.cartpole":
            return True
        if isinstance(node, ast.Attribute) and node.attr in ("prev_done", "_sutton_barto_reward"):
            return True
    return False


def test_only_native_cartpole_touches_the_vector_env_internals():
    users = sorted(p.stem for p in PACKAGE.glob("*.py") if _touches_cartpole_internals(p))
    assert users == ["native_cartpole"]


def test_old_import_paths_still_work():
    from evalfleet.runner import BatchEnvSlots as runner_batch
    from evalfleet.sandbox import forkclient, slots
    from evalfleet.sandbox.base import EnvSlots, SlotOutcome, error_text, scalar_info
    from evalfleet.sandbox.process import (
        PIDS_CGROUP_ROOT,
        ForkServer,
        ForkServerError,
        fork_server,
        shutdown_fork_servers,
    )

    assert (EnvSlots, SlotOutcome, error_text, scalar_info, runner_batch) == (
        slots.EnvSlots, slots.SlotOutcome, slots.error_text, slots.scalar_info,
        slots.BatchEnvSlots)
    assert (PIDS_CGROUP_ROOT, ForkServer, ForkServerError, fork_server, shutdown_fork_servers) == (
        forkclient.PIDS_CGROUP_ROOT, forkclient.ForkServer, forkclient.ForkServerError,
        forkclient.fork_server, forkclient.shutdown_fork_servers)
