"""Shared fixtures: each tiny model family's preset, server, client and trainer-side models, built once a
session by one factory; tiny-flux's also under the short names most tests use."""

import os
from pathlib import Path

import pytest
import torch
from support.families import FAMILIES
from support.servers import start_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


# The files that take longest, longest first (docs/testing.md has the table): under `--dist loadfile
# --no-loadscope-reorder` the workers take files in this order, and a long file taken last would run
# alone at the end. The other files follow in their usual order. A file is named by its name alone, in
# whichever folder of tests/ it is (test modules' names are unique: pytest imports them by name).
SLOWEST_FIRST = (
    "test_shapes_model.py",
    "test_contract.py",  # tests/families/: every family's server, replay and SP=2 rows
    "test_train.py",
    "test_ray.py",
    "test_sp.py",
    "test_serving.py",
    "test_weight_sync.py",
    "test_pool.py",
    "test_tree.py",
    "test_demo.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: position for position, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


class FamilyResources:
    """Per-family resources, each built on first use and kept for the session: the preset folder, one
    server and its client, and the transformer and pipeline loaded the trainer's way (plain diffusers
    from_pretrained)."""

    def __init__(self, cache_dir: Path, logs: Path):
        self.cache_dir, self.logs = cache_dir, logs
        self.built: dict[tuple[str, str], object] = {}

    def once(self, kind: str, family: str, build):
        if (kind, family) not in self.built:
            self.built[kind, family] = build()
        return self.built[kind, family]

    def folder(self, family: str) -> Path:
        from rollout_server.presets import resolve_model

        if FAMILIES[family].missing:
            pytest.skip(
                f"the {FAMILIES[family].preset} preset cannot be built here: {FAMILIES[family].missing}"
            )
        return self.once("folder", family, lambda: resolve_model(FAMILIES[family].preset, self.cache_dir))

    def adapter(self, family: str):
        from rollout_server import families

        return self.once(
            "adapter", family, lambda: families.load(self.folder(family), torch.device("cpu"), torch.float32)
        )

    def server(self, family: str):
        self.folder(family)  # built here first, not by the server
        log = self.logs / f"{family}-server.log"
        return self.once(
            "server",
            family,
            # The HTTP front end too (test_sglang_api.py compares it with the gRPC stream of one server),
            # and the metrics its tests watch a rollout by.
            lambda: start_server(
                self.cache_dir,
                log,
                *("--model", FAMILIES[family].preset, "--http-port", "0", "--metrics-port", "0"),
            ),
        )

    def client(self, family: str):
        from rollout_client import RolloutClient

        return self.once("client", family, lambda: RolloutClient(self.server(family).address, timeout=300))

    def transformer(self, family: str) -> torch.nn.Module | dict[str, torch.nn.Module]:
        import diffusers

        def load():
            spec = FAMILIES[family]
            model_class = getattr(diffusers, spec.transformer)
            experts = {
                name: model_class.from_pretrained(self.folder(family) / name).eval() for name in spec.experts
            }
            return experts["transformer"] if len(experts) == 1 else experts

        return self.once("transformer", family, load)

    def pipeline(self, family: str):
        import diffusers

        def load():
            pipe = getattr(diffusers, FAMILIES[family].pipeline).from_pretrained(
                self.folder(family), dtype=torch.float32
            )
            pipe.set_progress_bar_config(disable=True)
            return pipe

        return self.once("pipeline", family, load)

    def close(self) -> None:
        for (kind, _), value in self.built.items():
            if kind == "client":
                value.close()
        for (kind, _), value in self.built.items():
            if kind == "server":
                value.stop()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The preset cache, one for every test worker of the run: each preset is built once."""
    root = tmp_path_factory.getbasetemp()
    cache = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "preset-cache"
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture(scope="session")
def family_resources(cache_dir, tmp_path_factory):
    resources = FamilyResources(cache_dir, tmp_path_factory.mktemp("logs"))
    yield resources
    resources.close()


# For a test parametrized over ``family`` (a FAMILIES key), or in a module defining a ``family`` fixture.


@pytest.fixture
def family_folder(family_resources, family) -> Path:
    return family_resources.folder(family)


@pytest.fixture
def adapter(family_resources, family):
    """The family's adapter, loaded in the test process."""
    return family_resources.adapter(family)


@pytest.fixture
def family_client(family_resources, family):
    return family_resources.client(family)


@pytest.fixture
def family_transformer(family_resources, family):
    return family_resources.transformer(family)


@pytest.fixture
def family_pipeline(family_resources, family):
    return family_resources.pipeline(family)


# tiny-flux, the default model.


@pytest.fixture(scope="session")
def tiny_flux_folder(family_resources) -> Path:
    return family_resources.folder("flux")


@pytest.fixture(scope="session")
def server(family_resources):
    """The tiny-flux server shared by the tests that leave it in a clean state."""
    return family_resources.server("flux")


@pytest.fixture(scope="session")
def client(family_resources):
    return family_resources.client("flux")


@pytest.fixture(scope="session")
def tiny_transformer(family_resources):
    return family_resources.transformer("flux")
