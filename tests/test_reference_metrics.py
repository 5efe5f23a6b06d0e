"""The quickstart's metrics are bit-identical to the reference made before the loop redesign.

tests/fixtures/reference/quickstart_metrics.jsonl was written by flowrl at commit 06b93d1 (the
engine before flowrl/train/ existed), in its own clean venv, with::

    OMP_NUM_THREADS=1 flowrl train recipes/quickstart.toml -o DIR --set log.progress=false

Bits depend on the machine as well as the code: torch picks CPU kernels by instruction set and
shape, so the same commit gives other last bits on another CPU (06b93d1's own first reference,
made on an earlier CI machine, differs from what 06b93d1 computes on today's in row 0's
``grad_norm``). The machine the reference was made on is recorded beside it
(``environment.json``: torch version, torch's CPU capability, the CPU's vector extensions); the
bitwise test runs where the machine matches and says why it skips where it does not, and the
float-tolerance test below runs everywhere. To move the reference to a new machine, run the command
above at 06b93d1 there and write ``environment.json`` with ``python tests/test_reference_metrics.py``.

Every row, key order and value must be the same today, except the wall-clock ``time/*`` fields and
the keys added since (``compute/*``, listed below). The recipe is pinned here
(``tests/fixtures/reference/quickstart.toml``, the quickstart of that commit, shipped today as
``recipes/quickstart_hacking.toml``), so changing the shipped quickstart does not move the reference. The redesign kept the algorithm's arithmetic
exactly; the fast path added later (the first optimizer step after a rollout skips the
lean update's re-scoring forwards) computes the same gradient from the log-probs of its grad
forwards instead, which can differ in the last bits where rollout and re-scoring round differently.
So the bitwise comparison runs the exact lean path (``fast_path = false``, ``update_mode = "lean"``), and a second
test holds the default run to the reference within float tolerance.

The tests run the pinned recipe for the first ``ITERATIONS`` (3) of the reference's 30
iterations (about 10 s each on one CPU thread instead of 95 s), with the checkpoint and the image
grid every ``EVERY`` (2) iterations instead of 10, and compare with the reference's first rows.
That passes through every phase of the recipe: evaluation (every iteration), the group image grid
at iteration 0 with training going on after it, a checkpoint after 2 iterations with iteration 2
trained after it (a phase that disturbed the RNG or the optimizer would show in row 2), the image
at iteration 2, the last iteration's checkpoint and the final evaluation. Moving the checkpoint and
the image changes no logged bit: neither touches the RNG or the weights, and the rows (past the
``time/*`` fields) record neither. A shorter run is the longer run's prefix, at 06b93d1 as today: the only use
of the total iteration count besides the loop's bound and the ``last`` flag (images, checkpoint,
final evaluation; none of them touches the RNG or the weights) is the LR schedule's length, and the
recipe's schedule is constant (``lr`` is in every row). The final evaluation is the same call on
the same fixed prompts and noises as the per-iteration one, so the 11-iteration run's final row is
the reference's row 3 evaluation (``iteration``, ``final`` and the ``eval/*`` values, in the
reference final row's key order), compared bit for bit too.

The fast-path test runs the same 3 iterations with the default update and holds every value of
every row to the reference: within float tolerance where the reference's machine is this one,
and on another machine (whose last bits differ from the first row and grow with training) the
learning curve within its noise. Measured here (2026-11-26, 12 iterations): every reward and
evaluation value equal to the reference bit for bit; ``grad_norm`` within 7.1e-7 relative, the
ratios' extremes within one float32 ulp of 1, and quantities that are zero up to rounding
(on-policy log-ratio, ``loss``, ``approx_kl_old``) within 3e-7 absolute. A wrong coefficient in the
fast path moves ``grad_norm`` in row 0 by far more, so the test needs no longer run (it used to run
all 30 iterations and compare only the reward curve, which a scaled gradient barely moves in 30
iterations); the unit tests in ``tests/objectives/test_chunk_gradient.py`` pin its gradient to the
lean update's. The two runs share no work: they part at the first update.
"""

from __future__ import annotations

import pytest

import contextlib
import json
import math
from pathlib import Path

from rich.console import Console

from flowrl.recipe import load_recipe
from flowrl.runlog import read_metrics
from flowrl.train import train

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "fixtures" / "reference" / "quickstart_metrics.jsonl"
ENVIRONMENT = REFERENCE.parent / "environment.json"
#: How many of the reference's iterations the tests run, and how often they checkpoint and draw the
#: image grid meanwhile (the module docstring says why 3 and 2).
ITERATIONS, EVERY = 3, 2


def machine() -> dict:
    """What decides the last bits of a CPU run besides flowrl's code."""
    import platform

    import torch

    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(),
            "vector_extensions": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse")))}


#: Metric keys added after the reference was made, and by which change.
ADDED = ("compute/",  # compute accounting
         "diag/", "groups/",  # update diagnostics: log-ratio spread per step and unit, zero-advantage groups
         "eval/hf_share/")  # the evaluation's artefact measure (flowrl.artefacts)


def _records(rows: list[dict]) -> list[dict]:
    """Each row without its timings and without the keys added since the reference."""
    out = []
    for record in rows:
        assert all(k in REFERENCE_KEYS or k.startswith(("time/", *ADDED)) for k in record), set(record) - REFERENCE_KEYS
        out.append({k: v for k, v in record.items() if not k.startswith(("time/", *ADDED))})
    return out


#: The reference's rows. A fixture file, not a run directory (``read_metrics`` reads a run's
#: ``metrics.jsonl``): parsed here line by line as ``read_metrics`` parses a run's.
REFERENCE_ROWS = [json.loads(line) for line in REFERENCE.read_text().splitlines() if line.strip()]
REFERENCE_KEYS = {k for row in REFERENCE_ROWS for k in row}


def _quickstart(tmp_path, *overrides: str) -> list[dict]:
    recipe = load_recipe(REFERENCE.parent / "quickstart.toml",
                         [f"run.output_dir={str(tmp_path / 'run')!r}", "log.progress=false", f"train.iterations={ITERATIONS}",
                          f"checkpoint.every={EVERY}", f"log.image_every={EVERY}", *overrides])
    run = train(recipe, console=Console(quiet=True))
    # every phase the module docstring lists took place mid-run, not only at the end
    assert (run / "checkpoints" / f"iter_{EVERY:06d}" / "model.safetensors").is_file()
    assert (run / "images" / "iter_000000.png").is_file() and (run / "images" / f"iter_{EVERY:06d}.png").is_file()
    return _records(read_metrics(run))


def _reference_prefix() -> list[dict]:
    """What the pinned recipe run for ``ITERATIONS`` iterations writes (module docstring): the
    reference's first rows, then its final row with the evaluation of the policy after
    ``ITERATIONS`` iterations, which the full run logged at the start of that iteration."""
    rows = _records(REFERENCE_ROWS)
    assert len(rows) == 31 and rows[-1]["final"] and rows[-1]["iteration"] == 30
    assert EVERY < ITERATIONS < 30  # past a checkpoint and an image, and a prefix
    after = rows[ITERATIONS]
    final = {k: ITERATIONS if k == "iteration" else True if k == "final" else after[k] for k in rows[-1]}
    return rows[:ITERATIONS] + [final]


def test_quickstart_metrics_equal_the_pre_redesign_reference(tmp_path):
    recorded, here = json.loads(ENVIRONMENT.read_text()), machine()
    if recorded != here:
        import pytest

        pytest.skip(f"the reference's bits were made on another machine: {recorded} here {here}")
    got = _quickstart(tmp_path, "train.fast_path=false", "train.update_mode='lean'")
    want = _reference_prefix()
    assert len(got) == len(want) == ITERATIONS + 1
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = json.dumps(g), json.dumps(w)  # key order and every bit of every value
        assert g == w, f"row {i} differs:\n  got  {g[:300]}\n  want {w[:300]}"


@pytest.mark.slow
def test_quickstart_with_the_fast_path_stays_on_the_reference(tmp_path):
    """The default run (fast path) computes the same gradients from log-probs that may differ
    from the lean path's in the last bits (module docstring): every row, key and value as the
    reference's, floats within rounding where the reference was made on this machine, and on
    another the learning curve: every reward and evaluation mean within 1% of the reference or
    within the standard error of the reference's own mean."""
    recipe = load_recipe(REFERENCE.parent / "quickstart.toml")
    samples = recipe.train.prompts_per_iteration * recipe.train.group_size
    same_machine = json.loads(ENVIRONMENT.read_text()) == machine()
    got, want = _quickstart(tmp_path), _reference_prefix()
    assert len(got) == len(want) == ITERATIONS + 1
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), f"row {i}: keys differ"
        # every update of the quickstart is one on-policy step: the fast path re-scores nothing
        assert g.get("recompute_mismatch", 0.0) == 0.0, (i, g["recompute_mismatch"])
        for key, value in w.items():
            if same_machine:
                if isinstance(value, float):
                    assert math.isclose(g[key], value, rel_tol=1e-5, abs_tol=1e-6), (i, key, g[key], value)
                elif key != "recompute_mismatch":
                    assert g[key] == value, (i, key, g[key], value)
            elif key.endswith("/mean") and key.startswith(("reward/", "eval/")):
                stem = key[: -len("/mean")]
                standard_error = w[f"{stem}/sem"] if stem.startswith("eval/") else w[f"{stem}/std"] / math.sqrt(samples)
                assert math.isclose(g[key], value, rel_tol=1e-2, abs_tol=standard_error), (i, key, g[key], value)


if __name__ == "__main__":  # record this machine as the reference's (after regenerating it here)
    ENVIRONMENT.write_text(json.dumps(machine(), indent=2) + "\n")
    print(f"wrote {ENVIRONMENT}")
