"""Built-in model-backed rewards, registered as an ordinary flowrl plugin.

- ``pickscore``: PickScore (transformers CLIPModel), extra ``rewards``.
- ``clip``: CLIP similarity, open_clip (extra ``clip``) or transformers backend.
- ``embedded_clip``: a tiny CLIP trained on the embedded shapes grammar, shipped; runs offline.
- ``compose_clip``: a tiny CLIP trained on the compositional world's grammar, shipped; a judge to log.
- ``geneval``: GenEval's rules on real images (OWLv2 detector + CLIP colours, local weights).
- ``ocr``: how well an image writes the text its prompt quotes (RapidOCR, Flow-GRPO's rule), extra ``ocr``.
- ``hpsv3``: HPSv3 (Qwen2-VL reward model) natively on transformers >= 4.52.
- ``hpsv3_upstream``: the upstream ``hpsv3`` package, for its own environment behind ``http``.
- ``http``: any reward served by ``flowrl reward serve`` in another process or environment.
- ``condition_fidelity``: image editing, how close the result stays to its condition image.
- ``temporal_consistency``: video, how steady a clip is from frame to frame (no weights).
- ``video_align``: video, VideoReward (VideoAlign's Qwen2-VL-2B reward model) on whole clips.
- ``vlm_judge``: a VLM judge (UnifiedReward-style) asked about each image: P(Yes) or a parsed score,
  a local checkpoint (transformers) or an OpenAI-compatible server (vLLM, SGLang).

Every module here imports its heavy dependencies (transformers, open_clip, rapidocr) only when a reward
is built, so listing the plugins (``flowrl plugins``) stays fast and needs none of the extras. Docs: docs/rewards.md.
"""

from __future__ import annotations

from flowrl import hookimpl

from .clip import Clip, PickScore
from .compose_clip import ComposeClip
from .condition import ConditionFidelity
from .embedded_clip import EmbeddedClip
from .geneval import GenEval
from .hpsv3 import HPSv3
from .hpsv3_upstream import HPSv3Upstream
from .http import HttpReward
from .ocr import Ocr
from .temporal import TemporalConsistency
from .video_align import VideoAlign
from .vlm_judge import VlmJudge


@hookimpl(trylast=True)
def register_rewards(register):
    register("pickscore", PickScore,
             help="PickScore human-preference score (CLIP-H, transformers); needs flowrl-diffusion[rewards].")
    register("clip", Clip,
             help="CLIP image-text similarity: open_clip (flowrl-diffusion[clip]) or transformers backend.")
    register("embedded_clip", EmbeddedClip,
             help="A tiny CLIP trained on the embedded shapes grammar (offline, shipped): image-prompt cosine.")
    register("compose_clip", ComposeClip,
             help="A tiny CLIP trained on the compositional (GenEval-style) grammar (offline, shipped): log it.")
    register("geneval", GenEval,
             help="GenEval's rules on real images: OWLv2 detections + CLIP colours vs the prompt's metadata (local weights).")
    register("ocr", Ocr,
             help="Text the prompt quotes vs the text OCR reads (RapidOCR): 1 - edit distance / length; flowrl-diffusion[ocr].")
    register("hpsv3", HPSv3,
             help="HPSv3 human preference (Qwen2-VL reward model, mu), native on transformers >= 4.52.")
    register("hpsv3_upstream", HPSv3Upstream,
             help="The upstream hpsv3 package (its own transformers 4.45 env): serve it over HTTP.")
    register("condition_fidelity", ConditionFidelity,
             help="Image editing: 1 - mean |image - condition image| at low resolution (reads rewards' metadata).")
    register("temporal_consistency", TemporalConsistency,
             help="Video: frame-to-frame consistency of a clip in [0, 1] (colour histograms, blind to motion; or pixels).")
    register("video_align", VideoAlign,
             help="Video: VideoReward (VideoAlign, Qwen2-VL-2B) on whole clips: VQ, MQ, TA or overall; flowrl-diffusion[rewards].")
    register("vlm_judge", VlmJudge,
             help="A VLM judge (UnifiedReward-style): P(Yes) or a parsed score; local transformers or an OpenAI-compatible server.")
    register("http", HttpReward,
             help="A reward served over HTTP by `flowrl reward serve` (own env/GPU); errors, never defaults.")
