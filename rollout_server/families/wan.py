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
expert), the later ones ``transformer_2``. The started event names each step's expert, and weight
updates name the expert they change. Its second guidance scale (``guidance_scale_2``) is not
exposed: both experts take the request's ``guidance_scale``, as the pipeline does by default.
"""

import torch
from diffusers import WanPipeline
from PIL import Image

from rollout_server.families.base import (
    FamilyAdapter,
    FamilyDefaults,
    MediaShape,
    UnsupportedModel,
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
    max_frames = 161  # Wan 2.1 generates 81; twice that bounds the work of one request

    def __init__(self, folder, device, dtype):
        super().__init__(folder, device, dtype)
        two_experts = self.pipe.transformer_2 is not None
        if two_experts != (self.pipe.config.boundary_ratio is not None):
            raise UnsupportedModel(f"{folder}: transformer_2 and boundary_ratio come together or not at all")
        if self.pipe.transformer is None:
            raise UnsupportedModel(f"{folder}: a Wan pipeline without its (high-noise) transformer")

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        experts = {"transformer": self.pipe.transformer}
        if self.pipe.transformer_2 is not None:
            experts["transformer_2"] = self.pipe.transformer_2
        return experts

    def expert_for(self, timestep: float) -> str:
        ratio = self.pipe.config.boundary_ratio
        if ratio is None or timestep >= ratio * self.pipe.scheduler.config.num_train_timesteps:
            return "transformer"
        return "transformer_2"

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
        channels = self.pipe.transformer.config.in_channels
        return (channels, latent_frames, shape.height // spatial, shape.width // spatial)

    def generated_tokens(self, shape: MediaShape) -> int:
        _, frames, rows, cols = self.latent_shape(shape)
        t, h, w = self.pipe.transformer.config.patch_size
        return (frames // t) * (rows // h) * (cols // w)

    def latent_packing(self) -> str:
        return "video: [vae_z_dim, (F - 1)/4 + 1, H/8, W/8] (the transformer patchifies 1x2x2 itself)"

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape) -> dict:
        embeds, _ = self.pipe.encode_prompt(
            prompt=text,
            do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            device=self.device,
            dtype=self.dtype,
        )
        return {"encoder_hidden_states": embeds, "attention_kwargs": None, "return_dict": False}

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: MediaShape) -> list[list[Image.Image]]:
        vae = self.pipe.vae
        stats_shape = (1, vae.config.z_dim, 1, 1, 1)
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(stats_shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(stats_shape).to(
            latents.device, latents.dtype
        )
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="pil")
