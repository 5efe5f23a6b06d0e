"""GenEval's scoring rules, fed by detections from any detector.

GenEval (Ghosh et al., 2023) judges a text-to-image model by running an object detector and a
colour classifier on each image and checking the prompt's requirements. This module holds only
the *rules*: it takes :class:`Detection` objects (from the real Mask2Former + CLIP pipeline, an
embedded toy detector of coloured shapes, or anything else) and a prompt's metadata in GenEval's
format, and returns GenEval's verdict plus a partial score for training. Pure Python (stdlib
``math``, ``json``), no torch, no numpy.

Written from the rules, not copied, after reading:

- GenEval: ``djghosh13/geneval`` at ``af4902f24d3ca90ebbb446dd9891a59e0f82725f``,
  ``evaluation/evaluate_images.py`` (functions ``evaluate_image``, ``evaluate``,
  ``relative_position``, ``compute_iou``; constants set in its ``__main__``) and
  ``evaluation/summary_scores.py`` (the table). MIT licence.
- Flow-GRPO's training reward: ``yifan123/reward-server`` at
  ``92ac29fb322c028f8840db8f93c950422931710d``, ``reward_server/gen_eval.py`` (function
  ``evaluate_reward``, whose ``score`` is returned as ``scores`` by ``compute_geneval``), used by
  ``yifan123/flow_grpo`` at ``ac4c86e8cae021841f1fde853d340e0db67690dd``,
  ``flow_grpo/rewards.py`` (``geneval_score``; ``multi_score`` makes ``scores`` the reward
  ``avg`` that the GRPO advantages are computed from).

Selecting objects (:func:`select_objects`)
------------------------------------------
Per class, in this order, as GenEval does:

1. keep a detection only if its score is *strictly* above the confidence threshold:
   ``THRESHOLD = 0.3``, or ``COUNTING_THRESHOLD = 0.9`` when the prompt's tag is ``"counting"``
   (so a 0.5-confidence object counts for a colour prompt but not for a counting prompt);
2. order by score, highest first;
3. keep at most ``MAX_OBJECTS = 16`` (the cap comes *before* suppression, as in GenEval);
4. greedy non-maximum suppression: take the best remaining box, drop the others whose IoU with
   it is ``>= NMS_THRESHOLD``, repeat. GenEval sets ``NMS_THRESHOLD = 1.0`` and then skips the
   IoU test altogether when the threshold equals 1, so **nothing is ever suppressed** with the
   default: two identical boxes both count. (For other thresholds the IoU is GenEval's, with its
   inclusive-pixel convention: a box's side is ``x1 - x0 + 1``.)

A class with no object left is absent from the result.

Relative position (:func:`relative_position`)
---------------------------------------------
Relations of object A relative to object B, from the box centres ``c`` and the box sizes
``d = (|x1 - x0|, |y1 - y0|)``, per axis (x and y separately):

- ``offset = c_A - c_B``;
- the margin ``POSITION_THRESHOLD * (d_A + d_B)`` with ``POSITION_THRESHOLD = 0.1`` is taken off
  the offset's magnitude, floored at zero, keeping the offset's sign: ``revised``;
- if both components of ``revised`` are below ``1e-3`` in magnitude, there is no relation;
- otherwise ``(dx, dy) = revised / |offset|`` (divided by the length of the *original* offset)
  and ``dx < -0.5`` gives ``"left of"``, ``dx > 0.5`` ``"right of"``, ``dy < -0.5``
  ``"above"``, ``dy > 0.5`` ``"below"`` (image coordinates: y grows downwards). A diagonal
  offset can give two relations; a small offset relative to the boxes' sizes gives none.

Per-prompt verdict: ``PromptScore.strict`` (GenEval's ``correct``)
-----------------------------------------------------------------
The ``include`` requirements are checked in order; requirement *i* is
``{"class", "count", optional "color", optional "position": [relation, j]}`` with ``j < i``:

- *count*: the first ``count`` objects of the class (highest scores) are the group; fewer than
  ``count`` objects fails ("at least ``count``": extra objects are fine for GenEval);
- *colour* (only if the count passed): at least ``count`` of the group -- i.e. all of it -- must
  have the required colour (an object whose colour is ``None`` does not match);
- *position* (only if count and colour passed): if group *j* failed, this fails ("no target");
  otherwise every object of this group must stand in the relation to every object of group *j*;
- a requirement that fails leaves ``None`` as its group, so a later position referring to it
  fails too.

Each ``exclude`` requirement ``{"class", "count"}`` fails if the number of selected objects of
the class is ``>= count`` (GenEval uses it for counting prompts: ``count + 1`` of the same class).
The prompt is correct when every requirement passes.

Partial score: ``PromptScore.soft`` (Flow-GRPO's ``score``, made to agree with the verdict)
-----------------------------------------------------------------------------------------
Flow-GRPO's rule (:func:`flow_grpo_score` returns it unchanged) is the mean of a list of terms.
For each include requirement, with ``n`` = *all* selected objects of the class (not the first
``count``) and ``c`` = its count:

- a count term ``1 - |c - n| / c`` (so ``n = 2c`` gives 0 and ``n > 2c`` a *negative* term);
- if ``n != c`` (Flow-GRPO wants the exact count): one term ``0.0`` if the requirement has a
  colour or a position (one term even if it has both), and the requirement fails;
- otherwise a colour term ``1 - |c - m| / c`` with ``m`` the objects of the required colour
  (failing unless ``m = c``), then, if the colour passed, a position term: ``0.0`` when the
  target group failed; when the objects pass ``1.0``; when some pair fails, ``0.0`` *and then*
  ``1.0`` -- an extra 1.0 that Flow-GRPO's code appends after its loop whether or not the check
  failed (so a failed position contributes two terms averaging 0.5). We reproduce it as written.

Exclude requirements play no part in Flow-GRPO's score. Flow-GRPO's own "strict" flag is the
exact-count verdict (``n == c`` everywhere), **not** GenEval's; our ``strict`` is GenEval's.

``soft`` must be 1.0 exactly when ``strict`` is true; Flow-GRPO's score is 1.0 exactly when its
exact-count verdict holds, which differs from GenEval's in two ways. So ``soft`` is Flow-GRPO's
score with these changes, and equal to it otherwise:

1. when GenEval's verdict is true, ``soft = 1.0``. This only changes anything when a prompt asks
   for ``c`` objects of a class, more than ``c`` are detected and no exclude forbids it (e.g. two
   benches for "a photo of a bench": GenEval says correct, Flow-GRPO scores 0.0);
2. an exclude requirement that fails and is not already implied by an include of the same class
   with a smaller count adds a ``0.0`` term (Flow-GRPO ignores excludes; with GenEval's metadata,
   whose excludes are all ``count + 1`` of an included class, no term is ever added);
3. the mean is floored at 0.0 (Flow-GRPO's can go negative through the count term).

With these, ``soft == 1.0`` if and only if ``strict``, and ``0 <= soft <= 1``.

Exact-count score: ``PromptScore.exact`` (Flow-GRPO's ``score`` unchanged)
-------------------------------------------------------------------------
``soft`` inherits GenEval's "at least": for "a cross", two crosses score 1.0. A policy trained on
it learns to draw *more* objects (measured on the compositional world: in 10 DiffusionNFT
iterations GenEval's verdict rose from 0.38 to 0.52 while single objects came in twos and threes
and a second judge fell from 0.38 to 0.18). ``exact`` is Flow-GRPO's score as its reward server
returns it (:func:`flow_grpo_score`): an extra object costs as much as a missing one, so it is
the training reward to use when the evaluation is GenEval's; it may be negative (``n > 2c``) and
is 1.0 when every count is exact and every colour and position holds.

The table (:func:`summarise`)
-----------------------------
GenEval's score per tag is the fraction of correct images; the overall score is the unweighted
mean of the tags' means over the tags present (``summary_scores.py``). GenEval prints no error
bars; we add the standard error of each mean, ``sqrt(p (1 - p) / (n - 1))`` (0 when ``n <= 1``),
and for the overall mean ``sqrt(sum of squared tag SEMs) / number of tags``.

Where we differ from GenEval
----------------------------
- Ties in score keep the detector's order (a stable sort); GenEval's ``argsort`` leaves the
  order of equal scores unspecified.
- Malformed metadata (unknown tag or relation, a position referring to itself or a later
  requirement, a count below 1, an empty ``include``) raises :class:`ValueError`; GenEval would
  fail with a ``KeyError``/``IndexError`` or, for a negative index, silently use a later group.
- The colour classifier is the caller's: GenEval crops each object (masked onto grey) and asks
  CLIP to choose among ten colours (:data:`COLOURS`); here ``Detection.colour`` is whatever the
  caller's classifier said, ``None`` meaning not classified (never a match).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "COLOURS", "COUNTING_THRESHOLD", "MAX_OBJECTS", "NMS_THRESHOLD", "POSITION_THRESHOLD", "RELATIONS",
    "TAGS", "THRESHOLD", "Detection", "PromptScore", "flow_grpo_score", "load_metadata", "relative_position",
    "score_prompt", "select_objects", "summarise",
]

#: A detection counts if its score is above this (all tags but "counting").
THRESHOLD = 0.3
#: The same for the "counting" tag.
COUNTING_THRESHOLD = 0.9
#: At most this many objects of one class are kept, highest scores first.
MAX_OBJECTS = 16
#: Non-maximum suppression drops boxes with IoU >= this; 1.0 means no suppression at all.
NMS_THRESHOLD = 1.0
#: Margin for positions, as a fraction of the sum of the two boxes' sizes (per axis).
POSITION_THRESHOLD = 0.1

#: GenEval's six prompt categories, in its order.
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
#: The relations a "position" requirement may name.
RELATIONS = ("left of", "right of", "above", "below")
#: The ten colours GenEval's CLIP classifier chooses from (for reference; not enforced).
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")

_NO_RELATION = 1e-3  # GenEval: a revised offset below this on both axes means "no relation"
_CUT = 0.5  # GenEval: a normalised revised offset beyond +-0.5 on an axis gives a relation


@dataclass(frozen=True)
class Detection:
    """One detected object: class name, box ``(x0, y0, x1, y1)`` in pixels with y pointing down,
    the detector's confidence, and the colour classifier's answer (``None``: not classified)."""

    label: str
    box: tuple[float, float, float, float]
    score: float
    colour: str | None = None

    def __post_init__(self) -> None:
        box = tuple(float(v) for v in self.box)
        if len(box) != 4:
            raise ValueError(f"Detection box must be (x0, y0, x1, y1), got {self.box!r}")
        object.__setattr__(self, "box", box)
        object.__setattr__(self, "score", float(self.score))


@dataclass(frozen=True)
class PromptScore:
    """The result for one image: GenEval's verdict, the partial training score, Flow-GRPO's
    exact-count training score and the reasons for a failure (empty when ``strict``)."""

    strict: bool
    soft: float
    exact: float
    reasons: tuple[str, ...]


# ----------------------------------------------------------------------------- selection


def _check_tag(tag: object) -> str:
    if tag not in TAGS:
        raise ValueError(f"unknown GenEval tag {tag!r}; expected one of {', '.join(TAGS)}")
    return tag  # type: ignore[return-value]


def _iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """GenEval's IoU, counting pixels inclusively (a side is ``x1 - x0 + 1``)."""

    def area(x0: float, y0: float, x1: float, y1: float) -> float:
        return max(x1 - x0 + 1, 0.0) * max(y1 - y0 + 1, 0.0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a) + area(*b) - inter
    return inter / union if union else 0.0


def select_objects(detections: Sequence[Detection], tag: str, *,
                   nms_threshold: float | None = None) -> dict[str, list[Detection]]:
    """The objects GenEval counts, per class, highest score first (see the module docstring):
    score above the tag's threshold, at most :data:`MAX_OBJECTS`, then suppression at
    ``nms_threshold`` (default :data:`NMS_THRESHOLD`, which suppresses nothing). Classes with no
    object left are absent."""
    threshold = COUNTING_THRESHOLD if _check_tag(tag) == "counting" else THRESHOLD
    nms = NMS_THRESHOLD if nms_threshold is None else float(nms_threshold)
    by_class: dict[str, list[Detection]] = {}
    for det in detections:
        if det.score > threshold:
            by_class.setdefault(det.label, []).append(det)
    selected: dict[str, list[Detection]] = {}
    for label, dets in by_class.items():
        ordered = sorted(dets, key=lambda d: -d.score)[:MAX_OBJECTS]  # stable: ties keep input order
        kept: list[Detection] = []
        while ordered:
            best = ordered.pop(0)
            kept.append(best)
            if nms != 1:
                ordered = [d for d in ordered if _iou(best.box, d.box) < nms]
        selected[label] = kept
    return selected


# ----------------------------------------------------------------------------- position


def relative_position(a: Detection, b: Detection) -> set[str]:
    """The relations (a subset of :data:`RELATIONS`) of ``a`` relative to ``b``."""
    revised = []
    offsets = []
    for lo, hi in ((0, 2), (1, 3)):  # x axis, then y axis
        offset = (a.box[lo] + a.box[hi]) / 2 - (b.box[lo] + b.box[hi]) / 2
        margin = POSITION_THRESHOLD * (abs(a.box[hi] - a.box[lo]) + abs(b.box[hi] - b.box[lo]))
        revised.append(math.copysign(max(abs(offset) - margin, 0.0), offset) if offset else 0.0)
        offsets.append(offset)
    if all(abs(r) < _NO_RELATION for r in revised):
        return set()
    length = math.hypot(*offsets)
    dx, dy = revised[0] / length, revised[1] / length
    relations = set()
    if dx < -_CUT:
        relations.add("left of")
    if dx > _CUT:
        relations.add("right of")
    if dy < -_CUT:
        relations.add("above")
    if dy > _CUT:
        relations.add("below")
    return relations


# ----------------------------------------------------------------------------- metadata


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _validate(metadata: object) -> tuple[str, list[Mapping], list[Mapping]]:
    """``(tag, include, exclude)`` of well-formed metadata; ValueError saying what is wrong."""
    if not isinstance(metadata, Mapping):
        raise ValueError(f"GenEval metadata must be a mapping, got {type(metadata).__name__}")
    if "tag" not in metadata:
        raise ValueError('GenEval metadata has no "tag"')
    tag = _check_tag(metadata["tag"])
    include = metadata.get("include")
    if not isinstance(include, Sequence) or isinstance(include, str) or not include:
        raise ValueError('GenEval metadata needs "include": a non-empty list of requirements')
    exclude = metadata.get("exclude", [])
    if not isinstance(exclude, Sequence) or isinstance(exclude, str):
        raise ValueError('GenEval metadata "exclude" must be a list of requirements')
    for where, reqs in (("include", include), ("exclude", exclude)):
        for i, req in enumerate(reqs):
            name = f"{where}[{i}]"
            if not isinstance(req, Mapping):
                raise ValueError(f"{name} must be a mapping, got {type(req).__name__}")
            if not isinstance(req.get("class"), str) or not req["class"]:
                raise ValueError(f'{name} needs "class": a non-empty string')
            if not _is_count(req.get("count")):
                raise ValueError(f'{name} needs "count": an integer >= 1, got {req.get("count")!r}')
            if where == "exclude":
                continue
            if "color" in req and not isinstance(req["color"], str):
                raise ValueError(f'{name} "color" must be a string, got {req["color"]!r}')
            if "position" in req:
                pos = req["position"]
                if not isinstance(pos, Sequence) or isinstance(pos, str) or len(pos) != 2:
                    raise ValueError(f'{name} "position" must be [relation, index], got {pos!r}')
                relation, target = pos
                if relation not in RELATIONS:
                    raise ValueError(f"{name} has unknown relation {relation!r}; expected one of "
                                     f"{', '.join(RELATIONS)}")
                if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < i:
                    raise ValueError(f"{name} position must refer to an earlier include (0 <= index < {i}), "
                                     f"got {target!r}")
    return tag, list(include), list(exclude)


# ----------------------------------------------------------------------------- scoring


def _geneval_verdict(objects: Mapping[str, list[Detection]], include: list[Mapping],
                     exclude: list[Mapping]) -> list[str]:
    """GenEval's checks; the reasons for failure (empty: correct)."""
    reasons: list[str] = []
    groups: list[list[Detection] | None] = []
    for req in include:
        cls, count = req["class"], req["count"]
        group = objects.get(cls, [])[:count]
        ok = True
        if len(group) < count:
            ok = False
            reasons.append(f"expected at least {count} {cls!r}, found {len(group)}")
        else:
            if "color" in req:
                colours = [d.colour for d in group]
                matching = colours.count(req["color"])
                if matching < count:
                    ok = False
                    seen = ", ".join(str(c) for c in colours)
                    reasons.append(f"expected {count} {req['color']} {cls!r}, found {matching} among the "
                                   f"top {count} (colours: {seen})")
            if "position" in req and ok:
                relation, target = req["position"]
                target_group = groups[target]
                if target_group is None:
                    ok = False
                    reasons.append(f"{cls!r} should be {relation} include {target}, which failed")
                else:
                    for obj in group:
                        for other in target_group:
                            found = relative_position(obj, other)
                            if relation not in found:
                                ok = False
                                actual = " and ".join(sorted(found)) or "in no clear relation to"
                                reasons.append(f"{cls!r} should be {relation} {include[target]['class']!r}, "
                                               f"but is {actual} it")
                                break
                        if not ok:
                            break
        groups.append(group if ok else None)
    for req in exclude:
        n = len(objects.get(req["class"], []))
        if n >= req["count"]:
            reasons.append(f"expected fewer than {req['count']} {req['class']!r}, found {n}")
    return reasons


def _flow_grpo_terms(objects: Mapping[str, list[Detection]], include: list[Mapping]) -> list[float]:
    """Flow-GRPO's reward terms (see the module docstring), quirks included."""
    terms: list[float] = []
    groups: list[list[Detection] | None] = []
    for req in include:
        cls, count = req["class"], req["count"]
        found = objects.get(cls, [])
        terms.append(1 - abs(count - len(found)) / count)
        ok = True
        if len(found) != count:
            ok = False
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                matching = sum(d.colour == req["color"] for d in found)
                terms.append(1 - abs(count - matching) / count)
                ok = matching == count
            if "position" in req and ok:
                relation, target = req["position"]
                if groups[target] is None:
                    ok = False
                    terms.append(0.0)
                else:
                    if not all(relation in relative_position(obj, other)
                               for obj in found for other in groups[target]):
                        ok = False
                        terms.append(0.0)
                    terms.append(1.0)  # Flow-GRPO appends this after its loop, pass or fail
        groups.append(found if ok else None)
    return terms


def flow_grpo_score(detections: Sequence[Detection], metadata: Mapping) -> float:
    """Flow-GRPO's partial GenEval reward exactly as its reward server computes it: exact counts,
    excludes ignored, the extra 1.0 after a failed position, not clipped (it can be negative).
    :func:`score_prompt`'s ``soft`` is this, reconciled with GenEval's verdict."""
    tag, include, _ = _validate(metadata)
    terms = _flow_grpo_terms(select_objects(detections, tag), include)
    return sum(terms) / len(terms)


def score_prompt(detections: Sequence[Detection], metadata: Mapping) -> PromptScore:
    """GenEval's verdict and the partial score for one image's detections and its prompt's
    metadata (``{"tag", "include", optional "exclude", "prompt"}``); ValueError if malformed."""
    tag, include, exclude = _validate(metadata)
    objects = select_objects(detections, tag)
    reasons = _geneval_verdict(objects, include, exclude)
    terms = _flow_grpo_terms(objects, include)
    exact = sum(terms) / len(terms)
    if not reasons:
        return PromptScore(strict=True, soft=1.0, reasons=(), exact=exact)
    for req in exclude:
        implied = any(inc["class"] == req["class"] and inc["count"] < req["count"] for inc in include)
        if not implied and len(objects.get(req["class"], [])) >= req["count"]:
            terms.append(0.0)
    soft = max(sum(terms) / len(terms), 0.0)
    return PromptScore(strict=False, soft=soft, reasons=tuple(reasons), exact=exact)


# ----------------------------------------------------------------------------- table


def _sem(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0


def summarise(tags: Sequence[str], strict: Sequence[bool]) -> dict:
    """GenEval's table from per-image tags and verdicts:
    ``{"overall": {"mean", "sem", "n"}, "categories": {tag: {"mean", "sem", "n"}}}``, categories
    in :data:`TAGS` order, only those present; overall mean = mean of the category means."""
    tags, strict = list(tags), list(strict)
    if len(tags) != len(strict):
        raise ValueError(f"summarise needs one verdict per tag, got {len(tags)} tags and {len(strict)} verdicts")
    if not tags:
        raise ValueError("summarise needs at least one image")
    counts: dict[str, list[int]] = {}
    for tag, ok in zip(tags, strict):
        _check_tag(tag)
        if ok not in (True, False):
            raise ValueError(f"a verdict must be true or false (1 or 0), got {ok!r}")
        counts.setdefault(tag, [0, 0])
        counts[tag][0] += bool(ok)
        counts[tag][1] += 1
    categories = {}
    for tag in TAGS:
        if tag in counts:
            correct, n = counts[tag]
            p = correct / n
            categories[tag] = {"mean": p, "sem": _sem(p, n), "n": n}
    k = len(categories)
    overall = {
        "mean": sum(c["mean"] for c in categories.values()) / k,
        "sem": math.sqrt(sum(c["sem"] ** 2 for c in categories.values())) / k,
        "n": len(tags),
    }
    return {"overall": overall, "categories": categories}


# ----------------------------------------------------------------------------- files


def load_metadata(path: str | os.PathLike) -> list[dict]:
    """The prompts of a GenEval ``evaluation_metadata.jsonl`` (one JSON object a line; blank lines
    skipped), each checked like :func:`score_prompt` checks it; ValueError naming file and line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for key in ("tag", "include"):
                if key not in record:
                    raise ValueError(f'{where}: missing "{key}"')
            try:
                _validate(record)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            records.append(record)
    return records
