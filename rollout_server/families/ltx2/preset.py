"""Seeded, randomly initialised LTX-2-shaped text-to-video+audio pipelines for tests and benchmarks.

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
resolution-dependent shift. Only the widths, depths and vocabulary are shrunk, and the mel bins with
them (the audio VAE's per-channel statistics are as wide as one packed audio token: base_channels =
latent_channels x mel_bins / 4, which LTX-2's 128 = 8 x 64 / 4 satisfies).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
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

from rollout_server.families.common.tokenizers import write_gemma_tokenizer


@dataclass(frozen=True)
class LTX2PresetConfig:
    num_layers: int
    num_attention_heads: int  # divisible by 2: Ulysses sequence parallelism splits heads
    attention_head_dim: int
    audio_num_attention_heads: int  # divisible by 2; equal to the video's, as split RoPE on a2v needs
    audio_attention_head_dim: int
    latent_channels: int
    vae_block_out_channels: tuple[int, int, int, int]  # 4 levels of 2x: with the 4x4 patches, 32x
    vae_decoder_block_out_channels: tuple[int, int, int]
    audio_latent_channels: int
    mel_bins: int
    audio_ch_mult: tuple[int, ...]  # 3 levels: the 4x the pipeline assumes in time and mel bins
    vocoder_hidden_channels: int  # halved at each of the 5 upsamplers
    connector_heads: int  # x connector_head_dim = text_hidden_size (LTX-2.0's connectors keep the width)
    connector_head_dim: int
    connector_layers: int
    connector_registers: int  # divides the padded text length (the pipeline's 1024, the tokenizer's max)
    text_hidden_size: int  # the transformer's and the connectors' caption_channels
    text_layers: int  # the connectors read all of them and the embeddings: text_layers + 1
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_max_length: int  # the tokenizer's model_max_length, a multiple of connector_registers
    vocab_size: int


LTX2_PRESET_CONFIGS = {
    "tiny": LTX2PresetConfig(
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=32,
        audio_num_attention_heads=2,
        audio_attention_head_dim=16,
        latent_channels=128,  # LTX-2's
        vae_block_out_channels=(8, 16, 32, 64),  # LTX-2's / 32
        vae_decoder_block_out_channels=(8, 16, 32),  # LTX-2's / 32
        audio_latent_channels=8,  # LTX-2's
        mel_bins=16,  # LTX-2's / 4
        audio_ch_mult=(1, 2, 4),  # LTX-2's
        vocoder_hidden_channels=64,  # LTX-2's / 16
        connector_heads=2,
        connector_head_dim=16,
        connector_layers=1,
        connector_registers=128,  # LTX-2's
        text_hidden_size=32,
        text_layers=6,  # one period of Gemma 3's 5 local : 1 global pattern
        text_heads=2,
        text_kv_heads=1,
        text_head_dim=16,
        text_max_length=128,
        vocab_size=1024,
    ),
}
# LTX-2's scheduler (diffusers' scripts/convert_ltx2_to_diffusers.py): the pipeline passes
# linspace(1, 1/N, N) as sigmas and mu = calculate_shift(video tokens, 1024, 4096, 0.95, 2.05).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
}
# LTX-2's audio front end: 16 kHz mel spectrograms at a hop of 160 (100 mel frames, 25 latents a second).
AUDIO_SAMPLE_RATE = 16000
AUDIO_HOP_LENGTH = 160
VOCODER_SAMPLE_RATE = 24000  # 240 waveform samples per mel frame: the vocoder's upsampling factors' product


def build_ltx2_preset(folder: Path, size: str = "tiny") -> None:
    """Builds the `size` preset and saves it as a float32 LTX2Pipeline into `folder`."""
    cfg = LTX2_PRESET_CONFIGS[size]
    folder = Path(folder)
    write_gemma_tokenizer(folder / "tokenizer", cfg.vocab_size, model_max_length=cfg.text_max_length)
    tokenizer = GemmaTokenizer.from_pretrained(folder / "tokenizer")
    video_dim = cfg.num_attention_heads * cfg.attention_head_dim
    audio_dim = cfg.audio_num_attention_heads * cfg.audio_attention_head_dim
    audio_token_dim = cfg.audio_latent_channels * cfg.mel_bins // 4  # one packed audio latent frame

    # A fixed seed per component keeps each one stable when another component's config changes.
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=cfg.latent_channels,
        block_out_channels=cfg.vae_block_out_channels,
        down_block_types=("LTX2VideoDownBlock3D",) * 4,
        decoder_block_out_channels=cfg.vae_decoder_block_out_channels,
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        resnet_norm_eps=1e-6,
        scaling_factor=1.0,
        encoder_causal=True,
        decoder_causal=False,
        encoder_spatial_padding_mode="zeros",
        decoder_spatial_padding_mode="reflect",
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    )
    torch.manual_seed(1)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=audio_token_dim,  # its latents_mean/std normalise packed audio tokens
        output_channels=2,
        ch_mult=cfg.audio_ch_mult,
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=256,
        latent_channels=cfg.audio_latent_channels,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=AUDIO_SAMPLE_RATE,
        mel_hop_length=AUDIO_HOP_LENGTH,
        is_causal=True,
        mel_bins=cfg.mel_bins,
        double_z=True,
    )
    torch.manual_seed(2)
    vocoder = LTX2Vocoder(
        in_channels=2 * cfg.mel_bins,  # the decoded stereo mel spectrogram, channels x mel bins
        hidden_channels=cfg.vocoder_hidden_channels,
        out_channels=2,
        upsample_kernel_sizes=[16, 15, 8, 4, 4],
        upsample_factors=[6, 5, 2, 2, 2],
        resnet_kernel_sizes=[3, 7, 11],
        resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        act_fn="leaky_relu",
        leaky_relu_negative_slope=0.1,
        antialias=False,
        final_act_fn="tanh",
        final_bias=True,
        output_sampling_rate=VOCODER_SAMPLE_RATE,
    )
    torch.manual_seed(3)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        cross_attention_dim=video_dim,  # the caption projection's output
        vae_scale_factors=(8, 32, 32),
        pos_embed_max_pos=20,
        base_height=2048,
        base_width=2048,
        gated_attn=False,
        cross_attn_mod=False,
        audio_in_channels=audio_token_dim,
        audio_out_channels=audio_token_dim,
        audio_patch_size=1,
        audio_patch_size_t=1,
        audio_num_attention_heads=cfg.audio_num_attention_heads,
        audio_attention_head_dim=cfg.audio_attention_head_dim,
        audio_cross_attention_dim=audio_dim,
        audio_scale_factor=4,
        audio_pos_embed_max_pos=20,
        audio_sampling_rate=AUDIO_SAMPLE_RATE,
        audio_hop_length=AUDIO_HOP_LENGTH,
        audio_gated_attn=False,
        audio_cross_attn_mod=False,
        num_layers=cfg.num_layers,
        activation_fn="gelu-approximate",
        qk_norm="rms_norm_across_heads",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        caption_channels=cfg.text_hidden_size,
        attention_bias=True,
        attention_out_bias=True,
        rope_theta=10000.0,
        rope_double_precision=True,
        causal_offset=1,
        timestep_scale_multiplier=1000,
        cross_attn_timestep_scale_multiplier=1000,
        rope_type="split",
        use_prompt_embeddings=True,
        perturbed_attn=False,
    )
    torch.manual_seed(4)
    connectors = LTX2TextConnectors(
        caption_channels=cfg.text_hidden_size,
        text_proj_in_factor=cfg.text_layers + 1,
        video_connector_num_attention_heads=cfg.connector_heads,
        video_connector_attention_head_dim=cfg.connector_head_dim,
        video_connector_num_layers=cfg.connector_layers,
        video_connector_num_learnable_registers=cfg.connector_registers,
        video_gated_attn=False,
        audio_connector_num_attention_heads=cfg.connector_heads,
        audio_connector_attention_head_dim=cfg.connector_head_dim,
        audio_connector_num_layers=cfg.connector_layers,
        audio_connector_num_learnable_registers=cfg.connector_registers,
        audio_gated_attn=False,
        connector_rope_base_seq_len=4096,
        rope_theta=10000.0,
        rope_double_precision=True,
        causal_temporal_positioning=False,
        rope_type="split",
        per_modality_projections=False,
        proj_bias=False,
    )
    torch.manual_seed(5)
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=Gemma3TextConfig(
                vocab_size=len(tokenizer),
                hidden_size=cfg.text_hidden_size,
                intermediate_size=4 * cfg.text_hidden_size,  # Gemma 3 12B: 3840 -> 15360
                num_hidden_layers=cfg.text_layers,
                num_attention_heads=cfg.text_heads,
                num_key_value_heads=cfg.text_kv_heads,
                head_dim=cfg.text_head_dim,
                query_pre_attn_scalar=cfg.text_head_dim,
                hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=131072,
                rms_norm_eps=1e-6,
                sliding_window=1024,
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                },
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
            ),
            # Gemma 3's SigLIP tower, which text-to-video never runs (only an image prompt would).
            vision_config=SiglipVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=56,
                patch_size=14,
                vision_use_head=False,
            ),
            mm_tokens_per_image=4,  # 4x4 patches pooled 2x2, as Gemma 3 pools 64x64 to 16x16
            boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
            eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
            image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
        )
    )
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
