"""The parallel layout: ParallelDims checks its options, its device mesh has the named dims diffusers
splits attention over (on a real two-rank gloo group), the split refuses what it cannot run with an
exception, and each family's count of generated tokens is the length its transformer splits."""

import datetime
import inspect
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import FluxTransformer2DModel
from support.adapters import forward_at
from support.families import FAMILIES
from support.servers import command_line_exit

from rollout.v1 import rollout_pb2
from rollout_server import cli, families
from rollout_server.errors import InvalidRequest, ParallelismUnsupported
from rollout_server.families.base import MediaShape
from rollout_server.limits import Limits
from rollout_server.parallel import ATTENTION_SPLITS, ParallelDims, SequenceParallel, split_inputs
from rollout_server.presets import defaults_for
from rollout_server.validation import ServingContext, check_prompt_tokens, resolve


def test_parallel_dims_split_the_ranks():
    assert cli.ATTENTION_SPLITS == ATTENTION_SPLITS  # the command line offers what the library takes
    layouts = {
        (1, "ulysses"): (1, 1, 1, True),
        (4, "ulysses"): (4, 1, 4, True),
        (4, "ring"): (1, 4, 4, False),
        (4, "ulysses+ring"): (2, 2, 4, False),
        (2, "ulysses+ring"): (2, 1, 2, True),
    }
    for (sp, split), expected in layouts.items():
        dims = ParallelDims(sp, split, world_size=sp)
        assert (dims.ulysses, dims.ring, dims.seq_len_divisor, dims.uneven_text) == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sp": 0, "world_size": 0}, "--sp must be at least 1"),
        ({"sp": 2, "attention_split": "tensor", "world_size": 2}, "--attention-split must be one of"),
        ({"sp": 3, "attention_split": "ulysses+ring", "world_size": 3}, "needs an even --sp, got 3"),
        ({"sp": 2, "world_size": 4}, "--sp 2 needs 2 ranks, but the world has 4"),
    ],
)
def test_parallel_dims_name_the_wrong_option(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**fields)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--sp", "3", "--attention-split", "ulysses+ring"),
            "--attention-split ulysses+ring needs an even --sp",
        ),
        (("--sp", "2", "--attention-split", "ring"), "ring attention needs GPUs"),
    ],
)
def test_the_command_line_turns_a_refused_layout_into_an_exit_message(
    cache_dir, tiny_flux_folder, args, message
):
    """Checked before any rank starts: the library raises, the command line exits with the message."""
    assert command_line_exit("serve", "--cache-dir", str(cache_dir), *args).startswith(
        f"rollout-server: {message}"
    )


def test_split_transformer_refuses_with_an_exception(family_resources, tiny_transformer):
    """No context-parallel plan (SD3), or heads the Ulysses degree does not divide: an exception the
    command line turns into an exit message, not an exit from library code."""
    two_ranks = SequenceParallel(ParallelDims(sp=2, world_size=2))
    with pytest.raises(ParallelismUnsupported, match="no context-parallel plan in diffusers: --sp 2"):
        two_ranks.split_transformer(family_resources.transformer("sd3"))
    three_ranks = SequenceParallel(ParallelDims(sp=3, world_size=3))
    heads = tiny_transformer.config.num_attention_heads
    assert heads % 3
    with pytest.raises(ParallelismUnsupported, match=f"{heads} attention heads: not divisible by .* 3"):
        three_ranks.split_transformer(tiny_transformer)


def run_rank(rank: int, port: int, folder: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        dims = ParallelDims(sp=2, world_size=2)
        mesh = dims.build_mesh("cpu")
        transformer = FluxTransformer2DModel.from_pretrained(folder)
        SequenceParallel(dims, rank=rank, mesh=mesh).split_transformer(transformer)
        split_over = transformer._parallel_config.context_parallel_config._mesh
        results.put(
            (
                rank,
                mesh.mesh_dim_names,
                tuple(mesh.shape),
                dist.get_process_group_ranks(mesh["ulysses"].get_group()),
                split_over is mesh,
            )
        )
    finally:
        dist.destroy_process_group()


def test_the_mesh_has_named_dims_and_carries_the_split(tiny_flux_folder):
    """Two gloo ranks: the mesh is (ring 1, ulysses 2), its Ulysses group holds both ranks, and
    diffusers splits the transformer over this mesh rather than one of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("forkserver")  # the test servers' fork server: its imports are done
    results = context.Queue()
    folder = str(tiny_flux_folder / "transformer")
    processes = [context.Process(target=run_rank, args=(r, port, folder, results)) for r in (0, 1)]
    for process in processes:
        process.start()
    reports = sorted(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    for rank, report in enumerate(reports):
        assert report == (rank, ("ring", "ulysses"), (1, 2), [0, 1], True)


@pytest.fixture(scope="module")
def adapters(family_resources):
    loaded = {}

    def load(family: str) -> families.base.FamilyAdapter:
        if family not in loaded:
            folder = family_resources.folder(family)
            loaded[family] = families.load(folder, torch.device("cpu"), torch.float32)
        return loaded[family]

    return load


@pytest.mark.parametrize(
    ("family", "shape"),
    [
        ("flux", MediaShape(1, 48, 80)),
        ("flux2-klein", MediaShape(1, 48, 80)),
        ("qwen-image", MediaShape(1, 48, 80)),
        ("wan", MediaShape(9, 48, 80)),
        ("hunyuan-video15", MediaShape(9, 48, 80)),  # our plan
        ("ltx2", MediaShape(17, 64, 96)),
    ],
)
def test_generated_tokens_are_the_length_the_transformer_splits(adapters, family, shape):
    """A real forward at an uneven shape: every generated input the context-parallel plan splits
    has, along the split dim, the adapter's generated_tokens(shape)."""
    adapter = adapters(family)
    transformer = adapter.transformer
    lengths = {}

    def capture(module_name, plan):
        def hook(module, args, kwargs):
            bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
            for name, split in plan.items():
                if name in adapter.generated_inputs:
                    lengths[(module_name, name)] = bound[name].shape[split.split_dim]

        return hook

    hooks = [
        transformer.get_submodule(module_name).register_forward_pre_hook(
            capture(module_name, plan), with_kwargs=True
        )
        for module_name, plan in transformer._cp_plan.items()
        if isinstance(plan, dict) and any(name in adapter.generated_inputs for name in plan)
    ]
    try:
        forward_at(adapter, FAMILIES[family].prompts[0], shape)
    finally:
        for hook in hooks:
            hook.remove()
    assert lengths and len(hooks) == len({module for module, _ in lengths})
    assert set(lengths.values()) == {adapter.generated_tokens(shape)}


@pytest.mark.parametrize("family", ["wan", "hunyuan-video15"])
def test_validation_refuses_tokens_the_ranks_cannot_split(adapters, family):
    """At 2 ranks, 9 frames of 48 x 48 pixels are 3 x 3 x 3 = 27 tokens (Wan: 8x VAE and 2 x 2
    patches; HunyuanVideo 1.5: 16x VAE and 1 x 1 patches), refused naming height; at 64 x 64 pixels
    they are 48 tokens, which split."""
    adapter = adapters(family)
    defaults = defaults_for(FAMILIES[family].preset, adapter.defaults())
    serving = ServingContext(adapter, defaults, Limits(), seq_len_divisor=2)
    request = {"prompts": ["a fox"], "num_frames": 9, "num_steps": 2}
    with pytest.raises(InvalidRequest) as raised:
        resolve(rollout_pb2.RolloutRequest(height=48, width=48, **request), serving)
    assert raised.value.violations == [
        ("height", "48 x 48 pixels, 9 frame(s): 27 tokens, which do not split evenly across 2 ranks")
    ]
    assert resolve(rollout_pb2.RolloutRequest(height=64, width=64, **request), serving)


def test_ring_attention_refuses_prompts_of_uneven_token_counts(adapters):
    """Under ring attention the text tokens split evenly too; their count is known once encoded, and
    the refusal names each prompt whose count is odd (Qwen-Image encodes prompts unpadded)."""
    adapter = adapters("qwen-image")
    shape = MediaShape(1, 64, 64)
    texts = ["a fox", "a fox in the snow", "an old lighthouse on a rocky cliff at dusk, oil painting"]
    envs = {"positive": [adapter.encode_text(text, 1.0, shape) for text in texts]}
    odd = [
        f"prompts[{p}]" for p, env in enumerate(envs["positive"]) if env["encoder_hidden_states"].shape[1] % 2
    ]
    assert 0 < len(odd) < len(texts)
    assert "encoder_hidden_states" in split_inputs(adapter.transformer)
    check_prompt_tokens(ParallelDims(sp=2, attention_split="ulysses", world_size=2), adapter, envs)
    with pytest.raises(InvalidRequest) as raised:
        check_prompt_tokens(ParallelDims(sp=2, attention_split="ring", world_size=2), adapter, envs)
    assert [field for field, _ in raised.value.violations] == odd
