"""The chunk layout training uses, and the components that can move it.

The chunker names the sizes. A :class:`~flowrl.interfaces.ProfilingChunker` (``dynamics``)
first profiles the model with the training sampler; an
:class:`~flowrl.interfaces.AdaptiveChunker` re-profiles the current policy every
``reprofile_every`` iterations; a :class:`~flowrl.interfaces.CurveWeightedSelector` without a
profile of its own takes the chunker's L1rel curve (a :class:`~flowrl.interfaces.CurveSource`).
The sizes in use and the selector's curve are checkpointed, so a resumed run continues with them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import distributed
from ..errors import FlowrlError
from ..interfaces import AdaptiveChunker, CurveSource, CurveWeightedSelector, ProfilingChunker, trains_on_units


class ChunkLayout:
    """The chunk sizes in use (``sizes``, summing to T), broadcast from the main process."""

    def __init__(self, session, prompts: list[str], ctx, resumed: Path | None = None):
        self.session, self.prompts, self.ctx = session, prompts, ctx
        self.chunker = session.components.chunker
        self.selector = session.components.selector
        recipe, sampler = session.recipe, session.sampler
        if isinstance(self.chunker, ProfilingChunker) and self.chunker.needs_model:
            # A resumed run's start profile is in its directory: measuring it again (the same seed,
            # model and prompts give the same curve) would spend the forwards twice. Every process
            # takes the same branch: under FSDP2 the measuring forwards are collective.
            saved = resumed / "profile.json" if resumed is not None else None
            if distributed.broadcast_object(bool(saved and saved.is_file()), ctx):
                self.chunker.load_profile(saved)
            else:
                self.chunker.profile_at_start(session.encoding_model, sampler.sigmas, sampler.kernels, prompts,
                                              image_from=sampler.image_from, seed=recipe.run.seed)
        if not trains_on_units(session.components.loss):  # no units to lay out (DiffusionNFT)
            self.sizes = ()
            return
        try:
            self.sizes = distributed.broadcast_object(tuple(self.chunker.sizes(sampler.num_trainable)), ctx)
        except ValueError as exc:
            raise FlowrlError(f"{exc} (the sampler has T = {sampler.num_trainable} trainable transitions)",
                              where=f"{recipe.source}: [chunker]") from exc
        self.share_curve()

    def share_curve(self, refresh: bool = False) -> None:
        """Hand a curve-weighted selector without a profile of its own the chunker's L1rel."""
        selector, chunker = self.selector, self.chunker
        if not (isinstance(selector, CurveWeightedSelector) and isinstance(chunker, CurveSource)):
            return
        if selector.has_own_profile:
            return
        if selector.l1rel is None or refresh:
            selector.l1rel = chunker.l1rel(self.session.sampler.num_trainable)

    def reprofile_due(self, iteration: int) -> bool:
        """Adaptive chunking re-profiles every ``reprofile_every`` iterations (never at 0)."""
        every = self.chunker.reprofile_every if isinstance(self.chunker, AdaptiveChunker) else 0
        return bool(every) and iteration > 0 and iteration % every == 0

    def reprofile(self, iteration: int, console) -> dict:
        """Re-profile the current policy and move the boundaries; returns the metrics entry
        ``chunk_sizes_changed`` (empty when they did not move) and says so on the console."""
        sampler, seed, old = self.session.sampler, self.session.recipe.run.seed, self.sizes
        _, new = self.chunker.reprofile(self.session.encoding_model, sampler.sigmas, sampler.kernels, self.prompts,
                                        image_from=sampler.image_from, seed=seed)
        new = distributed.broadcast_object(tuple(new), self.ctx)
        self.chunker.set_sizes(new)
        self.share_curve(refresh=True)
        self.sizes = new
        if new == old:
            return {}
        if self.ctx.is_main:
            console.print(f"iteration {iteration}: chunk boundaries {list(old)} -> {list(new)}")
        return {"chunk_sizes_changed": {"from": list(old), "to": list(new)}}

    @property
    def selector_l1rel(self) -> list[float] | None:
        """The selector's curve in use (checkpointed), or None."""
        if not isinstance(self.selector, CurveWeightedSelector) or self.selector.l1rel is None:
            return None
        return [float(x) for x in self.selector.l1rel]

    def state_dict(self) -> dict:
        """The layout's entries of a checkpoint's ``state.json``: the chunk sizes in use and the
        selector's curve (both moved by re-profiling)."""
        return {"chunk_sizes": list(self.sizes), "selector_l1rel": self.selector_l1rel}

    def load_state_dict(self, state: dict) -> None:
        """Continue with the sizes and curve a checkpoint recorded (one written before adaptive
        chunking was checkpointed has neither: the layout stays as built)."""
        sizes, selector_l1rel = tuple(state.get("chunk_sizes", self.sizes)), state.get("selector_l1rel")
        if sizes != self.sizes:
            self.chunker.set_sizes(sizes)
            self.sizes = sizes
        if selector_l1rel is not None:
            self.selector.l1rel = torch.tensor(selector_l1rel, dtype=torch.float32)
