"""docs/hardware.md is what `scripts/hardware_table.py` writes today.

The page is `flowrl plan`'s estimate for every shipped recipe at the processes it is written for
(its `[distributed].num_processes`).
It goes stale when a recipe, a model's memory facts or the estimate change: regenerate it with
``python scripts/hardware_table.py``. Planning runs offline (about 35 s here, most of it imports
and the one-block activation measurements).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import script_module

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "hardware_table.py"


@pytest.fixture(scope="module")
def table():
    yield from script_module("hardware_table")


def test_every_recipe_declares_the_processes_its_header_launches(table):
    """The page plans each recipe at its [distributed].num_processes (what `flowrl plan RECIPE`
    uses): a recipe whose header launches `--num-processes N` must declare N, so that the plan,
    the page and the launch command agree (the flagship was once planned at 1)."""
    import re

    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    registry = get_registry()
    launched = {}
    for name in table.recipe_files():
        text = (table.RECIPES / name).read_text(encoding="utf-8")
        counts = {int(n) for n in re.findall(rf"^#\s+flowrl train recipes/{re.escape(name)}\b.*--num-processes (\d+)", text, re.M)}
        if counts:
            launched[name] = counts
    assert len(launched) >= 6, launched  # the multi-GPU recipes' headers are found at all
    wrong = {name: (counts, load_recipe(table.RECIPES / name, [], registry=registry).distributed.num_processes)
             for name, counts in launched.items()}
    wrong = {name: v for name, v in wrong.items() if v[0] != {v[1]}}
    assert not wrong, f"header --num-processes vs [distributed].num_processes: {wrong}"


@pytest.mark.slow
def test_hardware_page_is_current(table):
    # A fresh process, so that the script switches the hub to offline mode before anything
    # imports huggingface_hub: the page must be made without the network.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stderr[-4000:]}\n(the test's command: `{table.COMMAND} --check`)"
    assert "docs/hardware.md is up to date" in proc.stdout
    assert "docs/models.md is up to date" in proc.stdout  # its block of plan figures (the same command)
    assert "docs/distributed.md is up to date" in proc.stdout  # the flagship's figures it discusses


def test_a_recipe_that_cannot_be_planned_is_listed_with_its_reason(table):
    rows = [table.Row("a.toml", "flux", "lora", "auto (ddp)", 8, 30.04, "rollout"),
            table.Row("b.toml", "flux (org/x)", "full", "auto (ddp)", 8, reason="[model].path: cannot read the configs")]
    text = table.render(rows)
    assert "| `a.toml` | flux | lora | auto (ddp) | 8 | 30.0 | rollout | no | yes | yes |" in text
    assert "## Not planned" in text and "- `b.toml` at 8 process(es): [model].path: cannot read the configs" in text
    assert "`b.toml` |" not in text


def test_the_fits_columns_follow_plans_verdict(table):
    # `flowrl plan --gpu-memory G` says "fits" when the peak is at most G x 2^30 bytes
    text = table.render([table.Row("a.toml", "m", "lora", "none", 1, 24.0, "update"),
                         table.Row("b.toml", "m", "lora", "none", 1, 24.01, "update")])
    assert "| 24.0 | update | yes | yes | yes | yes |" in text  # 24, 32, 40 and 80 GB
    assert "| 24.0 | update | no | yes | yes | yes |" in text


def test_every_memory_figure_of_the_models_page_comes_from_the_plan(table):
    """docs/models.md quoted per-GPU figures by hand that the plan no longer gave (every
    memory figure in the docs comes from `flowrl plan`). Its figures now stand in the block the script
    writes; outside it, a figure is a card's size ("an 80 GB GPU"), or one of the plan's own lines
    checked here. A new hand-written figure fails this test: put it in the block."""
    import re

    from flowrl.commands.base import load, registry
    from flowrl.memory_plan import CUDA_OVERHEAD, GB, estimate

    text = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    head, rest = text.split(table.BEGIN, 1)
    outside = " ".join((head + rest.split(table.END, 1)[1]).split())

    def weights(*overrides: str) -> str:
        recipe = load(table.RECIPES / "flux2_klein_nf4_24gb.toml", list(overrides))
        _, _, lines = estimate(recipe, registry(), 1)
        return f"{next(l.bytes for l in lines if l.item == 'denoiser weights') / GB:.2f}"

    nf4, bf16 = weights(), weights('model.quantize="none"')
    checked = {f"{CUDA_OVERHEAD / GB:g} GB of CUDA context": "the plan's CUDA overhead",
               f"= {nf4} GB ({bf16} GB in bf16)": "the NF4 klein denoiser's weights"}
    for phrase, what in checked.items():
        assert phrase in outside, (what, phrase)
        outside = outside.replace(phrase, "")
    figures = re.findall(r"(\d+(?:\.\d+)?) ?GB(?! (?:GPU|card))", outside)
    assert not figures, f"memory figures in docs/models.md outside the generated block: {figures}"


#: Figures in the docs that are not memory estimates of a run, each with what it is (the page,
#: the phrase). Anything else "N GB" outside a generated block fails the test below.
NOT_ESTIMATES = {
    ("docs/install.md", "23.5 GB RAM"): "the machine's RAM in a sample of `flowrl doctor`'s output",
    ("docs/install.md", "/dev/shm: 23.5 GiB"): "the machine's shared memory in a sample of `flowrl doctor`'s output",
    ("docs/distributed.md", "`/dev/shm` (at least 1 GiB"): "doctor's threshold for shared memory "
                                                           "(tests/diagnostics/test_nodes.py holds it to the code)",
    ("docs/install.md", "below 4096 files and 1 GiB"): "doctor's thresholds (tests/diagnostics/test_nodes.py holds "
                                                        "them to the code)",
    ("docs/reference.md", "saves ~9.5 GB"): "the T5 encoder's size, in a model field's help text (from its code)",
    ("docs/reference.md", "downloads HPSv3.safetensors, 16.5 GB"): "a download's size",
    ("docs/rewards.md", "downloads 16.5 GB"): "a download's size",
    ("docs/rewards.md", "1.7 GB on disk"): "an environment's size on disk",
    ("README.md", "78 packages, 2.8 GB"): "the CPU install's download, measured with pip's resolver",
    ("README.md", "2.2 GB of it 19 CUDA packages"): "the CUDA packages' download, measured with pip's resolver",
    ("README.md", "59 packages, 0.28 GB"): "the CPU build's download, measured with pip's resolver",
}
#: Pages the test leaves to others: generated whole, or dated measurements.
OTHER_PAGES = {
    "docs/hardware.md": "generated whole by the script (test_hardware_page_is_current)",
    "docs/gpu_runs.md": "generated whole by scripts/gpu_runs_table.py from GPU results files: device names as "
                        "recorded (\"NVIDIA H100 80GB HBM3\"), measured figures, no plan figures",
    "docs/benchmarks.md": "measured results, each with its command, date and machine; a plan figure there is the "
                          "plan's at that date, beside what the measurement found",
}


def _doc_pages() -> list[str]:
    return ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", [p for p in _doc_pages() if p not in OTHER_PAGES])
def test_every_memory_figure_in_the_docs_comes_from_the_plan(table, page):
    """Every memory figure in the docs is generated from the plan. A page quotes the
    plan's figures only inside a block `scripts/hardware_table.py` writes (checked current by
    test_hardware_page_is_current); outside one, "N GB" is a card's size ("a 40 GB card"), a
    figure the plan computes here (the CUDA overhead, a default GPU size, the NF4 klein weights),
    or one of NOT_ESTIMATES. docs/distributed.md quoted hand-written figures (13.9, ~200, 910,
    550 GB, ...) that went stale when loading changed."""
    import re

    from flowrl.commands.base import DEFAULT_GPU_MEMORY_GB, load, registry
    from flowrl.memory_plan import CUDA_OVERHEAD, GB, estimate

    text = (REPO / page).read_text(encoding="utf-8")
    while table.BEGIN in text:
        head, rest = text.split(table.BEGIN, 1)
        assert table.END in rest, f"{page}: a block of plan figures without its end marker"
        text = head + rest.split(table.END, 1)[1]
    outside = " ".join(text.split())
    checked = {phrase: what for (where, phrase), what in NOT_ESTIMATES.items() if where == page}
    if page == "docs/models.md":
        def weights(*overrides: str) -> str:
            recipe = load(table.RECIPES / "flux2_klein_nf4_24gb.toml", list(overrides))
            _, _, lines = estimate(recipe, registry(), 1)
            return f"{next(l.bytes for l in lines if l.item == 'denoiser weights') / GB:.2f}"

        nf4, bf16 = weights(), weights('model.quantize="none"')
        checked[f"= {nf4} GB ({bf16} GB in bf16)"] = "the NF4 klein denoiser's weights"
        checked[f"{CUDA_OVERHEAD / GB:g} GB of CUDA context"] = "the plan's CUDA overhead"
    if page == "docs/recipes.md":
        checked[f"the plan's {DEFAULT_GPU_MEMORY_GB:g} GB"] = "the GPU size planned against when none is known"
    for phrase, what in checked.items():
        assert phrase in outside, (page, what, phrase)
        outside = outside.replace(phrase, "")
    figures = re.findall(r"\d+(?:\.\d+)? ?Gi?B(?! (?:GPU|card))", outside)
    assert not figures, f"memory figures in {page} outside a generated block: {figures}"
