"""A reference curve from a finished `flowrl sweep` of one recipe over seeds (flowrl/reference_curves.py).

::

    flowrl sweep recipes/quickstart.toml --seed-list 42,43,44 -o runs/reference_quickstart
    python scripts/reference_curves.py runs/reference_quickstart -o recipes/reference/quickstart.json

Every run of the sweep must have finished (its final evaluation written) and have the same
settings but the seed; the reference keeps, per held-out metric and evaluated iteration, the
seeds' mean, lowest and highest value. `flowrl plot` and `flowrl diagnose` then hold any run of
the recipe with the same settings against it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tomllib
from pathlib import Path

from flowrl.errors import FlowrlError
from flowrl.reference_curves import build_reference, write_reference
from flowrl.runlog import read_metrics


def sweep_runs(sweep_dir: Path) -> list[tuple[int, dict, list[dict]]]:
    """``(seed, resolved recipe, metrics rows)`` of every run of a finished sweep, by seed."""
    try:
        spec = json.loads((sweep_dir / "sweep.json").read_text())
    except (OSError, ValueError) as exc:
        raise FlowrlError(f"{sweep_dir} is not a sweep directory ({exc})", hint="give the -o of `flowrl sweep`") from None
    runs = []
    for run in spec["runs"]:
        if run.get("status") != "done":
            raise FlowrlError(f"{run['id']} has not finished ({run.get('status')})",
                              hint=f"finish the sweep first: `flowrl sweep --resume {sweep_dir}`")
        run_dir = sweep_dir / run["dir"]
        resolved = tomllib.loads((run_dir / "recipe.toml").read_text())
        runs.append((int(run["seed"]), resolved, read_metrics(run_dir)))
    return sorted(runs, key=lambda r: r[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a finished `flowrl sweep` directory of one recipe over seeds")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the reference file to write (JSON)")
    args = parser.parse_args(argv)
    try:
        runs = sweep_runs(args.sweep_dir)
        names = {r[1].get("run", {}).get("name", "") for r in runs}
        when = datetime.date.today().isoformat()
        reference = build_reference(runs, recipe=names.pop() if len(names) == 1 else "",
                                    measured=f"{when}, {platform.machine()} CPU, `flowrl sweep` in {args.sweep_dir}")
    except FlowrlError as exc:
        print(f"error: {exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return 2
    write_reference(args.output, reference)
    print(f"wrote {args.output}: {', '.join(reference['metrics'])} over seeds {reference['seeds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
