"""The embedded default as a flowrl plugin: model ``embedded`` and its offline rewards.

Registered through the ``flowrl`` entry-point group like any other plugin. The model is a tiny
pretrained FLUX transformer (diffusers ``FluxTransformer2DModel``) in pixel space, shipped as
safetensors inside the package; see MODEL_CARD.md beside this file.
"""

from __future__ import annotations

from flowrl import hookimpl

from . import rewards, video_rewards
from .adapter import EmbeddedConfig, PixelImageAdapter
from .compose import rewards as compose_rewards
from .compose.model import EmbeddedComposeModel
from .dataset import all_prompts
from .latent_verifier import LatentVerifier
from .network import EmbeddedT2I, load_pretrained
from .video_model import EmbeddedVideoModel


class EmbeddedModel(PixelImageAdapter):
    """The embedded tiny text-to-image model: 32x32 RGB, 16x16x12 latent packed to [64, 48] tokens."""

    Config = EmbeddedConfig
    network_class = EmbeddedT2I
    load = staticmethod(load_pretrained)

    def prompt_source(self):
        return all_prompts()


@hookimpl(trylast=True)
def register_models(register):
    register("embedded", EmbeddedModel)
    register("embedded_video", EmbeddedVideoModel)
    register("embedded_compose", EmbeddedComposeModel)


@hookimpl(trylast=True)
def register_rewards(register):
    register("verifier", rewards.verifier_score, help="Soft prompt-correctness (background, foreground colour, shape) in [0, 1].")
    register("area", rewards.foreground_area, help="Fraction of pixels not of the background colour (trades off against correctness).")
    register("brightness", rewards.brightness, help="Mean pixel brightness in [0, 1].")
    register("video_verifier", video_rewards.video_verifier,
             help="Video: soft correctness of the clip's colours, shape and motion direction in [0, 1] (embedded_video).")
    register("video_motion", video_rewards.video_motion,
             help="Video: how far the clip moves in the prompt's direction, in [0, 1] (embedded_video).")
    register("compose_geneval", compose_rewards.geneval_soft,
             help="GenEval's soft per-prompt score on the compositional world (embedded detector; embedded_compose).")
    register("compose_geneval_exact", compose_rewards.geneval_exact,
             help="Flow-GRPO's exact-count GenEval score on the compositional world: an extra object costs as much "
                  "as a missing one (embedded_compose; the compose recipes train on it).")
    register("compose_geneval_strict", compose_rewards.geneval_strict,
             help="GenEval's per-prompt verdict, 1 or 0, on the compositional world (embedded_compose).")
    register("latent_verifier", LatentVerifier,
             help="The verifier's score estimated from the embedded model's latents (no decode; a head trained offline).")


@hookimpl(trylast=True)
def default_component(kind):
    return "embedded" if kind == "model" else None
