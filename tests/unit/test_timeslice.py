"""A TimeSlicing claim's interval applied as NVIDIA's DRA driver applies it (agent/timeslice.py): the driver
root's nvidia-smi (a stand-in recording its arguments) sets the GPU's compute mode to DEFAULT and then
`compute-policy -i <UUID> --set-timeslice <n>`; an interval the node cannot apply (nvidia-smi refuses it, is
missing, does not answer in time) is the claim's one-line error and leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devinject.agent.timeslice import TimesliceError, apply_timeslice
from devinject.dra.claims import PrepareError
from devinject.dra.driver import DraDriver
from devinject.nodestate.ledger import Ledger
from tests.integration.test_dra_driver import DRIVER, GPU_POOL, FakeApi, make_driver

UID = "0b7f8e7c-4444-4c1b-9a55-000000000001"
RECORDING = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls"
"""
REFUSING = """#!/bin/sh
echo "Not Supported: compute-policy for $3" >&2
exit 3
"""


def time_slicing(interval: str) -> list[dict[str, object]]:
    return [{"source": "FromClaim", "requests": ["gpus"], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}}}}]


def driver_with(tmp_path: Path, interval: str, script: str | None) -> tuple[DraDriver, Path]:
    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"], mode=0o755)
    api = FakeApi()
    api.add("ts", UID, [(GPU_POOL, "gpu-0000-18-00-0")], config=time_slicing(interval))
    driver = make_driver(dirs, api)
    root = tmp_path / "driver"
    (root / "usr/bin").mkdir(parents=True)
    if script is not None:
        (root / "usr/bin/nvidia-smi").write_text(script)
        (root / "usr/bin/nvidia-smi").chmod(0o755)
    driver.preparer.driver_root = str(root)
    return driver, root


def test_the_interval_is_set_through_nvidia_smi(tmp_path: Path) -> None:
    driver, root = driver_with(tmp_path, "Long", RECORDING)
    driver.preparer.prepare("default", "ts", UID)
    uuid = driver.inventory().offers[(GPU_POOL, "gpu-0000-18-00-0")].device.uuid
    assert uuid and (root / "usr/bin/calls").read_text().splitlines() == [
        f"-i {uuid} -c DEFAULT", f"compute-policy -i {uuid} --set-timeslice 3"]
    assert driver.preparer.prepared()[UID].sharing == {"gpus": {"strategy": "TimeSlicing", "interval": "Long"}}


def test_an_interval_the_node_refuses_is_the_claims_error_and_leaves_nothing(tmp_path: Path) -> None:
    driver, _ = driver_with(tmp_path, "Short", REFUSING)
    with pytest.raises(PrepareError, match=r"claim default/ts: 0000:18:00.0: interval Short: nvidia-smi -i GPU-\S+ "
                                           r"-c DEFAULT failed \(status 3\): Not Supported"):
        driver.preparer.prepare("default", "ts", UID)
    assert not os.path.exists(driver.preparer.spec_path(UID))
    assert UID not in driver.preparer.prepared()
    assert not any(UID in b for b in Ledger(driver.opts.state_dir).snapshot()["allocations"])


def test_no_nvidia_smi_refuses_an_interval_but_not_the_default(tmp_path: Path) -> None:
    driver, _ = driver_with(tmp_path / "long", "Medium", None)
    with pytest.raises(PrepareError, match="interval Medium: .*nvidia-smi is not there"):
        driver.preparer.prepare("default", "ts", UID)
    driver, _ = driver_with(tmp_path / "default", "Default", None)
    assert driver.preparer.prepare("default", "ts", UID)


def test_a_hung_nvidia_smi_meets_its_deadline(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-smi").write_text("#!/bin/sh\nexec sleep 30\n")
    (tmp_path / "usr/bin/nvidia-smi").chmod(0o755)
    with pytest.raises(TimesliceError, match="did not answer within 0.3 s"):
        apply_timeslice(str(tmp_path), "0000:18:00.0", "GPU-1", "Long", timeout=0.3)
    with pytest.raises(TimesliceError, match="UUID is not known"):
        apply_timeslice(str(tmp_path), "0000:18:00.0", "", "Long")


def test_an_nvidia_smi_whose_child_holds_its_output_still_meets_the_deadline(tmp_path: Path) -> None:
    """The deadline held only for nvidia-smi itself: killed, its output was read to the end, which a child
    still holding the pipe (as a process stuck on a wedged GPU does) kept open for as long as it lived, with
    the claims' lock held all along."""
    import time

    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-smi").write_text("#!/bin/sh\nsleep 20 &\nexec sleep 20\n")
    (tmp_path / "usr/bin/nvidia-smi").chmod(0o755)
    started = time.monotonic()
    with pytest.raises(TimesliceError, match="did not answer within 0.3 s"):
        apply_timeslice(str(tmp_path), "0000:18:00.0", "GPU-1", "Long", timeout=0.3)
    assert time.monotonic() - started < 5


def test_what_nvidia_smi_says_is_read_only_up_to_a_bound(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-smi").write_text("#!/bin/sh\nhead -c 20000000 /dev/zero | tr '\\0' x\nexit 4\n")
    (tmp_path / "usr/bin/nvidia-smi").chmod(0o755)
    with pytest.raises(TimesliceError, match=r"failed \(status 4\): x+$") as refused:
        apply_timeslice(str(tmp_path), "0000:18:00.0", "GPU-1", "Long")
    assert len(str(refused.value)) < 600


# --- nvidia-smi runs as root: resolved inside the driver root and root's alone (agent/rootprogram.py) ---------
MARKING = """#!/bin/sh
: > "$(dirname "$0")/ran"
"""


@pytest.mark.parametrize("interval", ["Default", "Long"])
def test_an_nvidia_smi_another_user_could_change_is_refused_and_never_run(tmp_path: Path, interval: str) -> None:
    """A uid-1000-owned, world-writable nvidia-smi under the driver root: refused in one line, not run as
    root (before: run after an executable check)."""
    _, root = driver_with(tmp_path, interval, MARKING)
    program = root / "usr/bin/nvidia-smi"
    os.chown(program, 1000, 1000)
    program.chmod(0o777)
    with pytest.raises(TimesliceError) as caught:
        apply_timeslice(str(root), "0000:18:00.0", "GPU-1", interval)
    assert caught.value.message == (f"0000:18:00.0: interval {interval}: {program}: owned by uid 1000, not root; "
                                    "refused (it would run as root)")
    assert not (root / "usr/bin/ran").exists()


def test_an_nvidia_smi_in_a_directory_others_could_change_is_refused(tmp_path: Path) -> None:
    _, root = driver_with(tmp_path, "Long", MARKING)
    (root / "usr/bin").chmod(0o777)
    with pytest.raises(TimesliceError, match=r"usr/bin: directory writable by group or others; .* refused"):
        apply_timeslice(str(root), "0000:18:00.0", "GPU-1", "Long")
    assert not (root / "usr/bin/ran").exists()


def test_an_absolute_link_resolves_inside_the_driver_root(tmp_path: Path) -> None:
    """Debian's /usr/bin/nvidia-smi -> /etc/alternatives/nvidia-smi: the driver root's alternative runs,
    never the agent's own /etc/alternatives (here: none, so the unresolved link would fail)."""
    from devinject.agent.rootprogram import UntrustedProgramError, root_program

    _, root = driver_with(tmp_path, "Long", None)
    (root / "etc/alternatives").mkdir(parents=True)
    (root / "etc/alternatives/nvidia-smi").write_text(MARKING)
    (root / "etc/alternatives/nvidia-smi").chmod(0o755)
    (root / "usr/bin/nvidia-smi").symlink_to("/etc/alternatives/nvidia-smi")
    assert root_program(str(root), "/usr/bin/nvidia-smi") == str(root / "etc/alternatives/nvidia-smi")
    assert apply_timeslice(str(root), "0000:18:00.0", "GPU-1", "Long")
    assert (root / "etc/alternatives/ran").exists()
    (root / "usr/bin/nvidia-smi").unlink()
    (root / "usr/bin/nvidia-smi").symlink_to("../../../../../../../etc/passwd")  # `..` stops at the root
    assert root_program(str(root), "/usr/bin/nvidia-smi") is None
    (root / "etc/passwd").write_text("x")
    with pytest.raises(UntrustedProgramError, match=r"not an executable file; not run"):
        root_program(str(root), "/usr/bin/nvidia-smi")
