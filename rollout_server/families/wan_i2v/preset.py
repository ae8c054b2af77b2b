"""Wan 2.1 image-to-video's pipeline from its published configs, at a preset's size or the checkpoint's:
text-to-video's components, a transformer reading the noisy latents, the first-frame mask and the first
frame's latents, and a CLIP vision tower whose image embeddings it cross-attends to. The image processor's
PIL backend gives the same numbers whether or not torchvision is installed."""

from typing import TYPE_CHECKING

from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

from rollout_server.families.wan.preset import umt5_text, wan_transformer, wan_vae
from rollout_server.families.wan.published import WAN_SCHEDULER_CONFIG
from rollout_server.families.wan_i2v.published import CLIP_VIT_H, CLIP_VIT_H_PROCESSOR, WAN_I2V_14B

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def wan_i2v(target: "Build", image_encoder_class=CLIPVisionModel) -> WanImageToVideoPipeline:
    """A WanImageToVideoPipeline of Wan 2.1 I2V 14B's components. The pipeline reads the image encoder's
    penultimate states, never its projection: the published checkpoint ships one
    (CLIPVisionModelWithProjection, as diffusers' conversion script saves it), the presets none."""
    vision = CLIPVisionConfig(**target.config("image_encoder", CLIP_VIT_H))
    image_encoder = target.model(4, image_encoder_class, vision)
    return WanImageToVideoPipeline(
        **umt5_text(target),
        vae=wan_vae(target),
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
        image_processor=CLIPImageProcessorPil(**target.config("image_processor", CLIP_VIT_H_PROCESSOR)),
        image_encoder=image_encoder,
        transformer=wan_transformer(target, 5, WAN_I2V_14B),
    )
