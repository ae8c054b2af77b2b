"""Every served family at its published checkpoint's size, on the meta device.

Each entry builds a checkpoint's transformer from the values of its published ``config.json`` (written
here, under the checkpoint they come from), and the components whose sizes the adapter and the server
read (the VAE, the text and image encoders, the scheduler, a tokenizer's length), all on the meta
device: no weights, no memory, no arithmetic beyond shapes. The adapter is the server's own, built over
that pipeline. The checks are what breaks only at scale, against figures worked out by hand from the
published values:

- the adapter's latent shape, generated tokens and forward size at the family's default request size
  (1024 x 1024 pixels; 480 x 832 pixels x 81 frames for video, HunyuanVideo 1.5's own 480 x 848
  x 121, Cosmos3's 720 x 1280 x 189, LTX-2's 512 x 768 x 121), and the tokens the real transformer's
  input layer makes of that latent (of each latent stream, for LTX-2's video and audio);
- the sequence-parallel split at 2, 4 and 8 ranks: the attention heads Ulysses divides, and the
  tokens of a default request;
- the memory estimate: a forward row against tokens x width, the rows the runner puts in one forward,
  the text's env, a decode piece (a whole video's, and a sound's), and a component's parameters
  against its published safetensors' bytes or parameter count;
- the family's default LoRA targets (its adapter's ``lora_targets``, which GetServerInfo lists) against
  the real module tree, laid out by the server's own check, with and without sequence parallelism.

``python tests/test_real_sizes.py`` prints the table of docs/benchmarks.md ("Real checkpoint sizes");
``test_the_table_in_the_docs_is_the_one_computed_here`` holds the docs to it. Last, on the tiny-ltx2
preset (real weights, the CPU): the estimate's decode piece against the tensors a real decode of its
longest sound makes.
"""

import dataclasses
import functools
import io
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    ClassifierFreeGuidance,
    Cosmos3OmniPipeline,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
    QwenImageEditPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
from peft import LoraConfig
from PIL import Image
from support.families import FAMILIES
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    SiglipVisionConfig,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
)

from rollout.v1 import rollout_pb2
from rollout_client.train.lora import DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK
from rollout_client.updates import lora_config_json
from rollout_server import families, memory
from rollout_server.errors import InvalidRequest, ParallelismUnsupported
from rollout_server.families.base import FamilyAdapter, MediaShape
from rollout_server.limits import Limits
from rollout_server.live_tensors import LiveTensorBytes
from rollout_server.parallel import ParallelDims, check_splittable
from rollout_server.presets import defaults_for
from rollout_server.presets.cosmos3 import SCHEDULER_CONFIG as COSMOS3_SCHEDULER_CONFIG
from rollout_server.presets.flux import FLUX_SCHEDULER_CONFIG
from rollout_server.presets.flux2 import FLUX2_SCHEDULER_CONFIG
from rollout_server.presets.hunyuan_video15 import GUIDANCE_SCALE as HUNYUAN_VIDEO15_GUIDANCE_SCALE
from rollout_server.presets.hunyuan_video15 import SCHEDULER_CONFIG as HUNYUAN_VIDEO15_SCHEDULER_CONFIG
from rollout_server.presets.ltx2 import SCHEDULER_CONFIG as LTX2_SCHEDULER_CONFIG
from rollout_server.presets.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG, _prompt_template
from rollout_server.presets.sd3 import SD3_SCHEDULER_CONFIG
from rollout_server.presets.tokenizers import (
    QWEN3_CHAT_TEMPLATE,
    QWEN3_SPECIAL_TOKENS,
    write_mistral_tokenizer,
    write_qwen2_tokenizer,
    write_t5_tokenizer,
)
from rollout_server.presets.wan import WAN22_BOUNDARY_RATIO, WAN_SCHEDULER_CONFIG
from rollout_server.presets.z_image import Z_IMAGE_SCHEDULER_CONFIG
from rollout_server.scheduler import STREAM_BUFFER
from rollout_server.stream import wav_bytes
from rollout_server.validation import ServingContext, resolve
from rollout_server.weights.spec import TransformerSpec, layout_bytes, lora_layout

# The dtype the checkpoints ship and are served in.
DTYPE = torch.bfloat16
META = torch.device("meta")
SPLITS = (2, 4, 8)
# A trainer's group: the default --group-size of rollout_client.train, on one prompt.
GROUP = 8
# What a stream's outbox may hold from earlier events, as the server counts it.
BACKLOG = STREAM_BUFFER * Limits().max_message_bytes

# The published configs. Values the diffusers or transformers class defaults to are left out.

# black-forest-labs/FLUX.1-dev transformer/config.json; FLUX.1-Kontext-dev ships the same one.
FLUX_1_DEV = {
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
# black-forest-labs/FLUX.1-dev vae/config.json.
FLUX_1_VAE = {
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 16,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
}
# black-forest-labs/FLUX.1-dev text_encoder/config.json (openai/clip-vit-large-patch14's text model);
# also stabilityai/stable-diffusion-3.5-medium text_encoder/config.json.
CLIP_L = {
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "max_position_embeddings": 77,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "projection_dim": 768,
    "vocab_size": 49408,
}
# black-forest-labs/FLUX.1-dev text_encoder_2/config.json (google/t5-v1_1-xxl's encoder); also
# stabilityai/stable-diffusion-3.5-medium text_encoder_3/config.json.
T5_XXL = {
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "feed_forward_proj": "gated-gelu",
    "num_heads": 64,
    "num_layers": 24,
    "tie_word_embeddings": False,
    "vocab_size": 32128,
}
# black-forest-labs/FLUX.1-dev tokenizer_2/tokenizer_config.json: prompts are padded to this length.
FLUX_T5_TOKENS = 512
# stabilityai/stable-diffusion-3.5-medium transformer/config.json.
SD35_MEDIUM = {
    "attention_head_dim": 64,
    "caption_projection_dim": 1536,
    "dual_attention_layers": list(range(13)),
    "in_channels": 16,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 24,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "qk_norm": "rms_norm",
    "sample_size": 128,
}
# stabilityai/stable-diffusion-3.5-medium vae/config.json: FLUX.1's autoencoder layout, its own scale.
SD35_VAE = {**FLUX_1_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
# stabilityai/stable-diffusion-3.5-medium text_encoder_2/config.json (OpenCLIP ViT-bigG/14's text model).
CLIP_G = {
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "max_position_embeddings": 77,
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "projection_dim": 1280,
    "vocab_size": 49408,
}
# Qwen/Qwen-Image transformer/config.json; Qwen/Qwen-Image-Edit ships the same one.
QWEN_IMAGE = {
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
}
# Qwen/Qwen-Image vae/config.json (its default latents_mean and latents_std are the class's).
QWEN_IMAGE_VAE = {
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}
# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct).
QWEN_VL = {
    "text_config": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 128000,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False,
        "vocab_size": 152064,
    },
    "vision_config": {
        "depth": 32,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
    },
    "tie_word_embeddings": False,
}
# Qwen2.5-VL-7B-Instruct preprocessor_config.json, the image processor of Qwen/Qwen-Image-Edit.
QWEN_VL_PROCESSOR = {
    "merge_size": 2,
    "max_pixels": 12845056,
    "min_pixels": 3136,
    "patch_size": 14,
    "temporal_patch_size": 2,
}
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (diffusers' scripts/convert_wan_to_diffusers.py).
WAN_1_3B = {
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "text_dim": 4096,
}
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json; each of Wan-AI/Wan2.2-T2V-A14B-Diffusers's two
# experts (transformer/ and transformer_2/) has the same one.
WAN_14B = {**WAN_1_3B, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer/config.json: the noisy latents, the first-frame mask
# and the first frame's latents in, and cross-attention to CLIP image embeddings.
WAN_I2V_14B = {**WAN_14B, "added_kv_proj_dim": 5120, "image_dim": 1280, "in_channels": 36}
# Wan-AI/Wan2.1-*-Diffusers vae/config.json is AutoencoderKLWan's defaults (Wan2.1_VAE.pth, as the
# conversion script builds it); text_encoder/config.json is google/umt5-xxl's encoder.
UMT5_XXL = {
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "feed_forward_proj": "gated-gelu",
    "num_heads": 64,
    "num_layers": 24,
    "tie_word_embeddings": False,
    "vocab_size": 256384,
}
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers image_encoder/config.json (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's
# vision model).
CLIP_VIT_H = {
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "image_size": 224,
    "intermediate_size": 5120,
    "num_attention_heads": 16,
    "num_hidden_layers": 32,
    "patch_size": 14,
    "projection_dim": 1024,
}

# black-forest-labs/FLUX.2-dev transformer/config.json (diffusers' scripts/convert_flux2_to_diffusers.py).
FLUX_2_DEV = {
    "attention_head_dim": 128,
    "axes_dims_rope": [32, 32, 32, 32],
    "eps": 1e-6,
    "in_channels": 128,
    "joint_attention_dim": 15360,
    "mlp_ratio": 3.0,
    "num_attention_heads": 48,
    "num_layers": 8,
    "num_single_layers": 48,
    "patch_size": 1,
    "rope_theta": 2000,
    "timestep_guidance_channels": 256,
}
# FLUX.2 [klein] 4B and 9B (the same script): no guidance embedding, narrower and shallower.
FLUX_2_KLEIN_4B = {
    **FLUX_2_DEV,
    "guidance_embeds": False,
    "joint_attention_dim": 7680,
    "num_attention_heads": 24,
    "num_layers": 5,
    "num_single_layers": 20,
}
FLUX_2_KLEIN_9B = {
    **FLUX_2_DEV,
    "guidance_embeds": False,
    "joint_attention_dim": 12288,
    "num_attention_heads": 32,
    "num_layers": 8,
    "num_single_layers": 24,
}
# Tongyi-MAI/Z-Image-Turbo transformer/config.json.
Z_IMAGE_TURBO = {
    "all_f_patch_size": [1],
    "all_patch_size": [2],
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560,
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}
# Tongyi-MAI/Z-Image-Turbo and black-forest-labs/FLUX.2-klein-4B text_encoder/config.json: Qwen3-4B's.
QWEN3_4B = {
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
}
# black-forest-labs/FLUX.2-klein-9B text_encoder/config.json: Qwen3-8B's.
QWEN3_8B = {
    **QWEN3_4B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "tie_word_embeddings": False,
}
# black-forest-labs/FLUX.2-dev text_encoder/config.json: Mistral Small 3.1 24B's (its Pixtral vision
# tower beside the language model).
MISTRAL_SMALL_3_1 = {
    "image_token_index": 10,
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "vocab_size": 131072,
    },
    "vision_config": {
        "head_dim": 64,
        "hidden_size": 1024,
        "image_size": 1540,
        "intermediate_size": 4096,
        "model_type": "pixtral",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "rope_theta": 10000.0,
    },
    "vision_feature_layer": -1,
}


# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v transformer/config.json (the "480p_t2v"
# entry of diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py, which wrote it). Its VAE is
# AutoencoderKLHunyuanVideo15's defaults (the script builds it so), its scheduler shifts by 5 and its
# guider's scale is 6 (the script's 480p_t2v entries, the preset's values).
HUNYUAN_VIDEO15_480P_T2V = {
    "attention_head_dim": 128,
    "image_embed_dim": 1152,
    "in_channels": 65,
    "num_attention_heads": 16,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "out_channels": 32,
    "rope_axes_dim": (16, 56, 56),
    "target_size": 640,
    "task_type": "t2v",
    "text_embed_2_dim": 1472,
    "text_embed_dim": 3584,
}
# google/byt5-small config.json, the ByT5 encoder of HunyuanVideo 1.5 (Glyph-SDXL-v2's weights; the
# color and font tokens it adds to the vocabulary change no size the adapter reads).
BYT5_SMALL = {
    "d_ff": 3584,
    "d_kv": 64,
    "d_model": 1472,
    "feed_forward_proj": "gated-gelu",
    "num_heads": 6,
    "num_layers": 12,
    "tie_word_embeddings": False,
    "vocab_size": 384,
}

# nvidia/Cosmos3-Nano transformer/config.json, the arguments Cosmos3OmniTransformer takes (the file
# also carries the source model's, e.g. "model_type": "qwen3_vl_text" and "use_moe", which diffusers
# ignores): Qwen3-VL-8B's text model (36 layers of 4096, 32 query and 8 key/value heads of 128) with
# a second, generation pathway in every layer, and its action and sound heads.
COSMOS3_NANO = {
    "action_dim": 64,
    "action_gen": True,
    "base_fps": 24,
    "enable_fps_modulation": True,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "latent_channel": 48,
    "latent_patch_size": 2,
    "num_attention_heads": 32,
    "num_embodiment_domains": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "patch_latent_dim": 192,
    "qk_norm_for_text": True,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000,
    "sound_dim": 64,
    "sound_gen": True,
    "sound_latent_fps": 25,
    "timestep_scale": 0.001,
    "unified_3d_mrope_reset_spatial_ids": True,
    "unified_3d_mrope_temporal_modality_margin": 15000,
    "vocab_size": 151936,
}
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json, the VAE diffusers' convert_cosmos3_to_diffusers.py
# saves with Cosmos3 (its 48 latents_mean and latents_std values change no size: zeros and ones here).
WAN_2_2_VAE = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "latents_mean": [0.0] * 48,
    "latents_std": [1.0] * 48,
}

# Lightricks/LTX-2 (LTX-2.0, the 19B audio-video model): the "2.0" entries of diffusers'
# scripts/convert_ltx2_to_diffusers.py (its transformer, video VAE, audio VAE, vocoder and connectors
# getters), which Lightricks/LTX-2's vae/ and connectors/ config.json agree with. diffusers' classes
# default to most of these values; they are all written out here, as a later LTX version's could
# become the defaults. transformer/config.json:
LTX_2 = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "vae_scale_factors": (8, 32, 32),
    "pos_embed_max_pos": 20,
    "base_height": 2048,
    "base_width": 2048,
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_patch_size": 1,
    "audio_patch_size_t": 1,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "num_layers": 48,
    "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "caption_channels": 3840,
    "attention_bias": True,
    "attention_out_bias": True,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "rope_type": "split",
    "causal_offset": 1,
    "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000,
    "use_prompt_embeddings": True,
    "gated_attn": False,
    "cross_attn_mod": False,
    "perturbed_attn": False,
}
# connectors/config.json: one projection of Gemma 3's 48 layers and its embeddings (49 x 3840), then a
# 1D transformer per modality with learnable registers in place of the padding.
LTX_2_CONNECTORS = {
    "caption_channels": 3840,
    "text_proj_in_factor": 49,
    "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128,
    "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128,
    "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128,
    "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128,
    "connector_rope_base_seq_len": 4096,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "rope_type": "split",
    "per_modality_projections": False,
    "proj_bias": False,
}
# vae/config.json: 4x4 patches and four 2x levels (32x in space), 8x in time; a causal encoder and a
# non-causal decoder without timestep conditioning.
LTX_2_VAE = {
    "latent_channels": 128,
    "block_out_channels": (256, 512, 1024, 2048),
    "decoder_block_out_channels": (256, 512, 1024),
    "layers_per_block": (4, 6, 6, 2, 2),
    "decoder_layers_per_block": (5, 5, 5, 5),
    "spatio_temporal_scaling": (True, True, True, True),
    "decoder_spatio_temporal_scaling": (True, True, True),
    "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    "upsample_residual": (True, True, True),
    "upsample_factor": (2, 2, 2),
    "timestep_conditioning": False,
    "patch_size": 4,
    "patch_size_t": 1,
    "encoder_causal": True,
    "decoder_causal": False,
    "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 8,
    "scaling_factor": 1.0,
}
# audio_vae/config.json: 16 kHz stereo mel spectrograms (64 bins, hop 160) to 8 latent channels, 4x
# in time and in mel bins, causal in time.
LTX_2_AUDIO_VAE = {
    "base_channels": 128,
    "ch_mult": (1, 2, 4),
    "num_res_blocks": 2,
    "attn_resolutions": None,
    "in_channels": 2,
    "output_channels": 2,
    "resolution": 256,
    "latent_channels": 8,
    "norm_type": "pixel",
    "causality_axis": "height",
    "sample_rate": 16000,
    "mel_hop_length": 160,
    "mel_bins": 64,
    "double_z": True,
}
# vocoder/config.json: HiFi-GAN-style, the mel frames upsampled 6 x 5 x 2 x 2 x 2 = 240 times to 24 kHz.
LTX_2_VOCODER = {
    "in_channels": 128,
    "hidden_channels": 1024,
    "out_channels": 2,
    "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_factors": [6, 5, 2, 2, 2],
    "resnet_kernel_sizes": [3, 7, 11],
    "resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "act_fn": "leaky_relu",
    "leaky_relu_negative_slope": 0.1,
    "antialias": False,
    "final_act_fn": "tanh",
    "output_sampling_rate": 24000,
}
# text_encoder/config.json: Gemma 3 12B's (Gemma3ForConditionalGeneration, its SigLIP tower included).
# Not from the conversion script, which loads the encoder by its hub id: google/gemma-3-12b-it's
# config.json as remembered here; transformers' Gemma 3 defaults fill the rest (the 5:1 pattern of
# sliding-window to global layers, the norms' epsilon, the image tokens' ids). Its parameter count,
# 12.19 B here, is not checked.
GEMMA_3_12B = {
    "text_config": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "vocab_size": 262208,
    },
    "vision_config": {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
        "vision_use_head": False,
    },
    "mm_tokens_per_image": 256,
}


def on_meta(model_class, *args, **kwargs) -> torch.nn.Module:
    """``model_class(*args, **kwargs)`` on the meta device, in the served dtype."""
    with torch.device(META):
        return model_class(*args, **kwargs).to(DTYPE)


def t5_tokenizer(folder: Path, tokens: int) -> T5TokenizerFast:
    """A T5 tokenizer that pads to ``tokens``: the adapter reads its length, not its vocabulary (a
    locally trained one, as no hub is reached)."""
    write_t5_tokenizer(folder / "tokenizer_2", 256, model_max_length=tokens)
    return T5TokenizerFast.from_pretrained(folder / "tokenizer_2")


def flux_pipeline(folder: Path, pipeline_class: type[FluxPipeline] = FluxPipeline) -> FluxPipeline:
    return pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG),
        vae=on_meta(AutoencoderKL, **FLUX_1_VAE),
        text_encoder=on_meta(CLIPTextModel, CLIPTextConfig(**CLIP_L)),
        tokenizer=None,
        text_encoder_2=on_meta(T5EncoderModel, T5Config(**T5_XXL)),
        tokenizer_2=t5_tokenizer(folder, FLUX_T5_TOKENS),
        transformer=on_meta(FluxTransformer2DModel, **FLUX_1_DEV),
    )


def sd3_pipeline(folder: Path) -> StableDiffusion3Pipeline:
    return StableDiffusion3Pipeline(
        transformer=on_meta(SD3Transformer2DModel, **SD35_MEDIUM),
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG),
        vae=on_meta(AutoencoderKL, **SD35_VAE),
        text_encoder=on_meta(CLIPTextModelWithProjection, CLIPTextConfig(**CLIP_L)),
        tokenizer=None,
        text_encoder_2=on_meta(CLIPTextModelWithProjection, CLIPTextConfig(**CLIP_G)),
        tokenizer_2=None,
        text_encoder_3=on_meta(T5EncoderModel, T5Config(**T5_XXL)),
        tokenizer_3=None,
    )


def qwen_image_components(tokenizer: Qwen2Tokenizer | None = None) -> dict:
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        "vae": on_meta(AutoencoderKLQwenImage, **QWEN_IMAGE_VAE),
        "text_encoder": on_meta(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(**QWEN_VL)),
        "tokenizer": tokenizer,
        "transformer": on_meta(QwenImageTransformer2DModel, **QWEN_IMAGE),
    }


def qwen_image_pipeline(folder: Path) -> QwenImagePipeline:
    return QwenImagePipeline(**qwen_image_components())


def qwen_image_edit_pipeline(folder: Path) -> QwenImageEditPipeline:
    """The edit adapter counts the template's tokens around the image with the tokenizer (a locally
    trained one, whose words of the template are single tokens as in Qwen2's vocabulary). The
    processor needs torchvision (for its video processor)."""
    write_qwen2_tokenizer(folder / "tokenizer", _prompt_template(QwenImageEditPipeline))
    tokenizer = Qwen2Tokenizer.from_pretrained(folder / "tokenizer")
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**QWEN_VL_PROCESSOR), tokenizer=tokenizer
    )
    return QwenImageEditPipeline(**qwen_image_components(tokenizer), processor=processor)


def wan_pipeline(folder: Path, config: dict, experts: int = 1) -> WanPipeline:
    return WanPipeline(
        tokenizer=None,
        text_encoder=on_meta(UMT5EncoderModel, UMT5Config(**UMT5_XXL)),
        vae=on_meta(AutoencoderKLWan),
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
        transformer=on_meta(WanTransformer3DModel, **config),
        transformer_2=on_meta(WanTransformer3DModel, **config) if experts == 2 else None,
        boundary_ratio=WAN22_BOUNDARY_RATIO if experts == 2 else None,
    )


def wan_i2v_pipeline(folder: Path) -> WanImageToVideoPipeline:
    return WanImageToVideoPipeline(
        tokenizer=None,
        text_encoder=on_meta(UMT5EncoderModel, UMT5Config(**UMT5_XXL)),
        vae=on_meta(AutoencoderKLWan),
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
        image_processor=None,
        image_encoder=on_meta(CLIPVisionModelWithProjection, CLIPVisionConfig(**CLIP_VIT_H)),
        transformer=on_meta(WanTransformer3DModel, **WAN_I2V_14B),
    )


def flux2_klein_pipeline(folder: Path, transformer: dict, text_encoder: dict) -> Flux2KleinPipeline:
    """The adapter reads the tokenizer's length (a locally trained Qwen2 one: the real one is longer
    than the pipeline's 512) and the text encoder's depth."""
    write_qwen2_tokenizer(folder / "tokenizer", "")
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=on_meta(AutoencoderKLFlux2),
        text_encoder=on_meta(Qwen3ForCausalLM, Qwen3Config(**text_encoder)),
        tokenizer=Qwen2Tokenizer.from_pretrained(folder / "tokenizer"),
        transformer=on_meta(Flux2Transformer2DModel, **transformer),
    )


def flux2_dev_pipeline(folder: Path) -> Flux2Pipeline:
    """As [klein]'s, with Mistral's tokenizer (a real checkpoint's sits in a processor that needs
    torchvision; the adapter reads the tokenizer's length either way)."""
    write_mistral_tokenizer(folder / "tokenizer", "", model_max_length=131072)
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG),
        vae=on_meta(AutoencoderKLFlux2),
        text_encoder=on_meta(Mistral3ForConditionalGeneration, Mistral3Config(**MISTRAL_SMALL_3_1)),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer"),
        transformer=on_meta(Flux2Transformer2DModel, **FLUX_2_DEV),
    )


def z_image_pipeline(folder: Path) -> ZImagePipeline:
    """Z-Image decodes with FLUX.1's VAE; the adapter reads no tokenizer (its text length is the
    pipeline's 512)."""
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER_CONFIG),
        vae=on_meta(AutoencoderKL, **FLUX_1_VAE),
        text_encoder=on_meta(Qwen3Model, Qwen3Config(**QWEN3_4B)),
        tokenizer=None,
        transformer=on_meta(ZImageTransformer2DModel, **Z_IMAGE_TURBO),
    )


def hunyuan_video15_pipeline(folder: Path) -> HunyuanVideo15Pipeline:
    """The adapter reads no tokenizer: its text lengths are the pipeline's (1000 and 256)."""
    return HunyuanVideo15Pipeline(
        text_encoder=on_meta(Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig(**QWEN_VL["text_config"])),
        tokenizer=None,
        transformer=on_meta(HunyuanVideo15Transformer3DModel, **HUNYUAN_VIDEO15_480P_T2V),
        vae=on_meta(AutoencoderKLHunyuanVideo15),
        scheduler=FlowMatchEulerDiscreteScheduler(**HUNYUAN_VIDEO15_SCHEDULER_CONFIG),
        text_encoder_2=on_meta(T5EncoderModel, T5Config(**BYT5_SMALL)),
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=HUNYUAN_VIDEO15_GUIDANCE_SCALE),
    )


def cosmos3_pipeline(folder: Path) -> Cosmos3OmniPipeline:
    """Cosmos3's text tokenizer is Qwen3-VL's (a Qwen2 tokenizer with ``<|vision_start|>``, which the
    pipeline looks up): a locally trained one, as the adapter reads no size of it. No safety checker."""
    write_qwen2_tokenizer(
        folder / "text_tokenizer", "", special_tokens=QWEN3_SPECIAL_TOKENS, chat_template=QWEN3_CHAT_TEMPLATE
    )
    return Cosmos3OmniPipeline(
        transformer=on_meta(Cosmos3OmniTransformer, **COSMOS3_NANO),
        text_tokenizer=Qwen2Tokenizer.from_pretrained(folder / "text_tokenizer"),
        vae=on_meta(AutoencoderKLWan, **WAN_2_2_VAE),
        scheduler=UniPCMultistepScheduler(**COSMOS3_SCHEDULER_CONFIG),
        enable_safety_checker=False,
    )


def ltx2_pipeline(folder: Path) -> LTX2Pipeline:
    """The adapter reads no tokenizer: its text length is the pipeline's 1024."""
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER_CONFIG),
        vae=on_meta(AutoencoderKLLTX2Video, **LTX_2_VAE),
        audio_vae=on_meta(AutoencoderKLLTX2Audio, **LTX_2_AUDIO_VAE),
        text_encoder=on_meta(
            Gemma3ForConditionalGeneration,
            Gemma3Config(
                text_config=Gemma3TextConfig(**GEMMA_3_12B["text_config"]),
                vision_config=SiglipVisionConfig(**GEMMA_3_12B["vision_config"]),
                mm_tokens_per_image=GEMMA_3_12B["mm_tokens_per_image"],
            ),
        ),
        tokenizer=None,
        connectors=on_meta(LTX2TextConnectors, **LTX_2_CONNECTORS),
        transformer=on_meta(LTX2VideoTransformer3DModel, **LTX_2),
        vocoder=on_meta(LTX2Vocoder, **LTX_2_VOCODER),
    )


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint, and its figures at the family's default request size, by hand."""

    name: str
    family: str
    pipeline: Callable[[Path], DiffusionPipeline]  # on the meta device; tokenizers are written to the folder
    latent_shape: tuple[int, ...]  # one sample's latent
    generated_tokens: int
    forward: tuple[int, int]  # a row's tokens (generated, conditioning and text) and widest activation
    text_elements: int  # one text's env at its longest
    forward_rows: int  # rows of one forward, for a group of GROUP samples (and their CFG branches)
    ulysses_refused: frozenset[int] = frozenset()  # the SP degrees a Ulysses split is refused at
    # The SP degrees whose ranks the default request's generated tokens do not divide: validation
    # refuses it there, naming height.
    uneven_splits: frozenset[int] = frozenset()
    # (frames, height, width) of the default request: 1 x 1024 x 1024, or 81 x 480 x 832 for video,
    # unless given.
    default_media: tuple[int, int, int] | None = None
    # The bytes of a component's published safetensors (the total_size of its index), where known.
    published_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # A component's parameters in billions, as published (rounded to the digits given), where known.
    published_parameters: dict[str, str] = dataclasses.field(default_factory=dict)
    # The shapes of a sample's latent streams, for a family with several (LTX-2: video, then audio).
    latent_streams: tuple[tuple[int, ...], ...] = ()
    # A family with sound: one sample's waveform values (channels x samples) at the default size, and
    # the sound decode's widest activation on the adapter's probe, in bytes per waveform value (its
    # tensors at once hold at least that).
    audio_values: int = 0
    sound_width: float = 0.0
    # Bytes of the tensors that grow with the square of a sequence: in one transformer row's forward,
    # and in one decode piece at the default size.
    attention_matrix_bytes: int = 0
    decode_attention_bytes: int = 0


# FLUX.1 at 1024 x 1024: 8x VAE, 2x2 packing: 64 x 64 = 4096 tokens of 4 x 16 channels; the joint
# attention adds the 512 T5 tokens; a single block's attention output (3072) beside its 4x MLP hidden
# state is 5 x 3072 wide. Its text: 512 x 4096 T5 states and the 768-wide pooled CLIP projection.
FLUX_FIGURES = {
    "latent_shape": (4096, 64),
    "generated_tokens": 4096,
    "forward": (4096 + 512, 5 * 3072),
    "text_elements": 512 * 4096 + 768,
    "forward_rows": 8,  # no CFG: 8 rows, max_batch_size
}
# FLUX.2 at 1024 x 1024: 8x VAE of 32 channels, 2x2 patches packed: 4096 tokens of 128; the 512 text
# tokens join them; a single block's fused projection is (3 + 2 x mlp_ratio 3) x the attention width
# (heads x 128). Its text: three stacked layers of the encoder. [klein]'s CFG makes 16 rows and
# [dev] has none: max_batch_size 8 either way.
FLUX2_FIGURES = {"latent_shape": (4096, 128), "generated_tokens": 4096, "forward_rows": 8}
WAN_LATENT = (16, 21, 60, 104)  # 81 frames: 1 + 80 / 4 latent frames of 480 / 8 x 832 / 8
WAN_TOKENS = 21 * 30 * 52  # 1 x 2 x 2 patches
# CFG doubles the group's rows to 16; the 2,096,640-element latent fits 4 times in the default
# max_latent_elements (8 Mi), so 4 rows a forward.
WAN_FORWARD_ROWS = 4
# LTX-2 at the pipeline's default, 121 frames of 768 x 512: 32x VAE of 128 channels, 8x in time, 1 x 1
# patches: 1 + 120 / 8 latent frames of 512 / 32 x 768 / 32 video tokens; its audio: 121 frames at
# 24 fps are 5.04 s, 25 latent frames a second (16 kHz, hop 160, 4x), round(126.04) frames of 8
# channels x 64 / 4 mel bins. One joint latent of both.
LTX_2_VIDEO_TOKENS = 16 * 16 * 24
LTX_2_AUDIO_FRAMES = 126
LTX_2_CHECKPOINT = Checkpoint(
    "Lightricks/LTX-2",
    "ltx2",
    ltx2_pipeline,
    default_media=(121, 512, 768),
    latent_shape=(LTX_2_VIDEO_TOKENS * 128 + LTX_2_AUDIO_FRAMES * 128,),
    latent_streams=((LTX_2_VIDEO_TOKENS, 128), (LTX_2_AUDIO_FRAMES, 128)),
    generated_tokens=LTX_2_VIDEO_TOKENS,  # the video's, which --sp splits
    # Both streams' tokens; the video feed-forward's 4 x 4096, the widest (the audio's is 4 x 2048).
    forward=(LTX_2_VIDEO_TOKENS + LTX_2_AUDIO_FRAMES, 4 * 4096),
    # The connectors' video and audio states (30 x 128 wide each) of the 1024 padded text tokens, and
    # their one mask.
    text_elements=1024 * (30 * 128 + 30 * 128 + 1),
    # CFG doubles the group's rows to 16; the 802,560-element joint latent fits 10 times in the default
    # max_latent_elements (8 Mi): max_batch_size's 8 rows a forward.
    forward_rows=8,
    # Its 32 video and 32 audio heads divide by 2, 4 and 8 (the adapter's plan), and so do the 6144
    # video tokens.
    ulysses_refused=frozenset(),
    # The sound: the audio VAE's 4 x 126 mel frames less the 3 of its causal padding, each 240 samples
    # of the vocoder's, in stereo. Its widest tensor is the audio VAE's last upsampling, interpolated
    # before its convolution: 256 channels x 64 mel bins x 2 (2 L - 1) frames of the probe's L = 9
    # latent frames (9 video frames), in bf16, per value of the 2 x (4 L - 3) x 240 it decodes to.
    audio_values=2 * (4 * LTX_2_AUDIO_FRAMES - 3) * 240,
    sound_width=2 * 256 * 64 * 2 * (2 * 9 - 1) / (2 * (4 * 9 - 3) * 240),
    # LTX-2.0's components' parameter counts as cited with its configs (the "19B" of its name is the
    # transformer's 18.88 B); its published safetensors' bytes are not checked here.
    published_parameters={
        "transformer": "18.88",
        "connectors": "1.43",
        "vae": "1.22",
        "audio_vae": "0.053",
        "vocoder": "0.056",
    },
)
CHECKPOINTS = (
    Checkpoint(
        "black-forest-labs/FLUX.1-dev",
        "flux",
        flux_pipeline,
        **FLUX_FIGURES,
        # metadata.total_size of transformer/diffusion_pytorch_model.safetensors.index.json and of
        # text_encoder_2/model.safetensors.index.json.
        published_bytes={"transformer": 23802816640, "text_encoder_2": 9524621312},
    ),
    Checkpoint(
        "black-forest-labs/FLUX.1-Kontext-dev",
        "flux-kontext",
        functools.partial(flux_pipeline, pipeline_class=FluxKontextPipeline),
        # The conditioning image at the request's size adds as many tokens as it generates.
        **{**FLUX_FIGURES, "forward": (2 * 4096 + 512, 5 * 3072)},
    ),
    Checkpoint(
        "stabilityai/stable-diffusion-3.5-medium",
        "sd3",
        sd3_pipeline,
        latent_shape=(16, 128, 128),
        generated_tokens=64 * 64,  # 2 x 2 patches of the 128 x 128 latent
        forward=(64 * 64 + 77 + 256, 4 * 1536),  # CLIP's 77 and T5's 256 text tokens; 4x feed-forward
        text_elements=(77 + 256) * 4096 + 2048,
        forward_rows=8,  # CFG: 16 rows, max_batch_size 8
        ulysses_refused=frozenset(SPLITS),  # no context-parallel plan in diffusers
    ),
    Checkpoint(
        "Qwen/Qwen-Image",
        "qwen-image",
        qwen_image_pipeline,
        latent_shape=(4096, 64),
        generated_tokens=4096,
        forward=(4096 + 512, 4 * 3072),  # the 512 longest prompt tokens; 4x feed-forward
        text_elements=512 * 3584,
        forward_rows=8,
        # metadata.total_size of transformer/ and text_encoder/'s safetensors indexes.
        published_bytes={"transformer": 40860802176, "text_encoder": 16584333312},
    ),
    Checkpoint(
        "Qwen/Qwen-Image-Edit",
        "qwen-image-edit",
        qwen_image_edit_pipeline,
        latent_shape=(4096, 64),
        generated_tokens=4096,
        # The image's 4096 latent tokens; the text: the VL encoder's 37 x 37 merged image patches (1024
        # px to 1036, the nearest 28), the 1024 longest prompt tokens and the template's 7 others.
        forward=(2 * 4096 + 37 * 37 + 1024 + 7, 4 * 3072),
        # At its longest the image fills max_pixels: 12845056 / 28^2 = 16384 image tokens.
        text_elements=(16384 + 1024 + 7) * 3584,
        forward_rows=8,
    ),
    Checkpoint(
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "wan",
        functools.partial(wan_pipeline, config=WAN_1_3B),
        latent_shape=WAN_LATENT,
        generated_tokens=WAN_TOKENS,
        forward=(WAN_TOKENS, 8960),  # the feed-forward, wider than q, k and v (3 x 1536)
        text_elements=512 * 4096,
        forward_rows=WAN_FORWARD_ROWS,
        ulysses_refused=frozenset({8}),  # 12 heads
    ),
    Checkpoint(
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "wan",
        functools.partial(wan_pipeline, config=WAN_14B),
        latent_shape=WAN_LATENT,
        generated_tokens=WAN_TOKENS,
        forward=(WAN_TOKENS, 3 * 5120),  # q, k and v, wider than the feed-forward (13824)
        text_elements=512 * 4096,
        forward_rows=WAN_FORWARD_ROWS,
    ),
    Checkpoint(
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "wan",
        functools.partial(wan_pipeline, config=WAN_14B, experts=2),
        latent_shape=WAN_LATENT,
        generated_tokens=WAN_TOKENS,
        forward=(WAN_TOKENS, 3 * 5120),
        text_elements=512 * 4096,
        forward_rows=WAN_FORWARD_ROWS,
    ),
    Checkpoint(
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        "wan-i2v",
        wan_i2v_pipeline,
        latent_shape=WAN_LATENT,  # the condition enters on channels: the latent stays 16 wide
        generated_tokens=WAN_TOKENS,
        forward=(WAN_TOKENS, 3 * 5120),
        text_elements=512 * 4096 + (16 * 16 + 1) * 1280,  # and CLIP's 224 / 14 squared patches + class
        forward_rows=WAN_FORWARD_ROWS,
    ),
    Checkpoint(
        "black-forest-labs/FLUX.2-klein-4B",
        "flux2-klein",
        functools.partial(flux2_klein_pipeline, transformer=FLUX_2_KLEIN_4B, text_encoder=QWEN3_4B),
        **{
            **FLUX2_FIGURES,
            "forward": (4096 + 512, 9 * 24 * 128),
            "text_elements": 512 * 7680,  # three Qwen3-4B layers of 2560
        },
    ),
    Checkpoint(
        "black-forest-labs/FLUX.2-klein-9B",
        "flux2-klein",
        functools.partial(flux2_klein_pipeline, transformer=FLUX_2_KLEIN_9B, text_encoder=QWEN3_8B),
        **{**FLUX2_FIGURES, "forward": (4096 + 512, 9 * 32 * 128), "text_elements": 512 * 12288},
    ),
    Checkpoint(
        "black-forest-labs/FLUX.2-dev",
        "flux2",
        flux2_dev_pipeline,
        **{**FLUX2_FIGURES, "forward": (4096 + 512, 9 * 48 * 128), "text_elements": 512 * 15360},
    ),
    Checkpoint(
        "Tongyi-MAI/Z-Image-Turbo",
        "z-image",
        z_image_pipeline,
        latent_shape=(16, 128, 128),  # unpacked, 8x VAE
        generated_tokens=64 * 64,  # 2 x 2 patches, already a multiple of 32
        # The unified sequence: the image's tokens and the 512 caption tokens, each padded to a
        # multiple of 32; the gated feed-forward's two projections, int(3840 / 3 * 8) each.
        forward=(64 * 64 + 512, 2 * 10240),
        text_elements=512 * 2560,
        forward_rows=8,  # CFG: 16 rows, max_batch_size 8
        ulysses_refused=frozenset({4, 8}),  # 30 heads
    ),
    Checkpoint(
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
        "hunyuan-video15",
        hunyuan_video15_pipeline,
        # The pipeline's default: 121 frames at the 16:9 size its target_size (640) picks, 848 x 480;
        # 16x VAE of 32 channels, 4x in time: 1 + 120 / 4 latent frames of 480 / 16 x 848 / 16.
        default_media=(121, 480, 848),
        latent_shape=(32, 31, 30, 53),
        generated_tokens=31 * 30 * 53,  # 1 x 1 x 1 patches
        # Joint attention over the video tokens, the 1000 Qwen2.5-VL tokens, the 256 ByT5 bytes and
        # the 729 image tokens; the 4x feed-forward (16 x 128 wide), wider than q, k and v.
        forward=(31 * 30 * 53 + 1000 + 256 + 729, 4 * 2048),
        # The three contexts' states, and the two text masks.
        text_elements=1000 * (3584 + 1) + 256 * (1472 + 1) + 729 * 1152,
        # CFG doubles the group's rows to 16; the 1,577,280-element latent fits 5 times in the
        # default max_latent_elements (8 Mi), so 5 rows a forward.
        forward_rows=5,
        # Our plan (families/hunyuan_video15.py); its 16 heads divide by 2, 4 and 8. The default's
        # 31 x 30 x 53 = 2 x 24645 tokens split across 2 ranks, not 4 or 8 (848 x 480 is the size
        # the pipeline picks for 16:9; 832 x 480, 31 x 30 x 52 = 8 x 6045 tokens, splits across 8).
        uneven_splits=frozenset({4, 8}),
        # The token refiner's masks over the 1000 Qwen2.5-VL tokens: two booleans, and per head (16) a
        # boolean and SDPA's bf16 copy (the blocks' joint attention takes a key mask: none).
        attention_matrix_bytes=1000**2 * (2 + 16 * (1 + 2)),
        # The VAE decoder's mid-block attention over the 31 x 30 x 53 latent tokens: its causal mask
        # in bf16 and the math kernel's two float32 scores.
        decode_attention_bytes=(31 * 30 * 53) ** 2 * (2 + 2 * 4),
    ),
    Checkpoint(
        "nvidia/Cosmos3-Nano",
        "cosmos3",
        cosmos3_pipeline,
        # The pipeline's default: 189 frames of 1280 x 720; 16x VAE of 48 channels, 4x in time:
        # 1 + 188 / 4 latent frames of 720 / 16 x 1280 / 16.
        default_media=(189, 720, 1280),
        latent_shape=(48, 48, 45, 80),
        generated_tokens=48 * 23 * 40,  # 2 x 2 patches, the odd 45 rows padded to 46
        # One packed sequence: the vision tokens after at most 4096 text tokens (the adapter's
        # bound); the gated feed-forward's 12288, wider than q, k and v ((32 + 2 x 8) x 128).
        forward=(48 * 23 * 40 + 4096, 12288),
        text_elements=5 * 4096,  # input_ids, text_indexes and three mRoPE rows of the longest text
        # CFG doubles the group's rows to 16; the 8,294,400-element latent fits once in the default
        # max_latent_elements (8 Mi), so 1 row a forward (the transformer takes one sample anyway).
        forward_rows=1,
        # The adapter's seams and processor; its 32 query and 8 key/value heads divide by 2, 4 and 8,
        # and so do the default's 48 x 23 x 40 = 8 x 5520 vision tokens (the text splits unevenly).
    ),
    LTX_2_CHECKPOINT,
)


def build(checkpoint: Checkpoint, folder: Path) -> FamilyAdapter:
    """The server's adapter of ``checkpoint``, over its pipeline on the meta device."""
    adapter_class = next(a for a in families.ADAPTERS.values() if a.family == checkpoint.family)
    return adapter_class(checkpoint.pipeline(folder), META, DTYPE)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Callable[[Checkpoint], FamilyAdapter]:
    built: dict[str, FamilyAdapter] = {}

    def adapter(checkpoint: Checkpoint) -> FamilyAdapter:
        if missing := FAMILIES[checkpoint.family].missing:
            pytest.skip(f"{checkpoint.name} cannot be assembled here: {missing}")
        if checkpoint.name not in built:
            built[checkpoint.name] = build(checkpoint, tmp_path_factory.mktemp("tokenizers"))
        return built[checkpoint.name]

    return adapter


@pytest.fixture(scope="module")
def figures(adapters) -> Callable[[Checkpoint], "Figures"]:
    measured: dict[str, Figures] = {}

    def of(checkpoint: Checkpoint) -> Figures:
        if checkpoint.name not in measured:
            measured[checkpoint.name] = Figures.of(checkpoint, adapters(checkpoint))
        return measured[checkpoint.name]

    return of


def default_shape(adapter: FamilyAdapter) -> MediaShape:
    defaults = adapter.defaults()
    return MediaShape(defaults.frames, defaults.height, defaults.width)


def group_request(adapter: FamilyAdapter, split: int) -> rollout_pb2.RolloutRequest:
    """A trainer's group at the family's defaults (size, steps, CFG, images on), resolved by the
    server's validation with ``split`` sequence-parallel ranks; InvalidRequest if it cannot run."""
    request = rollout_pb2.RolloutRequest(prompts=["a red fox in the snow"], samples_per_prompt=GROUP)
    if adapter.takes_images:
        image = io.BytesIO()
        Image.new("RGB", (64, 64), "red").save(image, format="PNG")
        request.condition_images.add(data=image.getvalue())
    serving = ServingContext.of(adapter, adapter.defaults(), Limits(), seq_len_divisor=split)
    return resolve(request, serving)


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def weight_bytes(pipe: DiffusionPipeline) -> int:
    """What the loaded pipeline holds on each rank: every component's parameters and buffers."""
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


def default_request_refused(adapter: FamilyAdapter, split: int) -> bool:
    """Whether validation refuses the default request at ``split`` ranks (its tokens do not divide)."""
    try:
        group_request(adapter, split)
    except InvalidRequest:
        return True
    return False


def split_refusal(adapter: FamilyAdapter, split: int) -> str:
    """Why a Ulysses split across ``split`` ranks is refused at start-up ("" if it is not)."""
    try:
        for expert in adapter.experts.values():
            check_splittable(expert, ParallelDims(split, "ulysses", split))
    except ParallelismUnsupported as error:
        return str(error)
    return ""


def lora_config(targets: list[str]) -> str:
    """The trainer's default LoRA on ``targets``, as its updates' header carries it."""
    return lora_config_json(
        LoraConfig(r=DEFAULT_LORA_RANK, lora_alpha=DEFAULT_LORA_ALPHA, target_modules=targets)
    )


@dataclasses.dataclass(frozen=True)
class Figures:
    """What the server's code makes of a checkpoint at its default request: the table's figures."""

    parameters: tuple[int, ...]  # each expert's
    weights: int  # every component's bytes, on each rank
    peaks: dict[int, int | None]  # by SP degree: the weights and the estimate's peak (None: refused)
    full_update: int  # one expert's tensors
    lora_update: int  # the trainer's default adapter on one expert
    lora_under_sp: str  # the server's refusal of that adapter under --sp ("" if it takes it)

    @classmethod
    def of(cls, checkpoint: Checkpoint, adapter: FamilyAdapter) -> "Figures":
        weights = weight_bytes(adapter.pipe)
        profile = adapter.measure_vae()
        budget = memory.MemoryBudget(0, Limits())
        peaks = {}
        for split in (1, *SPLITS):
            estimate = memory.estimate(adapter, profile, group_request(adapter, 1), BACKLOG, split)
            refused = split > 1 and (split_refusal(adapter, split) or default_request_refused(adapter, split))
            peaks[split] = None if refused else weights + budget.peak([estimate])
        # The server's own checks: the spec it takes of a loaded transformer under --sp, and the
        # adapter laid out on it (without the split's modules to avoid, when it refuses the adapter).
        split_spec = TransformerSpec.of(next(iter(adapter.experts.values())), sequence_parallel=True)
        config = lora_config(list(adapter.lora_targets))
        try:
            lora, refusal = lora_layout(split_spec, config), ""
        except InvalidRequest as error:
            lora, refusal = lora_layout(dataclasses.replace(split_spec, unwrappable=()), config), str(error)
        return cls(
            parameters=tuple(parameters(expert) for expert in adapter.experts.values()),
            weights=weights,
            peaks=peaks,
            full_update=split_spec.tensor_bytes,
            lora_update=layout_bytes(lora),
            lora_under_sp=refusal,
        )


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.name)
def test_the_adapter_sizes_the_default_request_as_the_published_values_say(adapters, checkpoint):
    adapter = adapters(checkpoint)
    shape = default_shape(adapter)
    usual = (81, 480, 832) if adapter.max_frames > 1 else (1, 1024, 1024)
    assert (shape.frames, shape.height, shape.width) == (checkpoint.default_media or usual)
    assert adapter.latent_shape(shape) == checkpoint.latent_shape
    assert adapter.generated_tokens(shape) == checkpoint.generated_tokens
    assert adapter.forward_activation(shape) == checkpoint.forward
    assert adapter.text_elements() == checkpoint.text_elements
    sigmas, timesteps = adapter.schedule(adapter.defaults().num_steps, shape)
    assert len(sigmas) == len(timesteps) == adapter.defaults().num_steps + 1
    streams = adapter.latent_streams(shape)
    assert tuple(stream.shape for stream in streams) == checkpoint.latent_streams
    if streams:
        # LTX-2: the joint latent is cut into its streams, each fed under its own argument to its own
        # input projection (patches of 1), which makes a token of each row; the video's are generated.
        layers = {"hidden_states": "proj_in", "audio_hidden_states": "audio_proj_in"}
        with torch.no_grad():
            for stream in streams:
                sample = torch.empty(1, *stream.shape, device=META, dtype=DTYPE)
                embedded = getattr(adapter.transformer, layers[stream.argument])(sample)
                assert embedded.shape[1] == stream.shape[0]
        assert streams[0].shape[0] == checkpoint.generated_tokens
        return
    # The real transformer's input layer takes the latent as the adapter shapes it (with the
    # conditioning's channels, for a family that concatenates them), and makes that many tokens.
    for expert in adapter.experts.values():
        layer_name = next(
            n
            for n in ("x_embedder", "img_in", "pos_embed", "patch_embedding", "all_x_embedder", "proj_in")
            if hasattr(expert, n)
        )
        latent = list(checkpoint.latent_shape)
        channels = -1 if len(latent) == 2 else 0
        in_channels = getattr(expert.config, "in_channels", None) or expert.config.latent_channel  # Cosmos3's
        if adapter.conditioning.concat != rollout_pb2.CONDITIONING_CONCAT_CHANNELS:
            assert latent[channels] == in_channels
        latent[channels] = in_channels
        with torch.no_grad():
            sample = torch.empty(1, *latent, device=META, dtype=DTYPE)
            if layer_name == "all_x_embedder":  # Z-Image patchifies each sample [C, 1, H, W] itself
                patches, _, _ = expert._patchify_image(sample[0].unsqueeze(1), 2, 1)
                embedded = expert.all_x_embedder["2-1"](patches).unsqueeze(0)
            elif layer_name == "proj_in":  # Cosmos3 patchifies and packs its list of samples itself
                patches, _ = expert._patchify_and_pack_latents([sample])
                embedded = expert.proj_in(patches).unsqueeze(0)
            else:
                embedded = getattr(expert, layer_name)(sample)
        tokens = embedded.shape[1] if embedded.dim() == 3 else math.prod(embedded.shape[2:])
        assert tokens == checkpoint.generated_tokens


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.name)
def test_the_split_across_2_4_and_8_ranks(adapters, checkpoint):
    """Ulysses divides the attention heads (every expert's) among the ranks; the default request's
    tokens (generated and appended conditioning) then cut into equal parts, or validation names
    height."""
    adapter = adapters(checkpoint)
    refused = {split for split in SPLITS if split_refusal(adapter, split)}
    assert refused == checkpoint.ulysses_refused
    # A transformer without a plan is never split: its tokens need not cut evenly.
    no_plan = all("no context-parallel plan" in split_refusal(adapter, split) for split in SPLITS)
    shape = default_shape(adapter)
    tokens = adapter.generated_tokens(shape) + adapter.conditioning_tokens(shape)
    for split in () if no_plan else SPLITS:
        if split in checkpoint.uneven_splits:
            with pytest.raises(InvalidRequest) as raised:
                group_request(adapter, split)
            assert raised.value.violations == [
                (
                    "height",
                    f"{shape.height} x {shape.width} pixels, {shape.frames} frame(s): {tokens} tokens, "
                    f"which do not split evenly across {split} ranks",
                )
            ]
            continue
        assert MediaShape.of(group_request(adapter, split)) == shape
        assert tokens % split == 0


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.name)
def test_the_memory_estimate_at_scale(adapters, checkpoint):
    """A trainer's group at the default size: each forward row is 6 x its tokens x the widest
    activation plus its text, in bf16, each rank's share of the tokens under SP, plus what grows with
    the square of a sequence; a forward takes the rows the runner gives it; a decode piece is the
    larger of a video piece (a whole video where the VAE decodes one at once, with its attention's
    squares) and the sound's decode, each its probe's tensors per pixel (or waveform value) at once;
    an image-conditioned family's image encode is its probe's too; a component's parameters are its
    published checkpoint's bytes, or its published count."""
    adapter = adapters(checkpoint)
    tokens, width = checkpoint.forward
    profile = adapter.measure_vae()
    # A video VAE with a causal cache decodes a latent frame (4 frames) a piece; one without, the
    # whole probe (1 + 4 frames; LTX-2's 1 + 8) at once, and so a whole sample: its piece is the
    # default request's every frame.
    video_piece = 4 if adapter.decode_keeps_state else 1 + adapter.frame_step
    assert profile.frames_per_piece == (video_piece if adapter.max_frames > 1 else 1)
    assert profile.whole_sample == (adapter.max_frames > 1 and not adapter.decode_keeps_state)
    # Only a decode with a cache keeps tensors between its pieces.
    assert (profile.kept_bytes > 0) == adapter.decode_keeps_state
    shape = default_shape(adapter)
    assert adapter.audio_values(shape) == checkpoint.audio_values
    assert profile.sound_bytes >= checkpoint.sound_width
    pixels = profile.piece_frames(shape.frames) * shape.height * shape.width
    video_piece_bytes = math.ceil(pixels * profile.piece_bytes) + pixels * memory.FRAME_BYTES_PER_PIXEL
    # The sound decodes after the frames, beside the last piece's images: its tensors, the waveform's
    # float32 copies and WAV bytes (20 bytes a value), 4 bytes a pixel of the images.
    values = checkpoint.audio_values
    sound_bytes = values and math.ceil(values * profile.sound_bytes) + 20 * values + 4 * pixels
    assert memory.sound_piece(adapter, profile, shape, pixels) == sound_bytes
    video_piece_bytes += checkpoint.decode_attention_bytes
    budget = memory.MemoryBudget(0, Limits())
    for split in (1, *SPLITS):
        estimate = memory.estimate(adapter, profile, group_request(adapter, 1), BACKLOG, split)
        activations = (-(-tokens // split) * width * 6 + checkpoint.text_elements) * 2
        assert estimate.row_bytes == activations + checkpoint.attention_matrix_bytes
        assert budget.forward_rows(estimate, estimate.rows) == checkpoint.forward_rows
        assert estimate.decode_bytes == max(video_piece_bytes, sound_bytes)
        assert estimate.encode_bytes == (profile.encode(shape) if adapter.takes_images else 0)
    for component, size in checkpoint.published_bytes.items():
        assert 2 * parameters(getattr(adapter.pipe, component)) == size  # bf16
    for component, billions in checkpoint.published_parameters.items():
        # Rounded as published: to half a unit of its last digit.
        digits = len(billions.split(".")[1])
        assert f"{parameters(getattr(adapter.pipe, component)) / 1e9:.{digits}f}" == billions, component


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: c.name)
def test_the_default_lora_targets_name_modules_of_the_real_tree(adapters, figures, checkpoint):
    """Each target of the family's default LoRA matches linear layers of the published transformers
    (as PEFT matches a name: the whole name or its dotted end), and the server lays the trainer's
    default adapter out on it. Under sequence parallelism no target may wrap a module whose output
    the split gathers: FLUX's proj_out is one (its latent projection out)."""
    adapter = adapters(checkpoint)
    targets = adapter.lora_targets
    for expert in adapter.experts.values():
        modules = dict(expert.named_modules())
        for target in targets:
            matched = [m for name, m in modules.items() if name == target or name.endswith("." + target)]
            assert matched and all(isinstance(m, torch.nn.Linear) for m in matched), target
    measured = figures(checkpoint)
    assert measured.lora_update > 0
    if "proj_out" in targets:
        assert "may not wrap ['proj_out']" in measured.lora_under_sp
    else:
        assert measured.lora_under_sp == ""


def test_ltx2s_lora_targets_adapt_every_attention_and_feed_forward_of_both_streams(
    adapters, family_resources
):
    """LTX-2's default targets wrap, in every block of the published transformer and of the tiny-ltx2
    preset's, the four projections of each of its six attentions (video and audio self-attention and
    prompt cross-attention, audio-to-video and video-to-audio) and both streams' feed-forwards: 28
    linear layers a block, and nothing else."""
    attentions = (
        "attn1",
        "audio_attn1",
        "attn2",
        "audio_attn2",
        "audio_to_video_attn",
        "video_to_audio_attn",
    )
    per_block = [f"{a}.{p}" for a in attentions for p in ("to_q", "to_k", "to_v", "to_out.0")]
    per_block += [f"{ff}.{layer}" for ff in ("ff", "audio_ff") for layer in ("net.0.proj", "net.2")]
    for adapter in (adapters(LTX_2_CHECKPOINT), family_resources.adapter("ltx2")):
        transformer = adapter.transformer
        matched = [
            name
            for name, _ in transformer.named_modules()
            if any(name == target or name.endswith("." + target) for target in adapter.lora_targets)
        ]
        blocks = range(transformer.config.num_layers)
        assert sorted(matched) == sorted(
            f"transformer_blocks.{i}.{name}" for i in blocks for name in per_block
        )
        assert all(isinstance(transformer.get_submodule(name), torch.nn.Linear) for name in matched)


def gib(size: int) -> str:
    return f"{size / 2**30:.1f}"


def row(checkpoint: Checkpoint, adapter: FamilyAdapter, measured: Figures) -> str:
    """The checkpoint's line of the table."""
    shape = default_shape(adapter)
    counts = " + ".join(f"{count / 1e9:.2f} B" for count in measured.parameters)
    peaks = " / ".join("-" if peak is None else gib(peak) for peak in measured.peaks.values())
    size = f"{shape.width} x {shape.height}" + (f" x {shape.frames}" if shape.frames > 1 else "")
    tokens = f"{adapter.generated_tokens(shape)} ({adapter.forward_activation(shape)[0]})"
    return (
        f"| {checkpoint.name} | {counts} | {size} | {tokens} | {gib(measured.weights)} | {peaks} | "
        f"{gib(measured.full_update)} | {measured.lora_update / 2**20:.1f} |"
    )


TABLE_HEADER = (
    "| checkpoint | transformer parameters | default size | tokens (in a forward) | weights, GiB | "
    "est. peak per GPU at SP 1 / 2 / 4 / 8, GiB | FULL update, GiB | LoRA r=8 update, MiB |\n"
    "|---|---|---|---|---|---|---|---|"
)


def table(adapter: Callable[[Checkpoint], FamilyAdapter], figures: Callable[[Checkpoint], Figures]) -> str:
    served = [c for c in CHECKPOINTS if not FAMILIES[c.family].missing]
    return "\n".join([TABLE_HEADER, *(row(c, adapter(c), figures(c)) for c in served)])


def test_the_table_in_the_docs_is_the_one_computed_here(adapters, figures):
    docs = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    assert table(adapters, figures) in docs


def test_the_decode_piece_covers_a_real_decode_of_the_tiny_ltx2_presets_longest_sound(family_resources):
    """tiny-ltx2 at its longest sound, 241 frames (10 s) at 64 x 64 (the least video beside it): the
    request's estimate has room for the tensors that decoding one sample makes, piece by piece as the
    runner decodes it: the whole video and its frames (the VAE decodes every frame at once), then the
    sound and its WAV, within the estimate's own sound term.

    On this CPU the sound decode's resident memory, in a fresh process, peaked at 70 to 78 MiB, mostly
    the vocoder's oneDNN convolutions over the tiny preset's narrow tensors
    (docs/architecture.md#the-memory-budget): within its term (146 MiB), which counts what glibc keeps
    of them and their reorders."""
    adapter = family_resources.adapter("ltx2")
    serving = ServingContext.of(adapter, defaults_for("tiny-ltx2", adapter.defaults()), Limits())
    request = rollout_pb2.RolloutRequest(prompts=["a drum"], num_frames=241, height=64, width=64)
    request = resolve(request, serving)
    assert request.images and (request.num_frames, request.samples_per_prompt) == (241, 1)
    shape = MediaShape.of(request)
    profile = adapter.measure_vae()
    estimate = memory.estimate(adapter, profile, request, BACKLOG)
    latents = torch.randn(1, *adapter.latent_shape(shape), generator=torch.Generator().manual_seed(0))
    with LiveTensorBytes() as video:
        frames = [len(images) for images in adapter.decode_frames(latents, shape)]
    with LiveTensorBytes() as sound:
        wav = wav_bytes(adapter.decode_audio(latents, shape))
    assert frames == [241]  # one piece
    assert len(wav) == memory.WAV_HEADER_BYTES + 2 * adapter.audio_values(shape)
    assert video.peak <= estimate.decode_bytes
    assert sound.peak <= memory.sound_piece(adapter, profile, shape, 0) <= estimate.decode_bytes
    # Both are far above the piece the estimate counted before: a video piece of the probe's 9 frames
    # (4.6 MB here, where the video's tensors took 47 MB and the sound's 19 MB), and no sound.
    probe_pixels = profile.frames_per_piece * shape.height * shape.width
    probe_piece = math.ceil(probe_pixels * profile.piece_bytes) + probe_pixels * memory.FRAME_BYTES_PER_PIXEL
    assert probe_piece < sound.peak < video.peak


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        built = {
            c.name: build(c, Path(scratch) / c.name) for c in CHECKPOINTS if not FAMILIES[c.family].missing
        }
        print(table(lambda c: built[c.name], lambda c: Figures.of(c, built[c.name])))
