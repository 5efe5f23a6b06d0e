"""Built-in sigma schedules: fixed shift, FLUX's dynamic shift, and the model's own."""

from __future__ import annotations

import dataclasses

import torch

from flowrl import hookimpl
from flowrl.config import param
from flowrl.errors import FlowrlError
from flowrl.interfaces import HasImageSeqLen
from flowrl.sampling.schedules import flux_dynamic_sigmas, shifted_sigmas


@dataclasses.dataclass(frozen=True)
class ShiftConfig:
    shift: float = param(3.0, "Fixed time shift s: sigma' = s sigma / (1 + (s - 1) sigma). 1 = no shift.", min=0.0, exclusive_min=True)


class ShiftSchedule:
    """linspace(1, 0, N + 1) with a fixed (SD3-style) time shift."""

    Config = ShiftConfig

    def __init__(self, config: ShiftConfig):
        self.config = config

    def sigmas(self, num_steps, model=None):
        return shifted_sigmas(num_steps, self.config.shift)

    def sigma_at(self, t):
        """The shifted sigma at uniform times ``t`` (float64; MixGRPO-Flash's compression)."""
        t = torch.as_tensor(t, dtype=torch.float64)
        return self.config.shift * t / (1.0 + (self.config.shift - 1.0) * t)


@dataclasses.dataclass(frozen=True)
class FluxDynamicConfig:
    image_seq_len: int = param(0, "Image tokens (packed latent length); 0 = ask the model adapter.", min=0)
    base_seq_len: int = param(256, "Sequence length at which mu = base_shift.", min=1)
    max_seq_len: int = param(4096, "Sequence length at which mu = max_shift.", min=1)
    base_shift: float = param(0.5, "mu at base_seq_len.")
    max_shift: float = param(1.15, "mu at max_seq_len.")


class FluxDynamicSchedule:
    """FLUX's resolution-dependent exponential shift, mu from the image sequence length."""

    Config = FluxDynamicConfig

    def __init__(self, config: FluxDynamicConfig):
        self.config = config

    def sigmas(self, num_steps, model=None):
        seq_len = self.config.image_seq_len or (model.image_seq_len if isinstance(model, HasImageSeqLen) else 0)
        if not seq_len:
            raise FlowrlError(
                "schedule 'flux_dynamic' needs the image sequence length",
                where="[schedule].image_seq_len",
                hint="set image_seq_len, or use a model adapter that reports image_seq_len",
            )
        c = self.config
        return flux_dynamic_sigmas(
            num_steps, seq_len, base_seq_len=c.base_seq_len, max_seq_len=c.max_seq_len,
            base_shift=c.base_shift, max_shift=c.max_shift,
        )


class ModelSchedule:
    """The model adapter's own schedule (what its pipeline uses at inference)."""

    def sigmas(self, num_steps, model=None):
        sigmas = model.sigmas(num_steps) if model is not None else None
        if sigmas is None:
            raise FlowrlError(
                "schedule 'model' was chosen but the model adapter has no schedule of its own",
                where="[schedule].use",
                hint='use "shift" or "flux_dynamic"',
            )
        return sigmas


@hookimpl(trylast=True)
def register_schedules(register):
    register("shift", ShiftSchedule)
    register("flux_dynamic", FluxDynamicSchedule)
    register("model", ModelSchedule)


@hookimpl(trylast=True)
def default_component(kind):
    return "shift" if kind == "schedule" else None
