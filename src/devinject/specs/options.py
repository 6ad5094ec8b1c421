"""What `generate` is asked for (GenerateOptions): the one record every stage of the spec pipeline reads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from devinject.cdi.cdiversion import DEFAULT_VERSION_CAP, KNOWN_VERSIONS
from devinject.core.errors import ConfigError

if TYPE_CHECKING:
    from devinject.specs.hooks import HookCommand

STRATEGIES = ("index", "uuid", "pci")


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    root: str = "/"
    kinds: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    version_cap: str = DEFAULT_VERSION_CAP
    hook_path: str | None = None
    node_hook: HookCommand | None = None  # --node-hook: what the bundle's launcher runs, named in specs
    profile_dirs: tuple[str, ...] = ()
    nvml: bool | None = None
    exclude: frozenset[str] = field(default_factory=frozenset)
    bundles: tuple[str, ...] = ()  # co-bound devices to add (specs.bundles): "gpu-nic"
    target_root: str | None = None  # the host as the spec's reader sees it (None: host paths keep `root`)
    driver_root: str | None = None  # where the driver's files are, as the host names it (None: the host's /)

    def check(self) -> None:
        for strategy in self.strategies:
            if strategy not in STRATEGIES:
                raise ConfigError(f"--device-name-strategy: unknown {strategy!r} (use {', '.join(STRATEGIES)})")
        from devinject.specs.bundles import BUNDLES

        for bundle in self.bundles:
            if bundle not in BUNDLES:
                raise ConfigError(f"--bundles: unknown {bundle!r} (use {', '.join(BUNDLES)})")
        if self.version_cap not in KNOWN_VERSIONS:
            raise ConfigError(f"--cdi-version: unknown version {self.version_cap!r}")
        if not os.path.isdir(self.root):
            raise ConfigError(f"--host-root (--root): {self.root}: not a directory")
        if self.target_root is not None and not self.target_root.startswith("/"):
            raise ConfigError(f"--target-root: {self.target_root}: must be an absolute path")
        if self.driver_root is not None:
            if not self.driver_root.startswith("/"):
                raise ConfigError(f"--driver-root: {self.driver_root}: must be an absolute path (as the host names it)")
            inside = os.path.join(self.root, self.driver_root.lstrip("/"))
            if not os.path.isdir(inside):
                raise ConfigError(f"--driver-root: {self.driver_root}: not a directory under --host-root ({inside})")
