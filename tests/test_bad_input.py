"""Bad input that used to end in a traceback, a hang or a crash later in training: each is now
refused by `flowrl validate` (and so by `flowrl train`) with one message naming the key."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]
QUICK = str(REPO / "recipes" / "quickstart_hacking.toml")


def _validate(validate, *overrides: str) -> tuple[int, str]:
    code, err = validate(QUICK, *overrides)
    return code, " ".join(err.split())


@pytest.mark.parametrize("override, message", [
    ("kernel.a=nan", "key 'a' must be a finite number"),                     # built a kernel outside the error handling
    ("train.lr=nan", "key 'lr' must be a finite number"),                    # validated, then crashed in training
    ("train.lr=1e400", "key 'lr' must be a finite number, got inf"),
    ("train.on_policy_tolerance=nan", "key 'on_policy_tolerance' must be a finite number"),
    ("sampler.steps=99999999999999999999999", "key 'steps' must be <= 10000"),  # hung (one kernel per step)
    ("sampler.steps=1000000000", "key 'steps' must be <= 10000"),              # MemoryError
    ("run.seed=18446744073709551616", "key 'seed' must be <= 9223372036854775807"),  # crashed in seeding
    ('run.output_dir="a\\u0000b"', "key 'output_dir' contains a NUL character"),    # crashed making the run dir
    ("train.iterations=10000000000", "key 'iterations' must be <= 1000000000"),
])
def test_bad_values_are_refused_at_validation(validate, override, message):
    start = time.perf_counter()
    code, err = _validate(validate, override)
    assert code == 2 and message in err, err
    assert err.startswith("error:") and "Traceback" not in err
    assert time.perf_counter() - start < 10


def test_control_and_bidi_characters_in_a_key_name_are_shown_escaped(validate):
    code, err = _validate(validate, "run.na\x1b[31mme\u202e=1")
    assert code == 2
    assert "\x1b" not in err and "\u202e" not in err
    assert "unknown key 'na\\x1b[31mme\\u202e'" in err
