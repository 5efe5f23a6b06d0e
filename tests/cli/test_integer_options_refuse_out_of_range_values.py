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


@pytest.mark.parametrize("command", ["sample", "eval", "profile"])
def test_a_seed_past_what_a_seed_holds_is_one_usage_error(command, flowrl_cli):
    """A seed is packed as a signed 64-bit integer (flowrl.seeding): 2**63 was a struct.error
    traceback, after the model had loaded and an empty images folder was made."""
    (result,) = flowrl_cli.in_process([[command, "--seed", str(2**63)]])
    assert result.returncode == 2 and "Traceback" not in result.stderr and "--seed" in result.stderr, result.stderr


def test_reward_serve_checks_the_port_before_building_the_reward_and_names_a_bad_host(flowrl_cli, monkeypatch):
    """The port was checked only after the reward was built (PickScore downloaded and loaded first);
    a host name that does not resolve was told to choose another port."""
    from flowrl.commands import reward_server
    from flowrl.errors import FlowrlError
    from flowrl.serving.simple import make_server

    monkeypatch.setattr(reward_server, "build_reward", lambda *a, **k: pytest.fail("the reward was built first"))
    (result,) = flowrl_cli.in_process([["reward", "serve", "pickscore", "-p", "70000"]])
    assert result.returncode == 2 and "--port 70000 is not a port number" in result.flat_err, result.stderr
    with pytest.raises(FlowrlError, match="no address of this machine") as info:
        make_server(object(), name="x", host="999.1.1.1", port=0)
    assert "--port" not in (info.value.hint or "")
