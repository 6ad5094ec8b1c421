"""The device plugin's answers as plain data (deviceplugin/allocation.py): what a container gets for a set of
device IDs, and which IDs the plugin prefers. The gRPC side: tests/integration/test_device_plugin.py."""

from __future__ import annotations

import pytest

from devinject.cdi.model import ContainerEdits, Device, DeviceNode, Hook, Mount, Spec
from devinject.deviceplugin.allocation import AllocationError, PluginDevice, annotation_key, answer, preferred
from devinject.discovery.topology import Place

LIB = "/usr/lib/x86_64-linux-gnu"
LINKS = Hook("createContainer", "/usr/bin/devinject", (
    "devinject", "cdi-hook", "create-symlinks", "--link", f"libx.so.9.1::{LIB}/libx.so.9",
    "--link", f"libx.so.9::{LIB}/libx.so", "--link", "/elsewhere/liby.so::/opt/y/liby.so"))
SPEC = Spec("vendor.com/gpu", (
    Device("0", ContainerEdits(device_nodes=(DeviceNode("/dev/gpu0", "/host/dev/gpu0", "c", 200, 0),))),
    Device("1", ContainerEdits(device_nodes=(DeviceNode("/dev/gpu1", None, "c", 200, 1, permissions="rw"),),
                               env=("ONE=1",))),
    Device("all", ContainerEdits())),
    ContainerEdits(env=("VENDOR_VISIBLE=void", "BROKEN"), hooks=(LINKS,),
                   device_nodes=(DeviceNode("/dev/gpuctl", None, "c", 200, 255),),
                   mounts=(Mount(f"/host{LIB}/libx.so.9.1", f"{LIB}/libx.so.9.1"),
                           Mount("/host/run/sock", "/run/sock", ("nosuid", "nodev", "bind")))))


def place(address: str, path: str, numa: int | None = 0) -> Place:
    return Place(address, tuple(path.split("/")), numa, "")


DEVICES = {
    "0000:01:00.0": PluginDevice("0000:01:00.0", "vendor.com/gpu=0", True,
                                 place("0000:01:00.0", "pci0000:00/0000:00:01.0/0000:01:00.0")),
    "0000:02:00.0": PluginDevice("0000:02:00.0", "vendor.com/gpu=1", True,
                                 place("0000:02:00.0", "pci0000:00/0000:00:02.0/0000:02:00.0")),
    "0000:81:00.0": PluginDevice("0000:81:00.0", "vendor.com/gpu=2", False,
                                 place("0000:81:00.0", "pci0000:80/0000:80:01.0/0000:81:00.0", 1)),
}


def test_one_container_gets_its_devices_the_shared_edits_and_the_annotation() -> None:
    given = answer("vendor.com/gpu", SPEC, DEVICES, ["0000:02:00.0", "0000:01:00.0"])
    assert given.cdi_devices == ("vendor.com/gpu=1", "vendor.com/gpu=0")  # in the kubelet's order
    assert given.devices == (("/dev/gpuctl", "/dev/gpuctl", "rw"), ("/dev/gpu1", "/dev/gpu1", "rw"),
                             ("/dev/gpu0", "/host/dev/gpu0", "rw"))
    mounts = {c: (h, ro) for c, h, ro in given.mounts}
    assert mounts[f"{LIB}/libx.so.9.1"] == (f"/host{LIB}/libx.so.9.1", True)
    assert mounts["/run/sock"] == ("/host/run/sock", False)  # no ro: a socket the workload writes to
    assert mounts[f"{LIB}/libx.so.9"] == (f"/host{LIB}/libx.so.9.1", True)  # the SONAME link, as a mount
    assert mounts[f"{LIB}/libx.so"] == (f"/host{LIB}/libx.so.9.1", True)  # a link to that link
    assert "/opt/y/liby.so" not in mounts  # its target is not mounted: nothing to point at
    assert given.envs == {"VENDOR_VISIBLE": "void", "ONE": "1"}  # an entry without '=' is no variable
    assert given.annotations == {"cdi.k8s.io/devinject_vendor.com_gpu": "vendor.com/gpu=1,vendor.com/gpu=0"}


def test_cdi_only_answers_carry_no_fallback() -> None:
    given = answer("vendor.com/gpu", SPEC, DEVICES, ["0000:01:00.0"], fallback=False)
    assert given.cdi_devices == ("vendor.com/gpu=0",) and not given.devices and not given.mounts
    assert not given.envs and given.annotations == {annotation_key("vendor.com/gpu"): "vendor.com/gpu=0"}


@pytest.mark.parametrize(("ids", "message"), [
    (["0000:01:00.0", "0000:09:00.0"], "unknown device ID 0000:09:00.0 (offered: 0000:01:00.0, 0000:02:00.0"),
    (["0000:81:00.0"], "device 0000:81:00.0 is unhealthy; not allocated"),
    (["0000:01:00.0", "0000:01:00.0"], "device IDs repeated in one request"),
])
def test_a_bad_request_is_refused_whole(ids: list[str], message: str) -> None:
    with pytest.raises(AllocationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        answer("vendor.com/gpu", SPEC, DEVICES, ids)


def test_a_device_missing_from_the_spec_is_an_error() -> None:
    stale = {"0000:03:00.0": PluginDevice("0000:03:00.0", "vendor.com/gpu=7", True,
                                          place("0000:03:00.0", "pci0000:00/0000:03:00.0"))}
    with pytest.raises(AllocationError, match="vendor.com/gpu=7 is not in the vendor.com/gpu spec"):
        answer("vendor.com/gpu", SPEC, stale, ["0000:03:00.0"])


def test_preferred_keeps_devices_close_and_falls_back_to_the_kubelets_order() -> None:
    everything = list(DEVICES)
    assert preferred(DEVICES, everything, [], 2) == ["0000:01:00.0", "0000:02:00.0"]  # one host bridge
    assert preferred(DEVICES, everything, ["0000:81:00.0"], 1) == ["0000:81:00.0"]
    assert preferred(DEVICES, everything, ["0000:81:00.0"], 2)[0] == "0000:01:00.0"  # sorted; includes 81
    assert "0000:81:00.0" in preferred(DEVICES, everything, ["0000:81:00.0"], 2)
    # IDs the plugin does not know: the kubelet's own choice, must-include first
    assert preferred(DEVICES, ["a", "b", "c"], ["c"], 2) == ["c", "a"]
    assert annotation_key("nvidia.com/gpu") == "cdi.k8s.io/devinject_nvidia.com_gpu"


def test_the_links_of_a_merged_links_and_ldcache_hook_are_mounted_as_well() -> None:
    """`allocate: both` for a spec naming one links-and-ldcache hook (links and the linker cache, one process),
    in the launcher form generate writes: the same SONAME links as mounts as from a create-symlinks hook."""
    merged = LINKS._replace(path="/usr/bin/python3", args=(
        "/usr/bin/python3", "-IS", "/usr/lib/python3/dist-packages/devinject/hook/launcher.py", "cdi-hook",
        "links-and-ldcache", *LINKS.args[3:], "--folder", LIB))
    spec = SPEC._replace(edits=SPEC.edits._replace(hooks=(merged,)))
    mounts = {c: (h, ro) for c, h, ro in answer("vendor.com/gpu", spec, DEVICES, ["0000:01:00.0"]).mounts}
    assert mounts[f"{LIB}/libx.so.9"] == (f"/host{LIB}/libx.so.9.1", True)
    assert mounts[f"{LIB}/libx.so"] == (f"/host{LIB}/libx.so.9.1", True)
