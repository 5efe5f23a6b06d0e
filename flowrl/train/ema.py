"""An exponential moving average (EMA) of the trained weights (``[ema]``, off by default).

After every ``[ema].every``-th optimizer step (steps skipped for non-finite values do not count)
the shadow copy ``e`` of each trainable weight ``w`` (all weights, or only the LoRA matrices)
moves towards it::

    d_k = min(decay, (1 + k) / (1 + warmup_steps + k))     k = EMA updates done before this one
    e  <- d_k * e + (1 - d_k) * w

``warmup_steps = 0`` uses ``decay`` from the first update; ``warmup_steps = 9`` is the common
``(1 + k) / (10 + k)`` warm-up, so that early updates are not dominated by the initial weights.
The shadow starts equal to the weights at the start of training and is kept in float32, on the
training device or (``on_cpu = true``) in CPU memory. It is saved in every checkpoint
(``ema.safetensors``, and the update count in ``state.json``) and restored on resume, so a
resumed run's EMA is bit-identical to the uninterrupted run's.

Uses: ``[ema].evaluate = true`` evaluates the EMA weights during training; ``flowrl sample
--ema`` and ``flowrl export --ema`` use a checkpoint's EMA weights instead of the trained ones.

Under data parallelism every process holds the whole shadow (the weights are replicated).
Under FSDP2 the shadow is sharded like the weights: each process keeps the EMA of its own
shards (DTensors on the training device), saved into the sharded checkpoint
(torch.distributed.checkpoint, key ``ema``) by every process; ``on_cpu`` is refused there.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from ..distributed import drop_gathered_weights
from ..errors import FlowrlError
from .checkpoint import SHARDED, read_sharded_model_weights, read_tensors
from .finetune import load_trainable_state_dict

#: The file a checkpoint keeps the EMA weights in.
EMA_FILE = "ema.safetensors"
#: The key of the EMA weights in a sharded (torch.distributed.checkpoint) checkpoint.
EMA_KEY = "ema"


def ema_decay(decay: float, warmup_steps: int, k: int) -> float:
    """``d_k = min(decay, (1 + k) / (1 + warmup_steps + k))`` for the update after ``k`` updates."""
    if warmup_steps <= 0:
        return decay
    return min(decay, (1.0 + k) / (1.0 + warmup_steps + k))


class WeightEMA:
    """The shadow weights of a model's trainable parameters and their update rule."""

    def __init__(self, denoiser: torch.nn.Module, config):
        self.config = config
        self.denoiser = denoiser
        self.params = {n: p for n, p in denoiser.named_parameters() if p.requires_grad}
        device = torch.device("cpu") if config.on_cpu else None
        self.shadow = {n: p.detach().to(device=device or p.device, dtype=torch.float32, copy=True)
                       for n, p in self.params.items()}
        self.updates = 0  # EMA updates done
        self.steps = 0  # optimizer steps seen

    @classmethod
    def attach(cls, session, optimizer: torch.optim.Optimizer) -> WeightEMA | None:
        """The run's EMA (None unless ``[ema].enabled``), updated after each optimizer step by a
        step post-hook of ``optimizer``: a step skipped for non-finite values calls no hook."""
        config = session.recipe.ema
        if not config.enabled:
            return None
        sharded = any(hasattr(p, "full_tensor") for group in optimizer.param_groups for p in group["params"])
        if sharded and config.on_cpu:
            raise FlowrlError(
                "[ema] on_cpu = true is not supported with sharded weights ([distributed].strategy = 'fsdp2'): "
                "the EMA is sharded like the weights and lives next to them",
                where=f"{session.recipe.source}: [ema].on_cpu",
                hint="set on_cpu = false (each process then holds 1/N of the EMA), or use strategy 'ddp'",
            )
        ema = cls(session.model.denoiser, config)
        optimizer.register_step_post_hook(lambda *_: ema.step())
        return ema

    def step(self) -> None:
        """Count one optimizer step; update the shadow on every ``[ema].every``-th."""
        self.steps += 1
        if self.steps % self.config.every == 0:
            self.update()

    @torch.no_grad()
    def update(self) -> None:
        """``e <- d_k e + (1 - d_k) w`` for every trainable weight (in float32)."""
        d = ema_decay(self.config.decay, self.config.warmup_steps, self.updates)
        for name, p in self.params.items():
            e = self.shadow[name]
            w = p.detach().to(device=e.device, dtype=torch.float32)
            e.mul_(d).add_(w, alpha=1.0 - d)
        self.updates += 1

    def state(self) -> dict[str, int]:
        return {"updates": self.updates, "steps": self.steps}

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def state_dict(self) -> dict[str, dict[str, int]]:
        """The EMA's entry of a checkpoint's ``state.json``: updates and optimizer steps counted
        (its weights are :meth:`checkpoint_tensors`)."""
        return {EMA_KEY: self.state()}

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The EMA weights, under the name a checkpoint keeps them by (``ema.safetensors``, or
        sharded like the weights)."""
        return {EMA_KEY: self.tensors()}

    def load_state_dict(self, state: dict, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Continue from a checkpoint's ``state.json`` and named tensors (as written above)."""
        self.restore(tensors[EMA_KEY], state[EMA_KEY])

    def restore(self, tensors: dict[str, torch.Tensor], state: dict[str, int]) -> None:
        if sorted(tensors) != sorted(self.shadow):
            raise FlowrlError("the checkpoint's EMA does not match the model's trainable weights",
                              hint="resume with the recipe that wrote the checkpoint")
        for name, t in tensors.items():
            self.shadow[name].copy_(t)
        self.updates, self.steps = int(state["updates"]), int(state["steps"])

    @contextmanager
    def swapped_in(self):
        """Within the block the model's trainable weights are the EMA weights; the trained
        weights are put back exactly afterwards."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        drop_gathered_weights(self.denoiser)  # FSDP2 would reuse weights gathered before the swap
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            drop_gathered_weights(self.denoiser)
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])


def load_ema_weights(denoiser: torch.nn.Module, checkpoint: Path, where: str = "--ema") -> None:
    """Put a checkpoint's EMA weights into ``denoiser``'s trainable weights (for sampling and
    export; a sharded checkpoint is read in this one process); a clear error when the run kept
    no EMA."""
    path = Path(checkpoint) / EMA_FILE
    if (Path(checkpoint) / SHARDED).is_dir():
        tensors = read_sharded_model_weights(Path(checkpoint) / SHARDED, key=EMA_KEY)
        if tensors:
            load_trainable_state_dict(denoiser, tensors)
            return
    if not path.is_file():
        raise FlowrlError(f"{checkpoint} holds no EMA weights ({EMA_FILE})", where=where,
                          hint="train with [ema] enabled = true (docs/recipes.md, [ema]), or leave out --ema")
    load_trainable_state_dict(denoiser, read_tensors(path))
