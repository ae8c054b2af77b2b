"""Every served family at its published checkpoint's size, on the meta device.

Each checkpoint of ``real_size_pipelines.py`` builds its transformer from the values of its published
``config.json`` (the family's ``published.py``), and the components whose sizes the adapter and the server
read (the VAE, the text and image encoders, the scheduler, a tokenizer's length), all on the meta
device: no weights, no memory, no arithmetic beyond shapes. The adapter is the server's own, built over
that pipeline. The checks are what breaks only at scale, against figures worked out by hand from the
published values:

- the adapter's latent shape, generated tokens and forward size at the family's default request size
  (1024 x 1024 pixels; 480 x 832 pixels x 81 frames for video, HunyuanVideo 1.5's own 480 x 848
  x 121, Cosmos3's 720 x 1280 x 189, LTX-2's 512 x 768 x 121), and the tokens the real transformer's
  input layer makes of that latent (of each latent stream, for LTX-2's video and audio);
- the sequence-parallel split at 2, 4 and 8 ranks: the attention heads Ulysses divides, and the
  tokens of a default request;
- the memory estimate: a forward row against tokens x width, the rows the runner puts in one forward,
  the text's env, a decode piece (a whole video's, and a sound's), and a component's parameters
  against its published safetensors' bytes or parameter count;
- the family's default LoRA targets (its spec's ``lora_targets``) against the real module tree,
  laid out by the server's own check, with and without sequence parallelism.

``PYTHONPATH=tests python tests/families/test_real_sizes.py`` prints the table of docs/benchmarks.md
("Real checkpoint sizes"); ``test_the_table_in_the_docs_is_the_one_computed_here`` holds the docs to it.
Last, on the tiny-ltx2 preset (real weights, the CPU): the estimate's decode piece against the tensors a
real decode of its longest sound makes.
"""

import dataclasses
import io
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diffusers import (
    DiffusionPipeline,
)
from peft import LoraConfig
from PIL import Image
from real_size_pipelines import (
    CHECKPOINTS,
    DTYPE,
    LTX_2_CHECKPOINT,
    META,
    SPLITS,
    Checkpoint,
)
from support.families import FAMILIES
from support.servers import ROOT

from rollout.v1 import rollout_pb2
from rollout_client.train.lora import DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK
from rollout_client.updates import lora_config_json
from rollout_server import memory
from rollout_server.errors import InvalidRequest, ParallelismUnsupported
from rollout_server.families import registry
from rollout_server.families.base import FamilyAdapter, MediaShape
from rollout_server.limits import Limits
from rollout_server.live_tensors import LiveTensorBytes
from rollout_server.parallel import ParallelDims, check_splittable
from rollout_server.presets import defaults_for
from rollout_server.scheduler import STREAM_BUFFER
from rollout_server.stream import wav_bytes
from rollout_server.validation import ServingContext, resolve
from rollout_server.weights.spec import TransformerSpec, layout_bytes, lora_layout

# A trainer's group: the default --group-size of rollout_client.train, on one prompt.
GROUP = 8
# What a stream's outbox may hold from earlier events, as the server counts it.
BACKLOG = STREAM_BUFFER * Limits().max_message_bytes


def lora_targets(adapter: FamilyAdapter) -> tuple[str, ...]:
    """The default LoRA targets of the adapter's family, as its spec declares them."""
    return registry.family_of(type(adapter.pipe).__name__).lora_targets


def build(checkpoint: Checkpoint, folder: Path) -> FamilyAdapter:
    """The server's adapter of ``checkpoint``, over its pipeline on the meta device."""
    pipe = checkpoint.pipeline(folder)
    return registry.adapter_class(type(pipe).__name__)(pipe, META, DTYPE)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Callable[[Checkpoint], FamilyAdapter]:
    built: dict[str, FamilyAdapter] = {}

    def adapter(checkpoint: Checkpoint) -> FamilyAdapter:
        if missing := FAMILIES[checkpoint.family].missing:
            pytest.skip(f"{checkpoint.name} cannot be assembled here: {missing}")
        if checkpoint.name not in built:
            built[checkpoint.name] = build(checkpoint, tmp_path_factory.mktemp("tokenizers"))
        return built[checkpoint.name]

    return adapter


@pytest.fixture(scope="module")
def figures(adapters) -> Callable[[Checkpoint], "Figures"]:
    measured: dict[str, Figures] = {}

    def of(checkpoint: Checkpoint) -> Figures:
        if checkpoint.name not in measured:
            measured[checkpoint.name] = Figures.of(checkpoint, adapters(checkpoint))
        return measured[checkpoint.name]

    return of


def default_shape(adapter: FamilyAdapter) -> MediaShape:
    defaults = adapter.defaults()
    return MediaShape(defaults.frames, defaults.height, defaults.width)


def group_request(adapter: FamilyAdapter, split: int) -> rollout_pb2.RolloutRequest:
    """A trainer's group at the family's defaults (size, steps, CFG, images on), resolved by the
    server's validation with ``split`` sequence-parallel ranks; InvalidRequest if it cannot run."""
    request = rollout_pb2.RolloutRequest(prompts=["a red fox in the snow"], samples_per_prompt=GROUP)
    if adapter.takes_images:
        image = io.BytesIO()
        Image.new("RGB", (64, 64), "red").save(image, format="PNG")
        request.condition_images.add(data=image.getvalue())
    serving = ServingContext.of(adapter, adapter.defaults(), Limits(), seq_len_divisor=split)
    return resolve(request, serving)


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def weight_bytes(pipe: DiffusionPipeline) -> int:
    """What the loaded pipeline holds on each rank: every component's parameters and buffers."""
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


def default_request_refused(adapter: FamilyAdapter, split: int) -> bool:
    """Whether validation refuses the default request at ``split`` ranks (its tokens do not divide)."""
    try:
        group_request(adapter, split)
    except InvalidRequest:
        return True
    return False


def split_refusal(adapter: FamilyAdapter, split: int) -> str:
    """Why a Ulysses split across ``split`` ranks is refused at start-up ("" if it is not)."""
    try:
        for expert in adapter.experts.values():
            check_splittable(expert, ParallelDims(split, "ulysses", split))
    except ParallelismUnsupported as error:
        return str(error)
    return ""


def lora_config(targets: list[str]) -> str:
    """The trainer's default LoRA on ``targets``, as its updates' header carries it."""
    return lora_config_json(
        LoraConfig(r=DEFAULT_LORA_RANK, lora_alpha=DEFAULT_LORA_ALPHA, target_modules=targets)
    )


@dataclasses.dataclass(frozen=True)
class Figures:
    """What the server's code makes of a checkpoint at its default request: the table's figures."""

    parameters: tuple[int, ...]  # each expert's
    weights: int  # every component's bytes, on each rank
    peaks: dict[int, int | None]  # by SP degree: the weights and the estimate's peak (None: refused)
    full_update: int  # one expert's tensors
    lora_update: int  # the trainer's default adapter on one expert
    lora_under_sp: str  # the server's refusal of that adapter under --sp ("" if it takes it)

    @classmethod
    def of(cls, checkpoint: Checkpoint, adapter: FamilyAdapter) -> "Figures":
        weights = weight_bytes(adapter.pipe)
        profile = adapter.measure_vae()
        budget = memory.MemoryBudget(0, Limits())
        peaks = {}
        for split in (1, *SPLITS):
            estimate = memory.estimate(adapter, profile, group_request(adapter, 1), BACKLOG, split)
            refused = split > 1 and (split_refusal(adapter, split) or default_request_refused(adapter, split))
            peaks[split] = None if refused else weights + budget.peak([estimate])
        # The server's own checks: the spec it takes of a loaded transformer under --sp, and the
        # adapter laid out on it (without the split's modules to avoid, when it refuses the adapter).
        split_spec = TransformerSpec.of(next(iter(adapter.experts.values())), sequence_parallel=True)
        config = lora_config(list(lora_targets(adapter)))
        try:
            lora, refusal = lora_layout(split_spec, config), ""
        except InvalidRequest as error:
            lora, refusal = lora_layout(dataclasses.replace(split_spec, unwrappable=()), config), str(error)
        return cls(
            parameters=tuple(parameters(expert) for expert in adapter.experts.values()),
            weights=weights,
            peaks=peaks,
            full_update=split_spec.tensor_bytes,
            lora_update=layout_bytes(lora),
            lora_under_sp=refusal,
        )


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.name)
def test_the_adapter_sizes_the_default_request_as_the_published_values_say(adapters, checkpoint):
    adapter = adapters(checkpoint)
    shape = default_shape(adapter)
    usual = (81, 480, 832) if adapter.max_frames > 1 else (1, 1024, 1024)
    assert (shape.frames, shape.height, shape.width) == (checkpoint.default_media or usual)
    assert adapter.latent_shape(shape) == checkpoint.latent_shape
    assert adapter.generated_tokens(shape) == checkpoint.generated_tokens
    assert adapter.forward_activation(shape) == checkpoint.forward
    assert adapter.text_elements() == checkpoint.text_elements
    sigmas, timesteps = adapter.schedule(adapter.defaults().num_steps, shape)
    assert len(sigmas) == len(timesteps) == adapter.defaults().num_steps + 1
    streams = adapter.latent_streams(shape)
    assert tuple(stream.shape for stream in streams) == checkpoint.latent_streams
    if streams:
        # LTX-2: the joint latent is cut into its streams, each fed under its own argument to its own
        # input projection (patches of 1), which makes a token of each row; the video's are generated.
        layers = {"hidden_states": "proj_in", "audio_hidden_states": "audio_proj_in"}
        with torch.no_grad():
            for stream in streams:
                sample = torch.empty(1, *stream.shape, device=META, dtype=DTYPE)
                embedded = getattr(adapter.transformer, layers[stream.argument])(sample)
                assert embedded.shape[1] == stream.shape[0]
        assert streams[0].shape[0] == checkpoint.generated_tokens
        return
    # The real transformer's input layer takes the latent as the adapter shapes it (with the
    # conditioning's channels, for a family that concatenates them), and makes that many tokens.
    for expert in adapter.experts.values():
        layer_name = next(
            n
            for n in ("x_embedder", "img_in", "pos_embed", "patch_embedding", "all_x_embedder", "proj_in")
            if hasattr(expert, n)
        )
        latent = list(checkpoint.latent_shape)
        channels = -1 if len(latent) == 2 else 0
        in_channels = getattr(expert.config, "in_channels", None) or expert.config.latent_channel  # Cosmos3's
        if adapter.conditioning.concat != rollout_pb2.CONDITIONING_CONCAT_CHANNELS:
            assert latent[channels] == in_channels
        latent[channels] = in_channels
        with torch.no_grad():
            sample = torch.empty(1, *latent, device=META, dtype=DTYPE)
            if layer_name == "all_x_embedder":  # Z-Image patchifies each sample [C, 1, H, W] itself
                patches, _, _ = expert._patchify_image(sample[0].unsqueeze(1), 2, 1)
                embedded = expert.all_x_embedder["2-1"](patches).unsqueeze(0)
            elif layer_name == "proj_in":  # Cosmos3 patchifies and packs its list of samples itself
                patches, _ = expert._patchify_and_pack_latents([sample])
                embedded = expert.proj_in(patches).unsqueeze(0)
            else:
                embedded = getattr(expert, layer_name)(sample)
        tokens = embedded.shape[1] if embedded.dim() == 3 else math.prod(embedded.shape[2:])
        assert tokens == checkpoint.generated_tokens


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.name)
def test_the_split_across_2_4_and_8_ranks(adapters, checkpoint):
    """Ulysses divides the attention heads (every expert's) among the ranks; the default request's
    tokens (generated and appended conditioning) then cut into equal parts, or validation names
    height."""
    adapter = adapters(checkpoint)
    refused = {split for split in SPLITS if split_refusal(adapter, split)}
    assert refused == checkpoint.ulysses_refused
    # A transformer without a plan is never split: its tokens need not cut evenly.
    no_plan = all("no context-parallel plan" in split_refusal(adapter, split) for split in SPLITS)
    shape = default_shape(adapter)
    tokens = adapter.generated_tokens(shape) + adapter.conditioning_tokens(shape)
    for split in () if no_plan else SPLITS:
        if split in checkpoint.uneven_splits:
            with pytest.raises(InvalidRequest) as raised:
                group_request(adapter, split)
            assert raised.value.violations == [
                (
                    "height",
                    f"{shape.height} x {shape.width} pixels, {shape.frames} frame(s): {tokens} tokens, "
                    f"which do not split evenly across {split} ranks",
                )
            ]
            continue
        assert MediaShape.of(group_request(adapter, split)) == shape
        assert tokens % split == 0


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.name)
def test_the_memory_estimate_at_scale(adapters, checkpoint):
    """A trainer's group at the default size: each forward row is 6 x its tokens x the widest
    activation plus its text, in bf16, each rank's share of the tokens under SP, plus what grows with
    the square of a sequence; a forward takes the rows the runner gives it; a decode piece is the
    larger of a video piece (a whole video where the VAE decodes one at once, with its attention's
    squares) and the sound's decode, each its probe's tensors per pixel (or waveform value) at once;
    an image-conditioned family's image encode is its probe's too; a component's parameters are its
    published checkpoint's bytes, or its published count."""
    adapter = adapters(checkpoint)
    tokens, width = checkpoint.forward
    profile = adapter.measure_vae()
    # A video VAE with a causal cache decodes a latent frame (4 frames) a piece; one without, the
    # whole probe (1 + 4 frames; LTX-2's 1 + 8) at once, and so a whole sample: its piece is the
    # default request's every frame.
    video_piece = 4 if adapter.decode_keeps_state else 1 + adapter.frame_step
    assert profile.frames_per_piece == (video_piece if adapter.max_frames > 1 else 1)
    assert profile.whole_sample == (adapter.max_frames > 1 and not adapter.decode_keeps_state)
    # Only a decode with a cache keeps tensors between its pieces.
    assert (profile.kept_bytes > 0) == adapter.decode_keeps_state
    shape = default_shape(adapter)
    assert adapter.audio_values(shape) == checkpoint.audio_values
    assert profile.sound_bytes >= checkpoint.sound_width
    pixels = profile.piece_frames(shape.frames) * shape.height * shape.width
    video_piece_bytes = math.ceil(pixels * profile.piece_bytes) + pixels * memory.FRAME_BYTES_PER_PIXEL
    # The sound decodes after the frames, beside the last piece's images: its tensors, the waveform's
    # float32 copies and WAV bytes (20 bytes a value), 4 bytes a pixel of the images.
    values = checkpoint.audio_values
    sound_bytes = values and math.ceil(values * profile.sound_bytes) + 20 * values + 4 * pixels
    assert memory.sound_piece(adapter, profile, shape, pixels) == sound_bytes
    video_piece_bytes += checkpoint.decode_attention_bytes
    budget = memory.MemoryBudget(0, Limits())
    for split in (1, *SPLITS):
        estimate = memory.estimate(adapter, profile, group_request(adapter, 1), BACKLOG, split)
        activations = (-(-tokens // split) * width * 6 + checkpoint.text_elements) * 2
        assert estimate.row_bytes == activations + checkpoint.attention_matrix_bytes
        assert budget.forward_rows(estimate, estimate.rows) == checkpoint.forward_rows
        assert estimate.decode_bytes == max(video_piece_bytes, sound_bytes)
        assert estimate.encode_bytes == (profile.encode(shape) if adapter.takes_images else 0)
    for component, size in checkpoint.published_bytes.items():
        assert 2 * parameters(getattr(adapter.pipe, component)) == size  # bf16
    for component, billions in checkpoint.published_parameters.items():
        # Rounded as published: to half a unit of its last digit.
        digits = len(billions.split(".")[1])
        assert f"{parameters(getattr(adapter.pipe, component)) / 1e9:.{digits}f}" == billions, component


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.name)
def test_the_default_lora_targets_name_modules_of_the_real_tree(adapters, figures, checkpoint):
    """Each target of the family's default LoRA matches linear layers of the published transformers
    (as PEFT matches a name: the whole name or its dotted end), and the server lays the trainer's
    default adapter out on it. Under sequence parallelism no target may wrap a module whose output
    the split gathers: FLUX's proj_out is one (its latent projection out)."""
    adapter = adapters(checkpoint)
    targets = lora_targets(adapter)
    for expert in adapter.experts.values():
        modules = dict(expert.named_modules())
        for target in targets:
            matched = [m for name, m in modules.items() if name == target or name.endswith("." + target)]
            assert matched and all(isinstance(m, torch.nn.Linear) for m in matched), target
    measured = figures(checkpoint)
    assert measured.lora_update > 0
    if "proj_out" in targets:
        assert "may not wrap ['proj_out']" in measured.lora_under_sp
    else:
        assert measured.lora_under_sp == ""


def test_ltx2s_lora_targets_adapt_every_attention_and_feed_forward_of_both_streams(
    adapters, family_resources
):
    """LTX-2's default targets wrap, in every block of the published transformer and of the tiny-ltx2
    preset's, the four projections of each of its six attentions (video and audio self-attention and
    prompt cross-attention, audio-to-video and video-to-audio) and both streams' feed-forwards: 28
    linear layers a block, and nothing else."""
    attentions = (
        "attn1",
        "audio_attn1",
        "attn2",
        "audio_attn2",
        "audio_to_video_attn",
        "video_to_audio_attn",
    )
    per_block = [f"{a}.{p}" for a in attentions for p in ("to_q", "to_k", "to_v", "to_out.0")]
    per_block += [f"{ff}.{layer}" for ff in ("ff", "audio_ff") for layer in ("net.0.proj", "net.2")]
    targets = registry.spec("ltx2").lora_targets
    for adapter in (adapters(LTX_2_CHECKPOINT), family_resources.adapter("ltx2")):
        transformer = adapter.transformer
        matched = [
            name
            for name, _ in transformer.named_modules()
            if any(name == target or name.endswith("." + target) for target in targets)
        ]
        blocks = range(transformer.config.num_layers)
        assert sorted(matched) == sorted(
            f"transformer_blocks.{i}.{name}" for i in blocks for name in per_block
        )
        assert all(isinstance(transformer.get_submodule(name), torch.nn.Linear) for name in matched)


def gib(size: int) -> str:
    return f"{size / 2**30:.1f}"


def row(checkpoint: Checkpoint, adapter: FamilyAdapter, measured: Figures) -> str:
    """The checkpoint's line of the table."""
    shape = default_shape(adapter)
    counts = " + ".join(f"{count / 1e9:.2f} B" for count in measured.parameters)
    peaks = " / ".join("-" if peak is None else gib(peak) for peak in measured.peaks.values())
    size = f"{shape.width} x {shape.height}" + (f" x {shape.frames}" if shape.frames > 1 else "")
    tokens = f"{adapter.generated_tokens(shape)} ({adapter.forward_activation(shape)[0]})"
    return (
        f"| {checkpoint.name} | {counts} | {size} | {tokens} | {gib(measured.weights)} | {peaks} | "
        f"{gib(measured.full_update)} | {measured.lora_update / 2**20:.1f} |"
    )


TABLE_HEADER = (
    "| checkpoint | transformer parameters | default size | tokens (in a forward) | weights, GiB | "
    "est. peak per GPU at SP 1 / 2 / 4 / 8, GiB | FULL update, GiB | LoRA r=8 update, MiB |\n"
    "|---|---|---|---|---|---|---|---|"
)


def table(adapter: Callable[[Checkpoint], FamilyAdapter], figures: Callable[[Checkpoint], Figures]) -> str:
    served = [c for c in CHECKPOINTS if not FAMILIES[c.family].missing]
    return "\n".join([TABLE_HEADER, *(row(c, adapter(c), figures(c)) for c in served)])


def test_the_table_in_the_docs_is_the_one_computed_here(adapters, figures):
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert table(adapters, figures) in docs


def test_the_decode_piece_covers_a_real_decode_of_the_tiny_ltx2_presets_longest_sound(family_resources):
    """tiny-ltx2 at its longest sound, 241 frames (10 s) at 64 x 64 (the least video beside it): the
    request's estimate has room for the tensors that decoding one sample makes, piece by piece as the
    runner decodes it: the whole video and its frames (the VAE decodes every frame at once), then the
    sound and its WAV, within the estimate's own sound term.

    On this CPU the sound decode's resident memory, in a fresh process, peaked at 70 to 78 MiB, mostly
    the vocoder's oneDNN convolutions over the tiny preset's narrow tensors
    (docs/architecture.md#the-memory-budget): within its term (146 MiB), which counts what glibc keeps
    of them and their reorders."""
    adapter = family_resources.adapter("ltx2")
    serving = ServingContext.of(adapter, defaults_for("tiny-ltx2", adapter.defaults()), Limits())
    request = rollout_pb2.RolloutRequest(prompts=["a drum"], num_frames=241, height=64, width=64)
    request = resolve(request, serving)
    assert request.images and (request.num_frames, request.samples_per_prompt) == (241, 1)
    shape = MediaShape.of(request)
    profile = adapter.measure_vae()
    estimate = memory.estimate(adapter, profile, request, BACKLOG)
    latents = torch.randn(1, *adapter.latent_shape(shape), generator=torch.Generator().manual_seed(0))
    with LiveTensorBytes() as video:
        frames = [len(images) for images in adapter.decode_frames(latents, shape)]
    with LiveTensorBytes() as sound:
        wav = wav_bytes(adapter.decode_audio(latents, shape))
    assert frames == [241]  # one piece
    assert len(wav) == memory.WAV_HEADER_BYTES + 2 * adapter.audio_values(shape)
    assert video.peak <= estimate.decode_bytes
    assert sound.peak <= memory.sound_piece(adapter, profile, shape, 0) <= estimate.decode_bytes
    # Both are far above the piece the estimate counted before: a video piece of the probe's 9 frames
    # (4.6 MB here, where the video's tensors took 47 MB and the sound's 19 MB), and no sound.
    probe_pixels = profile.frames_per_piece * shape.height * shape.width
    probe_piece = math.ceil(probe_pixels * profile.piece_bytes) + probe_pixels * memory.FRAME_BYTES_PER_PIXEL
    assert probe_piece < sound.peak < video.peak


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        built = {
            c.name: build(c, Path(scratch) / c.name) for c in CHECKPOINTS if not FAMILIES[c.family].missing
        }
        print(table(lambda c: built[c.name], lambda c: Figures.of(c, built[c.name])))
