"""The CRI-O / podman hooks.d file (schema 1.0.0) that runs `devinject hook`, and a runc config snippet."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

DEFAULT_HOOKS_DIR = "/etc/containers/oci/hooks.d"
HOOK_FILE = "10-devinject.json"
HOOK_TIMEOUT = 30
ANNOTATION_KEY = r"^cdi\.k8s\.io/.+$"
ANNOTATION_VALUE = r"[^\s,]"  # Go regexp, unanchored: some character that is not blank or a comma


def hook_command(executable: str | None = None) -> list[str]:
    """How a runtime runs devinject, as [path, argv0, args...] (the subcommand follows). An explicit
    executable (the `devinject` console script) is used as given. By default: this installation's interpreter
    on the hook launcher with `-IS` (isolated, no `site`), which starts ~3 ms sooner on every container start
    and stop; its paths are this installation's, so it is what `install-hook` writes."""
    if executable:
        return [executable, "devinject"]
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook", "launcher.py")
    return [sys.executable, sys.executable, "-IS", launcher]


def _hook(command: list[str], *args: str) -> dict[str, Any]:
    return {"path": command[0], "args": [*command[1:], "hook", *args], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "timeout": HOOK_TIMEOUT}


def _stages(poststop: bool) -> list[str]:
    """prestart only, by default: the ledger frees a dead container's devices on its next access (pid and
    start time), so nothing at delete needs a hook process (~11 ms each, an interpreter's start).
    `poststop` releases at once, for an event log that shows the release when it happens."""
    return ["prestart", "poststop"] if poststop else ["prestart"]


def _server_args(server: str | None) -> list[str]:
    """The hook's `--server` when it is not the default socket the hook tries anyway."""
    from devinject.hook.client import DEFAULT_SOCKET

    return [] if server in (None, DEFAULT_SOCKET) else ["--server", server]


def hooks_d_entry(command: list[str], *, env_requests: bool = False, poststop: bool = False,
                  server: str | None = None) -> dict[str, Any]:
    """hooks.d cannot match environment variables: the env variant turns env requests on and runs for every
    container (exiting at once when nothing is requested); the default runs only when a `cdi.k8s.io/`
    annotation names something (a blank or comma-only value is no request)."""
    when: dict[str, Any] = {"always": True} if env_requests else {"annotations": {ANNOTATION_KEY: ANNOTATION_VALUE}}
    return {
        "version": "1.0.0",
        "hook": _hook(command, *(["--env-requests"] if env_requests else []), *_server_args(server)),
        "when": when,
        "stages": _stages(poststop),
    }


def runc_hooks(command: list[str], *, poststop: bool = False, server: str | None = None) -> dict[str, Any]:
    return {"hooks": {stage: [_hook(command, *_server_args(server))] for stage in _stages(poststop)}}


def render(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


SERVER_UNIT = "devinject-hook-server.service"
DEFAULT_UNIT_DIR = "/etc/systemd/system"
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._:=@+,-")


def _unit_word(word: str, *, program: bool = False) -> str:
    """One word of a unit's command line (systemd.service, "Command lines"): `%` starts a specifier
    everywhere, `$` a variable in the arguments only (the program is a literal path), and a word with blanks
    or quotes is quoted."""
    word = word.replace("%", "%%")
    if not program:
        word = word.replace("$", "$$")
    if word and set(word) <= _PLAIN | {"%", "$"}:
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def server_unit(command: list[str], server: str) -> str:
    """The systemd unit of `devinject hook-server` on `server`, run as `command` runs the hook (this
    installation's launcher by default, so the unit starts the devinject the hook belongs to)."""
    from devinject.hook.client import DEFAULT_SOCKET

    words = [*command[2:], "hook-server", "--socket", server or DEFAULT_SOCKET]
    exec_start = " ".join([_unit_word(command[0], program=True), *(_unit_word(word) for word in words)])
    return f"""[Unit]
Description=devinject: serve the OCI hook from a resident process (faster container starts)
# What it does: docs/hook.md in devinject's source (nothing installs the docs on the node)
# Optional: without it the hook runs in-process. Restart it after upgrading devinject.
Before=containerd.service crio.service docker.service

[Service]
Type=simple
ExecStart={exec_start}
Restart=on-failure
RestartSec=1
# No sandboxing: its workers do what the hook does (mknod and mounts in containers' namespaces, cgroup
# writes, moving network interfaces, the ledger), as the runtime's hook would.

[Install]
WantedBy=multi-user.target
"""


CONTAINERD_CONFIGS = ("/etc/containerd/config.toml",)
SAMPLE_CDI_ANNOTATION = "cdi.k8s.io/devinject_nvidia.com_gpu"


def _path_match(pattern: str, key: str) -> bool:
    """Go's path.Match, as containerd matches `pod_annotations`: `*` and `?` never cross a `/`."""
    from fnmatch import fnmatchcase

    parts, keys = pattern.split("/"), key.split("/")
    return len(parts) == len(keys) and all(fnmatchcase(k, p) for p, k in zip(parts, keys, strict=True))


def _pod_annotation_lists(table: object, where: str = "") -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    if isinstance(table, dict):
        for key, value in table.items():
            name = f"{where}.{key}" if where else str(key)
            if key == "pod_annotations" and isinstance(value, list):
                found.append((name, [str(v) for v in value]))
            else:
                found += _pod_annotation_lists(value, name)
    return found


def pod_annotation_passthrough(root: str = "/", configs: tuple[str, ...] | None = None) -> list[str]:
    """One line for each `pod_annotations` list in containerd's config under `root` that passes a pod's own
    `cdi.k8s.io/*` annotations into the OCI config, where they look like the kubelet's: the hook then serves a
    container of a pod only what the node's device plugin and DRA driver granted that pod (docs/hook.md,
    "Trust model"). Empty when none does, or no config is there. For `install-hook` and `doctor`."""
    import glob
    import tomllib

    lines = []
    queue = list(CONTAINERD_CONFIGS if configs is None else configs)
    seen: set[str] = set()
    while queue and len(seen) < 64:
        config = queue.pop(0)
        if config in seen:
            continue
        seen.add(config)
        path = os.path.join(root, config.lstrip("/"))
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except FileNotFoundError:
            continue
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            lines.append(f"{config}: cannot read containerd's config ({err}); pod annotations not checked")
            continue
        imports = data.get("imports")
        for pattern in imports if isinstance(imports, list) else ():  # drop-ins (`conf.d/*.toml`), as containerd
            if isinstance(pattern, str):
                pattern = pattern if pattern.startswith("/") else os.path.join(os.path.dirname(config), pattern)
                found = sorted(glob.glob(os.path.join(root, pattern.lstrip("/"))))
                queue += ["/" + os.path.relpath(f, root) for f in found]
        for name, patterns in _pod_annotation_lists(data):
            passing = [p for p in patterns if _path_match(p, SAMPLE_CDI_ANNOTATION)]
            if passing:
                lines.append(f"{config}: {name} = {passing} passes pods' own cdi.k8s.io/ annotations to the "
                             "runtime: the hook ignores them in a pod's container and serves it only what the "
                             "device plugin and DRA driver granted its pod")
    return lines
