"""NVIDIA Cosmos3 text-to-video (``Cosmos3OmniPipeline``, its plain text path): one packed sequence of
text tokens and video latent patches per sample, UniPC, classic CFG.

How the transformer is called. ``Cosmos3OmniTransformer`` has no text encoder in front of it: its own
embedding reads the prompt's token ids, and its dual-pathway (mixture-of-transformers) layers run the
text causally (the "understanding" pathway) and the vision tokens with full attention over the text
and themselves (the "generation" pathway). Text and latents of one sample are packed into a single
sequence, so a call takes one sample: batching two would let each attend to the other. The pipeline
runs one sample per call (``prompt`` lists collapse to their first entry). The call form is therefore
``PACKED_SAMPLE`` (``rollout_core.transformer_call``), one call per sample, exactly as
``Cosmos3OmniPipeline.__call__`` makes it::

    transformer(vision_tokens=[x_b], vision_timesteps=full((N,), t), **env)[0][0]

with ``x_b`` the sample's latent [1, C, F', H/16, W/16] in the transformer's dtype, and ``t`` the raw
timestep (the scheduler's integer timestep, fed in float32: the transformer scales it by its
``timestep_scale``, 0.001, and the pipeline's int64 ``full`` becomes the same float32 there), one per
noisy vision token (N = F' x ceil(H/32) x ceil(W/32), the transformer patchifying 2 x 2 and padding
an odd grid). The env of a text is what ``__call__`` builds once per prompt before its loop:

- ``input_ids``, ``text_indexes``: the token ids of the chat template (the pipeline's system prompt
  for video, or for an image when ``num_frames`` is 1), the prompt with the pipeline's duration and
  resolution sentences (``tokenize_prompt``, at the request's frames, size and the pipeline's 24 fps),
  then ``<|im_end|>`` and ``<|vision_start|>``; and their positions 0 .. L - 1;
- ``position_ids``: the 3D mRoPE ids of the text and of the vision grid (``_prepare_text_segment``
  and ``_prepare_vision_segment``), [3, L + N];
- ``und_len`` (L), ``sequence_length`` (L + N), ``vision_token_shapes`` ([[F', h, w]] patches),
  ``vision_sequence_indexes`` and ``vision_mse_loss_indexes`` (L .. L + N - 1: every frame is noisy
  in text-to-video), ``vision_noisy_frame_indexes`` (0 .. F' - 1, held as [1, F']: the transformer
  reads it as the list of the sample's one item), and ``return_dict`` (False).

The tensors but ``vision_noisy_frame_indexes`` carry a batch dimension of 1 (``batched_env_keys``),
which the call drops per sample. The prediction is the velocity of the whole latent; the pipeline's
mask of conditioned frames is all ones in text-to-video (a multiplication by 1, exact).

CFG is the pipeline's, on ``guidance_scale`` (default 6): v_neg + s (v_pos - v_neg) in float32
(``true_cfg``), off at 1. Its negative branch is not the negative prompt encoded like a prompt: the
pipeline appends the *inverse* templates to it ("The video is not ... seconds long ..."), so the
adapter encodes it apart (``encode_negative_text``), and the prompt cache keys it apart.

The schedule is the pipeline's scheduler's own: ``set_timesteps(N)`` on its
``UniPCMultistepScheduler`` (the released checkpoints: Karras sigmas on flow sigmas, ``sigma_max``
200 and ``sigma_min`` 0.147, so sigma_0 is 200 / 201 and the last one before 0 about 0.128; the
model card's ``flow_shift`` 10 is a scheduler one saves into the folder), or with the pipeline's
``use_native_flow_schedule``, linspace(1 - 1 / 1000, 0, N + 1)[:-1]. The deterministic steps take
the pipeline's solver, UniPC-2 bh2 with its corrector (``rollout_core.solvers``), so an ODE rollout
is what ``__call__`` produces from the same x_0. The stochastic steps are the samplers' first-order
Gaussian transitions on the same sigmas (``rollout_core.steps``): FLOW_SDE takes sigma_1 in place of
sigma_0 in std_t at the first step, whatever sigma_0 is (FlowGRPO's rule at sigma_0 = 1, Wan's at
1 - 1e-6); Cosmos3's sigma_0 = 0.995 would be finite, and the rule keeps the first step's noise what
every family's is. A stochastic step ends UniPC's history: the deterministic steps after it restart
at first order, and the corrector runs only between two deterministic steps (docs/protocol.md).

Latents are [C, (F - 1) / 4 + 1, H / 16, W / 16] (Wan 2.2's 48-channel VAE), normalised by the
VAE's ``latents_mean`` and ``latents_std`` as the pipeline does; they are float32 between steps, as
the pipeline keeps them. The decode is ``AutoencoderKLWan``'s, one latent frame a piece with the
causal cache (bitwise ``vae.decode``).

Served: text-to-video and text-to-image (``num_frames`` 1). Not served: sound and action generation,
image- and video-conditioned generation (a clean conditioning frame is masked out of the step, which
is not a Gaussian transition of the whole latent), the safety checker (``cosmos_guardrail``; a folder
whose pipeline enables it loads only where it is installed, and the server runs no check), and the
pipeline's mixed-precision schedule (``mixed_precision_format``; the server runs the loaded dtype).

Sequence parallelism (``--sp N``, Ulysses). ``Cosmos3OmniTransformer`` has no context-parallel plan
(``_cp_plan``) in diffusers 0.41, by design: ``forward`` has two seams instead, ``_cp_shard_fn``
(each pathway's hidden states and rotary embeddings, before the decoder layers) and ``_cp_gather_fn``
(each pathway's output, after the final norm), for a helper that splits and gathers and installs a
context-parallel attention processor; diffusers ships none. The adapter's constructor gives the
loaded transformer ours (``UlyssesSplit``, ``UlyssesAttnProcessor``), idle until ``--sp`` splits it,
and an empty plan (no diffusers hooks: the seams split), which ``check_splittable`` and
``enable_parallelism`` take. The shard cuts the text (the understanding pathway) and the vision
tokens apart, each with its rotary embeddings, as ``tensor_split`` does (the text unevenly, as
diffusers' ``ulysses_anything``; the vision tokens into equal parts, which validation checks as for
every family, though the exchange takes any cut). The processor mirrors diffusers' projections, norms
and rotations on the rank's tokens, then exchanges each pathway's q, k and v apart (one all-to-all
each, and one each back): every rank attends, for its share of the heads, over the unsplit text
(causally) and the unsplit text + vision sequence (fully), in SP=1's order, so in float32 on one CPU
thread SP=2 gives SP=1's velocities bitwise. Under GQA query head h reads key/value head
h / (query heads / key/value heads): a rank's share of the query heads reads exactly its share of
the key/value heads when both counts divide by the degree, which ``check_splittable`` requires
(Cosmos3-Nano's 32 and 8: 2, 4 or 8 ranks). The gather sends every rank's output part to every rank.
Ring attention is refused at start-up (``_cp_ulysses_only``): the exchange is Ulysses'. A transformer
loaded without the adapter has no seams and is refused as having no plan.
"""

import inspect
from collections.abc import Iterator

import numpy as np
import torch
from diffusers import Cosmos3OmniPipeline
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor, _rotate_half
from PIL import Image

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import CallForm
from rollout_server.errors import TextTooLong, UnsupportedModel
from rollout_server.families.base import FamilyAdapter, FamilyDefaults, MediaShape, set_up_schedule
from rollout_server.families.wan.adapter import wan_vae_frames
from rollout_server.parallel import ulysses

# Cosmos3OmniPipeline.__call__'s defaults: 189 frames of 1280 x 720 at 24 fps, 35 steps, CFG 6.
_CALL_DEFAULTS = inspect.signature(Cosmos3OmniPipeline.__call__).parameters
DEFAULT_FRAMES, DEFAULT_HEIGHT, DEFAULT_WIDTH = 189, 720, 1280  # __call__ fills these in when None
DEFAULT_STEPS = _CALL_DEFAULTS["num_inference_steps"].default
DEFAULT_GUIDANCE = _CALL_DEFAULTS["guidance_scale"].default
FPS = _CALL_DEFAULTS["fps"].default
# The most text tokens one text's env holds: the chat template, the duration and resolution templates
# and the text (a JSON-upsampled Cosmos prompt is about 1000 tokens). The pipeline truncates nothing,
# and a character may take several tokens (4 for an emoji, byte by byte), so a longer text is refused
# once tokenised (TextTooLong): the memory estimate sizes a text's env and a forward's text by it.
TEXT_TOKENS = 4096
# The env entries with a batch dimension of 1, one row per sample of a call.
BATCHED_ENV_KEYS = (
    "input_ids",
    "text_indexes",
    "position_ids",
    "vision_sequence_indexes",
    "vision_mse_loss_indexes",
)


class UlyssesSplit:
    """The transformer's context-parallel seams (``_cp_shard_fn``, ``_cp_gather_fn``), no-ops until
    ``enable_parallelism`` gives it a config: each pathway's tokens and their rotary embeddings cut
    into the ranks' parts before the decoder layers (the text unevenly, the vision tokens evenly:
    validation), and gathered back after the final norm. It keeps the parts' sizes of the forward
    under way, which the attention processors exchange by."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self.text_sizes: list[int] = []
        self.vision_sizes: list[int] = []

    def ulysses(self) -> tuple[int, int, object] | None:
        """The Ulysses degree, this rank's place in it and its group; None when not split."""
        return ulysses.place(self.transformer._parallel_config)

    def shard(self, und_seq, gen_seq, rotary_emb):
        if (place := self.ulysses()) is None:
            return und_seq, gen_seq, rotary_emb
        ranks, rank, _ = place
        cos_und, sin_und, cos_gen, sin_gen = rotary_emb  # [tokens, head_dim] each
        self.text_sizes = ulysses.split_sizes(und_seq.shape[0], ranks)
        self.vision_sizes = ulysses.split_sizes(gen_seq.shape[0], ranks)
        und_seq, cos_und, sin_und = (t.tensor_split(ranks)[rank] for t in (und_seq, cos_und, sin_und))
        gen_seq, cos_gen, sin_gen = (t.tensor_split(ranks)[rank] for t in (gen_seq, cos_gen, sin_gen))
        return und_seq, gen_seq, (cos_und, sin_und, cos_gen, sin_gen)

    def gather(self, und_out, gen_out):
        if (place := self.ulysses()) is None:
            return und_out, gen_out
        _, rank, group = place
        return ulysses.gather(und_out, self.text_sizes, rank, group), ulysses.gather(
            gen_out, self.vision_sizes, rank, group
        )


class UlyssesAttnProcessor(Cosmos3AttnProcessor):
    """The dual-pathway attention under the split (inference: no autograd through the exchange);
    diffusers' own processor when the transformer is not split. The projections, norms and rotary
    embeddings mirror ``Cosmos3AttnProcessor.__call__`` (diffusers 0.41) line for line, on this
    rank's tokens; then each pathway's q, k and v are exchanged for this rank's share of the query
    heads and of the key/value heads (GQA: query head h reads key/value head h / groups, so rank r's
    query heads read exactly rank r's key/value heads when both counts divide by the degree), and the
    two attentions run on the unsplit sequences, in their own order."""

    def __init__(self, split: UlyssesSplit):
        self.split = split

    def __call__(self, attn, und_seq, gen_seq, rotary_emb):
        if self._parallel_config is None:
            return super().__call__(attn, und_seq, gen_seq, rotary_emb)
        heads, kv_heads, dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, heads, dim))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, kv_heads, dim))
        v_und = attn.to_v(und_seq).view(-1, kv_heads, dim)
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, heads, dim))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, kv_heads, dim))
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv_heads, dim)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else None
        cos_und, sin_und, cos_gen, sin_gen = (t.unsqueeze(1) for t in rotary_emb)
        q_und, k_und = (t * cos_und + _rotate_half(t) * sin_und for t in (q_und, k_und))
        q_gen, k_gen = (t * cos_gen + _rotate_half(t) * sin_gen for t in (q_gen, k_gen))
        text = [q_und, k_und, v_und]
        if k_und_for_gen is not None:  # otherwise the generation pathway reads k_und itself
            text.append(k_und_for_gen * cos_und + _rotate_half(k_und_for_gen) * sin_und)

        # Every rank's text tokens, and apart every rank's vision tokens, for this rank's heads.
        _, rank, group = self.split.ulysses()
        text_sizes, vision_sizes = self.split.text_sizes, self.split.vision_sizes
        q_und, k_und, v_und, *for_gen = ulysses.to_heads(text, text_sizes, group)
        k_und_for_gen = for_gen[0] if for_gen else k_und
        q_gen, k_gen, v_gen = ulysses.to_heads([q_gen, k_gen, v_gen], vision_sizes, group)

        causal_out = dispatch_attention_fn(
            q_und.unsqueeze(0),
            k_und.unsqueeze(0),
            v_und.unsqueeze(0),
            is_causal=True,
            enable_gqa=True,
            backend=self._attention_backend,
        )
        full_out = dispatch_attention_fn(
            q_gen.unsqueeze(0),
            torch.cat([k_und_for_gen, k_gen], dim=0).unsqueeze(0),
            torch.cat([v_und, v_gen], dim=0).unsqueeze(0),
            is_causal=False,
            enable_gqa=True,
            backend=self._attention_backend,
        )
        causal_out = ulysses.to_tokens(causal_out.squeeze(0), text_sizes, rank, group).flatten(1)
        full_out = ulysses.to_tokens(full_out.squeeze(0), vision_sizes, rank, group).flatten(1)
        return attn.to_out(causal_out), attn.to_add_out(full_out)


class Cosmos3Adapter(FamilyAdapter):
    family = "cosmos3"
    pipeline_type = Cosmos3OmniPipeline
    timestep_divisor = 1.0
    timestep_rule = "timestep, float32, one per noisy vision token"
    call_form = CallForm(
        inputs=rollout_pb2.TRANSFORMER_INPUTS_PACKED_SAMPLE,
        latents_argument="vision_tokens",
        timestep_argument="vision_timesteps",
        timestep_float32=True,
        timestep_tokens_key="vision_mse_loss_indexes",
    )
    cfg_scale_field = "guidance_scale"
    cfg_rule = "true_cfg"
    batched_env_keys = BATCHED_ENV_KEYS
    negative_encoded_apart = True
    decode_keeps_state = True  # the causal convolutions' cache, between latent frames
    generated_inputs = ("vision_tokens",)
    max_frames = 2 * DEFAULT_FRAMES - 1  # about twice the default (4k + 1) bounds one request's work
    frame_rate = FPS

    def __init__(self, pipe, device, dtype, folder=None):
        super().__init__(pipe, device, dtype, folder)
        if type(self.pipe.scheduler).__name__ != "UniPCMultistepScheduler":
            raise UnsupportedModel(
                f"{self.source}: a {type(self.pipe.scheduler).__name__} scheduler; Cosmos3OmniPipeline "
                "steps with UniPCMultistepScheduler"
            )
        # Sequence parallelism through the transformer's seams (module docstring): an empty plan (no
        # hooks: the seams split and gather) and our processor, both idle until --sp splits it.
        transformer = self.pipe.transformer
        split = UlyssesSplit(transformer)
        transformer._cp_plan = {}
        transformer._cp_ulysses_only = True  # the processor's exchange is Ulysses' all-to-all
        transformer._cp_shard_fn, transformer._cp_gather_fn = split.shard, split.gather
        for layer in transformer.layers:
            layer.self_attn.set_processor(UlyssesAttnProcessor(split))

    @property
    def side_multiple(self) -> int:
        # The pipeline's check: multiples of the VAE's 16 (the transformer pads an odd patch grid).
        return self.pipe.vae_scale_factor_spatial

    @property
    def frame_step(self) -> int:
        return self.pipe.vae_scale_factor_temporal

    def defaults(self) -> FamilyDefaults:
        return FamilyDefaults(
            height=DEFAULT_HEIGHT,
            width=DEFAULT_WIDTH,
            frames=DEFAULT_FRAMES,
            num_steps=DEFAULT_STEPS,
            guidance_scale=DEFAULT_GUIDANCE,
            true_cfg_scale=1.0,
            noise_level=0.7,
        )

    def schedule(self, num_steps: int, shape: MediaShape) -> tuple[torch.Tensor, torch.Tensor]:
        scheduler = self.pipe.scheduler
        if not self.pipe.config.use_native_flow_schedule:
            return set_up_schedule(scheduler, num_steps)
        sigmas = np.linspace(1.0 - 1.0 / scheduler.config.num_train_timesteps, 0.0, num_steps + 1)[:-1]
        return set_up_schedule(scheduler, num_steps, sigmas=sigmas)

    def latent_shape(self, shape: MediaShape) -> tuple[int, ...]:
        spatial = self.pipe.vae_scale_factor_spatial
        latent_frames = (shape.frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return (self.pipe.vae.config.z_dim, latent_frames, shape.height // spatial, shape.width // spatial)

    def _patch_grid(self, shape: MediaShape) -> tuple[int, int, int]:
        _, frames, rows, cols = self.latent_shape(shape)
        patch = self.pipe.transformer.config.latent_patch_size
        return frames, -(-rows // patch), -(-cols // patch)

    def generated_tokens(self, shape: MediaShape) -> int:
        frames, rows, cols = self._patch_grid(shape)
        return frames * rows * cols

    def latent_packing(self) -> str:
        return (
            "video: [vae_z_dim, (F - 1)/4 + 1, H/16, W/16], one sample per call, packed after its text "
            "tokens (the transformer patchifies 2x2 itself)"
        )

    def text_elements(self) -> int:
        # input_ids, text_indexes and the text's three mRoPE rows; the vision entries are per shape.
        return 5 * TEXT_TOKENS

    def forward_activation(self, shape: MediaShape) -> tuple[int, int]:
        # One sequence of the text and the vision tokens, each through its pathway's layers: the
        # gated feed-forward's hidden width, or the q, k and v projections (grouped keys and values).
        config = self.pipe.transformer.config
        qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
        return self.generated_tokens(shape) + TEXT_TOKENS, max(config.intermediate_size, qkv)

    def _env(self, input_ids: list[int], shape: MediaShape) -> dict:
        """The env of a text's token ids at ``shape``, as ``__call__`` packs it before its loop."""
        pipe = self.pipe
        text = pipe._prepare_text_segment(input_ids, device=self.device)
        latents = torch.empty(1, *self.latent_shape(shape), device="meta")  # read for its shape only
        vision = pipe._prepare_vision_segment(
            input_vision_tokens=latents,
            has_image_condition=False,
            mrope_offset=text["vision_start_temporal_offset"],
            vision_fps=FPS,
            curr=text["und_len"],
            device=self.device,
            condition_frame_indexes=[],
        )
        position_ids = torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1)
        return {
            "input_ids": text["input_ids"].unsqueeze(0),
            "text_indexes": text["text_indexes"].unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
            "und_len": text["und_len"],
            "sequence_length": text["und_len"] + vision["num_vision_tokens"],
            "vision_token_shapes": [list(grid) for grid in vision["vision_token_shapes"]],
            "vision_sequence_indexes": vision["vision_sequence_indexes"].unsqueeze(0),
            "vision_mse_loss_indexes": vision["vision_mse_loss_indexes"].unsqueeze(0),
            "vision_noisy_frame_indexes": torch.stack(vision["vision_noisy_frame_indexes"]),
            "return_dict": False,
        }

    def _token_ids(self, text: str, shape: MediaShape, negative: bool) -> list[int]:
        """The token ids of ``text`` as a prompt, or as the negative prompt (with the inverse templates),
        as ``tokenize_prompt`` makes them; TextTooLong above TEXT_TOKENS."""
        prompt, negative_prompt = ("", text) if negative else (text, "")
        prompt_ids, negative_ids = self.pipe.tokenize_prompt(
            prompt, negative_prompt, num_frames=shape.frames, height=shape.height, width=shape.width, fps=FPS
        )
        ids = negative_ids if negative else prompt_ids
        if len(ids) > TEXT_TOKENS:
            raise TextTooLong(len(ids), TEXT_TOKENS)
        return ids

    @torch.no_grad()
    def encode_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        # guidance_scale is the CFG scale, applied when the branches are combined.
        return self._env(self._token_ids(text, shape, negative=False), shape)

    @torch.no_grad()
    def encode_negative_text(self, text: str, guidance_scale: float, shape: MediaShape, image=None) -> dict:
        return self._env(self._token_ids(text, shape, negative=True), shape)

    @torch.no_grad()
    def decode_pixels(self, latents: torch.Tensor, shape: MediaShape) -> Iterator[torch.Tensor]:
        yield from wan_vae_frames(self.pipe.vae, latents)

    def frames_of(self, piece: torch.Tensor) -> list[Image.Image]:
        return self.pipe.video_processor.postprocess_video(piece, output_type="pil")[0]
