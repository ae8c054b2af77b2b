"""Wan 2.1 / 2.2 text-to-video (``WanPipeline``): video latents, UMT5 conditioning, classic CFG,
UniPC's shifted flow sigmas, and Wan 2.2's two experts.

The transformer is called exactly as ``WanPipeline.__call__`` does, with the raw timestep (the
scheduler's integer timesteps, 0..999), and its kwargs (the env) are ``encoder_hidden_states`` (the
UMT5 states of the prompt's own tokens, zero-padded to 512 as the pipeline pads them),
``attention_kwargs`` and ``return_dict``. CFG is classic, on ``guidance_scale``: the negative branch
encodes the request's ``negative_prompt``, and an empty one when none is given, as the pipeline does.
Latents are ``[C, F', H/8, W/8]`` with F' = (F - 1) / 4 + 1 latent frames, as the transformer
consumes them (it patchifies 1x2x2 itself).

Wan 2.2 (a folder with ``transformer_2`` and a ``boundary_ratio``): as in the pipeline, a step whose
timestep is at least ``boundary_ratio * num_train_timesteps`` runs ``transformer`` (the high-noise
expert), the later ones ``transformer_2``; a request may set its own ``boundary_ratio``. The CFG
scale of ``transformer``'s steps is ``guidance_scale``, that of ``transformer_2``'s
``guidance_scale_2`` (``guidance_scale`` when unset, as the pipeline defaults it); CFG runs when
``guidance_scale`` is above 1, on both experts' steps alike. The started event names each step's
expert and scale, and weight updates name the expert they change.
"""

from collections.abc import Iterator

import numpy as np
import torch
from diffusers import WanPipeline
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify
from PIL import Image

from rollout_server.errors import UnsupportedModel
from rollout_server.families.base import (
    FamilyAdapter,
    FamilyDefaults,
    MediaShape,
    denormalized,
    set_up_schedule,
)

MAX_SEQUENCE_LENGTH = 512


class WanAdapter(FamilyAdapter):
    family = "wan"
    pipeline_type = WanPipeline
    timestep_divisor = 1.0
    timestep_rule = "timestep"
    cfg_scale_field = "guidance_scale"
    cfg_rule = "true_cfg"
    batched_env_keys = ("encoder_hidden_states",)
    decode_keeps_state = True  # the causal convolutions' cache, between latent frames
    max_frames = 161  # Wan 2.1 generates 81; twice that bounds the work of one request

    def __init__(self, pipe, device, dtype, folder=None):
        super().__init__(pipe, device, dtype, folder)
        two_experts = self.pipe.transformer_2 is not None
        if two_experts != (self.pipe.config.boundary_ratio is not None):
            raise UnsupportedModel(
                f"{self.source}: transformer_2 and boundary_ratio come together or not at all"
            )
        if self.pipe.transformer is None:
            raise UnsupportedModel(f"{self.source}: a Wan pipeline without its (high-noise) transformer")

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        experts = {"transformer": self.pipe.transformer}
        if self.pipe.transformer_2 is not None:
            experts["transformer_2"] = self.pipe.transformer_2
        return experts

    @property
    def boundary_ratio(self) -> float | None:
        return self.pipe.config.boundary_ratio

    def expert_for(self, timestep: float, boundary_ratio: float | None = None) -> str:
        ratio = self.boundary_ratio
        if ratio is None:
            return "transformer"
        if boundary_ratio is not None:
            # A request's float32, read as the shortest decimal that rounds to it (0.3, not
            # 0.30000001) as the pipeline reads its config's, so a timestep on the boundary takes the
            # pipeline's expert.
            ratio = float(str(np.float32(boundary_ratio)))
        if timestep >= ratio * self.pipe.scheduler.config.num_train_timesteps:
            return "transformer"
        return "transformer_2"

    def cfg_scale_for(self, request, expert: str) -> float:
        return request.guidance_scale_2 if expert == "transformer_2" else request.guidance_scale

    @property
    def side_multiple(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size[1]

    @property
    def frame_step(self) -> int:
        return self.pipe.vae_scale_factor_temporal

    def defaults(self) -> FamilyDefaults:
        # Wan2.1-T2V's usual settings: 480 x 832, 81 frames, 50 steps, CFG 5.
        return FamilyDefaults(
            height=480,
            width=832,
            frames=81,
            num_steps=50,
            guidance_scale=5.0,
            true_cfg_scale=1.0,
            noise_level=0.7,
        )

    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        # WanPipeline calls set_timesteps(num_steps) on its UniPC scheduler: shifted flow sigmas, and
        # the integer timesteps the transformer receives.
        return set_up_schedule(self.pipe.scheduler, num_steps)

    def latent_shape(self, shape: MediaShape) -> tuple[int, ...]:
        spatial = self.pipe.vae_scale_factor_spatial
        latent_frames = (shape.frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        channels = self.pipe.vae.config.z_dim  # an image-to-video transformer reads more channels
        return (channels, latent_frames, shape.height // spatial, shape.width // spatial)

    def generated_tokens(self, shape: MediaShape) -> int:
        _, frames, rows, cols = self.latent_shape(shape)
        t, h, w = self.pipe.transformer.config.patch_size
        return (frames // t) * (rows // h) * (cols // w)

    def latent_packing(self) -> str:
        return "video: [vae_z_dim, (F - 1)/4 + 1, H/8, W/8] (the transformer patchifies 1x2x2 itself)"

    def text_elements(self) -> int:
        return MAX_SEQUENCE_LENGTH * self.pipe.transformer.config.text_dim

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # Self-attention over the video tokens (1x2x2 patches; the text enters by cross-attention),
        # with separate q, k and v projections, and the feed-forward's ffn_dim.
        channels, frames, rows, cols = self.latent_shape(shape)
        config = self.pipe.transformer.config
        _, patch_rows, patch_cols = config.patch_size
        inner = config.num_attention_heads * config.attention_head_dim
        return frames * (rows // patch_rows) * (cols // patch_cols), max(config.ffn_dim, 3 * inner)

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # WanPipeline's encoding, also for its image-to-video twin: the same code, except that the
        # twin's requires ftfy to clean the text, which this one applies when it is installed.
        embeds = WanPipeline._get_t5_prompt_embeds(
            self.pipe,
            prompt=text,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            device=self.device,
            dtype=self.dtype,
        )
        return {"encoder_hidden_states": embeds, "attention_kwargs": None, "return_dict": False}

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        yield from wan_vae_frames(self.pipe.vae, latents)

    def frames_of(self, piece: torch.Tensor) -> list[Image.Image]:
        return self.pipe.video_processor.postprocess_video(piece, output_type="pil")[0]


def wan_vae_frames(vae, latents: torch.Tensor) -> Iterator[torch.Tensor]:
    """Normalised latents [1, C, F', H', W'] decoded by ``AutoencoderKLWan.decode``'s own loop, one
    latent frame at a time (the first gives one frame, each later one ``scale_factor_temporal`` frames),
    with the causal convolutions' cache kept between pieces: the same numbers, without holding the
    whole video. The VAEs of Wan 2.1 and of Wan 2.2 (patchified, residual: Cosmos3's) alike."""
    x = vae.post_quant_conv(denormalized(vae, latents))
    cache = [None] * sum(isinstance(module, WanCausalConv3d) for module in vae.decoder.modules())
    for i in range(x.shape[2]):
        frames = vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
        if vae.config.patch_size is not None:
            frames = unpatchify(frames, patch_size=vae.config.patch_size)
        yield torch.clamp(frames, min=-1.0, max=1.0)
