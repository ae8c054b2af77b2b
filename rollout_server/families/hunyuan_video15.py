"""HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``): video latents, two text encoders
(Qwen2.5-VL and ByT5), the conditioning channels of zeros the pipeline concatenates, and its CFG
guider.

The transformer is called exactly as ``HunyuanVideo15Pipeline.__call__`` does:
``transformer(hidden_states=cat([x, condition], dim=1), timestep=t, ...)`` with the raw timestep
(sigma x 1000, cast to the transformer's dtype) and the env entries as keyword arguments:

- ``encoder_hidden_states`` / ``encoder_attention_mask``: what ``encode_prompt`` gives one text from
  the Qwen2.5-VL text model: the chat template with the pipeline's system message, padded to
  108 + 1000 tokens, the hidden states 2 layers before the last, the first 108 tokens (the system
  turn) cropped; the mask in the transformer's dtype, as the pipeline casts it;
- ``encoder_hidden_states_2`` / ``encoder_attention_mask_2``: the ByT5 states of the text's quoted
  (glyph) text, padded to 256 bytes; zeros and a zero mask when it quotes nothing;
- ``image_embeds``: zeros [1, 729, image_embed_dim], which the transformer reads as "no image";
- ``condition``: zeros [1, C + 1, F', H', W'], the conditioning latents and their mask the pipeline
  concatenates to x on the channel axis for text-to-video (``prepare_cond_latents_and_mask``);
- ``attention_kwargs`` (None) and ``return_dict`` (False).

The prediction is x's C channels (the transformer's ``out_channels``). The negative prompt (empty by
default) takes the same encoding. CFG is the pipeline's ``guider`` (``ClassifierFreeGuidance``), its
scale taken from the request's ``guidance_scale`` (default: the guider's): v_neg + s (v_pos - v_neg)
(``true_cfg``, off at s <= 1), or with the guider's ``use_original_formulation``
v_pos + s (v_pos - v_neg) (``cfg_from_positive``, off at s <= 0). A guider that rescales
(``guidance_rescale``), guides only a window of the steps (``start`` / ``stop``) or is disabled is
refused.

The schedule is the pipeline's: sigmas linspace(1, 0, N + 1)[:-1] through ``retrieve_timesteps``,
which the scheduler shifts by its static ``shift``. Latents are [C, (F - 1) / 4 + 1, H / 16, W / 16]
as the transformer consumes them (it patchifies 1 x 1 x 1 itself). The pipeline keeps them in the
transformer's dtype (bfloat16 for the released checkpoints), rounding after every step, as
``latent_dtype`` BFLOAT16 does; it also combines the CFG branches in that dtype, the server in
float32. The decode is the pipeline's, ``vae.decode(latents / scaling_factor)``, a whole video at once.

Sequence parallelism: ``HunyuanVideo15Transformer3DModel`` has no context-parallel plan in diffusers
0.41 and this adapter gives it none, so ``--sp`` is refused at start-up.
"""

import inspect
from collections.abc import Iterator

import numpy as np
import torch
from diffusers import HunyuanVideo15Pipeline
from PIL import Image

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import LatentConditioning
from rollout_server.errors import UnsupportedModel
from rollout_server.families.base import FamilyAdapter, FamilyDefaults, MediaShape, set_up_schedule

# HunyuanVideo15Pipeline.__call__'s defaults (121 frames, 50 steps).
_CALL_DEFAULTS = inspect.signature(HunyuanVideo15Pipeline.__call__).parameters
DEFAULT_FRAMES = _CALL_DEFAULTS["num_frames"].default
DEFAULT_STEPS = _CALL_DEFAULTS["num_inference_steps"].default


class HunyuanVideo15Adapter(FamilyAdapter):
    family = "hunyuan-video15"
    pipeline_type = HunyuanVideo15Pipeline
    timestep_divisor = 1.0
    timestep_rule = "timestep"
    cfg_scale_field = "guidance_scale"
    conditioning = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_CHANNELS, "condition")
    batched_env_keys = (
        "encoder_hidden_states",
        "encoder_attention_mask",
        "encoder_hidden_states_2",
        "encoder_attention_mask_2",
        "image_embeds",
        "condition",
    )
    max_frames = 2 * DEFAULT_FRAMES - 1  # about twice the default (4k + 1) bounds one request's work

    def __init__(self, pipe, device, dtype, folder=None):
        super().__init__(pipe, device, dtype, folder)
        guider = self.pipe.guider.config
        if guider.guidance_rescale or (guider.start, guider.stop) != (0.0, 1.0) or not guider.enabled:
            raise UnsupportedModel(
                f"{self.source}: its guider rescales (guidance_rescale {guider.guidance_rescale}), "
                f"guides from {guider.start} to {guider.stop} of the steps or is disabled (enabled "
                f"{guider.enabled}): only plain CFG on every step is served"
            )
        if guider.use_original_formulation:
            self.cfg_rule, self.cfg_off_scale = "cfg_from_positive", 0.0
        else:
            self.cfg_rule, self.cfg_off_scale = "true_cfg", 1.0

    @property
    def side_multiple(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size

    @property
    def frame_step(self) -> int:
        return self.pipe.vae_scale_factor_temporal

    def defaults(self) -> FamilyDefaults:
        # The pipeline's: its frames and steps, the guider's scale, and the size it picks for the
        # transformer's target_size at its default aspect ratio (848 x 480 for 16:9 at 480p).
        aspect_width, aspect_height = self.pipe.default_aspect_ratio
        height, width = self.pipe.video_processor.calculate_default_height_width(
            aspect_height, aspect_width, self.pipe.target_size
        )
        return FamilyDefaults(
            height=height,
            width=width,
            frames=DEFAULT_FRAMES,
            num_steps=DEFAULT_STEPS,
            guidance_scale=self.pipe.guider.config.guidance_scale,
            true_cfg_scale=1.0,
            noise_level=0.7,
        )

    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        sigmas = np.linspace(1.0, 0.0, num_steps + 1)[:-1]
        return set_up_schedule(self.pipe.scheduler, num_steps, sigmas=sigmas)

    def latent_shape(self, shape: MediaShape) -> tuple[int, ...]:
        spatial = self.pipe.vae_scale_factor_spatial
        latent_frames = (shape.frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return (
            self.pipe.num_channels_latents,
            latent_frames,
            shape.height // spatial,
            shape.width // spatial,
        )

    def generated_tokens(self, shape: MediaShape) -> int:
        _, frames, rows, cols = self.latent_shape(shape)
        config = self.pipe.transformer.config
        return (frames // config.patch_size_t) * (rows // config.patch_size) * (cols // config.patch_size)

    def latent_packing(self) -> str:
        return (
            "video: [vae_latent_channels, (F - 1)/4 + 1, H/16, W/16], fed with C + 1 conditioning "
            "channels of zeros (the transformer patchifies itself)"
        )

    def _context_tokens(self) -> tuple[int, int, int]:
        """The Qwen2.5-VL, ByT5 and image tokens every row attends to, as the pipeline pads them."""
        pipe = self.pipe
        return pipe.tokenizer_max_length, pipe.tokenizer_2_max_length, pipe.vision_num_semantic_tokens

    def text_elements(self) -> int:
        config = self.pipe.transformer.config
        text, glyphs, image = self._context_tokens()
        return (
            text * (config.text_embed_dim + 1)
            + glyphs * (config.text_embed_2_dim + 1)
            + image * config.image_embed_dim
        )

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # Joint attention over the video tokens and the three contexts; the feed-forward's hidden
        # width (mlp_ratio), or the q, k and v projections.
        config = self.pipe.transformer.config
        inner = config.num_attention_heads * config.attention_head_dim
        tokens = self.generated_tokens(shape) + sum(self._context_tokens())
        return tokens, max(int(config.mlp_ratio * inner), 3 * inner)

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # guidance_scale is the CFG scale, applied when the branches are combined.
        pipe = self.pipe
        dtype = pipe.transformer.dtype
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(prompt=text, device=self.device, dtype=dtype)
        channels, frames, rows, cols = self.latent_shape(shape)
        return {
            "encoder_hidden_states": embeds,
            "encoder_attention_mask": mask,
            "encoder_hidden_states_2": embeds_2,
            "encoder_attention_mask_2": mask_2,
            "image_embeds": torch.zeros(
                1, pipe.vision_num_semantic_tokens, pipe.vision_states_dim, dtype=dtype, device=self.device
            ),
            self.conditioning.env_key: torch.zeros(
                1, channels + 1, frames, rows, cols, dtype=dtype, device=self.device
            ),
            "attention_kwargs": None,
            "return_dict": False,
        }

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        vae = self.pipe.vae
        video = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        yield torch.clamp(video, min=-1.0, max=1.0)  # the postprocessing clamps [0, 1] after x / 2 + 1/2

    def frames_of(self, piece: torch.Tensor) -> list[Image.Image]:
        return self.pipe.video_processor.postprocess_video(piece, output_type="pil")[0]
