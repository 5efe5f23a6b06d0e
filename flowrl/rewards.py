"""Calling a reward and checking what it returns: the one place that does either.

:func:`score` calls any :class:`flowrl.interfaces.Reward` and holds it to the contract (one float
score per image, extras of one number per image); the training loop, the evaluation, the reward
servers, ``flowrl eval`` and the conformance checks all score through it.
:class:`FunctionReward` makes a plain function a reward (``register("name", fn)``). The protocol
and its :class:`~flowrl.interfaces.RewardOutput` stay in :mod:`flowrl.interfaces`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .errors import FlowrlError
from .interfaces import Reward, RewardOutput, ScoresClips, scores_latents
from .video import aggregate_frames, is_clip

__all__ = ["FunctionReward", "PerFrameReward", "RewardOutputError", "for_clips", "needs_images", "score"]


class FunctionReward:
    """A plain function ``fn(images, prompts, **kwargs) -> Tensor[B]`` as a :class:`Reward`."""

    def __init__(self, fn: Callable[..., torch.Tensor], *, name: str, kwargs: Mapping[str, Any] | None = None):
        self.fn = fn
        self.name = name
        self.kwargs = dict(kwargs or {})

        # a function may declare that it scores whole clips (``fn.scores_clips = True``), as a
        # class declares it with an attribute (flowrl.interfaces.ScoresClips)
        if getattr(fn, "scores_clips", False):
            self.scores_clips = True
        # ... or that it scores the model's latents (flowrl.interfaces.ScoresLatents)
        if getattr(fn, "scores_latents", False):
            self.scores_latents = True

    def __call__(self, images, prompts, metadata=None):
        """A tensor result as a :class:`RewardOutput`, unchanged (no reshaping or conversion);
        any other result as it is, for :func:`score` to check."""
        with torch.no_grad():
            out = self.fn(images, list(prompts), **self.kwargs)
        return RewardOutput(scores=out) if isinstance(out, torch.Tensor) else out


class RewardOutputError(FlowrlError, ValueError):
    """A reward returned something other than ``[B]`` float scores (see :func:`score`)."""


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} element(s)"
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")


def score(reward: Reward, images: torch.Tensor, prompts: Sequence[str], metadata=None, *, name: str | None = None) -> RewardOutput:
    """Call a reward and check its output; the ONE rule for every reward:

    it returns a :class:`RewardOutput` or a tensor whose scores are a floating-point tensor of
    shape exactly ``[B]`` (one score per image; non-finite values are allowed and handled by the
    engine), and every extra is ``[B]`` too. Anything else (a list, a numpy array, ``[B, 1]``,
    integers) raises :class:`RewardOutputError` naming the reward (``name``, else its ``name``
    attribute) and what it returned. Returns float32 scores on the CPU."""
    out = reward(images, prompts, metadata)
    label = name or getattr(reward, "name", None) or type(reward).__name__
    b = images.shape[0]
    scores = out.scores if isinstance(out, RewardOutput) else out
    what = "scores" if isinstance(out, RewardOutput) else "output"
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or tuple(scores.shape) != (b,):
        raise RewardOutputError(
            f"reward '{label}' returned {_describe(scores)} as its {what} for {b} images; "
            f"a reward must return a float tensor of shape [{b}] (one score per image) or a RewardOutput of one",
            where=f"reward '{label}'",
            hint="e.g. `return torch.as_tensor(values, dtype=torch.float32)`; images arrive as [B, 3, H, W] "
                 "floats in [0, 1] with a list of B prompts (README, 'Writing a plugin')",
        )
    extras = {}
    for key, v in out.extras.items() if isinstance(out, RewardOutput) else ():
        if not isinstance(v, torch.Tensor) or v.numel() != b:
            raise RewardOutputError(f"reward '{label}' returned extra '{key}' as {_describe(v)} for {b} images",
                                    where=f"reward '{label}'", hint=f"every extra holds one number per image: shape [{b}]")
        extras[key] = v.detach().float().reshape(-1).cpu()
    return RewardOutput(scores=scores.detach().to(torch.float32).cpu(), extras=extras)


class PerFrameReward:
    """An image reward scoring clips ``[B, F, 3, H, W]``: every frame is scored as an image (the
    clip's prompt with each), and the per-frame scores, and each extra, become one number per
    clip by ``aggregation`` (:data:`flowrl.video.FRAME_AGGREGATIONS`). Images ``[B, 3, H, W]``
    go to the reward unchanged, so an image run scores exactly as before."""

    def __init__(self, reward: Reward, aggregation: str = "mean"):
        self.reward = reward
        self.aggregation = aggregation
        self.name = getattr(reward, "name", type(reward).__name__)

    def __call__(self, images, prompts, metadata=None):
        if not is_clip(images):
            return self.reward(images, prompts, metadata)
        b, f = images.shape[:2]
        frame_prompts = [p for p in prompts for _ in range(f)]  # clip-major, as flatten(0, 1) orders the frames
        out = score(self.reward, images.flatten(0, 1), frame_prompts, _per_frame_metadata(metadata, f), name=self.name)
        return RewardOutput(scores=aggregate_frames(out.scores.view(b, f), self.aggregation),
                            extras={k: aggregate_frames(v.view(b, f), self.aggregation) for k, v in out.extras.items()})


def _per_frame_metadata(metadata, frames: int):
    """Each clip's metadata repeated for its frames (per-item lists and tensors; other values as they are)."""
    if not metadata:
        return metadata
    out = {}
    for k, v in metadata.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.repeat_interleave(frames, dim=0)
        elif isinstance(v, (list, tuple)):
            out[k] = [x for x in v for _ in range(frames)]
        else:
            out[k] = v
    return out


def for_clips(reward: Reward, aggregation: str = "mean") -> Reward:
    """``reward`` as a recipe's ``[[rewards]]`` entry uses it: a reward that declares
    :class:`~flowrl.interfaces.ScoresClips` as it is, any other wrapped in :class:`PerFrameReward`
    (which hands images through untouched). A reward that scores latents is never wrapped: it
    never sees frames."""
    if scores_latents(reward) or (isinstance(reward, ScoresClips) and reward.scores_clips):
        return reward
    return PerFrameReward(reward, aggregation)


def needs_images(rewards) -> bool:
    """Whether any of ``rewards`` (``(label, weight, reward)`` entries) scores decoded images,
    i.e. whether scoring them needs a decode."""
    return any(not scores_latents(reward) for _, _, reward in rewards)
