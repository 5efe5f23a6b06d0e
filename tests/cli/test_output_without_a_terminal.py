"""Tables printed where no terminal gives a width (a pipe, a log, a Slurm output file).

rich assumes 80 columns there and folds table cells mid-word. ``flowrl compare`` and ``flowrl
profile`` (with ``--compare``) print their tables as wide as the cells need
(tests/sweep/test_compare.py runs compare piped); ``flowrl validate --explain`` wraps its prose at
spaces within 120 columns, key names whole.
"""

from __future__ import annotations

import pytest

import re

from flowrl.commands.base import TEXT_WIDTH_WITHOUT_TERMINAL, console, table_console


def test_the_table_console_is_wide_without_a_terminal_and_follows_columns(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert table_console().width == 1000 and table_console(120).width == 120  # capsys: not a terminal
    monkeypatch.setenv("COLUMNS", "97")
    assert table_console() is console  # the width the environment gives wins


def test_explain_piped_wraps_within_a_sane_width_and_never_splits_a_key(flowrl_cli):
    import subprocess
    import sys

    from flowrl.recipe import SECTIONS, fields_of

    env = flowrl_cli.env()
    env.pop("COLUMNS")  # as under Slurm: stdout is a file and nothing says how wide
    r = subprocess.run([sys.executable, "-m", "flowrl", "validate", "--explain"], cwd=flowrl_cli.repo, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= TEXT_WIDTH_WITHOUT_TERMINAL
    assert max(map(len, lines)) > 80  # not cut to rich's assumed 80 columns
    words = set(re.findall(r"[\w.]+", r.stdout))
    keys = [f.name for cls in SECTIONS.values() for f, _ in fields_of(cls)]
    assert keys and [k for k in keys if k not in words] == []


@pytest.mark.slow
def test_plan_piped_keeps_each_note_on_one_line(flowrl_cli):
    """`flowrl plan` into a log: a cell's note is not folded at rich's assumed 80 columns."""
    import subprocess
    import sys

    env = flowrl_cli.env()
    env.pop("COLUMNS")
    r = subprocess.run([sys.executable, "-m", "flowrl", "plan", "recipes/flux2_klein_nf4_24gb.toml"],
                       cwd=flowrl_cli.repo, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert any("3.876e9 params, 0.591 B each on average (quantised)" in line for line in r.stdout.splitlines()), r.stdout
