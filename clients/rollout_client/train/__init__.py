"""The trainer as a library: FlowGRPO, its tree variants and DiffusionNFT on the rollout stream.

    from rollout_client.train import parse_args, run
    rows, seconds, ranks = run(parse_args(["--iterations", "10", "--server", "127.0.0.1:50051"]))

    from rollout_client.train import ServerConfig, TrainConfig   # the same run, built in code
    rows, seconds, ranks = run(TrainConfig(iterations=10, server=ServerConfig(address="127.0.0.1:50051")))

``examples/train_grpo.py`` is its command line. The modules:

* ``options`` and ``config``: ``TrainConfig``, one dataclass per concern, each field a flag with its
  help, default and rule; every rule between flags in ``TrainConfig.__post_init__``, so a config built
  in code is refused as the command line refuses it (``parse_args``, generated from the fields);
* ``prompts``: where an iteration's prompts come from;
* ``rollouts``: an iteration's request, the stream with its stall watchdog, the retry policy;
* ``algorithms``: one interface (``Algorithm``) and the registered algorithms: ``flowgrpo``,
  ``tree`` (BranchGRPO / TreeGRPO, with early termination), ``nft`` (DiffusionNFT);
* ``policy``: the LoRA or full transformer, its push (gRPC or the weight-sync group, checksum
  checked) and its saving;
* ``checkpoint``, ``metrics`` (metrics.csv's columns, plots, images, the shapes eval's outputs),
  ``report`` (``--report-to tensorboard`` or ``wandb``, offline),
  ``distributed`` (data-parallel ranks), ``finite`` (the stop on a non-finite value);
* ``trainer``: ``Trainer``, with ``train_step(i)``, ``train()`` and ``evaluate()``; and ``run``, which
  starts a server when none is given and runs a whole training.

What a run does, flag by flag (``examples/train_grpo.py --help`` lists them all):

Each iteration samples P prompts x G images on a rollout server, scores the images with a reward
(JPEG compressibility by default: no download), standardises the rewards within each prompt's group,
recomputes the stochastic steps' log-probs with gradients, takes one PPO-clipped step on a LoRA of the
transformer, and pushes the adapter back as the next policy version. The next rollouts ask for that
version with ``min_policy_version``, so they never run on an older policy than they should.

Sync: iteration i rolls out on policy version i, so at its update the ratio exp(logp_new - logp_old)
is 1 up to float rounding (``ratio_max_dev`` in metrics.csv: the on-policy proof). Async: iteration
i + 1's rollouts are requested when iteration i starts training, with ``min_policy_version = i``: they
run on version i while the trainer holds i + 1, one version stale at most, and the clipped ratio
corrects for it.

Every iteration starts by pushing the trainer's policy, so the first rollouts of a run (fresh or
resumed) are on-policy whatever the server held before. A checkpoint (adapter, optimizer, schedule,
RNG, metrics) is written every --checkpoint-every iterations; --resume goes on from it. A server that
fails (down, restarting, overloaded, or silent for --stall-timeout seconds) is retried --retries
times with a growing pause; then the run stops, its finished iterations checkpointed. A reward, loss,
gradient or weight that is NaN or infinite stops the run before any optimizer step or checkpoint is
taken on it, the last good checkpoint kept.

Writes to --out: metrics.csv (one row per iteration), reward.png (reward mean +/- std per iteration),
the first and last iteration's images in samples/iter-NNNN/, the final LoRA in lora/ (a PEFT
adapter folder) and checkpoint.pt.

``--prompt-set shapes`` draws each iteration's P prompts from the shapes task's train prompts
(``rollout_core.scenes.train_prompts()``); with ``--eval-every N`` the served policy is
evaluated GenEval-style on the disjoint eval prompts (``rollout_client.shapes_eval``) before
iterations 0, N, 2N ... and once more after the last: metrics.csv gains ``eval_accuracy``, and the
run writes accuracy.png, eval.json (the tables before and after) and samples/eval-before.png and
samples/eval-after.png (the eval images, framed green where strictly right, red where wrong).
``--prompt TEXT`` (repeatable) trains on those prompts every iteration instead.

``--tree 0:2,3:2,6:2`` samples trees instead of flat groups (BranchGRPO, TreeGRPO): each of a
prompt's --group-size roots forks at those steps (``step:factor``, or ``step:factor:noise_level``),
the leaves are scored, and every edge (a node's transition) is trained once with its node's
advantage (``--tree-advantages``: BranchGRPO's depth-normalised fused rewards, mean or
log-prob-weighted, or TreeGRPO's backed-up leaf advantages; ``rollout_client.grpo``). With
``--prune-at S --prune-keep K`` the trainer terminates nodes early: when step S arrives, each node
that took it is scored by the reward of its predicted final image (the server's preview of the step),
and per prompt all but the K/2 best and K/2 worst are pruned with their subtrees (``PruneRollout``).
The request names S as its prune point, so the server runs step S + 1 only once the trainer has
answered: the prune stops its nodes there, and metrics.csv counts the nodes asked for and those the
server stopped.

``--train full`` trains every parameter of the transformer instead of a LoRA, and pushes it over a
weight-sync group by default (``--weight-sync``; ``rollout_client.WeightSyncGroup``): every push checks
the checksum the server serves against the trainer's own. Under ``torchrun --nproc-per-node N`` the
trainer runs N data-parallel ranks: each rolls out its block of the prompt groups with the seeds one
rank would draw, the gradients are averaged before each step, and rank 0 pushes and writes the run.

``--algorithm nft`` swaps the update for DiffusionNFT's (``rollout_client.nft``): the rollouts stream
only their final latents, and each iteration takes --nft-draws optimizer steps of its flow-matching
style loss on them, noised afresh for each step, against the rollout policy's own velocities. No
step's log-prob enters it, so ``ratio_max_dev`` is empty; the rollouts still ask for the pushed
version, so every update starts from the policy that sampled its data.
"""

from rollout_client.train.config import ServerConfig, TrainConfig, parse_args
from rollout_client.train.run import run
from rollout_client.train.trainer import Trainer

__all__ = ["ServerConfig", "TrainConfig", "Trainer", "parse_args", "run"]
