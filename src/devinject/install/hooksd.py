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
    launcher = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hook", "launcher.py")
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



def pod_annotation_passthrough(root: str = "/") -> list[str]:
    """One line when containerd's config under `root` (its imports too) passes a pod's own `cdi.k8s.io/*`
    annotations into the OCI config, where they look like the kubelet's (runtimes/config.py
    `annotations_passed_through`, which `doctor` reads too); empty when it does not, or no config is there.
    The hook ignores them in a pod's containers and serves those only what the node's device plugin and DRA
    driver granted the pod (docs/hook.md, "Trust model"); `install-hook` says so."""
    from devinject.core.errors import DevinjectError
    from devinject.runtimes.config import DEFAULT_CONFIG, annotations_passed_through, containerd_config

    config = DEFAULT_CONFIG["containerd"]
    main = os.path.join(root, config.lstrip("/"))
    try:
        data, files = containerd_config(main)
    except DevinjectError as err:
        return [f"{err.message}; pod annotations not checked"]
    passed = annotations_passed_through(data)
    if not passed:
        return []
    return [f"{', '.join(files)}: pod_annotations pass pods' own cdi.k8s.io/ annotations to the runtime "
            f"({'; '.join(passed)}): the hook ignores them in a pod's containers and serves those only what the "
            "device plugin and DRA driver granted the pod"]
