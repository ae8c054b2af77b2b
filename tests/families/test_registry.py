"""Every registered family is one complete folder, and its names stay in it.

The registry (``rollout_server/families/registry.py``) is the one list of families; these checks are
what a new folder must satisfy to be picked up by the rest of the suite: a spec, an adapter per
pipeline class, published configs, a preset builder per preset, a row in docs/adding-a-model.md,
and no mention of the family outside its folder, the registry and the docs.
"""

import importlib
import re

import pytest
from support.servers import ROOT

from rollout_server.families import registry
from rollout_server.presets import preset_names

FAMILIES_DIR = ROOT / "rollout_server" / "families"
# Folders of the families package that are no family: the builders' shared parts.
SHARED = {"common", "__pycache__"}
# Files that may name any family, and why.
NAMING_FILES = {
    "rollout_server/families/registry.py": "the one list of families",
}
# Lines elsewhere that may name a family, and why.
ALLOWED = {
    # diffusers keeps the dynamic-shift helper every packed-latent family calls in its flux package.
    "rollout_server/families/base.py": "from diffusers.pipelines.flux.pipeline_flux import",
    # The SGLang front end's extra text-length entries of a family's env, by family name (they belong
    # with the family's adapter; sglang.py is left as it is while its front end is reworked).
    "rollout_server/sglang.py": "SGLANG_ENV = {",
    # The request validation cites WanPipeline's default for guidance_scale_2 (two-expert models).
    "rollout_server/validation.py": "WanPipeline's default",
}
# A family built on another's parts may name it: Wan 2.1 image-to-video is Wan's transformer and
# adapter with a first frame; Cosmos3 decodes with Wan 2.2's VAE, framed as Wan's adapter frames it.
BUILT_ON = {"wan_i2v": {"wan"}, "cosmos3": {"wan"}}


@pytest.mark.parametrize("name", registry.FAMILIES)
def test_each_family_is_a_complete_folder(name):
    spec = registry.spec(name)
    folder = FAMILIES_DIR / name
    assert spec.name == name and spec.package == f"rollout_server.families.{name}"
    for module in ("__init__", "adapter", "published", "preset"):
        assert (folder / f"{module}.py").is_file(), module
    assert spec.adapters and spec.lora_targets and spec.presets
    for pipeline_class, adapter_name in spec.adapters.items():
        adapter = registry.adapter_class(pipeline_class)
        assert adapter.__name__ == adapter_name
        assert adapter.pipeline_type.__name__ == pipeline_class
    # The published configs are data: dictionaries of config.json values (and a few plain numbers).
    published = importlib.import_module(f"{spec.package}.published")
    configs = {key: value for key, value in vars(published).items() if key.isupper()}
    assert any(isinstance(value, dict) for value in configs.values())
    for preset in spec.presets.values():
        module, builder = preset.builder.split(":")
        assert callable(getattr(importlib.import_module(f"{spec.package}.{module}"), builder))
        assert preset.defaults.keys() <= {"height", "width", "frames", "num_steps", "true_cfg_scale"}


def test_every_family_folder_is_registered_and_presets_are_named_once():
    folders = {p.name for p in FAMILIES_DIR.iterdir() if p.is_dir()} - SHARED
    assert folders == set(registry.FAMILIES)
    declared = [name for spec in registry.specs() for name in spec.presets]
    assert len(declared) == len(set(declared)) and tuple(declared) == preset_names()


def test_each_family_has_its_row_in_the_docs():
    """docs/adding-a-model.md's table of families: one row per folder, naming its pipeline classes and
    presets, and no row for a family that is not registered."""
    docs = (ROOT / "docs" / "adding-a-model.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)/` \|.*$", docs, re.MULTILINE)}
    assert set(rows) == set(registry.FAMILIES)
    for spec in registry.specs():
        for named in (*spec.adapters, *spec.presets):
            assert f"`{named}`" in rows[spec.name], named


def names_of(spec) -> set[str]:
    """What names a family: its folder, its pipeline classes and its adapters' family names."""
    served = {registry.adapter_class(pipeline).family for pipeline in spec.adapters}
    return {spec.name, *spec.adapters, *served}


def test_no_family_is_named_outside_its_folder_the_registry_and_the_docs():
    """Server and client code reach a family through the registry only: a family's names appear in
    its own folder, in a family it is built on, or at the places ALLOWED says why."""
    sources = [p for p in (ROOT / "rollout_server").rglob("*.py") if "__pycache__" not in p.parts] + [
        p for p in (ROOT / "clients").rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]
    found = []
    for spec in registry.specs():
        word = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names_of(spec))) + r")(?![\w-])")
        owners = {spec.name} | {f for f, bases in BUILT_ON.items() if spec.name in bases}
        for path in sources:
            relative = path.relative_to(ROOT).as_posix()
            inside = (
                relative.startswith("rollout_server/families/") and path.relative_to(FAMILIES_DIR).parts[0]
            )
            if inside in owners or relative in NAMING_FILES:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if word.search(line) and not (relative in ALLOWED and ALLOWED[relative] in line):
                    found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []
