"""Overlapped rewards: decode and score rollout sub-batch i while sub-batch i + 1 samples.

The rollout runs in ``[sampler].batch_size`` sub-batches (:func:`flowrl.train.collect.sample`).
With ``[sampler].overlap_rewards = true`` each finished sub-batch is handed to
:class:`OverlappedScoring`, whose one background thread decodes its images and calls every
reward on them while the main thread samples the next sub-batch. What can run at the same time
as sampling: a reward served by another process (the ``http`` reward and ``flowrl reward
serve``), a reward on another device, and any torch work (torch releases the GIL inside its
kernels). At the end of the rollout the main thread waits for the last sub-batch only.

Guarantees (tests/train/test_engine_overlap.py):

- order: the scores of sub-batch i are placed at the rows of sub-batch i, whatever finishes
  first (one worker thread takes the sub-batches in order, so a reward is never called twice
  at once, and rewards need not be thread-safe);
- values: each reward is called on exactly the images of one sub-batch. The result equals
  scoring all images after the rollout bit for bit when the decoder and every reward score an
  image independently of the others in the same call (true of the built-in embedded model and
  its rewards on a CPU; a batched neural reward on a GPU may round differently by batch
  composition, as the rollout itself does with ``batch_size``);
- failures: a reward that raises stops the iteration with a :class:`RewardFailedError` naming
  the reward and the samples, as soon as the main thread next looks (after the sub-batch that
  is sampling, at the latest); the original exception is chained (``--debug`` shows it);
- stops: a run asked to stop (:mod:`flowrl.stop_points`) stops the thread before its next
  reward call, and the main thread's wait for the last sub-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import FlowrlError
from ..interfaces import scores_latents
from ..rewards import needs_images, score
from ..prompts import reward_metadata
from ..stop_points import carried, stop_point, wait_for


class RewardFailedError(FlowrlError):
    """A reward raised while scoring an iteration's images."""


def score_part(rewards, images: torch.Tensor | None, prompts: Sequence[str], samples: str = "", *,
               latents: torch.Tensor | None = None) -> tuple[dict, dict]:
    """Every reward of ``rewards`` (``(label, weight, reward)`` entries) in recipe order: a
    reward that scores latents (:class:`~flowrl.interfaces.ScoresLatents`) on ``latents``, any
    other on ``images`` (None when no reward needs them: nothing was decoded).
    ``({label: scores [n]}, {"label/extra": [n]})``. A reward that raises is reported as a
    :class:`RewardFailedError` naming it (``samples`` says which samples, for the message). A
    run may stop before each reward call (:mod:`flowrl.stop_points`)."""
    metadata = reward_metadata(prompts, images)  # condition images, when the prompts carry them
    scores: dict[str, torch.Tensor] = {}
    extras: dict[str, torch.Tensor] = {}
    for label, _, reward in rewards:
        stop_point()
        seen = latents if scores_latents(reward) else images
        try:
            if seen is None:
                raise ValueError(f"no {'latents' if scores_latents(reward) else 'images'} were given to score")
            out = score(reward, seen, prompts, metadata, name=label)
        except Exception as exc:  # re-raised below, naming the reward
            failure = reward_failed(label, exc, samples)
            if failure is exc:
                raise
            raise failure from exc
        scores[label] = out.scores
        extras.update({f"{label}/{k}": v.reshape(-1) for k, v in sorted(out.extras.items())})
    return scores, extras


def reward_failed(label: str, exc: BaseException, samples: str = "") -> FlowrlError:
    """The one message for a reward that raised: its name, the samples, the cause. A flowrl
    error keeps its type and hint (a ``RewardServerError`` stays one) with the reward's name
    added; any other exception becomes a :class:`RewardFailedError`."""
    where = samples or None
    if isinstance(exc, FlowrlError):
        if f"reward '{label}'" in exc.message:
            return exc
        try:
            return type(exc)(f"reward '{label}' failed: {exc.message}", where=exc.where or where, hint=exc.hint)
        except TypeError:  # a subclass with another signature
            return RewardFailedError(f"reward '{label}' failed: {exc.message}", where=exc.where or where, hint=exc.hint)
    return RewardFailedError(f"reward '{label}' failed: {type(exc).__name__}: {exc}", where=where,
                             hint="the reward itself raised; rerun with --debug for its traceback")


class OverlappedScoring:
    """Decode and score sub-batches in one background thread, in submission order.

    ``submit(image_latents, prompts)`` after each sub-batch's rollout (it first re-raises the
    failure of an earlier sub-batch, if any), then ``gather()`` for ``(images, rewards,
    reward_extras)`` over all sub-batches, concatenated in order. Use as a context manager: on
    the way out, sub-batches not yet started are cancelled and the thread is joined.
    """

    def __init__(self, model, rewards, *, iteration: int | None = None, decode: bool | None = None):
        self.model = model
        self.rewards = list(rewards)
        #: decode each sub-batch (default: when a reward scores images); False hands latents only
        self.decode = needs_images(self.rewards) if decode is None else decode
        self.iteration = iteration
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-rewards")
        self._futures: list[Future] = []
        self._rows = 0

    def __enter__(self) -> OverlappedScoring:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, image_latents: torch.Tensor, prompts: Sequence[str]) -> None:
        self.check()
        first, self._rows = self._rows, self._rows + len(prompts)
        what = f"samples {first}-{self._rows - 1} of this process" + (
            f", iteration {self.iteration}" if self.iteration is not None else "")
        self._futures.append(self._pool.submit(carried(self._decode_and_score), image_latents, list(prompts), what))

    def check(self) -> None:
        """Raise the failure of a finished sub-batch now (do not wait for the end of the rollout)."""
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def _decode_and_score(self, image_latents, prompts, what):
        images = None
        if self.decode:  # rewards that all score latents need no decode
            with torch.no_grad():
                images = self.model.decode(image_latents)
        scores, extras = score_part(self.rewards, images, prompts, what, latents=image_latents)
        return images, scores, extras

    def gather(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Wait for every sub-batch; ``(images, rewards, reward_extras)`` in sample order."""
        parts = [wait_for(f) for f in self._futures]  # the first failure, in order, raises here
        if not parts:
            raise ValueError("gather() before any submit(): nothing was sampled")
        images = None if parts[0][0] is None else torch.cat([p[0] for p in parts])
        scores = {k: torch.cat([p[1][k] for p in parts]) for k in parts[0][1]}
        extras = {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]}
        return images, scores, extras
