"""Qwen-Image and Qwen-Image-Edit's pipelines from their published configs, at a preset's size or a
checkpoint's.

Every component is the real diffusers/transformers class with Qwen-Image's structure (MMDiT over 2x2-packed
latents with 3-D RoPE, 8x video VAE with per-channel latent statistics, a Qwen2.5-VL text encoder behind the
chat prompt template, byte-level BPE Qwen2 tokenizer, dynamic-shift scheduler); only the widths, depths and
Qwen-Image-Edit has Qwen-Image's components under QwenImageEditPipeline, its tokenizer trained on the edit
template, and the Qwen2-VL processor that feeds the conditioning image to the text encoder's vision tower.
"""

from typing import TYPE_CHECKING

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
)
from transformers.utils import is_torchvision_available

from rollout_server.families.common import components
from rollout_server.families.common.published import QWEN_VL
from rollout_server.families.qwen_image.published import (
    QWEN_IMAGE,
    QWEN_IMAGE_SCHEDULER_CONFIG,
    QWEN_IMAGE_VAE,
    QWEN_VL_PROCESSOR,
)

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def _prompt_template(pipeline_class: type[QwenImagePipeline | QwenImageEditPipeline]) -> str:
    """The installed pipeline's prompt template, read off an empty pipeline (__init__ sets it)."""
    components, _ = pipeline_class._get_signature_keys(pipeline_class)
    return pipeline_class(**dict.fromkeys(components)).prompt_template_encode.format("")


def qwen_image(target: "Build") -> QwenImagePipeline:
    """A QwenImagePipeline of Qwen-Image's components."""
    return QwenImagePipeline(**qwen_image_components(target, QwenImagePipeline))


def qwen_image_edit(target: "Build") -> QwenImageEditPipeline:
    """A QwenImageEditPipeline of Qwen-Image's components, with the processor that tokenizes the edit
    template and cuts the image into patches."""
    if not is_torchvision_available():
        # Qwen2VLProcessor requires a video processor, which transformers has only with torchvision.
        raise ImportError("the Qwen-Image-Edit pipeline needs torchvision: its Qwen2VLProcessor does")
    parts = qwen_image_components(target, QwenImageEditPipeline)
    image_processor = Qwen2VLImageProcessorPil(**target.config("processor", QWEN_VL_PROCESSOR))
    return QwenImageEditPipeline(
        **parts, processor=Qwen2VLProcessor(image_processor=image_processor, tokenizer=parts["tokenizer"])
    )


def qwen_image_components(
    target: "Build", pipeline_class: type[QwenImagePipeline | QwenImageEditPipeline]
) -> dict:
    """Qwen-Image's components by pipeline component name; the tokenizer (whose words of
    ``pipeline_class``'s prompt template are single tokens, as in Qwen2's vocabulary) is written into
    the folder."""
    tokenizer = components.qwen2_tokenizer(target, "tokenizer", _prompt_template(pipeline_class))
    config = target.config("text_encoder", QWEN_VL, tokenizer)
    config["text_config"] |= components.token_ids(tokenizer, "bos", "eos")
    markers = ("image_pad", "video_pad", "vision_start", "vision_end")
    image_token_id, video_token_id, vision_start_token_id, vision_end_token_id = (
        tokenizer.convert_tokens_to_ids(f"<|{marker}|>") for marker in markers
    )
    text_encoder = target.model(
        2,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLConfig(
            **config,
            image_token_id=image_token_id,
            video_token_id=video_token_id,
            vision_start_token_id=vision_start_token_id,
            vision_end_token_id=vision_end_token_id,
        ),
    )
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        "vae": components.model(target, 0, "vae", AutoencoderKLQwenImage, QWEN_IMAGE_VAE),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": components.model(target, 1, "transformer", QwenImageTransformer2DModel, QWEN_IMAGE),
    }
