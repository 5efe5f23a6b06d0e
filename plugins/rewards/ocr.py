"""``ocr``: how well an image writes the text its prompt quotes (Flow-GRPO's OCR reward).

RapidOCR (``rapidocr-onnxruntime``, extra ``ocr``: PaddleOCR's PP-OCRv4 detection and recognition
models in ONNX, shipped inside the wheel, so it runs offline) reads the image; the score compares
what it read with the prompt's quoted text. The rule, exactly:

1. **Target.** The text between double quotes in the prompt (ASCII ``"..."`` or typographic
   ``“...”``). Several quoted spans are joined with a space in the order they appear
   (``a sign "OPEN" above "24 h"`` -> ``OPEN 24 h``). A prompt with no quoted span, or whose
   quoted text is only whitespace, cannot be scored: the call raises a :class:`FlowrlError`
   naming the prompt before any image is read (training on it would silently reward nothing),
   and ``flowrl validate`` refuses a prompt file holding such a prompt (``accepts_prompt``).
2. **Recognised text.** The text of every box RapidOCR reads with a recognition confidence of at
   least ``text_score`` (0.5), the boxes joined in reading order (:func:`reading_order`: lines
   top to bottom, a box joining a line when its vertical centre lies within the line's first
   box; boxes left to right within a line). An image where nothing is read gives ``""``.
3. **Normalisation.** Both texts are case-folded (``str.casefold``) and every whitespace
   character is removed (:func:`normalise_text`).
4. **Score** (:func:`text_reward`), with ``t`` the normalised target and ``r`` the normalised
   recognised text: with ``match = "contains"`` (default, Flow-GRPO's rule) 1 when ``t`` occurs in
   ``r``; otherwise ``1 - min(d, len(t)) / len(t)``, ``d`` the Levenshtein edit distance between
   ``r`` and ``t`` (insertions, deletions and substitutions of one character each cost 1). The
   score is in [0, 1]; a blank image scores 0. With ``match = "exact"`` the containment shortcut
   is skipped, so text in the image beyond the target costs as insertions.

Where this differs from Flow-GRPO (``flow_grpo/ocr.py``, ``OcrScorer``, and ``ocr_score`` in
``flow_grpo/rewards.py``):

- the engine: Flow-GRPO runs PaddleOCR (``lang="en"``, no angle classifier, PaddlePaddle); we run
  RapidOCR's ONNX export of PP-OCRv4 (its recognition model reads Chinese and English) on ONNX
  Runtime, also without the angle classifier unless ``angle_classifier = true``. Both drop boxes
  whose recognition confidence is below 0.5 (PaddleOCR's ``drop_score``, RapidOCR's
  ``text_score``) and both order boxes top to bottom, left to right (PaddleOCR by the boxes'
  top-left corners with a 10-pixel line tolerance; we by line as in step 2).
- the target: Flow-GRPO takes ``prompt.split('"')[1]``, the first quoted span only (a prompt
  without a quote raises ``IndexError``); we join every quoted span and say which prompt is wrong.
- normalisation: Flow-GRPO removes spaces (``" "`` only) and lower-cases (``str.lower``); we remove
  all whitespace and case-fold (``"STRASSE"`` matches ``"straße"``).
- errors: Flow-GRPO scores an image 0 when OCR raises; we let the error through (a reward never
  returns a made-up score).
- colours: Flow-GRPO hands PaddleOCR the RGB array, which PaddleOCR reads as BGR; we convert to
  BGR first.

Images are ``[B, 3, H, W]`` floats in [0, 1] (as every reward gets them), quantised to 8 bits as
Flow-GRPO does (``round(255 x)``); each image is read on its own (RapidOCR batches an image's text
boxes), so the scores do not depend on the batch. ``device = "auto"`` uses ONNX Runtime's CUDA
provider when ``onnxruntime-gpu`` is installed and a GPU is visible, else the CPU.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

import torch

from flowrl.config import param
from flowrl.errors import FlowrlError, MissingDependencyError, require
from flowrl.interfaces import RewardOutput

from .common import check_images

WHO = "ocr"
#: A quoted span: ASCII double quotes, or typographic ones.
QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
PROMPT_HINT = 'quote the text the image should show, e.g. a shop sign that says "OPEN"'


@dataclasses.dataclass(frozen=True)
class OcrConfig:
    device: str = param("auto", "Where ONNX Runtime runs the OCR models: 'auto' (its CUDA provider when onnxruntime-gpu "
                                "is installed and a GPU is visible, else the CPU), 'cpu', 'cuda' or 'cuda:N'.")
    threads: int = param(0, "CPU threads of each ONNX Runtime session (intra-op); 0, or more than the machine's "
                            "CPUs: ONNX Runtime's default (one per physical core).", min=0, max=1024)
    match: Literal["contains", "exact"] = param(
        "contains", "'contains' (Flow-GRPO's rule): the quoted text found anywhere in the recognised text scores 1, "
                    "other text in the image costs nothing; 'exact': always 1 - edit distance / target length, so "
                    "extra text costs too.")
    text_score: float = param(0.5, "Drop recognised boxes whose recognition confidence is below this (RapidOCR's and "
                                   "PaddleOCR's 0.5).", min=0.0, max=1.0)
    angle_classifier: bool = param(False, "Run RapidOCR's text-angle classifier (reads text turned upside down); "
                                          "Flow-GRPO runs without it.")

    def __post_init__(self):
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"unknown device {self.device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")


# ----------------------------------------------------------------------------- the rule (pure)


def quoted_target(prompt: str) -> str:
    """The text a prompt quotes: every quoted span, joined with a space (module doc, step 1).
    ``ValueError`` for a prompt that quotes no text; it is also the reward's ``accepts_prompt``,
    which ``flowrl validate`` runs over a recipe's prompt files."""
    spans = [m.group(1) if m.group(1) is not None else m.group(2) for m in QUOTED.finditer(str(prompt))]
    if not spans:
        raise ValueError("it quotes no text: the 'ocr' reward reads the text between double quotes")
    target = " ".join(spans)
    if not normalise_text(target):
        raise ValueError("its quoted text is empty: the 'ocr' reward reads the text between double quotes")
    return target


def normalise_text(text: str) -> str:
    """Case-folded, every whitespace character removed."""
    return "".join(str(text).casefold().split())


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest one-character insertions, deletions and substitutions
    that turn ``a`` into ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def text_reward(recognised: str, target: str, match: str = "contains") -> float:
    """The score of ``recognised`` text against ``target`` (module doc, steps 3 and 4)."""
    t, r = normalise_text(target), normalise_text(recognised)
    if not t:
        raise ValueError("the target text is empty")
    if match == "contains" and t in r:
        return 1.0
    return 1.0 - min(edit_distance(r, t), len(t)) / len(t)


def reading_order(boxes: Sequence[Sequence[Sequence[float]]]) -> list[int]:
    """Indices of text ``boxes`` (each a list of ``(x, y)`` corners, y down) in reading order:
    lines top to bottom, a box joining the current line when its vertical centre lies between the
    top and bottom of the line's first box; left to right within a line."""
    spans = [(min(y for _, y in box), max(y for _, y in box), min(x for x, _ in box)) for box in boxes]
    lines: list[list[int]] = []
    for i in sorted(range(len(spans)), key=lambda i: (spans[i][0], spans[i][2])):
        top, bottom, _ = spans[i]
        if lines and spans[lines[-1][0]][0] <= (top + bottom) / 2 <= spans[lines[-1][0]][1]:
            lines[-1].append(i)
        else:
            lines.append([i])
    return [i for line in lines for i in sorted(line, key=lambda i: spans[i][2])]


# ----------------------------------------------------------------------------- the engine


def resolve_provider(device: str, available: Sequence[str]) -> int | None:
    """The CUDA device ONNX Runtime should use for ``device``, or None for the CPU."""
    has_cuda = CUDA_PROVIDER in available
    if device == "cpu":
        return None
    if device == "auto":
        return torch.cuda.current_device() if has_cuda and torch.cuda.is_available() else None
    if not has_cuda:
        raise FlowrlError(
            f"device '{device}' needs ONNX Runtime's CUDA provider; this onnxruntime offers {', '.join(available)}",
            where=f"reward '{WHO}'",
            hint="install the GPU build (pip uninstall onnxruntime; pip install onnxruntime-gpu, built for this "
                 "machine's CUDA), or use device = 'auto' or 'cpu'")
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _sessions(engine) -> list:
    """The ONNX Runtime sessions of a RapidOCR engine (detection, angle classifier, recognition)."""
    found = [getattr(getattr(engine, "text_det", None), "infer", None),
             getattr(getattr(engine, "text_cls", None), "infer", None),
             getattr(getattr(engine, "text_rec", None), "session", None)]
    return [s.session for s in found if s is not None and hasattr(s, "session")]


def import_rapidocr():
    """``(rapidocr_onnxruntime, onnxruntime)``; one FlowrlError when the extra is not installed, or
    when it is but cannot load (OpenCV's wheel needs the system's libGL.so.1 and GLib)."""
    purpose = f"the '{WHO}' reward"
    try:
        return require("rapidocr_onnxruntime", extra="ocr", purpose=purpose), require("onnxruntime", extra="ocr",
                                                                                      purpose=purpose)
    except MissingDependencyError as exc:
        cause = exc.__cause__
        if not isinstance(cause, ImportError) or isinstance(cause, ModuleNotFoundError):
            raise  # not installed: the message names the extra
        raise FlowrlError(f"{purpose}'s packages are installed but cannot load: {cause}", where=f"reward '{WHO}'",
                          hint="a missing system library is the usual cause: OpenCV needs libGL.so.1 and GLib "
                               "(Debian/Ubuntu: apt-get install libgl1 libglib2.0-0), or replace opencv-python "
                               "with opencv-python-headless") from exc


def load_engine(config: OcrConfig):
    """A RapidOCR engine placed as ``config`` says, and the providers its sessions run on."""
    rapidocr, ort = import_rapidocr()
    gpu = resolve_provider(config.device, ort.get_available_providers())
    options = {"text_score": config.text_score, "print_verbose": False}
    if config.threads:
        options.update(intra_op_num_threads=config.threads, inter_op_num_threads=1)
    if gpu is not None:
        options.update(det_use_cuda=True, cls_use_cuda=True, rec_use_cuda=True)
    engine = rapidocr.RapidOCR(**options)
    sessions = _sessions(engine)
    if gpu:  # RapidOCR always asks for device 0
        for session in sessions:
            session.set_providers([CUDA_PROVIDER, CPU_PROVIDER], [{"device_id": gpu}, {}])
    providers = sessions[0].get_providers() if sessions else []
    if gpu is not None and config.device != "auto" and providers[:1] != [CUDA_PROVIDER]:
        raise FlowrlError(f"ONNX Runtime could not start its CUDA provider on device '{config.device}' "
                          f"(the sessions run on {', '.join(providers)})", where=f"reward '{WHO}'",
                          hint="check that onnxruntime-gpu matches this machine's CUDA and cuDNN, or use device = 'cpu'")
    return engine, providers


class Ocr:
    """How well an image writes its prompt's quoted text: 1 - normalised edit distance (Flow-GRPO)."""

    Config = OcrConfig
    accepts_prompt = staticmethod(quoted_target)  # flowrl.hookspecs: `flowrl validate` checks prompt files

    def __init__(self, config: OcrConfig):
        self.config = config
        self.name = WHO
        self.engine, self.providers = load_engine(config)

    def targets(self, prompts: Sequence[str]) -> list[str]:
        """Every prompt's quoted text, or one FlowrlError naming the first prompt without any."""
        out = []
        for prompt in prompts:
            try:
                out.append(quoted_target(prompt))
            except ValueError as exc:
                raise FlowrlError(f"cannot score the prompt {str(prompt)!r}: {exc}", where=f"reward '{WHO}'",
                                  hint=PROMPT_HINT) from exc
        return out

    def read(self, images: torch.Tensor) -> list[str]:
        """The text of each image ``[B, 3, H, W]`` in [0, 1]: its boxes in reading order, joined by spaces."""
        pixels = images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8)
        bgr = pixels.flip(1).permute(0, 2, 3, 1).contiguous().cpu().numpy()  # RapidOCR reads arrays as BGR
        texts = []
        for image in bgr:
            result, _ = self.engine(image, use_det=True, use_cls=self.config.angle_classifier, use_rec=True)
            result = result or []
            texts.append(" ".join(result[i][1] for i in reading_order([r[0] for r in result])))
        return texts

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        prompts = list(prompts)
        check_images(images, prompts, WHO)
        targets = self.targets(prompts)  # every prompt first: no image is read for a bad call
        with torch.no_grad():
            texts = self.read(images)
        scores = [text_reward(text, target, self.config.match) for text, target in zip(texts, targets)]
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32))
