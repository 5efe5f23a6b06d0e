"""``geneval``: GenEval's object-focused reward on real images, with an open-vocabulary detector.

GenEval (Ghosh et al., 2023; ``djghosh13/geneval``) checks a prompt's requirements (objects,
counts, colours, positions) with an object detector and a CLIP colour classifier. The rules live
in :mod:`flowrl.geneval` (selection, positions, verdict, partial score); this reward feeds them
with detections of real images:

1. **Metadata.** The prompt's requirements come from a GenEval-format JSONL file (``metadata``,
   e.g. GenEval's ``prompts/evaluation_metadata.jsonl``), looked up by the prompt's text with its
   whitespace normalised. A prompt not in the file is a ``ValueError`` naming it, raised before
   any model runs.
2. **Detection.** OWLv2 (transformers ``Owlv2ForObjectDetection``, from the local directory
   ``detector``) with the text queries ``"a photo of a {class}"`` for every class the prompt's
   metadata names (``include`` and ``exclude``), or with ``vocabulary = "metadata"`` for every
   class of the whole file. The image tower runs once per batch; each distinct query is embedded
   once per call. As transformers' ``post_process_object_detection`` does, each of OWLv2's boxes
   (one per image patch) gets the query with the highest logit as its label and the sigmoid of
   that logit as its score; boxes are corners in pixels of the image (OWLv2 predicts them on the
   image padded to a square at the bottom and right, so they are scaled by the longer side).
3. **Selection** is GenEval's, by :func:`flowrl.geneval.select_objects`: score above 0.3 (0.9
   for counting prompts), at most 16 per class, then suppression at ``nms_threshold`` (GenEval's
   1.0: none). Boxes at or below the lower of the two thresholds are dropped before any Python
   object is made for them: they can never be selected.
4. **Colour**, as GenEval does, only where a requirement names one, and only for the objects the
   rules look at (the ``count`` best of the class): each object is cropped by
   :func:`grey_masked_crop` and classified zero-shot by a CLIP model (transformers ``CLIPModel``,
   local directory ``clip``) among GenEval's ten colours (:data:`flowrl.geneval.COLOURS`), each
   colour's text embedding the normalised mean of GenEval's three templates ``"a photo of a {c}
   {class}"``, ``"a photo of a {c}-colored {class}"``, ``"a photo of a {c} object"``.
5. **Score**: :func:`flowrl.geneval.score_prompt`; ``mode = "soft"`` (default) reports
   ``PromptScore.soft``, ``"exact"`` Flow-GRPO's exact-count training score ``PromptScore.exact``
   (what Flow-GRPO trains on; soft's "at least" rewards extra objects), ``"strict"`` GenEval's
   verdict as 1.0 / 0.0. All three are logged as the extras ``soft``, ``exact`` and ``strict``.

Images stay tensors: OWLv2's preprocessing (pad to a square, Gaussian anti-aliasing when
shrinking, bilinear resize, CLIP normalisation) and the colour crops' CLIP preprocessing run in
torch on the reward's device.

Where this differs from GenEval (docs/rewards.md, "geneval"):

- the detector: GenEval runs Mask2Former (Swin-S, COCO's 80 classes, closed vocabulary); we run
  OWLv2, open vocabulary, over the prompt's classes only by default. The thresholds 0.3 / 0.9 are
  GenEval's, set for Mask2Former's scores; OWLv2's sigmoid scores are calibrated differently
  (its confident detections are often below 0.9), so counting prompts are harder to pass.
- the colour crop: GenEval composites the image over grey #999 through the object's
  *segmentation mask*, then crops to its box, so the background inside the box is grey. OWLv2
  gives boxes only: the mask is the box, so the crop keeps the background inside the box, and the
  grey shows only where a box reaches beyond the image (PIL's crop would make that black).
- CLIP: GenEval uses open_clip's ViT-L-14 (OpenAI weights); we load a transformers CLIPModel
  (``openai/clip-vit-large-patch14`` holds the same weights) and resize crops in torch.
- non-square images are padded with grey 0.5, as OWLv2's original code (and transformers 4.x)
  does; transformers 5's image processor pads with black.

``accepts_prompt`` (``flowrl validate``'s check of prompt files, :mod:`flowrl.hookspecs`) is not
provided: it is a static attribute of the factory called with the prompt alone, while the prompts
this reward can score depend on its ``metadata`` parameter. The check happens at the first call
instead, on all the call's prompts before any model runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from flowrl import geneval
from flowrl.compat import ensure_torchvision_importable
from flowrl.config import param
from flowrl.errors import FlowrlError, require

from .clip import OPENAI_MEAN, OPENAI_STD, ImageGeometry, geometry_from_hf
from .common import ModelReward, PlacementConfig, features, normalise

WHO = "geneval"
#: GenEval's background for colour crops, #999.
GREY = 0x99 / 255
#: OWLv2's padding of non-square images (its original code; transformers 4.x).
OWL_PAD = 0.5
#: The detector's text query for a class.
QUERY = "a photo of a {}"
#: GenEval's colour prompts (``evaluate_images.py``, ``color_classification``).
COLOUR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
#: A box scoring at or below this can never be selected (the lower of GenEval's two thresholds).
SCORE_FLOOR = min(geneval.THRESHOLD, geneval.COUNTING_THRESHOLD)

DETECTOR_HINT = ("download an OWLv2 checkpoint yourself, e.g. `hf download google/owlv2-base-patch16-ensemble "
                 "--local-dir models/owlv2`, and set detector = \"models/owlv2\"")
CLIP_HINT = ("download a CLIP model yourself, e.g. `hf download openai/clip-vit-large-patch14 --local-dir "
             "models/clip-vit-large-patch14` (the ViT-L/14 GenEval uses), and set "
             "clip = \"models/clip-vit-large-patch14\"")
METADATA_HINT = ("use GenEval's prompts/evaluation_metadata.jsonl (github.com/djghosh13/geneval) or a file in its "
                 "format: one JSON object a line with \"prompt\", \"tag\", \"include\" (and \"exclude\")")


@dataclasses.dataclass(frozen=True)
class GenEvalConfig(PlacementConfig):
    detector: str = param("", "Local directory of an OWLv2 checkpoint with its processor (e.g. a download of "
                              "google/owlv2-base-patch16-ensemble).", path=True, required=True)
    clip: str = param("", "Local directory of a transformers CLIPModel with its processor, the colour classifier "
                          "(e.g. openai/clip-vit-large-patch14). Required when a prompt names a colour.", path=True)
    metadata: str = param("", "GenEval-format JSONL (GenEval's prompts/evaluation_metadata.jsonl): each prompt's "
                              "requirements, looked up by its text.", path=True, required=True)
    mode: Literal["soft", "exact", "strict"] = param(
        "soft", "'soft': the partial score (1 exactly when GenEval's verdict is correct); 'exact': Flow-GRPO's "
                "training score, exact counts (an extra object costs as much as a missing one; soft rewards "
                "drawing more objects than asked); 'strict': GenEval's verdict, 1.0 or 0.0.")
    vocabulary: Literal["prompt", "metadata"] = param(
        "prompt", "Detector queries per image: 'prompt' (the classes its metadata names) or 'metadata' (every class "
                  "named anywhere in the metadata, closer to GenEval's closed-vocabulary detector).")
    nms_threshold: float = param(1.0, "Suppress a box whose IoU with a better box of its class is >= this "
                                      "(flowrl.geneval.select_objects); GenEval's 1.0 suppresses nothing.",
                                 min=0.0, max=1.0, exclusive_min=True)


# ----------------------------------------------------------------------------- metadata


def normalise_prompt(prompt: str) -> str:
    """The lookup key of a prompt: its words joined by single spaces."""
    return " ".join(str(prompt).split())


def index_metadata(path: str) -> dict[str, dict]:
    """GenEval metadata by normalised prompt; FlowrlError for a missing or malformed file, a record
    without a prompt, or one prompt given two different requirements."""
    where = f"reward '{WHO}': metadata"
    if not Path(path).is_file():
        raise FlowrlError(f"metadata file not found: {path}", where=where, hint=METADATA_HINT)
    try:
        records = geneval.load_metadata(path)
    except (ValueError, OSError) as exc:
        raise FlowrlError(f"cannot read GenEval metadata: {exc}", where=where, hint=METADATA_HINT) from exc
    if not records:
        raise FlowrlError(f"{path} holds no prompt", where=where, hint=METADATA_HINT)
    index: dict[str, dict] = {}
    for i, record in enumerate(records, 1):
        if not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise FlowrlError(f"record {i} of {path} has no \"prompt\" (the text it is looked up by)", where=where,
                              hint=METADATA_HINT)
        key = normalise_prompt(record["prompt"])
        if key in index and _requirements(index[key]) != _requirements(record):
            raise FlowrlError(f"the prompt {key!r} appears twice in {path} with different requirements", where=where,
                              hint="keep one record per prompt")
        index.setdefault(key, record)
    return index


def _requirements(record: Mapping) -> tuple:
    return record["tag"], json.dumps([record["include"], record.get("exclude", [])], sort_keys=True)


def record_classes(record: Mapping) -> list[str]:
    """The classes a prompt's metadata names (``include`` then ``exclude``), first mention first."""
    return list(dict.fromkeys(r["class"] for r in [*record["include"], *record.get("exclude", [])]))


def colour_needs(record: Mapping) -> dict[str, int]:
    """``{class: k}``: the ``k`` best objects of each class whose colour the rules read (a
    requirement with a colour reads the first ``count`` objects)."""
    needs: dict[str, int] = {}
    for req in record["include"]:
        if "color" in req:
            needs[req["class"]] = max(needs.get(req["class"], 0), req["count"])
    return needs


# ----------------------------------------------------------------------------- image maths


def gaussian_blur(images: torch.Tensor, sigma_y: float, sigma_x: float) -> torch.Tensor:
    """torchvision's ``gaussian_blur`` (kernel ``2 * ceil(3 sigma) + 1``, reflect padding), as
    OWLv2's image processor applies it before shrinking."""
    out, c = images, images.shape[1]
    for vertical, sigma in ((True, sigma_y), (False, sigma_x)):
        size = 2 * math.ceil(3 * sigma) + 1
        x = torch.linspace(-(size // 2), size // 2, size, dtype=images.dtype, device=images.device)
        kernel = torch.exp(-0.5 * (x / sigma) ** 2)
        kernel = (kernel / kernel.sum()).view((1, 1, size, 1) if vertical else (1, 1, 1, size))
        pad = (0, 0, size // 2, size // 2) if vertical else (size // 2, size // 2, 0, 0)
        out = F.conv2d(F.pad(out, pad, mode="reflect"), kernel.expand(c, 1, -1, -1), groups=c)
    return out


def owl_pixels(images: torch.Tensor, size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """OWLv2's preprocessing of ``images [B, 3, H, W]`` in [0, 1]: pad to a square at the bottom
    and right (grey 0.5), Gaussian anti-aliasing when shrinking (sigma ``(factor - 1) / 2``),
    bilinear resize to ``size x size`` without antialiasing, CLIP normalisation."""
    h, w = images.shape[-2:]
    side = max(h, w)
    if (h, w) != (side, side):
        images = F.pad(images, (0, side - w, 0, side - h), value=OWL_PAD)
    sigma = max(0.0, (side / size - 1) / 2)
    if sigma > 0:
        images = gaussian_blur(images, sigma, sigma)
    if side != size:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=False)
    return normalise(images, mean, std)


def grey_masked_crop(image: torch.Tensor, box: Sequence[float], mask: torch.Tensor | None = None) -> torch.Tensor:
    """GenEval's crop of one object for the colour classifier: ``image [3, H, W]`` composited over
    grey #999 through ``mask [H, W]`` (``None``: the box, so nothing inside the image turns
    grey), then cropped to ``box = (x0, y0, x1, y1)`` rounded to whole pixels as PIL's ``crop``
    rounds it (at least one pixel each way). Parts of the box outside the image are grey."""
    x0, y0, x1, y1 = (int(round(float(v))) for v in box)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)
    _, h, w = image.shape
    if mask is not None:
        image = torch.where(mask.to(image.device, torch.bool), image, torch.full_like(image, GREY))
    crop = torch.full((image.shape[0], y1 - y0, x1 - x0), GREY, dtype=image.dtype, device=image.device)
    ix0, iy0, ix1, iy1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
    if ix1 > ix0 and iy1 > iy0:
        crop[:, iy0 - y0 : iy1 - y0, ix0 - x0 : ix1 - x0] = image[:, iy0:iy1, ix0:ix1]
    return crop


def detections_from_outputs(logits: torch.Tensor, boxes: torch.Tensor, classes: Sequence[Sequence[str]],
                            sides: Sequence[float], floor: float = SCORE_FLOOR) -> list[list[geneval.Detection]]:
    """OWLv2's raw outputs as GenEval detections, per image: ``logits [B, N, Q]`` (image ``b``'s
    first ``len(classes[b])`` queries are its classes, the rest padding), ``boxes [B, N, 4]``
    centre/size in [0, 1] of the padded square whose side in pixels is ``sides[b]``. Each box
    takes its best query (transformers' ``post_process_object_detection``); boxes scoring
    ``<= floor`` are dropped. Colours are left ``None``."""
    out = []
    for b, names in enumerate(classes):
        best = logits[b, :, : len(names)].float().max(-1)
        scores = torch.sigmoid(best.values)
        keep = (scores > floor).nonzero().flatten()
        cx, cy, bw, bh = boxes[b, keep].float().unbind(-1)
        corners = torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1) * float(sides[b])
        out.append([geneval.Detection(label=names[q], box=tuple(box), score=s)
                    for q, box, s in zip(best.indices[keep].tolist(), corners.tolist(), scores[keep].tolist())])
    return out


# ----------------------------------------------------------------------------- loading


def _local_dir(path: str, key: str, what: str, hint: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FlowrlError(f"{key} directory not found: {path} ({what})", where=f"reward '{WHO}': {key}", hint=hint)
    if not (directory / "config.json").is_file():
        raise FlowrlError(f"no config.json in {path}: not a transformers {what}", where=f"reward '{WHO}': {key}",
                          hint=hint)
    return directory


def load_owlv2(path: str):
    """``(model, tokenizer, image size, mean, std)`` of an OWLv2 checkpoint directory (no network)."""
    directory = _local_dir(path, "detector", "an OWLv2 checkpoint", DETECTOR_HINT)
    where = f"reward '{WHO}': detector"
    try:
        model_type = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as exc:
        raise FlowrlError(f"cannot read {directory / 'config.json'}: {exc}", where=where, hint=DETECTOR_HINT) from exc
    if model_type != "owlv2":
        raise FlowrlError(f"{path} holds a '{model_type}' model, not OWLv2 (model_type 'owlv2')", where=where,
                          hint=DETECTOR_HINT + (" (OWL-ViT v1 is not supported)" if model_type == "owlvit" else ""))
    ensure_torchvision_importable()  # transformers' image processors import torchvision
    transformers = require("transformers", extra="rewards", purpose=f"the '{WHO}' reward")
    try:
        model = transformers.Owlv2ForObjectDetection.from_pretrained(str(directory), local_files_only=True)
        processor = transformers.Owlv2Processor.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FlowrlError(f"cannot load the OWLv2 detector from {path}: {exc}", where=where,
                          hint=DETECTOR_HINT) from exc
    image_processor = processor.image_processor
    mean = tuple(getattr(image_processor, "image_mean", None) or OPENAI_MEAN)
    std = tuple(getattr(image_processor, "image_std", None) or OPENAI_STD)
    return model, processor.tokenizer, int(model.config.vision_config.image_size), mean, std


def load_clip(path: str):
    """``(model, tokenizer, geometry)`` of a transformers CLIP directory (no network)."""
    directory = _local_dir(path, "clip", "a CLIP model", CLIP_HINT)
    ensure_torchvision_importable()
    transformers = require("transformers", extra="rewards", purpose=f"the '{WHO}' reward")
    try:
        model = transformers.CLIPModel.from_pretrained(str(directory), local_files_only=True)
        processor = transformers.AutoProcessor.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FlowrlError(f"cannot load the CLIP colour classifier from {path}: {exc}", where=f"reward '{WHO}': clip",
                          hint=CLIP_HINT) from exc
    tokenizer, image_processor = getattr(processor, "tokenizer", None), getattr(processor, "image_processor", None)
    if tokenizer is None or image_processor is None:
        raise FlowrlError(f"{path} holds no CLIP processor (a tokenizer and an image processor)",
                          where=f"reward '{WHO}': clip", hint=CLIP_HINT)
    return model, tokenizer, geometry_from_hf(image_processor)


def _max_length(tokenizer, config) -> int:
    return min(int(getattr(tokenizer, "model_max_length", 77) or 77), int(config.max_position_embeddings))


# ----------------------------------------------------------------------------- the reward


class GenEval(ModelReward):
    """GenEval's rules on real images: OWLv2 detections, CLIP colours, the prompt's metadata."""

    Config = GenEvalConfig

    def __init__(self, config: GenEvalConfig):
        self.name = WHO
        missing = [(key, what) for key, what in (
            ("detector", "an OWLv2 checkpoint directory, e.g. a download of google/owlv2-base-patch16-ensemble"),
            ("metadata", "a GenEval-format JSONL, e.g. GenEval's prompts/evaluation_metadata.jsonl"),
        ) if not getattr(config, key)]
        if missing:
            raise FlowrlError(
                "reward 'geneval' needs local files, which it never downloads: "
                + "; ".join(f"key '{key}' ({what})" for key, what in missing),
                where=f"reward '{WHO}'", hint=DETECTOR_HINT if missing[0][0] == "detector" else METADATA_HINT)
        self.mode = config.mode
        self.nms_threshold = config.nms_threshold
        self.metadata_path = config.metadata
        self.records = index_metadata(config.metadata)
        self.vocabulary = list(dict.fromkeys(c for r in self.records.values() for c in record_classes(r)))
        self.vocabulary_mode = config.vocabulary
        colour_prompts = [p for p, r in self.records.items() if colour_needs(r)]
        if colour_prompts and not config.clip:
            raise FlowrlError(
                f"key 'clip' is empty, but {len(colour_prompts)} prompt(s) of {config.metadata} name a colour "
                f"(e.g. {colour_prompts[0]!r}), which GenEval checks with CLIP",
                where=f"reward '{WHO}'", hint=CLIP_HINT)
        detector, self.owl_tokenizer, self.owl_size, self.owl_mean, self.owl_std = load_owlv2(config.detector)
        self.owl_max_length = _max_length(self.owl_tokenizer, detector.config.text_config)
        modules = {"detector": detector}
        self.clip_tokenizer = self.clip_geometry = None
        if config.clip:
            clip, self.clip_tokenizer, self.clip_geometry = load_clip(config.clip)
            self.clip_max_length = _max_length(self.clip_tokenizer, clip.config.text_config)
            modules["clip"] = clip
        self.module = torch.nn.ModuleDict(modules)
        self._setup_placement(config)

    # ------------------------------------------------------------------ metadata per call

    def metadata_for(self, prompt: str) -> dict:
        """The GenEval metadata of ``prompt``; ValueError naming it when the file lacks it."""
        record = self.records.get(normalise_prompt(prompt))
        if record is None:
            raise ValueError(f"reward '{WHO}': the prompt {prompt!r} is not in the GenEval metadata "
                             f"{self.metadata_path} ({len(self.records)} prompts); give prompts from that file")
        return record

    def classes_for(self, record: Mapping) -> list[str]:
        return list(self.vocabulary) if self.vocabulary_mode == "metadata" else record_classes(record)

    def prepare(self, prompts: list[str]) -> None:
        records = [self.metadata_for(p) for p in prompts]  # every prompt first: no model runs for a bad call
        queries = list(dict.fromkeys(c for r in records for c in self.classes_for(r)))
        self._queries = dict(zip(queries, self._encode_queries(queries)))
        colour_classes = list(dict.fromkeys(c for r in records for c in colour_needs(r)))
        self._colour_text = {c: self._colour_classifier(c) for c in colour_classes}

    # ------------------------------------------------------------------ detector

    @property
    def detector(self):
        return self.module["detector"]

    def _encode_queries(self, classes: list[str]) -> list[torch.Tensor]:
        if not classes:
            return []
        tok = self.owl_tokenizer([QUERY.format(c) for c in classes], padding="max_length", truncation=True,
                                 max_length=self.owl_max_length, return_tensors="pt")
        emb = features(self.detector.owlv2.get_text_features(
            input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device)))
        return list(emb)

    def raw_detections(self, pixels: torch.Tensor, queries: torch.Tensor, query_mask: torch.Tensor):
        """One detector pass: ``(logits [b, N, Q], boxes [b, N, 4])`` for OWLv2 pixels ``[b, 3, S, S]``
        and query embeddings ``[b, Q, D]`` (``query_mask [b, Q]``: which are real)."""
        feature_map = self.detector.image_embedder(pixel_values=pixels)[0]
        b, gh, gw, d = feature_map.shape
        image_feats = feature_map.reshape(b, gh * gw, d)
        logits = self.detector.class_predictor(image_feats, queries, query_mask)[0]
        boxes = self.detector.box_predictor(image_feats, feature_map)
        return logits, boxes

    def detect(self, images: torch.Tensor, class_lists: Sequence[Sequence[str]]) -> list[list[geneval.Detection]]:
        """Detections (colours ``None``) of ``images [b, 3, H, W]`` in [0, 1], image ``i`` queried
        for ``class_lists[i]``; boxes in pixels of the image."""
        pixels = owl_pixels(images, self.owl_size, self.owl_mean, self.owl_std).to(self.dtype)
        q = max(len(c) for c in class_lists)
        dim = next(iter(self._queries.values())).shape[-1]
        queries = torch.zeros(len(class_lists), q, dim, dtype=self.dtype, device=self.device)
        mask = torch.zeros(len(class_lists), q, dtype=torch.bool, device=self.device)
        for i, names in enumerate(class_lists):
            if names:
                queries[i, : len(names)] = torch.stack([self._queries[c] for c in names]).to(self.dtype)
                mask[i, : len(names)] = True
        logits, boxes = self.raw_detections(pixels, queries, mask)
        side = max(images.shape[-2:])
        return detections_from_outputs(logits, boxes, class_lists, [side] * len(class_lists))

    # ------------------------------------------------------------------ colour

    def _clip_text(self, texts: list[str]) -> torch.Tensor:
        tok = self.clip_tokenizer(texts, padding="max_length", truncation=True, max_length=self.clip_max_length,
                                  return_tensors="pt")
        emb = features(self.module["clip"].get_text_features(
            input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device))).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    def _colour_classifier(self, cls: str) -> torch.Tensor:
        """``[10, D]``: per colour, the normalised mean of its templates' normalised embeddings
        (clip_benchmark's ``zero_shot_classifier``, as GenEval builds it)."""
        texts = [t.format(c=colour, cls=cls) for colour in geneval.COLOURS for t in COLOUR_TEMPLATES]
        emb = self._clip_text(texts).view(len(geneval.COLOURS), len(COLOUR_TEMPLATES), -1).mean(1)
        return emb / emb.norm(dim=-1, keepdim=True)

    def classify_colours(self, crops: Sequence[torch.Tensor], classes: Sequence[str]) -> list[str]:
        """GenEval's colour of each crop ``[3, h, w]`` of an object of ``classes[i]``."""
        if not crops:
            return []
        geometry: ImageGeometry = self.clip_geometry
        pixels = torch.cat([geometry(c.unsqueeze(0)) for c in crops]).to(self.dtype)
        emb = torch.cat([features(self.module["clip"].get_image_features(pixel_values=pixels[i : i + self.batch_size]))
                         for i in range(0, len(pixels), self.batch_size)]).float()
        emb = emb / emb.norm(dim=-1, keepdim=True)
        text = torch.stack([self._colour_text[c] for c in classes])  # [n, 10, D]
        best = torch.einsum("nd,nkd->nk", emb, text).argmax(-1)
        return [geneval.COLOURS[i] for i in best.tolist()]

    # ------------------------------------------------------------------ scoring

    def _score_batch(self, images, prompts, metadata):
        records = [self.metadata_for(p) for p in prompts]
        detections = self.detect(images, [self.classes_for(r) for r in records])
        # GenEval's selection (with this reward's suppression); score_prompt selects again, which
        # leaves an already selected set unchanged
        selected = [[d for objs in geneval.select_objects(dets, r["tag"], nms_threshold=self.nms_threshold).values()
                     for d in objs] for dets, r in zip(detections, records)]
        jobs = []  # (image, index in its selection, class)
        for i, (objs, record) in enumerate(zip(selected, records)):
            for cls, k in colour_needs(record).items():
                jobs += [(i, j, cls) for j in [j for j, d in enumerate(objs) if d.label == cls][:k]]
        crops = [grey_masked_crop(images[i], selected[i][j].box) for i, j, _ in jobs]
        for (i, j, _), colour in zip(jobs, self.classify_colours(crops, [cls for _, _, cls in jobs])):
            selected[i][j] = dataclasses.replace(selected[i][j], colour=colour)
        results = [geneval.score_prompt(objs, record) for objs, record in zip(selected, records)]
        soft = torch.tensor([r.soft for r in results], dtype=torch.float32)
        strict = torch.tensor([float(r.strict) for r in results], dtype=torch.float32)
        exact = torch.tensor([r.exact for r in results], dtype=torch.float32)
        chosen = {"soft": soft, "exact": exact, "strict": strict}[self.mode]
        return {"scores": chosen, "soft": soft, "exact": exact, "strict": strict}
