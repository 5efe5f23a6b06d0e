"""Benchmark suites for ``flowrl eval --suite NAME``: prompts, categories, sampling settings,
scorer and table, the way each benchmark defines them.

Two kinds of suite go through the same sampling, table and JSON (``flowrl/commands/evaluate.py``,
``run_suite``), both as a :class:`SuiteRun`:

- a suite a model carries (:class:`flowrl.interfaces.BenchmarkSuite`, e.g. the compositional
  embedded model's ``geneval``: its held-out prompts scored by its own detector). A model that
  carries a suite of the asked name is evaluated on it (:func:`carried`);
- a suite of this registry (:data:`SUITES`), for any model: a prompt set, shipped in
  ``recipes/prompts/benchmarks/`` or fetched by ``scripts/fetch_prompt_sets.py``, scored by a
  registered reward (:class:`Suite`, :meth:`Suite.prepare`).

The registry:

- ``ocr``: Flow-GRPO's OCR test set (1018 prompts, no categories; shipped), scored by the ``ocr``
  reward; table: the mean OCR score (Flow-GRPO's OCR accuracy) and the exact-match rate.
- ``drawbench``: DrawBench (200 prompts in 11 categories; fetched), scored by a preference reward
  (default ``pickscore``, ``--reward`` picks another); table: the mean per category and overall.
- ``geneval``: GenEval's 553 prompts with their metadata (6 tags; shipped), scored by the
  ``geneval`` reward's verdicts; table: GenEval's (accuracy per tag, overall the mean of the tags).

Each suite records the benchmark's sampling settings (:class:`Sampling`) with their source. The
suite applies its steps and images per prompt itself (``--steps`` and ``--seeds`` change them);
resolution and guidance are parameters of the model (``--set model.height=...``), which the suite
cannot set for every model, so the result records both the benchmark's and the model's and
:func:`setting_differences` names those that differ.

Standard errors: a category's mean over its images with ``std / sqrt(n)`` (sample standard
deviation); a rate (GenEval's verdicts, OCR's exact match) with ``sqrt(p (1 - p) / (n - 1))``,
as :func:`flowrl.geneval.summarise` computes them. Images of the same prompt are counted as
independent, as GenEval's table does.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from . import geneval
from .errors import DISTRIBUTION, FlowrlError, MissingDependencyError, suggest
from .interfaces import BenchmarkSuite
from .rewards import score

__all__ = ["SHIPPED", "SUITES", "Sampling", "Suite", "SuiteRun", "carried", "get_suite", "mean_table", "ocr_table",
           "setting_differences", "summarize", "text_table", "verdict_table"]

#: The prompt sets shipped with the repository (a source checkout; a wheel carries no recipes).
SHIPPED = Path(__file__).resolve().parents[1] / "recipes" / "prompts" / "benchmarks"
#: Where ``scripts/fetch_prompt_sets.py`` writes by default, relative to the directory it runs in.
FETCHED = Path("data") / "prompts"
FETCH = "python scripts/fetch_prompt_sets.py"


# ----------------------------------------------------------------------------- statistics


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``mean``, ``std`` (divisor ``n - 1``), ``sem`` (``std / sqrt(n)``), ``min``, ``max``, ``n``."""
    values = [float(v) for v in values]
    n = len(values)
    if not n:
        raise ValueError("summarize needs at least one value")
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "sem": std / math.sqrt(n), "min": min(values), "max": max(values), "n": n}


def rate(flags: Sequence[bool]) -> dict[str, float]:
    """The fraction of true flags with GenEval's standard error ``sqrt(p (1 - p) / (n - 1))``."""
    n = len(flags)
    p = sum(bool(f) for f in flags) / n
    return {"mean": p, "sem": math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0, "n": n}


def verdict_table(records: Sequence[Mapping]) -> dict:
    """GenEval's table (:func:`flowrl.geneval.summarise`) of per-image ``category`` and ``strict``
    verdicts, plus ``soft``: the summary of the per-image partial scores."""
    table = geneval.summarise([r["category"] for r in records], [r["strict"] for r in records])
    table["soft"] = summarize([r["soft"] for r in records])
    return table


def mean_table(records: Sequence[Mapping]) -> dict:
    """Per category (in the order they first appear) and overall: the mean of the per-image
    ``score`` with its standard error; the overall is the mean over all images."""
    categories: dict[str, list[float]] = {}
    for r in records:
        categories.setdefault(r["category"], []).append(r["score"])
    return {"overall": summarize([r["score"] for r in records]),
            "categories": {c: summarize(v) for c, v in categories.items()}}


def ocr_table(records: Sequence[Mapping]) -> dict:
    """Flow-GRPO's OCR accuracy (the mean score over images) and the exact-match rate (the
    fraction of images scoring 1: the quoted text read in full); the set has no categories."""
    return {"overall": summarize([r["score"] for r in records]), "categories": {},
            "exact_match": rate([r["score"] >= 1.0 for r in records])}


# ----------------------------------------------------------------------------- what run_suite runs


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A benchmark's own sampling settings and where they come from. ``steps`` and
    ``images_per_prompt`` are applied by the suite; ``height``, ``width`` and ``guidance`` are the
    model's parameters, recorded beside the model's own (None: the benchmark does not fix it)."""

    images_per_prompt: int
    steps: int | None = None
    height: int | None = None
    width: int | None = None
    guidance: float | None = None
    source: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SuiteRun:
    """A suite ready to sample and score: one entry per prompt in ``prompts``, ``categories``
    (None where the set has none) and ``images_per_prompt``; ``score(images, prompts)`` gives one
    record (a dict of JSON values) per image, ``tabulate(records)`` the table (``overall`` and
    ``categories``, each ``mean``, ``sem``, ``n``, and whatever else the suite reports)."""

    name: str
    prompts: list[str]
    categories: list[str | None]
    images_per_prompt: list[int]
    score: Callable[[torch.Tensor, list[str]], list[dict]]
    tabulate: Callable[[Sequence[Mapping]], dict]
    metric: str = "accuracy"
    overall: str = "mean of the categories"  # how the overall row is made, printed beside it
    steps: int | None = None
    description: str = ""
    batch_size: int = 64
    settings: dict = dataclasses.field(default_factory=dict)  # recorded in the result's settings
    extra_rows: tuple[tuple[str, str, str], ...] = ()  # (label, key of the table, note) printed after overall

    def first(self, n: int) -> SuiteRun:
        """The suite on its first ``n`` prompts (``--limit``)."""
        return dataclasses.replace(self, prompts=self.prompts[:n], categories=self.categories[:n],
                                   images_per_prompt=self.images_per_prompt[:n])


def carried(bench: BenchmarkSuite) -> SuiteRun:
    """A suite a model carries: its verdicts (``strict``, ``soft``, ``reasons``) in GenEval's table."""

    def score_images(images, prompts):
        return [{"strict": bool(v.strict), "soft": float(v.soft), "reasons": list(v.reasons)}
                for v in bench.score(images, prompts)]

    return SuiteRun(name=bench.name, prompts=list(bench.prompts), categories=list(bench.categories),
                    images_per_prompt=list(bench.images_per_prompt), score=score_images, tabulate=verdict_table,
                    steps=bench.steps, description=bench.description)


def text_table(run: SuiteRun, table: Mapping) -> str:
    """The table as text: each category's mean and standard error, the overall, the extra rows."""
    labels = [*table["categories"], "overall", *(label for label, _, _ in run.extra_rows)]
    width = max(len(str(c)) for c in labels)
    lines = [f"{run.name}: {run.metric} ± standard error (n images)"]
    for category, row in table["categories"].items():
        lines.append(f"  {category!s:<{width}}  {row['mean']:.3f} ± {row['sem']:.3f}  (n = {row['n']})")
    overall = table["overall"]
    lines.append(f"  {'overall':<{width}}  {overall['mean']:.3f} ± {overall['sem']:.3f}  ({run.overall})")
    for label, key, note in run.extra_rows:
        row = table[key]
        lines.append(f"  {label:<{width}}  {row['mean']:.3f} ± {row['sem']:.3f}  ({note})")
    return "\n".join(lines)


def setting_differences(sampling: Mapping | None, model: Mapping) -> str | None:
    """None when the model sampled at the benchmark's resolution and guidance (or the benchmark fixes
    neither), else both, e.g. ``"the benchmark samples at 512x512 with guidance 4.5, this model at
    32x32 with no guidance"``; the benchmark's ``None`` values are not compared."""
    if not sampling:
        return None
    keys = [k for k in ("height", "width", "guidance") if sampling.get(k) is not None]
    if all(model.get(k) == sampling[k] for k in keys):
        return None

    def describe(d: Mapping) -> str:
        size = f"{d.get('height')}x{d.get('width')}"
        return f"{size} with " + ("no guidance" if d.get("guidance") is None else f"guidance {d['guidance']:g}")

    return f"the benchmark samples at {describe(sampling)}, this model at {describe(model)}"


# ----------------------------------------------------------------------------- prompt files


def read_text_prompts(path: Path) -> list[tuple[str, str | None]]:
    """One prompt a line (blank lines skipped); no categories."""
    return [(line.strip(), None) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_geneval_prompts(path: Path) -> list[tuple[str, str | None]]:
    """GenEval's metadata (:func:`flowrl.geneval.load_metadata`): each record's prompt and tag."""
    try:
        records = geneval.load_metadata(path)
    except ValueError as exc:
        raise FlowrlError(f"not GenEval metadata: {exc}", where="--suite-prompts",
                          hint='one JSON object a line with "prompt", "tag", "include" (GenEval\'s format)') from exc
    missing = [i for i, r in enumerate(records, 1) if not str(r.get("prompt", "")).strip()]
    if missing:
        raise FlowrlError(f"record {missing[0]} of {path} has no \"prompt\"", where="--suite-prompts")
    return [(r["prompt"], r["tag"]) for r in records]


def read_table_prompts(path: Path) -> list[tuple[str, str | None]]:
    """A CSV with the columns ``prompt`` and ``category`` (``scripts/fetch_prompt_sets.py``'s tables);
    a row without a category is in the category ``(none)``."""
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in reader.fieldnames or []]
        if "prompt" not in columns or "category" not in columns:
            raise FlowrlError(f"{path} has the columns {columns}, not 'prompt' and 'category'", where="--suite-prompts",
                              hint=f"write it with `{FETCH} drawbench` (prompt,split,category)")
        rows = [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in reader]
    return [(r["prompt"], r["category"] or "(none)") for r in rows if r["prompt"]]


# ----------------------------------------------------------------------------- the registry


@dataclasses.dataclass(frozen=True)
class Suite:
    """A benchmark defined by its prompt set, for any model.

    ``files()`` lists where its prompts are looked for (the first that exists is read by
    ``read``, into ``(prompt, category)`` pairs); ``missing`` says how to get them when none
    exists. ``reward`` scores it (``choose_reward``: ``--reward NAME`` may replace it) with
    ``reward_settings(file)`` as defaults under the user's ``--reward-set``; ``needs`` are reward
    settings the user must give (``(key, what)``), ``requires`` the ``(module, extra)`` the reward
    imports. ``table``: ``"verdicts"`` (GenEval's table of the reward's ``strict``/``soft``
    extras), ``"ocr"`` (:func:`ocr_table`) or ``"mean"`` (:func:`mean_table` of the scores)."""

    name: str
    title: str
    sampling: Sampling
    files: Callable[[], list[Path]]
    read: Callable[[Path], list[tuple[str, str | None]]]
    missing: str
    reward: str
    table: Literal["verdicts", "ocr", "mean"]
    choose_reward: bool = False
    reward_settings: Callable[[Path], dict] = lambda path: {}
    needs: tuple[tuple[str, str], ...] = ()
    requires: tuple[tuple[str, str], ...] = ()

    def prompt_file(self, given: Path | None = None) -> Path:
        """``given`` (``--suite-prompts``) or the first of :attr:`files` that exists; one
        FlowrlError naming where it looked otherwise."""
        if given is not None:
            if not Path(given).is_file():
                raise FlowrlError(f"prompt file not found: {given}", where="--suite-prompts",
                                  hint=f"give the {self.title} file, or leave --suite-prompts out for the default")
            return Path(given)
        candidates = self.files()
        for path in candidates:
            if path.is_file():
                return path
        looked = " or ".join(str(p) for p in dict.fromkeys(candidates))
        raise FlowrlError(f"the {self.title} prompts are not here: no {looked}", where=f"--suite {self.name}",
                          hint=self.missing)

    def load(self, given: Path | None = None) -> tuple[Path, list[str], list[str | None]]:
        """``(file, prompts, categories)``; a FlowrlError for a missing, unreadable or empty file."""
        path = self.prompt_file(given)
        try:
            pairs = self.read(path)
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise FlowrlError(f"cannot read {path}: {exc}", where=f"--suite {self.name}") from exc
        if not pairs:
            raise FlowrlError(f"{path} holds no prompt", where=f"--suite {self.name}", hint=self.missing)
        return path, [p for p, _ in pairs], [c for _, c in pairs]

    def check_requirements(self, settings: Mapping[str, Any], *, model: str | None = None) -> None:
        """Before any model loads: the settings the user must give, then the packages its reward
        imports (a missing one is one message naming the extra)."""
        missing = [(key, what) for key, what in self.needs if not settings.get(key)]
        if missing:
            carrier = f"model '{model}' carries no '{self.name}' suite of its own, so " if model else ""
            needed = "; ".join(f"--reward-set {key}=DIR ({what})" for key, what in missing)
            raise FlowrlError(
                f"{carrier}the '{self.name}' suite ({self.title}) scores with the '{self.reward}' reward, which needs "
                f"local files it never downloads: {needed}", where=f"--suite {self.name}",
                hint=" ".join(f"--reward-set {key}=DIR" for key, _ in missing)
                + ' (docs/models.md, "Benchmark suites")')
        for module, extra in self.requires:
            if importlib.util.find_spec(module) is None:
                raise MissingDependencyError(
                    f"the '{self.name}' suite scores with the '{self.reward}' reward, which needs the optional "
                    f"package '{module}', which is not installed", where=f"--suite {self.name}",
                    hint=f'pip install "{DISTRIBUTION}[{extra}]"')

    def prepare(self, reward, label: str, file: Path, prompts: list[str], categories: list[str | None],
                settings: Mapping[str, Any] | None = None) -> SuiteRun:
        """The suite as a :class:`SuiteRun`, scored by ``reward`` (built by the caller from
        :attr:`reward` or the user's choice; ``label`` names it)."""
        if self.table == "verdicts":
            def score_images(images, batch_prompts):
                out = score(reward, images, batch_prompts, name=label)
                missing = [k for k in ("strict", "soft") if k not in out.extras]
                if missing:
                    raise FlowrlError(f"reward '{label}' returns no '{missing[0]}' extra, which the '{self.name}' "
                                      "table needs", where=f"--suite {self.name}")
                extras = {k: v.tolist() for k, v in out.extras.items()}
                return [{"strict": bool(extras["strict"][j] >= 0.5), "soft": float(extras["soft"][j]),
                         **({"exact": float(extras["exact"][j])} if "exact" in extras else {})}
                        for j in range(len(batch_prompts))]
            tabulate, metric, overall, rows = verdict_table, "accuracy", "mean of the categories", ()
        else:
            def score_images(images, batch_prompts):
                return [{"score": float(s)} for s in score(reward, images, batch_prompts, name=label).scores.tolist()]
            if self.table == "ocr":
                tabulate, metric, overall = ocr_table, f"{label} score", "mean over images: OCR accuracy"
                rows = (("exact match", "exact_match", "fraction of images scoring 1"),)
            else:
                tabulate, metric, overall, rows = mean_table, label, "mean over images", ()
        n = self.sampling.images_per_prompt
        return SuiteRun(
            name=self.name, prompts=list(prompts), categories=list(categories), images_per_prompt=[n] * len(prompts),
            score=score_images, tabulate=tabulate, metric=metric, overall=overall, steps=self.sampling.steps,
            description=f"{self.title} ({file.resolve()}), scored by the '{label}' reward", batch_size=8,
            extra_rows=rows, settings={"benchmark": self.sampling.as_dict(), "prompt_file": str(file.resolve()),
                                       "reward": {"use": label, "settings": dict(settings or {})}})


FLOW_GRPO_EVAL = ("Flow-GRPO's SD3.5-M evaluation (yifan123/flow_grpo at ac4c86e8: config/base.py "
                  "sample.eval_num_steps = 40, sample.eval_guidance_scale = 4.5; config/grpo.py resolution 512), "
                  "as recipes/flow_grpo_{task}_sd3.toml records")

#: The registered suites by name.
SUITES: dict[str, Suite] = {
    "ocr": Suite(
        name="ocr", title="Flow-GRPO OCR test set",
        sampling=Sampling(images_per_prompt=1, steps=40, height=512, width=512, guidance=4.5,
                          source=FLOW_GRPO_EVAL.format(task="ocr") + ": one image a prompt over the 1018 prompts "
                                 "([prompts] num_eval = 1018)"),
        files=lambda: [SHIPPED / "ocr_test.txt"], read=read_text_prompts,
        missing="the set ships in a source checkout (recipes/prompts/benchmarks/ocr_test.txt); from an installed "
                "package pass --suite-prompts PATH to a copy of Flow-GRPO's dataset/ocr/test.txt",
        reward="ocr", table="ocr",
        requires=(("rapidocr_onnxruntime", "ocr"), ("onnxruntime", "ocr")),
    ),
    "drawbench": Suite(
        name="drawbench", title="DrawBench",
        sampling=Sampling(images_per_prompt=5, steps=40, height=512, width=512, guidance=4.5,
                          source="five images a prompt as Flow-GRPO's DrawBench test file lists each prompt five "
                                 "times (yifan123/flow_grpo_refactor f1f91a2, dataset/drawbench/test.txt; "
                                 "recipes/prompts/benchmarks/README.md); steps, guidance and resolution: "
                                 + FLOW_GRPO_EVAL.format(task="pickscore")),
        files=lambda: list(dict.fromkeys([FETCHED / "drawbench.csv",
                                          SHIPPED.parents[2] / FETCHED / "drawbench.csv"])),
        read=read_table_prompts,
        missing=f"DrawBench has no licence to redistribute it, so it is fetched, not shipped: run `{FETCH} drawbench` "
                f"(writes {FETCHED / 'drawbench.csv'}), or pass --suite-prompts PATH to that file",
        reward="pickscore", table="mean", choose_reward=True,
    ),
    "geneval": Suite(
        name="geneval", title="GenEval",
        sampling=Sampling(images_per_prompt=4, steps=40, height=512, width=512, guidance=4.5,
                          source="four images a prompt: GenEval (djghosh13/geneval at af4902f2, its 553 prompts "
                                 "x 4, as Flow-GRPO's test_metadata.jsonl repeats them); steps, guidance and "
                                 "resolution: " + FLOW_GRPO_EVAL.format(task="geneval")),
        files=lambda: [SHIPPED / "geneval.jsonl"], read=read_geneval_prompts,
        missing="the set ships in a source checkout (recipes/prompts/benchmarks/geneval.jsonl); from an installed "
                "package pass --suite-prompts PATH to GenEval's prompts/evaluation_metadata.jsonl",
        reward="geneval", table="verdicts",
        reward_settings=lambda path: {"metadata": str(path), "mode": "strict"},
        needs=(("detector", ("an OWLv2 checkpoint directory, e.g. `hf download google/owlv2-base-patch16-ensemble "
                             "--local-dir models/owlv2`")),
               ("clip", ("a CLIP ViT-L/14 directory, GenEval's colour classifier, e.g. `hf download "
                         "openai/clip-vit-large-patch14 --local-dir models/clip-vit-large-patch14`"))),
        requires=(("transformers", "rewards"),),
    ),
}


def get_suite(name: str, *, carried_by: str | None = None) -> Suite:
    """The registered suite ``name``; one FlowrlError listing the suites otherwise (``carried_by``:
    the model that was asked first and carries none by that name)."""
    if name in SUITES:
        return SUITES[name]
    carrier = f": model '{carried_by}' carries none by that name, and flowrl defines none" if carried_by else ""
    raise FlowrlError(f"unknown suite '{name}'{carrier}", where="--suite",
                      hint=suggest(name, SUITES) + " (or a suite the model carries, e.g. embedded_compose's geneval)")
