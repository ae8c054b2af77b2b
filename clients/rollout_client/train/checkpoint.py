"""A run's checkpoint: policy, optimizer, schedule, RNG and metrics rows, written atomically."""

import os
from pathlib import Path

import torch
from peft import set_peft_model_state_dict

from rollout_client.train.policy import trainable_state


def save_checkpoint(
    path: Path, config, transformer, optimizer, schedule, rows: list[dict], averages: dict
) -> None:
    """What the run needs to go on after ``len(rows)`` iterations, written to a temporary file and
    renamed over ``path``: a kill at any moment leaves the previous checkpoint or this one, whole.
    ``averages`` holds the weights the run keeps beside the trained ones (its EMA, the algorithm's
    state)."""
    state = {
        "settings": config.settings(),
        "iterations_done": len(rows),
        "policy": {name: t.detach().cpu() for name, t in trainable_state(transformer, config).items()},
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "rng": {"cpu": torch.get_rng_state()}
        | ({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}),
        "rows": rows,
        "averages": averages,
    }
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def restore_checkpoint(checkpoint: dict, transformer, optimizer, schedule) -> tuple[list[dict], dict]:
    """Load a checkpoint's policy, optimizer, schedule and RNG state; returns its metrics rows and its
    averages."""
    if checkpoint["settings"]["train"] == "full":
        transformer.load_state_dict(checkpoint["policy"])
    else:
        loaded = set_peft_model_state_dict(transformer, checkpoint["policy"])
        if loaded.unexpected_keys:
            raise RuntimeError(
                f"the checkpoint's adapter has tensors this LoRA lacks: {loaded.unexpected_keys}"
            )
    optimizer.load_state_dict(checkpoint["optimizer"])
    schedule.load_state_dict(checkpoint["schedule"])
    torch.set_rng_state(checkpoint["rng"]["cpu"])
    if "cuda" in checkpoint["rng"]:
        torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
    return checkpoint["rows"], checkpoint["averages"]
