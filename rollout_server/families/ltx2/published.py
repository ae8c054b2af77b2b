"""LTX-2's published configs."""

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
