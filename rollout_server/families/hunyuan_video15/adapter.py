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

Sequence parallelism (Ulysses): ``HunyuanVideo15Transformer3DModel`` has no context-parallel plan in
diffusers 0.41, so the adapter gives its transformer one (``context_parallel_plan``) and an attention
processor for its dual-stream blocks (``UlyssesAttnProcessor``). The plan splits the video tokens at
the first block, with their RoPE frequencies (``rope``'s output), and the context tokens too (the
Qwen2.5-VL, ByT5 and image tokens the transformer concatenates: 1985, split unevenly, as diffusers'
``ulysses_anything`` does); ``proj_out`` gathers the video tokens back, and the context's output is
dropped as before. Both streams are split because each block's joint attention concatenates them: a
whole context on every rank would be gathered once per rank. Diffusers' processor cannot run on the
split: it builds a dense [B, 1, S, S] mask from the sequence it is given (the rank's part), and its
Ulysses all-to-all would gather the ranks' parts in rank order (video, context, video, context, ...).
Ours exchanges the video tokens and the context tokens apart, so every rank attends, for its share
of the heads, over the unsplit sequence in its own order (all video tokens, then the context), with
the unsplit context mask it is given whole (the plan does not split it). It masks keys only
(mask[j], not mask[i] & mask[j]) and zeroes the rows of masked context tokens, which is what the
dense mask gives them (no key to attend to): the same attention in every row, without an S x S mask
(on the CPU, in float32 on one thread, SP = 2 gives SP = 1's velocities bitwise). At SP = 1 it runs
the same key-masked attention on the whole sequence: diffusers' velocities bitwise, without the
S x S masks (6 bytes a query and key, 14.7 GiB a row at the default 480p x 121 frames). Ring
attention is refused at start-up (``_cp_ulysses_only``): the exchange is Ulysses'. The video tokens
are exchanged in equal parts: validation checks that they divide.

The memory estimate counts what still grows with the square of a sequence: the token refiner's
masks over the 1000 Qwen2.5-VL tokens (``attention_matrix_bytes``), and the VAE decoder's causal
attention over every latent token of the video, on SDPA's math kernel (``decode_attention_bytes``).
"""

import inspect
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import HunyuanVideo15Pipeline
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from PIL import Image

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import LatentConditioning
from rollout_server.errors import UnsupportedModel
from rollout_server.families.base import FamilyAdapter, FamilyDefaults, MediaShape, set_up_schedule
from rollout_server.parallel import ulysses

# HunyuanVideo15Pipeline.__call__'s defaults (121 frames, 50 steps).
_CALL_DEFAULTS = inspect.signature(HunyuanVideo15Pipeline.__call__).parameters
DEFAULT_FRAMES = _CALL_DEFAULTS["num_frames"].default
DEFAULT_STEPS = _CALL_DEFAULTS["num_inference_steps"].default


def context_parallel_plan() -> dict:
    """A diffusers context-parallel plan for ``HunyuanVideo15Transformer3DModel`` (see the module
    docstring): the video tokens and their RoPE frequencies, and the context tokens, split into the
    first block; the video tokens gathered at ``proj_out``."""
    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    frequencies = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)  # [S, D / 2]
    return {
        "rope": {0: frequencies, 1: frequencies},  # cos and sin
        "transformer_blocks.0": {"hidden_states": tokens, "encoder_hidden_states": tokens},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


class UlyssesAttnProcessor(HunyuanVideo15AttnProcessor2_0):
    """The dual-stream blocks' joint attention, with the context mask on the keys alone (no S x S
    mask), whole or under our plan's Ulysses split (inference: no autograd through the exchange). The
    projections, norms and RoPE mirror ``HunyuanVideo15AttnProcessor2_0.__call__`` (diffusers 0.41)
    line for line: its mask is built between them and the attention, from the sequence it is given.

    diffusers builds mask[i] & mask[j] for all i, j. A key mask gives every unmasked query the same
    scores, so the same kernel on the same q, k and v gives it the same output; a masked query (a
    padded context token), with no key to attend to in diffusers' mask, gets its zero output here by
    ``masked_fill``. Unsplit, the velocities are diffusers' bitwise (on the CPU's flash kernel, which
    both take), without the [B, 1, S, S] masks and SDPA's float copy of one, 6 S^2 bytes a row."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
        query, key, value = (
            projection(hidden_states).unflatten(2, (attn.heads, -1))
            for projection in (attn.to_q, attn.to_k, attn.to_v)
        )
        query, key = attn.norm_q(query), attn.norm_k(key)
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        context_query, context_key, context_value = (
            projection(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            for projection in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        if attn.norm_added_q is not None:
            context_query = attn.norm_added_q(context_query)
        if attn.norm_added_k is not None:
            context_key = attn.norm_added_k(context_key)

        split = self._parallel_config is not None
        if split:
            # Gather every rank's video tokens, then every rank's context tokens, for this rank's
            # heads: the unsplit sequence in its own order. The context was cut as diffusers' sharder
            # cuts it (tensor_split: ulysses_anything); attention_mask, not split, is the whole
            # context's.
            ranks, rank, group = ulysses.place(self._parallel_config)
            video_sizes = [hidden_states.shape[1]] * ranks  # validation: an even split
            context_sizes = ulysses.split_sizes(attention_mask.shape[1], ranks)
            if context_sizes[rank] != encoder_hidden_states.shape[1]:
                raise RuntimeError(
                    f"rank {rank} holds {encoder_hidden_states.shape[1]} context tokens, not "
                    f"{context_sizes[rank]}: the transformer was not split by our plan"
                )
            video = sum(video_sizes)
            batch, _, heads, dim = query.shape
            gathered = query.new_empty(video + attention_mask.shape[1], 3, batch, heads // ranks, dim)
            ulysses.to_heads([torch.stack([query, key, value])], video_sizes, group, gathered[:video])
            ulysses.to_heads(
                [torch.stack([context_query, context_key, context_value])],
                context_sizes,
                group,
                gathered[video:],
            )
            query, key, value = gathered.permute(1, 2, 0, 3, 4).unbind(0)
        else:
            video = hidden_states.shape[1]
            query, key, value = (
                torch.cat(pair, dim=1)
                for pair in ((query, context_query), (key, context_key), (value, context_value))
            )

        mask = F.pad(attention_mask.bool(), (video, 0), value=True)
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=mask[:, None, None, :], backend=self._attention_backend
        )
        hidden_states = hidden_states.masked_fill(~mask[:, :, None, None], 0.0).to(query.dtype)
        if split:
            encoder_hidden_states = ulysses.to_tokens(hidden_states[:, video:], context_sizes, rank, group)
            hidden_states = ulysses.to_tokens(hidden_states[:, :video], video_sizes, rank, group)
        else:
            encoder_hidden_states, hidden_states = hidden_states[:, video:], hidden_states[:, :video]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.flatten(2, 3)))
        return hidden_states, attn.to_add_out(encoder_hidden_states.flatten(2, 3))


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
        transformer = self.pipe.transformer
        transformer._cp_plan = context_parallel_plan()
        transformer._cp_ulysses_only = True  # the processor's exchange is Ulysses' all-to-all
        for block in transformer.transformer_blocks:
            block.attn.set_processor(UlyssesAttnProcessor())

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

    def attention_matrix_bytes(self, shape: MediaShape) -> int:
        # The blocks' joint attention takes a key mask (UlyssesAttnProcessor). The token refiner, run
        # over the Qwen2.5-VL tokens before the blocks (whole on every rank), builds diffusers' T x T
        # masks: mask[i] and mask[i] & mask[j] (booleans), the per-head copy its Attention makes, and
        # SDPA's copy of that in the transformer's dtype.
        tokens, heads = self.pipe.tokenizer_max_length, self.pipe.transformer.config.num_attention_heads
        return tokens**2 * (2 + heads * (1 + self.dtype.itemsize))

    def decode_attention_bytes(self, shape: MediaShape) -> int:
        # The decoder's mid-block attends over every latent token of the video at once, causally by
        # frame, through an S x S mask in the VAE's dtype; a 3-D mask the CPU's flash kernel does not
        # take, so SDPA's math kernel runs, with two float32 S x S scores (q k^T, then the mask added)
        # beside it at its peak.
        _, frames, rows, cols = self.latent_shape(shape)
        tokens = frames * rows * cols
        return tokens**2 * (self.pipe.vae.dtype.itemsize + 2 * torch.float32.itemsize)

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
