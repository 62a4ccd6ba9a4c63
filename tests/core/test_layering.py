"""The core (``evalfleet/``) depends on no layer above it and never imports Prefect.

Checked on the source, so a lazy import inside a function, or a module named to
``importlib.import_module``, counts as much as an import at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "evalfleet"
#: Top-level packages the core must not name: the layers above it, and Prefect.
FORBIDDEN = {"flows", "tasks", "deployments", "prefect", "prefect_dask"}


def _named_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module a file imports or hands to ``importlib.import_module`` / ``__import__``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def test_the_core_names_no_upper_layer_and_no_prefect() -> None:
    offenders = [
        f"{path.relative_to(CORE.parent)}:{line} imports {module!r}"
        for path in sorted(CORE.rglob("*.py"))
        for line, module in _named_modules(ast.parse(path.read_text(), str(path)))
        if module.split(".")[0] in FORBIDDEN
    ]
    assert offenders == []


def test_the_checker_sees_lazy_imports() -> None:
    tree = ast.parse("def f():\n    import prefect\n    importlib.import_module('flows.eval')\n")
    assert _named_modules(tree) == [(2, "prefect"), (3, "flows.eval")]
