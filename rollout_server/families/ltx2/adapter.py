"""LTX-2 text-to-video with sound (``LTX2Pipeline``): a video and an audio latent denoised together by one
audio-visual transformer, the Gemma 3 prompt encoding through the pipeline's text connectors, and
the sound decoded through the audio VAE and the vocoder.

A sample carries two latent streams (``rollout_core.latent_streams``), in this order:

- ``video``: the pipeline's packed video tokens ``[F' H' W', C]`` (F' = (F - 1) / 8 + 1, H' = H / 32,
  W' = W / 32; the transformer's patch size is 1), fed as ``hidden_states``;
- ``audio``: the pipeline's packed audio tokens ``[L, C_a M']``, L = round(F / fps x sample_rate / hop
  / 4) latent audio frames of M' = mel_bins / 4 bins, fed as ``audio_hidden_states``.

The sampler steps their joint latent, each stream draws its own noise from the sample's seed, and a
step's log-prob is the mean over all elements of both (with each stream's own beside it). The
transformer is called exactly as ``LTX2Pipeline.__call__`` does, with the raw timestep (sigma x 1000,
float32, as the pipeline passes it) as ``timestep`` and as ``sigma``, and the env:

- ``encoder_hidden_states`` / ``audio_encoder_hidden_states`` / ``encoder_attention_mask`` /
  ``audio_encoder_attention_mask``: the text connectors' video and audio embeddings and their mask, of
  the Gemma 3 hidden states (every layer, stacked) of one text padded on the left to the pipeline's
  ``max_sequence_length`` (1024). The connectors fill the padding with their learned registers and the
  mask is all ones, an additive 0 on every attention score: it is sent as None (the same numbers but
  for the attention kernel's rounding), which context parallelism needs (below);
- ``video_coords`` / ``audio_coords``: the rotary positions the pipeline prepares once (at its
  ``frame_rate``, 24 fps);
- ``num_frames``, ``height``, ``width``, ``fps``, ``audio_num_frames``, ``isolate_modalities``
  (False), ``spatio_temporal_guidance_blocks`` and ``perturbation_mask`` (None), ``use_cross_timestep``
  (True, the pipeline's default), ``attention_kwargs`` (None) and ``return_dict`` (False).

Guidance: classifier-free guidance on ``guidance_scale`` for both streams, off at 1: the pipeline
called with ``audio_guidance_scale=None``, which then follows ``guidance_scale`` (its own default for
the audio is 7, the video's 3; the server has one scale). The pipeline combines the branches in x0 space,
x0 = x - sigma v: x0_pos + (s - 1)(x0_pos - x0_neg), which is v_neg + s (v_pos - v_neg) (``true_cfg``)
in exact arithmetic; the server combines the velocities in float32. Its other guidance terms, each a
further forward per step (spatio-temporal guidance through a perturbed block, modality isolation
without the cross-modal attention) and its rescale, are not served: a rollout is the pipeline called
with ``stg_scale=0``, ``modality_scale=1``, ``guidance_rescale=0`` and their audio twins None (which
then follow them; their defaults, 1, 3 and 0.7, would turn them on for the audio alone).

The schedule is the pipeline's: linspace(1, 1/N, N) shifted by ``mu`` of the video token count
(``base_image_seq_len`` 1024 .. ``max_image_seq_len`` 4096, shifts 0.95 .. 2.05 unless the scheduler
config says otherwise), the same for both streams. The decode is the pipeline's: the video unpacked,
denormalised and decoded at timestep 0 (its ``decode_timestep``, with no decode noise); the audio
denormalised, unpacked, decoded to a mel spectrogram by the audio VAE and to a waveform by the vocoder
at its ``output_sampling_rate``.

Sequence parallelism: diffusers' context-parallel plan for ``LTX2VideoTransformer3DModel`` splits the
video tokens, the text tokens and the video's rotary embeddings as the "interleaved" RoPE lays them
out ([B, T, D]), and misses the video's cross-modal rotary embeddings (``cross_attn_rope``), which the
audio-video attention reads per video token too. The adapter gives the transformer a plan of its own
(``context_parallel_plan``) that splits both RoPEs' outputs along their token axis in either layout
("split" RoPE, LTX-2.0's: [B, heads, T, D / 2]). diffusers views a text attention mask per head,
which Ulysses splits: only the all-ones mask the connectors give (sent as None) splits. The audio
stream is not split: every rank holds all
its tokens, and where Ulysses gathers them with the video's (the audio's own attention, the
cross-modal ones) each rank's copy arrives once per rank, so every key appears as many times with its
value, which leaves each softmax-weighted mean as it is, but for rounding.
"""

import math
from collections.abc import Iterator

import numpy as np
import torch
from diffusers import LTX2Pipeline
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift
from PIL import Image

from rollout_core import latent_streams
from rollout_core.latent_streams import LatentStream
from rollout_core.transformer_call import CallForm
from rollout_server.families.base import FamilyAdapter, FamilyDefaults, MediaShape, Sound, set_up_schedule

# LTX2Pipeline.__call__'s defaults.
DEFAULT_FRAMES = 121
FRAME_RATE = 24.0
MAX_SEQUENCE_LENGTH = 1024
# The shift of its schedule, where the scheduler config does not set it (the pipeline's fallbacks).
SHIFT_DEFAULTS = {
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "base_shift": 0.95,
    "max_shift": 2.05,
}


def context_parallel_plan(transformer: torch.nn.Module) -> dict:
    """A diffusers context-parallel plan for ``LTX2VideoTransformer3DModel`` (see the module docstring):
    its own plan's inputs and output, with the video RoPE and the video's cross-modal RoPE split along
    their token axis in the layout of the transformer's ``rope_type``."""
    split_rope = transformer.config.rope_type == "split"  # [B, heads, T, D / 2], else [B, T, D]
    rope = ContextParallelInput(
        split_dim=2 if split_rope else 1, expected_dims=4 if split_rope else 3, split_output=True
    )
    return {
        "": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_attention_mask": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
        },
        "rope": {0: rope, 1: rope},
        "cross_attn_rope": {0: rope, 1: rope},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


class LTX2Adapter(FamilyAdapter):
    family = "ltx2"
    pipeline_type = LTX2Pipeline
    timestep_divisor = 1.0
    timestep_rule = "timestep (float32), also fed as sigma"
    call_form = CallForm(timestep_float32=True, timestep_copies=("sigma",))
    cfg_scale_field = "guidance_scale"
    cfg_rule = "true_cfg"
    batched_env_keys = (
        "encoder_hidden_states",
        "audio_encoder_hidden_states",
        "encoder_attention_mask",
        "audio_encoder_attention_mask",
        "video_coords",
        "audio_coords",
    )
    decodes_audio = True
    max_frames = 2 * DEFAULT_FRAMES - 1  # about twice the default (8k + 1) bounds one request's work
    frame_rate = FRAME_RATE

    def __init__(self, pipe, device, dtype, folder=None):
        super().__init__(pipe, device, dtype, folder)
        self.pipe.transformer._cp_plan = context_parallel_plan(self.pipe.transformer)

    @property
    def side_multiple(self) -> int:
        return self.pipe.vae_spatial_compression_ratio * self.pipe.transformer_spatial_patch_size

    @property
    def min_side(self) -> int:
        # The video decoder's reflect padding needs at least 2 x 2 latents.
        return 2 * self.side_multiple

    @property
    def frame_step(self) -> int:
        return self.pipe.vae_temporal_compression_ratio

    def defaults(self) -> FamilyDefaults:
        # LTX2Pipeline.__call__'s: 512 x 768, 121 frames, 30 steps, CFG 3.
        return FamilyDefaults(
            height=512,
            width=768,
            frames=DEFAULT_FRAMES,
            num_steps=30,
            guidance_scale=3.0,
            true_cfg_scale=1.0,
            noise_level=0.7,
        )

    def _video_grid(self, shape: MediaShape) -> tuple[int, int, int]:
        """Latent frames, rows and columns of the video."""
        spatial = self.pipe.vae_spatial_compression_ratio
        frames = (shape.frames - 1) // self.pipe.vae_temporal_compression_ratio + 1
        return frames, shape.height // spatial, shape.width // spatial

    def _audio_frames(self, shape: MediaShape) -> int:
        """Latent audio frames of a video of ``shape.frames`` frames, as the pipeline counts them."""
        pipe = self.pipe
        compression = pipe.audio_vae_temporal_compression_ratio
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(compression)
        return round(shape.frames / FRAME_RATE * per_second)

    def _mel_bins(self) -> int:
        return self.pipe.audio_vae.config.mel_bins // self.pipe.audio_vae_mel_compression_ratio

    def audio_values(self, shape: MediaShape) -> int:
        # The audio VAE decodes L latent frames to 4L mel frames, less the 3 of its causal padding
        # (AutoencoderKLLTX2Audio's decoder), and the vocoder's transposed convolutions multiply them by
        # their strides (each pads (kernel - stride) / 2 a side, an even number for LTX-2's).
        audio_vae, vocoder = self.pipe.audio_vae, self.pipe.vocoder.config
        compression = self.pipe.audio_vae_temporal_compression_ratio
        mel_frames = self._audio_frames(shape) * compression
        if audio_vae.config.causality_axis is not None:
            mel_frames = max(mel_frames - (compression - 1), 1)
        return vocoder.out_channels * mel_frames * math.prod(vocoder.upsample_factors)

    def latent_streams(self, shape: MediaShape) -> tuple[LatentStream, ...]:
        pipe = self.pipe
        patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        frames, rows, cols = self._video_grid(shape)
        video_tokens = (frames // patch_t) * (rows // patch) * (cols // patch)
        video_width = pipe.transformer.config.in_channels
        audio_width = pipe.audio_vae.config.latent_channels * self._mel_bins()
        return (
            LatentStream("video", (video_tokens, video_width), "hidden_states"),
            LatentStream("audio", (self._audio_frames(shape), audio_width), "audio_hidden_states"),
        )

    def latent_shape(self, shape: MediaShape) -> tuple[int, ...]:
        return latent_streams.joint_shape(self.latent_streams(shape))

    def generated_tokens(self, shape: MediaShape) -> int:
        return self.latent_streams(shape)[0].shape[0]  # the video tokens, which --sp splits

    def latent_packing(self) -> str:
        return (
            "joint video + audio: video tokens [(F-1)/8 + 1) (H/32) (W/32), C] then audio tokens "
            "[L, C_a (mel_bins/4)], each flattened (transformer_call.streams)"
        )

    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        config = {**SHIFT_DEFAULTS, **self.pipe.scheduler.config}
        mu = calculate_shift(
            self.generated_tokens(shape),
            config["base_image_seq_len"],
            config["max_image_seq_len"],
            config["base_shift"],
            config["max_shift"],
        )
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        return set_up_schedule(self.pipe.scheduler, num_steps, sigmas=sigmas, mu=mu)

    def text_elements(self) -> int:
        config = self.pipe.connectors.config
        video = config.video_connector_num_attention_heads * config.video_connector_attention_head_dim
        audio = config.audio_connector_num_attention_heads * config.audio_connector_attention_head_dim
        return MAX_SEQUENCE_LENGTH * (video + audio + 1)  # the embeddings and their one mask

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # Video and audio tokens each attend to themselves, to the text and to each other; the video
        # feed-forward (4x) is the widest.
        config = self.pipe.transformer.config
        inner = config.num_attention_heads * config.attention_head_dim
        video, audio = self.latent_streams(shape)
        return video.shape[0] + audio.shape[0], 4 * inner

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # guidance_scale is the CFG scale, applied when the branches are combined.
        pipe = self.pipe
        embeds, mask = pipe._get_gemma_prompt_embeds(
            prompt=text, max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.device
        )
        video_embeds, audio_embeds, connector_mask = pipe.connectors(
            embeds, mask, padding_side=pipe.tokenizer.padding_side
        )
        # The connectors fill a text's padding with their learned registers and give an all-ones mask,
        # which adds exactly 0 to every attention score: it is passed as None, the same numbers but for
        # the attention kernel's rounding. Under --sp it must be: diffusers views the mask per head,
        # and Ulysses gives each rank a part of the heads.
        mask = None if bool(connector_mask.all()) else connector_mask
        frames, rows, cols = self._video_grid(shape)
        audio_frames = self._audio_frames(shape)
        rope, audio_rope = pipe.transformer.rope, pipe.transformer.audio_rope
        return {
            "encoder_hidden_states": video_embeds,
            "audio_encoder_hidden_states": audio_embeds,
            "encoder_attention_mask": mask,
            "audio_encoder_attention_mask": mask,
            "video_coords": rope.prepare_video_coords(1, frames, rows, cols, self.device, fps=FRAME_RATE),
            "audio_coords": audio_rope.prepare_audio_coords(1, audio_frames, self.device),
            "num_frames": frames,
            "height": rows,
            "width": cols,
            "fps": FRAME_RATE,
            "audio_num_frames": audio_frames,
            "isolate_modalities": False,
            "spatio_temporal_guidance_blocks": None,
            "perturbation_mask": None,
            "use_cross_timestep": True,
            "attention_kwargs": None,
            "return_dict": False,
        }

    def _streams_of(self, latents: torch.Tensor, shape: MediaShape) -> list[torch.Tensor]:
        return latent_streams.split(latents, self.latent_streams(shape))

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        pipe, vae = self.pipe, self.pipe.vae
        video = self._streams_of(latents, shape)[0]
        frames, rows, cols = self._video_grid(shape)
        video = pipe._unpack_latents(
            video.to(pipe.transformer.dtype),
            frames,
            rows,
            cols,
            pipe.transformer_spatial_patch_size,
            pipe.transformer_temporal_patch_size,
        )
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        # The pipeline's decode_timestep (0) with its decode noise scale (0): the latents as they are.
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(1, device=self.device, dtype=video.dtype)
        pixels = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]
        yield torch.clamp(pixels, min=-1.0, max=1.0)  # the postprocessing clamps [0, 1] after x / 2 + 1/2

    def frames_of(self, piece: torch.Tensor) -> list[Image.Image]:
        return self.pipe.video_processor.postprocess_video(piece, output_type="pil")[0]

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor, shape: MediaShape) -> Sound:
        pipe, audio_vae = self.pipe, self.pipe.audio_vae
        audio = self._streams_of(latents, shape)[1]
        audio = pipe._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, self._audio_frames(shape), num_mel_bins=self._mel_bins())
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        waveform = pipe.vocoder(mel)[0].float()
        # On the host for the WAV; a pipeline on the meta device (sized, not run) keeps it there.
        waveform = waveform if waveform.is_meta else waveform.cpu()
        return Sound(waveform, int(pipe.vocoder.config.output_sampling_rate))

    def sound_format(self) -> tuple[int, int]:
        return int(self.pipe.vocoder.config.output_sampling_rate), self.pipe.vocoder.config.out_channels
