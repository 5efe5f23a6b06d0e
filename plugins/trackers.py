"""Built-in trackers. ``metrics.jsonl`` is always written by the engine; these add to it.

A tracker checks its optional package when it is built (``flowrl validate`` and ``flowrl train``
build every tracker before anything is written), so a missing extra is reported before a run
directory exists.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
from pathlib import Path
from typing import Literal

from flowrl import hookimpl
from flowrl.config import param
from flowrl.errors import require

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclasses.dataclass(frozen=True)
class TensorBoardConfig:
    log_dir: str = param("", "Event directory; empty = RUN_DIR/tensorboard.")


class TensorBoardTracker:
    """TensorBoard scalars and image grids (needs `pip install "flowrl-diffusion[tensorboard]"`);
    a resumed run hides the events of the iterations it redoes (TensorBoard's ``purge_step``)."""

    Config = TensorBoardConfig

    def __init__(self, config: TensorBoardConfig):
        require("tensorboard", extra="tensorboard", purpose="the tensorboard tracker")
        self.config = config
        self.writer = None
        self.purge_step = None

    def rewind(self, step):
        self.purge_step = step

    def start(self, run_dir):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.config.log_dir or str(run_dir / "tensorboard"), purge_step=self.purge_step)

    def log_metrics(self, step, metrics):
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)

    def log_image(self, step, name, image):
        import numpy as np

        self.writer.add_image(name, np.asarray(image), step, dataformats="HWC")

    def close(self):
        if self.writer is not None:
            self.writer.close()


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    project: str = param("flowrl", "wandb project.")
    entity: str = param("", "wandb entity (user or team); empty = your default.")
    name: str = param("", "Run name shown in wandb; empty = the run directory's name.")
    group: str = param("", "wandb group (e.g. one sweep); empty = none.")
    tags: list[str] = param([], "wandb tags.")
    mode: Literal["", "online", "offline", "disabled"] = param(
        "", "'online', 'offline' or 'disabled'; empty = wandb's default (the WANDB_MODE variable, else online)."
    )


#: The file in the run directory that names the wandb run, so that a resumed run logs into it.
WANDB_RUN_FILE = "wandb_run.json"


class WandbTracker:
    """Weights & Biases: scalars (x axis: the iteration), image grids, the resolved recipe as
    the run's config; a resumed run logs into the same wandb run (its id is kept in
    RUN_DIR/wandb_run.json). wandb's files go to RUN_DIR/wandb. Needs `pip install "flowrl-diffusion[wandb]"`."""

    Config = WandbConfig

    def __init__(self, config: WandbConfig):
        self.wandb = require("wandb", extra="wandb", purpose="the wandb tracker")
        self.config = config
        self.run = None

    def start(self, run_dir):
        run_dir = Path(run_dir)
        id_file = run_dir / WANDB_RUN_FILE
        run_id = json.loads(id_file.read_text())["id"] if id_file.is_file() else secrets.token_hex(4)
        recipe = run_dir / "recipe.toml"
        c = self.config
        self.run = self.wandb.init(
            project=c.project, entity=c.entity or None, name=c.name or run_dir.name, group=c.group or None,
            tags=list(c.tags) or None, mode=c.mode or None, dir=str(run_dir), id=run_id, resume="allow",
            config=tomllib.loads(recipe.read_text()) if recipe.is_file() else None,
        )
        id_file.write_text(json.dumps({"id": run_id, "project": c.project}))
        self.run.define_metric("iteration")
        self.run.define_metric("*", step_metric="iteration")

    def log_metrics(self, step, metrics):
        values = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log({**values, "iteration": step})

    def log_image(self, step, name, image):
        self.run.log({name: self.wandb.Image(image), "iteration": step})

    def close(self):
        if self.run is not None:
            self.run.finish()
            self.run = None


@hookimpl(trylast=True)
def register_trackers(register):
    register("tensorboard", TensorBoardTracker)
    register("wandb", WandbTracker)
