"""--report-to: what a run reports besides metrics.csv and its plots, for TensorBoard or W&B.

Per iteration, every numeric column of the metrics row as a scalar (``train/<column>``, the step the
iteration); at each eval, ``eval/accuracy`` and its standard error ``eval/accuracy_stderr`` (with
TensorBoard, a custom scalar chart draws the accuracy between ``eval/accuracy_lower`` and
``eval/accuracy_upper``, one standard error either side) and the eval's framed grid (the other evals,
at the server's defaults and with --search, as ``train/eval_accuracy_<name>`` columns, and after the
last iteration as ``eval/accuracy_<name>``); at the first and
last iteration and every --eval-every, a grid of the iteration's samples (a row per prompt, labelled
with its mean reward) and each prompt's mean reward (``reward_per_prompt/p<index>``). W&B runs offline
only: it writes its run under --out/wandb and sends nothing.
"""

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from rollout_client.images import contact_sheet

if TYPE_CHECKING:
    import torch

    from rollout_client import Trajectory
    from rollout_client.shapes_eval import ShapesEval

# The columns that are no scalar (their text or the step itself).
NOT_SCALARS = ("iteration", "scored_steps")


class Report:
    """A backend's sink for scalars, images and text; this one (``--report-to none``) keeps nothing."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def image(self, tag: str, image: Image.Image, step: int) -> None:
        pass

    def text(self, tag: str, text: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass

    # What the trainer reports, in the backend's terms.

    def row(self, row: dict) -> None:
        """An iteration's metrics row: its finite numbers as ``train/<column>``, its eval as ``eval/``."""
        values = {
            f"train/{name}": float(value)
            for name, value in row.items()
            if name not in NOT_SCALARS and isinstance(value, int | float) and math.isfinite(value)
        }
        self.scalars(values, row["iteration"])
        if not math.isnan(row.get("eval_accuracy", math.nan)):
            self.accuracy(row["eval_accuracy"], row["eval_se"], row["iteration"])

    def accuracy(self, accuracy: float, stderr: float, step: int) -> None:
        """An eval's accuracy with its error bar (the policy before iteration ``step``'s update)."""
        self.scalars(
            {
                "eval/accuracy": accuracy,
                "eval/accuracy_stderr": stderr,
                "eval/accuracy_lower": accuracy - stderr,
                "eval/accuracy_upper": accuracy + stderr,
            },
            step,
        )

    def eval_images(self, result: "ShapesEval", step: int) -> None:
        """The eval's images, framed green where strictly right and red where wrong."""
        from rollout_client.train.metrics import eval_sheet

        self.image("eval/images", eval_sheet(result), step)

    def samples(self, trajectories: list["Trajectory"], rewards: "torch.Tensor", step: int) -> None:
        """The iteration's samples, a row per prompt labelled with its mean reward, and each prompt's
        mean reward."""
        rows: dict[int, list[tuple[Trajectory, float]]] = {}
        for trajectory, reward in zip(trajectories, rewards.tolist(), strict=True):
            rows.setdefault(trajectory.prompt_index, []).append((trajectory, reward))
        means = {p: sum(r for _, r in row) / len(row) for p, row in sorted(rows.items())}
        self.scalars({f"reward_per_prompt/p{p:02d}": mean for p, mean in means.items()}, step)
        columns = max(len(row) for row in rows.values())
        images, labels, table = [], [], ["| prompt | text | mean reward | rewards |", "|---|---|---|---|"]
        for p, row in sorted(rows.items()):
            pictures = [trajectory.image() for trajectory, _ in sorted(row, key=lambda t: t[0].sample_index)]
            images += pictures + [Image.new("RGB", pictures[0].size)] * (columns - len(pictures))
            labels.append(f"{means[p]:+.4f} {row[0][0].prompt}")
            table.append(
                f"| {p} | {row[0][0].prompt} | {means[p]:.5f} | {', '.join(f'{r:.5f}' for _, r in row)} |"
            )
        self.image("samples/images", contact_sheet(images, columns, labels), step)
        self.text("samples/reward_per_prompt", "\n".join(table), step)


class TensorBoard(Report):
    """Event files under ``folder``, through torch's SummaryWriter (which needs ``tensorboard``)."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_custom_scalars(
            {
                "eval": {
                    "accuracy +- stderr": [
                        "Margin",
                        ["eval/accuracy", "eval/accuracy_lower", "eval/accuracy_upper"],
                    ]
                }
            }
        )

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def image(self, tag: str, image: Image.Image, step: int) -> None:
        import numpy

        self.writer.add_image(tag, numpy.asarray(image.convert("RGB")), step, dataformats="HWC")

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()


class WandB(Report):
    """An offline W&B run under ``folder``: nothing leaves the machine (``wandb sync`` would send it)."""

    def __init__(self, folder: Path, settings: dict):
        os.environ["WANDB_MODE"] = "offline"  # before the import: W&B reads it there too
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(mode="offline", dir=str(folder), config=settings, project="rollout-server")

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def image(self, tag: str, image: Image.Image, step: int) -> None:
        self.run.log({tag: self.wandb.Image(image)}, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: self.wandb.Html(f"<pre>{text}</pre>")}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_report(report_to: str, out: Path, settings: dict) -> Report:
    """The backend ``report_to`` names, writing under ``out``."""
    if report_to == "tensorboard":
        return TensorBoard(out / "tensorboard")
    if report_to == "wandb":
        return WandB(out / "wandb", settings)
    return Report()
