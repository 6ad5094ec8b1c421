"""Specs of the newest CDI versions through the hook under real runc: netDevices (1.1.0) moved into the
container's network namespace, what a hook cannot apply logged, and a failure handing the interface back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Bundle, container_name

pytestmark = pytest.mark.live


@pytest.fixture
def dummy() -> Iterator[str]:
    """A network interface on the host (what a spec's hostInterfaceName names): one end of a veth pair,
    since this kernel has no dummy driver. The pair goes away when either end's namespace does."""
    from pyroute2 import IPRoute

    name = f"dvi{uuid.uuid4().hex[:8]}"
    with IPRoute() as ipr:
        ipr.link("add", ifname=name, kind="veth", peer=f"{name}p")
    yield name
    with IPRoute() as ipr:
        for index in ipr.link_lookup(ifname=name)[:1] or ipr.link_lookup(ifname=f"{name}p")[:1]:
            ipr.link("del", index=index)  # either end: deleting one removes the pair


def spec_1_1(directory: Path, interface: str, *, broken_mount: Path | None = None) -> Path:
    directory.mkdir()
    mounts = (f"    mounts: [{{hostPath: {broken_mount}, containerPath: /opt/missing.so, options: [ro, bind]}}]\n"
              if broken_mount else "")
    (directory / "net.yaml").write_text(
        "cdiVersion: 1.1.0\nkind: example.com/nic\ndevices:\n- name: a\n  containerEdits:\n"
        "    deviceNodes: [{path: /dev/example-nic, type: c, major: 1, minor: 3}]\n"
        f"    netDevices: [{{hostInterfaceName: {interface}, name: net0}}]\n"
        "    additionalGids: [44]\n    env: [NIC=net0]\n" + mounts)
    return directory


def host_has(interface: str) -> bool:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return bool(ipr.link_lookup(ifname=interface))


def test_net_device_is_moved_into_the_container_and_the_rest_is_logged(bundle: Bundle, dummy: str,
                                                                        tmp_path: Path) -> None:
    bundle.use_spec_dir(spec_1_1(tmp_path / "cdi", dummy))
    bundle.save(["sh", "-c", "ls /sys/class/net; cat /dev/example-nic; echo done"],
                annotations={"cdi.k8s.io/test": "example.com/nic=a"})
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["done", "lo", "net0"]
    (record,) = [r for r in bundle.log_records() if r.get("stage") == "prestart"]
    assert record["net_devices"] == [f"{dummy} -> net0"]
    warnings = " ".join(record["warnings"])
    assert "env edit(s) ignored" in warnings and "additionalGids [44] ignored" in warnings
    assert not host_has(dummy)  # it went with the container (a virtual device ends with its namespace)


def test_a_failed_start_hands_the_interface_back_to_the_host(bundle: Bundle, dummy: str, tmp_path: Path) -> None:
    spec_dir = spec_1_1(tmp_path / "cdi", dummy, broken_mount=tmp_path / "absent.so")
    bundle.use_spec_dir(spec_dir)
    bundle.save(["true"], annotations={"cdi.k8s.io/test": "example.com/nic=a"})
    done = bundle.run(container_name())
    assert done.returncode != 0
    assert "mount source" in done.stderr and "absent.so" in done.stderr
    assert host_has(dummy) and not host_has("net0")  # back under its own name
