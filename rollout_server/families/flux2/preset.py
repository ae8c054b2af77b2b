"""FLUX.2 [klein] and [dev]'s pipelines from their published configs, at a preset's size or a
checkpoint's.

Every component is the real diffusers/transformers class with FLUX.2's structure (a
Flux2Transformer2DModel of double- and single-stream blocks with 4-D RoPE, AutoencoderKLFlux2 with its
2x2 patches' batch-norm statistics and 8x downsampling, a dynamic-shift scheduler). [klein] has a Qwen3
text encoder behind the Qwen3 chat template, no guidance embedding, and is the CFG-trained base
(``is_distilled`` False); [dev] has a Mistral3 text encoder (Mistral Small 3.1's, with its Pixtral vision
tower) behind Mistral's chat template, and embeds the guidance scale.

[dev]'s tokenizer is a tokenizer, not the Mistral processor a real checkpoint ships (Pixtral's image
processor beside the tokenizer), which transformers builds only with torchvision; Flux2Pipeline's
text-only prompt encoding reads the tokenizer alone.
"""

from typing import TYPE_CHECKING

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen3ForCausalLM,
)

from rollout_server.families.common import components
from rollout_server.families.common.published import QWEN3_4B
from rollout_server.families.common.tokenizers import write_mistral_tokenizer
from rollout_server.families.flux2.published import (
    FLUX2_SCHEDULER,
    FLUX_2_DEV,
    FLUX_2_KLEIN_4B,
    FLUX_2_VAE,
    MISTRAL_SMALL_3_1,
    MISTRAL_TOKENIZER,
)

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def flux2_klein(target: "Build", transformer=FLUX_2_KLEIN_4B, text_encoder=QWEN3_4B) -> Flux2KleinPipeline:
    """A Flux2KleinPipeline of [klein]'s components (4B's; ``transformer`` and ``text_encoder`` name
    another's), the CFG-trained base."""
    # The words of the chat template's turns are single tokens, as in Qwen3's vocabulary.
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=_vae(target),
        **components.qwen3_text(target, 2, Qwen3ForCausalLM, text_encoder, "user\nassistant\n"),
        transformer=components.model(target, 0, "transformer", Flux2Transformer2DModel, transformer),
        is_distilled=False,
    )


def flux2(target: "Build") -> Flux2Pipeline:
    """A Flux2Pipeline of FLUX.2 [dev]'s components."""
    # The words of the pipeline's system message are single tokens, as in Mistral's vocabulary.
    tokenizer = components.tokenizer(
        target,
        "tokenizer",
        write_mistral_tokenizer,
        PreTrainedTokenizerFast,
        MISTRAL_TOKENIZER,
        extra_text=SYSTEM_MESSAGE,
    )
    config = target.config("mistral", MISTRAL_SMALL_3_1, tokenizer)
    config["text_config"] |= components.token_ids(tokenizer, "bos", "eos", "pad")
    config["image_token_index"] = tokenizer.convert_tokens_to_ids("[IMG]")
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=_vae(target),
        text_encoder=target.model(2, Mistral3ForConditionalGeneration, Mistral3Config(**config)),
        tokenizer=tokenizer,
        transformer=components.model(target, 0, "transformer", Flux2Transformer2DModel, FLUX_2_DEV),
    )


def _vae(target: "Build") -> AutoencoderKLFlux2:
    vae = components.model(target, 1, "vae", AutoencoderKLFlux2, FLUX_2_VAE)
    # A trained VAE's batch-norm statistics of its patches: random here, away from (0, 1), so a decode
    # that skipped them would differ.
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.2 * torch.randn(vae.bn.num_features))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.num_features))
    return vae
