"""What every runtime's configuration change is made of (a Plan of file Changes, written by config.apply) and
how a runtime's version is known (given, or asked of its binary, bounded): shared by config.py and docker.py."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from devinject.core.errors import ConfigError

DEFAULT_CONFIG = {
    "containerd": "/etc/containerd/config.toml",
    "crio": "/etc/crio/crio.conf",
    "docker": "/etc/docker/daemon.json",
    "podman": "/etc/containers/containers.conf",
}
CRIO_CONFIG_DIR = "/etc/crio/crio.conf.d"  # CRI-O's --config-dir default, whatever --config says
NO_CDI_FIX = ("install devinject's OCI hook instead (devinject install-hook; runc: install-hook --runc-snippet), "
              "or, on Kubernetes, let the device plugin's Allocate answer deliver the devices")


@dataclass(frozen=True, slots=True)
class Change:
    """One file's change: `new` None removes it."""

    path: str
    old: str | None
    new: str | None

    def diff(self) -> str:
        old = (self.old or "").splitlines(keepends=True)
        new = (self.new or "").splitlines(keepends=True)
        lines = difflib.unified_diff(old, new, self.path if self.old is not None else "/dev/null",
                                     self.path if self.new is not None else "/dev/null")
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


@dataclass(frozen=True, slots=True)
class Plan:
    runtime: str
    changes: tuple[Change, ...]
    notes: tuple[str, ...] = ()  # what the admin does next (restart the runtime)


def in_root(root: str, path: str) -> str:
    """`path` as the runtime sees it, under the host root `root` (an absolute path is the root's)."""
    return os.path.join(root, path.lstrip("/")) if root != "/" else path


def binary_version(name: str, *, timeout: float = 5.0, binary: str | None = None) -> str | None:
    """`NAME --version`'s first `vX.Y` (or `X.Y`), from `binary` or the one on a fixed PATH, bounded; None when
    it is not installed or does not answer."""
    binary = binary or shutil.which(name, path="/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin")
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=timeout,
                              env={"PATH": "/usr/bin:/bin"}, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\bv?(\d+\.\d+(?:\.\d+)?)", done.stdout[:4096])
    return found.group(1) if found else None


def major_minor(version: str) -> tuple[int, int]:
    """A `--runtime-version` (or a binary's) as (major, minor); one line naming it when it is none."""
    parts = re.findall(r"\d+", version)
    if not parts:
        raise ConfigError(f"--runtime-version {version!r}: expected a version such as 1.7 or 2.0")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
