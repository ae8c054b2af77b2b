"""The shapes eval at the server's defaults and with step-wise search, as the trainer runs it
(``train.metrics.evaluate``), and best-of-N by the same reward, on the shared shapes server."""

import io

import pytest
import torch

from rollout_client.rewards import shapes
from rollout_client.shapes_eval import (
    eval_request,
    evaluate_best_of,
    evaluate_policy,
    search_capacity,
)
from rollout_client.train.config import parse_args
from rollout_client.train.metrics import DEFAULTS, SEARCH, SEARCH_DEFAULTS, TRAINING, eval_columns, evaluate
from rollout_client.train.rewards import Rewards
from rollout_core import noise, scenes

GENEVAL = "rollout_client.rewards.shapes:geneval_reward"
# Decisions at steps 1 and 2, both below T - 1: each held and pruned.
STEPS, K, SEARCHED, PROMPTS = 4, 4, [0, 1], 6


@pytest.fixture(scope="module")
def shapes_client(family_resources):
    return family_resources.client("shapes")


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_trainers_evals_are_at_its_settings_at_the_servers_defaults_and_with_search(shapes_client):
    """With --search the trainer evaluates four ways (here on the first 6 eval prompts). The defaults
    eval is the request with GetServerInfo.defaults' steps and CFG written out (the same requests on
    one server: the same images, bitwise). A search of K at m steps whose decisions are held spends
    (K - 1) m rows of one step per image and CFG branch beside plain sampling's T, here in several
    requests (the tree is admitted at its full width, K^m leaves an image), its images in the eval's
    order."""
    flags = ["--prompt-set", "shapes", "--reward", GENEVAL, "--eval-every", "1", "--eval-samples", "1"]
    flags += ["--eval-prompts", str(PROMPTS), "--steps", str(STEPS), "--size", "64"]
    flags += ["--search", str(K), "--search-steps", ",".join(map(str, SEARCHED))]
    config = parse_args(flags)
    results = evaluate(shapes_client, config, Rewards(GENEVAL))
    assert list(results) == [TRAINING, DEFAULTS, SEARCH, SEARCH_DEFAULTS]
    assert all(result.prompts == list(scenes.eval_prompts())[:PROMPTS] for result in results.values())

    info = shapes_client.server_info()
    defaults = info.defaults
    cfg = defaults.true_cfg_scale if defaults.HasField("true_cfg_scale") else None
    explicit = eval_request(
        samples=1, steps=defaults.num_steps, size=64, seed=2024, true_cfg_scale=cfg, prompts=PROMPTS
    )
    written_out = evaluate_policy(shapes_client, explicit)
    assert [png(i) for i in written_out.images] == [png(i) for i in results[DEFAULTS].images]
    assert defaults.num_steps != STEPS  # so the two settings differ

    assert search_capacity(K, len(SEARCHED), info.limits) < PROMPTS  # several search requests
    for name, steps in ((SEARCH, STEPS), (SEARCH_DEFAULTS, defaults.num_steps)):
        result = results[name]
        branches = result.plain_forwards // (steps * PROMPTS)
        assert branches in (1, 2) and result.plain_forwards == steps * PROMPTS * branches
        assert result.forwards == result.plain_forwards + (K - 1) * len(SEARCHED) * PROMPTS * branches

    row = eval_columns(results)
    assert row["eval_accuracy"] == results[TRAINING].accuracy
    assert row["eval_se_defaults"] == results[DEFAULTS].standard_error
    assert row["eval_forwards_search"] == results[SEARCH].forwards
    assert row["eval_plain_forwards_search_defaults"] == results[SEARCH_DEFAULTS].plain_forwards


def test_best_of_n_keeps_each_images_best_candidate_by_the_reward(shapes_client):
    """Best-of-1 is plain sampling (the same request: bitwise); best-of-2 keeps, image by image, the
    candidate the reward scores higher (the first on a tie) of the plain image and the one from the
    documented second seed, each recomputed here."""
    request = eval_request(samples=2, steps=STEPS, size=64, seed=7, prompts=PROMPTS)
    plain = evaluate_policy(shapes_client, request)
    reward = shapes.geneval_reward
    one = evaluate_best_of(shapes_client, request, reward, 1, plain_forwards=100)
    assert [png(i) for i in one.images] == [png(i) for i in plain.images] and one.forwards == 100

    two = evaluate_best_of(shapes_client, request, reward, 2, plain_forwards=100)
    count = len(plain.images)
    second_request = eval_request(samples=2, steps=STEPS, size=64)
    second_request.prompts[:] = request.prompts
    second_request.ClearField("base_seed")
    second_request.seeds[:] = noise.derive_seeds(7 + count, count)
    second = evaluate_policy(shapes_client, second_request)
    first_scores, second_scores = reward(plain.images, plain.prompts), reward(second.images, plain.prompts)
    expected = [
        png(b) if float(s2) > float(s1) else png(a)
        for a, b, s1, s2 in zip(plain.images, second.images, first_scores, second_scores, strict=True)
    ]
    assert [png(i) for i in two.images] == expected and two.forwards == 200 and two.plain_forwards == 100
    assert two.correct == shapes.strict_accuracy(two.images, two.prompts).bool().tolist()
    assert torch.as_tensor(first_scores).ne(torch.as_tensor(second_scores)).any()  # the choice mattered
