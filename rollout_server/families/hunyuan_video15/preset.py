"""HunyuanVideo 1.5 text-to-video's pipeline from its published configs, at a preset's size or the
checkpoint's.

Every component is the real diffusers/transformers class with HunyuanVideo 1.5's structure: a
dual-stream video DiT (HunyuanVideo15Transformer3DModel, text-to-video) over 32-channel latents with
the conditioning channels it reads (2C + 1 in, C out), a token refiner over the Qwen2.5-VL states and
a projection of the ByT5 states; the 16x spatial, 4x temporal AutoencoderKLHunyuanVideo15; a
Qwen2.5-VL text model behind Qwen2.5-VL's chat template, with a byte-level BPE Qwen2 tokenizer
trained on the pipeline's system message (whose turn it then tokenizes to exactly the 108 tokens the
pipeline crops, as the real tokenizer does); ByT5's tokenizer (bytes: it needs no files) and a T5
encoder of its 384-token vocabulary; a statically shifted flow-matching scheduler; and the CFG guider
component.
"""

import inspect
from typing import TYPE_CHECKING

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
    T5Config,
    T5EncoderModel,
)

from rollout_server.families.common import components
from rollout_server.families.common.published import QWEN_VL
from rollout_server.families.common.tokenizers import QWEN3_CHAT_TEMPLATE
from rollout_server.families.hunyuan_video15.published import (
    BYT5_SMALL,
    GUIDANCE_SCALE,
    HUNYUAN_VIDEO15_480P_T2V,
    HUNYUAN_VIDEO15_VAE,
    SCHEDULER_CONFIG,
)

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def system_message() -> str:
    """The installed pipeline's system message, the default of its text-encoding helper."""
    parameters = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    return parameters["system_message"].default


def hunyuan_video15(target: "Build") -> HunyuanVideo15Pipeline:
    """A HunyuanVideo15Pipeline of the 480p text-to-video checkpoint's components."""
    tokenizer = components.qwen2_tokenizer(
        target, "tokenizer", system_message(), chat_template=QWEN3_CHAT_TEMPLATE
    )
    tokenizer_2 = ByT5Tokenizer()
    return HunyuanVideo15Pipeline(
        text_encoder=components.text_encoder(
            target,
            2,
            "text_encoder",
            Qwen2_5_VLTextModel,
            Qwen2_5_VLTextConfig,
            QWEN_VL["text_config"],
            tokenizer,
        ),
        tokenizer=tokenizer,
        transformer=components.model(
            target, 1, "transformer", HunyuanVideo15Transformer3DModel, HUNYUAN_VIDEO15_480P_T2V
        ),
        vae=components.model(target, 0, "vae", AutoencoderKLHunyuanVideo15, HUNYUAN_VIDEO15_VAE),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        text_encoder_2=components.text_encoder(
            target, 3, "text_encoder_2", T5EncoderModel, T5Config, BYT5_SMALL, tokenizer_2, ids=("pad", "eos")
        ),
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )
