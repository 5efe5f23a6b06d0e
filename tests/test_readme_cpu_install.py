"""The CPU-only install line (README's quickstart, docs/install.md) installs the release that
constraints/cpu.txt pins, as PyTorch's CPU build, and the README's download figures are the
measured ones of docs/install.md.

A new user's trial: `-c constraints/cpu.txt` pins a version, not a build, and on Linux PyPI's
torch 2.13.0 is the CUDA build, with 19 CUDA packages (2.2 GB). The line is an indented block in
both pages, as docs/install.md's GPU line is: it needs PyTorch's index, which the test machines
cannot reach, so no test runs it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
INSTALL = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def cpu_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.startswith("    ") and CPU_INDEX in line]


def pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints" / "cpu.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            out[req.name] = str(req.specifier)
    return out


def test_the_cpu_line_installs_the_pinned_release_from_pytorchs_cpu_index():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    [readme_line] = cpu_lines(quickstart)
    [doc_line] = cpu_lines(INSTALL.split("## Install on a CPU-only machine", 1)[1].split("\n## ", 1)[0])
    assert readme_line == doc_line
    install = shlex.split(readme_line.split("&&")[-1])
    assert install[:2] == [".venv/bin/pip", "install"] and install[install.index("--index-url") + 1] == CPU_INDEX
    wanted = {Requirement(a).name: str(Requirement(a).specifier) for a in install if "==" in a}
    assert wanted == pins() == {"torch": "==2.13.0", "torchvision": "==0.28.0"}
    # the README's first shell block, the install that follows it, is unchanged: still the pinned release
    first = re.search(r"```bash\n(.*?)```", quickstart, flags=re.S).group(1)
    assert "-c constraints/cpu.txt" in first


def test_the_readmes_download_figures_are_the_measured_ones():
    table = INSTALL.split("## Install on a CPU-only machine", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): (int(m.group(2)), int(m.group(3).replace(",", "")))
            for m in re.finditer(r"^\| (PyPI alone|PyTorch's CPU build first)[^|]*\| (\d+) \| ([\d,]+) MB \|", table, re.M)}
    assert rows == {"PyPI alone": (78, 2821), "PyTorch's CPU build first": (59, 282)}
    flat = " ".join(README.split())
    assert "downloads 78 packages, 2.8 GB, 2.2 GB of it 19 CUDA packages" in flat
    assert "with the CPU build first, 59 packages, 0.28 GB" in flat
    assert "19 CUDA packages (`nvidia-*`, `cuda-*`, `triton`) 2,204 MB" in " ".join(table.split())
