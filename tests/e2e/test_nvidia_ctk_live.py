"""NVIDIA's own generator against devinject's on one node: `nvidia-ctk cdi generate` (1.20.0, ../shared/peers)
reads the HGX H100 host (real char nodes, real ELF libraries) through the stub libnvidia-ml built from the
host's data (tests/nvmlstub), devinject's `generate` reads the same tree, and their specs must hold the same
content: each GPU's nodes (by index) and the common ones, the mounts' container paths, the links the hooks
make and the linker cache's folders. A difference fails unless docs/driver-fidelity.md lists it, with its
reason, under "Against nvidia-ctk" (and a listed one that no longer occurs fails too: the list stays true)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import lzma
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import DEVINJECT, REPO, require
from tests.fixtures.build_hosts import FakeHost, LibBuilder, build_hgx_h100

pytestmark = pytest.mark.live

PEERS = REPO.parent / "shared" / "peers"
FIDELITY = REPO / "docs" / "driver-fidelity.md"
GPUS = [str(i) for i in range(8)]


def _unpacked(name: str, into: Path) -> Path:
    """A peer's binary, unpacked and checked against SHA256SUMS."""
    packed = PEERS / f"{name}.xz"
    require(packed.is_file(), f"{packed} missing (../shared/peers)")
    sums = dict(reversed(line.split()) for line in (PEERS / "SHA256SUMS").read_text().splitlines() if line.strip())
    binary = lzma.decompress(packed.read_bytes())
    assert hashlib.sha256(binary).hexdigest() == sums[name], f"{name}: not the binary SHA256SUMS names"
    (into / name).write_bytes(binary)
    (into / name).chmod(0o755)
    return into / name


@pytest.fixture(scope="module")
def both_specs(tmp_path_factory: pytest.TempPathFactory, nvml_stubs) -> tuple[Path, Path, Path]:  # type: ignore[no-untyped-def]
    from tests.nvmlstub import install_stub

    require(shutil.which("gcc") is not None, "gcc not installed (the stub libnvidia-ml is compiled)")
    base = tmp_path_factory.mktemp("ctk")
    root = base / "host"
    with contextlib.ExitStack() as scratch:
        builder = LibBuilder()
        scratch.callback(shutil.rmtree, builder.tmp, ignore_errors=True)
        build_hgx_h100(builder, FakeHost(root, real_nodes=True))
    install_stub(root, nvml_stubs("hgx-h100"))
    ctk = _unpacked("nvidia-ctk", base)
    done = subprocess.run([str(ctk), "cdi", "generate", "--driver-root", str(root), "--dev-root", str(root),
                           "--output", str(base / "nvidia.yaml")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([DEVINJECT, "generate", "--root", str(root), "--kind", "nvidia.com/gpu", "--output",
                           str(base / "devinject.yaml"), "--hook-path", DEVINJECT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return root, base / "nvidia.yaml", base / "devinject.yaml"


def content(spec_path: Path, root: Path) -> set[tuple[str, str]]:
    """A spec's content as (what, item): `nodes` (`<GPU index>:<path>`, `*:<path>` for the spec's own),
    `mounts` (container paths), `links` (`<link> -> <target>`) and `folders` (the linker cache's)."""
    spec = yaml.safe_load(spec_path.read_text())
    prefix = f"{root}/"

    def host(path: str) -> str:
        return "/" + path[len(prefix):] if path.startswith(prefix) else path

    devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    common = spec.get("containerEdits") or {}
    out = {("nodes", f"*:{host(n['path'])}") for n in common.get("deviceNodes") or []}
    out |= {("nodes", f"{i}:{host(n['path'])}") for i in GPUS for n in devices[i].get("deviceNodes") or []}
    for edits in (common, *(devices[i] for i in GPUS)):
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


def listed_differences() -> dict[tuple[str, str, str], str]:
    """docs/driver-fidelity.md's "Against nvidia-ctk" table: (what, item, only in) -> why."""
    text = FIDELITY.read_text()
    section = text[text.index("## Against nvidia-ctk"):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in ("nodes", "mounts", "links", "folders"):
            assert cells[3], f"driver-fidelity.md: {cells[:3]} has no reason"
            rows[(cells[0], cells[1], cells[2])] = cells[3]
    return rows


def test_nvidia_ctk_and_devinject_give_the_same_content(both_specs: tuple[Path, Path, Path]) -> None:
    root, nvidia, ours = both_specs
    theirs, mine = content(nvidia, root), content(ours, root)
    assert {what for what, _ in theirs} == {"nodes", "mounts", "links", "folders"}, theirs  # it read the host
    assert sum(1 for what, item in theirs if what == "nodes" and re.match(r"\d:", item)) == 8
    found = {(what, item, "nvidia-ctk") for what, item in theirs - mine}
    found |= {(what, item, "devinject") for what, item in mine - theirs}
    listed = listed_differences()
    assert sorted(found - set(listed)) == [], "differences docs/driver-fidelity.md does not list"
    assert sorted(set(listed) - found) == [], "listed in docs/driver-fidelity.md, no longer differing"
