"""Wan image-to-video (``WanImageToVideoPipeline``): Wan's text-to-video family, conditioned on a
first frame concatenated to the noisy latents on the channel axis.

Each prompt comes with its conditioning image, the video's first frame. Its env entries are what
``WanImageToVideoPipeline.__call__`` computes of it: ``condition``, the mask of the frames that are
given (4 channels: one per frame of a latent frame; the first frame only) followed by the VAE
latents of the first frame and ``F - 1`` black frames, as ``prepare_latents`` builds it (the latent
mode, normalised by the VAE's ``latents_mean`` and ``latents_std``, float32); and
``encoder_hidden_states_image``, the penultimate hidden states of the CLIP vision encoder
(``encode_image``), when the transformer reads image embeddings (Wan 2.1; Wan 2.2's experts do not:
then None). The transformer is fed ``cat([x, condition], dim=1)``, x first, as the pipeline's loop
does, and predicts x's channels only. Both branches of CFG read the same image.

Everything else is ``WanAdapter``'s: the UniPC schedule and raw integer timesteps, the UMT5 text
env, classic CFG on ``guidance_scale``, Wan 2.2's two experts, and the streamed decode. Wan 2.2
TI2V (``expand_timesteps``) is refused: it overwrites the first frame's latents with the image after
every step (latent inpainting), which no Gaussian log-prob of the whole latent describes.
"""

from typing import TYPE_CHECKING

import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import LatentConditioning
from rollout_server.errors import UnsupportedModel
from rollout_server.families.wan.adapter import WanAdapter

if TYPE_CHECKING:
    from rollout_server.families.base import MediaShape


class WanImageToVideoAdapter(WanAdapter):
    family = "wan-i2v"
    pipeline_type = WanImageToVideoPipeline
    conditioning = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_CHANNELS, "condition")
    batched_env_keys = ("encoder_hidden_states", "encoder_hidden_states_image", "condition")
    takes_images = True
    image_encoding = (
        "condition: the 4-channel first-frame mask, then the VAE latent mode of the image followed by "
        "F - 1 black frames, normalised by latents_mean / latents_std (the pipeline's prepare_latents), "
        "float32; encoder_hidden_states_image: the CLIP vision encoder's penultimate hidden states "
        "(the pipeline's encode_image), None for experts without image embeddings"
    )

    def __init__(self, pipe, device, dtype, folder=None):
        super().__init__(pipe, device, dtype, folder)
        if self.pipe.config.expand_timesteps:
            raise UnsupportedModel(
                f"{self.source}: expand_timesteps (Wan 2.2 TI2V) overwrites the first frame's latents with "
                "the image after every step, so a step is not a Gaussian transition of the whole latent; "
                "its log-probs would need a mask, which this server does not compute"
            )
        if self.reads_image_embeddings and self.pipe.image_encoder is None:
            raise UnsupportedModel(f"{self.source}: its transformer reads image embeddings: no image_encoder")

    @property
    def reads_image_embeddings(self) -> bool:
        return self.pipe.transformer.config.image_dim is not None

    def text_elements(self) -> int:
        # Each row's cross-attention also reads the image embeddings (CLIP's patches and class token).
        if not self.reads_image_embeddings:
            return super().text_elements()
        vision = self.pipe.image_encoder.config
        image_tokens = (vision.image_size // vision.patch_size) ** 2 + 1
        return super().text_elements() + image_tokens * vision.hidden_size

    @torch.no_grad()
    def encode_image(self, image: Image.Image, shape: "MediaShape") -> dict:
        embeds = None
        if self.reads_image_embeddings:  # CLIP's, of the image resized to its own input size
            embeds = self.pipe.encode_image(image, self.device).to(self.pipe.transformer.dtype)
        return {"encoder_hidden_states_image": embeds, **self.encode_image_latents(image, shape)}

    @torch.no_grad()
    def encode_image_latents(self, image: Image.Image, shape: "MediaShape") -> dict:
        pipe = self.pipe
        pixels = pipe.video_processor.preprocess(image, height=shape.height, width=shape.width)
        # prepare_latents draws the initial noise unless it is given some: only its condition is kept.
        noise = torch.zeros(1, *self.latent_shape(shape), device=self.device)
        _, condition = pipe.prepare_latents(
            pixels.to(self.device, dtype=torch.float32),
            batch_size=1,
            num_channels_latents=pipe.vae.config.z_dim,
            height=shape.height,
            width=shape.width,
            num_frames=shape.frames,
            dtype=torch.float32,
            device=self.device,
            latents=noise,
        )
        return {self.conditioning.env_key: condition}
