"""Built-in model-backed rewards, registered as an ordinary flowrl plugin.

- ``pickscore``: PickScore (transformers CLIPModel), extra ``rewards``.
- ``clip``: CLIP similarity, open_clip (extra ``clip``) or transformers backend.
- ``embedded_clip``: a tiny CLIP trained on the embedded shapes grammar, shipped; runs offline.
- ``hpsv3``: HPSv3 (Qwen2-VL reward model) natively on transformers >= 4.52.
- ``hpsv3_upstream``: the upstream ``hpsv3`` package, for its own environment behind ``http``.
- ``http``: any reward served by ``flowrl reward serve`` in another process or environment.

Every module here imports its heavy dependencies only when a reward is built, so listing the
plugins (``flowrl plugins``) stays fast and needs none of the extras. Docs: docs/rewards.md.
"""

from __future__ import annotations

from flowrl import hookimpl


def _pickscore(config):
    from .clip import PickScore

    return PickScore(config)


def _clip(config):
    from .clip import Clip

    return Clip(config)


def _embedded_clip(config):
    from .embedded_clip import EmbeddedClip

    return EmbeddedClip(config)


def _hpsv3(config):
    from .hpsv3 import HPSv3

    return HPSv3(config)


def _hpsv3_upstream(config):
    from .hpsv3_upstream import HPSv3Upstream

    return HPSv3Upstream(config)


def _http(config):
    from .http import HttpReward

    return HttpReward(config)


@hookimpl(trylast=True)
def register_rewards(register):
    # The config modules import only torch and flowrl; transformers/open_clip load in the factories.
    from .clip import ClipConfig, PickScoreConfig
    from .embedded_clip import EmbeddedClipConfig
    from .hpsv3 import HPSv3Config
    from .hpsv3_upstream import HPSv3UpstreamConfig
    from .http import HttpRewardConfig

    register("pickscore", _pickscore, params=PickScoreConfig,
             help="PickScore human-preference score (CLIP-H, transformers); needs flowrl[rewards].")
    register("clip", _clip, params=ClipConfig,
             help="CLIP image-text similarity: open_clip (flowrl[clip]) or transformers backend.")
    register("embedded_clip", _embedded_clip, params=EmbeddedClipConfig,
             help="A tiny CLIP trained on the embedded shapes grammar (offline, shipped): image-prompt cosine.")
    register("hpsv3", _hpsv3, params=HPSv3Config,
             help="HPSv3 human preference (Qwen2-VL reward model, mu), native on transformers >= 4.52.")
    register("hpsv3_upstream", _hpsv3_upstream, params=HPSv3UpstreamConfig,
             help="The upstream hpsv3 package (its own transformers 4.45 env): serve it over HTTP.")
    register("http", _http, params=HttpRewardConfig,
             help="A reward served over HTTP by `flowrl reward serve` (own env/GPU); errors, never defaults.")
