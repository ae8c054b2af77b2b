"""Wan 2.2's two experts on a server of their own: a weight update names the expert it changes (full,
LoRA, or from a pipeline folder) and changes only the steps that expert runs, which a trainer then
replays with both experts by name."""

import shutil

import grpc
import pytest
import torch
from peft import get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from support.errors import field_violations
from support.families import family_request
from support.parity import assert_replays
from support.servers import start_server
from support.weights import perturbed, with_lora

from rollout_client import RolloutClient

FAMILY = "wan2.2"


@pytest.fixture(scope="module")
def family():
    return FAMILY


@pytest.fixture(scope="module")
def wan22(family_resources, cache_dir, tmp_path_factory):
    """A tiny-wan2.2 server whose --weights-root holds a copy of its own pipeline folder (the tests
    change its policy, so it is not the shared one)."""
    folder = tmp_path_factory.mktemp("wan22")
    shutil.copytree(family_resources.folder(FAMILY), folder / "weights" / "pipeline")
    server = start_server(
        cache_dir, folder / "wan22.log", "--model", "tiny-wan2.2", "--weights-root", str(folder / "weights")
    )
    try:
        with RolloutClient(server.address, timeout=120) as client:
            yield client
    finally:
        server.stop()


def test_an_update_of_the_low_noise_expert_changes_only_its_steps(wan22, family_transformer):
    experts = family_transformer
    request = family_request(FAMILY, "FLOW_SDE", cfg=True)
    wan22.load_weights("pipeline", wan22.server_info().policy_version + 1, target="transformer_2")
    before = wan22.rollout(request)
    v = before[0].policy_version
    assert before[0].step_transformers == ["transformer", "transformer", "transformer_2", "transformer_2"]

    changed = perturbed(experts["transformer_2"], seed=5)
    assert wan22.update_weights(changed.state_dict(), v + 1, target="transformer_2").policy_version == v + 1
    after = wan22.rollout(request)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.latents[:3], new.latents[:3])  # x_0, and steps 0 and 1 on transformer
        assert (old.latents[3:] - new.latents[3:]).abs().amax(dim=tuple(range(1, 5))).min() > 1e-3
    assert_replays(
        {"transformer": experts["transformer"], "transformer_2": changed}, after, bare_reference=True
    )
    with pytest.raises(AssertionError):
        assert_replays(experts, after)  # the old low-noise expert does not replay it

    # A LoRA on the low-noise expert only (over its updated weights): the server reports it under
    # that expert's name.
    adapted, config = with_lora(changed, trained=True)
    adapter = get_peft_model_state_dict(adapted)
    wan22.update_weights(adapter, v + 2, lora_config=config, target="transformer_2")
    info = wan22.server_info()
    wrapped = sorted(name for name, module in adapted.named_modules() if isinstance(module, BaseTunerLayer))
    assert list(info.lora_adapters) == ["transformer_2"] and not info.HasField("lora_adapter")
    assert list(info.lora_adapters["transformer_2"].modules) == wrapped
    with_adapter = wan22.rollout(request)
    assert torch.equal(with_adapter[0].latents[:3], before[0].latents[:3])
    assert_replays({"transformer": experts["transformer"], "transformer_2": adapted}, with_adapter)

    # The pipeline folder's transformer_2 brings the expert back (a full update drops its LoRA).
    assert wan22.load_weights("pipeline", v + 3, target="transformer_2").policy_version == v + 3
    assert not wan22.server_info().lora_adapters
    for old, new in zip(before, wan22.rollout(request), strict=True):
        assert torch.equal(old.latents, new.latents)


@pytest.mark.parametrize("target", ["transformer_3", "../transformer", ""])
def test_an_unknown_expert_is_refused_by_name(wan22, family_transformer, target):
    version = wan22.server_info().policy_version
    if not target:  # the default, the first expert: accepted
        assert wan22.load_weights("pipeline", version + 1, target=target).policy_version == version + 1
        return
    for call, field in (
        (
            lambda: wan22.update_weights(
                family_transformer["transformer"].state_dict(), version + 1, target=target
            ),
            "header.target",
        ),
        (lambda: wan22.load_weights("pipeline", version + 1, target=target), "target"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [violation.field for violation in field_violations(refused.value)] == [field]
    assert wan22.server_info().policy_version == version
