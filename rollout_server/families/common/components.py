"""The steps every family's builder takes: a tokenizer trained into the folder, a text encoder over it, a
model from its config; and the CLIP and T5 text stacks several families share."""

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from diffusers import AutoencoderKL
from transformers import (
    CLIPTextConfig,
    CLIPTokenizer,
    Qwen2Tokenizer,
    Qwen3Config,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from rollout_server.families.common.published import CLIP_TOKENIZER, T5_TOKENIZER
from rollout_server.families.common.tokenizers import (
    QWEN3_CHAT_TEMPLATE,
    QWEN3_SPECIAL_TOKENS,
    write_clip_tokenizer,
    write_qwen2_tokenizer,
    write_t5_tokenizer,
)

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def tokenizer(
    target: "Build", component: str, write: Callable, loader, published: Mapping[str, Any], **settings
):
    """``write(folder, **config)`` trains ``component``'s tokenizer into ``folder/component`` from its
    published settings, this size's overrides and ``settings``; returns it loaded back by ``loader``."""
    folder = target.folder / component
    write(folder, **target.config(component, published), **settings)
    return loader.from_pretrained(folder)


def token_ids(tokenizer, *names: str) -> dict[str, int]:
    """The ``<name>_token_id`` of each of ``names`` in ``tokenizer``; a tokenizer with no beginning of
    text (Qwen2's) begins with ``<|endoftext|>``."""
    ids = {name: getattr(tokenizer, f"{name}_token_id") for name in names}
    if "bos" in ids and ids["bos"] is None:
        ids["bos"] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return {f"{name}_token_id": value for name, value in ids.items()}


def text_encoder(
    target: "Build",
    seed: int,
    component: str,
    model_class,
    config_class,
    published: Mapping[str, Any],
    tokenizer,
    ids: tuple[str, ...] = ("bos", "eos", "pad"),
):
    """``component``, a ``model_class`` of ``config_class(published with this size's overrides)``, with
    ``tokenizer``'s ``ids`` (its vocabulary where the size says ``TOKENIZER_LENGTH``)."""
    config = target.config(component, published, tokenizer)
    return target.model(seed, model_class, config_class(**config, **token_ids(tokenizer, *ids)))


def model(target: "Build", seed: int, component: str, model_class, published: Mapping[str, Any], **settings):
    """``component``, a diffusers ``model_class`` of its published config with this size's overrides."""
    return target.model(seed, model_class, **target.config(component, published), **settings)


def clip_text(target: "Build", seed: int, names: tuple[str, str], model_class, published: Mapping[str, Any]):
    """A CLIP tokenizer and text encoder (``model_class``, with a projection or not) of ``published``'s
    sizes, as the components ``names`` (tokenizer, encoder)."""
    tokenizer_name, encoder_name = names
    clip_tokenizer = tokenizer(target, tokenizer_name, write_clip_tokenizer, CLIPTokenizer, CLIP_TOKENIZER)
    encoder = text_encoder(target, seed, encoder_name, model_class, CLIPTextConfig, published, clip_tokenizer)
    return clip_tokenizer, encoder


def t5_text(
    target: "Build",
    seed: int,
    names: tuple[str, str],
    published: Mapping[str, Any],
    published_tokenizer: Mapping[str, Any] = T5_TOKENIZER,
    model_class=T5EncoderModel,
    config_class=T5Config,
):
    """A T5 tokenizer and encoder (T5 v1.1's, or ``model_class``: UMT5's) of ``published``'s sizes, as the
    components ``names`` (tokenizer, encoder)."""
    tokenizer_name, encoder_name = names
    t5_tokenizer = tokenizer(target, tokenizer_name, write_t5_tokenizer, T5TokenizerFast, published_tokenizer)
    ids = ("pad", "eos")
    encoder = text_encoder(
        target, seed, encoder_name, model_class, config_class, published, t5_tokenizer, ids
    )
    return t5_tokenizer, encoder


def kl_vae(cfg, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """A randomly initialised (seed it first) AutoencoderKL with the preset's widths and the family's
    latent scaling and shift; one down block per width (4 keep FLUX's and SD3's 8x downsampling)."""
    blocks = len(cfg.vae_block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=cfg.vae_block_out_channels,
        layers_per_block=cfg.vae_layers_per_block,
        act_fn="silu",
        latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.vae_norm_num_groups,
        sample_size=1024,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        force_upcast=True,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    )


def t5_encoder(tokenizer, cfg) -> T5EncoderModel:
    """A randomly initialised (seed it first) T5 v1.1-style encoder (gated GELU, untied embeddings)."""
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=cfg.t5_d_model,
            d_kv=cfg.t5_d_model // cfg.t5_heads,
            d_ff=int(2.5 * cfg.t5_d_model),  # t5-v1_1-xxl: 4096 -> 10240
            num_layers=cfg.t5_layers,
            num_heads=cfg.t5_heads,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


def qwen3_tokenizer(folder, extra_text: str, model_max_length: int = 131072) -> Qwen2Tokenizer:
    """Qwen3's tokenizer, written into ``folder`` and loaded back: Qwen2's byte-level BPE with Qwen3's
    reasoning markers and chat template, the words of ``extra_text`` (the template's) single tokens."""
    write_qwen2_tokenizer(
        folder,
        extra_text,
        special_tokens=QWEN3_SPECIAL_TOKENS,
        chat_template=QWEN3_CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    return Qwen2Tokenizer.from_pretrained(folder)


def qwen3_config(tokenizer: Qwen2Tokenizer, cfg, **more) -> Qwen3Config:
    """A Qwen3 text encoder's config of the preset's text sizes (``text_hidden_size``, ``text_layers``,
    ``text_heads``, ``text_kv_heads``) over ``tokenizer``'s vocabulary and markers; ``more`` sets the
    rest."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.text_hidden_size,
        num_hidden_layers=cfg.text_layers,
        num_attention_heads=cfg.text_heads,
        num_key_value_heads=cfg.text_kv_heads,
        head_dim=cfg.text_hidden_size // cfg.text_heads,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **more,
    )
