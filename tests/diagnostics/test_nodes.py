"""flowrl doctor's checks of what a run over several processes or nodes needs of the machine
(flowrl.diagnostics.nodes): the open-file limit, /dev/shm, the rendezvous address and port, and a
run directory every node sees; and docs/distributed.md's doctor command, run as written."""

from __future__ import annotations

import json
import re
import resource
import shlex
import socket
from pathlib import Path

import pytest

from flowrl.diagnostics import nodes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("limits, processes, status, fragment", [
    ((1024, 1048576), 8, "warn", "ulimit -n 1048576"),
    ((1024, resource.RLIM_INFINITY), 8, "warn", "ulimit -n 4096"),
    ((1024, 1024), 8, "warn", "the hard limit is 1024 too"),
    ((1024, 1024), 1, "ok", "soft limit 1024, hard 1024"),
    ((65536, 65536), 16, "ok", "soft limit 65536"),
])
def test_the_open_file_limit_is_warned_below_4096_for_several_processes(monkeypatch, limits, processes, status,
                                                                         fragment):
    monkeypatch.setattr(resource, "getrlimit", lambda kind: limits)
    check = nodes.open_files_check(processes)
    assert (check.status, check.name) == (status, "open files") and fragment in check.detail, check.detail


def test_a_containers_small_shared_memory_is_warned_for_several_processes(monkeypatch):
    class Stat:
        f_blocks = f_bavail = 64 * 1024**2 // 4096
        f_frsize = 4096

    monkeypatch.setattr(nodes.os, "statvfs", lambda path: Stat())
    warned = nodes.shared_memory_check(8)
    assert warned.status == "warn" and "0.1 GiB" in warned.detail and "--shm-size" in warned.detail
    assert nodes.shared_memory_check(1).status == "ok"

    class Full:
        f_blocks, f_bavail, f_frsize = 16 * 1024**3 // 4096, 100, 4096

    monkeypatch.setattr(nodes.os, "statvfs", lambda path: Full())
    full = nodes.shared_memory_check(8)
    assert full.status == "warn" and "less than 1 GiB free" in full.detail and "16.0 GiB" in full.detail

    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(nodes.os, "statvfs", missing)
    assert nodes.shared_memory_check(8) is None  # no /dev/shm (macOS): no line


def test_an_address_that_does_not_resolve_fails(monkeypatch):
    def fail(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(nodes.socket, "getaddrinfo", fail)
    check, = nodes.rendezvous_checks({"MASTER_ADDR": "node-0.cluster", "MASTER_PORT": "29500"})
    assert check.status == "fail" and "MASTER_ADDR='node-0.cluster' does not resolve on this node" in check.detail


def test_a_port_that_is_not_a_port_fails():
    check, = nodes.rendezvous_checks({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "port"})
    assert check.status == "fail" and "MASTER_PORT='port' is not a port number" in check.detail


def test_a_busy_port_fails_on_the_hosting_node_before_launch_only():
    """A port another process holds fails before launching, where this node hosts the
    rendezvous; in a launched process (RANK set) the port is its own run's store: not checked.
    A free port, and any port on another machine, is fine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("", 0))
        held.listen()
        port = str(held.getsockname()[1])
        check, = nodes.rendezvous_checks({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        assert check.status == "fail" and f"port {port} is in use on this node" in check.detail, check.detail
        assert "(this machine)" in check.detail
        launched, = nodes.rendezvous_checks({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0"})
        assert launched.status == "ok"
        elsewhere, = nodes.rendezvous_checks({"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": port})
        assert elsewhere.status == "ok" and "this machine" not in elsewhere.detail
    free, = nodes.rendezvous_checks({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    assert free.status == "ok"
    assert nodes.rendezvous_checks({}) == []


def test_a_port_in_time_wait_after_the_last_run_is_free_as_the_launch_finds_it():
    """The minute after a rendezvous closes, its port's connections sit in TIME_WAIT; torch's
    store binds with SO_REUSEADDR and gets it, so the check must too."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end of the connection enters TIME_WAIT
        client.close()
    assert nodes._port_free(port)
    check, = nodes.rendezvous_checks({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert check.status == "ok", check.detail


def test_a_loopback_address_fails_for_a_run_over_several_nodes():
    one, = nodes.rendezvous_checks({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, nodes=1)
    assert "loopback" not in one.detail
    two, = nodes.rendezvous_checks({"MASTER_ADDR": "localhost", "RANK": "0"}, nodes=2)
    assert two.status == "fail" and "resolves only to the loopback address" in two.detail, two.detail


MOUNTS = """\
overlay / overlay rw,relatime 0 0
proc /proc proc rw 0 0
tmpfs /dev/shm tmpfs rw 0 0
10.0.0.5:/export /shared nfs4 rw,vers=4.2 0 0
/dev/nvme0n1 /shared/scratch ext4 rw 0 0
/dev/sdb1 /mnt/my\\040disk xfs rw 0 0
server:/x /mnt/tab\\011here nfs rw 0 0
"""


@pytest.mark.parametrize("path, mount", [
    ("/shared/runs/flux", ("/shared", "nfs4")),
    ("/shared/scratch/run", ("/shared/scratch", "ext4")),  # the deepest mount holding it
    ("/sharedfoo/run", ("/", "overlay")),  # a prefix of the name is not a parent
    ("/mnt/my disk/run", ("/mnt/my disk", "xfs")),  # /proc/mounts writes a space as \040
    ("/mnt/tab\there/run", ("/mnt/tab\there", "nfs")),  # and a tab as \011
    ("/tmp/run", ("/", "overlay")),
])
def test_the_file_system_of_a_run_directory_is_its_deepest_mount(path, mount):
    assert nodes.file_system_type(Path(path), MOUNTS) == mount


def test_a_run_directory_under_a_link_is_judged_where_the_link_leads(tmp_path):
    """``/shared`` may be a symbolic link into a shared mount: the mount of the real path counts."""
    real = tmp_path / "lustre"
    real.mkdir()
    (tmp_path / "shared").symlink_to(real)
    mounts = f"overlay / overlay rw 0 0\nmds:/fs {real} lustre rw 0 0\n"
    assert nodes.file_system_type(tmp_path / "shared" / "runs" / "flux", mounts) == (str(real), "lustre")


def test_a_run_over_several_nodes_is_warned_off_a_local_file_system():
    local = nodes.run_directory_check(Path("/tmp/run"), 2, MOUNTS)
    assert local.status == "warn" and "(overlay), a file system only this machine sees" in local.detail
    shared = nodes.run_directory_check(Path("/shared/runs/flux"), 2, MOUNTS)
    assert shared.status == "ok" and "(nfs4)" in shared.detail
    one_node = nodes.node_checks(8, 1, Path("/tmp/run"), env={}, mounts=MOUNTS)
    assert "run directory" not in {c.name for c in one_node}


def test_a_launched_process_says_how_many_nodes_and_processes_its_run_has():
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "9"}
    assert (nodes.launched_processes(env), nodes.launched_nodes(env)) == (16, 2)
    assert (nodes.launched_processes({}), nodes.launched_nodes({})) == (1, 1)
    assert nodes.launched_processes({"WORLD_SIZE": "two"}) == 1


def test_the_docs_doctor_command_for_two_nodes_runs_as_written(flowrl_cli):
    """docs/distributed.md's doctor command before a two-node launch: the address resolves (a
    number; not this machine, so its port is not bound here) and the run directory, which does
    not exist on this one machine, lies on a local file system: warned."""
    text = (REPO / "docs" / "distributed.md").read_text(encoding="utf-8")
    flat = " ".join(text.split())
    assert f"(at least {nodes.MIN_OPEN_FILES}: sockets" in flat and f"(at least {nodes.MIN_SHM_BYTES // 1024**3} GiB:" in flat
    install = " ".join((REPO / "docs" / "install.md").read_text(encoding="utf-8").split())
    assert f"below {nodes.MIN_OPEN_FILES} files and {nodes.MIN_SHM_BYTES // 1024**3} GiB" in install
    block, = [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "flowrl doctor" in b]
    words = shlex.split(block)
    env = dict(w.split("=", 1) for w in words[:words.index("flowrl")])
    argv = words[words.index("flowrl") + 1:]
    assert argv[:2] == ["doctor", "recipes/chunk_grpo_flux.toml"] and "--num-nodes" in argv
    result, = flowrl_cli.in_process([{"argv": [*argv, "--json"], "env": env}])
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"] if c["section"] == "launcher"}
    assert checks["rendezvous"]["status"] == "ok" and "10.0.0.1" in checks["rendezvous"]["detail"]
    assert checks["run directory"]["detail"].startswith("/shared/runs/flux: on ")
    assert {"open files", "shared memory"} <= set(checks)
