"""``profile.json``: the file ``flowrl profile`` writes and the ``dynamics`` chunker and the
``weighted`` selector read.

Layout (JSON, every list indexed by sampling step ``i = 0 .. N-1`` unless said otherwise)::

    {
      "format": "flowrl-profile", "version": 1,
      "sigmas": [N + 1 floats],           the schedule that was sampled
      "trainable": [N bools],              the engine's trainable transitions (T = count of true)
      "positions": [T ints],               their step indices (layout position t -> step)
      "curves": {"l1rel": {"mean": [N], "prompt_std": [N] | null, "prompt_cv": [N] | null,
                           "seed_std": [N] | null, "seed_cv": [N] | null,
                           "d1": [N - 1], "d2": [N - 2],
                           "summary": {"prompt_cv": float, "seed_cv": float}}, ...},
      "proposals": {"l1rel": {"dp": {"sizes": [...], "boundaries": [...], "cost": ..,
                                     "explained": .., "chosen_k": .., "snippet": "[chunker]..."},
                              "curvature": {...}, "derivative": {...}}, ...},
      "settings": {... model, schedule, kernel, steps, prompts, seeds, segmentation limits ...},
      "elapsed_s": float
    }

Written atomically. Readers check the format, the version and the lengths, and say which file
and key is wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..checks import positive_int
from ..errors import FlowrlError
from ..files import write_text_atomic

FORMAT = "flowrl-profile"
VERSION = 1
_REGENERATE = "regenerate it with `flowrl profile RECIPE -o DIR` (see docs/profile.md)"


def profile_to_dict(result) -> dict[str, Any]:
    """A :class:`flowrl.dynamics.measure.ProfileResult` as the JSON-able dict described above."""
    positions = result.positions
    curves = {}
    for name, stats in result.curves.items():
        entry = stats.to_dict()
        entry["summary"] = stats.summary(positions or None)  # all-ODE: over every transition
        curves[name] = entry
    return {
        "format": FORMAT,
        "version": VERSION,
        "sigmas": list(result.sigmas),
        "trainable": list(result.trainable),
        "positions": positions,
        "curves": curves,
        "proposals": {c: {m: seg.to_dict() for m, seg in by.items()} for c, by in result.proposals.items()},
        "settings": result.settings,
        "elapsed_s": result.elapsed_s,
    }


def _json_safe(value):
    # JSON has no NaN / inf: write them as null so every reader can parse the file
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as indented JSON, atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(_json_safe(data), indent=1) + "\n")
    return path


def write_profile(path: str | Path, result) -> Path:
    """Write a :class:`~flowrl.dynamics.measure.ProfileResult` (or an already converted dict)."""
    data = result if isinstance(result, dict) else profile_to_dict(result)
    return write_json(path, data)


def read_profile(path: str | Path, *, where: str | None = None) -> dict[str, Any]:
    """Read and check a ``profile.json``; raises :class:`FlowrlError` naming the file and key."""
    where = where or "profile"
    if not path:
        raise FlowrlError("no profile file given", where=where, hint=_REGENERATE)
    p = Path(path)
    if not p.is_file():
        raise FlowrlError(
            f"profile file not found: {p}", where=where,
            hint=f"paths are relative to the current directory ({Path.cwd()}); {_REGENERATE}",
        )
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FlowrlError(f"{p} is not a JSON file ({exc})", where=where, hint=_REGENERATE) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        hint = _REGENERATE
        if found == "flowrl-profile-compare":
            hint = "a --compare summary is not a profile: use the base.json or trained.json beside it"
        raise FlowrlError(f"{p} is not a flowrl profile (format {found!r})", where=where, hint=hint)
    if data.get("version") != VERSION:
        raise FlowrlError(
            f"{p} has profile version {data.get('version')!r}; this flowrl reads version {VERSION}",
            where=where, hint=_REGENERATE,
        )
    sigmas, trainable, curves = data.get("sigmas"), data.get("trainable"), data.get("curves")
    if not isinstance(sigmas, list) or not isinstance(trainable, list) or len(sigmas) != len(trainable) + 1:
        raise FlowrlError(f"{p}: 'sigmas' must hold one more entry than 'trainable'", where=where, hint=_REGENERATE)
    if not isinstance(curves, dict) or not curves:
        raise FlowrlError(f"{p}: 'curves' is missing or empty", where=where, hint=_REGENERATE)
    n = len(trainable)
    for name, entry in curves.items():
        mean = entry.get("mean") if isinstance(entry, dict) else None
        if not isinstance(mean, list) or len(mean) != n or any(not isinstance(v, (int, float)) for v in mean):
            raise FlowrlError(
                f"{p}: curves.{name}.mean must be {n} numbers (one per sampling step)", where=where, hint=_REGENERATE
            )
    return data


def trainable_curve(
    data: dict[str, Any],
    curve: str = "l1rel",
    num_transitions: int | None = None,
    *,
    source: str = "profile",
    where: str | None = None,
) -> list[float]:
    """The mean of ``curve`` at the trainable transitions (layout positions ``0 .. T-1``).

    With ``num_transitions``, checks that the profile's T equals the caller's T (a profile of a
    different sampler, e.g. another number of steps, does not describe this one).
    """
    where = where or source
    curves = data["curves"]
    if curve not in curves:
        raise FlowrlError(
            f"{source} has no curve '{curve}'", where=where, hint=f"curves in the file: {', '.join(sorted(curves))}"
        )
    positions = [i for i, t in enumerate(data["trainable"]) if t]
    if num_transitions is not None and len(positions) != num_transitions:
        settings = data.get("settings", {})
        raise FlowrlError(
            f"{source} describes T = {len(positions)} trainable transitions "
            f"(steps = {len(data['trainable'])}, image_from = {settings.get('image_from', '?')}), "
            f"but this run has T = {num_transitions}",
            where=where,
            hint="profile the recipe you train with: `flowrl profile RECIPE`",
        )
    mean = curves[curve]["mean"]
    return [float(mean[i]) for i in positions]


def read_l1rel(path: str | Path, num_transitions: int, *, where: str = "[selector].profile") -> torch.Tensor:
    """Mean L1rel per trainable transition, float32 ``[T]``, from a profile file.

    This is what the ``weighted`` selector turns into chunk weights (paper Eq. 16:
    ``w_j = mean_{i in chunk j} L1rel_i``). Raises :class:`FlowrlError` if the path is empty, the
    file is missing or malformed, or its T differs from ``num_transitions``.
    """
    if not path:
        raise FlowrlError(
            "weighted chunk sampling needs a profile, and none was given",
            where=where,
            hint='set profile = "path/to/profile.json" (from `flowrl profile RECIPE`), or use '
            '[chunker] use = "dynamics" and let the engine pass the chunker\'s profile',
        )
    positive_int(num_transitions, "num_transitions")
    data = read_profile(path, where=where)
    values = trainable_curve(data, "l1rel", num_transitions, source=str(path), where=where)
    out = torch.tensor(values, dtype=torch.float32)
    if not bool(torch.isfinite(out).all()) or bool((out < 0).any()):
        raise FlowrlError(f"{path}: L1rel must be finite and non-negative, got {values}", where=where, hint=_REGENERATE)
    return out
