"""Per-text prompt conditioning, encoded once and kept in a bounded LRU cache.

GRPO asks for every prompt K times per group and again in later epochs, and the text encoders (T5
for Flux and SD3, Qwen2.5-VL for Qwen-Image) are a large share of a rollout. Each distinct text is
encoded on its own, as a batch of one: its conditioning then depends on nothing but the text and the
encoding parameters (never on the other prompts of a request), so a cached entry is bitwise what
encoding would give. The negative prompt is one more text: one entry, shared by every prompt (keyed
apart from the same text as a prompt where the family encodes a negative prompt otherwise: Cosmos3).

A key is (family, text, guidance scale, media shape): every parameter an adapter's encoding reads.
Image-conditioned families add entries per conditioning image, keyed by its SHA-256 and the media
shape (its latents and what else the transformer reads of it), merged over the text's; a family whose
text encoding reads the image (Qwen-Image-Edit's vision-language encoder) keys the text's entry on the
image too, so the same text with another image is another entry. Entries hold the adapter's tensors
on its device; ``max_entries`` bounds them (0 turns caching off).
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_server.errors import InvalidRequest, TextTooLong

if TYPE_CHECKING:  # the families load diffusers; the command line reads the default below without it
    from rollout_server.families.base import FamilyAdapter, MediaShape
    from rollout_server.images import ConditionImage

# Real text encoders give a few MB per text (T5-XXL: 512 x 4096 values), held on the model's device.
DEFAULT_PROMPT_CACHE_ENTRIES = 256


@dataclass(frozen=True)
class Conditioning:
    """The frozen transformer kwargs per branch and prompt.

    ``envs[branch][p]`` holds every ``forward()`` keyword argument besides ``hidden_states`` and
    ``timestep`` for prompt p; entries named in ``batched_keys`` have a leading batch dimension of 1
    (or are one-element lists) and are concatenated to batch samples, the rest are shared.
    """

    envs: dict[str, list[dict[str, Any]]]
    batched_keys: tuple[str, ...]


@dataclass(frozen=True)
class Encoded:
    """A request's conditioning, and how many of its distinct texts came from the cache."""

    conditioning: Conditioning
    hits: int
    misses: int


class PromptCache:
    def __init__(self, adapter: "FamilyAdapter", max_entries: int):
        self.adapter = adapter
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def encode(
        self,
        prompts: list[str],
        negative_prompt: str | None,
        guidance_scale: float,
        shape: "MediaShape",
        images: "list[ConditionImage] | None" = None,
    ) -> Encoded:
        """The conditioning of ``prompts`` (and of the negative branch, when ``negative_prompt`` is
        given), each distinct text encoded alone or taken from the cache. ``images``: the prompts'
        conditioning images, whose entries are merged over the text's env of each branch.
        InvalidRequest naming the first text (``prompts[i]``, ``negative_prompt``) whose tokens are
        more than the model takes (``TextTooLong``): its encoding stops once it is tokenised."""
        per_prompt = images or [None] * len(prompts)
        seen: dict[tuple, dict[str, Any]] = {}  # this request's entries, each counted once
        counts = {"hits": 0, "misses": 0}
        reads_image = self.adapter.text_reads_image

        def env(text: str, image: "ConditionImage | None", negative: bool = False) -> dict[str, Any]:
            digest = image.sha256 if image is not None and reads_image else None
            apart = negative and self.adapter.negative_encoded_apart
            encode = self.adapter.encode_negative_text if apart else self.adapter.encode_text
            text_env = self._get(
                (self.adapter.family, "negative" if apart else "text", text, digest, guidance_scale, shape),
                lambda: encode(text, guidance_scale, shape, image.image if digest is not None else None),
                seen,
                counts,
            )
            if image is None:
                return text_env
            image_env = self._get(
                (self.adapter.family, "image", image.sha256, shape),
                lambda: self.adapter.encode_image(image.image, shape),
                seen,
                counts,
            )
            return {**text_env, **image_env}

        def field_env(field: str, *args, **kwargs) -> dict[str, Any]:
            try:
                return env(*args, **kwargs)
            except TextTooLong as error:
                raise InvalidRequest([(field, str(error))]) from None

        pairs = enumerate(zip(prompts, per_prompt, strict=True))
        branches = {"positive": [field_env(f"prompts[{p}]", text, image) for p, (text, image) in pairs]}
        if negative_prompt is not None:
            branches["negative"] = [
                field_env("negative_prompt", negative_prompt, image, negative=True) for image in per_prompt
            ]
        conditioning = Conditioning(envs=branches, batched_keys=self.adapter.batched_env_keys)
        return Encoded(conditioning, hits=counts["hits"], misses=counts["misses"])

    def _get(
        self,
        key: tuple,
        encode: Callable[[], dict[str, Any]],
        seen: dict[tuple, dict[str, Any]],
        counts: dict[str, int],
    ) -> dict[str, Any]:
        """The entry of ``key``: from this request (``seen``), from the cache (a hit) or encoded (a
        miss)."""
        if key in seen:
            return seen[key]
        entry = seen[key] = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            counts["hits"] += 1
            return entry
        entry = seen[key] = encode()
        counts["misses"] += 1
        if self.max_entries:
            self._entries[key] = entry
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return entry
