"""The trainer helpers: log-probs with gradients match the streamed ones at the rollout's policy and
reach the transformer's weights, also on steps scored while the rest still streams; group
advantages, the clipped loss, the KL and the JPEG reward match their formulas, computed
independently here (float64 NumPy, torch.distributions, PIL)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from support.parity import TOLERANCE, stochastic_steps
from support.requests import make_request

from rollout.v1 import rollout_pb2
from rollout_client.events import Step
from rollout_client.grpo import (
    clipped_policy_loss,
    group_advantages,
    guarded_policy_loss,
    kl_to_reference,
    micro_batches,
    sde_window,
    step_log_probs,
    step_transitions,
)
from rollout_client.rewards import jpeg_compressibility
from rollout_client.trajectory import Collector, collect


@pytest.mark.parametrize(
    "fields",
    [
        {"sampler": rollout_pb2.SAMPLER_TYPE_FLOW_SDE},
        {"sampler": rollout_pb2.SAMPLER_TYPE_CPS, "true_cfg_scale": 3.0, "negative_prompt": "blurry"},
    ],
    ids=["flow-sde", "cps-true-cfg"],
)
def test_step_log_probs_match_the_stream_and_carry_gradients(client, tiny_transformer, fields):
    request = make_request(
        {"prompts": ["a red fox", "two cats"], "samples_per_prompt": 2, "base_seed": 5, "num_steps": 4},
        {"height": 64, "width": 64, "images": False},
        fields,
    )
    trajectories = client.rollout(request)
    weight = tiny_transformer.proj_out.weight
    try:
        for i in stochastic_steps(trajectories[0]):
            log_probs = step_log_probs(tiny_transformer, trajectories, i)
            streamed = torch.stack([t.log_probs[i] for t in trajectories])
            torch.testing.assert_close(log_probs.detach(), streamed, atol=TOLERANCE, rtol=0)
            tiny_transformer.zero_grad(set_to_none=True)
            log_probs.sum().backward()
            assert weight.grad is not None and torch.isfinite(weight.grad).all()
            assert weight.grad.abs().sum() > 0
    finally:
        tiny_transformer.zero_grad(set_to_none=True)


def test_step_log_probs_refuse_a_deterministic_step(client, tiny_transformer):
    request = make_request(
        {"prompts": ["a red fox"], "num_steps": 3, "height": 64, "width": 64, "images": False},
        {"sampler": rollout_pb2.SAMPLER_TYPE_CPS},
    )
    trajectories = client.rollout(request)
    with pytest.raises(ValueError, match="step 2 of sample 0 is not stochastic"):
        step_log_probs(tiny_transformer, trajectories, 2)  # CPS's last step goes to sigma 0


def test_group_advantages_standardise_within_each_group():
    rewards = np.array([1.0, 3.0, 2.0, -1.0, -1.0, -1.0, 0.5, 4.0])
    groups = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    got = group_advantages(torch.tensor(rewards), torch.tensor(groups)).numpy()
    expected = np.empty_like(rewards)
    for g in np.unique(groups):
        values = rewards[groups == g]
        expected[groups == g] = (values - values.mean()) / (values.std() + 1e-4)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert np.all(got[groups == 1] == 0)  # a group with one reward value carries no signal


def test_clipped_policy_loss_is_the_ppo_surrogate():
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(64, generator=generator, dtype=torch.float64)
    new = old + 0.3 * torch.randn(64, generator=generator, dtype=torch.float64)
    advantages = 4 * torch.randn(64, generator=generator, dtype=torch.float64)
    for clip_range in (1e-4, 0.2):
        got = clipped_policy_loss(new, old, advantages, clip_range).item()
        a = np.clip(advantages.numpy(), -5, 5)
        rho = np.exp(new.numpy() - old.numpy())
        expected = np.mean(np.maximum(-a * rho, -a * np.clip(rho, 1 - clip_range, 1 + clip_range)))
        assert got == pytest.approx(expected, rel=1e-12)
    # On policy (rho = 1) the loss is -mean(A) and its gradient is -A / N.
    new = old.clone().requires_grad_(True)
    clipped_policy_loss(new, old, advantages, 1e-4).backward()
    np.testing.assert_allclose(new.grad.numpy(), -np.clip(advantages.numpy(), -5, 5) / 64, rtol=1e-12)


def _gaussian_log_probs(x_next: torch.Tensor, means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """float64 [B]: the mean over elements of log N(x_next; means, stds^2), as the server streams it."""
    s = stds.reshape(-1, 1, 1)
    elementwise = -((x_next - means) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * np.log(2 * np.pi)
    return elementwise.mean(dim=(1, 2))


def test_guarded_policy_loss_is_grpo_guards_surrogate():
    """Against the closed form of GRPO-Guard's log-ratio, mean(eps * (mean - mean_old)) with
    x_{i+1} = mean_old + s eps, computed without log-probs, on steps whose stds span 1e-3 to 0.5."""
    generator = torch.Generator().manual_seed(0)
    batch, shape = 64, (4, 8)
    stds = torch.logspace(-3, np.log10(0.5), batch, dtype=torch.float64)
    dts = torch.rand(batch, generator=generator, dtype=torch.float64) * 0.2 + 0.05
    old_means = torch.randn(batch, *shape, generator=generator, dtype=torch.float64)
    means = old_means + 0.05 * torch.randn(batch, *shape, generator=generator, dtype=torch.float64)
    eps = torch.randn(batch, *shape, generator=generator, dtype=torch.float64)
    x_next = old_means + stds.reshape(-1, 1, 1) * eps
    advantages = 4 * torch.randn(batch, generator=generator, dtype=torch.float64)
    log_probs, old_log_probs = (
        _gaussian_log_probs(x_next, means, stds),
        _gaussian_log_probs(x_next, old_means, stds),
    )
    a = np.clip(advantages.numpy(), -5, 5)
    rho = np.exp((eps.numpy() * (means - old_means).numpy()).mean(axis=(1, 2)))
    for clip_range in (1e-4, 0.2):
        got = guarded_policy_loss(
            log_probs, old_log_probs, means, old_means, stds, dts, advantages, clip_range
        ).item()
        expected = np.mean(
            np.maximum(-a * rho, -a * np.clip(rho, 1 - clip_range, 1 + clip_range)) / dts.numpy()
        )
        # float64: the log-prob terms are below 1e3 in size (|eps|^2 / 2 and |log s|, and
        # |mean - mean_old|^2 / (2 s^2) at s = 1e-3), so log_probs - old_log_probs + bias carries an
        # absolute error below 1e3 * 2.2e-16 * a few roundings, ~1e-12, before the scaling by s <= 0.5:
        # the ratios, and the loss, agree to a relative 1e-12; 1e-10 leaves room for the mean's sums.
        assert got == pytest.approx(expected, rel=1e-10)
    # On policy (rho = 1) the gradient w.r.t. the step mean is -A eps / (N B dt): eps, not PPO's
    # eps / s, so a step's pull no longer grows as its noise shrinks.
    on_policy = old_means.clone().requires_grad_(True)
    loss = guarded_policy_loss(
        _gaussian_log_probs(x_next, on_policy, stds),
        old_log_probs,
        on_policy,
        old_means,
        stds,
        dts,
        advantages,
        1e-4,
    )
    loss.backward()
    n = np.prod(shape)
    expected_grad = -a.reshape(-1, 1, 1) * eps.numpy() / (n * batch * dts.numpy().reshape(-1, 1, 1))
    # Same float64 bound as above, on terms of size |eps| / (n B dt) with no cancellation.
    np.testing.assert_allclose(on_policy.grad.numpy(), expected_grad, rtol=1e-10, atol=0)


def test_steps_scored_while_the_stream_runs_match_the_whole_rollout(client, tiny_transformer):
    """A trainer scoring each step as soon as x_i, x_{i+1} and its log-probs arrive gets the same
    numbers as one that waits for the whole rollout, and the streamed log-probs."""
    request = make_request(
        {"prompts": ["a red fox", "two cats"], "samples_per_prompt": 2, "base_seed": 9, "num_steps": 5},
        {"height": 64, "width": 64, "latents": rollout_pb2.LATENT_SELECTION_AROUND_STOCHASTIC},
        stochastic_steps=[1, 2],
    )
    collector, events, early = Collector(), [], {}
    with torch.no_grad():
        for event in client.stream(request):
            collector.add(event)
            events.append(event)
            if isinstance(event, Step):
                for i in (1, 2):
                    if i not in early and collector.ready(i):
                        assert collector.finished is None and not collector.images
                        early[i] = step_log_probs(tiny_transformer, collector.trajectories(), i)
        assert sorted(early) == [1, 2]
        assert not collector.ready(0) and not collector.ready(3)  # deterministic steps
        whole = collect(events)
        assert torch.equal(collector.trajectories()[3].latents.nan_to_num(), whole[3].latents.nan_to_num())
        assert whole[0].image_png is not None
        for i, log_probs in early.items():
            assert torch.equal(log_probs, step_log_probs(tiny_transformer, whole, i))
            streamed = torch.stack([t.log_probs[i] for t in whole])
            torch.testing.assert_close(log_probs, streamed, atol=TOLERANCE, rtol=0)


def test_micro_batches_cover_every_row_once_and_never_mix_shapes(client, tiny_transformer):
    small = client.rollout(
        make_request(
            {"prompts": ["a", "b"], "samples_per_prompt": 3, "num_steps": 3, "height": 64, "width": 64}
        )
    )
    large = client.rollout(make_request({"prompts": ["c"], "num_steps": 3, "height": 128, "width": 64}))
    trajectories = small + large
    pieces = list(micro_batches(trajectories, [0, 2], size=4))
    assert all(1 <= len(rows) <= 4 for _, rows in pieces)
    covered = sorted((i, row) for i, rows in pieces for row in rows)
    assert covered == sorted((i, row) for i in (0, 2) for row in range(7))
    for i, rows in pieces:  # each piece is one batch of one shape, scored as streamed
        with torch.no_grad():
            log_probs = step_log_probs(tiny_transformer, [trajectories[row] for row in rows], i)
        streamed = torch.stack([trajectories[row].log_probs[i] for row in rows])
        torch.testing.assert_close(log_probs, streamed, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="differ in transformer call, env shapes or expert"):
        step_log_probs(None, [small[0], large[0]], 0)


def test_sde_window_is_consecutive_and_starts_in_the_first_half():
    generator = torch.Generator().manual_seed(0)
    starts = set()
    for _ in range(200):
        window = sde_window(10, 2, generator)
        assert window == [window[0], window[0] + 1]
        starts.add(window[0])
    assert starts == {0, 1, 2, 3, 4}  # uniform over [0, 10 // 2 - 1]
    assert sde_window(4, 4) == [0, 1, 2, 3]
    assert sde_window(6, 3, last_start=5, generator=torch.Generator().manual_seed(1))[-1] <= 5
    with pytest.raises(ValueError):
        sde_window(3, 4)


def test_kl_to_reference_is_the_gaussian_kl_per_element():
    generator = torch.Generator().manual_seed(3)
    means = torch.randn(3, 16, 8, generator=generator, dtype=torch.float64)
    reference = means + 0.1 * torch.randn(3, 16, 8, generator=generator, dtype=torch.float64)
    stds = torch.tensor([0.3, 0.05, 1.0], dtype=torch.float64)
    got = kl_to_reference(means, reference, stds)
    scale = stds.view(3, 1, 1).expand_as(means)
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(means, scale), torch.distributions.Normal(reference, scale)
    ).mean(dim=(1, 2))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    assert torch.equal(kl_to_reference(means, means, stds), torch.zeros(3))


def test_kl_to_the_base_model_is_zero_before_training_and_positive_after(client, tiny_transformer):
    from support.weights import with_lora

    trajectories = client.rollout(
        make_request({"prompts": ["a kite"], "num_steps": 3, "height": 64, "width": 64})
    )
    for trained in (False, True):
        adapted, _ = with_lora(tiny_transformer, trained=trained)
        with torch.no_grad():
            transition = step_transitions(adapted, trajectories, 0)
            adapted.disable_adapters()
            reference = step_transitions(adapted, trajectories, 0).means
            # The base weights the adapter wraps, called without it: the same parameter memory, so
            # the same kernels and bits (a copy of the module may be laid out differently in memory,
            # which changes the last bits of a BLAS product on some CPUs).
            base = step_transitions(_without_adapters(adapted), trajectories, 0).means
        assert torch.equal(reference, base)
        kl = kl_to_reference(transition.means, reference, transition.stds)
        assert (kl > 1e-6).all() if trained else torch.equal(kl, torch.zeros(1))


def _without_adapters(adapted: torch.nn.Module) -> torch.nn.Module:
    """The base model built on the very tensors the LoRA layers of ``adapted`` wrap (assigned, not
    copied), so it computes exactly what the base model computes on that memory."""
    from rollout_core.checksum import base_tensors

    plain = type(adapted).from_config(adapted.config)
    plain.load_state_dict(base_tensors(adapted), strict=True, assign=True)
    return plain.eval()


def test_jpeg_compressibility_is_minus_the_q95_size_in_kb_over_500():
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    flat = Image.new("RGB", (64, 64), (120, 30, 200))
    rewards = jpeg_compressibility([noise, flat.convert("L"), flat], ["a", "b", "c"])
    sizes = []
    for image in (noise, flat.convert("L").convert("RGB"), flat):
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=95)
        sizes.append(len(buffer.getvalue()))
    np.testing.assert_allclose(rewards.numpy(), -np.array(sizes) / 1000 / 500, rtol=1e-6)
    assert rewards[2] > rewards[0]  # a flat image compresses far better than noise
