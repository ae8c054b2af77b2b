"""The steps every family's builder takes: a tokenizer trained into the folder, a text encoder over it, a
model from its config; and the CLIP, T5 and Qwen text stacks several families share, each returned by
component name."""

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from transformers import (
    CLIPTextConfig,
    CLIPTokenizer,
    Qwen2Tokenizer,
    Qwen3Config,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from rollout_server.families.common.published import (
    CLIP_TOKENIZER,
    QWEN3_TOKENIZER,
    QWEN_VL_TOKENIZER,
    T5_TOKENIZER,
)
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


def model(
    target: "Build",
    seed: int,
    component: str,
    model_class,
    published: Mapping[str, Any],
    tokenizer=None,
    **settings,
):
    """``component``, a diffusers ``model_class`` of its published config with this size's overrides (a
    vocabulary of ``tokenizer``'s length where the size says so) and ``settings``."""
    return target.model(seed, model_class, **{**target.config(component, published, tokenizer), **settings})


TEXT = ("tokenizer", "text_encoder")  # a pipeline's first tokenizer and text encoder, by component name


def clip_text(target: "Build", seed: int, model_class, published: Mapping[str, Any], names=TEXT):
    """A CLIP tokenizer and text encoder (``model_class``, with a projection or not) of ``published``'s
    sizes, by component name (``names``: the tokenizer's, the encoder's)."""
    tokenizer_name, encoder_name = names
    clip_tokenizer = tokenizer(target, tokenizer_name, write_clip_tokenizer, CLIPTokenizer, CLIP_TOKENIZER)
    encoder = text_encoder(target, seed, encoder_name, model_class, CLIPTextConfig, published, clip_tokenizer)
    return {tokenizer_name: clip_tokenizer, encoder_name: encoder}


def t5_text(
    target: "Build",
    seed: int,
    published: Mapping[str, Any],
    names=TEXT,
    published_tokenizer: Mapping[str, Any] = T5_TOKENIZER,
    model_class=T5EncoderModel,
    config_class=T5Config,
):
    """A T5 tokenizer and encoder (T5 v1.1's, or ``model_class``: UMT5's) of ``published``'s sizes, by
    component name (``names``: the tokenizer's, the encoder's)."""
    tokenizer_name, encoder_name = names
    t5_tokenizer = tokenizer(target, tokenizer_name, write_t5_tokenizer, T5TokenizerFast, published_tokenizer)
    encoder = text_encoder(
        target, seed, encoder_name, model_class, config_class, published, t5_tokenizer, ids=("pad", "eos")
    )
    return {tokenizer_name: t5_tokenizer, encoder_name: encoder}


def qwen2_tokenizer(
    target: "Build",
    component: str,
    extra_text: str,
    published: Mapping[str, Any] = QWEN_VL_TOKENIZER,
    **settings,
) -> Qwen2Tokenizer:
    """Qwen2's byte-level BPE tokenizer as ``component``, the words of ``extra_text`` (a pipeline's
    template) single tokens, as they are in Qwen2's vocabulary; ``settings``: its special tokens and chat
    template."""
    return tokenizer(
        target, component, write_qwen2_tokenizer, Qwen2Tokenizer, published, extra_text=extra_text, **settings
    )


def qwen3_tokenizer(target: "Build", component: str, extra_text: str) -> Qwen2Tokenizer:
    """Qwen3's tokenizer as ``component``: Qwen2's with Qwen3's reasoning markers and chat template."""
    return qwen2_tokenizer(
        target,
        component,
        extra_text,
        QWEN3_TOKENIZER,
        special_tokens=QWEN3_SPECIAL_TOKENS,
        chat_template=QWEN3_CHAT_TEMPLATE,
    )


def qwen3_text(
    target: "Build", seed: int, model_class, published: Mapping[str, Any], extra_text: str, names=TEXT
):
    """Qwen3's tokenizer (``qwen3_tokenizer``) and a Qwen3 ``model_class`` of ``published``'s sizes, by
    component name (``names``: the tokenizer's, the encoder's)."""
    tokenizer_name, encoder_name = names
    qwen3 = qwen3_tokenizer(target, tokenizer_name, extra_text)
    encoder = text_encoder(target, seed, encoder_name, model_class, Qwen3Config, published, qwen3)
    return {tokenizer_name: qwen3, encoder_name: encoder}
