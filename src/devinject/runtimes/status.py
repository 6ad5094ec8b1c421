"""Whether a node's container runtime applies CDI, from which spec dirs, read from its configuration under a
root (what `devinject doctor`'s runtime link says). Only files are read; the runtime's binary is asked its
version (bounded) only for the machine's own root."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from devinject.core.paths import DEFAULT_SPEC_DIRS
from devinject.runtimes import daemons
from devinject.runtimes.config import (
    CRIO_CONFIG_DIR,
    DEFAULT_CONFIG,
    DROP_IN,
    NO_CDI_FIX,
    _major_minor,
    annotations_passed_through,
    binary_version,
    containerd_version_problem,
    in_root,
    read_containerd,
    toml_layers,
)
from devinject.runtimes.names import CONFIGURABLE

HOOKS_DIR = "/etc/containers/oci/hooks.d"  # install/hooksd.py's default: the hooks.d files install-hook writes
HOOK_FILE = "10-devinject.json"


@dataclass(frozen=True, slots=True)
class RuntimeStatus:
    runtime: str
    applies: bool  # applies CDI itself, or the hook is installed for it
    detail: str
    fix: str | None = None
    spec_dirs: tuple[str, ...] | None = None  # None: the runtime reads no spec dirs (the hook does)
    warning: str | None = None
    warning_fix: str | None = None
    spec_dir_fix: str | None = None  # the fix for a spec dir not among spec_dirs ({spec_dir} in it); None: configure
    configure: str | None = None  # the `runtime configure` command line for this node and version, no --spec-dir
    restart: str | None = None  # what makes the runtime read a changed config


def detect(root: str) -> list[str]:
    """The runtimes whose configuration (or, for podman and docker, binary) is on the node, containerd first."""
    found = [name for name, path in DEFAULT_CONFIG.items() if os.path.exists(in_root(root, path))]
    if "podman" not in found and os.path.exists(in_root(root, "/usr/bin/podman")):
        found.append("podman")
    dockerd = ("/usr/bin/dockerd", "/usr/sbin/dockerd")
    if "docker" not in found and any(os.path.exists(in_root(root, p)) for p in dockerd):
        found.append("docker")  # docker 28.2+ needs no daemon.json: a stock node has none
    return found


def runtime_status(root: str, runtime: str | None = None, *, hooks_dir: str | None = None,
                   version: str | None = None) -> RuntimeStatus:
    """The runtime's (or, None, the first found's) CDI status on the node under `root`; `version`: the runtime's
    (None: asked of its binary for the machine's own root, else unknown)."""
    names = [runtime] if runtime else detect(root)
    if not names:
        return RuntimeStatus("none", False, f"no container runtime's configuration under {root} "
                             f"({', '.join(DEFAULT_CONFIG.values())})", "give --runtime, or "
                             f"devinject runtime configure --runtime {'|'.join(CONFIGURABLE)}")
    return _status(root, names[0], hooks_dir or HOOKS_DIR, version)


def _hook_installed(root: str, hooks_dir: str) -> bool:
    return os.path.exists(os.path.join(in_root(root, hooks_dir), HOOK_FILE))


def _status(root: str, name: str, hooks_dir: str, version: str | None = None) -> RuntimeStatus:
    if name == "runc":
        if _hook_installed(root, hooks_dir):
            return RuntimeStatus("runc", True, f"runc applies no CDI; the devinject hook is installed "
                                 f"({hooks_dir}/{HOOK_FILE}); runc itself runs it only from a bundle's config.json")
        return RuntimeStatus("runc", False, "runc applies no CDI and the devinject hook is not installed",
                             "devinject install-hook --runc-snippet (into each bundle's config.json)")
    if name == "containerd":
        running = daemons.running_containerd() if root == "/" else None
        if running is None:
            return _containerd(root, version if version is not None else
                               (binary_version("containerd") if root == "/" else None))
        return _containerd(root, version or running[2], running[1], running[0])
    if name == "crio":
        return _crio(root)
    if name == "podman":
        return _podman(root, version if version is not None else
                       (binary_version("podman") if root == "/" else None))
    if name == "docker":
        from devinject.runtimes import docker

        found = docker.node_status(root, version=version, hook_installed=_hook_installed(root, hooks_dir))
        return RuntimeStatus("docker", found.applies, found.detail, found.fix, found.spec_dirs,
                             spec_dir_fix=found.spec_dir_fix)
    raise ValueError(f"unknown runtime {name}")


PODMAN_READS_SPEC_DIRS = (5, 5)  # before it, podman reads CDI's default dirs whatever containers.conf says


def _podman(root: str, version: str | None) -> RuntimeStatus:
    data = toml_layers(root, DEFAULT_CONFIG["podman"], "/etc/containers/containers.conf.d", suffix=".conf").data
    configured = data.get("engine", {}).get("cdi_spec_dirs")
    named = f"podman {version}" if version else "podman"
    if configured and version is not None and _major_minor(version) < PODMAN_READS_SPEC_DIRS:
        # seen on podman 4.3: `--device` of a spec only in a cdi_spec_dirs directory is unresolvable
        return RuntimeStatus("podman", True, f"{named} applies CDI from {', '.join(DEFAULT_SPEC_DIRS)} (it ignores "
                             f"containers.conf's cdi_spec_dirs {', '.join(configured)})",
                             spec_dirs=DEFAULT_SPEC_DIRS)
    dirs = configured or list(DEFAULT_SPEC_DIRS)
    return RuntimeStatus("podman", True, f"{named} applies CDI from {', '.join(dirs)}", spec_dirs=tuple(dirs))


def configure_command(runtime: str, root: str, version: str | None = None, *extra: str) -> str:
    """The `devinject runtime configure` line that changes this node's runtime (under `root`), for a fix."""
    return " ".join(["devinject runtime configure --runtime", runtime, *(["--root", root] if root != "/" else []),
                     *(["--runtime-version", version] if version else []), *extra])


def _crio(root: str) -> RuntimeStatus:
    """CRI-O reads its main config, then every file of its --config-dir (whatever --config says): the running
    CRI-O's own flags on this machine's root, else its defaults."""
    running = daemons.running_crio() if root == "/" else None
    config, config_dir = running[1] if running else (DEFAULT_CONFIG["crio"], CRIO_CONFIG_DIR)
    layers = toml_layers(root, config, config_dir)
    configured = layers.data.get("crio", {}).get("runtime", {}).get("cdi_spec_dirs")
    dirs = [d for d in configured if isinstance(d, str)] if isinstance(configured, list) and configured \
        else list(DEFAULT_SPEC_DIRS)
    read = ", ".join(layers.files) or f"no config in {config} or {config_dir}: its defaults"
    flags = [] if (config, config_dir) == (DEFAULT_CONFIG["crio"], CRIO_CONFIG_DIR) else \
        ["--config", config, "--config-dir", config_dir]
    started = f"; pid {running[0]}'s --config-dir {config_dir}" if running and flags else ""
    return RuntimeStatus("crio", True, f"CRI-O applies CDI from {', '.join(dirs)} ({read}{started}; a "
                         "container's cdi.k8s.io/* annotations, never a pod's)", spec_dirs=tuple(dirs),
                         configure=configure_command("crio", root, None, *flags), restart="systemctl restart crio")


def _patch_version(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


RESTART_CONTAINERD = "systemctl restart containerd"
REFUSES_NEWER_DROP_INS = ((2, 3, 0), (2, 3, 4))  # "drop-in config version 3 higher than root config version 2"


def _containerd(root: str, version: str | None, main: str = DEFAULT_CONFIG["containerd"],
                pid: int | None = None) -> RuntimeStatus:
    """containerd's CDI from `main` (the running daemon's --config, pid `pid`, else the default) and its
    imports, for containerd `version` (None: unknown)."""
    found = read_containerd(main, root)
    named_config = [] if main == DEFAULT_CONFIG["containerd"] else ["--config", main]
    configure = configure_command("containerd", root, version, *named_config)
    fix = f"{configure}, then {RESTART_CONTAINERD}"
    if version is not None and _major_minor(version) < (1, 7):
        return RuntimeStatus("containerd", False, f"containerd {version} applies no CDI", NO_CDI_FIX)
    named = f"containerd {version}" if version else ("containerd 2.x" if (found.version or 0) >= 3 else "containerd")
    problem = containerd_version_problem(found.version, version) if version else None
    if problem:
        return RuntimeStatus("containerd", False, f"{in_root(root, main)}: {problem}: {named} does not start on it",
                             f"rewrite it for {named} (containerd config default prints its own), then {fix}")
    if found.newer and (version is None or REFUSES_NEWER_DROP_INS[0] <= _patch_version(version)
                        <= REFUSES_NEWER_DROP_INS[1]):
        path, newer = found.newer[0]
        ours = os.path.basename(path) == DROP_IN + ".toml"  # an older devinject's: configure rewrites it
        return RuntimeStatus("containerd", False, f"{in_root(root, path)} is a version {newer} drop-in, above the root "
                             f"config's version {found.version}: containerd 2.3.0-2.3.4 refuse to start on it",
                             None if ours else f"make {in_root(root, path)} version {found.version} (its keys in that "
                             "version's names) or remove it", configure=configure if ours else None,
                             restart=RESTART_CONTAINERD)
    if version is not None:
        two = _major_minor(version) >= (2, 0)
    elif found.version is not None:
        two = found.version >= 3
    else:
        return RuntimeStatus("containerd", False, f"no {in_root(root, main)} and containerd's version unknown: 2.x "
                             f"applies CDI from {', '.join(DEFAULT_SPEC_DIRS)} without one, 1.7 applies none",
                             "give --runtime-version (containerd --version)")
    enabled, dirs, setter = found.cri(two)
    read = ", ".join(in_root(root, f) for f in found.files) or f"no {in_root(root, main)}: its defaults"
    read += f"; pid {pid}'s --config" if pid is not None and named_config else ""
    if not enabled:
        return RuntimeStatus("containerd", False, f"{named}: enable_cdi is off ({in_root(root, setter or main)})", fix,
                             configure=configure, restart=RESTART_CONTAINERD)
    passed = annotations_passed_through(found.data)
    warning = (f"pod annotations reach the OCI spec ({'; '.join(passed)}): a pod's own cdi.k8s.io/* annotation "
               "looks like the kubelet's there (the devinject hook ignores it in a pod's containers; another hook "
               "may not)" if passed else None)
    return RuntimeStatus("containerd", True, f"{named} applies CDI from {', '.join(dirs)} ({read})",
                         spec_dirs=tuple(dirs), warning=warning,
                         warning_fix="drop cdi.k8s.io/* from the runtimes' pod_annotations" if passed else None,
                         configure=configure, restart=RESTART_CONTAINERD)
