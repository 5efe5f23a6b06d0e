"""Write docs/gpu_runs.md: every GPU run flowrl has a results file for, one row per file, and what
has only been planned, never measured on a GPU.

    python scripts/gpu_runs_table.py            # regenerate docs/gpu_runs.md
    python scripts/gpu_runs_table.py --check    # exit 1 when the page is stale

The rows come from the files in benchmarks/results/ that GPU runs wrote, and from nothing else:

- ``gpu_flux_iteration_*.json``: ``benchmarks/gpu_flux_iteration.py --json`` (FLUX.1-dev's
  training iteration, one entry per variant);
- ``sdpa_backends_*.jsonl``: the lines ``benchmarks/sdpa_backends.py`` prints (one per attention
  backend, ``ok`` or its error);
- ``gpu_memory_check_*.json``: ``benchmarks/gpu_memory_check.py`` (the plan against the measured
  peak, per configuration and phase);
- ``gpu_check_*.json``: ``flowrl selftest --gpu`` (``"kind": "flowrl-gpu-check"``: the device,
  versions, and each step's status and figures).

A field the file does not hold (a date, a driver, even the device) is "not recorded": the page
never fills it in from prose elsewhere. The planned-only list is data here (``PLANNED``), each item
with the page, the section and the sentence that says it was not measured; tests/test_gpu_runs_doc.py
checks that the sentence still stands there, that the page is what this script writes, and that
every GPU figure the docs quote is in one of these results files. Standard library only: no
flowrl import, no GPU.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "gpu_runs.md"
COMMAND = "python scripts/gpu_runs_table.py"
NOT_RECORDED = "not recorded"
#: the file name patterns of GPU results, and which reader each takes
PATTERNS = {"gpu_flux_iteration_*.json": "flux_iteration", "sdpa_backends_*.jsonl": "sdpa_backends",
            "gpu_check_*.json": "gpu_check", "gpu_memory_check_*.json": "memory_check"}
CHECK_KIND, CHECK_STATUSES = "flowrl-gpu-check", ("pass", "fail", "skip", "timeout")
#: GPU model names as they appear in device names and in prose ("NVIDIA H100 80GB HBM3" -> "H100")
GPU_MODEL = re.compile(r"(?<![A-Za-z0-9])(H100|H200|H20|A100|A10G|B200|B100|GB200|L40S|L4|RTX ?\d{4})(?![A-Za-z0-9])",
                       re.IGNORECASE)


@dataclass(frozen=True)
class Said:
    """What a page of the docs says about a GPU run that no results file records: something planned
    and never measured on a GPU, or a run noted in prose only."""

    what: str
    page: str  # a page under docs/
    section: str  # the heading of the section that says so, without its '#'s
    says: str  # the sentence there, verbatim (whitespace aside)


#: What has only been planned, never measured on a GPU, as the docs say it. Remove an item when a
#: GPU results file measures it (and the sentence in its page changes).
PLANNED = (
    Said("FP8 rollouts (`[sampler].rollout_precision = \"fp8\"`): their time against bf16 rollouts "
            "(`benchmarks/gpu_flux_iteration.py --variants step fp8_rollout`) and the GPU lane's FP8 test",
            "objectives.md", "Rollouts in FP8, and the update's correction",
            "The FP8 matmul path has not run on a GPU: the H200 that ran the GPU lane had no torchao, and its three "
            "FP8 tests skipped."),
    Said("`flowrl plan`'s peak memory against `torch.cuda.max_memory_allocated` for the GPU recipes other than "
            "the three LoRA ones measured (FLUX.1-dev full fine-tuning, Qwen-Image, FLUX.2 [klein], Z-Image, the "
            "editing models, Wan 2.1 14B, Wan 2.2, LTX-Video; docs/hardware.md), and SD3.5-M's and Wan 2.1 1.3B's "
            "since the start-up fix",
            "benchmarks.md", "`flowrl plan` against torch's memory accounting (`benchmarks/memory_plan.py`)",
            "The other recipes' plans have not been compared with `torch.cuda.max_memory_allocated`, nor SD3.5-M's "
            "and Wan's since the fix."),
    Said("the FLUX.1-dev recipes as written (real weights, their own resolution, group and reward; the Chunk-GRPO "
            "iteration at group 12 against `flowrl plan`) and any run of 2 or more processes on GPUs",
            "benchmarks.md", "H100",
            "Not measured here: the Chunk-GRPO iteration at group 12 against `flowrl plan`, and the 2-process "
            "runs (one GPU, 15 minutes of device time)."),
    Said("multi-GPU DDP and FSDP2 (the FLUX paper recipes' 8 processes): no GPU scaling figure",
            "benchmarks.md", "Distributed: 2 processes (DDP, FSDP2) vs 1 process, same global work "
            "(`benchmarks/distributed.py`)",
            "No GPU was lent to this task, so no GPU scaling figure is given."),
    Said("the rollout process on a GPU of its own (`[pipeline] worker = \"process\"`, `device = \"cuda:1\"`), "
            "the rollout/learner split",
            "benchmarks.md", "H200: the tree advantage",
            "the rollout process (`[pipeline] worker = \"process\"`) on a second GPU was not measured: the machine "
            "had one."),
    Said("the batched group rollout against one sample at a time",
            "benchmarks.md", "Batched group rollout vs one sample at a time (`benchmarks/rollout.py`)",
            "No GPU was available, so the GPU figure is unmeasured."),
    Said("Qwen-Image, FLUX.2 [klein], Z-Image and the editing models (FLUX.1 Kontext, Qwen-Image-Edit) at full "
            "size, and any recipe trained with real weights",
            "models.md", "Recipes",
            "Qwen-Image, FLUX.2 [klein], Z-Image and the editing models have not run at full size, and no recipe has "
            "been trained on a GPU as written, with real weights."),
    Said("Qwen-Image, FLUX.2 [klein] and Z-Image at full size (their conformance suites ran on tiny pipelines)",
            "models.md", "Qwen-Image, FLUX.2 [klein] and Z-Image",
            "On a GPU only their conformance suites have run, on tiny pipelines; no run at full size"),
    Said("Wan 2.1 text-to-video 14B", "models.md", "Video: Wan 2.1 text-to-video", "the 14B has not run"),
    Said("Wan 2.2 TI2V-5B at full size", "models.md", "Video: Wan 2.2 TI2V-5B (text- and image-to-video)",
            "On a GPU only its conformance suite has run, on a tiny pipeline; no run at full size"),
    Said("Wan 2.2 A14B (two experts) at full size, and its image-to-video adapter on a GPU at all", "models.md",
            "Video: Wan 2.2 T2V A14B (two experts)",
            "On a GPU only the text-to-video adapter's conformance suite has run, on a tiny pipeline"),
    Said("LTX-Video at full size", "models.md", "Video: LTX-Video",
            "On a GPU only its conformance suite has run, on a tiny pipeline; no run at full size"),
    Said("context parallelism (`[distributed] context_parallel`, Ulysses and the ring's flash and cuDNN kernels) "
            "on two or more GPUs",
            "distributed.md", "Context parallelism: splitting every sequence",
            "No context-parallel run has been made on GPUs (no two GPUs were lent): neither split has run with "
            "the GPU kernels."),
)
#: GPU runs the docs describe that wrote no results file: listed apart from the table, as said there.
NOTED = (
    Said("the rollout process on CUDA, the embedded model (`pytest tests/train/test_engine_pipeline.py -k on_a_gpu`), "
         "on the H200 session's machine",
         "benchmarks.md", "H200: the tree advantage",
         "it ran and matched the worker thread's run to float32 rounding"),
)


@dataclass
class Run:
    """One GPU results file: what the page shows of it, and every number it holds."""

    source: str  # the file, relative to the repository
    device: str  # as recorded, or NOT_RECORDED with the file name's hint
    model: str  # the GPU model ("H100"), from the recorded device, else from the file name; "" if neither
    date: str = NOT_RECORDED
    versions: str = NOT_RECORDED
    driver: str = NOT_RECORDED
    ran: list[str] = field(default_factory=list)
    #: every number the file holds, with its path of keys (what tests/test_gpu_runs_doc.py checks the
    #: docs' GPU figures against)
    values: list[tuple[str, float]] = field(default_factory=list)


def numbers(obj, path: str = "") -> list[tuple[str, float]]:
    """Every number in a JSON value, at any depth, with its path of keys and indices joined by '.'
    (``variants.step.median``); booleans are not numbers."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [(path, float(obj))]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    return [pair for key, value in items for pair in numbers(value, f"{path}.{key}" if path else str(key))]


def gpu_model(text: str) -> str:
    """The GPU model a device name or a file name's slug names ("NVIDIA H100 80GB HBM3" -> "H100"), or ""."""
    match = GPU_MODEL.search(text or "")
    return re.sub(r"RTX ?", "RTX ", match.group(1).upper()) if match else ""


def _slug(path: Path) -> str:
    """The part of the file name its pattern's ``*`` stands for (``gpu_check_h200.json`` -> ``h200``)."""
    prefix = next(pattern.split("*")[0] for pattern in PATTERNS if path.match(pattern))
    return path.stem.removeprefix(prefix)


def _device(recorded: str | None, path: Path) -> tuple[str, str]:
    if recorded:
        return recorded, gpu_model(recorded)
    return f"{NOT_RECORDED} (file name: {_slug(path)})", gpu_model(_slug(path))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _error(text: str) -> str:
    """An error's name for the table: a CUDA status such as CUBLAS_STATUS_EXECUTION_FAILED if it has
    one, else its first words."""
    status = re.search(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]{4,}\b", text or "")
    if status:
        return status.group(0)
    text = " ".join((text or "no error recorded").split())
    return text if len(text) <= 80 else text[:77] + "..."


def _number(x: float) -> str:
    """A figure as the table prints it: 4 significant digits (22.706 -> 22.71, 60.0 -> 60)."""
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"


def _figure(value) -> str:
    """A step's figure for the table: numbers to 4 digits; a dict as its flat entries in brackets
    (deeper ones left to the JSON); a list as its length."""
    if isinstance(value, bool) or not isinstance(value, (int, float, dict, list)):
        return str(value)
    if isinstance(value, (int, float)):
        return _number(value)
    if isinstance(value, list):
        return f"({len(value)})"
    flat = [f"{k} {_figure(v)}" for k, v in value.items() if not isinstance(v, (dict, list)) and v is not None]
    return "(" + ", ".join(flat) + ")"


def read_flux_iteration(path: Path) -> Run:
    data = json.loads(path.read_text(encoding="utf-8"))
    run = Run(_relative(path), *_device(data.get("device"), path), values=numbers(data))
    run.date = data.get("date") or NOT_RECORDED
    run.driver = data.get("driver") or NOT_RECORDED
    run.versions = f"torch {data['torch']}" if data.get("torch") else NOT_RECORDED
    args = data.get("args") or {}
    how = []
    if "layers" in args:
        how.append("full depth" if args["layers"] is None else f"layers {args['layers']}")
    if args.get("size"):
        how.append(f"{args['size']} x {args['size']}")
    if args.get("iterations"):
        how.append(f"{args['iterations']} iterations")
    if args.get("attention"):
        how.append(f"attention `{args['attention']}`")
    variants, ratios = data.get("variants") or {}, data.get("ratio_to_step") or {}
    steps = []
    for name in [*args.get("variants", []), *[v for v in variants if v not in args.get("variants", [])]]:
        entry = variants.get(name)
        if entry is None:
            steps.append(f"`{name}` no result in the file")
            continue
        text = f"`{name}` pass, {entry['median']:.2f} s per iteration"
        if name in ratios:
            text += f" ({ratios[name]:.2f}x `step`)"
        steps.append(text)
    run.ran = ["FLUX.1-dev training iteration, random weights, `benchmarks/gpu_flux_iteration.py`"
               + (f" ({', '.join(how)})" if how else "") + ": " + "; ".join(steps)]
    return run


def read_sdpa_backends(path: Path) -> Run:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    recorded = next((line["device"] for line in lines if line.get("device")), None)
    values = [pair for i, line in enumerate(lines) for pair in numbers(line, str(i))]
    run = Run(_relative(path), *_device(recorded, path), values=values)
    run.date = next((line["date"] for line in lines if line.get("date")), NOT_RECORDED)
    run.driver = next((line["driver"] for line in lines if line.get("driver")), NOT_RECORDED)
    torches = sorted({line["torch"] for line in lines if line.get("torch")})
    run.versions = ", ".join(f"torch {t}" for t in torches) or NOT_RECORDED
    steps = []
    for line in lines:
        name = line.get("backend", "?")
        if line.get("ok"):
            steps.append(f"`{name}` pass ({len(line.get('done', []))} checks)")
        else:
            steps.append(f"`{name}` fail ({_error(line.get('error') or line.get('stderr') or '')})")
    run.ran = ["attention backends at FLUX.1-dev's head shape, forward and backward, `benchmarks/sdpa_backends.py`: "
               + "; ".join(steps)]
    return run


def read_gpu_check(path: Path) -> Run:
    data = json.loads(path.read_text(encoding="utf-8"))
    name = _relative(path)
    if data.get("kind") != CHECK_KIND:
        raise SystemExit(f"{name}: not a `flowrl selftest --gpu` result (kind {data.get('kind')!r}, "
                         f"expected {CHECK_KIND!r})")
    device = data.get("device") or {}
    recorded = device.get("name")
    if recorded and device.get("count", 1) != 1:
        recorded = f"{device['count']} x {recorded}"
    run = Run(name, *_device(recorded, path), values=numbers(data))
    run.date = data.get("date") or NOT_RECORDED
    run.driver = device.get("driver") or NOT_RECORDED
    labels = {"cuda": "CUDA"}
    versions = data.get("versions") or {}
    run.versions = ", ".join(f"{labels.get(k, k)} {v}" for k, v in versions.items() if v) or NOT_RECORDED
    steps = []
    for step in data.get("steps") or []:
        status = step.get("status")
        if status not in CHECK_STATUSES:
            raise SystemExit(f"{name}: step {step.get('name')!r} has status {status!r}, not one of {CHECK_STATUSES}")
        text = f"`{step.get('name')}` {status}"
        if step.get("seconds") is not None:
            text += f" ({_number(step['seconds'])} s)"
        figures = step.get("figures") or {}
        if figures:
            text += ": " + ", ".join(f"{k} {_figure(v)}" for k, v in figures.items())
        if status != "pass" and step.get("error"):
            text += f" ({_error(step['error'])})"
        steps.append(text)
    whole = "`flowrl selftest --gpu`"
    if data.get("seconds") is not None:
        whole += f" ({_number(data['seconds'])} s" + (f" of a {_number(data['budget_s'])} s budget)"
                                                       if data.get("budget_s") is not None else ")")
    run.ran = [whole + ": " + ("; ".join(steps) or "no steps recorded")]
    return run


def read_memory_check(path: Path) -> Run:
    """``benchmarks/gpu_memory_check.py``'s JSON: per configuration the plan's peak against
    ``max_memory_allocated``, and the phase that held the measured peak."""
    data = json.loads(path.read_text(encoding="utf-8"))
    run = Run(_relative(path), *_device(data.get("device"), path), values=numbers(data))
    run.date = data.get("date") or NOT_RECORDED
    run.versions = ", ".join(f"{k} {data[k]}" for k in ("torch", "cuda", "diffusers", "transformers", "peft")
                             if data.get(k)) or NOT_RECORDED
    parts = []
    for name, item in (data.get("configurations") or {}).items():
        if item.get("measured_gib") is None:
            parts.append(f"`{name}` {item.get('status') or 'no result'}"
                         + (f" ({_error(item['error'])})" if item.get("error") else ""))
            continue
        phases = item.get("measured_phases_gib") or {}
        at = max(phases, key=phases.get) if phases else None
        parts.append(f"`{name}` ({item.get('title', name)}): planned {_number(item['planned_gib'])} GiB, measured "
                     f"{_number(item['measured_gib'])} GiB" + (f" (peak in `{at}`)" if at else ""))
    run.ran = ["`flowrl plan` against `torch.cuda.max_memory_allocated`, full size, random weights, "
               "`benchmarks/gpu_memory_check.py`: " + ("; ".join(parts) or "no configuration recorded")]
    return run


READERS = {"flux_iteration": read_flux_iteration, "sdpa_backends": read_sdpa_backends, "gpu_check": read_gpu_check,
           "memory_check": read_memory_check}


def _relative(path: Path) -> str:
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return path.name


def load_runs(results: Path = RESULTS) -> list[Run]:
    """Every GPU results file in ``results``, read, in file-name order."""
    files = sorted({(p, kind) for pattern, kind in PATTERNS.items() for p in results.glob(pattern)},
                   key=lambda pk: pk[0].name)
    return [READERS[kind](path) for path, kind in files]


def render(runs: list[Run], planned=PLANNED, noted=NOTED) -> str:
    out = [
        "# GPU runs",
        "",
        f"<!-- Generated by `{COMMAND}` from the GPU results files in benchmarks/results/; do not edit by hand. -->",
        "",
        "What has run on a GPU, one row per results file a GPU run wrote to benchmarks/results/, and what",
        "has only been planned. Each row shows what its file records and nothing else: a field the file",
        f"does not hold is \"{NOT_RECORDED}\" (docs/benchmarks.md, \"GPU: FLUX.1-dev iteration\", describes",
        "the sessions, with what was noted there by hand). The FLUX.1-dev runs use the full-size",
        "transformer with random weights, so they time an iteration and say nothing about learning.",
        f"Regenerate with `{COMMAND}`; tests/test_gpu_runs_doc.py fails when this page",
        "is stale or when a page of the docs quotes a GPU figure that no results file holds.",
        "",
    ]
    if runs:
        out += ["| device | date | versions | driver | what ran: status and headline figure | results file |",
                "|---|---|---|---|---|---|"]
        out += [f"| {_cell(r.device)} | {_cell(r.date)} | {_cell(r.versions)} | {_cell(r.driver)} | "
                f"{_cell(' '.join(r.ran))} | `{r.source}` |" for r in runs]
    else:
        out.append("No GPU results file is in benchmarks/results/: nothing has run on a GPU.")
    if noted:
        out += ["", "## Noted in the docs, with no results file", "",
                "GPU runs a page describes that wrote no file to benchmarks/results/, as the page says it:", ""]
        out += [f"- {n.what}. [{n.page}]({n.page}), \"{n.section}\": \"{n.says}\"" for n in noted]
    out += ["", "## Planned, never measured on a GPU", "",
            "Each item with the page and section that say it was not measured:", ""]
    out += [f"- {p.what}. [{p.page}]({p.page}), \"{p.section}\": \"{p.says}\"" for p in planned]
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/gpu_runs.md is stale; write nothing")
    args = parser.parse_args(argv)
    text = render(load_runs())
    name = PAGE.relative_to(REPO).as_posix()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != text:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), name, "regenerated", lineterm="")
            print("\n".join(list(diff)[:60]), file=sys.stderr)
            print(f"{name} is stale; regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        print(f"{name} is up to date")
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
