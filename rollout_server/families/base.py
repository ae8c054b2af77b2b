"""The model-family adapter interface: everything model-specific lives behind it.

An adapter loads a local diffusers folder and knows the family's schedule, prompt encoding (the
frozen env), latent layout, transformer-call conventions and decoding. The sampler, the engine and
the server never import a model class.
"""

import contextlib
import copy
import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from PIL import Image

from rollout_core import solvers
from rollout_core.transformer_call import BATCHED_CALL, NO_CONDITIONING, CallForm, LatentConditioning
from rollout_server.families import registry
from rollout_server.live_tensors import LiveTensorBytes

if TYPE_CHECKING:
    from rollout_core.latent_streams import LatentStream


@dataclass(frozen=True)
class MediaShape:
    """What one sample is: ``frames`` frames of ``height`` x ``width`` pixels (an image is one frame)."""

    frames: int
    height: int
    width: int

    @classmethod
    def of(cls, request) -> "MediaShape":
        """The shape a resolved RolloutRequest asks for."""
        return cls(request.num_frames, request.height, request.width)


@dataclass(frozen=True)
class Sound:
    """A sample's decoded sound: float32 [channels, samples] in [-1, 1] at ``sample_rate`` per second."""

    waveform: torch.Tensor
    sample_rate: int


@dataclass(frozen=True)
class VaeProfile:
    """What the VAE's work holds in the device's memory, measured on a small probe
    (``FamilyAdapter.measure_vae``), per unit of what it yields or takes, which the work of any size
    follows: a decode piece's bytes per pixel of the frames it yields, and what a decode keeps between
    its pieces (a causal video VAE's cache) per pixel of a piece; the most frames one piece yields, or
    that a piece is a sample's every frame (a video VAE that decodes a whole video at once). For a
    family with sound, its decode's bytes per value of the waveform (channels x samples); for an
    image-conditioned family, its conditioning image's encode: bytes per pixel of a frame at
    ``encode_frames`` frames, and per pixel of each frame more (a video VAE encodes the image with
    the request's other frames, black). 0 where the family has none."""

    piece_bytes: float
    kept_bytes: float
    frames_per_piece: int
    whole_sample: bool = False
    sound_bytes: float = 0.0
    encode_bytes: float = 0.0
    encode_frame_bytes: float = 0.0
    encode_frames: int = 1

    def piece_frames(self, frames: int) -> int:
        """The frames of a sample's largest piece, for a sample of ``frames`` frames."""
        return frames if self.whole_sample else self.frames_per_piece

    def encode(self, shape: "MediaShape") -> int:
        """The bytes of one conditioning image's encode at ``shape``."""
        more = max(0, shape.frames - self.encode_frames)
        return math.ceil(shape.height * shape.width * (self.encode_bytes + more * self.encode_frame_bytes))


def convolution_scratch(module: torch.nn.Module, output: torch.Tensor, input: torch.Tensor) -> int:
    """The bytes a convolution's CPU kernel takes besides its input and output: PyTorch's 3D kernel
    unfolds its input into ``in_channels x kernel volume`` columns per output element; oneDNN, which
    runs the others (and 3D ones on large inputs, where the columns bound it), reorders the input and
    the output into its blocked layouts."""
    if isinstance(module, torch.nn.Conv3d):
        columns = module.in_channels // module.groups * math.prod(module.kernel_size)
        return columns * output.numel() // module.out_channels * output.element_size()
    return (input.numel() + output.numel()) * output.element_size()


CONVOLUTIONS = (
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose1d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
)


@dataclass(frozen=True)
class FamilyDefaults:
    """Request defaults that follow the family's usual settings."""

    height: int
    width: int
    num_steps: int
    guidance_scale: float
    true_cfg_scale: float
    noise_level: float
    frames: int = 1


class FamilyAdapter(ABC):
    """A loaded pipeline of one model family."""

    family: ClassVar[str]
    pipeline_type: ClassVar[type[DiffusionPipeline]]
    # The transformer is fed timestep / timestep_divisor, with what call_form adds (an offset, the
    # dtype); timestep_rule says so in words.
    timestep_divisor: ClassVar[float]
    timestep_rule: ClassVar[str]
    # How the latents and the timestep are handed to the transformer and its prediction read back:
    # as tensors under hidden_states and timestep, unless the family's transformer takes otherwise.
    call_form: ClassVar[CallForm] = BATCHED_CALL
    # CFG: the request field holding the CFG scale (a second, negative-prompt branch runs when it is
    # above cfg_off_scale) and the rule of rollout_core.transformer_call that combines the branches.
    cfg_scale_field: ClassVar[str] = "true_cfg_scale"
    cfg_rule: ClassVar[str] = "true_cfg"
    cfg_off_scale: ClassVar[float] = 1.0
    # Frames per sample: image families take 1 (the default of every request).
    max_frames: ClassVar[int] = 1
    # Video families: the frame rate (frames per second) the pipeline generates for, where it states one
    # (a pipeline that conditions on it); 0 for an image family, or a pipeline that states none.
    frame_rate: ClassVar[float] = 0.0
    # The env entries concatenated along dim 0 to batch samples (the others are shared).
    batched_env_keys: ClassVar[tuple[str, ...]]
    # How conditioning latents enter the transformer's hidden states, and the env entry holding them:
    # none for text-to-image and text-to-video.
    conditioning: ClassVar[LatentConditioning] = NO_CONDITIONING
    # Image-conditioned families (editing, image-to-video) take one conditioning image per prompt.
    takes_images: ClassVar[bool] = False
    # Whether the text encoding reads the conditioning image (a vision-language encoder): then a
    # text's env is encoded, and cached, per (text, image).
    text_reads_image: ClassVar[bool] = False
    # Whether the negative prompt has an encoding of its own (``encode_negative_text``; Cosmos3 appends
    # inverse templates to it), which the prompt cache then keys apart from the same text as a prompt.
    negative_encoded_apart: ClassVar[bool] = False
    # How ``encode_image`` turns the image into env entries, in words (the started event says it).
    image_encoding: ClassVar[str] = ""
    # Whether a sample's decode keeps state between its pieces (a causal video VAE's cache).
    decode_keeps_state: ClassVar[bool] = False
    # Whether a sample also decodes to sound (``decode_audio``), streamed as a WAV after its frames.
    decodes_audio: ClassVar[bool] = False
    # The transformer inputs that carry the generated (image or video) tokens, whose count
    # ``generated_tokens`` gives: the sequence-parallel split checks them when a request arrives.
    generated_inputs: ClassVar[tuple[str, ...]] = ("hidden_states",)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The trainer's default LoRA targets (GetServerInfo's ``lora_targets``), as the family's spec
        declares them: module names as PEFT matches them, layers of its published transformers
        (tests/families/test_real_sizes.py checks them on the real module trees)."""
        return registry.family_of(self.pipeline_type.__name__).lora_targets

    def __init__(
        self, pipe: DiffusionPipeline, device: torch.device, dtype: torch.dtype, folder: Path | None = None
    ):
        """The adapter of ``pipe``, a ``pipeline_type`` whose components are on ``device`` in ``dtype``:
        loaded from ``folder`` (``from_folder``), or assembled in memory (None)."""
        self.pipe, self.device, self.dtype, self.folder = pipe, device, dtype, folder
        self.pipe.set_progress_bar_config(disable=True)

    @classmethod
    def from_folder(cls, folder: Path, device: torch.device, dtype: torch.dtype) -> "FamilyAdapter":
        """The adapter of a local diffusers folder of this family, loaded with ``from_pretrained``."""
        return cls(cls.pipeline_type.from_pretrained(folder, dtype=dtype).to(device), device, dtype, folder)

    @property
    def source(self) -> str:
        """Where the pipeline comes from, for messages: its folder, or its class when built in memory."""
        return str(self.folder) if self.folder is not None else type(self.pipe).__name__

    @property
    def scale_fields(self) -> tuple[str, ...]:
        """The request's scale fields this model reads: its CFG scale, and ``guidance_scale`` when the
        transformer embeds guidance (guidance-distilled models)."""
        fields = {self.cfg_scale_field}
        if getattr(self.transformer.config, "guidance_embeds", False):
            fields.add("guidance_scale")
        return tuple(sorted(fields))

    def runs_cfg(self, request) -> bool:
        """Whether a resolved request runs the negative branch: its CFG scale is above the family's
        ``cfg_off_scale`` (at it, the guidance rule gives the positive branch alone)."""
        return getattr(request, self.cfg_scale_field) > self.cfg_off_scale

    @property
    def transformer(self) -> torch.nn.Module:
        """The denoising transformer (the policy; the first expert of a family with several)."""
        return self.pipe.transformer

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        """The denoising transformers by pipeline component name; one for most families."""
        return {"transformer": self.pipe.transformer}

    @property
    def boundary_ratio(self) -> float | None:
        """Models with two experts: the pipeline's own ``boundary_ratio`` (see ``expert_for``), the
        default of a request's. None for a model with one."""
        return None

    def expert_for(self, timestep: float, boundary_ratio: float | None = None) -> str:
        """The component that computes the velocity at ``timestep`` (as fed, before the divisor) under
        a request's ``boundary_ratio`` (a float32; None: the pipeline's)."""
        return "transformer"

    def cfg_scale_for(self, request, expert: str) -> float:
        """The CFG scale of a resolved request on the steps ``expert`` runs: its ``cfg_scale_field``."""
        return getattr(request, self.cfg_scale_field)

    @property
    @abstractmethod
    def side_multiple(self) -> int:
        """Height and width must be multiples of this many pixels."""

    @property
    def min_side(self) -> int:
        """Height and width must be at least this many pixels: one ``side_multiple`` unless the decoder
        needs more."""
        return self.side_multiple

    @property
    def frame_step(self) -> int:
        """Video families: ``num_frames - 1`` must be a multiple of it. 0: one frame only."""
        return 0

    @property
    def min_steps(self) -> int:
        """The fewest denoising steps the schedule is defined for: a scheduler that stretches its
        sigmas to end at ``shift_terminal`` divides by the last sigma's distance from 1, which is 0 with
        one step (every sigma would be NaN)."""
        return 2 if self.pipe.scheduler.config.get("shift_terminal") else 1

    def trainer_schedule(self, sigmas: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmas, timesteps) of a trainer's validated schedule: the sigmas as sent, float32, and the
        flow-matching timesteps sigma * num_train_timesteps."""
        values = torch.tensor(sigmas, dtype=torch.float32)
        return values, values * self.pipe.scheduler.config.get("num_train_timesteps", 1000)

    @property
    def solver(self) -> str:
        """The deterministic solver of the family's pipeline: its scheduler's step, where
        ``rollout_core.solvers`` has it with the scheduler's settings (UniPC for Wan), else Euler."""
        scheduler = self.pipe.scheduler
        return solvers.solver_of_scheduler(type(scheduler).__name__, scheduler.config)

    @abstractmethod
    def defaults(self) -> FamilyDefaults:
        """The family's usual request settings."""

    @abstractmethod
    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmas, timesteps), each T + 1 float32 values on the CPU with the terminal 0 included,
        exactly as the family's own diffusers scheduler sets them up."""

    @abstractmethod
    def latent_shape(self, shape: MediaShape) -> tuple[int, ...]:
        """One sample's latent shape as the transformer consumes it: with several latent streams, their
        joint latent's [N] (``rollout_core.latent_streams.joint_shape``)."""

    def call_form_for(self, shape: MediaShape) -> CallForm:
        """The call form of a request of ``shape``: ``call_form`` with the latent streams at it."""
        return dataclasses.replace(self.call_form, streams=self.latent_streams(shape))

    def latent_streams(self, shape: MediaShape) -> tuple["LatentStream", ...]:
        """The latent streams of one sample, in order, when it carries several (LTX-2: video, then
        audio); empty for a family with one latent tensor."""
        return ()

    @abstractmethod
    def generated_tokens(self, shape: MediaShape) -> int:
        """How many tokens of one sample the transformer's attention sees (after its patchify)."""

    @abstractmethod
    def latent_packing(self) -> str:
        """A readable description of how latents are packed."""

    @abstractmethod
    def encode_text(
        self, text: str, guidance_scale: float, shape: MediaShape, image: Image.Image | None = None
    ) -> dict[str, Any]:
        """The frozen env of one text (a prompt, or the negative prompt: both take the same path),
        encoded as a batch of one: every ``forward()`` keyword argument besides ``hidden_states`` and
        ``timestep``, those named in ``batched_env_keys`` with a leading batch dimension of 1. ``image``
        (the prompt's conditioning image, as ``encode_image`` gets it) is given only to a family whose
        ``text_reads_image``."""

    def encode_negative_text(
        self, text: str, guidance_scale: float, shape: MediaShape, image: Image.Image | None = None
    ) -> dict[str, Any]:
        """The env of the negative prompt: ``encode_text``'s, unless ``negative_encoded_apart``."""
        return self.encode_text(text, guidance_scale, shape, image)

    def encode_image(self, image: Image.Image, shape: MediaShape) -> dict[str, Any]:
        """The env entries of one conditioning image, an RGB image of exactly ``shape``'s width x
        height: the conditioning latents under ``conditioning.env_key`` (batch dimension 1) and what
        else the transformer reads of the image (position ids, image embeddings). They are merged over
        the text's env (``encode_text``), for every branch."""
        raise NotImplementedError(f"{type(self).__name__} takes no conditioning image")

    def encode_image_latents(self, image: Image.Image, shape: MediaShape) -> dict[str, Any]:
        """The entries of ``encode_image`` that the VAE makes of the image, the work that grows with
        it (the memory estimate measures it): all of them unless the family also reads the image
        through an encoder of a fixed input size."""
        return self.encode_image(image, shape)

    def conditioning_tokens(self, shape: MediaShape) -> int:
        """Tokens the conditioning adds to the generated ones on the sequence axis (the split axis):
        0 unless conditioning is concatenated on the sequence."""
        return 0

    @abstractmethod
    def text_elements(self) -> int:
        """Elements of one text's batched env tensors at their longest (the text states and pooled
        projections): what the env of a prompt holds, and what each row adds to a forward."""

    @abstractmethod
    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        """(tokens, width) of one transformer row's forward at ``shape``: the tokens its blocks run
        over (image and text, for joint attention), and the widest per-token activation in elements
        (the feed-forward's hidden width, or a fused projection's)."""

    def attention_matrix_bytes(self, shape: MediaShape) -> int:
        """The bytes one transformer row's forward at ``shape`` holds at once in tensors that grow with
        the square of a sequence: an attention mask materialised query by key, SDPA's float copy of a
        boolean one, the scores of SDPA's math kernel (the CPU's for a mask its flash kernel cannot
        broadcast). 0 where every attention runs in a fused kernel with at most a key mask, as the CPU's
        flash kernel runs every family's but the masks these methods count."""
        return 0

    def decode_attention_bytes(self, shape: MediaShape) -> int:
        """The bytes one decode piece at ``shape`` holds at once in tensors that grow with the square of
        its latent tokens (``attention_matrix_bytes`` for the decoder): 0 where the decoder attends
        within a frame's tokens, without a mask, in a fused kernel."""
        return 0

    def audio_values(self, shape: MediaShape) -> int:
        """The values of one sample's decoded waveform at ``shape`` (channels x samples), which the
        memory estimate sizes its sound decode by: 0 without sound (families with ``decodes_audio``)."""
        return 0

    def measure_vae(self) -> VaeProfile:
        """What the VAE's work holds, measured on a small probe (``LiveTensorBytes``), per pixel: the
        tensors of a piece of any size follow its channel widths at each resolution. On a CPU a piece
        takes what glibc's heap keeps for it, each size's most blocks alive at once (``segregated``),
        with its convolutions' scratch; elsewhere the most bytes alive at once. A video probe has two
        latent frames: a decoder that yields both in one piece decodes a whole sample at once. A family
        with sound measures its sound decode on the same probe, per value of the waveform; an
        image-conditioned family its conditioning image's encode (a video family's also at a latent
        frame more: what each frame more adds)."""
        side = 2 * self.side_multiple
        shape = MediaShape(1 + self.frame_step, side, side)
        latents = torch.zeros(1, *self.latent_shape(shape), device=self.device)
        piece_bytes = 0.0
        frames_per_piece = 0
        kept = []  # after each piece, per pixel of it
        with self._counting([self.pipe.vae]) as tensors:
            tensors.start_piece()
            for piece in self.decode_pixels(latents, shape):
                pixels = piece.numel() // 3  # RGB
                piece_bytes = max(piece_bytes, self._held(tensors) / pixels)
                frames_per_piece = max(frames_per_piece, pixels // (side * side))
                kept.append((tensors.live - piece.untyped_storage().nbytes()) / pixels)
                del piece
                tensors.start_piece()
        # What the decode holds besides a piece it yielded, until its next piece (none after the last).
        kept_bytes = max(kept[:-1], default=0.0)
        whole_sample = len(kept) == 1 and shape.frames > 1
        profile = VaeProfile(piece_bytes, kept_bytes, frames_per_piece, whole_sample)
        if self.decodes_audio:
            profile = dataclasses.replace(profile, sound_bytes=self._measure_sound(latents, shape))
        if self.takes_images:
            profile = dataclasses.replace(profile, **self._measure_encode(side))
        return profile

    def _held(self, tensors: LiveTensorBytes) -> int:
        """What the tensors that ``tensors`` counted take in this device's memory: on a CPU, glibc's
        heap (``segregated``); elsewhere the most bytes alive at once."""
        return tensors.segregated if self.device.type == "cpu" else tensors.peak

    @contextlib.contextmanager
    def _counting(self, components: list[torch.nn.Module]) -> Iterator[LiveTensorBytes]:
        """A LiveTensorBytes over the work run in it (without gradients), told on a CPU of the scratch
        of the convolutions among ``components``' modules."""
        tensors = LiveTensorBytes()

        def scratch(module, inputs, output) -> None:
            tensors.scratch(convolution_scratch(module, output, inputs[0]))

        convolutions = [m for c in components for m in c.modules() if isinstance(m, CONVOLUTIONS)]
        handles = [m.register_forward_hook(scratch) for m in convolutions if self.device.type == "cpu"]
        try:
            with torch.no_grad(), tensors:
                yield tensors
        finally:
            for handle in handles:
                handle.remove()

    def _measure_sound(self, latents: torch.Tensor, shape: MediaShape) -> float:
        """The sound decode's bytes (the modules of every pipeline component it runs: an audio VAE, a
        vocoder) per value of the waveform it decodes."""
        components = [c for c in self.pipe.components.values() if isinstance(c, torch.nn.Module)]
        with self._counting(components) as tensors:
            sound = self.decode_audio(latents, shape)
        return self._held(tensors) / sound.waveform.numel()

    def _measure_encode(self, side: int) -> dict[str, float | int]:
        """The ``VaeProfile`` fields of the conditioning image's encode (``encode_image_latents``) of a
        black ``side`` x ``side`` image: at the probe's frames, and for video at a latent frame more."""
        image = Image.new("RGB", (side, side))
        frames = [1 + self.frame_step, 1 + 2 * self.frame_step] if self.frame_step else [1]
        held = []
        for count in frames:
            with self._counting([self.pipe.vae]) as tensors:
                self.encode_image_latents(image, MediaShape(count, side, side))
            held.append(self._held(tensors) / side**2)
        more = max(0.0, (held[-1] - held[0]) / self.frame_step) if self.frame_step else 0.0
        return {"encode_bytes": held[0], "encode_frame_bytes": more, "encode_frames": frames[0]}

    @abstractmethod
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        """Decode one sample's final latents [1, ...] into its RGB pixels in [-1, 1], in order, a piece
        at a time: an image family yields its one image [1, 3, H, W] once; a video family yields
        consecutive chunks of frames [1, 3, frames, H, W], as small as its VAE decodes them. The
        caller may stop between pieces."""

    def decode_audio(self, latents: torch.Tensor, shape: MediaShape) -> Sound:
        """The sound of one sample's final latents [1, ...], as the pipeline decodes it (families with
        ``decodes_audio``)."""
        raise NotImplementedError(f"{type(self).__name__} generates no sound")

    def sound_format(self) -> tuple[int, int]:
        """(samples per second, channels) of the sound ``decode_audio`` gives (families with
        ``decodes_audio``)."""
        raise NotImplementedError(f"{type(self).__name__} generates no sound")

    def frames_of(self, piece: torch.Tensor) -> list[Image.Image]:
        """A decoded piece's frames as images, the pipeline's own postprocessing."""
        return self.pipe.image_processor.postprocess(piece, output_type="pil")

    def decode_frames(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[list[Image.Image]]:
        """``decode_pixels``, each piece as its frames' images."""
        for piece in self.decode_pixels(latents, shape):
            yield self.frames_of(piece)


class PackedLatentAdapter(FamilyAdapter):
    """Families whose pipeline packs 2x2 latent patches into tokens and shifts linspace sigmas by the
    image token count (FLUX.1's and Qwen-Image's pipelines)."""

    @property
    def side_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2

    def _latent_grid(self, shape: MediaShape) -> tuple[int, int]:
        return shape.height // self.side_multiple, shape.width // self.side_multiple

    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = self._latent_grid(shape)
        mu = resolution_shift(self.pipe.scheduler.config, rows * cols)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        return set_up_schedule(self.pipe.scheduler, num_steps, sigmas=sigmas, mu=mu)

    def latent_shape(self, shape: MediaShape) -> tuple[int, ...]:
        rows, cols = self._latent_grid(shape)
        return (rows * cols, self.pipe.transformer.config.in_channels)

    def generated_tokens(self, shape: MediaShape) -> int:
        return self.latent_shape(shape)[0]  # the latents are packed into tokens already


def resolution_shift(scheduler_config, image_seq_len: int, max_shift_default: float = 1.15) -> float:
    """The resolution-dependent shift ``mu`` of the dynamic-shift pipelines, from the scheduler config."""
    return calculate_shift(
        image_seq_len,
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", max_shift_default),
    )


def set_up_schedule(scheduler, num_steps: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipelines' own ``retrieve_timesteps`` on a private copy of the scheduler (set_timesteps
    mutates it, and requests may overlap): T + 1 float32 sigmas and timesteps, terminal 0 included."""
    scheduler = copy.deepcopy(scheduler)
    retrieve_timesteps(scheduler, num_steps, "cpu", **kwargs)
    timesteps = torch.cat([scheduler.timesteps.float().cpu(), torch.zeros(1)])
    return scheduler.sigmas.to(torch.float32).cpu(), timesteps


def unscaled(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents in the VAE's dtype, from the scaled and shifted space FLUX.1's, SD3's and Z-Image's
    pipelines sample in (``scaling_factor`` and ``shift_factor`` of the VAE config)."""
    return latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor


def denormalized(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, F, H, W] in the VAE's dtype, from the per-channel normalised space Wan's and
    Qwen-Image's pipelines sample in (``latents_mean`` and ``latents_std`` of the VAE config)."""
    latents = latents.to(vae.dtype)

    def stats(values) -> torch.Tensor:
        return torch.tensor(values).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)

    # As the pipelines compute it: divided by the inverse of the std.
    return latents / (1.0 / stats(vae.config.latents_std)) + stats(vae.config.latents_mean)
