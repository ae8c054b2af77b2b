"""The layering the code keeps: the front ends (gRPC and HTTP) call the engine's facade only, the
exceptions that cross layers come from one module, every collective of the server is in its parallel
package, the client's modules import one another without a circle, the server and the client library
import nothing of each other (``rollout_core`` is the contract both import), and the client library names
no model family."""

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rollout_server"
CLIENTS = PACKAGE.parent / "clients"
CLIENT_PACKAGES = ("rollout_client", "rollout_core")
# What the engine keeps behind its facade: the gRPC layer imports none of it, and reaches through the
# engine to none of it.
ENGINE_INTERNALS = ("scheduler", "policy", "runner", "sampler", "stream", "residency")
DYNAMIC_IMPORTS = {"importlib.import_module", "import_module", "__import__"}
# Imports across the server / client line that are still being replaced, by importing module: what
# each may import of the other side. Nothing else crosses it.
CROSSINGS_BEING_REPLACED = {
    # The HTTP front end builds its answer by decoding the gRPC events with the client library, until
    # it builds it from the engine's events.
    "rollout_server.sglang": {
        "rollout_client.events",
        "rollout_client.events.Finished",
        "rollout_client.events.Step",
        "rollout_client.events.decode_stream",
        "rollout_client.trajectory",
        "rollout_client.trajectory.Collector",
        "rollout_client.trajectory.Trajectory",
    },
}
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


def uses_torch_distributed(tree: ast.Module) -> bool:
    """Whether a module imports torch.distributed (or a module of it), or reaches it as an attribute."""
    named = {
        *imported_modules(tree),
        *(ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)),
    }
    return any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in named)


def test_only_the_parallel_package_uses_torch_distributed():
    """The process groups, the collectives between ranks (the families' Ulysses exchanges among them)
    and the weight-sync group are rollout_server/parallel/'s: how ranks talk is one package's."""
    users = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if uses_torch_distributed(ast.parse(path.read_text()))
    }
    assert {"parallel/mesh.py", "parallel/ulysses.py", "parallel/sync_group.py"} <= users
    assert all(path.startswith("parallel/") for path in users), sorted(users)


def module_name(path: Path, root: Path = CLIENTS) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.Module, module: str, is_package: bool, type_checking: bool = False) -> set[str]:
    """The modules ``tree`` imports when it runs, at module level or in a function (relative imports
    resolved; ``from package import name`` is the submodule when there is one; ``importlib.import_module``
    and ``__import__`` of a literal name too); what an ``if TYPE_CHECKING:`` block imports does not run,
    and counts only with ``type_checking``."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            found.update({source, *(f"{source}.{alias.name}" for alias in node.names)})
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in DYNAMIC_IMPORTS
            and node.args
            and isinstance(name := node.args[0], ast.Constant)
            and isinstance(name.value, str)
        ):
            found.add(name.value)
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


def every_import(package: Path, root: Path) -> dict[str, set[str]]:
    """Each module of ``package`` (a folder under ``root``) and every module it imports: at module
    level, in a function, or for type checking only."""
    return {
        module_name(path, root): runtime_imports(
            ast.parse(path.read_text()),
            module_name(path, root),
            path.name == "__init__.py",
            type_checking=True,
        )
        for path in package.rglob("*.py")
    }


def crossings(importing: Path, root: Path, imported: tuple[str, ...]) -> dict[str, set[str]]:
    """The modules of ``importing`` that import one of the ``imported`` packages, and what they import of
    them."""
    found = {}
    for module, imports in every_import(importing, root).items():
        if crossing := {name for name in imports if name.split(".")[0] in imported}:
            found[module] = crossing
    return found


def test_the_client_library_and_the_server_import_nothing_of_each_other():
    to_server = crossings(CLIENTS / "rollout_client", CLIENTS, ("rollout_server",))
    to_client = crossings(PACKAGE, PACKAGE.parent, ("rollout_client",))
    assert to_server | to_client == CROSSINGS_BEING_REPLACED
    # The contract both import imports neither.
    assert not crossings(CLIENTS / "rollout_core", CLIENTS, ("rollout_server", "rollout_client"))


def test_an_import_across_the_line_is_seen_wherever_it_is(tmp_path):
    """At module level, in a function, relative, under TYPE_CHECKING, or by importlib."""
    package = tmp_path / "rollout_client"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from rollout_server.local import LocalServer\n")
    (package / "b.py").write_text("if TYPE_CHECKING:\n    import rollout_server.engine\n")
    (package / "c.py").write_text("import importlib\n\nx = importlib.import_module('rollout_server.cli')\n")
    (package / "d.py").write_text("from . import a\nfrom rollout_core import wire\n")
    assert crossings(package, tmp_path, ("rollout_server",)) == {
        "rollout_client.a": {"rollout_server.local", "rollout_server.local.LocalServer"},
        "rollout_client.b": {"rollout_server.engine"},
        "rollout_client.c": {"rollout_server.cli"},
    }


def family_words() -> set[str]:
    """Every family's wire name (GetServerInfo.family) and its pipeline class, from the registry."""
    from rollout_server.families import registry

    adapters = [registry.adapter_class(pipeline) for pipeline in registry.pipeline_classes()]
    return {*registry.pipeline_classes(), *(adapter.family for adapter in adapters)}


def names_of_families(source: str, words: set[str]) -> set[str]:
    """The family words that ``source`` holds in a string, or in a name of its code (an identifier, an
    attribute, an argument, a definition, an import). A string holds a word between characters that
    cannot continue a name ("tiny-flux" holds no "flux"); a name holds it between underscores, in any
    case (``QWEN_IMAGE_TARGETS`` holds "qwen-image"). Prose that names a model (a docstring's "Wan 2.2",
    "LTX-2") is documentation, not a family's name on the wire."""
    strings, names = [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.append(node.value)
        elif isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.alias):
            names += [node.name, node.asname or ""]
    found = set()
    for word in words:
        in_string = re.compile(rf"(?<![\w.-]){re.escape(word)}(?![\w-])")
        in_name = re.compile(rf"(?<![a-z0-9]){re.escape(word.replace('-', '_').lower())}(?![a-z0-9])")
        if any(in_string.search(text) for text in strings) or any(
            in_name.search(name.lower()) for name in names
        ):
            found.add(word)
    return found


def test_the_client_library_names_no_model_family():
    """What the client needs of the model (its LoRA targets, what its decode makes) comes from
    GetServerInfo; the trainer is the client library's too."""
    words = family_words()
    assert {"flux", "ltx2", "qwen-image-edit", "FluxPipeline", "LTX2Pipeline"} <= words
    named = {
        module_name(path): found
        for path in (CLIENTS / "rollout_client").rglob("*.py")
        if (found := names_of_families(path.read_text(), words))
    }
    assert named == {}


def test_a_family_name_is_seen_in_a_string_or_a_name_not_in_prose():
    words = {"flux", "qwen-image", "FluxPipeline"}
    assert names_of_families('TABLE = {"flux": 1}', words) == {"flux"}
    assert names_of_families("QWEN_IMAGE_TARGETS = ()", words) == {"qwen-image"}
    assert names_of_families("from diffusers import FluxPipeline", words) == {"FluxPipeline"}
    assert names_of_families("def f(flux_model): pass", words) == {"flux"}
    assert names_of_families('x = "the qwen-image family"', words) == {"qwen-image"}
    assert not names_of_families('"""Flux and Qwen-Image, as FLUX.1 [dev] does."""', words)
    assert not names_of_families('MODEL = "tiny-flux"\nflux2 = "flux2"', words)
