"""The torchvision shim: defines the two op schemas only when torchvision's compiled library
cannot load, and does nothing otherwise. Uses fake `torchvision` packages in subprocesses (the
shim is process-wide); open_clip's tests exercise it against the real broken wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

# What torchvision's import does that breaks on a CUDA wheel beside CPU torch: it registers fake
# kernels for ops that only its compiled library defines.
FAKE_INIT = textwrap.dedent('''
    import os, torch
    try:
        torch.ops.load_library(os.path.join(os.path.dirname(__file__), "_C.so"))
    except OSError:
        pass
    for op in ("nms", "qnms"):
        torch.library.register_fake("torchvision::" + op)(lambda dets, scores, iou_threshold: dets.new_empty(0, dtype=torch.long))
''')

SCRIPT = textwrap.dedent('''
    import sys, torch
    try:
        import torchvision
        print("plain import: ok")
    except RuntimeError as exc:
        print("plain import:", exc)
    from flowrl import compat as tc
    print("status:", tc.ensure_torchvision_importable(), tc.ensure_torchvision_importable())
    import torchvision
    print("import after shim: ok")
    print("nms defined:", tc._op_defined("nms"), "qnms defined:", tc._op_defined("qnms"))
''')


def run(env_path):
    import os

    env = dict(os.environ, PYTHONPATH=str(env_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def make_fake(tmp_path, library: bytes | None):
    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FAKE_INIT)
    if library is not None:
        (pkg / "_C.so").write_bytes(library)
    return tmp_path


@pytest.mark.slow
def test_broken_library_gets_the_schemas(tmp_path):
    out = run(make_fake(tmp_path, b"not an ELF file"))
    assert "plain import: operator torchvision::nms does not exist" in out
    assert "status: shimmed shimmed" in out  # idempotent: the second call defines nothing
    assert "import after shim: ok" in out
    assert "nms defined: True qnms defined: True" in out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a loadable library")
def test_healthy_library_is_left_alone(tmp_path):
    src = tmp_path / "empty.c"
    src.write_text("int flowrl_test_symbol(void) { return 1; }\n")
    lib = tmp_path / "lib.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    (tmp_path / "site").mkdir()
    fake = make_fake(tmp_path / "site", lib.read_bytes())
    # A loadable library that defines no ops: the shim must report "healthy" and define nothing,
    # so the fake's own import fails exactly as it would without the shim.
    env_out = subprocess.run(
        [sys.executable, "-c", "from flowrl import compat as tc;"
         "print(tc.ensure_torchvision_importable(), tc._op_defined('nms'))"],
        capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(fake)},
    )
    assert env_out.stdout.split() == ["healthy", "False"], env_out.stderr


# torchvision is hidden from the import system (find_spec finds nothing, import fails) by a
# meta-path finder wrapping all the others, so this runs whether or not torchvision is installed
# (the dev extra installs it, with open_clip).
HIDDEN_TORCHVISION = textwrap.dedent('''
    import importlib.abc, importlib.util, sys

    class Hide(importlib.abc.MetaPathFinder):
        def __init__(self, finders):
            self.finders = finders

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torchvision":
                return None
            for finder in self.finders:
                spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
                if spec is not None:
                    return spec
            return None

    sys.meta_path[:] = [Hide(list(sys.meta_path))]
    assert importlib.util.find_spec("torchvision") is None
    from flowrl import compat as tc
    print(tc.ensure_torchvision_importable(), tc._op_defined("nms"))
''')


@pytest.mark.slow
def test_absent_torchvision_is_a_no_op():
    proc = subprocess.run([sys.executable, "-c", HIDDEN_TORCHVISION], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["absent", "False"], proc.stderr
