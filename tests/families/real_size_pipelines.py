"""The published checkpoints of every served family, assembled on the meta device, and their figures at
the family's default request size worked out by hand.

Each pipeline is built from its family's published configs (``rollout_server/families/<family>/published.py``)
and the preset module's published scheduler settings: the checkpoint's transformer and the components whose
sizes the adapter and the server read (the VAE, the text and image encoders, the scheduler, a tokenizer's
length), with no weights, no memory and no arithmetic beyond shapes. ``test_real_sizes.py`` checks the
server's adapter over each against the figures.
"""

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

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

from rollout_server.families.common.published import CLIP_L, FLUX_1_VAE, QWEN3_4B, QWEN_VL, T5_XXL
from rollout_server.families.common.tokenizers import (
    QWEN3_CHAT_TEMPLATE,
    QWEN3_SPECIAL_TOKENS,
    write_mistral_tokenizer,
    write_qwen2_tokenizer,
    write_t5_tokenizer,
)
from rollout_server.families.cosmos3.preset import SCHEDULER_CONFIG as COSMOS3_SCHEDULER_CONFIG
from rollout_server.families.cosmos3.published import COSMOS3_NANO, WAN_2_2_VAE
from rollout_server.families.flux.preset import FLUX_SCHEDULER_CONFIG
from rollout_server.families.flux.published import FLUX_1_DEV, FLUX_T5_TOKENS
from rollout_server.families.flux2.preset import FLUX2_SCHEDULER_CONFIG
from rollout_server.families.flux2.published import (
    FLUX_2_DEV,
    FLUX_2_KLEIN_4B,
    FLUX_2_KLEIN_9B,
    MISTRAL_SMALL_3_1,
    QWEN3_8B,
)
from rollout_server.families.hunyuan_video15.preset import GUIDANCE_SCALE as HUNYUAN_VIDEO15_GUIDANCE_SCALE
from rollout_server.families.hunyuan_video15.preset import (
    SCHEDULER_CONFIG as HUNYUAN_VIDEO15_SCHEDULER_CONFIG,
)
from rollout_server.families.hunyuan_video15.published import BYT5_SMALL, HUNYUAN_VIDEO15_480P_T2V
from rollout_server.families.ltx2.preset import SCHEDULER_CONFIG as LTX2_SCHEDULER_CONFIG
from rollout_server.families.ltx2.published import (
    GEMMA_3_12B,
    LTX_2,
    LTX_2_AUDIO_VAE,
    LTX_2_CONNECTORS,
    LTX_2_VAE,
    LTX_2_VOCODER,
)
from rollout_server.families.qwen_image.preset import QWEN_IMAGE_SCHEDULER_CONFIG, _prompt_template
from rollout_server.families.qwen_image.published import QWEN_IMAGE, QWEN_IMAGE_VAE, QWEN_VL_PROCESSOR
from rollout_server.families.sd3.preset import SD3_SCHEDULER_CONFIG
from rollout_server.families.sd3.published import CLIP_G, SD35_MEDIUM, SD35_VAE
from rollout_server.families.wan.preset import WAN22_BOUNDARY_RATIO, WAN_SCHEDULER_CONFIG
from rollout_server.families.wan.published import UMT5_XXL, WAN_1_3B, WAN_14B
from rollout_server.families.wan_i2v.published import CLIP_VIT_H, WAN_I2V_14B
from rollout_server.families.z_image.preset import Z_IMAGE_SCHEDULER_CONFIG
from rollout_server.families.z_image.published import Z_IMAGE_TURBO

# The dtype the checkpoints ship and are served in.
DTYPE = torch.bfloat16
META = torch.device("meta")
SPLITS = (2, 4, 8)


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
        # Our plan (families/hunyuan_video15/adapter.py); its 16 heads divide by 2, 4 and 8. The default's
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
