"""Noise ownership and what the stream carries: group independence, batch invariance of noise,
stochastic-step lists, latent selections and manifest-only mode (docs/design.md, invariants 3-4)."""

import torch
from support.requests import stream_events

from rollout.v1 import rollout_pb2
from rollout_core import noise

EPS = rollout_pb2.DEBUG_TENSOR_EPS
MEAN = rollout_pb2.DEBUG_TENSOR_MEAN
VELOCITY = rollout_pb2.DEBUG_TENSOR_VELOCITY
SMALL = {"height": 64, "width": 64, "num_steps": 4, "images": False}


def run(client, **fields):
    rollout = stream_events(client, SMALL, fields)
    return rollout.started, rollout.steps


def test_group_samples_get_distinct_seeds_noise_and_log_probs(client):
    started, steps = run(
        client, prompts=["a red fox"], samples_per_prompt=4, base_seed=3, debug_tensors=[EPS]
    )
    seeds = list(started.message.seeds)
    assert seeds == noise.derive_seeds(3, 4) and len(set(seeds)) == 4
    assert list(started.message.prompt_indices) == [0, 0, 0, 0]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(started.x0[a], started.x0[b])
            for step in steps:
                assert not torch.equal(step.debug["eps"][a], step.debug["eps"][b])
    for step in steps:
        assert len(set(step.log_probs.tolist())) == 4, "every sample must get its own log-prob"


def test_noise_is_reproducible_from_the_documented_rule(client):
    started, steps = run(
        client, prompts=["a red fox"], samples_per_prompt=2, base_seed=8, debug_tensors=[EPS]
    )
    shape = tuple(started.message.layout.shape)
    assert started.message.layout.frames == started.message.resolved.num_frames == 1  # an image
    assert torch.equal(started.x0, noise.initial_noise(started.message.seeds, shape))
    for step in steps:
        assert torch.equal(step.debug["eps"], noise.step_noise(started.message.seeds, step.index, shape))


def test_noise_does_not_depend_on_batch_composition(client):
    alone_started, alone_steps = run(client, prompts=["a castle"], seeds=[4242], debug_tensors=[EPS])
    batch_started, batch_steps = run(
        client,
        prompts=["a dog", "a castle"],
        samples_per_prompt=2,
        seeds=[1, 2, 4242, 3],
        debug_tensors=[EPS],
    )
    assert torch.equal(alone_started.x0[0], batch_started.x0[2])
    for alone, batched in zip(alone_steps, batch_steps, strict=True):
        assert torch.equal(alone.debug["eps"][0], batched.debug["eps"][2])
        # Log-probs come from eps and sd alone, so they are bitwise equal too.
        assert alone.log_probs[0].item() == batched.log_probs[2].item()


def test_stochastic_step_list(client):
    started, steps = run(
        client,
        prompts=["a boat"],
        base_seed=1,
        num_steps=5,
        stochastic_steps=[1, 3],
        debug_tensors=[EPS, MEAN, VELOCITY],
    )
    assert list(started.message.stochastic) == [False, True, False, True, False]
    sigmas = torch.tensor(list(started.message.sigmas))
    x = started.x0
    for step in steps:
        assert step.stochastic == (step.index in (1, 3)) == step.message.stochastic
        if step.stochastic:
            assert step.log_probs.shape == (1,) and "eps" in step.debug
        else:
            # An ODE step: no noise, no log-prob, and x_{i+1} = x_i + dt * v exactly.
            assert step.log_probs is None and len(step.message.log_probs) == 0 and "eps" not in step.debug
            assert step.message.noise_std == 0.0
            dt = sigmas[step.index + 1] - sigmas[step.index]
            assert torch.equal(step.x_next, x + dt * step.debug["velocity"])
            assert torch.equal(step.x_next, step.debug["mean"])
        x = step.x_next
    # A stochastic step's noise does not depend on which other steps are stochastic.
    _, all_steps = run(client, prompts=["a boat"], base_seed=1, num_steps=5, debug_tensors=[EPS])
    assert torch.equal(all_steps[3].debug["eps"], steps[3].debug["eps"])


def sent_latents(started, steps) -> list[int]:
    return ([0] if started.x0 is not None else []) + [s.index + 1 for s in steps if s.x_next is not None]


def test_latent_selections_send_what_they_say(client):
    common = {"prompts": ["a tree"], "base_seed": 2, "num_steps": 5, "stochastic_steps": [1, 3]}
    selections = {
        rollout_pb2.LATENT_SELECTION_ALL: [0, 1, 2, 3, 4, 5],
        rollout_pb2.LATENT_SELECTION_AROUND_STOCHASTIC: [1, 2, 3, 4],
        rollout_pb2.LATENT_SELECTION_FINAL_ONLY: [5],
        rollout_pb2.LATENT_SELECTION_NONE: [],
    }
    reference_started, reference_steps = run(client, **common)
    for selection, expected in selections.items():
        started, steps = run(client, latents=selection, **common)
        assert sent_latents(started, steps) == expected, rollout_pb2.LatentSelection.Name(selection)
        for step, reference_step in zip(steps, reference_steps, strict=True):
            if step.x_next is not None:
                assert torch.equal(step.x_next, reference_step.x_next)
            if step.stochastic:
                assert torch.equal(step.log_probs, reference_step.log_probs)


def test_manifest_only_describes_without_bytes(client):
    started, steps = run(client, prompts=["a fox"], base_seed=2, manifest_only=True)
    manifest = {t.name: t for t in started.message.tensors.manifest}
    assert started.message.tensors.total_bytes > 0
    assert (
        list(manifest["x_0"].shape) == [1, *started.message.layout.shape] and manifest["x_0"].dtype == "F32"
    )
    assert "env/positive/0/encoder_hidden_states" in manifest
    assert started.x0 is None and started.env["positive"][0].get("encoder_hidden_states") is None
    for step in steps:
        assert step.x_next is None and [t.name for t in step.message.tensors.manifest] == ["x_next"]
        assert step.log_probs is not None


def test_resolved_request_reproduces_the_rollout(client):
    """The started event's resolved request, sent again, gives the same seeds, noise and log-probs."""
    started, steps = run(client, prompts=["a kite"], samples_per_prompt=2, debug_tensors=[EPS])
    resent = {field.name: value for field, value in started.message.resolved.ListFields()}
    again_started, again_steps = run(client, **resent)
    assert list(again_started.message.seeds) == list(started.message.seeds)
    assert torch.equal(again_started.x0, started.x0)
    for step, again in zip(steps, again_steps, strict=True):
        assert torch.equal(step.debug["eps"], again.debug["eps"])
        assert torch.equal(step.log_probs, again.log_probs)
