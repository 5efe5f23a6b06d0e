"""No noise a user cannot act on.

- building flowrl prints no setuptools BuildBackendWarning (the data directories of the built-in
  plugins are packaged by pattern, not as would-be packages), and still ships the data;
- `flowrl sample --model embedded` and a LoRA training run print no warning;
- the three library messages that fire on every diffusers command and ask nothing of a user are
  filtered exactly, and their actionable neighbours are not (flowrl.compat.NotActionable).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tiny_recipe import tiny_recipe

from flowrl.compat import NotActionable, quiet_library_messages

REPO = Path(__file__).resolve().parents[1]

LORA = tiny_recipe(run={"name": "lora", "seed": None}, model={"random_init": None},
                   train={"iterations": 1, "micro_batch_size": 4, "finetune": "lora", "lora_rank": 4})


def warnings_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if "warn" in line.lower()]


def test_building_flowrl_prints_no_setuptools_warning_and_ships_the_data(tmp_path):
    import shutil

    pytest.importorskip("setuptools", reason="building flowrl needs setuptools")
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
    for name in ("flowrl", "plugins"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    output = proc.stdout + proc.stderr
    assert "BuildBackendWarning" not in output and not warnings_in(output), output
    [wheel] = tmp_path.glob("flowrl_diffusion-*.whl")  # the distribution's name, normalised (PEP 427)
    names = set(zipfile.ZipFile(wheel).namelist())
    # the distribution the package index knows it by ("flowrl" there is an unrelated JAX library)
    [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert "\nName: flowrl-diffusion\n" in zipfile.ZipFile(wheel).read(meta).decode()
    for data in ("flowrl_plugins/embedded/weights/embedded.safetensors", "flowrl_plugins/embedded/weights/embedded.json",
                 "flowrl_plugins/rewards/embedded_clip/model.safetensors", "flowrl_plugins/rewards/hpsv3_prompt.txt",
                 "flowrl_plugins/rewards/video_align_prompt.txt"):
        assert data in names


@pytest.mark.slow
def test_sample_and_a_lora_run_print_no_warning(tmp_path, flowrl_cli):
    """The real console script, default warning filters, as a user runs it."""
    sample = subprocess.run(
        [str(flowrl_cli.script), "sample", "--model", "embedded", "--prompt", "a red circle on a blue background",
         "-o", str(tmp_path / "samples")],
        cwd=tmp_path, env=flowrl_cli.env(), capture_output=True, text=True, timeout=300,
    )
    assert sample.returncode == 0, sample.stderr
    assert sample.stderr == "" and not warnings_in(sample.stdout), sample.stdout + sample.stderr
    (tmp_path / "lora.toml").write_text(LORA)
    lora = subprocess.run(
        [str(flowrl_cli.script), "train", "lora.toml", "-o", str(tmp_path / "run")],
        cwd=tmp_path, env=flowrl_cli.env(), capture_output=True, text=True, timeout=300,
    )
    assert lora.returncode == 0, lora.stderr
    assert lora.stderr == "" and not warnings_in(lora.stdout), lora.stdout + lora.stderr


QUIET = [
    ("transformers.utils.import_utils",
     "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` for backward "
     "compatibility. Install torchvision to use the default backend, or import `CLIPImageProcessorPil` directly to "
     "silence this warning."),
    ("diffusers.models.modeling_utils",
     "There are modules in FluxTransformer2DModel that should be kept in float32: []. Casting directly with `to()` can "
     "lead to inconsistent results; set `torch_dtype` in `from_pretrained()` instead to keep these modules in float32."),
    ("diffusers.pipelines.flux.pipeline_flux",
     "The following part of your input was truncated because `max_sequence_length` is set to  16 tokens: ['', '']"),
    # logged while diffusers is imported where torchao's kernels cannot load (this CPU machine)
    ("diffusers.quantizers.torchao.torchao_quantizer",
     "Unable to import `torchao` Tensor objects. This may affect loading checkpoints serialized with `torchao`"),
    # torch 2.13 on torchao's import (torchao registers its own enums)
    ("torch.utils._pytree",
     "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque value "
     "type. Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release."),
    # torchao's compiled extensions that cannot load on this machine (flowrl's FP8 path uses none)
    ("torchao", "Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                "Could not load this library: /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-"
                "linux-gnu.so"),
    ("torchao", "Failed to load /venv/lib/python3.11/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load this "
                "library: /venv/lib/python3.11/site-packages/torchao/_C_cutlass_90a.abi3.so"),
]
KEPT = [
    ("diffusers.models.modeling_utils",
     "There are modules in SD3Transformer2DModel that should be kept in float32: ['norm']. Casting directly with `to()` "
     "can lead to inconsistent results; set `torch_dtype` in `from_pretrained()` instead to keep these modules in float32."),
    ("diffusers.pipelines.flux.pipeline_flux",
     "The following part of your input was truncated because `max_sequence_length` is set to  16 tokens: ['a red fox']"),
    ("transformers.utils.import_utils", "`CLIPImageProcessor` requires torchvision; install it"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao`: install torchao>=0.16"),
    ("torch.utils._pytree", "<class 'MyConfig'> is already registered as a pytree node"),
    ("torchao", "Skipping import of cpp extensions due to incompatible torch version. Please upgrade to torch >= 2.11.0 "
                "(found 2.9.0)."),
    ("torchao", "Failed to load /venv/lib/python3.11/site-packages/other/_C.so: Could not load this library"),
]


@pytest.mark.parametrize("logger_name, message", QUIET + KEPT)
def test_exactly_the_non_actionable_messages_are_dropped(logger_name, message):
    record = logging.LogRecord(logger_name, logging.WARNING, __file__, 1, message, None, None)
    assert NotActionable().filter(record) is ((logger_name, message) in KEPT)


def test_the_filter_sits_on_the_library_loggers(caplog):
    """Through the real loggers: diffusers' and transformers' handlers and the emitting loggers."""
    import diffusers  # noqa: F401  (creates diffusers' library handler)
    from diffusers.utils import logging as dlog

    quiet_library_messages()
    quiet_library_messages()  # idempotent
    handler = logging.getLogger("diffusers").handlers[0]
    assert sum(isinstance(f, NotActionable) for f in handler.filters) == 1
    for name, message in QUIET + KEPT:
        logger = dlog.get_logger(name) if name.startswith("diffusers") else logging.getLogger(name)
        record = logger.makeRecord(name, logging.WARNING, __file__, 1, message, None, None)
        passes = all(f.filter(record) for f in [*logger.filters, *handler.filters])
        assert passes is ((name, message) in KEPT), (name, message)
