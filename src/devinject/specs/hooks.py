"""The CDI hooks a spec runs: how they start devinject (`hook_command`) and the `cdi-hook` subcommands the
spec pipeline asks for: one spec-level hook for the libraries' links, the linker cache, the devices' own
links (a DRM device's by-path links) and the driver's application profile for the container's GPUs."""

from __future__ import annotations

import os
import posixpath
import shutil
import sys
from typing import NamedTuple

from devinject.cdi.model import Hook
from devinject.discovery.discover import FoundDevice

HOOK_ENV = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)
HOOK_TIMEOUT = 10


class HookCommand(NamedTuple):
    """How a spec's hooks start devinject."""

    path: str
    argv: tuple[str, ...]  # before `cdi-hook`
    env: tuple[str, ...] = HOOK_ENV


def default_hook_path() -> str:
    """This devinject, by an absolute path: the program run (a relative `.venv/bin/devinject` made absolute),
    else the console script beside this interpreter, else the one on PATH; `/usr/local/bin/devinject` when
    none is found (generate then refuses it unless it exists: cli.py `_checked_hook_path`)."""
    argv0 = sys.argv[0]
    if os.path.basename(argv0) == "devinject" and os.sep in argv0 and os.access(argv0, os.X_OK):
        return os.path.abspath(argv0)
    beside = os.path.join(os.path.dirname(sys.executable), "devinject")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("devinject")
    return os.path.abspath(found) if found else "/usr/local/bin/devinject"


def _launcher() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hook", "launcher.py")


def _is_this_installation(path: str) -> bool:
    """Whether `path` is this installation's own `devinject` console script: its `#!` names this interpreter
    and it runs devinject's entry. Read here, so only for a spec read on this machine (no --target-root)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    first, _, rest = head.partition(b"\n")
    return first == b"#!" + os.fsencode(sys.executable) and b"from devinject.entry import main" in rest


def hook_command(hook_path: str | None, *, target_root: str | None = None,
                 node_hook: HookCommand | None = None) -> HookCommand:
    """How a spec's CDI hooks run devinject. By default, and for a --hook-path that is this installation's
    console script, this interpreter on the hook launcher with `-IS`, as `install-hook` writes the OCI hook: no
    `site` (a virtual environment's `site` and `.pth` files cost a container start ~30 ms per hook here,
    bench/bench_cdi_hooks.py) and nothing imported but the cdi-hook's own modules. `node_hook` (`--node-hook`:
    what the node hook bundle's launcher runs, install/nodehook.py bundle_command) is named as it is. Any other
    --hook-path (a path as another host names it) runs as given."""
    if node_hook is not None:
        return node_hook
    if hook_path is None or (target_root is None and _is_this_installation(hook_path)):
        return HookCommand(sys.executable, (sys.executable, "-IS", _launcher()))
    return HookCommand(hook_path, ("devinject",))


def cdi_hook(command: HookCommand, subcommand: str, *flags: tuple[str, list[str]]) -> Hook:
    """A createContainer hook running one of devinject's own `cdi-hook` subcommands (`command`: hook_command's)."""
    args = [*command.argv, "cdi-hook", subcommand]
    for flag, values in flags:
        for value in values:
            args += [flag, value]
    return Hook("createContainer", command.path, tuple(args), command.env, HOOK_TIMEOUT)


def library_hook(command: HookCommand, links: list[str], folders: list[str], forward_compat: list[str],
                 device_links: tuple[str, ...] = (), gpu_nodes: tuple[str, ...] = ()) -> tuple[Hook, ...]:
    """The spec-level hook: one process per container for the links, its devices' own links (`--device-link`,
    made only for the devices the container was given), the linker cache and the application profile of its
    GPUs (`--application-profile`: every GPU's node, the profile naming those the container was given)
    together (each hook is an interpreter's start); the single-purpose subcommand when only one of them is
    needed, none when nothing is."""
    linked = ("--link", links), ("--device-link", list(device_links))
    cached = ("--folder", folders), ("--forward-compat", forward_compat)
    profiled = ("--application-profile", list(gpu_nodes))
    if sum(map(bool, (links or device_links, folders, gpu_nodes))) > 1:
        return (cdi_hook(command, "links-and-ldcache", *linked, *cached, profiled),)
    if links or device_links:
        return (cdi_hook(command, "create-symlinks", *linked),)
    if folders:
        return (cdi_hook(command, "update-ldcache", *cached),)
    if gpu_nodes:
        return (cdi_hook(command, "update-application-profile", profiled),)
    return ()


_DRM_BY_PATH = (("card", "card"), ("renderD", "render"))


def drm_by_path_links(item: FoundDevice) -> tuple[str, ...]:
    """`/dev/dri/by-path/pci-<address>-card` and `-render` links to the device's DRM nodes (TARGET::LINK), as
    udev makes them on the host (Chromium, VA-API and GStreamer find a GPU's nodes by its PCI address through
    them): the spec-level hook's `--device-link`s, made for the devices a container is given."""
    links = []
    for node in item.nodes:
        directory, name = posixpath.split(node.path)
        if directory != "/dev/dri":
            continue
        for prefix, suffix in _DRM_BY_PATH:
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                links.append(f"../{name}::/dev/dri/by-path/pci-{item.address}-{suffix}")
    return tuple(links)


def gpu_nodes(item: FoundDevice) -> tuple[str, ...]:
    """The device's GPU nodes as its profile's `application-profile` names them (`/dev/nvidia3`), its
    partitions' included (a MIG device's parent GPU): the spec-level hook's `--application-profile`s."""
    rule = item.profile.application_profile
    if rule is None:
        return ()
    nodes = [*item.nodes, *(node for partition in item.partitions for node in partition.nodes)]
    return tuple(dict.fromkeys(node.path for node in nodes if rule.names_gpu(node.path)))
