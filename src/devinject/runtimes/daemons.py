"""The container runtime daemons running on this machine, as root runs them: their command line's config paths
(CRI-O's --config and --config-dir, containerd's --config) and containerd's own binary's version, so
`runtime configure` and `doctor` on the machine's own root read and write what the running runtime reads."""

from __future__ import annotations

import os
from collections.abc import Iterator

from devinject.runtimes.plan import CRIO_CONFIG_DIR, DEFAULT_CONFIG, binary_version


def command_flags(argv: list[str], aliases: dict[str, str], defaults: dict[str, str]) -> dict[str, str]:
    """The values of a daemon's flags in its command line (`--flag VALUE`, `--flag=VALUE`, `-f VALUE`), by the
    name `aliases` maps each spelling to; `defaults` for those not given."""
    found = dict(defaults)
    for i, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag in aliases and (equals or i + 1 < len(argv)):
            found[aliases[flag]] = value if equals else argv[i + 1]
    return found


def crio_paths(argv: list[str]) -> tuple[str, str]:
    """(--config, --config-dir) of a CRI-O command line, each its default when not given."""
    found = command_flags(argv, {"--config": "config", "-c": "config", "--config-dir": "dir", "-d": "dir"},
                          {"config": DEFAULT_CONFIG["crio"], "dir": CRIO_CONFIG_DIR})
    return found["config"], found["dir"]


def pid_namespace(proc: str) -> int | None:
    """The pid namespace of the process whose /proc dir is `proc` (its inode); None when it cannot be read."""
    try:
        return os.stat(os.path.join(proc, "ns", "pid")).st_ino
    except OSError:
        return None


def root_processes(name: str, proc: str = "/proc", pids: list[int] | None = None) -> Iterator[tuple[int, list[str]]]:
    """Each process named `name` that root runs (or this user, who runs devinject), by pid (of `pids` alone when
    given), with its command line's arguments. The name is the process's `comm`, else (a fixture's /proc) its
    argv[0]'s. Anyone can name a process so, and so can a container's image: a process of another user or, on
    this machine's own /proc, of another pid namespace (a kind node's containerd, docker-in-docker) is never the
    node's; its flags are not taken and its binary never run as root."""
    ours = pid_namespace("/proc/self") if proc == "/proc" else None
    owners = {0, os.geteuid()}
    if pids is None:
        try:
            pids = sorted(int(entry) for entry in os.listdir(proc) if entry.isdigit())
        except OSError:
            return  # a root with no /proc: nothing runs there
    for pid in pids:
        here = os.path.join(proc, str(pid))
        try:
            if os.stat(here).st_uid not in owners:
                continue
            if ours is not None and pid_namespace(here) != ours:
                continue
            with open(os.path.join(here, "cmdline"), "rb") as handle:
                argv = handle.read(64 << 10).decode(errors="replace").split("\0")
            try:
                with open(os.path.join(here, "comm"), encoding="utf-8", errors="replace") as handle:
                    comm = handle.read(64).strip()
            except FileNotFoundError:
                comm = os.path.basename(argv[0])
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if comm == name:
            yield pid, [arg for arg in argv if arg]


def running_daemon(name: str, proc: str = "/proc", pids: list[int] | None = None) -> tuple[int, list[str]] | None:
    """The running daemon `name` (the lowest pid of root_processes) and its command line's arguments (argv[0]
    left out); None when none runs."""
    for pid, argv in root_processes(name, proc, pids):
        return pid, argv[1:]
    return None


def running_crio(proc: str = "/proc", pids: list[int] | None = None) -> tuple[int, tuple[str, str]] | None:
    """The running CRI-O and the paths its command line reads its config from; None when none runs."""
    found = running_daemon("crio", proc, pids)
    return (found[0], crio_paths(found[1])) if found else None


def running_containerd(proc: str = "/proc", pids: list[int] | None = None) -> tuple[int, str, str | None] | None:
    """The running containerd: its pid, the config its command line names (--config, -c; else the default) and
    its own binary's version (not the one on PATH: a node may run another); None when none runs."""
    found = running_daemon("containerd", proc, pids)
    if found is None:
        return None
    pid, argv = found
    config = command_flags(argv, {"--config": "config", "-c": "config"}, {"config": DEFAULT_CONFIG["containerd"]})
    return pid, config["config"], binary_version("containerd", binary=os.path.join(proc, str(pid), "exe"))
