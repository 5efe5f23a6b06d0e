"""Build flowrl's wheel and sdist, install each into a fresh virtual environment and run the
quickstart from outside the repository: what a user of the package index gets.

    python scripts/check_install.py                  # into a temporary directory, removed after
    python scripts/check_install.py --keep /tmp/ci   # keep the environments and the run there

The distribution is ``flowrl-diffusion`` (``flowrl`` on PyPI is an unrelated JAX library); the
import package and the command stay ``flowrl``. Steps, each timed:

1. the wheel (``pip wheel --no-deps``) and the sdist (setuptools' PEP 517 ``build_sdist``, so
   that the ``build`` package is not needed), both from a copy of the tracked files only, so that
   nothing untracked or built in the checkout can leak in;
2. a fresh venv; the wheel installed with its dependencies pinned by ``constraints/cpu.txt``;
3. from an empty directory: ``flowrl --version``, ``flowrl plugins --json`` (the built-ins come
   from the installed distribution, not the checkout) and one iteration of the quickstart;
4. the sdist installed over it (``--force-reinstall --no-deps``: the dependencies are the same)
   and the same commands again.

Too slow for the test suite (a fresh environment installs torch): tests/test_quiet_output.py
checks the wheel's contents and metadata in CI; this script is the full check (221 s measured
on 2 shared CPU cores with a warm pip cache, 133 s of it installing the dependencies).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTION = "flowrl-diffusion"
WHEEL_PREFIX = DISTRIBUTION.replace("-", "_")  # PEP 427 / 625 file names


def run(cmd: list[str], **kwargs) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise SystemExit(f"FAILED ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def timed(label: str, timings: dict[str, float]):
    class Timer:
        def __enter__(self):
            self.t0 = time.perf_counter()
            print(f"... {label}", flush=True)

        def __exit__(self, *exc):
            timings[label] = time.perf_counter() - self.t0
            if exc[0] is None:
                print(f"    {timings[label]:.1f} s", flush=True)

    return Timer()


def tracked_copy(dest: Path) -> Path:
    files = run(["git", "ls-files", "-z"], cwd=REPO).split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def check_installed(python: Path, flowrl: Path, workdir: Path, run_dir: Path) -> None:
    """The installed package, used from a directory that is not the checkout."""
    workdir.mkdir(parents=True, exist_ok=True)
    location = run([python, "-c", "import flowrl, flowrl_plugins; print(flowrl.__file__); print(flowrl_plugins.__file__)"],
                   cwd=workdir)
    assert str(REPO) not in location, f"imported from the checkout: {location}"
    version = run([flowrl, "--version"], cwd=workdir).strip()
    assert version.startswith("flowrl "), version
    plugins = json.loads(run([flowrl, "plugins", "--json"], cwd=workdir))
    dists = {p["distribution"] for p in plugins}
    assert dists == {DISTRIBUTION}, dists
    run([flowrl, "train", REPO / "recipes" / "quickstart.toml", "--set", "train.iterations=1", "-o", run_dir,
         "--set", "log.progress=false"], cwd=workdir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if not r.get("final")] == [0], rows  # one trained iteration
    assert rows[-1].get("final"), rows[-1]  # then the closing evaluation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="work here and keep everything (default: a temporary directory)")
    args = parser.parse_args(argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="flowrl-install-"))
    root.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    try:
        src, dist = tracked_copy(root / "src"), root / "dist"
        dist.mkdir(exist_ok=True)
        with timed("build the wheel", timings):
            run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src])
        with timed("build the sdist", timings):
            run([sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"],
                cwd=src)
        [wheel] = dist.glob(f"{WHEEL_PREFIX}-*.whl")
        [sdist] = dist.glob(f"{WHEEL_PREFIX}-*.tar.gz")
        print(f"    {wheel.name}, {sdist.name}")
        env_dir = root / "venv"
        with timed("fresh venv + the wheel with its dependencies (constraints/cpu.txt)", timings):
            venv.create(env_dir, with_pip=True, clear=True)
            python, flowrl = env_dir / "bin" / "python", env_dir / "bin" / "flowrl"
            run([python, "-m", "pip", "install", "-q", "-c", REPO / "constraints" / "cpu.txt", wheel], cwd=root)
        with timed("the wheel: --version, plugins, one quickstart iteration (outside the checkout)", timings):
            check_installed(python, flowrl, root / "elsewhere", root / "run_wheel")
        with timed("the sdist over it (--force-reinstall --no-deps)", timings):
            run([python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", sdist], cwd=root)
        with timed("the sdist: --version, plugins, one quickstart iteration (outside the checkout)", timings):
            check_installed(python, flowrl, root / "elsewhere", root / "run_sdist")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print("OK: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f"; total {sum(timings.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
