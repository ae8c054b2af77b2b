"""The training loop: ``Trainer(config, client, model_path, ranks).train()``.

Each ``train_step(i)`` pushes the policy (rank 0) and rolls out this rank's share on it (or takes the
rollout that streamed during the last step, with ``--async``), scores it, has the algorithm update the
policy, and writes the iteration's metrics row; ``train()`` runs the steps, checkpoints, and ends
with the server on the final policy. A server that fails is retried (``rollouts.retrying``); one that
fails for good stops the run with its finished iterations checkpointed. A reward, loss, gradient or
weight that is not finite stops the run (``finite.NonFinite``) before any step or checkpoint on it.
"""

import contextlib
import csv
import functools
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from rollout_client.train.algorithms import ALGORITHMS
from rollout_client.train.averages import WeightAverage
from rollout_client.train.checkpoint import restore_checkpoint, save_checkpoint
from rollout_client.train.config import CHECKPOINT
from rollout_client.train.finite import NonFinite, non_finite_tensor
from rollout_client.train.metrics import (
    COLUMNS,
    EVAL_LABELS,
    TRAINING,
    eval_columns,
    eval_grid,
    evaluate,
    plot_accuracy,
    plot_rewards,
    record_eval,
    save_images,
)
from rollout_client.train.policy import Pusher, load_policy, save_policy
from rollout_client.train.probe import VelocityProbe
from rollout_client.train.report import Report, open_report
from rollout_client.train.rewards import Rewards, SampleInfo
from rollout_client.train.rollouts import (
    Prefetch,
    Rollout,
    ServerFailure,
    retrying,
    rollout_request,
    say,
    stream,
)

if TYPE_CHECKING:
    from rollout_client import RolloutClient, Step
    from rollout_client.shapes_eval import ShapesEval
    from rollout_client.train.config import TrainConfig
    from rollout_client.train.distributed import Ranks


class Trainer:
    def __init__(self, config: "TrainConfig", client: "RolloutClient", model_path: Path, ranks: "Ranks"):
        torch.manual_seed(config.seed)
        self.config, self.client, self.model_path, self.ranks = config, client, model_path, ranks
        self.reward = Rewards(config.reward)
        info = client.server_info()
        self.transformer, self.lora_config = load_policy(model_path, config, info.lora_targets)
        self.pusher = Pusher(client, self.transformer, self.lora_config, config)
        self.named_parameters = [(n, p) for n, p in self.transformer.named_parameters() if p.requires_grad]
        self.parameters = [p for _, p in self.named_parameters]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.optim.lr)
        self.max_samples = info.limits.max_samples
        # A cosine from lr down to lr / 10 over the run: the late steps refine instead of overshooting.
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.optimizer, config.iterations, eta_min=config.optim.lr / 10
        )
        # --ema-decay: an average of the trained weights, which the evals and the run's end push.
        self.ema = WeightAverage(self.parameters) if config.ema_decay > 0 else None
        self.algorithm = ALGORITHMS[config.algorithm_name](self)
        self.checkpoint = config.checkpoint.out / CHECKPOINT
        self.rows: list[dict] = []
        if config.checkpoint.state is not None:
            self.rows, averages = restore_checkpoint(
                config.checkpoint.state, self.transformer, self.optimizer, self.schedule
            )
            if self.ema is not None:
                self.ema.load_state_dict(averages["ema"])
            self.algorithm.load_state(averages["algorithm"])
            say(f"resuming after iteration {len(self.rows) - 1} from {self.checkpoint}")
        elif self.checkpoint.exists() and ranks.leader:
            say(f"a new run: removing the previous run's {self.checkpoint} (--resume goes on with it)")
            self.checkpoint.unlink()
        self.saved = len(self.rows)  # iterations in the checkpoint on disk
        self.first_row = len(self.rows)  # this process's first iteration
        self.iteration = self.first_row  # the one in progress
        self.staleness = 1 if config.rollout.async_ else 0
        self.prefetch = Prefetch()  # --async: the next rollout, streaming while this one trains
        self.probe: VelocityProbe | None = None  # made from the first rollout this process trains on
        self.clock = time.perf_counter()  # --time-budget counts from here
        self.report = Report()  # --report-to's, rank 0's, open while train() runs

    # The optimizer step every algorithm takes.

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, loss: float) -> None:
        """Average the gradients over the data-parallel ranks, clip them to the algorithm's
        ``max_grad_norm`` (if it has one), and step on them. ``loss`` is this rank's loss of the step.
        A non-finite loss (on any rank) or averaged gradient stops the run before the step, a weight
        the step left non-finite stops it before anything pushes or checkpoints it (``stop_if``)."""
        self.ranks.average_gradients(self.parameters)
        gradients = ((f"the gradient of {name}", p.grad) for name, p in self.named_parameters)
        bad_loss = None if math.isfinite(loss) else f"the loss is {loss}"
        self.stop_if(bad_loss or non_finite_tensor(gradients), "no step was taken on it")
        if self.algorithm.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters, self.algorithm.max_grad_norm)
        self.optimizer.step()
        # Finite gradients can still step to a non-finite weight: from an optimizer state that is not.
        problem = non_finite_tensor((f"the weight {name}", p) for name, p in self.named_parameters)
        self.stop_if(
            problem and f"after the optimizer step, {problem}", "it was neither pushed nor checkpointed"
        )

    def stop_if(self, problem: str | None, taken: str) -> None:
        """Stop the run, every rank alike, when a rank found ``problem`` (a non-finite value of the
        iteration in progress; ``taken`` says what was done with it)."""
        problems = [p for p in self.ranks.gather(problem) if p is not None]
        if problems:
            raise self.non_finite(problems[0], taken)

    def non_finite(self, problem: str, taken: str) -> NonFinite:
        """The run's stop on ``problem``: the checkpoint on disk, of the iterations before, stays."""
        kept = (
            f"the last good checkpoint, of iterations 0-{self.saved - 1}, is {self.checkpoint}"
            if self.saved
            else "no checkpoint was written"
        )
        return NonFinite(f"iteration {self.iteration}: {problem}; {taken}, and {kept}")

    def push_rollout_policy(self) -> int:
        """Push the weights the server rolls out with (the algorithm's); returns their version."""
        with self.algorithm.rollout_weights():
            return self.pusher.push()

    def evaluated_weights(self):
        """The weights an eval measures, applied for the block: the EMA if the run keeps one."""
        return self.ema.applied(self.parameters) if self.ema is not None else contextlib.nullcontext()

    # The server's part of an iteration.

    def request(self, iteration: int, version: int):
        algorithm = self.algorithm
        return rollout_request(
            self.config, iteration, version, algorithm.latents, algorithm.preview_steps(self.config)
        )

    def roll_out(self, iteration: int, bar: tqdm, pushed: int | None) -> tuple[Rollout, int, float]:
        """Push the trainer's policy (unless rank 0 ``pushed`` it), and roll out this rank's share
        (async: take the rollout that streamed during the last iteration, then push). Safe to try
        again."""
        bar.reset()
        self.algorithm.start()
        rollout = self.prefetch.take()
        push_start = time.perf_counter()
        version = self.push_rollout_policy() if pushed is None else pushed
        push_seconds = time.perf_counter() - push_start
        bar.update(1)
        if rollout is None:
            request = self.ranks.share(self.request(iteration, version), self.max_samples)
            rollout = stream(
                self.client, request, self.config.server.stall_timeout, functools.partial(self._arrived, bar)
            )
        return rollout, version, push_seconds

    def _arrived(self, bar: tqdm, rollout: Rollout, step: "Step") -> None:
        bar.update(1)
        self.algorithm.on_step(rollout, step)

    def push_from_rank_0(self, iteration: int) -> int | None:
        """With several ranks: rank 0 pushes (tried again as a rollout is) and every rank learns the
        version; alone, the rollout phase pushes."""
        if self.ranks.world == 1:
            return None
        what = f"iteration {iteration}: the push"
        pushed = (
            retrying(what, self.push_rollout_policy, self.config.server.retries, self.client.address)
            if self.ranks.leader
            else None
        )
        return self.ranks.agree(pushed)

    def rolled_out(self, iteration: int, bar: tqdm) -> tuple[Rollout, int, float]:
        """The iteration's rollout, with the server's failures retried; a failure for good stops the
        run with what finished checkpointed."""
        config = self.config
        try:
            pushed = self.push_from_rank_0(iteration)
            return retrying(
                f"iteration {iteration}",
                functools.partial(self.roll_out, iteration, bar, pushed),
                config.server.retries,
                self.client.address,
            )
        except ServerFailure as failure:
            bar.close()
            if not self.rows:
                raise ServerFailure(f"{failure}; no iteration had finished") from failure
            if self.saved < len(self.rows) and self.ranks.leader:
                self.save_checkpoint()
            done = f"iterations 0-{len(self.rows) - 1} are in {self.checkpoint}"
            raise ServerFailure(f"{failure}; {done}: run again with --resume") from failure

    @contextlib.contextmanager
    def colocated(self):
        """--colocate: rank 0 has the server release its weights' memory for the block (the policy
        trains in it) and resume it after, before anything calls the server again. Every rank's
        rollout is in by then: the rewards' gather before the block waits for all of them."""
        if not (self.config.server.colocate and self.ranks.leader):
            yield
            return
        server = self.config.server
        retrying(
            "releasing the server's memory", self.client.release_memory, server.retries, self.client.address
        )
        try:
            yield
        finally:
            retrying(
                "resuming the server's memory", self.client.resume_memory, server.retries, self.client.address
            )

    # One iteration.

    def train_step(self, iteration: int) -> dict:
        """Roll out, score, update and record iteration ``iteration``; returns its metrics row."""
        config, ranks = self.config, self.ranks
        self.iteration = iteration
        start = time.perf_counter()
        bar = tqdm(
            total=config.rollout.steps + 2,
            desc=f"iter {iteration:>4}",
            dynamic_ncols=True,
            leave=False,
            disable=not ranks.leader,
        )
        rollout, version, push_seconds = self.rolled_out(iteration, bar)
        bar.update(config.rollout.steps + 1 - bar.n)
        if config.rollout.async_ and iteration + 1 < config.iterations:
            # Streams while this iteration trains, on the policy just pushed: one behind the next.
            request = self.request(iteration + 1, version)
            self.prefetch.start(self.client, request, config.server.stall_timeout)
        if not 0 <= version - rollout.policy_version <= self.staleness:
            raise RuntimeError(f"iteration {iteration} ran on policy {rollout.policy_version}, not {version}")

        result, eval_seconds = None, math.nan  # the evals by name (metrics.TRAINING ...), where one ran
        if config.eval.every and iteration % config.eval.every == 0 and ranks.leader:
            eval_start = time.perf_counter()
            result = self.evaluate()  # the policy before this iteration's update
            eval_seconds = time.perf_counter() - eval_start
            if iteration == 0:
                record_eval(config.checkpoint.out / "eval.json", "before", result)
                eval_grid(result[TRAINING], config.checkpoint.out / "samples" / "eval-before.png")
            self.report.eval_images(result[TRAINING], iteration)

        trajectories = rollout.trajectories
        samples = [SampleInfo(t.prompt_index, t.sample_index, t.seed, t.policy_version) for t in trajectories]
        rewards = self.reward([t.image() for t in trajectories], [t.prompt for t in trajectories], samples)
        self.stop_if(self.reward.non_finite(rewards, samples), "no step was taken on it")
        train_start = time.perf_counter()
        if self.probe is None and self.lora_config is not None and ranks.leader:
            self.probe = VelocityProbe(self.transformer, trajectories, config.seed, config.device)
        with self.colocated():
            loss = self.algorithm.update(rollout, rewards, iteration)
        self.schedule.step()
        if self.ema is not None:
            self.ema.update(self.parameters, config.ema_decay)
        bar.update(1)
        # Over every rank's share: all rewards, the mean of the ranks' losses, the largest deviation.
        shares = ranks.gather((rewards, loss, self.algorithm.ratio_max_dev, self.reward.last))
        all_rewards = torch.cat([share[0] for share in shares])
        terms = {
            f"reward_mean/{spec}": torch.cat([share[3][spec] for share in shares]).mean().item()
            for spec in self.reward.last
        }
        row = {
            "iteration": iteration,
            "policy_version": rollout.policy_version,
            "pushed_version": version,
            "reward_mean": all_rewards.mean().item(),
            "reward_std": all_rewards.std(correction=0).item(),
            "loss": sum(share[1] for share in shares) / ranks.world,
            "ratio_max_dev": max(share[2] for share in shares),
            **self.algorithm.metrics(rollout),
            "rollout_seconds": rollout.seconds,
            "train_seconds": time.perf_counter() - train_start,
            "update_seconds": push_seconds,
            "iteration_seconds": time.perf_counter() - start,
            **eval_columns(result),
            "velocity_norm_ratio": math.nan if self.probe is None else self.probe.ratio(self.transformer),
            "transformer_rows": rollout.collector.finished.message.transformer_rows,
            "prune_asked": rollout.prune_asked,
            "prune_stopped": rollout.prune_stopped,
            "eval_seconds": eval_seconds,
            **(terms if self.reward.columns() else {}),
        }
        bar.set_postfix(reward=f"{row['reward_mean']:.5f}", ratio_dev=f"{row['ratio_max_dev']:.1e}")
        bar.close()
        if ranks.leader and iteration in (0, config.iterations - 1):
            save_images(trajectories, config.checkpoint.out / "samples" / f"iter-{iteration:04d}")
        if iteration in (0, config.iterations - 1) or (
            config.eval.every and iteration % config.eval.every == 0
        ):
            self.report.samples(trajectories, rewards, iteration)
        return row

    def push_evaluated_policy(self) -> int:
        with self.evaluated_weights():
            return self.pusher.push()

    def evaluate(self) -> dict[str, "ShapesEval"]:
        """Evaluate the evaluated weights (the EMA, or the trained ones), pushed first where the server
        rolls out with others: the evals by name (``metrics.evaluate``)."""
        if self.ema is not None or self.algorithm.own_rollout_policy:
            what = "the eval's push"
            retrying(what, self.push_evaluated_policy, self.config.server.retries, self.client.address)
        return evaluate(self.client, self.config, self.reward)

    def save_checkpoint(self) -> None:
        """Write the checkpoint of ``self.rows``' iterations over the last one, unless a trained weight
        is not finite (then the run stops, the last one kept). Rank 0's alone: the ranks' weights are
        the same, checked alike after every step."""
        problem = non_finite_tensor((f"the weight {name}", p) for name, p in self.named_parameters)
        if problem:
            raise self.non_finite(problem, "it was not checkpointed")
        averages = {
            "ema": None if self.ema is None else self.ema.state_dict(),
            "algorithm": self.algorithm.state(),
        }
        save_checkpoint(
            self.checkpoint, self.config, self.transformer, self.optimizer, self.schedule, self.rows, averages
        )
        self.saved = len(self.rows)

    def out_of_time(self) -> bool:
        """With --time-budget: whether the next iteration (as long as this process's mean one, its evals
        left out) and the final eval (as long as the first) would end past the budget."""
        budget = self.config.time_budget
        done = self.rows[self.first_row :]
        if not budget or not done:
            return False
        iteration = sum(r["iteration_seconds"] - _or_zero(r["eval_seconds"]) for r in done) / len(done)
        evals = [r["eval_seconds"] for r in done if not math.isnan(r["eval_seconds"])]
        final_eval = evals[0] if evals else 0.0
        return time.perf_counter() - self.clock + iteration + final_eval > budget

    # The run.

    def train(self) -> list[dict]:
        config, ranks = self.config, self.ranks
        if ranks.leader:
            self.report = open_report(config.report.report_to, config.checkpoint.out, config.settings())
        try:
            return self.train_and_finish()
        finally:
            self.report.close()

    def train_and_finish(self) -> list[dict]:
        config, ranks = self.config, self.ranks
        metrics_path = (
            config.checkpoint.out / "metrics.csv" if ranks.leader else Path(os.devnull)
        )  # rank 0 writes the run
        progress = tqdm(
            total=config.iterations, initial=len(self.rows), desc="run", unit="iter", disable=not ranks.leader
        )
        with open(metrics_path, "w", newline="") as metrics, self.prefetch, progress:
            writer = csv.DictWriter(
                metrics,
                fieldnames=COLUMNS + self.algorithm.columns() + self.reward.columns(),
                extrasaction="ignore",
            )
            writer.writeheader()
            writer.writerows(self.rows)
            for iteration in range(len(self.rows), config.iterations):
                if ranks.agree(self.out_of_time() if ranks.leader else None):
                    say(f"--time-budget {config.time_budget:g} s: stopping after {len(self.rows)} iterations")
                    break
                row = self.train_step(iteration)
                writer.writerow(row)
                metrics.flush()
                self.report.row(row)
                progress.update(1)
                progress.set_postfix(reward=f"{row['reward_mean']:.5f}")
                self.rows.append(row)
                if ranks.leader and (
                    len(self.rows) % config.checkpoint.every == 0 or len(self.rows) == config.iterations
                ):
                    self.save_checkpoint()
                    say(f"checkpoint: iterations 0-{iteration} in {self.checkpoint}")
        if ranks.leader and self.saved < len(self.rows):
            self.save_checkpoint()  # stopped by --time-budget
        if ranks.leader:
            self.finish()
        return self.rows

    def finish(self) -> None:
        """Save the policy (and its EMA) and the plots, and leave the server on the evaluated policy (the
        EMA if the run keeps one), evaluated with --eval-every."""
        config, out = self.config, self.config.checkpoint.out
        saved_policy = save_policy(self.transformer, self.lora_config, out)
        if self.ema is not None:
            with self.ema.applied(self.parameters):
                saved_policy = save_policy(self.transformer, self.lora_config, out, suffix="-ema")
        plot_rewards(self.rows, config.reward, out / "reward.png")
        try:
            retrying("the final push", self.push_evaluated_policy, config.server.retries, self.client.address)
            if config.eval.every:
                finals = evaluate(self.client, config, self.reward)
        except ServerFailure as failure:
            raise ServerFailure(f"{failure}; the run is complete, its policy in {saved_policy}") from failure
        finally:
            self.pusher.close()
        if config.eval.every:
            pairings = record_eval(out / "eval.json", "after", finals)
            final = finals[TRAINING]
            eval_grid(final, out / "samples" / "eval-after.png")
            done = len(self.rows)
            self.report.accuracy(final.accuracy, final.standard_error, done)
            self.report.eval_images(final, done)
            plot_accuracy(self.rows, (done, final.accuracy, final.standard_error), out / "accuracy.png")
            for name, result in finals.items():
                paired = pairings.get(name)
                if name != TRAINING:  # the training settings' went in as eval/accuracy
                    scalars = {"accuracy": result.accuracy, "accuracy_stderr": result.standard_error}
                    self.report.scalars({f"eval/{key}_{name}": value for key, value in scalars.items()}, done)
                say(
                    f"eval accuracy after {done} iterations {EVAL_LABELS[name]}: "
                    f"{result.accuracy:.3f} +- {result.standard_error:.3f}"
                    + (
                        ""
                        if paired is None
                        else f" ({paired['difference']:+.3f} +- {paired['se']:.3f} paired)"
                    )
                    + (
                        ""
                        if result.forwards is None
                        else f", {result.forwards} forwards ({result.plain_forwards} plain)"
                    )
                )


def _or_zero(seconds: float) -> float:
    return 0.0 if math.isnan(seconds) else seconds
