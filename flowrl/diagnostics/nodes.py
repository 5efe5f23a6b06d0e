"""``flowrl doctor``'s checks of what a run of several processes, or several nodes, needs from
the machine beyond its GPUs: the traps users of multi-node jobs meet before the first iteration.

- **open files**: every process opens a socket per peer, shared-memory segments and the data's
  files; a soft limit of 1024 (many distributions' default) fails as "Too many open files" at
  start-up or in a DataLoader worker. Warned below :data:`MIN_OPEN_FILES` when the run has
  several processes, with the hard limit it can be raised to.
- **shared memory**: NCCL's transport inside a node and torch's process-to-process tensors live
  in ``/dev/shm``; a container's default of 64 MB fails as NCCL's "unhandled system error" or a
  bus error. Warned below :data:`MIN_SHM_BYTES` when the run has several processes.
- **rendezvous**: ``MASTER_ADDR`` must resolve on this node, ``MASTER_PORT`` must be a port
  number, and (before launching, on the node that hosts it) free: a port held by another run's
  rendezvous fails as "address already in use" after the launcher has started every process.
- **run directory**: with several nodes, every process writes its checkpoint shards into the run
  directory and the first node writes the metrics, so every node must see the same directory. A
  local file system (ext4, xfs, overlay, tmpfs, ...) under it is warned: each node would write
  its own, and a resume would find half a checkpoint.

Each returns :class:`~flowrl.diagnostics.report.Check` lines in the ``launcher`` section; none
opens a connection (binding the port is the only socket call, and it is closed at once).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path

from .report import Check

#: below this soft limit of open files, a run of several processes is warned
MIN_OPEN_FILES = 4096
#: below this size of /dev/shm, a run of several processes is warned (NCCL's buffers, torch's shared tensors)
MIN_SHM_BYTES = 1024**3
#: file systems that only this machine sees (``/proc/mounts``' third field)
LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "overlay", "tmpfs",
                                "ramfs", "vfat", "exfat", "ntfs", "ntfs3", "apfs", "hfs", "squashfs"})


def launched_processes(env: Mapping[str, str] | None = None) -> int:
    """``WORLD_SIZE`` of a launched process (torchrun, accelerate, ``flowrl train
    --num-processes``), else 1."""
    value = (os.environ if env is None else env).get("WORLD_SIZE", "1").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def launched_nodes(env: Mapping[str, str] | None = None) -> int:
    """The nodes of a launched process's run, ``WORLD_SIZE / LOCAL_WORLD_SIZE``, else 1."""
    env = os.environ if env is None else env
    local = env.get("LOCAL_WORLD_SIZE", "").strip()
    if not local.isdigit() or int(local) == 0:
        return 1
    return max(1, launched_processes(env) // int(local))


def node_checks(processes: int, nodes: int, run_dir: Path | None, env: Mapping[str, str] | None = None,
                mounts: str | None = None) -> list[Check]:
    """The checks for a run of ``processes`` processes over ``nodes`` nodes writing into
    ``run_dir`` (None: no recipe given). ``env``: the environment (``os.environ``); ``mounts``:
    the text of ``/proc/mounts`` (read when None)."""
    env = os.environ if env is None else env
    checks = [open_files_check(processes), shared_memory_check(processes)]
    checks += rendezvous_checks(env, nodes)
    if run_dir is not None and nodes > 1:
        checks.append(run_directory_check(run_dir, nodes, mounts))
    return [c for c in checks if c is not None]


def open_files_check(processes: int) -> Check:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = f"soft limit {_limit(soft)}, hard {_limit(hard)}"
    if processes > 1 and soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        can = hard == resource.RLIM_INFINITY or hard >= MIN_OPEN_FILES
        fix = (f"raise it before launching: ulimit -n {MIN_OPEN_FILES if hard == resource.RLIM_INFINITY else hard}"
               if can else f"the hard limit is {hard} too: ask for a higher one (limits.conf, or the job's container)")
        return Check("launcher", "open files", "warn", f"{shown}: below {MIN_OPEN_FILES} for {processes} processes "
                     f"(sockets to every peer, shared tensors, data files: 'Too many open files'); {fix}",
                     {"soft": soft, "hard": hard})
    return Check("launcher", "open files", "ok", shown, {"soft": soft, "hard": hard})


def _limit(value: int) -> str:
    import resource

    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def shared_memory_check(processes: int, path: str = "/dev/shm") -> Check | None:
    try:
        stat = os.statvfs(path)
    except OSError:  # no /dev/shm (macOS): nothing to say
        return None
    size, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    shown = f"{path}: {size / 1024**3:.1f} GiB, {free / 1024**3:.1f} GiB free"
    figures = {"bytes": size, "free_bytes": free}
    if processes > 1 and size < MIN_SHM_BYTES:
        return Check("launcher", "shared memory", "warn", f"{shown}, below {MIN_SHM_BYTES / 1024**3:.0f} GiB for "
                     f"{processes} processes (NCCL's buffers and torch's shared tensors live there: 'unhandled system "
                     "error' or a bus error); in a container: docker run --shm-size=16g, or --ipc=host", figures)
    if processes > 1 and free < MIN_SHM_BYTES:
        return Check("launcher", "shared memory", "warn", f"{shown}: less than {MIN_SHM_BYTES / 1024**3:.0f} GiB "
                     f"free for {processes} processes (segments left by killed runs? ls -la {path})", figures)
    return Check("launcher", "shared memory", "ok", shown, figures)


def rendezvous_checks(env: Mapping[str, str], nodes: int = 1) -> list[Check]:
    """``MASTER_ADDR`` resolves, and for a run over several ``nodes`` not only to a loopback
    address (which every node would take for itself); ``MASTER_PORT`` is a port, and free where
    this node would host the rendezvous and no launcher has started yet (a launched process finds
    its own store there)."""
    addr, port_text = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr is None and port_text is None:
        return []
    problems, figures = [], {}
    local = False
    if addr is not None:
        try:
            resolved = sorted({info[4][0] for info in socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)})
        except (socket.gaierror, UnicodeError) as exc:
            return [Check("launcher", "rendezvous", "fail", f"MASTER_ADDR={addr!r} does not resolve on this node "
                          f"({exc}): give the first node's address or a name every node resolves")]
        figures["resolved"] = resolved
        local = any(_is_this_machine(a) for a in resolved)
        if nodes > 1 and all(_is_loopback(a) for a in resolved):
            problems.append(f"it resolves only to the loopback address ({', '.join(resolved)}), which every one of "
                            f"the {nodes} nodes takes for itself: give the first node's network address")
    port = None
    if port_text is not None:
        if not port_text.strip().isdigit() or not 0 < int(port_text) < 65536:
            problems.append(f"MASTER_PORT={port_text!r} is not a port number (1-65535)")
        else:
            port = int(port_text)
    launched = "RANK" in env
    six = addr is not None and all(":" in a for a in figures["resolved"])
    if port is not None and (addr is None or local) and not launched and not _port_free(port, six):
        problems.append(f"port {port} is in use on this node (another run's rendezvous?): choose another "
                        "--master_port / --main_process_port")
    where = f"MASTER_ADDR={addr}" if addr is not None else "MASTER_ADDR unset (this node)"
    if addr is not None:
        where += f" -> {', '.join(figures['resolved'])}" + (" (this machine)" if local else "")
    shown = where + (f", MASTER_PORT={port_text}" if port_text is not None else "")
    return [Check("launcher", "rendezvous", "fail" if problems else "ok",
                  shown + (f": {'; '.join(problems)}" if problems else ""), figures)]


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a resolved address (an IPv6 zone such as ``%eth0`` dropped); None if not one."""
    try:
        return ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None


def _is_loopback(address: str) -> bool:
    ip = _ip(address)
    return ip is not None and ip.is_loopback


def _is_this_machine(address: str) -> bool:
    ip = _ip(address)
    if ip is None:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    try:
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((str(ip), 0))  # only an address of one of this machine's interfaces can be bound
        return True
    except OSError:
        return False


def _port_free(port: int, ipv6: bool = False) -> bool:
    """Whether a listening socket can take ``port``: bound as torch's TCPStore binds it, with
    SO_REUSEADDR, so that a port whose last connections are in TIME_WAIT (the minute after the
    previous run's rendezvous closed) counts as free, as it is for the launch."""
    with socket.socket(socket.AF_INET6 if ipv6 else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("::" if ipv6 else "", port))
        except OSError:
            return False
    return True


def _unescape_mount(field: str) -> str:
    """A path as /proc/mounts writes it: space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def file_system_type(path: Path, mounts: str) -> tuple[str, str] | None:
    """``(mount point, type)`` of the mount holding ``path`` (its nearest existing ancestor),
    from the text of ``/proc/mounts``; None when no mount matches."""
    path = _real(Path(path))
    best: tuple[str, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape_mount(fields[1])
        if path == Path(point) or Path(point) in path.parents:
            if best is None or len(point) >= len(best[0]):
                best = (point, fields[2])
    return best


def _real(path: Path) -> Path:
    """``path`` with the symbolic links of its nearest existing ancestor resolved (``/shared``
    may be a link into a Lustre mount): the rest, not yet created, appended as given."""
    path = Path(os.path.abspath(path))
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    return Path(os.path.realpath(existing)) / path.relative_to(existing)


def run_directory_check(run_dir: Path, nodes: int, mounts: str | None = None) -> Check | None:
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:  # not Linux: the mount table is elsewhere
            return None
    found = file_system_type(run_dir, mounts)
    if found is None:
        return None
    point, kind = found
    shown = f"{run_dir}: on {point} ({kind})"
    if kind in LOCAL_FILE_SYSTEMS:
        return Check("launcher", "run directory", "warn", f"{shown}, a file system only this machine sees, for a run "
                     f"over {nodes} nodes: every process writes its checkpoint shards there, and a resume reads them "
                     "all; give -o a directory on a shared file system (NFS, Lustre, GPFS, ...)",
                     {"mount": point, "type": kind})
    return Check("launcher", "run directory", "ok", f"{shown}: not a local file system type (every node must "
                 "mount the same one)", {"mount": point, "type": kind})
