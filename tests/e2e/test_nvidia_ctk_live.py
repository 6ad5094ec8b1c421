"""NVIDIA's own generator against devinject's on one node: `nvidia-ctk cdi generate` (1.20.0, ../shared/peers)
reads a fixture host (real char nodes, real ELF libraries: the HGX H100, and the DGX A100 with a MIG GPU and
a full graphics install) through the stub libnvidia-ml built from the host's data (tests/nvmlstub),
devinject's `generate` reads the same tree, and their specs must hold the same content: each device's nodes
(by its index name, `0` or `0:1`) and the common ones, the mounts' container paths, the links the hooks make
and the linker cache's folders. A difference fails unless docs/driver-fidelity.md lists it, with its reason,
under "Against nvidia-ctk" (and a listed one that no longer occurs fails too: the list stays true).

nvidia-ctk reads `/proc/driver/nvidia-caps/mig-minors` on the machine it runs on whatever its roots, so it runs
in a mount namespace of its own with the host tree's `/proc/driver` over the machine's."""

from __future__ import annotations

import contextlib
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import DEVINJECT, REPO, require
from tests.e2e.peers import unpacked
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_dgx_a100_mig, build_hgx_h100

pytestmark = pytest.mark.live

FIDELITY = REPO / "docs" / "driver-fidelity.md"
BUILDERS = {"hgx-h100": build_hgx_h100, "dgx-a100-mig": build_dgx_a100_mig}
INDEX_NAME = re.compile(r"\d+(:\d+)?")  # a GPU's or a MIG device's index name, which both generators give


@pytest.fixture(scope="module")
def nvidia_ctk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return unpacked("nvidia-ctk", tmp_path_factory.mktemp("peers"))


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def both_specs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, nvml_stubs,  # type: ignore[no-untyped-def]
               nvidia_ctk: Path) -> tuple[str, Path, Path, Path]:
    from tests.nvmlstub import install_stub

    require(shutil.which("unshare") is not None, "unshare not installed")
    name = request.param
    base = tmp_path_factory.mktemp(name)
    root = base / "host"
    with contextlib.ExitStack() as scratch:
        builder = LibBuilder()
        scratch.callback(shutil.rmtree, builder.tmp, ignore_errors=True)
        BUILDERS[name](builder, FakeHost(root, real_nodes=True))
    install_stub(root, nvml_stubs(name))
    generate = (f"mount --bind {root}/proc/driver /proc/driver && exec {nvidia_ctk} cdi generate --driver-root "
                f"{root} --dev-root {root} --output {base}/nvidia.yaml")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", generate],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([DEVINJECT, "generate", "--root", str(root), "--kind", "nvidia.com/gpu", "--output",
                           str(base / "devinject.yaml"), "--hook-path", DEVINJECT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return name, root, base / "nvidia.yaml", base / "devinject.yaml"


def content(spec_path: Path, root: Path) -> set[tuple[str, str]]:
    """A spec's content as (what, item): `nodes` (`<index name>:<path>`, `*:<path>` for the spec's own),
    `mounts` (container paths), `links` (`<link> -> <target>`) and `folders` (the linker cache's)."""
    spec = yaml.safe_load(spec_path.read_text())
    prefix = f"{root}/"

    def host(path: str) -> str:
        return "/" + path[len(prefix):] if path.startswith(prefix) else path

    devices = {d["name"]: d["containerEdits"] for d in spec["devices"] if INDEX_NAME.fullmatch(d["name"])}
    common = spec.get("containerEdits") or {}
    out = {("nodes", f"*:{host(n['path'])}") for n in common.get("deviceNodes") or []}
    out |= {("nodes", f"{i}:{host(n['path'])}") for i, edits in devices.items() for n in edits.get("deviceNodes") or []}
    for edits in (common, *devices.values()):
        out |= {("mounts", host(m["containerPath"])) for m in edits.get("mounts") or []}
        for hook in edits.get("hooks") or []:
            args = hook["args"]
            for flag, value in itertools.pairwise(args):
                if flag == "--link":
                    target, _, link = value.partition("::")
                    out.add(("links", f"{link} -> {target}"))
                elif flag == "--folder":
                    out.add(("folders", host(value)))
    return out


def listed_differences(host: str) -> dict[tuple[str, str, str], str]:
    """docs/driver-fidelity.md's "Against nvidia-ctk" table, the rows of `host`: (what, item, only in) -> why."""
    text = FIDELITY.read_text()
    section = text[text.index("## Against nvidia-ctk"):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1] in ("nodes", "mounts", "links", "folders"):
            assert cells[4], f"driver-fidelity.md: {cells[:4]} has no reason"
            if cells[0] == host:
                rows[(cells[1], cells[2], cells[3])] = cells[4]
    return rows


def test_nvidia_ctk_and_devinject_give_the_same_content(both_specs: tuple[str, Path, Path, Path]) -> None:
    host, root, nvidia, ours = both_specs
    theirs, mine = content(nvidia, root), content(ours, root)
    assert {what for what, _ in theirs} == {"nodes", "mounts", "links", "folders"}, theirs  # it read the host
    assert any(re.match(r"\d", item) for what, item in theirs if what == "nodes")  # and its devices
    found = {(what, item, "nvidia-ctk") for what, item in theirs - mine}
    found |= {(what, item, "devinject") for what, item in mine - theirs}
    listed = listed_differences(host)
    assert sorted(found - set(listed)) == [], "differences docs/driver-fidelity.md does not list"
    assert sorted(set(listed) - found) == [], "listed in docs/driver-fidelity.md, no longer differing"
