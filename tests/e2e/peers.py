"""The peers' binaries (../shared/peers: real runtimes and NVIDIA's own tools) as the live tests use them."""

from __future__ import annotations

import hashlib
import lzma
from pathlib import Path

from tests.e2e.conftest import REPO, require

# ../shared/peers beside the checkout, else the machine's own (a clone made elsewhere: a clean-clone run's);
# every live module that runs a peer reads it from here
PEERS = next((p for p in (REPO.parent / "shared" / "peers", Path("/work/shared/peers")) if (p / "SHA256SUMS").exists()),
             REPO.parent / "shared" / "peers")


def unpacked(name: str, into: Path) -> Path:
    """A peer's binary unpacked into `into`, checked against SHA256SUMS; its path."""
    packed = PEERS / f"{name}.xz"
    require(packed.is_file(), f"{packed} missing (../shared/peers)")
    sums = dict(reversed(line.split()) for line in (PEERS / "SHA256SUMS").read_text().splitlines() if line.strip())
    binary = lzma.decompress(packed.read_bytes())
    assert hashlib.sha256(binary).hexdigest() == sums[name], f"{name}: not the binary SHA256SUMS names"
    (into / name).write_bytes(binary)
    (into / name).chmod(0o755)
    return into / name
