"""`devinject labels`."""

from __future__ import annotations

import os

import click

from devinject.commands.common import _node
from devinject.commands.group import cli, note
from devinject.commands.options import RenamedOption, nvml_option, profile_dir_option, root_option
from devinject.core.errors import DevinjectError, UsageError


@cli.command()
@root_option
@profile_dir_option
@click.option("--nfd-features-dir", "directory", cls=RenamedOption, renamed_from=("--write",), default=None,
              metavar="DIRECTORY",
              help="Write the feature file into DIRECTORY (NFD's features.d) instead of printing it.")
@nvml_option
def labels(root: str, profile_dirs: tuple[str, ...], directory: str | None, nvml: bool | None) -> None:
    """The node's labels for Node Feature Discovery's local source: per kind its count, product, driver
    version, partitions and NUMA nodes, and NVML's memory, compute capability, family and MIG profiles' counts,
    under devinject.io/ (watch and device-plugin write them with --nfd-features-dir)."""
    from devinject.agent.nfd import FEATURE_FILE, features, write_features

    node = _node(root=root, profile_dirs=profile_dirs, nvml=nvml)
    lines = features(node.host, node.devices(), gpu_facts=node.gpu_facts)
    if directory is None:
        click.echo("\n".join(lines))
        return
    if not os.path.isdir(directory):
        raise UsageError(f"--nfd-features-dir {directory}: no such directory")
    try:
        written = write_features(directory, lines)
    except OSError as err:
        raise DevinjectError(f"{directory}: cannot write the feature file: {err.strerror}") from None
    note(f"{'wrote' if written else 'unchanged:'} {os.path.join(directory, FEATURE_FILE)}")
