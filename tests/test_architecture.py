"""The layering the code keeps: the front ends (gRPC and HTTP) call the engine's facade only, the
exceptions that cross layers come from one module, and the client's modules import one another
without a circle."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rollout_server"
CLIENTS = PACKAGE.parent / "clients"
CLIENT_PACKAGES = ("rollout_client", "rollout_core")
# What the engine keeps behind its facade: the gRPC layer imports none of it, and reaches through the
# engine to none of it.
ENGINE_INTERNALS = ("scheduler", "policy", "runner", "sampler", "stream", "residency")
CROSS_LAYER_ERRORS = {
    "InvalidRequest",
    "Overloaded",
    "ShuttingDown",
    "MemoryReleased",
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


@pytest.mark.parametrize(
    "layer", ["grpc_api.py", "http_api.py", "sglang.py", "admission.py", "engine_client.py", "server.py"]
)
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


# The server's imports of the client library still to move into rollout_core (the shared contract):
# constants both sides read. Nothing else of the server may import it.
CLIENT_IMPORTS_TO_MOVE = {
    ("limits.py", "rollout_client.channel"),  # MAX_RECEIVE_BYTES
    ("grpc_api.py", "rollout_client.channel"),  # the previous-attempts header and trailer
    ("auth.py", "rollout_client.credentials"),  # the token reader
    # The shapes preset's tokenizers learn the captions of the reward's scene grammar (imported when
    # the preset is built, not served).
    ("presets/shapes.py", "rollout_client.rewards"),
}


def test_no_server_module_imports_the_client_library():
    """The front ends translate the engine's events themselves: no server module decodes its own wire
    with the client library (``rollout_core`` is what both sides share)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found.update(
                (path.relative_to(PACKAGE).as_posix(), name)
                for name in names
                if name.split(".")[0] == "rollout_client"
            )
    assert found - CLIENT_IMPORTS_TO_MOVE == set()


def test_the_front_ends_are_peers():
    """HTTP stands beside gRPC, not on it: neither front end imports the other, and the server reaches
    the engine through the engine client."""
    for layer, other in (("http_api.py", "grpc_api"), ("grpc_api.py", "http_api"), ("sglang.py", "grpc_api")):
        modules = imported_modules(ast.parse((PACKAGE / layer).read_text()))
        assert not {m for m in modules if m.startswith(f"rollout_server.{other}")}, layer
    server = ast.parse((PACKAGE / "server.py").read_text())
    reached = {
        node.attr
        for node in ast.walk(server)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "service"
    }
    assert not reached & {"engine", "metrics", "serving"}, reached


def test_exceptions_that_cross_layers_are_defined_in_the_errors_module_only():
    defined = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in CROSS_LAYER_ERRORS:
                defined.setdefault(node.name, []).append(path.relative_to(PACKAGE).as_posix())
    assert defined == {name: ["errors.py"] for name in CROSS_LAYER_ERRORS}


def module_name(path: Path) -> str:
    parts = path.relative_to(CLIENTS).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """The modules ``tree`` imports when it runs, at module level or in a function (relative imports
    resolved; ``from package import name`` is the submodule when there is one); what an ``if
    TYPE_CHECKING:`` block imports does not run."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            found.update({source, *(f"{source}.{alias.name}" for alias in node.names)})
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def client_import_graph() -> dict[str, set[str]]:
    """Each module of the client packages and the modules of those packages it imports."""
    paths = {module_name(path): path for name in CLIENT_PACKAGES for path in (CLIENTS / name).rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        imported = runtime_imports(ast.parse(path.read_text()), module, path.name == "__init__.py")
        graph[module] = (imported & paths.keys()) - {module}
    return graph


def a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (its modules in order, the first again at the end), or []."""
    done: set[str] = set()

    def search(module: str, path: list[str]) -> list[str]:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return []
        for imported in sorted(graph[module]):
            if cycle := search(imported, [*path, module]):
                return cycle
        done.add(module)
        return []

    return next((cycle for module in sorted(graph) if (cycle := search(module, []))), [])


def test_the_client_packages_import_without_a_circle():
    graph = client_import_graph()
    assert {"rollout_client.client", "rollout_client.routing"} <= graph["rollout_client.pool"]
    assert "rollout_client.client" not in graph["rollout_client.weight_sync"]  # TYPE_CHECKING only
    assert not a_cycle(graph), " -> ".join(a_cycle(graph))


def test_an_import_circle_is_seen():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert a_cycle(graph) == ["a", "b", "c", "a"]
    assert not a_cycle({"a": {"b"}, "b": set()})


def test_the_reference_replayer_imports_only_torch_safetensors_diffusers_and_the_stubs():
    """conformance/replay.py is the protocol's executable form for other implementations: it reads the
    docs' formulas, not our code, and stays short enough to read in one sitting."""
    source = (PACKAGE.parent / "conformance" / "replay.py").read_text()
    modules = imported_modules(ast.parse(source))
    allowed = {"torch", "safetensors", "diffusers", "google", "rollout"}
    assert {name.split(".")[0] for name in modules} <= allowed | set(sys.stdlib_module_names)
    assert {name for name in modules if name.startswith("rollout")} <= {
        "rollout.v1",
        "rollout.v1.rollout_pb2",
    }
    assert {name for name in modules if name.startswith("google")} <= {
        "google.protobuf",
        "google.protobuf.json_format",
    }
    assert len(source.splitlines()) <= 300
