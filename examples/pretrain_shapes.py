"""Pretrain the `shapes` preset: its VAE, then its transformer with a flow-matching loss, on scenes
rendered on the fly (`rollout_client.rewards.shapes`).

    python examples/pretrain_shapes.py --out pretrain-shapes-output      # or: make pretrain-shapes

1. The VAE learns to reconstruct scenes (random crops of them: the autoencoder is convolutional, so it
   learns the same from a quarter of the pixels), with a small KL term.
2. The latents' mean and standard deviation over rendered scenes become the VAE's ``shift_factor`` and
   ``scaling_factor``, so the transformer sees unit-variance latents, as FLUX's does.
3. The transformer learns the rectified-flow velocity: for a scene's latents x_0, noise e and
   sigma ~ logit-normal(0, 1), ``x_sigma = (1 - sigma) x_0 + sigma e`` and the target is ``e - x_0``
   (the sampler's step is ``x + (sigma_next - sigma) v``). Captions come from the pretraining split
   (held-out compositions never appear); 10 % are dropped to the empty prompt, so classifier-free
   guidance works. The saved weights are an exponential moving average of the trained ones.

Every batch is drawn from a generator seeded by (seed, stage, step), so a run is reproducible and
``--resume`` (from ``checkpoint.pt``, written every ``--checkpoint-every`` steps) continues it exactly.
The text encoders stay as seeded; their outputs for every caption are computed once.

Writes ``--out/weights/`` (``vae.safetensors``, ``transformer.safetensors``, ``latents.json``,
``PRETRAINED.json`` with the command, seed, losses and sha256 of each file) and prints the strict
accuracy of samples of the eval prompts per task type.
"""

import argparse
import hashlib
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from rollout_client.rewards import shapes
from rollout_core import scenes
from rollout_server.families.flux.shapes import TEXT_TOKENS, untrained_shapes_pipeline

STAGES = ("vae", "transformer")
CAPTION_DROPOUT = 0.1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("pretrain-shapes-output"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--vae-crop", type=int, default=32, help="side of the random crops the VAE trains on")
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=12000, help="transformer steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    parser.add_argument(
        "--eval-steps", type=int, default=20, help="sampler steps of the final check; 0: none"
    )
    parser.add_argument("--eval-cfg", type=float, default=3.0, help="true CFG scale of the final check")
    return parser.parse_args(argv)


def batch_rng(seed: int, stage: str, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, STAGES.index(stage), step])


def rendered_scenes(
    specs: list, count: int, size: int, rng: np.random.Generator
) -> tuple[torch.Tensor, list[str]]:
    """``count`` rendered scenes as a [count, 3, size, size] tensor in [-1, 1], and their captions."""
    chosen = [specs[i] for i in rng.integers(len(specs), size=count)]
    images = [np.asarray(scenes.render(spec, size, rng=rng), dtype=np.float32) for spec in chosen]
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2) / 127.5 - 1
    return pixels, [scenes.caption(spec) for spec in chosen]


def crops(pixels: torch.Tensor, side: int, rng: np.random.Generator) -> torch.Tensor:
    if side >= pixels.shape[-1]:
        return pixels
    corners = rng.integers(pixels.shape[-1] - side + 1, size=(len(pixels), 2))
    return torch.stack(
        [image[:, y : y + side, x : x + side] for image, (y, x) in zip(pixels, corners, strict=True)]
    )


def learning_rate(base: float, step: int, steps: int, warmup: int = 100) -> float:
    """Linear warm-up, then a cosine decay to a tenth."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class TextCache:
    """The frozen text encoders' outputs for every pretraining caption and the empty prompt."""

    def __init__(self, pipe, captions: list[str]):
        self.entries = {}
        texts = ["", *captions]
        with torch.no_grad():
            for start in range(0, len(texts), 128):
                chunk = texts[start : start + 128]
                embeds, pooled, _ = pipe.encode_prompt(
                    prompt=chunk, prompt_2=None, device=torch.device("cpu"), max_sequence_length=TEXT_TOKENS
                )
                self.entries.update(zip(chunk, zip(embeds, pooled, strict=True), strict=True))

    def batch(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled = zip(*(self.entries[text] for text in captions), strict=True)
        return torch.stack(embeds), torch.stack(pooled)


def train_vae(pipe, args, state: dict, specs: list, save) -> None:
    vae = pipe.vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    if "vae_optimizer" in state:
        optimizer.load_state_dict(state["vae_optimizer"])
    losses = state.setdefault("vae_losses", [])
    for step in tqdm(
        range(len(losses), args.vae_steps), desc="vae", initial=len(losses), total=args.vae_steps
    ):
        rng = batch_rng(args.seed, "vae", step)
        pixels, _ = rendered_scenes(specs, args.vae_batch, args.size, rng)
        pixels = crops(pixels, args.vae_crop, rng)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.vae_lr, step, args.vae_steps)
        posterior = vae.encode(pixels).latent_dist
        generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
        reconstruction = vae.decode(posterior.sample(generator)).sample
        loss = (reconstruction - pixels).pow(2).mean() + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.vae_steps:
            state["vae_optimizer"] = optimizer.state_dict()
            save()
    vae.eval().requires_grad_(False)


@torch.no_grad()
def latent_statistics(pipe, args, specs: list) -> dict:
    """The VAE's shift and scaling factors: the mean and 1 / std of its latents over 512 scenes."""
    pixels, _ = rendered_scenes(specs, 512, args.size, batch_rng(args.seed, "vae", 10**9))
    latents = torch.cat([pipe.vae.encode(chunk).latent_dist.mode() for chunk in pixels.split(64)])
    return {"shift_factor": latents.mean().item(), "scaling_factor": 1 / latents.std().item()}


@torch.no_grad()
def packed_latents(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """Scenes to the transformer's x_0: scaled latents packed into 2x2 patches, [B, tokens, 4C]."""
    vae = pipe.vae
    latents = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    batch, channels, height, width = latents.shape
    return pipe._pack_latents(latents, batch, channels, height, width)


def train_transformer(pipe, args, state: dict, specs: list, text: TextCache, save) -> None:
    transformer = pipe.transformer.train()
    transformer.requires_grad_(True)
    parameters = list(transformer.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=0.0)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    ema = state.setdefault("ema", {name: p.detach().clone() for name, p in transformer.named_parameters()})
    losses = state.setdefault("losses", [])
    side = args.size // pipe.vae_scale_factor
    img_ids = pipe._prepare_latent_image_ids(1, side // 2, side // 2, torch.device("cpu"), torch.float32)
    txt_ids = torch.zeros(TEXT_TOKENS, 3)
    for step in tqdm(
        range(len(losses), args.steps), desc="transformer", initial=len(losses), total=args.steps
    ):
        rng = batch_rng(args.seed, "transformer", step)
        pixels, captions = rendered_scenes(specs, args.batch, args.size, rng)
        captions = [
            "" if drop else caption
            for caption, drop in zip(captions, rng.random(args.batch) < CAPTION_DROPOUT, strict=True)
        ]
        x_0 = packed_latents(pipe, pixels)
        generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
        noise = torch.randn(x_0.shape, generator=generator)
        sigma = torch.sigmoid(torch.randn(args.batch, generator=generator))
        x_sigma = (1 - sigma.view(-1, 1, 1)) * x_0 + sigma.view(-1, 1, 1) * noise
        embeds, pooled = text.batch(captions)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args.lr, step, args.steps)
        velocity = transformer(
            hidden_states=x_sigma,
            timestep=sigma,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        loss = (velocity - (noise - x_0)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for name, parameter in transformer.named_parameters():
                ema[name].lerp_(parameter.detach(), 1 - decay)
        losses.append(loss.item())
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            state["optimizer"] = optimizer.state_dict()
            save()
    transformer.load_state_dict(ema)  # the averaged weights are the model
    transformer.eval().requires_grad_(False)


@torch.no_grad()
def strict_accuracy(pipe, args) -> dict:
    """Samples one image per eval prompt (ODE, seeded, true CFG against the empty prompt) and scores
    them strictly, per task type."""
    prompts = scenes.eval_prompts()
    images = [
        pipe(
            prompt=prompt,
            height=args.size,
            width=args.size,
            num_inference_steps=args.eval_steps,
            true_cfg_scale=args.eval_cfg,
            negative_prompt="" if args.eval_cfg > 1 else None,
            max_sequence_length=TEXT_TOKENS,
            generator=torch.Generator().manual_seed(k),
        ).images[0]
        for k, prompt in enumerate(tqdm(prompts, desc="eval"))
    ]
    return shapes.accuracy_table(prompts, shapes.strict_accuracy(images, prompts).bool().tolist())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out / "checkpoint.pt"
    pipe = untrained_shapes_pipeline(args.out / "tokenizers")
    pipe.set_progress_bar_config(disable=True)
    pipe.text_encoder.requires_grad_(False)
    pipe.text_encoder_2.requires_grad_(False)
    state: dict = {}
    if args.resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        pipe.vae.load_state_dict(state["vae"])
        pipe.transformer.load_state_dict(state["transformer"])
        if "latents" in state:
            pipe.vae.register_to_config(**state["latents"])

    def save() -> None:
        state["vae"] = pipe.vae.state_dict()
        state["transformer"] = pipe.transformer.state_dict()
        torch.save(state, checkpoint.with_suffix(".tmp"))
        checkpoint.with_suffix(".tmp").replace(checkpoint)

    specs = scenes.pretraining_specs()
    began = time.perf_counter()
    train_vae(pipe, args, state, specs, save)
    if "latents" not in state:
        state["latents"] = latent_statistics(pipe, args, specs)
        pipe.vae.register_to_config(**state["latents"])
        save()
    text = TextCache(pipe, sorted({scenes.caption(spec) for spec in specs}))
    train_transformer(pipe, args, state, specs, text, save)
    seconds = time.perf_counter() - began

    weights = args.out / "weights"
    weights.mkdir(exist_ok=True)
    save_file(pipe.vae.state_dict(), weights / "vae.safetensors")
    save_file(pipe.transformer.state_dict(), weights / "transformer.safetensors")
    (weights / "latents.json").write_text(json.dumps(state["latents"], indent=2) + "\n")
    table = strict_accuracy(pipe, args) if args.eval_steps else {}
    record = {
        "command": shlex.join(["python", "examples/pretrain_shapes.py", *sys.argv[1:]]),
        "seed": args.seed,
        "vae_steps": args.vae_steps,
        "transformer_steps": args.steps,
        "final_vae_loss": float(np.mean(state["vae_losses"][-50:])),
        "final_transformer_loss": float(np.mean(state["losses"][-50:])),
        "train_seconds_this_run": round(seconds, 1),
        "eval_accuracy": {task: {"correct": c, "total": n} for task, (c, n) in table.items()},
        "sha256": {path.name: sha256(path) for path in sorted(weights.glob("*.safetensors"))},
    }
    (weights / "PRETRAINED.json").write_text(json.dumps(record, indent=2) + "\n")
    for task, (correct, total) in table.items():
        print(f"{task:12s} {correct:4d} / {total:4d}  {correct / max(total, 1):6.1%}")


if __name__ == "__main__":
    main()
