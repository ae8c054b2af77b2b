"""The layering the code keeps: the front ends (gRPC and HTTP) call the engine's facade only, and the
exceptions that cross layers come from one module."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rollout_server"
# What the engine keeps behind its facade: the gRPC layer imports none of it, and reaches through the
# engine to none of it.
ENGINE_INTERNALS = ("scheduler", "policy", "runner", "sampler", "stream")
CROSS_LAYER_ERRORS = {
    "InvalidRequest",
    "Overloaded",
    "ShuttingDown",
    "RankFailure",
    "NonFiniteStep",
    "StaleUpdate",
    "UploadIdle",
    "StartupError",
    "UnsupportedModel",
    "ParallelismUnsupported",
}


def imported_modules(tree: ast.Module) -> set[str]:
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


@pytest.mark.parametrize("layer", ["service.py", "server.py", "http_api.py", "sglang.py"])
def test_the_front_ends_use_the_engine_facade_only(layer):
    tree = ast.parse((PACKAGE / layer).read_text())
    internals = {f"rollout_server.{name}" for name in ENGINE_INTERNALS}
    assert not imported_modules(tree) & internals
    reached = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "engine"
    }
    assert not reached & {*ENGINE_INTERNALS, "metrics", "on_fatal"}, reached


def test_exceptions_that_cross_layers_are_defined_in_the_errors_module_only():
    defined = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in CROSS_LAYER_ERRORS:
                defined.setdefault(node.name, []).append(path.relative_to(PACKAGE).as_posix())
    assert defined == {name: ["errors.py"] for name in CROSS_LAYER_ERRORS}
