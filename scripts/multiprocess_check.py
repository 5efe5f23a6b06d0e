"""The quickstart geometry trained in 1 process and in 2, through every launcher, row by row.

An outside check that drives only the command line, as a user would: the shipped quickstart
(``recipes/quickstart.toml``: 4 prompts x 8 samples per iteration, its held-out evaluation of 18
prompts x 6 noises) for a few iterations with evaluation, images and a checkpoint every
iteration, once in one process and then in two processes under ``ddp`` and under ``fsdp2``, each
through ``flowrl train --num-processes 2``, ``torchrun`` and ``accelerate launch``. Every metrics
row of every 2-process run must equal the 1-process run's within float tolerance (the processes
sum gradients in another order), every checkpoint must say ``world_size`` 2, and the ``fsdp2``
checkpoints must hold real shards (``sharded/``, no gathered ``model.safetensors``).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/multiprocess_check.py --iterations 2 --out /tmp/mp

Prints one line per run and exits 1 on any difference. Minutes on a 2-core CPU machine (7 runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.toml"
#: Keys that may differ between process counts: wall-clock times, and the world size itself.
SKIP = ("time/", "speed/", "world_size")


def flowrl_args(recipe: Path, out: Path, iterations: int, strategy: str | None) -> list[str]:
    sets = [f"train.iterations={iterations}", "log.eval_every=1", "log.image_every=1", "checkpoint.every=1",
            "log.progress=false"]
    if strategy:
        sets.append(f"distributed.strategy='{strategy}'")
    return ["train", str(recipe), "-o", str(out), *[a for s in sets for a in ("--set", s)]]


def commands(launcher: str, args: list[str]) -> list[str]:
    python = sys.executable
    if launcher == "single":
        return [python, "-m", "flowrl", *args]
    if launcher == "flowrl":
        return [python, "-m", "flowrl", *args, "--num-processes", "2"]
    if launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "flowrl", *args]
    if launcher == "accelerate":
        # accelerate's GPU launchers are torch.distributed.run with its settings in the environment;
        # on a CPU flowrl's processes use gloo. (`--cpu` would start one process: accelerate's
        # multi-CPU launch needs mpirun.) Under fsdp2 accelerate must say FSDP2 too, else flowrl
        # refuses the disagreement (docs/distributed.md).
        mode = ["--use_fsdp", "--fsdp_version", "2"] if "distributed.strategy='fsdp2'" in args else ["--multi_gpu"]
        return [python, "-m", "accelerate.commands.launch", *mode, "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "flowrl", *args]
    raise ValueError(launcher)


def rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(SKIP)}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def differences(a: list[dict], b: list[dict], rtol: float = 1e-4, atol: float = 1e-6) -> list[str]:
    out = []
    if len(a) != len(b):
        return [f"{len(a)} rows against {len(b)}"]
    for i, (x, y) in enumerate(zip(a, b)):
        if sorted(x) != sorted(y):
            out.append(f"row {i}: keys {sorted(set(x) ^ set(y))}")
            continue
        for key in x:
            u, v = x[key], y[key]
            if key.startswith("compute/"):
                continue  # counts of forwards: FSDP2's lockstep stand-ins may add work (never remove it)
            if isinstance(u, float) or isinstance(v, float):
                if not math.isclose(u, v, rel_tol=rtol, abs_tol=atol):
                    out.append(f"row {i}: {key} {u!r} != {v!r}")
            elif u != v:
                out.append(f"row {i}: {key} differs")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/flowrl_multiprocess_check"))
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--only", nargs="*", default=None, metavar="RUN",
                        help="only these 2-process runs (e.g. fsdp2_torchrun ddp_accelerate); the 1-process run always")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [("single", None), *[(launcher, strategy) for strategy in ("ddp", "fsdp2")
                                 for launcher in ("flowrl", "torchrun", "accelerate")]]
    reference, failed = None, 0
    for launcher, strategy in runs:
        name = launcher if strategy is None else f"{strategy}_{launcher}"
        if strategy is not None and args.only is not None and name not in args.only:
            continue
        out = args.out / name
        start = time.monotonic()
        proc = subprocess.run(commands(launcher, flowrl_args(args.recipe, out, args.iterations, strategy)),
                              cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            print(f"{name:20s} FAILED (exit {proc.returncode}, {seconds:.0f} s)\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
            failed += 1
            continue
        got = rows(out)
        problems = [] if reference is None else differences(got, reference)
        checkpoints = sorted((out / "checkpoints").glob("iter_*"))
        states = [json.loads((c / "state.json").read_text()) for c in checkpoints]
        if strategy is not None and any(s["world_size"] != 2 for s in states):
            problems.append("a checkpoint's world_size is not 2")
        if strategy == "fsdp2" and not all((c / "sharded").is_dir() and not (c / "model.safetensors").exists()
                                           for c in checkpoints):
            problems.append("an fsdp2 checkpoint without shards, or with gathered weights")
        evals = sum(1 for r in got if any(k.startswith("eval/") for k in r))
        print(f"{name:20s} {'ok' if not problems else 'DIFFERS'}  {len(got)} rows ({evals} with evaluation), "
              f"{len(checkpoints)} checkpoints, {seconds:.0f} s")
        for p in problems[:10]:
            print(f"    {p}")
        failed += bool(problems)
        if reference is None:
            reference = got
    print("all runs agree" if not failed else f"{failed} run(s) failed or differ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
