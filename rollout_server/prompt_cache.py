"""Per-text prompt conditioning, encoded once and kept in a bounded LRU cache.

GRPO asks for every prompt K times per group and again in later epochs, and the text encoders (T5
for Flux and SD3, Qwen2.5-VL for Qwen-Image) are a large share of a rollout. Each distinct text is
encoded on its own, as a batch of one: its conditioning then depends on nothing but the text and the
encoding parameters (never on the other prompts of a request), so a cached entry is bitwise what
encoding would give. The negative prompt is one more text: one entry, shared by every prompt.

A key is (family, text, guidance scale, media shape): every parameter an adapter's encoding reads.
Entries hold the adapter's tensors on its device; ``max_entries`` bounds them (0 turns caching off).
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the families load diffusers; the command line reads the default below without it
    from rollout_server.families.base import FamilyAdapter, MediaShape

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
        self, prompts: list[str], negative_prompt: str | None, guidance_scale: float, shape: "MediaShape"
    ) -> Encoded:
        """The conditioning of ``prompts`` (and of the negative branch, when ``negative_prompt`` is
        given), each distinct text encoded alone or taken from the cache."""
        texts = list(dict.fromkeys([*prompts, *([negative_prompt] if negative_prompt is not None else [])]))
        envs, hits = {}, 0
        for text in texts:
            key = (self.adapter.family, text, guidance_scale, shape)
            env = self._entries.get(key)
            if env is None:
                env = self.adapter.encode_text(text, guidance_scale, shape)
                if self.max_entries:
                    self._entries[key] = env
                    while len(self._entries) > self.max_entries:
                        self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
                hits += 1
            envs[text] = env
        branches = {"positive": [envs[text] for text in prompts]}
        if negative_prompt is not None:
            branches["negative"] = [envs[negative_prompt]] * len(prompts)
        conditioning = Conditioning(envs=branches, batched_keys=self.adapter.batched_env_keys)
        return Encoded(conditioning, hits=hits, misses=len(texts) - hits)
