"""LTX-2's published configs, and the size of the preset built from them."""

from rollout_server.families.common.build import TOKENIZER_LENGTH

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
# tokenizer/: Gemma 3's, whose model_max_length is the length the pipeline pads prompts to.
GEMMA_3_TOKENIZER = {"vocab_size": 262144, "model_max_length": 1024}
# scheduler/scheduler_config.json (the conversion script's): the pipeline passes linspace(1, 1/N, N) as
# sigmas and mu = calculate_shift(video tokens, 1024, 4096, 0.95, 2.05).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
}

# The preset: LTX-2's latent channels (video 128, audio 8), its widths / 16 or / 32, a quarter of its
# mel bins. The audio VAE's per-channel statistics are as wide as one packed audio token: base_channels =
# latent_channels x mel_bins / 4 (LTX-2's 128 = 8 x 64 / 4; here 8 x 16 / 4 = 32).
AUDIO_TOKEN = 8 * 16 // 4
TINY = {
    "vae": {
        "block_out_channels": (8, 16, 32, 64),  # 4 levels of 2x: with the 4x4 patches, 32x
        "decoder_block_out_channels": (8, 16, 32),
        "layers_per_block": (1, 1, 1, 1, 1),
        "decoder_layers_per_block": (1, 1, 1, 1),
    },
    "audio_vae": {"base_channels": AUDIO_TOKEN, "num_res_blocks": 1, "mel_bins": 16},
    # The decoded stereo mel spectrogram, channels x mel bins; halved at each of the 5 upsamplers.
    "vocoder": {"in_channels": 2 * 16, "hidden_channels": 64},
    "transformer": {
        "num_layers": 2,
        "num_attention_heads": 2,  # divisible by 2: Ulysses sequence parallelism splits heads
        "attention_head_dim": 32,
        "cross_attention_dim": 2 * 32,  # the caption projection's output
        # Equal to the video's heads, as split RoPE on a2v needs.
        "audio_num_attention_heads": 2,
        "audio_attention_head_dim": 16,
        "audio_cross_attention_dim": 2 * 16,
        "audio_in_channels": AUDIO_TOKEN,
        "audio_out_channels": AUDIO_TOKEN,
        "caption_channels": 32,  # the text encoder's width
    },
    "connectors": {
        "caption_channels": 32,
        "text_proj_in_factor": 6 + 1,  # the text encoder's layers and its embeddings
        # Heads x head dim is the text width, as LTX-2.0's connectors keep it.
        "video_connector_num_attention_heads": 2,
        "video_connector_attention_head_dim": 16,
        "video_connector_num_layers": 1,
        "audio_connector_num_attention_heads": 2,
        "audio_connector_attention_head_dim": 16,
        "audio_connector_num_layers": 1,
    },
    # The padded text length: a multiple of the connectors' 128 registers.
    "tokenizer": {"vocab_size": 1024, "model_max_length": 128},
    "text_encoder": {
        "text_config": {
            "vocab_size": TOKENIZER_LENGTH,
            "hidden_size": 32,
            "intermediate_size": 4 * 32,  # Gemma 3 12B: 3840 -> 15360
            "num_hidden_layers": 6,  # one period of Gemma 3's 5 local : 1 global pattern
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
        },
        # Gemma 3's SigLIP tower, which text-to-video never runs (only an image prompt would).
        "vision_config": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 56,
        },
        "mm_tokens_per_image": 4,  # 4x4 patches pooled 2x2, as Gemma 3 pools 64x64 to 16x16
    },
}
