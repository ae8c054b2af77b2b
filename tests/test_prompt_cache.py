"""The prompt cache: each distinct text's conditioning is encoded once, alone, and reused bitwise.

A second request sharing a prompt and the negative prompt with the first reuses both (the finished
event counts the hits), and everything it streams is bitwise what a server without the cache
streams for it; the cache holds at most --prompt-cache-entries texts, least recently used out.
"""

import pytest
import torch
from support.parity import assert_same_env, assert_same_kwargs
from support.requests import Rollout, stream_events
from support.servers import start_server

from rollout_client import RolloutClient
from rollout_server import families
from rollout_server.families.base import MediaShape
from rollout_server.prompt_cache import PromptCache

# Texts no other test sends to the shared server, so its cache holds none of them yet.
SHAPE = MediaShape(frames=1, height=64, width=64)
NEGATIVE = "grainy, overexposed (prompt cache test)"


REQUEST = {
    "samples_per_prompt": 2,
    "base_seed": 17,
    "height": 64,
    "width": 64,
    "num_steps": 3,
    "true_cfg_scale": 2.0,
    "negative_prompt": NEGATIVE,
    "images": False,
}


@pytest.fixture(scope="module")
def uncached(tiny_flux_folder, cache_dir, tmp_path_factory):
    server = start_server(
        cache_dir, tmp_path_factory.mktemp("logs") / "uncached.log", "--prompt-cache-entries", "0"
    )
    with RolloutClient(server.address, timeout=120) as client:
        yield client
    server.stop()


def stream(client: RolloutClient, prompts: list[str]) -> Rollout:
    return stream_events(client, REQUEST, prompts=prompts)


def assert_same_stream(a: Rollout, b: Rollout) -> None:
    assert_same_env(a.started.env, b.started.env)
    for one, two in zip(a.steps, b.steps, strict=True):
        assert torch.equal(one.x_next, two.x_next) and torch.equal(one.log_probs, two.log_probs)


def test_shared_texts_are_encoded_once_and_reused_bitwise(client, uncached):
    first = stream(
        client, ["a red fox in the snow (prompt cache test)", "two cats on a sofa (prompt cache test)"]
    )
    second = stream(
        client, ["two cats on a sofa (prompt cache test)", "a lighthouse at dusk (prompt cache test)"]
    )
    # Distinct texts of a request: its prompts and the negative prompt.
    assert (first.finished.message.prompts_encoded, first.finished.message.prompt_cache_hits) == (3, 0)
    assert (second.finished.message.prompts_encoded, second.finished.message.prompt_cache_hits) == (1, 2)
    # "two cats on a sofa" is prompt 1 of the first request and prompt 0 of the second.
    assert_same_kwargs(first.started.env["positive"][1], second.started.env["positive"][0])

    fresh = stream(
        uncached, ["two cats on a sofa (prompt cache test)", "a lighthouse at dusk (prompt cache test)"]
    )
    assert (fresh.finished.message.prompts_encoded, fresh.finished.message.prompt_cache_hits) == (3, 0)
    assert_same_stream(second, fresh)


def test_least_recently_used_texts_leave_a_full_cache(tiny_flux_folder):
    adapter = families.load(tiny_flux_folder, torch.device("cpu"), torch.float32)
    cache = PromptCache(adapter, max_entries=2)

    def hits(prompts: list[str]) -> int:
        return cache.encode(prompts, None, 3.5, SHAPE).hits

    assert hits(["a", "b"]) == 0
    assert hits(["a"]) == 1  # "a" is now the most recent
    assert hits(["c"]) == 0  # evicts "b"
    assert len(cache) == 2
    assert hits(["a", "c"]) == 2
    assert hits(["b"]) == 0
    assert cache.encode(["a"], None, 4.0, SHAPE).hits == 0  # another guidance scale: another entry
    off = PromptCache(adapter, max_entries=0)
    assert off.encode(["a"], None, 3.5, SHAPE).hits == off.encode(["a"], None, 3.5, SHAPE).hits == 0
    assert len(off) == 0
