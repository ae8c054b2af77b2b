"""LTX-2's text-to-video+audio pipeline from its published configs, at a preset's size or the
checkpoint's.

Every component is the real diffusers/transformers class with LTX-2's (2.0's) structure: an audio-video
DiT (LTX2VideoTransformer3DModel) with a video and an audio stream, each with self-attention, prompt
cross-attention and the audio-to-video / video-to-audio cross-attention between them, over LTX-2's
128-channel video latents and 8-channel audio latents, with the transformer's own caption projections
and split RoPE; the 32x spatial, 8x temporal AutoencoderKLLTX2Video (4x4 patches, causal encoder,
non-causal decoder without timestep conditioning); the mel-spectrogram AutoencoderKLLTX2Audio (4x in
time and in mel bins) and the LTX2Vocoder (HiFi-GAN-style, x240 to 24 kHz); the LTX2TextConnectors
(LTX-2.0's: one projection of all of the text encoder's layers, per-modality 1D transformers with
learnable registers in place of padding); a Gemma 3 text encoder (Gemma3ForConditionalGeneration, its
SigLIP tower included, 5 sliding-window layers to 1 global, linearly scaled global RoPE) behind a
byte-fallback BPE Gemma tokenizer that pads on the left; and the flow-matching scheduler with LTX-2's
resolution-dependent shift.
"""

from typing import TYPE_CHECKING

from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GemmaTokenizer,
    SiglipVisionConfig,
)

from rollout_server.families.common import components
from rollout_server.families.common.tokenizers import write_gemma_tokenizer
from rollout_server.families.ltx2.published import (
    GEMMA_3_12B,
    GEMMA_3_TOKENIZER,
    LTX_2,
    LTX_2_AUDIO_VAE,
    LTX_2_CONNECTORS,
    LTX_2_VAE,
    LTX_2_VOCODER,
    SCHEDULER_CONFIG,
)

if TYPE_CHECKING:
    from rollout_server.families.common.build import Build


def ltx2(target: "Build") -> LTX2Pipeline:
    """An LTX2Pipeline of LTX-2.0's components."""
    tokenizer = components.tokenizer(
        target, "tokenizer", write_gemma_tokenizer, GemmaTokenizer, GEMMA_3_TOKENIZER
    )
    gemma = target.config("text_encoder", GEMMA_3_12B, tokenizer)
    markers = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    boi_token_index, eoi_token_index, image_token_index = tokenizer.convert_tokens_to_ids(list(markers))
    text_encoder = target.model(
        5,
        Gemma3ForConditionalGeneration,
        Gemma3Config(
            text_config=Gemma3TextConfig(
                **gemma["text_config"], **components.token_ids(tokenizer, "pad", "bos", "eos")
            ),
            vision_config=SiglipVisionConfig(**gemma["vision_config"]),
            mm_tokens_per_image=gemma["mm_tokens_per_image"],
            boi_token_index=boi_token_index,
            eoi_token_index=eoi_token_index,
            image_token_index=image_token_index,
        ),
    )
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=components.model(target, 0, "vae", AutoencoderKLLTX2Video, LTX_2_VAE),
        audio_vae=components.model(target, 1, "audio_vae", AutoencoderKLLTX2Audio, LTX_2_AUDIO_VAE),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=components.model(target, 4, "connectors", LTX2TextConnectors, LTX_2_CONNECTORS),
        transformer=components.model(target, 3, "transformer", LTX2VideoTransformer3DModel, LTX_2),
        vocoder=components.model(target, 2, "vocoder", LTX2Vocoder, LTX_2_VOCODER),
    )
