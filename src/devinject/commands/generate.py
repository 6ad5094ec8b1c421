"""`devinject generate`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from devinject.cdi.cdiversion import DEFAULT_VERSION_CAP, KNOWN_VERSIONS
from devinject.commands.common import _bundle_command, _missing_kinds, _node, _node_hook
from devinject.commands.group import cli, note
from devinject.commands.options import (
    bundles_option,
    driver_root_option,
    node_hook_option,
    nvml_option,
    profile_dir_option,
    root_option,
    target_root_option,
)
from devinject.core.errors import DevinjectError, UsageError
from devinject.core.paths import (
    STATIC_SPEC_DIR,
)


@cli.command()
@root_option
@click.option("--output-dir", default=None, type=click.Path(file_okay=False), metavar="DIRECTORY",
              help=f"Write one <vendor>-<class> spec per kind here [default: {STATIC_SPEC_DIR} when --root is /, "
                   "else stdout: a fixture's or a mounted host's paths never land in this machine's spec dir].")
@click.option("-o", "--output", "output", default=None, metavar="FILE",
              help="Write to this file instead ('-' for stdout).")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True,
              help="The spec files' format.")
@click.option("--device-name-strategy", "strategies", multiple=True,
              type=click.Choice(["index", "uuid", "pci"]),
              help="Names to give each device (repeatable). Default: index and uuid, or index and pci.")
@click.option("--cdi-version", "version_cap", default=DEFAULT_VERSION_CAP, show_default=True,
              type=click.Choice(KNOWN_VERSIONS), help="Highest CDI version to emit (podman 4, containerd 1.7: 0.5.0).")
@click.option("--kind", "kinds", multiple=True, metavar="KIND",
              help="Only this kind, e.g. nvidia.com/gpu (repeatable; exit 1 when one has no devices).")
@click.option("--hook-path", default=None, metavar="PATH", help="Absolute path of devinject for the spec's CDI hooks.")
@profile_dir_option
@nvml_option
@bundles_option
@target_root_option
@driver_root_option
@node_hook_option
def generate(root: str, output_dir: str | None, output: str | None, fmt: str, strategies: tuple[str, ...],
             version_cap: str, kinds: tuple[str, ...], hook_path: str | None, profile_dirs: tuple[str, ...],
             nvml: bool | None, bundles: tuple[str, ...], target_root: str | None, driver_root: str | None,
             node_hook: str | None) -> None:
    """Discover devices on the host and write CDI specs."""
    if output is None and output_dir is None:
        # the node's own spec dir only for the node's own devices
        output, output_dir = ("-", None) if os.path.realpath(root) != "/" else (None, STATIC_SPEC_DIR)
    node = _node(root=root, target_root=target_root, profile_dirs=profile_dirs)
    hook_path = _node_hook(root, node_hook, hook_path, target_root)
    from devinject.cdi.spec import write_atomic
    from devinject.specs.generate import GenerateOptions, render, write_specs

    opts = GenerateOptions(kinds=kinds, strategies=strategies, version_cap=version_cap, hook_path=hook_path,
                           node_hook=_bundle_command(node_hook, hook_path), nvml=nvml, bundles=bundles,
                           driver_root=driver_root)
    specs = node.specs(opts)
    missing = _missing_kinds(kinds, {spec.kind for spec in specs})
    if not specs or missing:
        why = node.why_no_devices(missing or kinds)
        if missing:  # a kind asked for and not there: the admin's expectation failed
            raise DevinjectError(f"{why}; nothing written")
        note(f"{why}; nothing written")
        return
    from devinject.cdi.spec import spec_dir_problem

    if output != "-":  # a spec dir others could write: the hook and validate refuse every spec in it
        directory = (output_dir or STATIC_SPEC_DIR) if output is None else os.path.dirname(os.path.abspath(output))
        problem = spec_dir_problem(directory)
        if problem:
            raise DevinjectError(f"{problem}; nothing written", hint="write into a directory only root can change")
    if output == "-":
        texts = [render(spec, fmt) for spec in specs]
        if fmt == "json" and len(texts) > 1:
            click.echo(json.dumps([json.loads(t) for t in texts], indent=2))
        else:
            click.echo("".join(texts), nl=False)
        return
    if output is not None:
        if len(specs) != 1:
            kinds_found = ", ".join(s.kind for s in specs)
            raise UsageError(f"--output {output}: {len(specs)} kinds found ({kinds_found}); "
                                 "a spec file holds one kind", hint="use --kind or --output-dir")
        write_atomic(Path(output), render(specs[0], fmt))
        note(f"wrote {output} ({specs[0].kind}, {len(specs[0].devices)} names)")
        return
    for spec, path in zip(specs, write_specs(specs, Path(output_dir or STATIC_SPEC_DIR), fmt), strict=True):
        note(f"wrote {path} ({spec.kind}, {len(spec.devices)} names)")
