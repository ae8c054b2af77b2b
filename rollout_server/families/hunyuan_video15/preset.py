"""Seeded, randomly initialised HunyuanVideo 1.5-shaped text-to-video pipelines for tests and benchmarks.

Every component is the real diffusers/transformers class with HunyuanVideo 1.5's structure: a
dual-stream video DiT (HunyuanVideo15Transformer3DModel, text-to-video) over 32-channel latents with
the conditioning channels it reads (2C + 1 in, C out), a token refiner over the Qwen2.5-VL states and
a projection of the ByT5 states; the 16x spatial, 4x temporal AutoencoderKLHunyuanVideo15; a
Qwen2.5-VL text model behind Qwen2.5-VL's chat template, with a byte-level BPE Qwen2 tokenizer
trained on the pipeline's system message (whose turn it then tokenizes to exactly the 108 tokens the
pipeline crops, as the real tokenizer does); ByT5's tokenizer (bytes: it needs no files) and a T5
encoder of its 384-token vocabulary; a statically shifted flow-matching scheduler; and the CFG guider
component. Only the widths, depths and vocabulary are shrunk.
"""

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
)

from rollout_server.families.common.tokenizers import QWEN3_CHAT_TEMPLATE, write_qwen2_tokenizer


@dataclass(frozen=True)
class HunyuanVideo15PresetConfig:
    num_layers: int
    num_refiner_layers: int
    num_attention_heads: int  # divisible by 2: Ulysses sequence parallelism splits heads
    attention_head_dim: int
    rope_axes_dim: tuple[int, int, int]  # frames, rows, columns: sums to the head dim
    image_embed_dim: int
    latent_channels: int
    vae_block_out_channels: tuple[int, ...]  # log2(16) + 1 = 5 levels
    text_hidden_size: int  # the transformer's text_embed_dim
    text_layers: int  # at least 3: the pipeline reads the hidden states 2 layers before the last
    text_heads: int
    byt5_d_model: int  # the transformer's text_embed_2_dim
    byt5_layers: int
    byt5_heads: int


HUNYUAN_VIDEO15_PRESET_CONFIGS = {
    "tiny": HunyuanVideo15PresetConfig(
        num_layers=1,
        num_refiner_layers=1,
        num_attention_heads=2,
        attention_head_dim=16,
        rope_axes_dim=(4, 6, 6),
        image_embed_dim=16,
        latent_channels=32,  # HunyuanVideo 1.5's
        vae_block_out_channels=(8, 16, 32, 64, 64),  # the real widths / 16: the last is 2C wide
        text_hidden_size=32,
        text_layers=3,
        text_heads=2,
        byt5_d_model=32,
        byt5_layers=1,
        byt5_heads=2,
    ),
}
# A static shift (no resolution-dependent mu): the pipeline passes linspace(1, 0, N + 1)[:-1] as sigmas.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 5.0}
GUIDANCE_SCALE = 6.0


def system_message() -> str:
    """The installed pipeline's system message, the default of its text-encoding helper."""
    parameters = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    return parameters["system_message"].default


def build_hunyuan_video15_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset and saves it as a float32 HunyuanVideo15Pipeline into `folder`."""
    cfg = HUNYUAN_VIDEO15_PRESET_CONFIGS[size]
    folder = Path(folder)
    write_qwen2_tokenizer(folder / "tokenizer", system_message(), chat_template=QWEN3_CHAT_TEMPLATE)
    tokenizer = Qwen2Tokenizer.from_pretrained(folder / "tokenizer")
    tokenizer_2 = ByT5Tokenizer()

    # A fixed seed per component keeps each one stable when another component's config changes.
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=cfg.latent_channels,
        block_out_channels=cfg.vae_block_out_channels,
        layers_per_block=1,
    )
    torch.manual_seed(1)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * cfg.latent_channels + 1,  # the latents, the conditioning latents and their mask
        out_channels=cfg.latent_channels,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        num_layers=cfg.num_layers,
        num_refiner_layers=cfg.num_refiner_layers,
        text_embed_dim=cfg.text_hidden_size,
        text_embed_2_dim=cfg.byt5_d_model,
        image_embed_dim=cfg.image_embed_dim,
        rope_axes_dim=cfg.rope_axes_dim,
        target_size=64,
        task_type="t2v",
    )
    torch.manual_seed(2)
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg.text_hidden_size,
            intermediate_size=4 * cfg.text_hidden_size,
            num_hidden_layers=cfg.text_layers,
            num_attention_heads=cfg.text_heads,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    torch.manual_seed(3)
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=cfg.byt5_d_model,
            d_kv=cfg.byt5_d_model // cfg.byt5_heads,
            d_ff=2 * cfg.byt5_d_model,
            num_layers=cfg.byt5_layers,
            num_heads=cfg.byt5_heads,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
        )
    )
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )
    pipe.save_pretrained(folder, safe_serialization=True)
