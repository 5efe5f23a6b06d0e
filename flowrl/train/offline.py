"""Training from offline data (:mod:`flowrl.offline`): one optimizer step per iteration on the
iteration's rows, with the offline SFT or DPO objective (:mod:`flowrl.objectives.offline`). No
rollout, no reward model: the data's images (or pairs) are the training signal.

The iteration's rows and every point's sigma and noise are seeded by (seed, iteration, row), so
``state_dict()`` (the trained weights, the optimizer and the iteration) is all a resume needs to
repeat the uninterrupted run exactly.

This is the driver the offline tests and ``benchmarks``-style measurements use; it is not (yet)
wired into ``flowrl train`` (docs/objectives.md, "Offline SFT and DPO").
"""

from __future__ import annotations

import copy

import torch

from ..interfaces import select_embeddings
from ..objectives.offline import offline_dpo_loss, offline_points, sft_loss
from ..offline import OfflineRows, offline_batch

__all__ = ["OBJECTIVES", "OfflineTrainer"]

#: the offline objectives and the dataset kind each trains on
OBJECTIVES = {"sft": "images", "dpo": "pairs"}


class OfflineTrainer:
    """``step()`` trains one iteration and returns its metrics. ``model`` is the adapter (its
    ``trainable_parameters()`` are updated); DPO's reference is a frozen copy of its denoiser
    taken at construction (the model before offline training)."""

    def __init__(self, model, data: OfflineRows, *, objective: str, sigmas: torch.Tensor, batch_size: int,
                 timesteps: int, lr: float, seed: int, beta: float = 1000.0, device: str | torch.device = "cpu"):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, got {objective!r}")
        if OBJECTIVES[objective] != data.kind:
            raise ValueError(f"offline {objective} trains on a table of {OBJECTIVES[objective]}, "
                             f"got one of {data.kind}")
        self.model, self.data, self.objective = model, data, objective
        self.sigmas, self.batch_size, self.timesteps = sigmas, batch_size, timesteps
        self.seed, self.beta, self.device = seed, beta, device
        self.params = list(model.trainable_parameters())
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.reference = self._frozen_reference() if objective == "dpo" else None
        self.iteration = 0

    def _frozen_reference(self):
        """``velocity`` of the model as it is now, without gradient: the denoiser copied and
        swapped in for the call (the adapter's own velocity keeps its conventions)."""
        frozen = copy.deepcopy(self.model.denoiser).requires_grad_(False)

        def velocity(x, sigma, text):
            live, self.model.denoiser = self.model.denoiser, frozen
            try:
                with torch.no_grad():
                    return self.model.velocity(x, sigma, text)
            finally:
                self.model.denoiser = live

        return velocity

    def step(self) -> dict[str, float]:
        it = self.iteration
        batch = offline_batch(self.data, self.model, seed=self.seed, iteration=it, count=self.batch_size,
                              device=self.device)
        first = next(iter(batch.latents.values()))
        sigma, eps, idx = offline_points(self.seed, f"offline_{self.objective}", it, batch.rows, first,
                                         self.sigmas, self.timesteps)
        text = select_embeddings(self.model.encode_prompts(batch.prompts), idx.to(self.device))
        self.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            if self.objective == "sft":
                loss = sft_loss(self.model, batch.latents["image"], text, sigma, eps, idx)
                metrics = {"sft/fm_loss": float(loss.detach())}
            else:
                loss, parts = offline_dpo_loss(self.model, self.reference, batch.latents["chosen"],
                                               batch.latents["rejected"], text, sigma, eps, idx, self.beta)
                metrics = {f"dpo/{k}": v for k, v in parts.items()}
            loss.backward()
        self.optimizer.step()
        self.iteration = it + 1
        return {"iteration": it, **metrics}

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "optimizer": self.optimizer.state_dict(),
                "params": [p.detach().clone() for p in self.params]}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, state["params"], strict=True):
                p.copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = int(state["iteration"])
