"""`devinject topo`."""

from __future__ import annotations

import json

import click

from devinject.commands.common import _node
from devinject.commands.group import cli, note
from devinject.commands.options import profile_dir_option, root_option
from devinject.core.errors import DevinjectError


@cli.command()
@root_option
@click.option("--format", "fmt", type=click.Choice(["text", "json", "dot", "svg"]), default="text", show_default=True,
              help="text: the matrix and GPU-NIC pairs; dot: the PCIe tree for Graphviz; svg: rendered by `dot`.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write to FILE, not stdout.")
@profile_dir_option
def topo(root: str, fmt: str, as_json: bool, output: str | None, profile_dirs: tuple[str, ...]) -> None:
    """How close the devices are in the PCIe tree and across NUMA nodes (as `nvidia-smi topo -m`, any vendor)."""
    from devinject.discovery.topology import render_dot

    node = _node(root=root, profile_dirs=profile_dirs)
    result = node.topology()
    fmt = "json" if as_json else fmt
    if not result.labels and fmt != "json":  # the JSON of no devices is the empty topology (docs/json.md)
        note(node.why_no_devices())
        return
    if fmt == "json":
        text = json.dumps(result.to_json(), indent=2) + "\n"
    elif fmt == "text":
        text = result.render()
    else:
        text = render_dot(result)
        if fmt == "svg":
            text = _graphviz_svg(text)
    if output is None:
        click.echo(text, nl=False)
        return
    from devinject.core.atomicfile import replace

    try:
        replace(output, text.encode(), 0o644)
    except OSError as err:
        raise DevinjectError(f"--output {output}: cannot write: {err.strerror}") from None


def _graphviz_svg(dot_text: str) -> str:
    """`dot -Tsvg` from the host's Graphviz: clean environment, bounded time."""
    import shutil
    import subprocess

    dot = shutil.which("dot", path="/usr/local/bin:/usr/bin:/bin")
    if dot is None:
        raise DevinjectError("--format svg: Graphviz's `dot` is not installed (apt install graphviz), "
                             "or use --format dot")
    try:
        done = subprocess.run([dot, "-Tsvg"], input=dot_text, capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        raise DevinjectError(f"--format svg: {dot} did not finish in 60 s") from None
    if done.returncode != 0:
        raise DevinjectError(f"--format svg: {dot} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout
