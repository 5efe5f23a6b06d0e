"""Property: whatever a recipe holds, `flowrl validate` accepts it or exits 2 with one message.

Hypothesis builds recipes from the quickstart by setting documented keys (every key of every
plain table, of the quickstart's components and of every other registered component a table may
switch to) to random values of random types: huge and negative integers, NaN and infinities,
strings with control characters and bidi overrides, lists, tables. Each is validated through
the real command line (``flowrl.cli.main``) in this process; an exception escaping it would be a
traceback, so the test fails on any. Each example must finish within the deadline.

A second property draws PLAUSIBLE values for the newer keys (branch rollouts and the tree advantage,
pipelining, replay, windows, EMA, gradient sync, prompt tables and splits, offline data, reward
weights, profiles), several at once, on several shipped recipes: values of the right type near the
edges of what is valid (a branch step past the steps, a staleness of 2, a split with no rows, a
table of the other kind), so that the cross-field rules are reached rather than the type checks.

The examples are the same on every run (tests/conftest.py's ``ci`` hypothesis profile);
``FLOWRL_HYPOTHESIS=long`` draws 2000 fresh ones for a longer local hunt.
"""

from __future__ import annotations

import dataclasses
import json
import math
import unicodedata
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flowrl import cli  # noqa: E402
from flowrl.plugins import get_registry  # noqa: E402
from flowrl.recipe import COMPONENT_SECTIONS, SECTIONS, read_toml, resolve_paths  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
QUICKSTART = RECIPES / "quickstart_hacking.toml"
EXTRA_REWARD_KEYS = ("weight", "name", "chunk_weights")


def _documented_keys() -> list[tuple[str, str, str | None]]:
    """(table, key, component name or None) for every documented key a recipe may set."""
    keys = [(table, f.name, None) for table, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    registry = get_registry()
    for table, kind in [*COMPONENT_SECTIONS.items(), ("rewards", "reward")]:
        for name, comp in registry.components[kind].items():
            keys.append((table, "use", name))
            for f in dataclasses.fields(comp.params) if comp.params else ():
                keys.append((table, f.name, name))
    keys += [("rewards", k, None) for k in EXTRA_REWARD_KEYS]
    return keys


KEYS = _documented_keys()
NASTY = st.sampled_from(["", "\x00", "a\nb", "\x1b[31mred", "\u202eevil", "../../etc", "nan", "1e400", "[1]"])
SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
    NASTY,
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=5), st.dictionaries(st.text(max_size=5), SCALARS, max_size=3))


def _toml_key(key: str) -> str:
    """A TOML basic string holding exactly ``key`` (non-printables as \\u escapes)."""
    def esc(ch: str) -> str:
        if ch in '"\\':
            return "\\" + ch
        if ch.isprintable():
            return ch
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}"

    return '"' + "".join(esc(ch) for ch in key) + '"'


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return _toml_key(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{_toml_key(k)} = {_toml(v)}" for k, v in value.items()) + "}"


def _write(data: dict, path: Path) -> None:
    lines = []
    for table, body in data.items():
        entries = body if isinstance(body, list) else [body]
        for entry in entries:
            lines.append(f"[[{table}]]" if isinstance(body, list) else f"[{table}]")
            lines += [f"{_toml_key(k)} = {_toml(v)}" for k, v in entry.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.slow
@settings(deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.lists(st.tuples(st.sampled_from(KEYS), VALUES, st.booleans()), min_size=1, max_size=3))
def test_validate_accepts_or_exits_2_with_one_message(changes, tmp_path, capsys):
    data = read_toml(QUICKSTART)
    for (table, key, component), value, use_value in changes:
        entry = data.setdefault(table, [{}] if table == "rewards" else {})
        entry = entry[0] if isinstance(entry, list) else entry
        if key == "use":
            entry.clear()  # switching component: its own keys only
            entry["use"] = component if use_value else value
        else:
            if component is not None and entry.get("use") != component:
                entry.clear()
                entry["use"] = component
            entry[key] = value
    path = tmp_path / "fuzz.toml"
    _write(data, path)
    _assert_accepted_or_one_message(path, capsys)


def _assert_accepted_or_one_message(path: Path, capsys) -> None:
    """`flowrl validate PATH` exits 0 (silent, or validate's warnings only) or 2 with one clean
    message; an exception escaping the command line fails the test."""
    capsys.readouterr()
    try:
        cli.main(["validate", str(path)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code in (0, 2), (code, err)
    if code == 0:  # accepted: silent, or with validate's warnings only (e.g. the plan exceeds the memory)
        assert "ok" in out and all(line.startswith("warning:") for line in err.splitlines() if line), err
        assert "Traceback" not in err and "error:" not in err, err
    else:
        assert err.startswith("error:") and err.count("\nerror:") == 0 and "Traceback" not in err, err
        # no raw control, bidi or line-separator characters reach the terminal
        assert all(ch == "\n" or unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp") for ch in err), repr(err)


# ----------------------------------------------------------------------------- the newer keys, plausibly

#: The shipped recipes the plausible values are set on: GRPO with chunks, step-level GRPO,
#: DiffusionNFT with a prompt table and an ODE window, profile-driven chunks, offline SFT.
BASES = ["quickstart_hacking.toml", "quickstart_step.toml", "quickstart.toml", "quickstart_dynamics.toml",
         "offline_sft.toml"]
PROFILE = str(RECIPES / "profiles" / "embedded.json")
OTHER_PROFILE = str(RECIPES / "profiles" / "embedded_window16.json")
SHAPES = str(RECIPES / "prompts" / "shapes.csv")
steps_list = st.lists(st.integers(-1, 20), max_size=3)
small = st.integers(-1, 20)
fraction = st.sampled_from([-0.5, 0.0, 0.4, 0.99, 1.0, 1.5, float("nan")])

#: (table, key, component or None) -> plausible values. "{data}" is the fixture's folder of tables.
NEWER: dict[tuple[str, str, str | None], st.SearchStrategy] = {
    ("sampler", "steps", None): st.integers(1, 20),
    ("sampler", "image_from", None): st.sampled_from(["x0_hat", "final"]),
    ("sampler", "sde_window", None): st.lists(small, max_size=3),
    ("sampler", "batch_size", None): st.integers(0, 16),
    ("window", "steps", "branch"): steps_list,
    ("window", "factors", "branch"): st.lists(st.integers(0, 4), max_size=3),
    ("window", "profile", "branch"): st.sampled_from(["", PROFILE, OTHER_PROFILE, "{data}/nope.json",
                                                      "{data}/not_a_profile.json"]),
    ("window", "count", "branch"): st.integers(0, 5),
    ("advantage", "use", None): st.sampled_from(["group_zscore", "tree", "diversity"]),
    ("advantage", "keep", "tree"): st.integers(0, 10),
    ("advantage", "prune_steps", "tree"): steps_list,
    ("advantage", "prune_slide", "tree"): st.integers(0, 3),
    ("advantage", "fusion", "tree"): st.sampled_from(["mean", "probability"]),
    ("train", "group_size", None): st.integers(1, 8),
    ("train", "prompts_per_iteration", None): st.integers(1, 6),
    ("pipeline", "staleness", None): st.integers(0, 2),
    ("pipeline", "sync_every", None): st.integers(0, 3),
    ("pipeline", "overlap", None): st.booleans(),
    ("pipeline", "worker", None): st.sampled_from(["thread", "process", "fork"]),
    ("pipeline", "device", None): st.sampled_from(["", "cpu", "cuda:0", "cuda:9", "gpu"]),
    ("pipeline", "weight_level", None): st.sampled_from(["unit", "sequence"]),
    ("pipeline", "truncate", None): fraction,
    ("replay", "size", None): st.integers(0, 3),
    ("replay", "max_staleness", None): st.integers(0, 3),
    ("replay", "per_iteration", None): st.integers(0, 3),
    ("replay", "sample", None): st.sampled_from(["newest", "uniform", "oldest"]),
    ("replay", "weight_level", None): st.sampled_from(["unit", "sequence"]),
    ("replay", "weight_steps", None): small,
    ("replay", "truncate", None): fraction,
    ("window", "use", None): st.sampled_from(["fixed", "ode", "random", "sliding", "moving", "branch"]),
    ("window", "size", "random"): small, ("window", "lo", "random"): small, ("window", "hi", "random"): small,
    ("window", "scope", "random"): st.sampled_from(["sample", "group", "iteration"]),
    ("window", "size", "sliding"): small, ("window", "every", "sliding"): st.integers(0, 3),
    ("window", "stride", "sliding"): st.integers(0, 3), ("window", "compress", "sliding"): fraction,
    ("window", "outside", "sliding"): st.sampled_from(["euler", "dpm2m"]),
    ("window", "solver", "ode"): st.sampled_from(["euler", "dpm2m", "heun"]),
    ("schedule", "use", None): st.sampled_from(["shift", "flux_dynamic", "model"]),
    ("ema", "enabled", None): st.booleans(),
    ("ema", "decay", None): fraction,
    ("ema", "warmup_steps", None): st.integers(0, 10),
    ("ema", "every", None): st.integers(0, 3),
    ("ema", "on_cpu", None): st.booleans(),
    ("ema", "evaluate", None): st.booleans(),
    ("distributed", "strategy", None): st.sampled_from(["auto", "none", "ddp", "fsdp2"]),
    ("distributed", "gradient_sync", None): st.sampled_from(["auto", "step", "micro_batch", "every_step"]),
    ("distributed", "shard", None): st.sampled_from(["full", "hybrid"]),
    ("distributed", "num_processes", None): st.integers(0, 4),
    ("prompts", "source", None): st.sampled_from(["model", SHAPES, "{data}/prompts.txt", "{data}/no_split.csv",
                                                  "{data}/nope.csv"]),
    ("prompts", "eval_source", None): st.sampled_from(["", SHAPES, "{data}/prompts.txt", "{data}/no_split.csv"]),
    ("prompts", "split_column", None): st.sampled_from(["", "split", "splt"]),
    ("prompts", "train_split", None): st.sampled_from(["train", "test", "val", ""]),
    ("prompts", "eval_split", None): st.sampled_from(["train", "test", "val", ""]),
    ("prompts", "text_column", None): st.sampled_from(["prompt", "caption", ""]),
    ("prompts", "balance_column", None): st.sampled_from(["", "split", "tag"]),
    ("prompts", "num_eval", None): st.integers(0, 30),
    ("data", "path", None): st.sampled_from(["", "{data}/sft.jsonl", "{data}/pairs.jsonl", "{data}/prompts.txt",
                                             "{data}/nope.jsonl"]),
    ("data", "kind", None): st.sampled_from(["auto", "images", "pairs"]),
    ("loss", "use", None): st.sampled_from(["clipped", "nft", "sft", "offline_dpo", "guard"]),
    ("rewards", "weight", None): st.sampled_from([0.0, 1.0, -1.0, 0.5, float("nan")]),
    ("rewards", "chunk_weights", None): st.sampled_from([[], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0], [1.0, 0.0, 0.5, 2.0]]),
    ("chunker", "profile", "dynamics"): st.sampled_from(["", PROFILE, OTHER_PROFILE, "{data}/not_a_profile.json"]),
    ("selector", "profile", "weighted"): st.sampled_from(["", PROFILE, OTHER_PROFILE, "{data}/nope.json"]),
}
NEWER_KEYS = list(NEWER)


@st.composite
def plausible_changes(draw):
    """One base recipe and 1 to 6 of the newer keys set to plausible values (a reward key on one
    of the base's rewards)."""
    base = draw(st.sampled_from(BASES))
    keys = draw(st.lists(st.sampled_from(NEWER_KEYS), min_size=1, max_size=6, unique=True))
    return base, [(key, draw(NEWER[key]), draw(st.integers(0, 2))) for key in keys]


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> Path:
    """The files the plausible values name: offline tables of both kinds (their images exist),
    prompt files without columns or splits, and a JSON file that is not a profile."""
    d = tmp_path_factory.mktemp("tables")
    prompts = ["a red circle on a green background", "a blue square on a yellow background"]
    (d / "img.png").write_bytes(b"")  # validation checks that images exist; it does not decode them
    (d / "sft.jsonl").write_text("".join(json.dumps({"prompt": p, "image": "img.png"}) + "\n" for p in prompts))
    (d / "pairs.jsonl").write_text("".join(json.dumps({"prompt": p, "chosen": "img.png", "rejected": "img.png"}) + "\n"
                                           for p in prompts))
    (d / "prompts.txt").write_text("\n".join(prompts) + "\n")
    (d / "no_split.csv").write_text("prompt\n" + "".join(p + "\n" for p in prompts))
    (d / "not_a_profile.json").write_text("{}")
    return d


@pytest.mark.slow
@settings(deadline=10000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=plausible_changes())
def test_plausible_newer_keys_validate_or_exit_2_with_one_message(drawn, tables, tmp_path, capsys):
    base, changes = drawn
    data = read_toml(RECIPES / base)
    resolve_paths(data, RECIPES, get_registry(), base, from_file=True)  # the recipe is written elsewhere
    for (table, key, component), value, entry_index in changes:
        value = value.replace("{data}", str(tables)) if isinstance(value, str) else value
        if table == "rewards":
            entry = data["rewards"][entry_index % len(data["rewards"])]
        else:
            entry = data.setdefault(table, {})
            if component is not None and entry.get("use") != component:
                entry.clear()  # switching component: its own keys only
                entry["use"] = component
            elif key == "use" and entry.get("use") != value:
                entry.clear()
        entry[key] = value
    path = tmp_path / "plausible.toml"
    _write(data, path)
    _assert_accepted_or_one_message(path, capsys)
