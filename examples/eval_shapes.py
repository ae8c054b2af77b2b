"""GenEval-style accuracy of a policy on the shapes eval prompts, through a rollout server.

    python examples/eval_shapes.py                          # its own server on the shapes preset
    python examples/eval_shapes.py --lora train-output-shapes/lora
    python examples/eval_shapes.py --server HOST:PORT
    python examples/eval_shapes.py --steps 8 --search 4     # also with step-wise search, K = 4

Each eval prompt (``rollout_core.scenes.eval_prompts()``) is sampled ``--samples`` times
with the deterministic ODE sampler from fixed seeds, with the server's CFG (or ``--cfg``), and every image is
scored strictly (the right objects, counts, colours and relation, nothing extra; see
``rollout_client.shapes_eval``). Prints the table per task type and overall,
as GenEval reports it, twice: at ``--steps`` and ``--cfg`` and at the server's defaults (its steps and
CFG, as a user samples the model; once where the two are the same). ``--search K`` also evaluates
with step-wise search (the best of K children at each ``--search-steps`` step, by ``--reward`` on
their previews) at both, with its forwards beside plain sampling's. ``--lora`` pushes a PEFT adapter
folder (as ``make train-shapes`` writes it) first, as the server's next policy version; otherwise the
server's current policy is evaluated.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from rollout_client import RolloutClient
from rollout_client.rewards import shapes
from rollout_client.shapes_eval import (
    ShapesEval,
    at_server_defaults,
    eval_request,
    evaluate_policy,
    evaluate_search,
)
from rollout_client.train.config import parse_search_steps
from rollout_client.train.rewards import Rewards
from rollout_core.local_server import LocalServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="address of a running server (default: start one on --model)")
    parser.add_argument("--model", default="shapes", help="preset or folder for the server we start")
    parser.add_argument("--lora", type=Path, help="a PEFT adapter folder to evaluate")
    parser.add_argument("--samples", type=int, default=4, help="images per prompt")
    parser.add_argument(
        "--prompts", type=int, default=0, help="evaluate on the first this many eval prompts only (0: all)"
    )
    parser.add_argument("--steps", type=int, help="denoising steps (default: the server's)")
    parser.add_argument("--size", type=int, default=64, help="image height and width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cfg", type=float, help="true CFG scale (default: the server's; the shapes preset's is 3)"
    )
    parser.add_argument(
        "--search", type=int, default=0, help="also evaluate with step-wise search of K (0: none)"
    )
    parser.add_argument(
        "--search-steps", type=parse_search_steps, default="0,2,4", help="the steps --search branches at"
    )
    parser.add_argument(
        "--reward",
        default="rollout_client.rewards.shapes:geneval_reward",
        help="what --search keeps the best by (module:callable[*weight],...)",
    )
    parser.add_argument(
        "--json", type=Path, help="also write the tables here, by settings (settings, defaults, search ...)"
    )
    parser.add_argument("--out", type=Path, default=Path("eval-shapes-output"), help="server log folder")
    args = parser.parse_args(argv)
    if args.prompts < 0:
        parser.error("--prompts must be 0 (every eval prompt) or more")
    return args


def evaluate(client: RolloutClient, args: argparse.Namespace) -> dict[str, ShapesEval]:
    """The strict accuracy evals of the server's current policy, by settings: ``settings`` (--steps,
    --cfg) and ``defaults`` (the server's; the same eval where nothing is set), and with --search each
    with step-wise search (``search``, ``search_defaults``)."""
    request = eval_request(
        samples=args.samples,
        steps=args.steps,
        size=args.size,
        seed=args.seed,
        true_cfg_scale=args.cfg,
        prompts=args.prompts,
    )
    requests = {"settings": request, "defaults": at_server_defaults(request)}
    results = {"settings": evaluate_policy(client, request)}
    same = args.steps is None and args.cfg is None
    results["defaults"] = results["settings"] if same else evaluate_policy(client, requests["defaults"])
    if args.search:
        reward = Rewards(args.reward)
        for name, searched in requests.items():
            search = evaluate_search(client, searched, reward, args.search, args.search_steps)
            results[f"search_{name}" if name == "defaults" else "search"] = search
    return results


def push_lora(client: RolloutClient, folder: Path) -> int:
    from peft import LoraConfig
    from safetensors.torch import load_file

    weights = load_file(folder / "adapter_model.safetensors")
    version = client.server_info().policy_version + 1
    client.update_weights(weights, version, lora_config=LoraConfig.from_pretrained(folder), progress=False)
    return version


def main(argv=None) -> None:
    args = parse_args(argv)
    server = None
    if args.server is None:
        args.out.mkdir(parents=True, exist_ok=True)
        server = LocalServer.start(args.out / "server.log", "--model", args.model, "--threads", "1")
    try:
        with RolloutClient(args.server or server.address, timeout=600) as client:
            if args.lora is not None:
                print(f"policy version {push_lora(client, args.lora)}: {args.lora}", file=sys.stderr)
            results = evaluate(client, args)
    finally:
        if server is not None:
            server.stop()
    labels = {
        "settings": f"at --steps {args.steps or 'default'}, --cfg {args.cfg or 'default'}",
        "defaults": "at the server's defaults (its steps and CFG)",
        "search": f"with step-wise search of {args.search} at steps {args.search_steps}, --steps and --cfg",
        "search_defaults": f"with step-wise search of {args.search}, at the server's defaults",
    }
    for name, result in results.items():
        print(f"{labels[name]}:")
        print(shapes.format_accuracy_table(result.table))
        forwards = (
            "" if result.forwards is None else f"; {result.forwards} forwards ({result.plain_forwards} plain)"
        )
        print(
            f"accuracy {result.accuracy:.3f} +- {result.standard_error:.3f} (standard error, prompts as "
            f"clusters){forwards}\n"
        )
    if args.json is not None:
        tables = {name: result.summary() for name, result in results.items()}
        args.json.write_text(json.dumps(tables, indent=2) + "\n")


if __name__ == "__main__":
    main()
