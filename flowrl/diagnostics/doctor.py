"""The checks of ``flowrl doctor``: python, the torch build, packages, devices, attention kernels,
the launcher's variables, and a recipe's planned memory and weights against this machine.

Each function returns :class:`flowrl.diagnostics.report.Check` lines; none runs a model (the
self-test that trains one is :mod:`flowrl.diagnostics.selftest`). The command that prints them is
``flowrl/commands/doctor.py``.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from ..compat import ensure_torchvision_importable
from ..distributed import check_launch_environment
from ..errors import DISTRIBUTION, FlowrlError
from ..memory_plan import estimate, peak
from ..recipe import check_devices
from ..train.accel import SDPA_BACKENDS, attention_backend
from .report import Check

GB = 1024**3
#: the libraries flowrl runs on, reported with their versions (torchvision: open_clip, image processors)
PACKAGES = ("torchvision", "diffusers", "transformers", "peft", "accelerate")
#: the releases of the libraries flowrl's CI installs and tests (`bash .ci/run`); another release
#: may well work, but diffusers, transformers and peft have changed behaviour between releases
#: before, so `flowrl doctor` says which ones were not tested (tests/test_doctor_selftest.py holds
#: this table to the environment the tests run in)
TESTED_RELEASES = {"diffusers": "0.42.1", "transformers": "5.24.0", "peft": "0.21.2", "accelerate": "1.15.0"}
#: what torchrun, `flowrl train --num-processes` and `accelerate launch` set for each process
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ACCELERATE_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")
REINSTALL = ("reinstall torch and torchvision together: pip install -c constraints/cuda.txt -e . on a GPU machine, "
             "-c constraints/cpu.txt on a CPU one (docs/install.md)")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def python_checks() -> list[Check]:

    py = platform.python_version()
    ours = _version(DISTRIBUTION)
    where = Path(__file__).resolve().parents[1]
    return [
        Check("python", "python", "ok", f"{py} ({sys.executable}), {platform.system()} {platform.machine()}"),
        Check("python", "flowrl", "ok" if ours else "warn",
              f"{DISTRIBUTION} {ours} ({where})" if ours else
              f"running from {where} without an installed {DISTRIBUTION} (pip install -e .)"),
    ]


def torch_build() -> str:
    """``CUDA 12.8``, ``ROCm 6.4`` or ``CPU``: what this torch was compiled for."""
    import torch

    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip}"
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    return "CPU"


def _nvidia_driver_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def torch_checks() -> list[Check]:
    import torch
    import torch.distributed as dist

    build = torch_build()
    figures = {"version": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    if build == "CPU":
        gpu_here = _nvidia_driver_present()
        checks = [Check("torch", "torch", "warn" if gpu_here else "ok",
                        f"{torch.__version__}, a CPU build"
                        + (": this machine has an NVIDIA driver; install torch with constraints/cuda.txt "
                           "(docs/install.md)" if gpu_here else ""), figures)]
    else:
        visible = torch.cuda.is_available()
        checks = [Check("torch", "torch", "ok" if visible else "warn",
                        f"{torch.__version__}, a {build} build" + ("" if visible else
                        ": but no GPU is visible (driver too old for this build? CUDA_VISIBLE_DEVICES empty?)"),
                        figures)]
        if torch.backends.cudnn.is_available():
            checks.append(Check("torch", "cuDNN", "ok", str(torch.backends.cudnn.version())))
        checks.append(nccl_check())
    backends = [name for name, available in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()))
                if available] if dist.is_available() else []
    checks.append(Check("torch", "torch.distributed", "ok" if "gloo" in backends else "warn",
                        f"backends: {', '.join(backends) or 'none'}" + ("" if "gloo" in backends else
                        " (several processes need gloo for flowrl's small collectives)")))
    return checks


def nccl_check() -> Check:
    """NCCL (RCCL on ROCm), which multi-GPU runs use for the model's gradients and shards."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError) as exc:
        return Check("torch", "NCCL", "warn", f"not available ({exc}): several GPUs cannot train together")
    text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return Check("torch", "NCCL", "ok", text, {"version": text})


def expected_torchvision(torch_version: str) -> str | None:
    """The torchvision release built for a torch release (``2.13.0`` -> ``0.28``): torchvision's
    minor version is torch 2.x's plus 15 (torchvision's own compatibility table)."""
    parts = torch_version.split("+")[0].split(".")
    if len(parts) < 2 or parts[0] != "2" or not parts[1].isdigit():
        return None
    return f"0.{int(parts[1]) + 15}"


def torchvision_check() -> Check:
    """torchvision's release against torch's, and whether its compiled ops load beside this torch
    (a torchvision built for another torch or CUDA is a known breakage: flowrl/compat.py)."""
    import torch


    installed = _version("torchvision")
    if installed is None:
        return Check("packages", "torchvision", "ok", "not installed (needed only by open_clip rewards)")
    expected = expected_torchvision(torch.__version__)
    release = ".".join(installed.split("+")[0].split(".")[:2])
    status = ensure_torchvision_importable()
    try:
        import torchvision  # noqa: F401  (what open_clip, the image processors and diffusers do)
    except Exception as exc:  # a broken install is this line's finding, not a crash of the report
        return Check("packages", "torchvision", "fail", f"{installed}: import fails ({type(exc).__name__}: {exc}); "
                     f"{REINSTALL}", {"version": installed, "ops": status})
    figures = {"version": installed, "expected": expected, "ops": status}
    if expected is not None and release != expected:
        return Check("packages", "torchvision", "warn",
                     f"{installed} is not the release for torch {torch.__version__} (torchvision {expected}.x); it "
                     f"imports (compiled ops: {status}), but may break in its compiled ops; {REINSTALL}", figures)
    if status == "shimmed":  # e.g. a CPU torch beside the CUDA torchvision of an index without CPU wheels
        return Check("packages", "torchvision", "warn",
                     f"{installed}, the release for torch {torch.__version__}, but not the same build (CPU/CUDA): its "
                     "compiled ops (nms, roi_align) cannot load; flowrl uses none of them and defines what imports "
                     "need (flowrl/compat.py); to have them, install torch and torchvision from one build "
                     "(docs/install.md)", figures)
    return Check("packages", "torchvision", "ok", f"{installed}, the release for torch {torch.__version__}; "
                 f"compiled ops: {status}", figures)


def package_checks() -> list[Check]:
    """Versions, and whether each imports (after flowrl's torchvision shim, as flowrl imports them)."""
    import importlib

    checks = [torchvision_check()]
    for name in PACKAGES[1:]:
        version = _version(name)
        if version is None:
            checks.append(Check("packages", name, "fail", "not installed (a dependency of flowrl-diffusion)"))
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import failure is this line's finding, not a crash of the report
            checks.append(Check("packages", name, "fail", f"{version}, but import fails: {type(exc).__name__}: {exc}"))
            continue
        checks.append(release_check(name, version))
    return checks


def release_check(name: str, version: str) -> Check:
    """``ok`` for the release CI tests, else a ``warn`` naming it and how to install it."""
    tested = TESTED_RELEASES.get(name)
    figures = {"version": version, "tested": tested}
    if tested is None or version == tested:
        return Check("packages", name, "ok", version, figures)
    return Check("packages", name, "warn", f"{version}, not the release flowrl's CI tests ({tested}); if something "
                 f"breaks, try it: pip install {name}=={tested}", figures)


def _cpu_bf16() -> str:
    """How a CPU computes in bf16: natively (AVX512-BF16 / AMX) or converted by torch (slower)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        flags = []
    native = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    return f"native ({', '.join(native)})" if native else "emulated by torch (works; slower than fp32)"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def probe_devices() -> tuple[list[dict], list[Check]]:
    """Every visible GPU (name, memory, compute capability, bf16), else the CPU. Returns the
    devices as dictionaries (for the plan's verdict) and one check per device."""
    import torch

    checks, devices = [], []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(index)
            capability = f"{p.major}.{p.minor}"
            # bf16 tensor cores from Ampere (sm80) on; ROCm reports its own capability numbers
            bf16 = (p.major >= 8) if torch.version.cuda else torch.cuda.is_bf16_supported()
            devices.append({"device": f"cuda:{index}", "name": p.name, "memory_bytes": p.total_memory, "bf16": bf16})
            checks.append(Check("devices", f"cuda:{index}", "ok" if bf16 else "warn",
                                f"{p.name}, {p.total_memory / GB:.1f} GB, compute capability {capability}, bf16 "
                                + ("native" if bf16 else "not native: recipes with dtype = 'bf16' run slowly; "
                                   "use fp16 or fp32 on this GPU"),
                                {"memory_gb": round(p.total_memory / GB, 2), "capability": capability, "bf16": bf16}))
        return devices, checks
    memory = _host_memory_bytes()
    name = _cpu_name()
    devices.append({"device": "cpu", "name": name, "memory_bytes": memory, "bf16": True})
    memory_text = f"{memory / GB:.1f} GB RAM" if memory else "RAM unknown"
    checks.append(Check("devices", "gpu", "warn", "no GPU visible: flowrl runs on the CPU (the embedded model; "
                        "a real model needs GPUs)"))
    checks.append(Check("devices", "cpu", "ok", f"{name}, {os.cpu_count()} cores, torch threads "
                        f"{torch.get_num_threads()}, {memory_text}, bf16 {_cpu_bf16()}",
                        {"memory_gb": round(memory / GB, 2) if memory else None, "cores": os.cpu_count()}))
    return devices, checks


def attention_checks() -> list[Check]:
    """Each scaled-dot-product attention backend flowrl can select ([train].attention_backend,
    flowrl/train/accel.py), tried once on this machine's run device against the math backend."""
    import torch
    import torch.nn.functional as F


    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # flash and cudnn take only half precision on a GPU: try what a bf16 recipe computes in
    if device.type == "cpu":
        dtype = torch.float32
    else:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=generator).to(device, dtype) for _ in range(3))
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    dtype_name = str(dtype).removeprefix("torch.")
    checks = []
    for name in SDPA_BACKENDS.get(device.type, ("math",)):
        try:
            with attention_backend(name, device):
                out = F.scaled_dot_product_attention(q, k, v)
        except RuntimeError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            checks.append(Check("attention", name, "warn", f"not usable on {device.type} in {dtype_name}: {reason}"))
            continue
        error = float((out.float() - reference).abs().max())
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        checks.append(Check("attention", name, "ok" if error <= tolerance else "fail",
                            f"runs on {device.type} in {dtype_name}, max deviation from fp32 math {error:.1e}"
                            + ("" if error <= tolerance else f" > {tolerance:g}: this kernel computes wrong results"),
                            {"max_abs_error": error}))
    return checks


def launcher_checks(recipe, devices: list[dict]) -> list[Check]:
    """The variables a launcher gives each process, and the accelerate settings against the
    recipe's [distributed] table (:func:`flowrl.distributed.check_launch_environment`)."""

    env = os.environ
    present = {k: env[k] for k in LAUNCHER_VARIABLES if k in env}
    checks = []
    if not present:
        checks.append(Check("launcher", "processes", "ok", "no launcher: one process (flowrl train --num-processes N, "
                            "torchrun and accelerate launch set WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR)"))
    else:
        problems = [f"{k}={v!r} is not a number" for k, v in present.items()
                    if k not in ("MASTER_ADDR", "MASTER_PORT") and not v.strip().isdigit()]
        numbers = {k: int(v) for k, v in present.items() if v.strip().isdigit()}
        if numbers.get("WORLD_SIZE", 1) > 1 and "MASTER_ADDR" not in present:
            problems.append("WORLD_SIZE > 1 without MASTER_ADDR")
        gpus = sum(1 for d in devices if d["device"].startswith("cuda"))
        if gpus and numbers.get("LOCAL_RANK", 0) >= gpus:
            problems.append(f"LOCAL_RANK {numbers['LOCAL_RANK']} but {gpus} GPU(s) visible")
        shown = ", ".join(f"{k}={v}" for k, v in present.items())
        checks.append(Check("launcher", "processes", "warn" if problems else "ok",
                            shown + (f" ({'; '.join(problems)})" if problems else ""), dict(present)))
    accelerate = {k: v for k, v in sorted(env.items()) if k.startswith(ACCELERATE_PREFIXES)}
    if recipe is not None:
        try:
            check_launch_environment(recipe.distributed, env)
            agreement = Check("launcher", "accelerate", "ok", (", ".join(f"{k}={v}" for k, v in accelerate.items())
                              or "no accelerate settings") + ": they agree with the recipe's [distributed]")
        except FlowrlError as exc:
            agreement = Check("launcher", "accelerate", "fail", exc.format().replace("\n  ", " "))
        checks.append(agreement)
    elif accelerate:
        checks.append(Check("launcher", "accelerate", "ok", ", ".join(f"{k}={v}" for k, v in accelerate.items())
                            + " (give a RECIPE to check them against its [distributed])"))
    for key in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
        if key in env:
            checks.append(Check("launcher", key, "ok", env[key]))
    nccl = {k: v for k, v in sorted(env.items()) if k.startswith("NCCL_")}
    if nccl:
        checks.append(Check("launcher", "NCCL settings", "ok", ", ".join(f"{k}={v}" for k, v in nccl.items())))
    return checks


def recipe_device_checks(recipe) -> list[Check]:
    """Every device the recipe names is one this machine has (what ``flowrl validate`` and
    ``flowrl train`` refuse, :func:`flowrl.recipe.check_devices`), as a check."""
    try:
        check_devices(recipe)
    except FlowrlError as exc:
        return [Check("recipe", "devices", "fail", exc.format().replace("\n  ", " "))]
    return [Check("recipe", "devices", "ok", "every device the recipe names is on this machine")]


def plan_checks(recipe, devices: list[dict], registry) -> list[Check]:
    """The recipe's planned peak memory per process (``flowrl plan``, at [distributed].num_processes)
    against this machine: each GPU holds one process; without a GPU, the CPU's RAM holds them all."""

    processes = recipe.distributed.num_processes
    try:
        gpu_bytes = [d["memory_bytes"] for d in devices if d["device"].startswith("cuda") and d["memory_bytes"]]
        # fsdp2's gradient_sync "auto" decides against the card the run will have
        _, _, lines = estimate(recipe, registry, processes, gpu_memory=min(gpu_bytes) if gpu_bytes else None)
    except FlowrlError as exc:
        return [Check("recipe", "memory plan", "fail", exc.format().replace("\n  ", " "))]
    total, phase = peak(lines)
    plural = "es" if processes > 1 else ""
    planned = f"{total / GB:.1f} GB per process at {processes} process{plural} (peak in the {phase} phase)"
    figures = {"plan_gb": round(total / GB, 3), "num_processes": processes}
    gpus = [d for d in devices if d["device"].startswith("cuda")]
    if not gpus:
        ram = devices[0]["memory_bytes"] if devices else None
        need = total * processes
        if ram is None:
            return [Check("recipe", "memory plan", "warn", f"{planned}; no GPU, and this machine's RAM is unknown",
                          figures)]
        fits = need <= ram
        return [Check("recipe", "memory plan", "ok" if fits else "fail",
                      f"{planned}; no GPU: on the CPU "
                      + ("the process needs" if processes == 1 else f"the {processes} processes need")
                      + f" ~{need / GB:.1f} GB: "
                      + ("fits" if fits else "does not fit") + f" in {ram / GB:.1f} GB of RAM", figures)]
    smallest = min(gpus, key=lambda d: d["memory_bytes"])
    fits = total <= smallest["memory_bytes"]
    figures["device_gb"] = round(smallest["memory_bytes"] / GB, 2)
    checks = [Check("recipe", "memory plan", "ok" if fits else "fail",
                    f"{planned}: " + ("fits" if fits else "does not fit")
                    + f" in {smallest['memory_bytes'] / GB:.1f} GB ({smallest['name']})"
                    + ("" if fits else "; `flowrl plan RECIPE` lists what reduces it"), figures)]
    if processes > len(gpus):
        checks.append(Check("recipe", "processes", "warn",
                            f"the recipe is written for {processes} processes (one per GPU) and this machine has "
                            f"{len(gpus)} GPU(s): run it on more GPUs or machines, or plan another count with "
                            "`flowrl plan RECIPE --num-processes N`"))
    return checks


def weights_checks(recipe) -> list[Check]:
    """Where the recipe's model weights come from (``[model].path``): a local pipeline directory,
    the Hugging Face cache, or a download at the first run, which a gated repository (FLUX.1-dev)
    refuses without a login. Reads the cache only: no network."""
    params = recipe.components["model"].params
    path = getattr(params, "path", None)
    if not isinstance(path, str) or not path:
        return []  # a model that ships its weights (the embedded one)
    local = Path(path).expanduser()
    if local.is_dir() or path.startswith(("/", "./", "../", "~")):
        if not local.is_dir():
            return [Check("recipe", "weights", "fail", f"{path}: no such directory ([model].path)")]
        if not (local / "model_index.json").is_file():
            return [Check("recipe", "weights", "fail", f"{path}: a directory without model_index.json, not a "
                          "diffusers pipeline (save_pretrained writes one)")]
        return [Check("recipe", "weights", "ok", f"{path}: a local pipeline directory")]
    try:
        from huggingface_hub import get_token, try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of diffusers
        return []
    revision = getattr(params, "revision", "") or None
    if isinstance(try_to_load_from_cache(path, "model_index.json", revision=revision), str):
        return [Check("recipe", "weights", "ok", f"{path}: in the Hugging Face cache (its model_index.json; "
                      "that every weight file is there is not checked)")]
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes"):
        return [Check("recipe", "weights", "fail", f"{path}: not in the Hugging Face cache, and HF_HUB_OFFLINE "
                      "forbids the download: `huggingface-cli download` it where the hub is reachable")]
    login = "" if get_token() else ("; no Hugging Face token here: a gated model (FLUX.1-dev) needs its licence "
                                    "accepted on its page and `huggingface-cli login` (or HF_TOKEN)")
    return [Check("recipe", "weights", "warn", f"{path}: not in the Hugging Face cache: the first run downloads "
                  f"it (tens of GB for a full-size model){login}")]
