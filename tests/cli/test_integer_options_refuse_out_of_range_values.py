"""A count given on the command line below its least value is refused before anything runs, in one
message (``flowrl train --num-processes 0``, or -1, once was accepted and trained). Every
integer option of every command is checked (the app is walked, so a new option is covered): it
declares its least value (Typer's ``min=``) and a value below it is a usage error, or it is one of
the few whose every value means something or that a later check refuses."""

from __future__ import annotations

import pytest
import typer.main
from tiny_recipe import CLI, tiny_recipe

from flowrl.cli import app

#: Integer options without a least value on the command line, and why.
UNBOUNDED = {
    "--seed": "any integer is a seed",
    # flowrl reward serve: port 0 picks a free port; flowrl.serving refuses what is no port number
    # (make_server) and what the litserve backend refuses (fleet.check_options), in one message each
    "--port": "checked by flowrl.serving",
    "--replicas": "checked by flowrl.serving.fleet.check_options",
    "--max-batch": "checked by flowrl.serving.fleet.check_options",
}


def walk(command, path: tuple[str, ...] = ()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, (*path, name))


def is_integer(param) -> bool:
    descriptor = getattr(param, "type_descriptor", None)  # typer >= 0.2x (its own click)
    if descriptor is not None:
        return descriptor.annotation is int
    return getattr(getattr(param, "type", None), "name", "") in ("integer", "integer range")


def least_value(param):
    if hasattr(param, "min"):
        return param.min
    return getattr(getattr(param, "type", None), "min", None)


INTEGER_OPTIONS = [(path, p) for path, command in walk(typer.main.get_command(app)) for p in command.params
                   if getattr(p, "param_type_name", "option") == "option" and p.opts[0].startswith("--")
                   and is_integer(p)]
BOUNDED = [(path, p) for path, p in INTEGER_OPTIONS if least_value(p) is not None]


def test_the_walk_finds_the_integer_options():
    found = {(" ".join(path), p.opts[0]) for path, p in INTEGER_OPTIONS}
    assert {("train", "--num-processes"), ("sample", "--seeds"), ("plan", "--num-processes"),
            ("reward serve", "--port")} <= found, found


def test_every_integer_option_declares_its_least_value():
    undeclared = [f"flowrl {' '.join(path)} {p.opts[0]}" for path, p in INTEGER_OPTIONS
                  if least_value(p) is None and p.opts[0] not in UNBOUNDED]
    assert not undeclared, f"integer options that accept any value (declare min= or say why): {undeclared}"


@pytest.mark.parametrize("path, param", BOUNDED, ids=[f"{' '.join(p)} {o.opts[0]}" for p, o in BOUNDED])
def test_a_value_below_the_least_is_one_usage_error(path, param, flowrl_cli):
    (result,) = flowrl_cli.in_process([[*path, param.opts[0], str(least_value(param) - 1)]])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and "Invalid value" in output, output
    assert param.opts[0] in output, output


@pytest.mark.parametrize("n", ["0", "-1"])
def test_train_refuses_fewer_than_one_process(n, tmp_path, flowrl_cli):
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(tiny_recipe(CLI, run={"name": "no_processes", "seed": 1}), encoding="utf-8")
    run_dir = tmp_path / "run"
    (result,) = flowrl_cli.in_process([["train", str(recipe), "-o", str(run_dir), "--num-processes", n]])
    code, err = result.returncode, result.stderr
    assert code == 2, err
    assert "Traceback" not in err and "Invalid value" in err and "--num-processes" in err, err
    assert not run_dir.exists()  # refused before anything ran


def test_reward_serve_refuses_what_is_no_port_number():
    from flowrl.errors import FlowrlError
    from flowrl.serving.simple import make_server

    for port in (-5, 70000):
        with pytest.raises(FlowrlError, match="not a port number"):
            make_server(object(), name="x", port=port)
