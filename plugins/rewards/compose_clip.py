"""``compose_clip``: a tiny CLIP trained contrastively on the compositional world's prompts.

The compositional embedded world (GenEval's six categories: "a circle", "a circle and a square",
"three crosses", "a red triangle", "a circle left of a square", "a red triangle and a blue square";
464 prompts, 32x32 scenes on a grey background) is scored exactly by its GenEval rewards. This
reward is a learned judge beside them: a small CLIPModel (shipped in ``compose_clip/`` beside this
file) trained on ground-truth scenes of all 464 prompts, held-out ones included, so RL runs can log
how a CLIP-style reward sees their images (and how far it agrees with GenEval's verdict) without
downloading anything. Log it, do not optimise it: like any learned reward it can be exploited.

It is :class:`~flowrl_plugins.rewards.embedded_clip.EmbeddedClip` (PickScore's code path, default
scale ``cosine``) with other default weights. Retrain them with
``python scripts/train_compose_clip.py`` (from a checkout); the model card
(``compose_clip/MODEL_CARD.md``) records how they were trained and what they can and cannot tell apart.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flowrl.config import param
from flowrl.errors import FlowrlError

from .embedded_clip import EmbeddedClip, EmbeddedClipConfig

WEIGHTS_DIR = Path(__file__).with_name("compose_clip")


@dataclasses.dataclass(frozen=True)
class ComposeClipConfig(EmbeddedClipConfig):
    model: str = param("", "Directory of the CLIPModel + processor; empty = the compositional one shipped in "
                       "the package.", path=True)


class ComposeClip(EmbeddedClip):
    """A tiny CLIP trained on the compositional grammar; cosine of image and prompt (offline)."""

    Config = ComposeClipConfig

    def __init__(self, config: ComposeClipConfig):
        if not config.model and not (WEIGHTS_DIR / "model.safetensors").is_file():
            raise FlowrlError(f"no compositional CLIP weights in '{WEIGHTS_DIR}'",
                              hint="retrain them: python scripts/train_compose_clip.py (from a flowrl checkout)")
        super().__init__(dataclasses.replace(config, model=config.model or str(WEIGHTS_DIR)))
        self.name = "compose_clip"
