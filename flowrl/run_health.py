"""Is a run healthy? The warning signs in its ``metrics.jsonl`` (``flowrl diagnose RUN_DIR``).

A rising training reward proves nothing: a policy can raise it by hacking the reward (drawing
what the scorer likes, not what the prompt asks), by collapsing onto a few samples, or not at
all while the curve wobbles. Each check below reads one sign from the metrics every run logs,
and says what it means and what to do:

- **held-out reward** (each optimised reward): the first against the last evaluation on the
  held-out prompts, in standard errors of the two combined. Falling means the policy got worse
  at what it is trained for.
- **judge** (each evaluated reward the run does not optimise): falling while an optimised reward
  rises is the reward-hacking signature (the quickstart's hacking lesson: area up, verifier down).
- **high-frequency share** (``eval/hf_share``, :mod:`flowrl.artefacts`): the images' energy above
  0.25 cycles per pixel. A pixel-scale texture (a checkerboard) raises it several-fold while a
  reward that cannot see it climbs; a doubling that adds at least 0.05 is flagged.
- **equal-reward groups** (``groups/all_equal_fraction``): a group whose samples all score the
  same has zero advantage and trains nothing; half or more of them late in the run means the
  reward is saturated or too coarse for the task.
- **reward spread** (``reward/<label>/std`` within an iteration): falling to under a quarter of
  its early value means the samples converge (mode collapse, or a saturated reward), and the
  groups carry little signal.
- **clip** (``clip_fraction``): a clip acting on 30% or more of the units means each optimizer
  step moves the policy far from the rollout's; a lower learning rate or fewer steps per
  rollout keeps the ratio where the clipped objective is accurate.
- **non-finite steps** (``nonfinite_steps``): optimizer steps skipped for a NaN or infinite
  gradient.

"Early" and "late" are the first and last quarter of the training rows (at least one row each).
The thresholds are signs to look at, not proofs: every warning says to open the images
(``RUN_DIR/images``). Nothing here fails a run; ``flowrl diagnose --strict`` exits 1 on a warning
(for scripts and sweeps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .check_result import Check

#: |change| in standard errors (the two evaluations' combined in quadrature) that counts as a change
SIGNIFICANT_SE = 2.0
#: eval/hf_share: flagged when the last evaluation's is at least this many times the first's ...
HF_SHARE_FACTOR = 2.0
#: ... and at least this much higher (the base models' images score about 0.05-0.09)
HF_SHARE_RISE = 0.05
#: groups/all_equal_fraction, late in the run
EQUAL_GROUPS = 0.5
#: reward/<label>/std late over early
SPREAD_COLLAPSE = 0.25
#: clip_fraction, late in the run
CLIP_ACTIVE = 0.3
#: the artefact measure is logged beside the rewards, but is not one
ARTEFACT = "hf_share"

HELD_OUT, TRAINING = "held-out evaluation", "training"


def is_evaluation(row: dict[str, Any]) -> bool:
    """Whether a metrics row holds a held-out evaluation (``eval/*``)."""
    return any(k.startswith("eval/") for k in row)


def _numbers(**figures: float) -> dict[str, float | None]:
    """A check's figures, a missing one (nan) as None: the JSON report stays valid JSON."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in figures.items()}


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def _quarters(rows: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """The mean of ``key`` over the first and over the last quarter of the rows that have it."""
    have = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if not have:
        return math.nan, math.nan
    n = max(1, len(have) // 4)
    return _mean(have[:n]), _mean(have[-n:])


def _change(first: dict, last: dict, label: str) -> tuple[float, float, float]:
    """(first mean, last mean, change in standard errors; nan without standard errors)."""
    m0, m1 = first.get(f"eval/{label}/mean", math.nan), last.get(f"eval/{label}/mean", math.nan)
    spread = math.hypot(first.get(f"eval/{label}/sem", math.nan), last.get(f"eval/{label}/sem", math.nan))
    return m0, m1, ((m1 - m0) / spread if spread > 0 else math.nan)


def _moved(se: float, m0: float, m1: float) -> int:
    """+1 rose, -1 fell, 0 within the noise (without a standard error: any change counts)."""
    if math.isnan(se):
        return 0 if m1 == m0 or math.isnan(m1 - m0) else (1 if m1 > m0 else -1)
    return 1 if se >= SIGNIFICANT_SE else -1 if se <= -SIGNIFICANT_SE else 0


def _shown(m0: float, m1: float, se: float) -> str:
    return f"{m0:.4f} -> {m1:.4f}" + ("" if math.isnan(se) else f" ({se:+.1f} SE)")


def evaluation_checks(rows: list[dict[str, Any]], optimised: Sequence[str]) -> list[Check]:
    """The held-out evaluation's signs: each optimised reward, each judge, the artefact measure."""
    evals = [r for r in rows if is_evaluation(r)]
    labels = sorted({k.split("/")[1] for r in evals for k in r if k.startswith("eval/") and k.endswith("/mean")})
    if len(evals) < 2:  # a recipe that evaluates nothing chose so ([prompts].num_eval = 0): said, not warned
        return [Check(HELD_OUT, "evaluations", "ok",
                      "none logged: nothing held out to judge the run by ([prompts].num_eval, [log].eval_every)"
                      if not evals else "one so far: nothing to compare yet")]
    first, last = evals[0], evals[-1]
    span = f"iteration {first['iteration']} -> {last['iteration']}"
    checks, rose = [], []
    for label in [l for l in optimised if l in labels]:
        m0, m1, se = _change(first, last, label)
        moved = _moved(se, m0, m1)
        if moved > 0:
            rose.append(label)
        detail = {1: "rose", 0: "no change beyond the noise", -1: "fell: the policy got worse at what it is trained "
                  "for, on held-out prompts; open the images, and lower the learning rate or add a KL term"}[moved]
        checks.append(Check(HELD_OUT, f"{label} (optimised)", "warn" if moved < 0 else "ok",
                            f"{_shown(m0, m1, se)}, {span}: {detail}", _numbers(first=m0, last=m1, change_se=se)))
    for label in [l for l in labels if l not in optimised and l != ARTEFACT]:
        m0, m1, se = _change(first, last, label)
        moved = _moved(se, m0, m1)
        if moved < 0 and rose:
            detail = (f"fell while {', '.join(rose)} rose: the reward-hacking signature (the policy learns what the "
                      "optimised reward likes, not what the prompt asks); open the images")
        elif moved < 0:
            detail = "fell"
        else:
            detail = "rose" if moved > 0 else "no change beyond the noise"
        checks.append(Check(HELD_OUT, f"{label} (judge, not optimised)", "warn" if moved < 0 else "ok",
                            f"{_shown(m0, m1, se)}: {detail}",
                            {**_numbers(first=m0, last=m1, change_se=se), "hacking": bool(moved < 0 and rose)}))
    if ARTEFACT in labels:
        m0, m1, _ = _change(first, last, ARTEFACT)
        grew = m1 >= HF_SHARE_FACTOR * m0 and m1 - m0 >= HF_SHARE_RISE
        detail = (f"{m0:.3f} -> {m1:.3f} ({m1 / m0:.1f}x): the images gained high-frequency energy; a pixel-scale "
                  "texture (a checkerboard) is the usual cause; open the images" if grew and m0 > 0 else
                  f"{m0:.3f} -> {m1:.3f}")
        checks.append(Check(HELD_OUT, "high-frequency share", "warn" if grew else "ok", detail,
                            _numbers(first=m0, last=m1)))
    return checks


def training_checks(rows: list[dict[str, Any]], optimised: Sequence[str]) -> list[Check]:
    """The training rows' signs: the rewards' trend and spread, equal-reward groups, the clip,
    skipped steps."""
    train = [r for r in rows if "loss" in r]
    if not train:
        return [Check(TRAINING, "iterations", "warn", "no training row logged yet")]
    checks = [Check(TRAINING, "iterations", "ok", f"{len(train)} rows, the last of iteration {train[-1]['iteration']}"
                    + ("; the run ended with its final evaluation" if rows and rows[-1].get("final") else ""))]
    for label in optimised:
        early, late = _quarters(train, f"reward/{label}/mean")
        if not math.isnan(early):
            checks.append(Check(TRAINING, f"{label} (training reward)", "ok",
                                f"{early:.4f} early -> {late:.4f} late (rollouts on training prompts: read it beside "
                                "the held-out evaluation)", _numbers(early=early, late=late)))
        s0, s1 = _quarters(train, f"reward/{label}/std")
        if s0 > 0 and s1 < SPREAD_COLLAPSE * s0:
            checks.append(Check(TRAINING, f"{label} spread", "warn",
                                f"the spread of rewards within an iteration fell {s0:.4f} -> {s1:.4f}: the samples "
                                "converge (mode collapse, or a saturated reward) and groups carry little advantage",
                                _numbers(early=s0, late=s1)))
    _, equal = _quarters(train, "groups/all_equal_fraction")
    if not math.isnan(equal):
        checks.append(Check(TRAINING, "equal-reward groups", "warn" if equal >= EQUAL_GROUPS else "ok",
                            f"{equal:.0%} of groups late in the run" + (
                                ": their advantages are zero and they train nothing; the reward is saturated or too "
                                "coarse (a continuous reward, larger groups or harder prompts help)"
                                if equal >= EQUAL_GROUPS else ""), _numbers(late=equal)))
    _, clip = _quarters(train, "clip_fraction")
    if not math.isnan(clip):
        checks.append(Check(TRAINING, "clip", "warn" if clip >= CLIP_ACTIVE else "ok",
                            f"acts on {clip:.1%} of units late in the run" + (
                                ": each step moves the policy far from the rollout's; lower the learning rate or "
                                "take fewer optimizer steps per rollout" if clip >= CLIP_ACTIVE else ""),
                            _numbers(late=clip)))
    skipped = max((r.get("nonfinite_steps", 0) or 0 for r in train), default=0)
    checks.append(Check(TRAINING, "non-finite steps", "warn" if skipped else "ok",
                        f"{skipped} optimizer step(s) skipped for a non-finite gradient" if skipped else "none skipped",
                        {"skipped": skipped}))
    return checks


def optimised_labels(recipe) -> list[str]:
    """The labels of the rewards a run trains on: a weight, or weights per chunk (``chunk_weights``);
    none for an offline run (``[data]``: SFT / DPO on a table), whose evaluated rewards are all
    judges."""
    if recipe.data.enabled:
        return []
    return [r.label for r in recipe.rewards if r.weight or any(r.chunk_weights)]


def run_health(rows: list[dict[str, Any]], optimised: Sequence[str]) -> list[Check]:
    """Every check of a run's metrics rows; ``optimised``: the labels of the rewards it trains on
    (weight != 0)."""
    return [*evaluation_checks(rows, optimised), *training_checks(rows, optimised)]
