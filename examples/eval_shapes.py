"""GenEval-style accuracy of a policy on the shapes eval prompts, through a rollout server.

    python examples/eval_shapes.py                          # its own server on the shapes preset
    python examples/eval_shapes.py --lora train-output-shapes/lora
    python examples/eval_shapes.py --server HOST:PORT

Each eval prompt (``rollout_core.scenes.eval_prompts()``) is sampled ``--samples`` times
with the deterministic ODE sampler from fixed seeds, with the server's CFG (or ``--cfg``), and every image is
scored strictly (the right objects, counts, colours and relation, nothing extra; see
``rollout_client.shapes_eval``). Prints the table per task type and overall,
as GenEval reports it. ``--lora`` pushes a PEFT adapter folder (as ``make train-shapes`` writes it)
first, as the server's next policy version; otherwise the server's current policy is evaluated.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from rollout_client import RolloutClient
from rollout_client.rewards import shapes
from rollout_client.shapes_eval import ShapesEval, eval_request, evaluate_policy
from rollout_core.local_server import LocalServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="address of a running server (default: start one on --model)")
    parser.add_argument("--model", default="shapes", help="preset or folder for the server we start")
    parser.add_argument("--lora", type=Path, help="a PEFT adapter folder to evaluate")
    parser.add_argument("--samples", type=int, default=4, help="images per prompt")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps")
    parser.add_argument("--size", type=int, default=64, help="image height and width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cfg", type=float, help="true CFG scale (default: the server's; the shapes preset's is 3)"
    )
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument("--out", type=Path, default=Path("eval-shapes-output"), help="server log folder")
    return parser.parse_args(argv)


def evaluate(client: RolloutClient, args: argparse.Namespace) -> ShapesEval:
    """The strict accuracy eval of the server's current policy."""
    request = eval_request(
        samples=args.samples, steps=args.steps, size=args.size, seed=args.seed, true_cfg_scale=args.cfg
    )
    return evaluate_policy(client, request)


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
            result = evaluate(client, args)
    finally:
        if server is not None:
            server.stop()
    print(shapes.format_accuracy_table(result.table))
    print(
        f"accuracy {result.accuracy:.3f} +- {result.standard_error:.3f} (standard error, prompts as clusters)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result.summary(), indent=2) + "\n")


if __name__ == "__main__":
    main()
