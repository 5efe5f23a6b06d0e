"""Two nodes, run here as two node launchers on one machine over gloo: `torchrun --nnodes 2` and
`accelerate launch --num_machines 2`, one process per node, equal one process (metrics and
weights), a two-node run killed by SIGTERM resumes exactly, and docs/distributed.md's two-node
commands run as written (the hybrid FSDP2 mesh across the nodes).

Every run evaluates, writes images and checkpoints every iteration, as users run. The node
launchers share the run directory, as nodes share a file system. A real cluster differs in the
network (gloo over loopback here, NCCL between machines there) and in each node's devices: the
rendezvous, the ranks, the node count and the mesh the strategies build from them are the same.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import REPO, assert_records_close, assert_weights_close, load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.checkpoint_dirs import latest_checkpoint
from flowrl.runlog import read_metrics
from flowrl.train import train
from flowrl.train.checkpoint import read_model_weights

pytestmark = pytest.mark.slow

DOC = REPO / "docs" / "distributed.md"
#: The tiny recipe as users run it: evaluation, images and checkpoints every iteration. One
#: optimizer step per pass over the rollout, so that every step sees the same samples however
#: many processes hold them (with two steps, one process would split its 8 samples 4 + 4 by
#: index, two processes 2 + 2 each: other batches, other weights).
RUN = {"log": {"eval_every": 1, "image_every": 1}, "checkpoint": {"every": 1}, "prompts": {"num_eval": 2},
       "train": {"optimizer_steps_per_update": 1}}
#: accelerate's command line, after flowrl's torchvision check: in an environment where torch and
#: torchvision are different builds (docs/install.md), accelerate's CLI imports torchvision through
#: timm and fails before it launches anything; a healthy environment runs `accelerate` itself.
ACCELERATE = ("import sys; from flowrl.compat import ensure_torchvision_importable; ensure_torchvision_importable(); "
              "from accelerate.commands.accelerate_cli import main; sys.argv[0] = 'accelerate'; main()")


def final_weights(run_dir: Path) -> dict:
    """The trained weights of the run's latest checkpoint, whole, whether it is sharded or not."""
    return read_model_weights(latest_checkpoint(run_dir))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")


def torchrun_nodes(port: int, flowrl_args: list[str]) -> list[list[str]]:
    """The two node launchers' command lines: one process per node."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [[torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank), "--master_addr", "127.0.0.1",
             "--master_port", str(port), "-m", "flowrl", *flowrl_args] for rank in (0, 1)]


def start_nodes(commands: list[list[str]], cwd: Path) -> list[subprocess.Popen]:
    return [subprocess.Popen(c, cwd=cwd, env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True) for c in commands]


def finish_nodes(nodes: list[subprocess.Popen], timeout: float = 900) -> list[tuple[int, str]]:
    """Each node launcher's exit code and output; a launcher still running at the deadline is killed
    with its workers (and the test fails on its code)."""
    results = []
    deadline = time.monotonic() + timeout
    for node in nodes:
        try:
            out, _ = node.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            out, _ = node.communicate()
        results.append((node.returncode, out))
    return results


def run_nodes(commands: list[list[str]], cwd: Path) -> None:
    results = finish_nodes(start_nodes(commands, cwd))
    for code, out in results:
        assert code == 0, "\n\n".join(o[-4000:] for _, o in results)


def one_process(recipe: Path, out: Path, *sets: str) -> Path:
    train(load(recipe, *sets, f"run.output_dir={str(out)!r}"), console=quiet_console())
    return out


def assert_runs_equal(two: Path, one: Path) -> None:
    """A two-node run equals the one-process run of the same recipe: metrics and weights."""
    rec2, rec1 = read_metrics(two), read_metrics(one)
    assert [r["iteration"] for r in rec2] == [r["iteration"] for r in rec1] and rec2[-1].get("final")
    assert any(k.startswith("eval/") for k in rec2[-1])
    for a, b in zip(rec2, rec1):
        a.pop("world_size", None), b.pop("world_size", None)
        for key in [k for k in a if k.startswith("compute/")]:
            a.pop(key), b.pop(key, None)
        assert_records_close(a, b, rtol=1e-4, atol=1e-6)
    assert_weights_close(final_weights(two), final_weights(one), atol=1e-6)


def shard_chunks(run_dir: Path) -> set[int]:
    """How many pieces each trained tensor of the latest sharded checkpoint is stored in."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(latest_checkpoint(run_dir) / "sharded")).read_metadata()
    return {len(m.chunks) for k, m in meta.state_dict_metadata.items() if hasattr(m, "chunks") and k.startswith("model")}


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_recipe(tmp_path, tiny_recipe(ENGINE, **RUN))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2_hybrid"])
def test_two_torchrun_nodes_equal_one_process(tmp_path, tiny, strategy):
    sets = ["train.iterations=2"]
    if strategy == "fsdp2_hybrid":  # sharded within a node (1 process), replicated across the 2 nodes
        sets += ["distributed.strategy='fsdp2'", "distributed.shard='hybrid'"]
    args = ["train", str(tiny), *(a for s in sets for a in ("--set", s)), "-o", str(tmp_path / "two")]
    run_nodes(torchrun_nodes(free_port(), args), tmp_path)
    one = one_process(tiny, tmp_path / "one", *sets)
    assert_runs_equal(tmp_path / "two", one)
    if strategy == "fsdp2_hybrid":
        assert shard_chunks(tmp_path / "two") == {1}  # a node holds whole tensors: one shard per node


def test_two_accelerate_nodes_equal_one_process(tmp_path, tiny):
    port = free_port()
    sets = ["train.iterations=2"]
    commands = [[sys.executable, "-c", ACCELERATE, "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "2",
                 "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                 "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "flowrl", "train", str(tiny),
                 *(a for s in sets for a in ("--set", s)), "-o", str(tmp_path / "two")] for rank in (0, 1)]
    run_nodes(commands, tmp_path)
    assert_runs_equal(tmp_path / "two", one_process(tiny, tmp_path / "one", *sets))


def test_two_nodes_stopped_by_sigterm_resume_exactly(tmp_path, tiny):
    """SIGTERM to both node launchers once the first checkpoint is written (a preempted job): both
    stop with a checkpoint; the same two launchers with --resume finish the run, whose metrics
    and weights are bit for bit those of the uninterrupted two-node run."""
    sets = ["train.iterations=4"]
    flags = [a for s in sets for a in ("--set", s)]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_nodes(torchrun_nodes(free_port(), ["train", str(tiny), *flags, "-o", str(whole)]), tmp_path)

    nodes = start_nodes(torchrun_nodes(free_port(), ["train", str(tiny), *flags, "-o", str(parts)]), tmp_path)
    deadline = time.monotonic() + 600
    while not ((parts / "checkpoints").is_dir() and latest_checkpoint(parts) is not None):
        assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "no first checkpoint"
        time.sleep(0.2)
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    results = finish_nodes(nodes, timeout=300)
    assert all(code != 0 for code, _ in results), "the run finished before the stop reached it: lengthen it"
    stopped_at = read_metrics(parts)[-1]["iteration"]
    assert stopped_at < 4 and not read_metrics(parts)[-1].get("final")

    run_nodes(torchrun_nodes(free_port(), ["train", str(tiny), *flags, "--resume", str(parts)]), tmp_path)
    a, b = read_metrics(whole), read_metrics(parts)
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] and b[-1]["final"]
    for x, y in zip(a, b):
        assert_records_close(x, y, rtol=0, atol=0)
    wa, wb = final_weights(whole), final_weights(parts)
    assert sorted(wa) == sorted(wb) and all(bool((wa[k] == wb[k]).all()) for k in wa)


def doc_commands(launcher: str) -> list[str]:
    """The two-node commands of docs/distributed.md's worked example for ``launcher``."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("### Two nodes (worked example)"):]
    section = section[:section.index("\n## ")]
    blocks = [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", section, re.S)]
    found = [b.strip() for b in blocks if b.strip().startswith(launcher)]
    assert len(found) == 1, f"docs/distributed.md's two-node example has no single {launcher} command"
    return shlex.split(found[0])


def on_this_machine(argv: list[str], rank: int, port: int, recipe: Path, out: Path) -> list[str]:
    """The documented command as node ``rank`` of two nodes that are this machine: one process per
    node, the loopback address, a free port, the tiny recipe, a local run directory, and two
    iterations."""
    values = {"--nproc_per_node": "1", "--num_processes": "2", "--node_rank": str(rank), "--machine_rank": str(rank),
              "--master_addr": "127.0.0.1", "--main_process_ip": "127.0.0.1", "--master_port": str(port),
              "--main_process_port": str(port), "-o": str(out)}
    argv = [values.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)]
    argv = [str(recipe) if a.startswith("recipes/") and a.endswith(".toml") else a for a in argv]
    if argv[0] == "torchrun":
        argv[0] = str(Path(sys.executable).with_name("torchrun"))
    else:
        argv[:1] = [sys.executable, "-c", ACCELERATE]
    return argv + ["--set", "train.iterations=2"]


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate launch"])
def test_the_documented_two_node_commands_run(tmp_path, tiny, launcher):
    """docs/distributed.md's commands, changed only where a machine differs (above): FSDP2 with
    hybrid sharding and bf16 across the two nodes, each node holding whole tensors."""
    argv = doc_commands(launcher)
    assert "distributed.shard=hybrid" in argv and "--nnodes" in argv or "--num_machines" in argv
    port = free_port()
    run_nodes([on_this_machine(argv, rank, port, tiny, tmp_path / "run") for rank in (0, 1)], tmp_path)
    records = read_metrics(tmp_path / "run")
    assert records[-1]["final"] and records[-1]["iteration"] == 2
    state = json.loads((latest_checkpoint(tmp_path / "run") / "state.json").read_text())
    assert state["world_size"] == 2 and state["strategy"] == "fsdp2"
    assert shard_chunks(tmp_path / "run") == {1}
