"""`flowrl doctor` and `flowrl selftest` on this CPU machine; docs/install.md; constraints/cuda.txt.

The command lines run once, in one interpreter per fixture (``flowrl_cli.batch``): the doctor's
in a few seconds, the self-test (a tiny FLUX trained three times, offline) in about 30 s.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "install.md"
SECTIONS = ["python", "torch", "packages", "devices", "attention", "launcher"]
STATUS_LINE = re.compile(r"^  (ok|warn|fail|pass|skip)\s+(.+?): ", re.M)
FLAGSHIP = "recipes/chunk_grpo_flux.toml"
#: lines every machine's report has (others depend on the machine: GPUs, NCCL, launcher variables)
CORE_NAMES = {"python", "flowrl", "torch", "torch.distributed", "torchvision", "diffusers", "transformers", "peft",
              "accelerate", "math", "flash", "processes"}


def doc_commands() -> list[list[str]]:
    """The command lines of docs/install.md's ```bash blocks (the GPU install line is an indented
    block: it cannot run on this machine)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S):
        out += [shlex.split(line)[1:] for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return out


DOCTOR_CALLS = {
    "text": ["doctor"],
    "json": ["doctor", "--json"],
    "quickstart": ["doctor", "recipes/quickstart.toml"],
    # online as far as doctor knows: other tests in this process may have set HF_HUB_OFFLINE for good
    "flagship": {"argv": ["doctor", FLAGSHIP, "--json"], "env": {"HF_HUB_OFFLINE": "0"}},
    "missing": ["doctor", "recipes/no_such_recipe.toml"],
    "launched": {"argv": ["doctor", "--json"], "env": {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}},
    "garbled": {"argv": ["doctor", "--json"], "env": {"WORLD_SIZE": "two", "MASTER_ADDR": "10.0.0.1"}},
    "deepspeed": {"argv": ["doctor", "recipes/quickstart.toml", "--json"], "env": {"ACCELERATE_USE_DEEPSPEED": "true"}},
}


@pytest.fixture(scope="module")
def doctor(flowrl_cli, tmp_path_factory):
    """name -> result of each call above, and of every doctor command docs/install.md shows."""
    docs = {f"doc:{' '.join(argv)}": argv for argv in doc_commands() if argv[0] == "doctor"}
    not_a_pipeline = tmp_path_factory.mktemp("not_a_pipeline")
    local = {"local_dir": ["doctor", FLAGSHIP, "--json", "--set", f"model.path={json.dumps(str(not_a_pipeline))}"],
             "offline": {"argv": ["doctor", FLAGSHIP, "--json"], "env": {"HF_HUB_OFFLINE": "1"}}}
    calls = {**DOCTOR_CALLS, **local, **docs}
    results = flowrl_cli.batch(list(calls.values()), timeout=300)
    return dict(zip(calls, results))


def _checks(result) -> dict[str, dict]:
    report = json.loads(result.stdout)
    return {f"{c['section']}/{c['name']}": c for c in report["checks"]}


@pytest.mark.slow
def test_doctor_prints_every_section_and_passes_on_this_machine(doctor):
    r = doctor["text"]
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    headers = [line for line in r.stdout.splitlines() if line in SECTIONS]
    assert headers == SECTIONS, r.stdout
    lines = STATUS_LINE.findall(r.stdout)
    assert {status for status, _ in lines} <= {"ok", "warn"}, r.stdout
    names = {name for _, name in lines}
    assert CORE_NAMES <= names, names
    assert "summary:" in r.stdout and "FAILED" not in r.stdout


@pytest.mark.slow
def test_doctor_json_parses_and_states_this_torch(doctor):
    import torch

    r = doctor["json"]
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["command"] == "doctor" and report["failed"] is False and report["recipe"] is None
    assert [s for s in dict.fromkeys(c["section"] for c in report["checks"])] == SECTIONS
    checks = _checks(r)
    assert checks["torch/torch"]["figures"]["version"] == torch.__version__
    assert checks["torch/torch"]["figures"]["cuda"] == torch.version.cuda
    gpu = torch.cuda.is_available()
    assert ("devices/cpu" in checks) != gpu and ("devices/cuda:0" in checks) == gpu
    assert all(c["status"] in ("ok", "warn", "fail") for c in checks.values())


@pytest.mark.slow
def test_doctor_with_a_recipe_shows_its_plan_line(doctor):
    r = doctor["quickstart"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "\nrecipe\n" in r.stdout
    plan = next(line for line in r.stdout.splitlines() if "memory plan:" in line)
    assert "GB per process at 1 process" in plan and "fits" in plan and "does not fit" not in plan, plan


@pytest.mark.slow
def test_doctor_plans_the_flagship_at_its_processes_against_this_machine(doctor):
    """The plan line is `flowrl plan`'s estimate at [distributed].num_processes (8), and its verdict
    is this machine's: per GPU, or, without one, all processes in RAM."""
    import torch

    from flowrl.memory_plan import GB, estimate, peak
    from flowrl.plugins import get_registry
    from flowrl.recipe import load_recipe

    r = doctor["flagship"]
    line = _checks(r)["recipe/memory plan"]
    recipe = load_recipe(REPO / FLAGSHIP)
    total = peak(estimate(recipe, get_registry(), 8)[2])[0]
    assert line["figures"]["num_processes"] == 8
    assert line["figures"]["plan_gb"] == pytest.approx(total / GB, abs=1e-3)
    if torch.cuda.is_available():
        fits = total <= min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    else:
        fits = 8 * total <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert line["status"] == ("ok" if fits else "fail"), line
    assert r.returncode == (1 if json.loads(r.stdout)["failed"] else 0)


@pytest.mark.slow
def test_doctor_of_a_missing_recipe_is_one_message(doctor):
    r = doctor["missing"]
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", (r.stdout, r.stderr)
    assert "recipe file not found" in r.flat_err and "no_such_recipe.toml" in r.flat_err


@pytest.mark.slow
def test_doctor_reads_the_launcher(doctor):
    processes = _checks(doctor["launched"])["launcher/processes"]
    assert processes["status"] == "warn" and "WORLD_SIZE=2" in processes["detail"]
    assert "without MASTER_ADDR" in processes["detail"]
    garbled = _checks(doctor["garbled"])["launcher/processes"]
    assert garbled["status"] == "warn" and "WORLD_SIZE='two' is not a number" in garbled["detail"], garbled
    refused = doctor["deepspeed"]
    accelerate = _checks(refused)["launcher/accelerate"]
    assert accelerate["status"] == "fail" and "DeepSpeed" in accelerate["detail"], accelerate
    assert refused.returncode == 1


def test_torchvision_release_for_each_torch_release():
    from flowrl.diagnostics.doctor import expected_torchvision

    assert expected_torchvision("2.13.0+cpu") == "0.28"
    assert expected_torchvision("2.4.1") == "0.19"
    assert expected_torchvision("1.13.1") is None


def _pins(name: str) -> dict[str, Requirement]:
    lines = (REPO / "constraints" / name).read_text().splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return {r.name: r for r in reqs}


def test_cuda_constraints_pin_a_cuda_build_of_the_tested_release():
    from flowrl.diagnostics.doctor import expected_torchvision

    cpu, cuda = _pins("cpu.txt"), _pins("cuda.txt")
    assert set(cuda) == set(cpu) == {"torch", "torchvision"}
    (torch_release,) = [s.version for s in cpu["torch"].specifier]
    (vision_release,) = [s.version for s in cpu["torchvision"].specifier]
    # the same release as the CPU pins (so the CPU test suite tests it), never its CPU build
    assert cuda["torch"].specifier.contains(torch_release)
    assert cuda["torch"].specifier.contains(f"{torch_release}+cu126")
    assert not cuda["torch"].specifier.contains(f"{torch_release}+cpu")
    assert cuda["torchvision"].specifier.contains(vision_release)
    assert not cuda["torchvision"].specifier.contains(f"{vision_release}+cpu")
    assert vision_release.startswith(expected_torchvision(torch_release) + ".")


# ------------------------------------------------------------------------------------- selftest


@pytest.fixture(scope="module")
def selftest(flowrl_cli):
    """`flowrl selftest` as docs/install.md writes it (this machine: the CPU) and with --json."""
    (doc,) = [argv for argv in doc_commands() if argv[0] == "selftest" and "--gpu" not in argv]
    text, as_json = flowrl_cli.batch([doc, doc + ["--json"]], timeout=600)
    return doc, text, as_json


@pytest.mark.slow
def test_selftest_passes_on_the_cpu_and_reports_each_check(selftest):
    _, text, as_json = selftest
    for r in (text, as_json):
        assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr[-3000:])
    report = json.loads(as_json.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("tiny FLUX pipeline", "2 iterations", "fast path", "chunk-graph update", "on-policy check",
                 "kill and resume", "math", "flash"):
        assert checks[name]["status"] == "pass", checks[name]
    assert checks["torch.compile"]["status"] == "skip" and "CPU" in checks["torch.compile"]["detail"]
    assert checks["2-process FSDP2"]["status"] == "skip" and "2 or more GPUs" in checks["2-process FSDP2"]["detail"]
    train = checks["2 iterations"]["figures"]
    assert train["images_per_second"] > 0 and train["peak_memory_gb"] is None and train["plan_gb"] > 0
    assert {"rollout", "update", "eval", "checkpoint"} <= set(train["seconds_per_phase"])
    assert "every metrics row equals the uninterrupted run's" in checks["kill and resume"]["detail"]
    assert report["dtype"] == "fp32" and report["device"] == "cpu"
    # CI runs it: a regression guard well above its ~30 s here (2 cores, one thread)
    assert report["seconds"] < 120, report["seconds"]
    assert "peak memory n/a on the CPU" in text.stdout and "summary:" in text.stdout
    noise = [line for line in text.stderr.splitlines() if not line.startswith("running ")]
    assert not noise, noise  # progress only: no library warning or loading bar


def test_selftest_fails_when_a_check_fails(monkeypatch, capsys):
    """The exit status follows the checks: a failed check makes the command exit 1."""
    from flowrl import cli
    from flowrl.commands import selftest as command
    from flowrl.diagnostics.report import Check
    from flowrl.diagnostics import selftest as checks

    for key in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS"):  # the command sets them if unset
        monkeypatch.setenv(key, "1")
    # the command turns diffusers' and transformers' logging down for good: not in this test process
    monkeypatch.setattr(command, "_quiet_libraries", lambda: None)

    monkeypatch.setattr(checks, "run_selftest", lambda *a, **k: [
        Check("train", "2 iterations", "pass", "fine"), Check("resume", "kill and resume", "fail", "differs")])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["selftest", "--device", "cpu"])
    assert exit_info.value.code == 1
    assert "FAILED" in capsys.readouterr().out


def test_resume_comparison_sees_a_difference():
    from flowrl.diagnostics.selftest import differences

    want = [{"iteration": 0, "loss": 1.0, "time/update": 3.0, "reward/brightness/mean": 0.5}]
    assert differences([{**want[0], "time/update": 9.0}], want, 1e-5, 1e-6) == []
    assert differences([{**want[0], "loss": 1.001}], want, 1e-5, 1e-6) == ["iteration 0: loss 1.001 != 1.0"]
    assert differences([{**want[0], "extra": 1}], want, 1e-5, 1e-6) == ["iteration 0: extra 1 != None"]
    assert differences([], want, 1e-5, 1e-6)
    nan = {**want[0], "eval/brightness/sem": float("nan")}
    assert differences([nan], [nan], 1e-5, 1e-6) == []  # a value that is NaN in both runs is repeated
    assert differences([nan], [{**nan, "eval/brightness/sem": 0.1}], 1e-5, 1e-6)


def test_a_crash_in_one_check_is_its_failure():
    from flowrl.diagnostics.selftest import guarded

    def boom():
        raise RuntimeError("no kernel")

    (check,) = guarded("attention", "flash", boom)
    assert (check.status, check.detail) == ("fail", "RuntimeError: no kernel")


# ----------------------------------------------------------------------------------- docs/install.md


@pytest.mark.slow
def test_install_doc_commands_are_the_ones_run_here(doctor, selftest):
    commands = doc_commands()
    assert [c[0] for c in commands] == ["doctor", "selftest", "doctor", "selftest"], commands
    assert commands[3] == ["selftest", "--gpu", "--dry-run"]  # run in tests/diagnostics/test_gpu_check.py
    for argv in commands:
        if argv[0] == "doctor":
            r = doctor[f"doc:{' '.join(argv)}"]
            assert "Traceback" not in r.stderr and r.returncode in (0, 1), r.stderr
            assert "summary:" in r.stdout
    assert commands[1] == selftest[0]


@pytest.mark.slow
def test_install_doc_example_is_doctor_output_of_today(doctor):
    """The captured example has today's sections and line format (re-capture it when they change)."""
    text = DOC.read_text(encoding="utf-8")
    example = text.split("<!-- doctor example -->", 1)[1].split("```", 2)[1]
    assert "flowrl doctor" in example.splitlines()
    assert [l for l in example.splitlines() if l in SECTIONS] == SECTIONS
    assert CORE_NAMES <= {name for _, name in STATUS_LINE.findall(example)}
    assert CORE_NAMES <= {name for _, name in STATUS_LINE.findall(doctor["text"].stdout)}


@pytest.mark.slow
def test_doctor_says_where_the_weights_come_from(doctor):
    """A hub id not in the cache is downloaded by the first run (a warning, naming the login a gated
    model needs when no token is set), or cannot be with HF_HUB_OFFLINE (a failure); a local
    directory must be a diffusers pipeline. The embedded model ships its weights: no line."""
    import huggingface_hub

    if isinstance(huggingface_hub.try_to_load_from_cache("black-forest-labs/FLUX.1-dev", "model_index.json"), str):
        pytest.skip("FLUX.1-dev is in this machine's Hugging Face cache")
    weights = _checks(doctor["flagship"])["recipe/weights"]
    assert weights["status"] == "warn" and "black-forest-labs/FLUX.1-dev: not in the Hugging Face cache" in weights["detail"]
    assert ("huggingface-cli login" in weights["detail"]) == (huggingface_hub.get_token() is None)
    offline = _checks(doctor["offline"])["recipe/weights"]
    assert offline["status"] == "fail" and "HF_HUB_OFFLINE" in offline["detail"]
    local = _checks(doctor["local_dir"])["recipe/weights"]
    assert local["status"] == "fail" and "without model_index.json" in local["detail"]
    assert "weights:" not in doctor["quickstart"].stdout


def test_the_tested_releases_are_the_ones_the_tests_run_with():
    """doctor's TESTED_RELEASES names what CI installs: the environment these tests run in. When a
    fresh install brings another release, this fails, and the table (and the release notes) move."""
    from importlib import metadata

    from flowrl.diagnostics.doctor import TESTED_RELEASES

    assert {name: metadata.version(name) for name in TESTED_RELEASES} == TESTED_RELEASES
    listed = ", ".join(f"{name} {version}" for name, version in TESTED_RELEASES.items())
    assert f"`flowrl/diagnostics/doctor.py`: {listed})" in DOC.read_text(encoding="utf-8")  # docs/install.md


def test_an_untested_release_is_a_warning_naming_the_tested_one():
    from flowrl.diagnostics.doctor import TESTED_RELEASES, release_check

    tested = TESTED_RELEASES["diffusers"]
    assert release_check("diffusers", tested).status == "ok"
    other = release_check("diffusers", "0.99.0")
    assert other.status == "warn" and f"not the release flowrl's CI tests ({tested})" in other.detail
    assert f"pip install diffusers=={tested}" in other.detail
    assert release_check("numpy", "2.0.0").status == "ok"  # not a library doctor judges
