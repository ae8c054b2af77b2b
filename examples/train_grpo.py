"""FlowGRPO (or DiffusionNFT) on the rollout stream: the command line of ``rollout_client.train``.

    python examples/train_grpo.py                       # its own tiny-flux server; writes train-output/
    python examples/train_grpo.py --async               # next rollouts stream while this one trains
    python examples/train_grpo.py --server HOST:PORT --model-path FOLDER
    python examples/train_grpo.py --model shapes --prompt-set shapes \\
        --reward rollout_client.rewards.shapes:geneval_reward --eval-every 5   # make train-shapes

What each flag does, and what a run writes: the package's docstring and docs/training.md.
"""

import math

from rollout_client.train import parse_args, run
from rollout_client.train.finite import NonFinite
from rollout_client.train.rollouts import ServerFailure

__all__ = ["main", "parse_args"]


def main(argv: list[str] | None = None) -> list[dict]:
    config = parse_args(argv)
    try:
        rows, seconds, ranks = run(config)
    except (ServerFailure, NonFinite) as failure:
        raise SystemExit(f"train_grpo.py: stopped: {failure}") from None
    if not ranks.leader:
        return rows
    first, last = rows[0]["reward_mean"], rows[-1]["reward_mean"]
    deviation = max(r["ratio_max_dev"] for r in rows)  # NaN where no step is scored (nft, awm)
    on_policy = "" if math.isnan(deviation) else f", max ratio deviation {deviation:.1e}"
    print(
        f"{len(rows)} iterations in {seconds:.0f} s ({'async' if config.rollout.async_ else 'sync'}, "
        f"{config.algorithm}): reward {first:.5f} -> {last:.5f}{on_policy}; "
        f"results in {config.checkpoint.out}/"
    )
    return rows


if __name__ == "__main__":
    main()
