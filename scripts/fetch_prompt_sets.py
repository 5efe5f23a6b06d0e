"""Fetch the standard prompt sets this repository does not ship, check them and write them where
the Flow-GRPO recipes' headers read them (``data/prompts/`` by default, ignored by git).

    python scripts/fetch_prompt_sets.py flow_grpo_ocr          # data/prompts/ocr_train.txt
    python scripts/fetch_prompt_sets.py flow_grpo_geneval      # geneval_train.jsonl, geneval_all.jsonl
    python scripts/fetch_prompt_sets.py flow_grpo_pickscore    # pickscore_train.txt
    python scripts/fetch_prompt_sets.py drawbench              # drawbench.csv
    python scripts/fetch_prompt_sets.py hpd                    # hpd_benchmark.csv (huggingface_hub)
    python scripts/fetch_prompt_sets.py all -o DIR
    python scripts/fetch_prompt_sets.py drawbench --from DrawBench.csv   # convert a copy you have

Why these are fetched, not shipped (recipes/prompts/benchmarks/README.md has the details):

- Flow-GRPO's training sets (yifan123/flow_grpo, MIT) are large: the PickScore one is 2.9 MB, and
  the OCR and GenEval ones were too large to be read where the shipped sets were prepared.
  Each is downloaded from the pinned commit and must have the git blob hash recorded here, so the
  bytes are exactly the commit's.
- DrawBench (Saharia et al. 2022, the Imagen paper) is published as a Google Sheet with no licence
  stated. It is downloaded from that sheet (the URL HELM and the Hugging Face DrawBench loader
  use) and must hold the 200 prompts of Flow-GRPO's copy (the sha256 of the sorted prompts is
  recorded here) in DrawBench's 11 categories.
- The HPSv2 benchmark prompts (Wu et al. 2023) live in the Hugging Face dataset zhwang/HPDv2,
  whose licence was not checked here; they are fetched with huggingface_hub as the hpsv2 package
  does (benchmark/{anime,concept-art,paintings,photo}.json), with no hash to check against.

Formats written (what flowrl's prompt loader reads, flowrl/prompts.py): text files one prompt a
line (byte for byte the upstream file), GenEval JSONL (one object a line with ``prompt``, ``tag``,
``include``, optional ``exclude``; flowrl.geneval.load_metadata reads it) and CSV tables with the
columns ``prompt,split,category`` (every row ``split = test``). ``geneval_all.jsonl`` is Flow-GRPO's
GenEval training metadata followed by GenEval's 553 evaluation prompts (the shipped
recipes/prompts/benchmarks/geneval.jsonl): the `geneval` reward's ``metadata`` must cover both
the training and the evaluation prompts of a run.

Needs the network (GitHub, Google Sheets, the Hugging Face hub) unless ``--from`` gives a local
copy of the upstream file; nothing else is installed or downloaded.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "recipes" / "prompts" / "benchmarks"
DEFAULT_OUT = Path("data") / "prompts"

FLOW_GRPO = "yifan123/flow_grpo"
FLOW_GRPO_COMMIT = "ac4c86e8cae021841f1fde853d340e0db67690dd"
#: set -> (path in Flow-GRPO at FLOW_GRPO_COMMIT, git blob SHA-1 there, file written)
FLOW_GRPO_FILES = {
    "flow_grpo_ocr": ("dataset/ocr/train.txt", "3ce0521b77b0a9031191d66ecc36ebaaf27a3922", "ocr_train.txt"),
    "flow_grpo_pickscore": ("dataset/pickscore/train.txt", "a437bd921c03fbc00c4e7ce148ae2d28fcd6e49b",
                            "pickscore_train.txt"),
    "flow_grpo_geneval": ("dataset/geneval/train_metadata.jsonl", "0b97e8a6802c08fc7537cd00c76ae79c851bddcb",
                          "geneval_train.jsonl"),
}

DRAWBENCH_URL = ("https://docs.google.com/spreadsheets/d/1y7nAbmR4FREi6npB1u-Bo3GFdwdOPYJc617rBOxIRHY/"
                 "gviz/tq?tqx=out:csv&sheet=Sheet1")
#: sha256 of DrawBench's 200 prompts, stripped, sorted, joined with "\n": Flow-GRPO's copy
#: (yifan123/flow_grpo_refactor f1f91a2, dataset/drawbench/test.txt: each prompt 5 times) and the
#: sheet's CSV export as found in mwomick/VaReSynth f904709, data/DrawBench.csv, agree on it.
DRAWBENCH_SHA256 = "1ccb4f9e51c9fd05bca5b34d04f8aa0460919be1e4b2cc233bf1abcb4c2bb618"
#: DrawBench's 11 categories and their sizes in that CSV.
DRAWBENCH_CATEGORIES = {"Colors": 25, "Conflicting": 10, "Counting": 19, "DALL-E": 20, "Descriptions": 20,
                        "Gary Marcus et al.": 10, "Misspellings": 10, "Positional": 20, "Rare Words": 7,
                        "Reddit": 38, "Text": 21}

HPD_REPO = "zhwang/HPDv2"
HPD_STYLES = ("anime", "concept-art", "paintings", "photo")

SETS = (*FLOW_GRPO_FILES, "drawbench", "hpd")


class FetchError(Exception):
    """A set could not be fetched or did not pass its check; the message says which and why."""


# ----------------------------------------------------------------------------- checks


def git_blob_sha1(data: bytes) -> str:
    """The SHA-1 git gives a file's content (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_blob(data: bytes, expected: str, what: str) -> None:
    got = git_blob_sha1(data)
    if got != expected:
        raise FetchError(f"{what}: git blob hash {got}, expected {expected} ({len(data)} bytes): not the file of "
                         f"{FLOW_GRPO} at {FLOW_GRPO_COMMIT[:8]}")


def prompts_sha256(prompts) -> str:
    return hashlib.sha256("\n".join(sorted({p.strip() for p in prompts})).encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- conversions


def drawbench_rows(csv_text: str) -> list[dict[str, str]]:
    """The rows ``{prompt, split, category}`` of DrawBench's CSV export (columns ``Prompts`` and
    ``Category``; other columns and blank rows ignored; text and category stripped), checked:
    200 distinct prompts, DRAWBENCH_SHA256, and DRAWBENCH_CATEGORIES."""
    reader = csv.DictReader(io.StringIO(csv_text.lstrip("\ufeff")))
    fields = {(name or "").strip(): name for name in reader.fieldnames or []}
    if "Prompts" not in fields or "Category" not in fields:
        raise FetchError(f"drawbench: expected the columns 'Prompts' and 'Category', got {reader.fieldnames}")
    rows = []
    for record in reader:
        prompt = (record.get(fields["Prompts"]) or "").strip()
        category = (record.get(fields["Category"]) or "").strip()
        if prompt:
            rows.append({"prompt": prompt, "split": "test", "category": category})
    prompts = [r["prompt"] for r in rows]
    if len(rows) != 200 or len(set(prompts)) != 200:
        raise FetchError(f"drawbench: {len(rows)} rows, {len(set(prompts))} distinct prompts; DrawBench has 200")
    if prompts_sha256(prompts) != DRAWBENCH_SHA256:
        raise FetchError("drawbench: the 200 prompts differ from Flow-GRPO's copy of DrawBench (sha256 of the "
                         f"sorted prompts {prompts_sha256(prompts)}, expected {DRAWBENCH_SHA256})")
    counts = dict(Counter(r["category"] for r in rows))
    if counts != DRAWBENCH_CATEGORIES:
        raise FetchError(f"drawbench: categories {sorted(counts.items())}, expected {sorted(DRAWBENCH_CATEGORIES.items())}")
    return rows


def hpd_rows(styles: dict[str, bytes]) -> list[dict[str, str]]:
    """``{prompt, split, category}`` rows of the HPSv2 benchmark: each style's file is a JSON list
    of prompt strings; the category is the style."""
    rows = []
    for style in HPD_STYLES:
        try:
            prompts = json.loads(styles[style])
        except (KeyError, json.JSONDecodeError) as exc:
            raise FetchError(f"hpd: {style}.json is missing or not JSON: {exc}") from exc
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
            raise FetchError(f"hpd: {style}.json is not a non-empty JSON list of prompts")
        rows += [{"prompt": p.strip(), "split": "test", "category": style} for p in prompts if p.strip()]
    return rows


def write_table(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, ["prompt", "split", "category"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def geneval_all(train: bytes, evaluation: bytes) -> bytes:
    """Flow-GRPO's GenEval training metadata followed by GenEval's evaluation metadata, one object
    a line; a prompt given two different requirements is refused (the `geneval` reward would)."""
    seen: dict[str, dict] = {}
    lines = []
    for name, data in (("train", train), ("evaluation", evaluation)):
        for lineno, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            key = " ".join(str(record.get("prompt", "")).split())
            requirement = {k: v for k, v in record.items() if k != "prompt"}
            if key in seen and seen[key] != requirement:
                raise FetchError(f"geneval: {name} line {lineno}: {key!r} has other requirements than before")
            seen[key] = requirement
            lines.append(line.rstrip("\r\n"))
    return ("\n".join(lines) + "\n").encode("utf-8")


def check_geneval(path: Path) -> int:
    """The file read by flowrl.geneval.load_metadata (so by the `geneval` reward): its record count."""
    sys.path.insert(0, str(REPO))
    from flowrl.geneval import load_metadata

    try:
        return len(load_metadata(path))
    except ValueError as exc:
        raise FetchError(f"geneval: {exc}") from exc


def unscorable_ocr_prompts(lines: list[str]) -> list[str]:
    """The prompts the `ocr` reward refuses (no quoted text); empty when every prompt is scorable
    (or when flowrl's plugins cannot be imported: nothing is checked then)."""
    sys.path.insert(0, str(REPO))
    try:
        from flowrl_plugins.rewards.ocr import quoted_target
    except ImportError:
        return []
    bad = []
    for prompt in lines:
        try:
            quoted_target(prompt)
        except ValueError:
            bad.append(prompt)
    return bad


# ----------------------------------------------------------------------------- fetching


def download(url: str, what: str, timeout: float = 120.0) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "flowrl-fetch-prompt-sets"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise FetchError(f"{what}: cannot download {url}: {exc}; give a local copy with --from") from exc


def fetch_set(name: str, out: Path, source: Path | None = None) -> list[str]:
    """Fetch (or read from ``source``), check and write one set (``out`` is made only then); the
    lines of its report."""
    if name in FLOW_GRPO_FILES:
        path, blob, filename = FLOW_GRPO_FILES[name]
        url = f"https://raw.githubusercontent.com/{FLOW_GRPO}/{FLOW_GRPO_COMMIT}/{path}"
        data = source.read_bytes() if source else download(url, name)
        check_blob(data, blob, name)
        out.mkdir(parents=True, exist_ok=True)
        target = out / filename
        target.write_bytes(data)
        report = [f"{name}: {target} ({len(data)} bytes, git blob {blob[:12]} of {FLOW_GRPO}@{FLOW_GRPO_COMMIT[:8]}:{path})"]
        if name == "flow_grpo_geneval":
            report.append(f"  {check_geneval(target)} GenEval records")
            merged = out / "geneval_all.jsonl"
            merged.write_bytes(geneval_all(data, (SHIPPED / "geneval.jsonl").read_bytes()))
            report.append(f"  {merged}: {check_geneval(merged)} records (training + GenEval's 553), the reward's metadata")
        else:
            lines = [line.strip() for line in data.decode("utf-8").splitlines() if line.strip()]
            report.append(f"  {len(lines)} prompts")
            if name == "flow_grpo_ocr":
                bad = unscorable_ocr_prompts(lines)
                if bad:
                    report.append(f"  warning: {len(bad)} prompt(s) quote no text, which the `ocr` reward refuses "
                                  f"(flowrl validate will say so), e.g. {bad[0]!r}")
        return report
    if name == "drawbench":
        text = source.read_text(encoding="utf-8") if source else download(DRAWBENCH_URL, name).decode("utf-8")
        rows = drawbench_rows(text)
        target = out / "drawbench.csv"
        write_table(target, rows)
        line = (f"drawbench: {target} ({len(rows)} prompts in {len(DRAWBENCH_CATEGORIES)} categories; "
                f"prompt sha256 {DRAWBENCH_SHA256[:12]})")
        return [line]
    if name == "hpd":
        if source:
            styles = {s: (source / f"{s}.json").read_bytes() for s in HPD_STYLES if (source / f"{s}.json").is_file()}
        else:
            try:
                from huggingface_hub import hf_hub_download
            except ImportError as exc:
                raise FetchError("hpd: needs huggingface_hub (installed with flowrl-diffusion)") from exc
            styles = {}
            for s in HPD_STYLES:
                try:
                    styles[s] = Path(hf_hub_download(HPD_REPO, f"{s}.json", subfolder="benchmark",
                                                     repo_type="dataset")).read_bytes()
                except Exception as exc:  # the hub raises many types; all mean "not fetched"
                    raise FetchError(f"hpd: cannot download benchmark/{s}.json of {HPD_REPO}: {exc}") from exc
        rows = hpd_rows(styles)
        target = out / "hpd_benchmark.csv"
        write_table(target, rows)
        counts = Counter(r["category"] for r in rows)
        return [f"hpd: {target} ({len(rows)} prompts: " + ", ".join(f"{s} {counts[s]}" for s in HPD_STYLES) + ")"]
    raise FetchError(f"unknown set {name!r}: choose from {', '.join(SETS)} or 'all'")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sets", nargs="+", choices=[*SETS, "all"], metavar="SET",
                    help=f"one or more of: {', '.join(SETS)}, or all")
    ap.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT, help=f"output directory [{DEFAULT_OUT}]")
    ap.add_argument("--from", dest="source", type=Path,
                    help="a local copy of the upstream file (one set only; hpd: a directory of its four .json files)")
    args = ap.parse_args(argv)
    names = list(SETS) if "all" in args.sets else list(dict.fromkeys(args.sets))
    if args.source and len(names) != 1:
        ap.error("--from takes one set")
    failed = 0
    for name in names:
        try:
            for line in fetch_set(name, args.out, args.source):
                print(line)
        except FetchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
