"""Reference curves: what a recipe's held-out evaluation did over several seeds, to hold a run against.

Is my run healthy, or just noisy? A reference is the held-out evaluation of a recipe measured
over several seeds, iteration by iteration: per evaluated metric the mean and the lowest and
highest seed. ``flowrl plot RUN_DIR`` draws the band behind the run's curve, and ``flowrl diagnose``
says where the run's last evaluation falls against it, whenever a reference applies to the run:
one shipped for its recipe (``recipes/reference/<run.name>.json``) or one given with
``--reference``. A reference applies only to a run of the same resolved recipe (the seed, where
it writes, what it logs and checkpoints aside, :data:`IGNORED`); otherwise the keys that differ
are named and nothing is drawn, since a band of other settings says nothing about this run. The
keys compared are the reference's: a setting flowrl gained after the reference was measured is
taken to hold its default. Paths inside the checkout compare relative to it, so a reference
measured in one clone applies in another.

A reference file is JSON: ``format``, ``recipe`` (the run name), ``seeds``, ``regime`` (the
resolved recipe, :data:`IGNORED` left out), ``measured`` (where and when), and ``metrics``:
``{"eval/<label>/mean": {"iterations": [...], "mean": [...], "low": [...], "high": [...]}}``.
``scripts/reference_curves.py`` writes one from the runs of a ``flowrl sweep``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .artefacts import ARTEFACT_MEASURES
from .check_result import Check
from .errors import FlowrlError
from .files import write_text_atomic
from .run_health import HELD_OUT, is_evaluation

FORMAT = 1
#: resolved-recipe keys that do not change what a run learns: left out of the comparison
IGNORED = {"run": ("seed", "output_dir", "device", "name"), "log": ("progress", "image_every", "every"),
           "checkpoint": None, "trackers": None}
#: the checkout, and where its shipped references live (a recipe's: ``<run.name>.json``)
CHECKOUT = Path(__file__).resolve().parents[1]
SHIPPED = CHECKOUT / "recipes" / "reference"


def _checkout_relative(value):
    if isinstance(value, dict):
        return {k: _checkout_relative(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_checkout_relative(v) for v in value]
    if isinstance(value, str) and value.startswith(f"{CHECKOUT}/"):
        return "<checkout>/" + value[len(str(CHECKOUT)) + 1:]
    return value


def regime(resolved: dict[str, Any]) -> dict[str, Any]:
    """A resolved recipe (``Recipe.to_toml_dict()`` or a run's ``recipe.toml``) without :data:`IGNORED`,
    its paths inside the checkout relative to it."""
    out = _checkout_relative(json.loads(json.dumps(resolved, default=str)))
    for table, keys in IGNORED.items():
        if keys is None:
            out.pop(table, None)
        else:
            for key in keys:
                out.get(table, {}).pop(key, None)
    return out


def build_reference(runs: Sequence[tuple[int, dict[str, Any], list[dict[str, Any]]]], *, recipe: str,
                    measured: str) -> dict[str, Any]:
    """The reference of ``runs``: ``(seed, resolved recipe, metrics rows)`` of one recipe over seeds.
    Their regimes must be equal, and the evaluations at the same iterations."""
    if len(runs) < 2:
        raise FlowrlError(f"a reference needs runs of at least 2 seeds, got {len(runs)}")
    regimes = [regime(r) for _, r, _ in runs]
    for (seed, _, _), other in zip(runs[1:], regimes[1:]):
        if other != regimes[0]:
            raise FlowrlError(f"seed {seed}'s run differs from seed {runs[0][0]}'s in "
                              f"{', '.join(differences(regimes[0], other)[:6])}: one reference is one recipe")
    curves = [_evaluations(rows) for _, _, rows in runs]
    keys = sorted(set.intersection(*(set(c) for c in curves)))
    metrics = {}
    for key in keys:
        iterations = [it for it, _ in curves[0][key]]
        if any([it for it, _ in c[key]] != iterations for c in curves):
            raise FlowrlError(f"the runs evaluated {key} at different iterations: finish every run first")
        values = list(zip(*[[v for _, v in c[key]] for c in curves]))
        metrics[key] = {"iterations": iterations, "mean": [sum(v) / len(v) for v in values],
                        "low": [min(v) for v in values], "high": [max(v) for v in values]}
    if not metrics:
        raise FlowrlError("the runs logged no held-out evaluation ([prompts].num_eval = 0): nothing to refer to")
    return {"format": FORMAT, "recipe": recipe, "seeds": [s for s, _, _ in runs], "measured": measured,
            "regime": regimes[0], "metrics": metrics}


def _evaluations(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """``{eval/<label>/mean: [(iteration, value)]}``; the final evaluation counts at its iteration."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if not is_evaluation(row):
            continue
        for key, value in row.items():
            if key.startswith("eval/") and key.endswith("/mean") and isinstance(value, (int, float)):
                points = out.setdefault(key, [])
                if not points or points[-1][0] != row["iteration"]:
                    points.append((int(row["iteration"]), float(value)))
    return out


def write_reference(path: Path, reference: dict[str, Any]) -> None:
    write_text_atomic(Path(path), json.dumps(reference, indent=1) + "\n")


def read_reference(path: Path) -> dict[str, Any]:
    """A reference file, checked; one message when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT or not isinstance(data.get("metrics"), dict):
            raise ValueError(f"format {data.get('format')!r}, this flowrl reads {FORMAT}")
        if not isinstance(data.get("regime"), dict) or not isinstance(data.get("seeds"), list):
            raise ValueError("no 'regime' table or 'seeds' list")
        for key, curve in data["metrics"].items():
            if not all(len(curve[k]) == len(curve["iterations"]) for k in ("mean", "low", "high")):
                raise ValueError(f"{key}: curves of different lengths")
            numbers = [v for k in ("iterations", "mean", "low", "high") for v in curve[k]]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
                raise ValueError(f"{key}: a curve holds a value that is not a number")
    except FileNotFoundError:
        raise FlowrlError(f"reference not found: {path}", where="--reference",
                          hint="give a reference file (scripts/reference_curves.py writes one from a sweep)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FlowrlError(f"{path} is not a reference file ({exc})", where="--reference",
                          hint="write it with scripts/reference_curves.py from a finished sweep") from None
    return data


def differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested tables."""
    out = []
    for key in sorted(set(a) | set(b), key=str):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}")
    return out


def shipped_reference(run_name: str) -> Path | None:
    """The shipped reference of a recipe's ``run.name``, if there is one."""
    path = SHIPPED / f"{run_name}.json"
    return path if path.is_file() else None


def applies(reference: dict[str, Any], resolved: dict[str, Any]) -> list[str]:
    """The reference's keys whose values a run's resolved recipe does not share (empty: it applies)."""
    return differences(reference["regime"], _only(regime(resolved), reference["regime"]))


def _only(table: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    """``table`` cut to the keys of ``keys`` (nested tables alike)."""
    out = {}
    for key, value in table.items():
        if key not in keys:
            continue
        out[key] = _only(value, keys[key]) if isinstance(value, dict) and isinstance(keys[key], dict) else value
    return out


def reference_for(run_dir: Path, given: Path | None = None) -> tuple[dict[str, Any] | None, str]:
    """The reference that applies to a run, and a line saying which (or why none is used): the
    ``given`` file, else the run's recipe's shipped one (no line when it has none)."""
    import tomllib

    try:
        resolved = tomllib.loads((Path(run_dir) / "recipe.toml").read_text())
    except (OSError, ValueError):
        return None, "no reference: the run directory has no readable recipe.toml" if given else ""
    if given is not None:
        path = Path(given)
    else:
        path = shipped_reference(str(resolved.get("run", {}).get("name", "")))
        if path is None:
            return None, ""
    reference = read_reference(path)
    differ = applies(reference, resolved)
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        return None, f"reference {path} not used: it was measured with other settings ({shown})"
    return reference, f"reference: {path}, {seeds_text(reference)}"


def seeds_text(reference: dict[str, Any]) -> str:
    seeds = reference["seeds"]
    return f"{len(seeds)} seeds ({', '.join(str(s) for s in seeds)})"


def reference_checks(rows: list[dict[str, Any]], reference: dict[str, Any], source: str) -> list[Check]:
    """The run's last held-out evaluation of each metric the reference holds at that iteration:
    within the seeds' range (ok), or below or above it (warn below: this run learned less than
    every reference seed did by then)."""
    evals = [r for r in rows if is_evaluation(r)]
    if not evals:
        return []
    last = evals[-1]
    checks = []
    for key, curve in sorted(reference["metrics"].items()):
        if key not in last or last["iteration"] not in curve["iterations"]:
            continue
        i = curve["iterations"].index(last["iteration"])
        value, low, high, mean = float(last[key]), curve["low"][i], curve["high"][i], curve["mean"][i]
        label = key[len("eval/"):-len("/mean")]
        band = f"{low:.3f} to {high:.3f} over the reference's {seeds_text(reference)}, mean {mean:.3f}"
        if label in ARTEFACT_MEASURES:  # lower is cleaner: above the range is the sign
            bad, why = value > high, "more high-frequency energy than every reference seed's images; open the images"
        else:
            bad, why = value < low, "this run is behind every reference seed; compare the settings and open the images"
        if math.isnan(value) or bad:
            status, said = "warn", (f"{value:.3f} at iteration {last['iteration']}, "
                                    f"{'above' if label in ARTEFACT_MEASURES else 'below'} {band}: {why}")
        else:
            status, said = "ok", f"{value:.3f} at iteration {last['iteration']}, " + (
                f"above {band}" if value > high else f"within {band}")
        checks.append(Check(HELD_OUT, f"{label} against the reference", status, said,
                            {"value": value, "low": low, "high": high, "mean": mean, "reference": source}))
    return checks
