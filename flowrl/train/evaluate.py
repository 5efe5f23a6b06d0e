"""The run's evaluation on a fixed prompt set.

Images are drawn with the one ODE sampler, :func:`flowrl.sampling.rollout.ode_sample` (as
``flowrl sample`` and ``flowrl eval`` draw them). :func:`evaluate` scores the fixed evaluation set of a run: prompt ``p`` with seed index ``s``
is item ``j`` of ``[(p, s) for s in seeds for p in prompts]`` and starts from noise drawn by a
generator seeded with ``(seed, "eval", j)``, so the numbers do not depend on the batch size and
``flowrl eval RUN_DIR`` reproduces them at any checkpoint.

:class:`RunEvaluator` is the training run's evaluation: every ``[log].eval_every`` iterations
and once at the end, with the EMA weights when ``[ema].evaluate``; it returns the metrics
row's ``eval/*`` and hands the images to the run's eval grids. With several ``ddp`` processes
each evaluates a contiguous share of the evaluation's batches (:func:`evaluation_share`: the
batches themselves are those of one process, so every image's score is too) and the main
process gathers the scores; under FSDP2 the main process evaluates and the others make the
same sharded forwards alongside.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from .. import distributed
from ..artefacts import ARTEFACT_MEASURES
from ..interfaces import scores_latents
from ..rewards import score
from ..prompts import evaluation_prompts, read_prompts, reward_metadata
from ..sampling.rollout import ode_sample
from ..seeding import generator
from ..stop_points import StopRequested, stop_point, stoppable
from .outputs import EVAL_GRID_MAX
from .warning_signs import WarningSigns


def evaluation_set(recipe, model) -> list[str]:
    """The run's fixed evaluation prompts: ``[prompts].num_eval`` of the evaluation pool
    (``eval_source``, else ``source``) in the order seeded by ``[run].seed``; empty when the
    recipe evaluates nothing. Training and ``flowrl eval RUN_DIR`` both take them from here."""
    p = recipe.prompts
    if not p.num_eval:
        return []
    pool = read_prompts(p.eval_source or p.source, model, f"{recipe.source}: [prompts].eval_source", p, role="eval")
    return evaluation_prompts(pool, recipe.run.seed, p.num_eval)


def evaluation_items(prompts: Sequence[str], seeds: int) -> list[tuple[str, int]]:
    """``(prompt, seed index)`` of every evaluation image, in the order that keys their noise."""
    return [(p, s) for s in range(seeds) for p in prompts]


def evaluation_noise(latent_shape, seed: int, indices: Sequence[int]) -> torch.Tensor:
    """Starting noise ``[len(indices), *L]`` of the evaluation items with these indices."""
    return torch.stack([torch.randn(tuple(latent_shape), generator=generator(seed, "eval", j)) for j in indices])


def evaluation_share(num_items: int, batch: int, rank: int, world_size: int) -> range:
    """The batch indices (batches of ``batch`` items, in item order) data rank ``rank`` of
    ``world_size`` evaluates: a contiguous block, the first ranks one batch more when they do
    not divide, so that the main process holds the first items (those the eval grids show)."""
    num_batches = -(-num_items // batch)
    base, extra = divmod(num_batches, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@torch.no_grad()
def evaluate(model, sigmas: torch.Tensor, rewards, prompts: list[str], seeds: int, seed: int, cache, batch: int,
             on_images: Callable[[torch.Tensor], None] | None = None, batches: Sequence[int] | None = None):
    """Scores ``{label: [len(prompts) * seeds]}`` of every reward on the fixed evaluation set
    (ODE sampling along ``sigmas``, the run's schedule), then of every artefact measure
    (:data:`flowrl.artefacts.ARTEFACT_MEASURES`: the texture a policy may learn). ``on_images``
    receives each batch's decoded images, in item order. ``batches``: only these batch indices
    (batches of ``batch`` items; :func:`evaluation_share`), their items' scores in that order.
    A run may stop before each denoiser forward and each reward call (:mod:`flowrl.stop_points`;
    the reward calls only where this process evaluates alone: the others of an fsdp2 run make
    the forwards, not the calls)."""
    scores: dict[str, list[torch.Tensor]] = defaultdict(list)
    items = evaluation_items(prompts, seeds)
    starts = range(0, len(items), batch) if batches is None else [k * batch for k in batches]
    for start in starts:
        part = items[start : start + batch]
        ps = [p for p, _ in part]
        text = cache.get(ps, sigmas.device)
        noise = evaluation_noise(model.latent_shape, seed, range(start, start + len(part))).to(sigmas.device)
        latents = ode_sample(stoppable(lambda i, x, s: model.velocity(x, s, text)), noise, sigmas)
        images = model.decode(latents)  # for the grids and the artefact measures, whatever the rewards score
        metadata = reward_metadata(ps, images)
        if on_images is not None:
            on_images(images)
        for label, _, reward in rewards:
            stop_point(every_process=False)
            scores[label].append(score(reward, latents if scores_latents(reward) else images, ps, metadata).scores)
        if rewards:  # (no rewards: a process that samples in lockstep only)
            for label, measure in ARTEFACT_MEASURES.items():
                scores[label].append(measure(images).cpu())
    return {label: torch.cat(v) for label, v in scores.items()}


def eval_metrics(scores: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean and standard error of the mean of each reward over the evaluation set."""
    out = {}
    for label, v in scores.items():
        out[f"eval/{label}/mean"] = v.mean().item()
        out[f"eval/{label}/sem"] = (v.std() / math.sqrt(v.numel())).item()
    return out


class RunEvaluator:
    """A training run's evaluation on its fixed set (see the module docstring); ``prompts``
    empty: the run does not evaluate."""

    def __init__(self, session, prompts: list[str], ctx, outputs, ema=None, lockstep: bool = False,
                 say: Callable[[str], None] | None = None):
        self.session, self.prompts, self.ctx, self.outputs = session, prompts, ctx, outputs
        self.ema = ema if session.recipe.ema.evaluate else None
        self.lockstep = lockstep  # FSDP2: the other processes make the same denoiser calls
        # every evaluation's warning signs, said above the progress bar as they appear (main process)
        self.signs = WarningSigns(outputs.run_dir, session.recipe, say if ctx.is_main else None) if prompts else None

    def due(self, iteration: int) -> bool:
        return bool(self.prompts) and iteration % self.session.recipe.log.eval_every == 0

    def __call__(self, iteration: int, final: bool = False) -> dict[str, float]:
        """``eval/<reward>/mean`` and ``/sem`` of the policy after ``iteration`` iterations
        (``{}`` on the other processes); writes the eval grids."""
        recipe, session = self.session.recipe, self.session
        batch = recipe.train.micro_batch_size * 4
        if self.ctx.enabled and not self.lockstep:  # ddp: every data rank evaluates its share
            share = evaluation_share(len(self.prompts) * recipe.prompts.eval_seeds, batch, self.ctx.rank,
                                     self.ctx.world_size)
            scores, images = self._gathered(share, batch)
            if not self.ctx.is_main:
                return {}
        elif not self.ctx.is_main:
            if self.lockstep:  # every forward of a sharded denoiser is a collective: sample alongside, unscored,
                # with this process's EMA shards swapped in too (else the gathered weights would mix EMA and live)
                with self.ema.swapped_in() if self.ema is not None else nullcontext():
                    evaluate(session.model, session.eval_sigmas, [], self.prompts, recipe.prompts.eval_seeds,
                             recipe.run.seed, session.cache, batch)
            return {}
        else:
            scores, images = self._scores(None, batch)
        self.outputs.write_eval_grids(iteration, self.prompts, images.float() / 255, scores, final)
        metrics = eval_metrics(scores)
        if self.signs is not None:
            self.signs({"iteration": iteration, **metrics})
        return metrics

    def _scores(self, batches, batch: int) -> tuple[dict, torch.Tensor]:
        """Scores of these batches (None: all), with the EMA weights when the recipe evaluates
        them, and the 8-bit images among the first :data:`EVAL_GRID_MAX` items (what the eval
        grids show)."""
        recipe, session = self.session.recipe, self.session
        images: list[torch.Tensor] = []
        item = 0 if not batches else batches[0] * batch  # the index of the next image kept

        def keep(x: torch.Tensor) -> None:  # as 8-bit images in CPU memory
            nonlocal item
            wanted = max(0, min(len(x), EVAL_GRID_MAX - item))
            if wanted:
                images.append((x[:wanted].detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu())
            item += len(x)

        with self.ema.swapped_in() if self.ema is not None else nullcontext():
            scores = evaluate(session.model, session.eval_sigmas, session.components.rewards, self.prompts,
                              recipe.prompts.eval_seeds, recipe.run.seed, session.cache, batch, on_images=keep,
                              batches=batches)
        return scores, (torch.cat(images) if images else torch.zeros(0, dtype=torch.uint8))

    def _gathered(self, share: range, batch: int) -> tuple[dict, torch.Tensor]:
        """This rank's share evaluated, then every rank's scores (and the images the grids show)
        gathered in item order. A stop asked during the share (its stop points are this process's
        own: the shares differ in length) is raised on every rank after the gather, which every
        rank reaches exactly once."""
        stopped, scores, images = False, {}, torch.zeros(0, dtype=torch.uint8)
        try:
            scores, images = self._scores(share, batch)
        except StopRequested:
            stopped = True
        parts = distributed.gather_objects((stopped, scores, images), self.ctx)
        if any(part[0] for part in parts):
            raise StopRequested
        labels = next(part[1] for part in parts if part[1]).keys()  # the first share is never empty
        gathered = {label: torch.cat([part[1][label] for part in parts if part[1]]) for label in labels}
        return gathered, torch.cat([part[2] for part in parts if len(part[2])])
