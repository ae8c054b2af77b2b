"""``make train``: examples/train_grpo.py closes the loop on a real server. Its rollouts run on the
policy it pushed, the server binds its LoRA to the modules it trained, and what the server samples
afterwards is exactly the trainer's final policy (replayed through the base transformer with the saved
adapter). A run starts on its own policy whatever the server held, a killed run resumes to the
uninterrupted result, and a hung or dead server is reported and retried, then stops the run with its
finished iterations checkpointed."""

import copy
import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import AutoModel
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from PIL import Image
from safetensors.torch import load_file
from support import forked
from support.parity import TOLERANCE, assert_replays
from support.requests import make_request
from support.servers import example_module, metrics_url, run_example, scrape, start_server
from support.train_runs import (
    TIMED,
    TINY,
    WAIT_SECONDS,
    metrics_rows,
    read_metrics,
    run_trainer,
    same_for_any_run,
    start_trainer,
    trainer_args,
    training_server,
    wait_until,
)
from support.weights import next_version, perturbed, with_lora

from rollout_client import RolloutClient
from rollout_client.rewards import jpeg_compressibility
from rollout_client.train import Trainer
from rollout_client.train.distributed import Ranks
from rollout_client.train.finite import NonFinite
from rollout_core import checksum
from rollout_core.local_server import SERVING_LINE

PROBE = make_request(
    {"prompts": ["a red fox"], "samples_per_prompt": 2, "base_seed": 11, "num_steps": 3},
    {"height": 64, "width": 64},
)
# The server's log lines of a release and a resume of its weights' memory.
RESIDENCY_LINES = (r"weights' memory released", r"weights' memory resumed")


@pytest.fixture(scope="module")
def train_server(cache_dir, tiny_flux_folder, tmp_path_factory):
    """This module's server (``training_server``)."""
    server = training_server(cache_dir, tmp_path_factory.mktemp("train") / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def train_client(train_server):
    with RolloutClient(train_server.address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def trainer():
    """examples/train_grpo.py as a module (its argument parser)."""
    return example_module("train_grpo")


def test_three_iterations_push_the_trained_lora_and_change_the_rollouts(
    train_client, tmp_path, tiny_transformer
):
    """Here the server holds another policy first (a random LoRA), as an earlier run leaves it: the
    trainer's first rollouts still run on its own policy, pushed before them."""
    foreign, foreign_config = with_lora(tiny_transformer, trained=True)
    weights = get_peft_model_state_dict(foreign)
    version = next_version(train_client)
    train_client.update_weights(weights, version, lora_config=foreign_config, progress=False)
    before = train_client.rollout(PROBE)
    first = next_version(train_client)
    out = tmp_path / "train"
    rows = run_trainer(train_client.address, out)

    assert [int(row["iteration"]) for row in rows] == [0, 1, 2]
    assert all(float(row["ratio_max_dev"]) <= TOLERANCE for row in rows)  # on policy from the first, in fp32
    # Each iteration pushes the trainer's policy, then rolls out on it.
    assert [int(row["pushed_version"]) for row in rows] == [first, first + 1, first + 2]
    assert [int(row["policy_version"]) for row in rows] == [first, first + 1, first + 2]
    assert all(float(row[column]) > 0 for row in rows for column in TIMED)
    assert Image.open(out / "reward.png").format == "PNG"
    for iteration in ("iter-0000", "iter-0002"):
        assert len(list((out / "samples" / iteration).glob("p0?-s00?-*.png"))) == 6

    # The adapter the server runs is bound to every module the trainer trained, and only those.
    config = LoraConfig.from_pretrained(out / "lora")
    trained = copy.deepcopy(tiny_transformer)
    trained.add_adapter(config)
    set_peft_model_state_dict(trained, load_file(out / "lora" / "adapter_model.safetensors"))
    wrapped = sorted(name for name, module in trained.named_modules() if isinstance(module, BaseTunerLayer))
    info = train_client.server_info()
    assert sorted(config.target_modules) == sorted(info.lora_targets)  # the server's default targets
    assert info.policy_version == first + 3  # and the final policy after the last iteration
    assert list(info.lora_adapter.modules) == wrapped
    assert {target for target in config.target_modules if any(m.endswith(target) for m in wrapped)} == set(
        config.target_modules
    )

    # Same request, same noise; after the pushes the rollout differs, and it is the trainer's policy.
    after = train_client.rollout(PROBE)
    assert after[0].policy_version == first + 3
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.latents[0], new.latents[0])
        assert (old.latents[-1] - new.latents[-1]).abs().max() > 1e-4
    assert_replays(trained, after)


def run_data_parallel(address: str, out: Path, ranks: int, *flags: str) -> list[dict]:
    """The trainer under ``torchrun --nproc-per-node ranks`` (gloo on the CPU)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command = [*launcher, forked.TRAINER, *trainer_args(address, out, *flags)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(out)


def first_step(out: Path) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, weight, gradient) of every trained tensor after a run's first optimizer step, read back
    from its checkpoint. AdamW's first-moment buffer starts at zero and is lerped towards the
    gradient by 1 - beta1, so after one step it holds (1 - beta1) g, up to one rounding."""
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    optimizer = checkpoint["optimizer"]
    beta1 = optimizer["param_groups"][0]["betas"][0]
    gradients = [optimizer["state"][index]["exp_avg"] / (1 - beta1) for index in sorted(optimizer["state"])]
    policy = checkpoint["policy"]  # the trained tensors, in the optimizer's order
    assert [tuple(t.shape) for t in policy.values()] == [tuple(g.shape) for g in gradients]
    return [(name, weight, g) for (name, weight), g in zip(policy.items(), gradients, strict=True)]


def test_two_data_parallel_ranks_train_the_adapter_one_rank_does(train_client, tmp_path, tiny_flux_folder):
    """Under torchrun each rank rolls out its half of the prompt groups, with the seeds one rank
    would draw, and the gradients are averaged before the step: the same images and rewards as one
    rank, and the same gradient up to the order of the float sums. (Over more iterations the
    policies' rounding differences reach the 8-bit images a reward sees, so runs drift apart by more.)"""
    rows, steps = 2 * 4, 3
    flags = ("--iterations", "1", "--prompts", "2", "--group-size", "4", "--steps", str(steps))
    one = run_trainer(train_client.address, tmp_path / "one", *flags)
    two = run_data_parallel(train_client.address, tmp_path / "two", 2, *flags)
    assert (one[0]["reward_mean"], one[0]["reward_std"]) == (two[0]["reward_mean"], two[0]["reward_std"])
    assert math.isclose(float(one[0]["loss"]), float(two[0]["loss"]), rel_tol=1e-5, abs_tol=1e-7)  # ~0

    # What the ranks promise is the gradient: one rank sums every row's contribution in one backward
    # per step; two ranks sum half the rows each, then all_reduce and halve (exact: a power of 2).
    # Each element is a sum of n = rows x steps x tokens terms (a weight gradient reduces over every
    # token of every row at every stochastic step), and fp32 recursive summation errs by at most
    # (n - 1) u sum|t| (u = 2^-24). The terms' absolute sum is not observable from here; taking the
    # gradient's norm as its scale, the two runs differ by at most 2 n u |g| in norm. With 16 image
    # and 512 text tokens that is 2 x 12,672 u ~ 1.5e-3 relative; the CPUs seen give ~50 u.
    text_tokens = json.loads((tiny_flux_folder / "tokenizer_2" / "tokenizer_config.json").read_text())
    n = rows * steps * (16 + text_tokens["model_max_length"])
    bound = 2 * n * 2.0**-24
    runs = [first_step(tmp_path / run) for run in ("one", "two")]
    assert [name for name, _, _ in runs[0]] == [name for name, _, _ in runs[1]]
    for (name, _, g), (_, _, g_two) in zip(*runs, strict=True):
        assert (g_two - g).norm() <= bound * g.norm(), name

    # The adapters: AdamW's first step moves each element by lr g / (|g| + eps) (the bias-corrected
    # moments are g and g^2), which turns an element whose gradient is within the error of 0 into
    # any move up to lr: that is where Adam amplifies the sums' order, and only there. Where |g|
    # clears twice the error e = bound |g|, the two moves differ by at most lr eps e / (|g| - e)^2
    # (the slope of g / (|g| + eps) is eps / (|g| + eps)^2), plus the roundings of computing the move
    # and the weight: 4 ulps of the larger of the weight and lr.
    lr, eps = 1e-2, 1e-8  # the trainer's learning rate and AdamW's default eps
    for (name, weight, g), (_, weight_two, _) in zip(*runs, strict=True):
        error = bound * g.norm()
        clear = g.abs() > 2 * error
        roundings = 4 * 2.0**-23 * weight.abs().clamp_min(lr)
        allowed = lr * eps * error / (g.abs() - error).clamp_min(error) ** 2 + roundings
        assert bool(((weight_two - weight).abs() <= allowed)[clear].all()), name
    saved = load_file(tmp_path / "one" / "lora" / "adapter_model.safetensors")
    assert saved.keys() == {name for name, _, _ in runs[0]}  # the checkpoint holds the final adapter
    assert all(torch.equal(saved[name], weight) for name, weight, _ in runs[0])
    # The runs trained: lora_B starts at zero.
    assert max(weight.abs().max().item() for name, weight, _ in runs[0] if "lora_B" in name) > 1e-4


def test_full_parameter_training_syncs_over_the_group_from_two_ranks(cache_dir, tmp_path, tiny_transformer):
    """--train full: every parameter trains, and rank 0 pushes the whole transformer over a
    weight-sync group at every iteration; the server ends serving the saved transformer, bitwise."""
    server = start_server(cache_dir, tmp_path / "server.log")
    try:
        out = tmp_path / "full"
        flags = ("--iterations", "2", "--train", "full", "--lr", "1e-4")
        rows = run_data_parallel(server.address, out, 2, *flags)
        assert all(float(row["ratio_max_dev"]) <= TOLERANCE for row in rows)  # on policy
        with RolloutClient(server.address, timeout=60) as client:
            info = client.server_info()
            trained = AutoModel.from_pretrained(str(out / "transformer"))
            served = checksum.weights_checksum(checksum.policy_tensors({"transformer": trained.state_dict()}))
            base = checksum.policy_tensors({"transformer": tiny_transformer.state_dict()})
            assert info.weights_checksum == served != checksum.weights_checksum(base)
            assert not info.HasField("lora_adapter")
            assert not info.HasField("weight_sync")  # the trainer left the group at the end
            assert_replays(trained, client.rollout(PROBE))
        assert "joined weight-sync group" in (tmp_path / "server.log").read_text()
    finally:
        server.stop()


def test_full_parameter_training_forms_a_new_group_when_its_server_restarts(cache_dir, tmp_path):
    """--train full over the group: the server is killed while the trainer streams a rollout (the
    trainer is stopped meanwhile, so the rollout is still open), and a new one comes up on its port,
    in no group. The trainer retries, sees from the server's info that the server is not in its
    group, forms a new one and pushes its policy there: every iteration on policy, and the server
    ends serving the saved transformer. (Before, the retry pushed into the old group and the run
    stopped on FAILED_PRECONDITION.)"""
    server = start_server(cache_dir, tmp_path / "server.log", "--metrics-port", "0")
    port, metrics = server.address.rsplit(":", 1)[1], metrics_url(server)
    out = tmp_path / "full"
    flags = ("--iterations", "4", "--train", "full", "--lr", "1e-4", "--retries", "6")
    process, log = start_trainer(server.address, out, *flags)
    try:
        wait_until(process, log, lambda: metrics_rows(out) >= 1)
        while True:  # until the trainer is stopped inside a rollout of a later iteration
            wait_until(process, log, lambda: scrape(metrics)[("rollout_server_in_flight_rollouts", ())] > 0)
            process.send_signal(signal.SIGSTOP)
            if scrape(metrics)[("rollout_server_in_flight_rollouts", ())] > 0:
                break
            process.send_signal(signal.SIGCONT)
        assert metrics_rows(out) < 4
        server.stop(signal.SIGKILL)
        server = start_server(cache_dir, tmp_path / "restarted.log", "--port", port)
        process.send_signal(signal.SIGCONT)
        assert process.wait(timeout=WAIT_SECONDS) == 0, log.read_text()
        with RolloutClient(server.address, timeout=60) as client:
            info = client.server_info()
    finally:
        process.kill()
        server.stop()
    assert "the server is no longer in the weight-sync group: forming a new one" in log.read_text()
    rows = read_metrics(out)
    assert len(rows) == 4 and all(float(row["ratio_max_dev"]) <= TOLERANCE for row in rows)
    trained = AutoModel.from_pretrained(str(out / "transformer"))
    assert info.weights_checksum == checksum.weights_checksum(
        checksum.policy_tensors({"transformer": trained.state_dict()})
    )


def test_a_policy_the_server_does_not_serve_stops_the_run(train_client, tiny_flux_folder, tmp_path):
    """The trainer's --model-path is another transformer than the server's: the adapter it pushes
    lands on the server's base, whose checksum is not the trainer's. The run stops with one line
    naming both checksums, not a traceback."""
    other = tmp_path / "other-model"
    shutil.copytree(tiny_flux_folder, other)
    base = AutoModel.from_pretrained(str(other), subfolder="transformer")
    perturbed(base, seed=5).save_pretrained(str(other / "transformer"))
    with pytest.raises(SystemExit) as stopped:
        run_trainer(train_client.address, tmp_path / "train", "--model-path", str(other))
    message = str(stopped.value.code)
    assert message.startswith("train_grpo.py: stopped: ") and "\n" not in message
    mismatch = r"the server serves weights \S+, not the trained \S+; no iteration had finished"
    assert re.search(mismatch, message)


def test_a_colocated_run_releases_the_server_while_it_trains_and_rolls_out_on_policy(
    train_server, train_client, tmp_path
):
    """--colocate: the server releases its weights' memory for each iteration's update and resumes it
    before the next push; the weights that come back are the ones that went (the base a LoRA run
    scores against: the ratio of every first inner step is 1 again, Replay), and the server is left
    serving."""
    released, resumed = (len(re.findall(what, train_server.log())) for what in RESIDENCY_LINES)
    first = next_version(train_client)
    rows = run_trainer(train_client.address, tmp_path / "train", "--colocate")
    assert [int(row["policy_version"]) for row in rows] == [first, first + 1, first + 2]
    assert all(float(row["ratio_max_dev"]) <= TOLERANCE for row in rows)
    log = train_server.log()
    assert [len(re.findall(what, log)) for what in RESIDENCY_LINES] == [released + 3, resumed + 3]
    assert not train_client.server_info().memory_released


def test_async_rollouts_are_at_most_one_version_stale(train_client, tmp_path):
    first = next_version(train_client)
    rows = run_trainer(train_client.address, tmp_path / "train", "--async", "--kl-beta", "0.04")
    # Iteration 0 waits for its rollout; iteration i > 0 trains on rollouts of the policy before its
    # own, which streamed while iteration i - 1 trained.
    assert [int(row["pushed_version"]) for row in rows] == [first, first + 1, first + 2]
    assert [int(row["policy_version"]) for row in rows] == [first, first, first + 1]
    deviations = [float(row["ratio_max_dev"]) for row in rows]
    assert deviations[0] <= TOLERANCE < deviations[1]  # the ratio sees the stale policy
    # The KL to the base model: none before the first step (the LoRA starts at zero), then some.
    kls = [float(row["kl"]) for row in rows]
    assert kls[0] == 0 and kls[1] > 0 and kls[2] > 0


def test_steps_scored_while_streaming_train_as_after_the_stream(train_client, tmp_path):
    """The same run with log-probs computed as steps arrive ends with the same adapter (here with a
    Flow-GRPO-Fast window of 2 stochastic steps and micro-batches smaller than a step's rows)."""
    flags = ("--window", "2", "--micro-batch", "4")
    streamed = run_trainer(train_client.address, tmp_path / "streamed", *flags, "--score-while-streaming")
    plain = run_trainer(train_client.address, tmp_path / "plain", *flags)
    for a, b in zip(streamed, plain, strict=True):
        assert float(a["reward_mean"]) == pytest.approx(float(b["reward_mean"]), abs=1e-6)
        assert a["scored_steps"] in ("0 1", "1 2")  # a window of 2 consecutive steps out of 3
    adapters = [
        load_file(tmp_path / run / "lora" / "adapter_model.safetensors") for run in ("streamed", "plain")
    ]
    assert adapters[0].keys() == adapters[1].keys()
    for name, tensor in adapters[0].items():
        torch.testing.assert_close(tensor, adapters[1][name], atol=1e-6, rtol=0)
    assert any(tensor.abs().max() > 0 for name, tensor in adapters[0].items() if "lora_B" in name)


def test_the_stabilisers_train_on_policy_and_log_the_anchors_pull(train_client, tmp_path):
    """--grpo-guard trains the LoRA on policy; --algorithm nft with the x0 loss and an anchor logs
    both terms' gradient norms (the unit tests check the losses themselves)."""
    guarded = run_trainer(train_client.address, tmp_path / "guard", "--grpo-guard")
    assert all(float(row["ratio_max_dev"]) <= TOLERANCE for row in guarded)
    adapter = load_file(tmp_path / "guard" / "lora" / "adapter_model.safetensors")
    assert any(tensor.abs().max() > 0 for name, tensor in adapter.items() if "lora_B" in name)
    assert all(math.isnan(float(row["anchor_grad_norm"])) for row in guarded)
    flags = ("--algorithm", "nft", "--nft-loss", "x0", "--nft-anchor", "1", "--nft-draws", "2")
    anchored = run_trainer(train_client.address, tmp_path / "nft", *flags)
    for row in anchored:
        assert 0 < float(row["policy_grad_norm"]) < math.inf and 0 < float(row["anchor_grad_norm"]) < math.inf


def test_awm_an_old_policy_an_ema_early_branching_and_a_time_budget_train(train_client, tmp_path):
    """The forward-process variants and the run-level options on the tiny model: AWM with a KL to the
    EMA saves both adapters, different and both trained, and leaves the server on the EMA (the pusher
    checks what the server serves); DiffusionNFT with an old policy checkpoints it; a tree with
    --tree-sde forks trains its fork step only, on policy; and a budget already spent stops the run
    after its first iteration, saved and ended as a whole run is."""
    awm = run_trainer(train_client.address, tmp_path / "awm", "--algorithm", "awm", "--ema-decay", "0.5",
                      "--awm-kl", "1", "--nft-draws", "2", "--nft-min-level", "0.5")  # fmt: skip
    assert all(row["ratio_max_dev"] == "nan" and math.isfinite(float(row["loss"])) for row in awm)
    assert all(0.5 < float(row["velocity_norm_ratio"]) < 2 for row in awm)
    trained, ema = (
        load_file(tmp_path / "awm" / folder / "adapter_model.safetensors") for folder in ("lora", "lora-ema")
    )
    lora_b = [name for name in trained if "lora_B" in name]
    assert any(trained[name].abs().max() > 0 for name in lora_b)
    assert any(ema[name].abs().max() > 0 for name in lora_b)
    assert not all(torch.equal(trained[name], ema[name]) for name in lora_b)

    flags = ("--algorithm", "nft", "--nft-old-decay", "0.5", "--nft-old-ramp", "1", "--nft-draws", "2")
    run_trainer(train_client.address, tmp_path / "old", *flags)
    averages = torch.load(tmp_path / "old" / "checkpoint.pt", weights_only=True)["averages"]
    assert averages["ema"] is None and len(averages["algorithm"]["old"]) > 0

    early = run_trainer(train_client.address, tmp_path / "tree", "--group-size", "1", "--tree", "0:4",
                        "--tree-sde", "forks")  # fmt: skip
    for row in early:
        assert row["scored_steps"] == "0" and float(row["ratio_max_dev"]) <= TOLERANCE

    spent = run_trainer(train_client.address, tmp_path / "budget", "--time-budget", "0.001")
    assert len(spent) == 1
    assert torch.load(tmp_path / "budget" / "checkpoint.pt", weights_only=True)["iterations_done"] == 1
    assert (tmp_path / "budget" / "lora" / "adapter_model.safetensors").is_file()


def test_tree_rollouts_pruned_early_train_every_edge_on_policy(train_client, tmp_path):
    """--tree: two roots per prompt fork at steps 0 and 1 (8 leaves a prompt). When step 1 arrives the
    trainer keeps each prompt's best and worst node by predicted reward and asks the server to prune
    the other 6; the server, holding the rollout at that step, stops every one of them at step 2
    (so the rollout costs exactly the rows of a tree pruned there), every edge left is trained once,
    on the policy that sampled it, and the adapter moves."""
    steps = 4  # the server would run past the prune point long before a prune without the hold
    flags = ("--group-size", "2", "--tree", "0:2,1:2", "--steps", str(steps), "--prune-at", "1")
    rows = run_trainer(train_client.address, tmp_path / "tree", *flags, "--prune-keep", "2")
    pruned_at_2 = 2 * (2 + 4 + 2 * (steps - 2))  # per prompt: 2 roots, 4 children, then 2 kept leaves
    for row in rows:
        assert float(row["ratio_max_dev"]) <= TOLERANCE and math.isfinite(float(row["loss"]))
        assert row["scored_steps"] == " ".join(map(str, range(steps)))
        assert int(row["prune_asked"]) == int(row["prune_stopped"]) == 2 * 6
        assert int(row["pruned_leaves"]) == 2 * 6 and int(row["transformer_rows"]) == pruned_at_2
    adapter = load_file(tmp_path / "tree" / "lora" / "adapter_model.safetensors")
    assert any(tensor.abs().max() > 0 for name, tensor in adapter.items() if "lora_B" in name)


def test_a_killed_run_resumes_to_the_uninterrupted_run(train_client, tmp_path, trainer, capsys):
    """SIGKILL after the first checkpoint, then --resume: the metrics, the final adapter and its EMA are
    those of a run that was never interrupted, bit for bit (same seeds, same server, one thread each
    side)."""
    flags = ("--iterations", "5", "--checkpoint-every", "2", "--ema-decay", "0.5")
    killed = tmp_path / "killed"
    process, log = start_trainer(train_client.address, killed, *flags)
    try:
        wait_until(process, log, lambda: "checkpoint: iterations 0-1 " in log.read_text())
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL, log.read_text()  # it was killed with work left
    assert torch.load(killed / "checkpoint.pt", weights_only=True)["iterations_done"] in (2, 4)

    resumed = run_trainer(train_client.address, killed, *flags, "--resume")
    whole = run_trainer(train_client.address, tmp_path / "whole", *flags)
    assert [int(row["iteration"]) for row in resumed] == list(range(5))
    for row in resumed + whole:
        assert row["policy_version"] == row["pushed_version"]  # sync: every iteration on its own policy
        assert float(row["ratio_max_dev"]) <= TOLERANCE
    assert [same_for_any_run(row) for row in resumed] == [same_for_any_run(row) for row in whole]
    for folder in ("lora", "lora-ema"):
        adapters = [
            load_file(out / folder / "adapter_model.safetensors") for out in (killed, tmp_path / "whole")
        ]
        assert adapters[0].keys() == adapters[1].keys()
        assert all(torch.equal(tensor, adapters[1][name]) for name, tensor in adapters[0].items())

    # A checkpoint continues the run it was written by, not another one.
    with pytest.raises(SystemExit) as refused:
        trainer.parse_args([*TINY, *flags, "--lr", "0.02", "--out", str(killed), "--resume"])
    assert refused.value.code == 2
    assert "--lr 0.02 (the checkpoint's run has 0.01)" in capsys.readouterr().err


def test_a_hung_then_dead_server_is_reported_retried_and_the_run_stops_checkpointed(cache_dir, tmp_path):
    """The trainer's server is stopped (SIGSTOP) mid-run: the trainer says it is waiting, gives up on
    the call after --stall-timeout and retries, going on once the server resumes. Then the server is
    killed: after its retries the trainer stops with one line, its finished iterations checkpointed
    (none was due by --checkpoint-every)."""
    flags = ("--iterations", "8", "--checkpoint-every", "100", "--stall-timeout", "3", "--retries", "2")
    server = start_server(cache_dir, tmp_path / "server.log")
    out = tmp_path / "train"
    process, log = start_trainer(server.address, out, *flags)
    try:
        wait_until(process, log, lambda: metrics_rows(out) >= 1)
        server.process.send_signal(signal.SIGSTOP)
        try:
            wait_until(process, log, lambda: "retry 1 of 2 in 1 s" in log.read_text())
        finally:
            server.process.send_signal(signal.SIGCONT)
        rows = metrics_rows(out)
        wait_until(process, log, lambda: metrics_rows(out) > rows)  # the retry went through
        server.stop(signal.SIGKILL)
        assert process.wait(timeout=WAIT_SECONDS) == 1
    finally:
        process.kill()
        server.stop(signal.SIGKILL)
    output = log.read_text()
    assert "waiting for the server" in output  # said while the server was stopped
    # The stopped server held up a rollout (the watchdog ends it) or a push (its deadline does).
    assert "giving up on the call" in output or "DEADLINE_EXCEEDED" in output
    assert "UNAVAILABLE" in output and "retry 2 of 2 in 2 s" in output
    assert "Traceback" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith("train_grpo.py: stopped: iteration ") and "failed 3 times" in last, last
    done = metrics_rows(out)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["iterations_done"] == done
    assert last.endswith(f"iterations 0-{done - 1} are in {out / 'checkpoint.pt'}: run again with --resume")


# reward_nan_at's state: the reward call (0-based) that returns a NaN, and the (checkpoint, copy)
# files it copies when it does.
NAN_REWARD: dict = {"at": None, "calls": 0, "checkpoint": None}


def reward_nan_at(images, prompts) -> torch.Tensor:
    """JPEG compressibility, with sample 1's reward NaN at call ``NAN_REWARD["at"]``: iteration
    ``at`` of a flat run, which calls its reward once an iteration. That call first copies the run's
    checkpoint aside, as the iteration before it left it."""
    rewards = jpeg_compressibility(images, prompts)
    call, NAN_REWARD["calls"] = NAN_REWARD["calls"], NAN_REWARD["calls"] + 1
    if call == NAN_REWARD["at"]:
        shutil.copyfile(*NAN_REWARD["checkpoint"])
        rewards[1] = math.nan
    return rewards


def test_a_nan_reward_stops_the_run_before_its_step_keeping_the_last_good_checkpoint(
    train_client, tmp_path, monkeypatch
):
    """A reward that turns NaN at iteration 2 stops the run with one line naming it, before that
    iteration's optimizer step and before any checkpoint of it: checkpoint.pt stays the file iteration
    1 wrote, byte for byte, and --resume (the reward mended) goes on from it to the end."""
    out, kept = tmp_path / "train", tmp_path / "checkpoint-of-iteration-1.pt"
    monkeypatch.setitem(NAN_REWARD, "at", 2)
    monkeypatch.setitem(NAN_REWARD, "calls", 0)
    monkeypatch.setitem(NAN_REWARD, "checkpoint", (out / "checkpoint.pt", kept))
    flags = ("--checkpoint-every", "1", "--reward", f"{__name__}:reward_nan_at")
    with pytest.raises(SystemExit) as stopped:
        run_trainer(train_client.address, out, *flags)
    assert stopped.value.code == (
        f"train_grpo.py: stopped: iteration 2: the reward of prompt 0's sample 1 is nan "
        f"({__name__}:reward_nan_at); no step was taken on it, and the last good checkpoint, of "
        f"iterations 0-1, is {out / 'checkpoint.pt'}"
    )
    assert (out / "checkpoint.pt").read_bytes() == kept.read_bytes()
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=True)
    assert checkpoint["iterations_done"] == 2
    assert all(tensor.isfinite().all() for tensor in checkpoint["policy"].values())
    assert not (out / "lora").exists()  # the run did not end: no final policy was saved

    monkeypatch.setitem(NAN_REWARD, "at", None)
    rows = run_trainer(train_client.address, out, *flags, "--resume")
    assert [int(row["iteration"]) for row in rows] == [0, 1, 2]
    assert all(math.isfinite(float(row[column])) for row in rows for column in ("reward_mean", "loss"))
    adapter = load_file(out / "lora" / "adapter_model.safetensors")
    assert all(tensor.isfinite().all() for tensor in adapter.values())


def test_a_non_finite_loss_gradient_or_weight_is_not_stepped_on_nor_checkpointed(
    train_client, tiny_flux_folder, tmp_path, trainer, capsys
):
    """A trainer's optimizer step with a NaN in one gradient, or with a non-finite loss, stops before
    stepping: the weights and AdamW's state stay as they were, bit for bit. A NaN in AdamW's state
    steps to a NaN weight: the run stops naming it, and checkpoint.pt is not written over. --resume
    refuses a checkpoint holding a NaN weight, as a run without these checks could leave."""
    out = tmp_path / "train"
    out.mkdir()
    config = trainer.parse_args(trainer_args(train_client.address, str(out)))
    with torch.random.fork_rng(devices=[]):
        model = Trainer(config, train_client, tiny_flux_folder, Ranks())
    names = [name for name, _ in model.named_parameters]
    start = [parameter.detach().clone() for parameter in model.parameters]

    def unchanged() -> bool:
        return all(torch.equal(now, was) for now, was in zip(model.parameters, start, strict=True))

    def set_gradients(nan_in: int | None = None) -> None:
        for k, parameter in enumerate(model.parameters):
            parameter.grad = torch.full_like(parameter, 0.5)
            if k == nan_in:
                parameter.grad.view(-1)[-1] = math.nan

    set_gradients(nan_in=3)
    with pytest.raises(NonFinite) as stopped:
        model.optimizer_step(0.25)
    assert str(stopped.value) == (
        f"iteration 0: the gradient of {names[3]} holds nan; no step was taken on it, and no checkpoint "
        "was written"
    )
    set_gradients()
    with pytest.raises(NonFinite, match=r"^iteration 0: the loss is inf; no step was taken on it"):
        model.optimizer_step(math.inf)
    assert not model.optimizer.state and unchanged()  # AdamW never stepped

    model.optimizer_step(0.25)
    assert not unchanged()
    model.rows.append({"iteration": 0})
    model.save_checkpoint()
    good = (out / "checkpoint.pt").read_bytes()
    model.optimizer.state[model.parameters[2]]["exp_avg"].view(-1)[0] = math.nan
    set_gradients()
    with pytest.raises(NonFinite) as stopped:
        model.optimizer_step(0.25)
    assert str(stopped.value) == (
        f"iteration 0: after the optimizer step, the weight {names[2]} holds nan; it was neither pushed nor "
        f"checkpointed, and the last good checkpoint, of iterations 0-0, is {out / 'checkpoint.pt'}"
    )
    with pytest.raises(NonFinite, match=rf"weight {re.escape(names[2])} holds nan; it was not checkpointed"):
        model.save_checkpoint()
    assert (out / "checkpoint.pt").read_bytes() == good

    poisoned = torch.load(out / "checkpoint.pt", weights_only=True)
    name, tensor = next(iter(poisoned["policy"].items()))
    tensor.view(-1)[0] = math.inf
    torch.save(poisoned, out / "checkpoint.pt")
    with pytest.raises(SystemExit) as refused:
        trainer.parse_args(trainer_args(train_client.address, str(out), "--resume"))
    assert refused.value.code == 2
    assert f"--resume: {out / 'checkpoint.pt'}'s weight {name} holds inf: no run can go on from it" in (
        capsys.readouterr().err
    )


def test_a_run_without_a_server_starts_its_own_and_stops_it(tiny_flux_folder, tmp_path):
    """Its server is a child process (python -m rollout_server) on a free port, logging to the run's
    folder, stopped when the run ends."""
    out = tmp_path / "train"
    flags = ["--iterations", "1", "--prompts", "1", "--group-size", "2", "--steps", "2", "--size", "64"]
    run_example("train_grpo", "--model", tiny_flux_folder, *flags, "--out", out)
    assert len(read_metrics(out)) == 1
    lines = (out / "server.log").read_text().splitlines()
    host, port = next(filter(None, map(SERVING_LINE.search, lines)))["address"].rsplit(":", 1)
    assert "shutting down" in lines[-1], lines[-5:]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=WAIT_SECONDS).close()


def test_resume_needs_a_checkpoint(trainer, capsys, tmp_path):
    with pytest.raises(SystemExit) as refused:
        trainer.parse_args(["--out", str(tmp_path), "--resume"])
    assert refused.value.code == 2
    assert f"--resume: no checkpoint.pt in {tmp_path}" in capsys.readouterr().err
