"""``embedded_clip``: a tiny CLIP trained contrastively on the embedded model's shapes grammar.

Why: the CLIP-family rewards (``pickscore``, ``clip`` with the transformers backend) load
multi-GB weights from the Hub. This small CLIPModel (about 0.4 M parameters, shipped in
``embedded_clip/`` beside this file) is trained offline on ``flowrl_plugins.embedded.dataset``
("a {colour} {shape} on a {colour} background", 32x32), so the real CLIP scoring code path
runs anywhere, in tests and on a laptop, with a score that means something: the cosine
similarity of an image and a prompt, high when the image shows what the prompt says.

It is registered as the reward ``embedded_clip`` (PickScore's code, default scale ``cosine``).
Retrain it with ``python scripts/train_embedded_clip.py --steps 3000`` (from a checkout); the
model card (``embedded_clip/MODEL_CARD.md``) records how it was trained and what it scores.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flowrl.config import param
from flowrl.errors import FlowrlError

from .clip import PickScale, PickScore, PickScoreConfig
from .common import PlacementConfig

WEIGHTS_DIR = Path(__file__).with_name("embedded_clip")


@dataclasses.dataclass(frozen=True)
class EmbeddedClipConfig(PlacementConfig):
    model: str = param("", "Directory of the CLIPModel + processor; empty = the one shipped in the package.", path=True)
    scale: PickScale = param("cosine", "Reported scale: 'cosine' (default), 'logit', 'logit/26', '(logit-18)/8' (see docs/rewards.md).")


class EmbeddedClip(PickScore):
    """A tiny CLIP trained on the embedded shapes grammar; cosine of image and prompt (offline)."""

    Config = EmbeddedClipConfig

    def __init__(self, config: EmbeddedClipConfig):
        directory = config.model or str(WEIGHTS_DIR)
        if not (Path(directory) / "model.safetensors").is_file():
            raise FlowrlError(f"no embedded CLIP weights in '{directory}'",
                              hint="retrain them: python scripts/train_embedded_clip.py (from a flowrl checkout)")
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(PlacementConfig)}
        PickScore.__init__(self, PickScoreConfig(model=directory, processor=directory, scale=config.scale, **fields))
        self.name = "embedded_clip"
