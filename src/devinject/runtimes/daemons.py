"""The container runtime daemons running on this machine, as root runs them: their command line's config paths
(CRI-O's --config and --config-dir, containerd's --config) and containerd's own binary's version, so
`runtime configure` and `doctor` on the machine's own root read and write what the running runtime reads."""

from __future__ import annotations

import os

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


def running_daemon(name: str, proc: str = "/proc", pids: list[int] | None = None) -> tuple[int, list[str]] | None:
    """The running daemon `name` (the lowest pid of that name that root runs: anyone can name a process so, of
    `pids` alone when given) and its command line's arguments; None when none runs. On this machine's own /proc
    a process of another pid namespace is a container's (a kind node's containerd, docker-in-docker), never the
    node's: its binary is not the node's to ask its version as root."""
    ours = pid_namespace("/proc/self") if proc == "/proc" else None
    for pid in pids if pids is not None else sorted(int(entry) for entry in os.listdir(proc) if entry.isdigit()):
        try:
            if os.stat(os.path.join(proc, str(pid))).st_uid != 0:
                continue
            if ours is not None and pid_namespace(os.path.join(proc, str(pid))) != ours:
                continue
            with open(os.path.join(proc, str(pid), "comm"), encoding="utf-8", errors="replace") as handle:
                if handle.read(64).strip() != name:
                    continue
            with open(os.path.join(proc, str(pid), "cmdline"), "rb") as handle:
                argv = handle.read(64 << 10).decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        return pid, [arg for arg in argv[1:] if arg]
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
