"""Every command in docs/sweep.md runs as written.

`flowrl sweep RECIPE ...` examples run with --dry-run added (they would train for minutes; real
sweeps are tested in test_sweep.py). The sweep directories the other examples read are made
here: runs/lr_sweep as the first example defines it, every run done, with synthetic metrics.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from flowrl.sweeps import (
    MANIFEST_VERSION,
    sha256_of,
    command_line,
    parse_grid,
    parse_variant,
    plan_runs,
    write_manifest,
)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "sweep.md"


def doc_commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("flowrl "):
                commands.append(shlex.split(line)[1:])
    return commands


def _fake_sweep(root: Path, argv: list[str]) -> None:
    """Write the manifest `flowrl sweep argv` would end with, every run done with 4 evaluations."""
    args = {"--grid": [], "--variant": [], "--seeds": "1", "-o": None}
    it = iter(argv[2:])
    for a in it:
        value = next(it)
        if isinstance(args.get(a), list):
            args[a].append(value)
        elif a in args:
            args[a] = value
    recipe = argv[1]
    variants = [parse_variant(v) for v in args["--variant"]]
    grid = parse_grid(args["--grid"])
    seeds = [42 + k for k in range(int(args["--seeds"]))]
    spec = {"recipe": recipe, "recipe_sha256": sha256_of(root / recipe), "sets": [], "grid": grid,
            "variants": [{"name": n, "overrides": o} for n, o in variants], "seeds": seeds}
    sweep_dir = root / args["-o"]
    runs = plan_runs(Path(recipe).stem, variants, grid, seeds)
    for k, run in enumerate(runs):
        run.update(status="done", exit_code=0, wall_time_s=100.0 + k, attempts=1, iterations=3)
        run_dir = sweep_dir / run["dir"]
        run_dir.mkdir(parents=True)
        lines = [{"iteration": i, "eval/area/mean": 0.3 + 0.01 * i, "eval/verifier/mean": 0.8 + 0.001 * (i + k),
                  "time/rollout": 10.0 + k, "time/update": 20.0, "time/eval": 3.0} for i in range(3)]
        lines.append({"iteration": 3, "final": True, "eval/area/mean": 0.33, "eval/verifier/mean": 0.81 + 0.001 * k})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
        (run_dir / "recipe.toml").write_text(f'[run]\nseed = {run["seed"]}\n\n[[rewards]]\nuse = "area"\n\n[[rewards]]\nuse = "verifier"\n')
    write_manifest(sweep_dir, {"version": MANIFEST_VERSION, "created": "-", "cwd": str(root), "spec": spec,
                               "command": command_line(spec, Path(args["-o"])), "status": "done", "runs": runs})


def test_every_command_in_docs_sweep_md_runs(tmp_path, flowrl_cli):
    commands = doc_commands()
    assert len(commands) >= 7, commands
    os.symlink(REPO / "recipes", tmp_path / "recipes")
    defined = {}
    calls = []
    for argv in commands:
        if argv[0] == "sweep" and argv[1] != "--resume":
            defined[argv[argv.index("-o") + 1]] = argv
            calls.append(argv + ["--dry-run"])
        else:
            calls.append(argv)
    # the directories the --resume and compare examples read
    _fake_sweep(tmp_path, defined["runs/lr_sweep"])
    _fake_sweep(tmp_path, defined["runs/algos"])
    results = flowrl_cli.in_process(calls, cwd=tmp_path)
    for res in results:
        assert res.returncode == 0, (res.argv, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr
    by_cmd = {" ".join(r.argv): r for r in results}
    resume = next(r for k, r in by_cmd.items() if k.startswith("sweep --resume"))
    assert "6 of 6 run(s) already done" in resume.flat_out
    assert (tmp_path / "runs" / "algos" / "report" / "compare.png").is_file()
    sizes = next(r for k, r in by_cmd.items() if "chunker.sizes" in k)
    assert "6 run(s)" in sizes.flat_out  # 3 sizes x 2 seeds
