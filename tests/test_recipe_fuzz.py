"""Property: whatever a recipe holds, `flowrl validate` accepts it or exits 2 with one message.

Hypothesis builds recipes from the quickstart by setting documented keys (every key of every
plain table, of the quickstart's components and of every other registered component a table may
switch to) to random values of random types: huge and negative integers, NaN and infinities,
strings with control characters and bidi overrides, lists, tables. Each is validated through
the real command line (``flowrl.cli.main``) in this process; an exception escaping it would be a
traceback, so the test fails on any. Each example must finish within the deadline.

The examples are the same on every run (tests/conftest.py's ``ci`` hypothesis profile);
``FLOWRL_HYPOTHESIS=long`` draws 2000 fresh ones for a longer local hunt.
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flowrl import cli  # noqa: E402
from flowrl.plugins import get_registry  # noqa: E402
from flowrl.recipe import COMPONENT_SECTIONS, SECTIONS, read_toml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart_hacking.toml"
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
