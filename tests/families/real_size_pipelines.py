"""The published checkpoints of every served family, assembled on the meta device, and their figures at
the family's default request size worked out by hand.

Each pipeline is its family's builder (``rollout_server/families/<family>/preset.py``, the one that builds
the family's presets) over its published configs (``published.py``) with no size's overrides, on the meta
device: no weights, no memory and no arithmetic beyond shapes; its tokenizers are trained locally into a
folder. ``test_real_sizes.py`` checks the server's adapter over each against the figures.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from transformers import CLIPVisionModelWithProjection

from rollout_server.families.common.build import Build
from rollout_server.families.cosmos3.preset import cosmos3
from rollout_server.families.flux.preset import flux, flux_kontext
from rollout_server.families.flux2.preset import flux2, flux2_klein
from rollout_server.families.flux2.published import FLUX_2_KLEIN_9B, QWEN3_8B
from rollout_server.families.hunyuan_video15.preset import hunyuan_video15
from rollout_server.families.ltx2.preset import ltx2
from rollout_server.families.qwen_image.preset import qwen_image, qwen_image_edit
from rollout_server.families.sd3.preset import sd3
from rollout_server.families.wan.preset import wan, wan_2_2
from rollout_server.families.wan.published import WAN_14B
from rollout_server.families.wan_i2v.preset import wan_i2v
from rollout_server.families.z_image.preset import z_image

# The dtype the checkpoints ship and are served in.
DTYPE = torch.bfloat16
META = torch.device("meta")
SPLITS = (2, 4, 8)


def real_size(builder: Callable[..., DiffusionPipeline], **published) -> Callable[[Path], DiffusionPipeline]:
    """The family's ``builder`` at the published checkpoint's size (``published`` names its configs where the
    family has several), on the meta device; its tokenizers are written into the folder it is given."""
    return lambda folder: builder(Build(folder, meta=True), **published)


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
# Wan at 832 x 480 x 81: 1 + 80 / 4 latent frames of 480 / 8 x 832 / 8, 16 channels (image-to-video's
# condition enters on channels: its latent stays 16 wide); 1 x 2 x 2 patches. Its text: 512 UMT5 states
# of 4096. CFG doubles the group's rows to 16; the 2,096,640-element latent fits 4 times in the default
# max_latent_elements (8 Mi), so 4 rows a forward. The 14B's widest activation is q, k and v (3 x 5120),
# wider than its feed-forward (13824).
WAN_TOKENS = 21 * 30 * 52
WAN_FIGURES = {
    "latent_shape": (16, 21, 60, 104),
    "generated_tokens": WAN_TOKENS,
    "forward": (WAN_TOKENS, 3 * 5120),
    "text_elements": 512 * 4096,
    "forward_rows": 4,
}
# LTX-2 at the pipeline's default, 121 frames of 768 x 512: 32x VAE of 128 channels, 8x in time, 1 x 1
# patches: 1 + 120 / 8 latent frames of 512 / 32 x 768 / 32 video tokens; its audio: 121 frames at
# 24 fps are 5.04 s, 25 latent frames a second (16 kHz, hop 160, 4x), round(126.04) frames of 8
# channels x 64 / 4 mel bins. One joint latent of both.
LTX_2_VIDEO_TOKENS = 16 * 16 * 24
LTX_2_AUDIO_FRAMES = 126
LTX_2_CHECKPOINT = Checkpoint(
    "Lightricks/LTX-2",
    "ltx2",
    real_size(ltx2),
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
        real_size(flux),
        **FLUX_FIGURES,
        # metadata.total_size of transformer/diffusion_pytorch_model.safetensors.index.json and of
        # text_encoder_2/model.safetensors.index.json.
        published_bytes={"transformer": 23802816640, "text_encoder_2": 9524621312},
    ),
    Checkpoint(
        "black-forest-labs/FLUX.1-Kontext-dev",
        "flux-kontext",
        real_size(flux_kontext),
        # The conditioning image at the request's size adds as many tokens as it generates.
        **{**FLUX_FIGURES, "forward": (2 * 4096 + 512, 5 * 3072)},
    ),
    Checkpoint(
        "stabilityai/stable-diffusion-3.5-medium",
        "sd3",
        real_size(sd3),
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
        real_size(qwen_image),
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
        real_size(qwen_image_edit),
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
        real_size(wan),
        # The 1.3B's widest: the feed-forward, wider than q, k and v (3 x 1536).
        **{**WAN_FIGURES, "forward": (WAN_TOKENS, 8960)},
        ulysses_refused=frozenset({8}),  # 12 heads
    ),
    Checkpoint(
        "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "wan",
        real_size(wan, transformer=WAN_14B),
        **WAN_FIGURES,
    ),
    Checkpoint(
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "wan",
        real_size(wan_2_2),
        **WAN_FIGURES,
    ),
    Checkpoint(
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        "wan-i2v",
        real_size(wan_i2v, image_encoder_class=CLIPVisionModelWithProjection),
        # The text, and CLIP's 224 / 14 squared patches and class token.
        **{**WAN_FIGURES, "text_elements": 512 * 4096 + (16 * 16 + 1) * 1280},
    ),
    Checkpoint(
        "black-forest-labs/FLUX.2-klein-4B",
        "flux2-klein",
        real_size(flux2_klein),
        **{
            **FLUX2_FIGURES,
            "forward": (4096 + 512, 9 * 24 * 128),
            "text_elements": 512 * 7680,  # three Qwen3-4B layers of 2560
        },
    ),
    Checkpoint(
        "black-forest-labs/FLUX.2-klein-9B",
        "flux2-klein",
        real_size(flux2_klein, transformer=FLUX_2_KLEIN_9B, text_encoder=QWEN3_8B),
        **{**FLUX2_FIGURES, "forward": (4096 + 512, 9 * 32 * 128), "text_elements": 512 * 12288},
    ),
    Checkpoint(
        "black-forest-labs/FLUX.2-dev",
        "flux2",
        real_size(flux2),
        **{**FLUX2_FIGURES, "forward": (4096 + 512, 9 * 48 * 128), "text_elements": 512 * 15360},
    ),
    Checkpoint(
        "Tongyi-MAI/Z-Image-Turbo",
        "z-image",
        real_size(z_image),
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
        real_size(hunyuan_video15),
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
        real_size(cosmos3),
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
