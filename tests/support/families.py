"""The model families the suite runs: each one's tiny preset and the conventions a trainer replays it with,
keyed by family name, and the request every family's contract checks start from."""

import dataclasses

from transformers.utils import is_torchvision_available

from rollout.v1 import rollout_pb2
from rollout_core import wire
from rollout_server.families import registry
from support.family_spec import Family, Sp2Row
from support.parity import TOLERANCE
from support.requests import SAMPLERS, condition_png, make_request

# FluxTransformer2DModel's kwargs besides hidden_states and timestep (guidance is None without an embedding).
FLUX_ENV_KEYS = frozenset(
    {
        "encoder_hidden_states",
        "pooled_projections",
        "guidance",
        "txt_ids",
        "img_ids",
        "joint_attention_kwargs",
        "return_dict",
    }
)
# Flux2Transformer2DModel's kwargs besides hidden_states and timestep (guidance is None for [klein]).
FLUX2_ENV_KEYS = frozenset(
    {"encoder_hidden_states", "txt_ids", "img_ids", "guidance", "joint_attention_kwargs", "return_dict"}
)
SHORT_PROMPT = "a fox"
LONG_PROMPT = "A cozy cabin in the mountains covered with fresh snow, warm light in the windows."
# FLUX.1-dev: packed 2x2 tokens, embedded guidance, true CFG.
# GetServerInfo.features of every server, in the order it lists them; a server adds its own after them.
SERVED_FEATURES = [
    "lora",
    "tree",
    "prune_points",
    "weight_sync",
    "sigmas",
    "initial_latents",
    "release_memory",
    "previews",
]
# The prompts and seed of the SP=2 rows that run their own request, and the videos' 9 frames with CFG 5.
SP_PROMPTS = {"prompts": ["a red fox in the snow", "two cats"], "base_seed": 17}
VIDEO_SP2 = {"num_frames": 9, "guidance_scale": 5.0, "negative_prompt": "blurry"}
FLUX = Family(
    preset="tiny-flux",
    transformer="FluxTransformer2DModel",
    pipeline="FluxPipeline",
    prompts=("a red fox in the snow", "two cats"),
    base_seed=11,
    cfg_on={"true_cfg_scale": 3.0, "negative_prompt": "blurry, low quality"},
    cfg_off={},
    timestep_divisor=1000.0,
    cfg_rule=("true_cfg", 3.0),
    env_keys=FLUX_ENV_KEYS,
    latent_shape=(16, 16),  # 4 x 4 packed tokens of 4 x 4 channels
    replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
    replay_latent_dtypes=("float32", "bfloat16"),
)
# Qwen-Image: every prompt has its own text length, and true CFG rescales to the positive norm.
QWEN_IMAGE = Family(
    preset="tiny-qwen-image",
    server_info={
        "family": "qwen-image",
        "pipeline_class": "QwenImagePipeline",
        "cfg_scale_field": "true_cfg_scale",
        "cfg_rule": "true_cfg_norm_rescale",
        "timestep_rule": "timestep / 1000",
        **{"defaults.height": 128, "defaults.width": 128, "defaults.num_steps": 10},  # the preset's
        **{"defaults.guidance_scale": 1.0, "defaults.true_cfg_scale": 4.0},  # Qwen-Image's
        "defaults.noise_level": 0.7,
        "limits.side_multiple": 16,  # 8x VAE, 2x2 patches
        **{"limits.max_frames": 1, "defaults.num_frames": 1},  # an image family
    },
    # Prompts of odd, different lengths: diffusers' uneven Ulysses split of the text tokens.
    sp2=Sp2Row(
        {**SP_PROMPTS, "prompts": ["a fox", "an old lighthouse on a rocky cliff at dusk, oil painting"]},
        uneven_text=True,
    ),
    transformer="QwenImageTransformer2DModel",
    pipeline="QwenImagePipeline",
    prompts=(SHORT_PROMPT, LONG_PROMPT),
    base_seed=31,
    cfg_on={"true_cfg_scale": 4.0, "negative_prompt": "blurry"},
    cfg_off={"true_cfg_scale": 1.0},
    timestep_divisor=1000.0,
    cfg_rule=("true_cfg_norm_rescale", 4.0),
    env_keys=frozenset(
        {
            "encoder_hidden_states",
            "encoder_hidden_states_mask",
            "img_shapes",
            "guidance",
            "attention_kwargs",
            "return_dict",
        }
    ),
    latent_shape=(16, 4 * 16),  # 4 x 4 packed tokens of 4 x 16 channels
)
# Wan 2.1: video latents, the raw integer timestep, classic CFG on guidance_scale.
WAN = Family(
    preset="tiny-wan",
    server_info={
        "family": "wan",
        "pipeline_class": "WanPipeline",
        **{"cfg_scale_field": "guidance_scale", "cfg_rule": "true_cfg", "timestep_rule": "timestep"},
        "transformers": ["transformer"],
        "features": [*SERVED_FEATURES, "video"],
        **{"defaults.height": 64, "defaults.width": 64, "defaults.num_frames": 5, "defaults.num_steps": 10},
        "defaults.guidance_scale": 5.0,  # Wan 2.1's
        # 8x VAE, 1x2x2 patches
        **{"limits.side_multiple": 16, "limits.frame_step": 4, "limits.max_frames": 161},
    },
    refused_frames=(2, 4, 6, 200),
    # 9 frames: 3 latent frames of 8 x 8, 2 x 2 patches: 3 x 4 x 4 tokens.
    sp2=Sp2Row({**SP_PROMPTS, **VIDEO_SP2}, layout=(16, 3, 8, 8)),
    transformer="WanTransformer3DModel",
    pipeline="WanPipeline",
    prompts=("a red fox in the snow", "two cats"),
    base_seed=41,
    cfg_on={"guidance_scale": 5.0, "negative_prompt": "blurry"},
    cfg_off={"guidance_scale": 1.0},
    timestep_divisor=1.0,
    cfg_rule=("true_cfg", 5.0),
    env_keys=frozenset({"encoder_hidden_states", "attention_kwargs", "return_dict"}),
    latent_shape=(16, 2, 8, 8),  # the preset's 5 frames: 2 latent frames of 8 x 8
    replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
    text_width="text_dim",
)

FAMILIES = {
    "flux": FLUX,
    # FLUX.1 Kontext: FLUX's call with the conditioning image's packed latents appended to the tokens.
    "flux-kontext": dataclasses.replace(
        FLUX,
        preset="tiny-flux-kontext",
        server_info={
            "family": "flux-kontext",
            "pipeline_class": "FluxKontextPipeline",
            "cfg_scale_field": "true_cfg_scale",
            "cfg_rule": "true_cfg",
            "timestep_rule": "timestep / 1000",
            **{"defaults.height": 128, "defaults.width": 128, "defaults.num_steps": 10},  # the preset's
            **{"defaults.guidance_scale": 2.5, "defaults.true_cfg_scale": 1.0},  # FLUX.1 Kontext dev's
            "limits.side_multiple": 16,
        },
        features=frozenset({wire.FEATURE_CONDITION_IMAGES}),
        # The ranks split the 16 generated and 16 image tokens together and gather them back.
        sp2=Sp2Row({"samples_per_prompt": 1}),
        pipeline="FluxKontextPipeline",
        prompts=("make the fox red", "two cats on the snow"),
        base_seed=61,
        env_keys=FLUX_ENV_KEYS | {"image_latents"},
        replay_samplers=("FLOW_SDE", "CPS"),
        replay_latent_dtypes=(None,),
        conditioning=("CONDITIONING_CONCAT_SEQUENCE", "image_latents"),
    ),
    # The pretrained shapes preset: FLUX's family without a guidance embedding (guidance is None in
    # its env), a 4x VAE and 24 text tokens.
    "shapes": Family(
        preset="shapes",
        # The pretrained network at true CFG 3: the split attention rounds differently from the whole
        # one, guided v = (1 - s) v_uncond + s v_cond takes each branch's difference up to 2 + 3 times
        # at s = 3, and a trained network carries a difference in its input on to the next steps: up
        # to 6.1e-5 here, against 1e-5 for the random tiny presets.
        sp2=Sp2Row(
            {"prompts": ["a red circle", "two blue squares"], "base_seed": 17}, tolerance=10 * TOLERANCE
        ),
        transformer="FluxTransformer2DModel",
        pipeline="FluxPipeline",
        prompts=("a red circle", "a blue square to the left of a yellow triangle"),
        base_seed=51,
        cfg_on={"true_cfg_scale": 3.0, "negative_prompt": ""},  # the preset's default
        cfg_off={"true_cfg_scale": 1.0},
        timestep_divisor=1000.0,
        cfg_rule=("true_cfg", 3.0),
        env_keys=FLUX_ENV_KEYS,
        latent_shape=(64, 16),  # 8 x 8 packed tokens, each 2 x 2 latent pixels of 4 channels
    ),
    # SD3: unpacked latents, the raw timestep, CFG driven by guidance_scale.
    "sd3": Family(
        preset="tiny-sd3",
        server_info={
            "family": "sd3",
            "pipeline_class": "StableDiffusion3Pipeline",
            **{"cfg_scale_field": "guidance_scale", "cfg_rule": "true_cfg", "timestep_rule": "timestep"},
            **{"defaults.height": 128, "defaults.width": 128, "defaults.num_steps": 10},  # the preset's
            **{"defaults.guidance_scale": 4.5, "defaults.true_cfg_scale": 1.0},  # SD3.5-Medium's
            "defaults.noise_level": 0.7,
            "limits.side_multiple": 16,  # 8x VAE, 2x2 patches
            **{"limits.max_frames": 1, "defaults.num_frames": 1},  # an image family
        },
        transformer="SD3Transformer2DModel",
        pipeline="StableDiffusion3Pipeline",
        prompts=("a red fox in the snow", "two cats"),
        base_seed=21,
        cfg_on={"guidance_scale": 4.5, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1.0,
        cfg_rule=("true_cfg", 4.5),
        env_keys=frozenset(
            {"encoder_hidden_states", "pooled_projections", "joint_attention_kwargs", "return_dict"}
        ),
        latent_shape=(16, 8, 8),
    ),
    # FLUX.2 [klein]: packed 2x2 patches, 4-D position ids, a Qwen3 embedding of three stacked hidden
    # states, CFG driven by guidance_scale and no guidance embedding (guidance is None in its env).
    "flux2-klein": Family(
        preset="tiny-flux2-klein",
        server_info={
            "family": "flux2-klein",
            "pipeline_class": "Flux2KleinPipeline",
            "timestep_rule": "timestep / 1000",
            **{
                "cfg_scale_field": "guidance_scale",
                "cfg_rule": "true_cfg",
                "defaults.guidance_scale": 4.0,
            },  # FLUX.2 [klein] base's CFG 4
            "scale_fields": ["guidance_scale"],  # [klein]'s CFG scale, [dev]'s guidance
            **{"defaults.height": 128, "defaults.width": 128, "defaults.num_steps": 10},  # the preset's
            **{"defaults.true_cfg_scale": 1.0, "limits.side_multiple": 16},
        },
        transformer="Flux2Transformer2DModel",
        pipeline="Flux2KleinPipeline",
        prompts=("a red fox in the snow", "two cats"),
        base_seed=91,
        cfg_on={"guidance_scale": 4.0, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1000.0,
        cfg_rule=("true_cfg", 4.0),
        env_keys=FLUX2_ENV_KEYS,
        latent_shape=(16, 16),  # 4 x 4 packed tokens of 4 x 4 channels
        replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
        replay_latent_dtypes=("float32", "bfloat16"),
    ),
    # FLUX.2 [dev]: [klein]'s call with a Mistral3 embedding and the guidance scale embedded, no CFG.
    "flux2": Family(
        preset="tiny-flux2",
        server_info={
            "family": "flux2",
            "pipeline_class": "Flux2Pipeline",
            "timestep_rule": "timestep / 1000",
            **{
                "cfg_scale_field": "",
                "cfg_rule": "none",
                "defaults.guidance_scale": 4.0,
            },  # FLUX.2 [dev]'s embedded guidance 4, no CFG field
            "scale_fields": ["guidance_scale"],  # [klein]'s CFG scale, [dev]'s guidance
            **{"defaults.height": 128, "defaults.width": 128, "defaults.num_steps": 10},  # the preset's
            **{"defaults.true_cfg_scale": 1.0, "limits.side_multiple": 16},
        },
        transformer="Flux2Transformer2DModel",
        pipeline="Flux2Pipeline",
        prompts=("a red fox in the snow", "two cats"),
        base_seed=101,
        cfg_on={},
        cfg_off={"guidance_scale": 3.5},
        timestep_divisor=1000.0,
        cfg_rule=("none", 1.0),
        env_keys=FLUX2_ENV_KEYS,
        latent_shape=(16, 16),  # 4 x 4 packed tokens of 4 x 4 channels
        replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
        replay_latent_dtypes=("float32", "bfloat16"),
        replay_cfg=(False,),
    ),
    "qwen-image": QWEN_IMAGE,
    # Qwen-Image-Edit: Qwen-Image's call with the image's packed latents appended to the tokens, and
    # prompt embeddings that read the image (the Qwen2.5-VL encoder's vision tokens).
    "qwen-image-edit": dataclasses.replace(
        QWEN_IMAGE,
        preset="tiny-qwen-image-edit",
        server_info={
            "family": "qwen-image-edit",
            "pipeline_class": "QwenImageEditPipeline",
            "cfg_scale_field": "true_cfg_scale",
            "cfg_rule": "true_cfg_norm_rescale",
            "timestep_rule": "timestep / 1000",
            **{"defaults.height": 128, "defaults.width": 128, "defaults.num_steps": 10},  # the preset's
            **{"defaults.guidance_scale": 1.0, "defaults.true_cfg_scale": 4.0},  # Qwen-Image-Edit's
            "limits.side_multiple": 16,
        },
        features=frozenset({wire.FEATURE_CONDITION_IMAGES}),
        sp2=None,
        pipeline="QwenImageEditPipeline",
        prompts=("make the fox red", LONG_PROMPT),
        base_seed=81,
        env_keys=QWEN_IMAGE.env_keys | {"image_latents"},
        conditioning=("CONDITIONING_CONCAT_SEQUENCE", "image_latents"),
        missing="" if is_torchvision_available() else "its Qwen2VLProcessor needs torchvision, not installed",
    ),
    "wan": WAN,
    # Wan 2.2: two experts; of 4 steps (timesteps 999, 900, 750, 500) the last two are below the
    # boundary (875) and run transformer_2.
    "wan2.2": dataclasses.replace(
        WAN,
        preset="tiny-wan2.2",
        server_info={
            **WAN.server_info,
            "family": "wan",  # Wan 2.2's pipeline is WanPipeline too
            "transformers": ["transformer", "transformer_2"],
            "features": [*SERVED_FEATURES, "video", "experts", "guidance_scale_2", "boundary_ratio"],
            "defaults.boundary_ratio": 0.875,  # the pipeline's boundary, exact in float32
        },
        refused_frames=(),
        sp2=None,
        base_seed=51,
        experts=("transformer", "transformer_2"),
        step_transformers=("transformer", "transformer", "transformer_2", "transformer_2"),
    ),
    # Wan 2.1 image-to-video: Wan's call with the first frame's mask and latents concatenated to the
    # channels, and cross-attention to its CLIP image embeddings too.
    "wan-i2v": dataclasses.replace(
        WAN,
        preset="tiny-wan-i2v",
        server_info={
            "family": "wan-i2v",
            "pipeline_class": "WanImageToVideoPipeline",
            **{"cfg_scale_field": "guidance_scale", "cfg_rule": "true_cfg", "timestep_rule": "timestep"},
            **{
                "defaults.height": 64,
                "defaults.width": 64,
                "defaults.num_frames": 5,
                "defaults.num_steps": 10,
            },
            **{"limits.side_multiple": 16, "limits.frame_step": 4},
        },
        features=frozenset({wire.FEATURE_CONDITION_IMAGES, wire.FEATURE_VIDEO}),
        refused_frames=(),
        # The ranks split the 2 x 4 x 4 video tokens the patch embedding makes of the 36 channels.
        sp2=Sp2Row({}),
        pipeline="WanImageToVideoPipeline",
        prompts=("the fox runs off", "the cats turn around"),
        base_seed=71,
        env_keys=WAN.env_keys | {"encoder_hidden_states_image", "condition"},
        replay_samplers=("FLOW_SDE", "CPS"),
        conditioning=("CONDITIONING_CONCAT_CHANNELS", "condition"),
    ),
    # HunyuanVideo 1.5: video latents with C + 1 conditioning channels of zeros, the raw timestep, two
    # text encoders (Qwen2.5-VL and ByT5, each with its mask), zero image embeddings, classic CFG on
    # guidance_scale.
    "hunyuan-video15": Family(
        preset="tiny-hunyuan-video15",
        server_info={
            "family": "hunyuan-video15",
            "pipeline_class": "HunyuanVideo15Pipeline",
            **{"cfg_scale_field": "guidance_scale", "cfg_rule": "true_cfg", "timestep_rule": "timestep"},
            **{
                "defaults.height": 64,
                "defaults.width": 64,
                "defaults.num_frames": 5,
                "defaults.num_steps": 10,
            },
            "defaults.guidance_scale": 6.0,  # the preset's guider's
            # 16x VAE, 1x1 patches
            **{"limits.side_multiple": 16, "limits.frame_step": 4, "limits.max_frames": 241},
        },
        refused_frames=(2, 4, 6, 245),
        # 16x VAE, 1 x 1 patches: 3 x 4 x 4 tokens, beside a context of 1985 (1000 Qwen2.5-VL tokens,
        # 256 ByT5 bytes, 729 image tokens) that our plan splits unevenly, 993 and 992.
        sp2=Sp2Row({**SP_PROMPTS, **VIDEO_SP2}, layout=(32, 3, 4, 4)),
        transformer="HunyuanVideo15Transformer3DModel",
        pipeline="HunyuanVideo15Pipeline",
        prompts=("a red fox in the snow", 'a sign that says "open"'),  # the second quotes glyph text
        base_seed=111,
        cfg_on={"guidance_scale": 6.0, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1.0,
        cfg_rule=("true_cfg", 6.0),
        env_keys=frozenset(
            {
                "encoder_hidden_states",
                "encoder_attention_mask",
                "encoder_hidden_states_2",
                "encoder_attention_mask_2",
                "image_embeds",
                "condition",
                "attention_kwargs",
                "return_dict",
            }
        ),
        latent_shape=(32, 2, 4, 4),  # the preset's 5 frames: 2 latent frames of 4 x 4 (16x VAE)
        text_width="text_embed_dim",
        conditioning=("CONDITIONING_CONCAT_CHANNELS", "condition"),
    ),
    # LTX-2: two latent streams per sample (packed video tokens, then packed audio tokens) in one joint
    # latent, the connectors' video and audio text states with one mask, the raw float32 timestep also
    # fed as sigma, classic CFG on guidance_scale for both streams.
    "ltx2": Family(
        preset="tiny-ltx2",
        server_info={
            **{"family": "ltx2", "pipeline_class": "LTX2Pipeline"},
            **{"cfg_scale_field": "guidance_scale", "cfg_rule": "true_cfg"},
            # The preset's 9 frames: 2 latent frames of 2 x 2 tokens, 9 latent audio frames.
            **{"defaults.height": 64, "defaults.width": 64, "defaults.num_frames": 9},
            **{"limits.side_multiple": 32, "limits.min_side": 64, "limits.frame_step": 8},
            "limits.max_frames": 241,
            # Video at the rate the pipeline conditions on; the sound's format is checked against its WAVs.
            **{"decode.media": rollout_pb2.MEDIA_KIND_VIDEO, "decode.frame_rate": 24.0},
        },
        features=frozenset({wire.FEATURE_LATENT_STREAMS, wire.FEATURE_AUDIO, wire.FEATURE_VIDEO}),
        refused_frames=(2, 5, 16, 249),
        # The plan splits the video tokens (3 x 2 x 2 at 17 frames) and the text tokens; the audio
        # stream runs whole on every rank.
        sp2=Sp2Row(
            {**SP_PROMPTS, "num_frames": 17, "guidance_scale": 3.0, "negative_prompt": "silence"},
            streams=((12, 128), (18, 32)),
        ),
        transformer="LTX2VideoTransformer3DModel",
        pipeline="LTX2Pipeline",
        prompts=("a drum and a bell", "rain on a tin roof at night"),
        base_seed=131,
        cfg_on={"guidance_scale": 3.0, "negative_prompt": "silence"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1.0,
        cfg_rule=("true_cfg", 3.0),
        env_keys=frozenset(
            {
                "encoder_hidden_states",
                "audio_encoder_hidden_states",
                "encoder_attention_mask",
                "audio_encoder_attention_mask",
                "video_coords",
                "audio_coords",
                "num_frames",
                "height",
                "width",
                "fps",
                "audio_num_frames",
                "isolate_modalities",
                "spatio_temporal_guidance_blocks",
                "perturbation_mask",
                "use_cross_timestep",
                "attention_kwargs",
                "return_dict",
            }
        ),
        # The preset's 9 frames: video 2 x 2 x 2 tokens of 128 channels, then audio 9 tokens of 8 x 4.
        latent_shape=(8 * 128 + 9 * 32,),
        text_width="caption_channels",
    ),
    # Cosmos3: one sample per call, its text as token ids packed before its video latent patches, the
    # raw timestep in float32 once per noisy vision token, classic CFG on guidance_scale with the
    # negative prompt's own (inverse) templates.
    "cosmos3": Family(
        preset="tiny-cosmos3",
        server_info={
            **{"family": "cosmos3", "pipeline_class": "Cosmos3OmniPipeline"},
            **{"cfg_scale_field": "guidance_scale", "cfg_rule": "true_cfg", "cfg_off_scale": 1.0},
            **{
                "defaults.height": 64,
                "defaults.width": 64,
                "defaults.num_frames": 5,
                "defaults.num_steps": 10,
            },
            "defaults.guidance_scale": 6.0,  # Cosmos3OmniPipeline.__call__'s
            "defaults.solver": rollout_pb2.SOLVER_UNIPC,  # the pipeline's scheduler
            # The VAE's 16 (the transformer pads an odd patch grid), 4x in time, about twice the 189 frames.
            **{"limits.side_multiple": 16, "limits.frame_step": 4, "limits.max_frames": 377},
        },
        refused_frames=(2, 4, 6, 381),
        # 16x VAE of 48 channels, 2 x 2 patches: 3 x 2 x 2 vision tokens, packed after a text that the
        # seams split unevenly (71 and 68 tokens, the negative's 73: 36 / 35, 34 / 34, 37 / 36); 4 query
        # and 2 key/value heads, 2 and 1 a rank.
        sp2=Sp2Row({**SP_PROMPTS, **VIDEO_SP2}, layout=(48, 3, 4, 4)),
        transformer="Cosmos3OmniTransformer",
        pipeline="Cosmos3OmniPipeline",
        prompts=(SHORT_PROMPT, LONG_PROMPT),  # two text lengths: two packed sequences of their own
        base_seed=121,
        cfg_on={"guidance_scale": 6.0, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 1.0},
        timestep_divisor=1.0,
        cfg_rule=("true_cfg", 6.0),
        env_keys=frozenset(
            {
                "input_ids",
                "text_indexes",
                "position_ids",
                "und_len",
                "sequence_length",
                "vision_token_shapes",
                "vision_sequence_indexes",
                "vision_mse_loss_indexes",
                "vision_noisy_frame_indexes",
                "return_dict",
            }
        ),
        latent_shape=(48, 2, 4, 4),  # the preset's 5 frames: 2 latent frames of 4 x 4 (16x VAE)
        text_key="",  # token ids, no text states
    ),
    # Z-Image: per-sample latents with a frame axis under x, (1000 - t) / 1000 in float32 under t, the
    # negated prediction, prompts of their own lengths, and CFG around the positive branch, on with
    # guidance_scale > 0.
    "z-image": Family(
        preset="tiny-z-image",
        server_info={
            **{"family": "z-image", "pipeline_class": "ZImagePipeline"},
            **{"cfg_scale_field": "guidance_scale", "cfg_rule": "cfg_from_positive"},
            "timestep_rule": "(1000 - timestep) / 1000, float32",
            "cfg_off_scale": 0.0,  # CFG on above 0
            **{"defaults.height": 128, "defaults.width": 128, "defaults.num_steps": 10},  # the preset's
            **{"defaults.guidance_scale": 5.0, "defaults.true_cfg_scale": 1.0},  # ZImagePipeline's
            "limits.side_multiple": 16,  # 8x VAE, 2x2 patches
            **{"limits.max_frames": 1, "defaults.num_frames": 1},
        },
        # Our plan splits the image's, the caption's and the unified tokens over the two ranks and
        # gathers them back, over prompts of different lengths.
        sp2=Sp2Row({"samples_per_prompt": 1}, attention_split="ulysses"),
        lora_module=".attention.to_q.",  # Z-Image's own module names
        transformer="ZImageTransformer2DModel",
        pipeline="ZImagePipeline",
        prompts=(SHORT_PROMPT, LONG_PROMPT),
        base_seed=91,
        cfg_on={"guidance_scale": 4.0, "negative_prompt": "blurry"},
        cfg_off={"guidance_scale": 0.0},
        timestep_divisor=1000.0,
        cfg_rule=("cfg_from_positive", 4.0),
        cfg_off_rule=("none", 0.0),
        env_keys=frozenset({"cap_feats", "return_dict"}),
        latent_shape=(16, 8, 8),
        replay_samplers=("FLOW_SDE", "DANCE", "CPS"),
        replay_latent_dtypes=("float32", "bfloat16"),
        text_key="cap_feats",
        text_width="cap_feat_dim",
    ),
}


def family_request(family: str, sampler: str, cfg: bool, **fields) -> rollout_pb2.RolloutRequest:
    """Two prompts, two samples each, 4 steps at 64 x 64 without images, CFG on or off as the family
    does it, and a conditioning image per prompt for an image-conditioned family; ``fields`` override
    (None leaves a field unset)."""
    spec = FAMILIES[family]
    if registry.adapter_class(spec.pipeline).takes_images:
        images = [rollout_pb2.ConditionImage(data=condition_png(p)) for p in range(len(spec.prompts))]
        fields = {"condition_images": images, **fields}
    base = {
        "prompts": list(spec.prompts),
        "samples_per_prompt": 2,
        "base_seed": spec.base_seed,
        "height": 64,
        "width": 64,
        "num_steps": 4,
        "sampler": SAMPLERS[sampler],
        "images": False,
    }
    return make_request(base, spec.cfg_on if cfg else spec.cfg_off, fields)


def qwen_text_length(pipe, prompt: str) -> int:
    """The prompt's token count after QwenImagePipeline drops its template's system prefix."""
    tokens = pipe.tokenizer(pipe.prompt_template_encode.format(prompt)).input_ids
    return len(tokens) - pipe.prompt_template_encode_start_idx
