"""Whether a node's container runtime applies CDI, from which spec dirs, read from its configuration under a
root (what `devinject doctor`'s runtime link says). Only files are read; the runtime's binary is asked its
version (bounded) only for the machine's own root."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

from devinject.core.paths import DEFAULT_SPEC_DIRS
from devinject.runtimes.config import (
    DEFAULT_CONFIG,
    NO_CDI_FIX,
    _major_minor,
    annotations_passed_through,
    binary_version,
    containerd_config,
    containerd_cri,
    parse_toml,
    read_text,
)

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


def _in(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root != "/" else path


def _toml_files(root: str, main: str, drop_in_dir: str, suffix: str) -> dict[str, Any]:
    """A TOML config and its drop-ins (sorted, later wins key by key), as CRI-O and podman read them."""
    from devinject.runtimes.config import _merge

    data: dict[str, Any] = {}
    for path in [_in(root, main), *sorted(glob.glob(os.path.join(_in(root, drop_in_dir), "*" + suffix)))]:
        text = read_text(path)
        if text is not None:
            data = _merge(data, parse_toml(text, path))
    return data


def detect(root: str) -> list[str]:
    """The runtimes whose configuration (or, for podman and docker, binary) is on the node, containerd first."""
    found = [name for name, path in DEFAULT_CONFIG.items() if os.path.exists(_in(root, path))]
    if "podman" not in found and os.path.exists(_in(root, "/usr/bin/podman")):
        found.append("podman")
    if "docker" not in found and any(os.path.exists(_in(root, p)) for p in ("/usr/bin/dockerd", "/usr/sbin/dockerd")):
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
                             "devinject runtime configure --runtime containerd|crio|docker|podman")
    return _status(root, names[0], hooks_dir or HOOKS_DIR, version)


def _hook_installed(root: str, hooks_dir: str) -> bool:
    return os.path.exists(os.path.join(_in(root, hooks_dir), HOOK_FILE))


def _status(root: str, name: str, hooks_dir: str, version: str | None = None) -> RuntimeStatus:
    if name == "runc":
        if _hook_installed(root, hooks_dir):
            return RuntimeStatus("runc", True, f"runc applies no CDI; the devinject hook is installed "
                                 f"({hooks_dir}/{HOOK_FILE}); runc itself runs it only from a bundle's config.json")
        return RuntimeStatus("runc", False, "runc applies no CDI and the devinject hook is not installed",
                             "devinject install-hook --runc-snippet (into each bundle's config.json)")
    if name == "containerd":
        return _containerd(root)
    if name == "crio":
        data = _toml_files(root, DEFAULT_CONFIG["crio"], "/etc/crio/crio.conf.d", ".conf")
        dirs = data.get("crio", {}).get("runtime", {}).get("cdi_spec_dirs") or list(DEFAULT_SPEC_DIRS)
        return RuntimeStatus("crio", True, f"CRI-O applies CDI from {', '.join(dirs)}", spec_dirs=tuple(dirs))
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
    data = _toml_files(root, DEFAULT_CONFIG["podman"], "/etc/containers/containers.conf.d", ".conf")
    configured = data.get("engine", {}).get("cdi_spec_dirs")
    named = f"podman {version}" if version else "podman"
    if configured and version is not None and _major_minor(version) < PODMAN_READS_SPEC_DIRS:
        # seen on podman 4.3: `--device` of a spec only in a cdi_spec_dirs directory is unresolvable
        return RuntimeStatus("podman", True, f"{named} applies CDI from {', '.join(DEFAULT_SPEC_DIRS)} (it ignores "
                             f"containers.conf's cdi_spec_dirs {', '.join(configured)})",
                             spec_dirs=DEFAULT_SPEC_DIRS)
    dirs = configured or list(DEFAULT_SPEC_DIRS)
    return RuntimeStatus("podman", True, f"{named} applies CDI from {', '.join(dirs)}", spec_dirs=tuple(dirs))


def _containerd(root: str) -> RuntimeStatus:
    main = _in(root, DEFAULT_CONFIG["containerd"])
    data, files = containerd_config(main)
    version = "2" if data.get("version") == 3 else (binary_version("containerd") if root == "/" else None)
    if version is not None and _major_minor(version) < (1, 7):
        return RuntimeStatus("containerd", False, f"containerd {version} applies no CDI", NO_CDI_FIX)
    enabled, dirs = containerd_cri(data)
    read = ", ".join(files) or f"{main} (absent: defaults)"
    if not enabled:
        return RuntimeStatus("containerd", False, f"containerd{' ' + version if version else ''}: enable_cdi is "
                             f"off ({read})", "devinject runtime configure --runtime containerd, then "
                             "systemctl restart containerd")
    passed = annotations_passed_through(data)
    warning = (f"pod annotations reach the OCI spec ({'; '.join(passed)}): a pod's own cdi.k8s.io/* annotation "
               "looks like the kubelet's there (the devinject hook ignores it in a pod's containers; another hook "
               "may not)" if passed else None)
    return RuntimeStatus("containerd", True, f"containerd{' ' + version if version else ''} applies CDI from "
                         f"{', '.join(dirs)} ({read})", spec_dirs=tuple(dirs), warning=warning,
                         warning_fix="drop cdi.k8s.io/* from the runtimes' pod_annotations" if passed else None)
