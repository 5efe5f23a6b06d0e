"""Built-in trackers. ``metrics.jsonl`` is always written by the engine; these add to it."""

from __future__ import annotations

import dataclasses

from flowrl import hookimpl
from flowrl.config import param
from flowrl.errors import require


@dataclasses.dataclass(frozen=True)
class TensorBoardConfig:
    log_dir: str = param("", "Event directory; empty = RUN_DIR/tensorboard.")


class TensorBoardTracker:
    """TensorBoard scalars and image grids (needs `pip install "flowrl[tensorboard]"`)."""

    Config = TensorBoardConfig

    def __init__(self, config: TensorBoardConfig):
        self.config = config
        self.writer = None

    def start(self, run_dir):
        require("tensorboard", extra="tensorboard", purpose="the tensorboard tracker")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.config.log_dir or str(run_dir / "tensorboard"))

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


@hookimpl(trylast=True)
def register_trackers(register):
    register("tensorboard", TensorBoardTracker)
