import logging

from devinject.discovery.discover import discover
from devinject.discovery.host import Host
from devinject.discovery.profiles import load_profiles
from devinject.discovery.sysfs import scan_pci
from tests.conftest import HOSTS


def _found(name):
    host = Host(str(HOSTS / name))
    return discover(host, load_profiles(host))


def test_pci_scan_follows_nested_realpaths_and_strips_newlines():
    host = Host(str(HOSTS / "hgx-h100"))
    gpu = next(p for p in scan_pci(host) if p.address == "0000:18:00.0")
    assert gpu.sys_path == "/sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
    assert (gpu.vendor, gpu.device, gpu.class_code) == (0x10DE, 0x2330, 0x030200)
    assert (gpu.driver, gpu.numa_node, gpu.iommu_group) == ("nvidia", 0, "20")


def test_nvidia_minor_comes_from_information_file_not_the_index():
    gpus = [f for f in _found("hgx-h100") if f.profile.kind == "nvidia.com/gpu"]
    assert [f.address for f in gpus] == [f"0000:{b}:00.0" for b in ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")]
    assert [f.index for f in gpus] == list(range(8))
    assert [f.nodes[0].minor for f in gpus] == [2, 3, 0, 1, 6, 7, 4, 5]
    assert all(f.nodes[0].path == f"/dev/nvidia{f.nodes[0].minor}" and f.nodes[0].major == 195 for f in gpus)


def test_nvswitches_and_bmc_are_not_gpus():
    kinds = {(f.profile.kind, f.pci.device) for f in _found("hgx-h100")}
    assert (("nvidia.com/gpu", 0x22A3)) not in kinds
    assert all(k[0] in ("nvidia.com/gpu", "nvidia.com/rdma") for k in kinds)


def test_amd_gpus_skip_the_bmc_card0():
    gpus = _found("mi300x")
    assert [n.path for n in gpus[0].nodes] == ["/dev/dri/card1", "/dev/dri/renderD128"]
    assert gpus[0].nodes[1].major == 226 and gpus[0].nodes[1].minor == 128


def test_gaudi_accel_control_and_uverbs():
    first = _found("gaudi2")[0]
    assert [(n.path, n.major, n.minor) for n in first.nodes] == [
        ("/dev/accel/accel0", 261, 0), ("/dev/accel/accel_controlD0", 508, 0), ("/dev/infiniband/uverbs0", 231, 192)]


def test_alveo_joins_both_functions_of_a_card():
    cards = _found("alveo-u250")
    assert len(cards) == 2
    assert [f.address for f in cards[1].functions] == ["0000:05:00.0", "0000:05:00.1"]
    assert [n.path for n in cards[1].nodes] == ["/dev/xclmgmt1280", "/dev/dri/renderD129"]


def test_vfio_bound_function_goes_to_vfio_kind_not_vendor_kind():
    found = {f.address: f for f in _found("workstation")}
    assert found["0000:02:00.0"].profile.kind == "devinject.io/vfio"
    assert [n.path for n in found["0000:02:00.0"].nodes] == ["/dev/vfio/15", "/dev/vfio/devices/vfio0"]
    assert found["0000:01:00.0"].profile.kind == "nvidia.com/gpu"


def test_ascend_indexed_virtual_class_devices():
    npus = _found("ascend-910b")
    assert [n.path for f in npus for n in f.nodes] == [f"/dev/davinci{i}" for i in range(8)]


def test_empty_vm_has_no_devices():
    assert _found("empty-vm") == []


def test_unreadable_device_is_skipped_with_a_warning_naming_the_path(host_copy, caplog):
    root = host_copy("hgx-h100")
    (root / "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0/vendor").unlink()
    host = Host(str(root))
    with caplog.at_level(logging.WARNING):
        gpus = [f for f in discover(host, load_profiles(host)) if f.profile.kind == "nvidia.com/gpu"]
    assert len(gpus) == 7
    assert "0000:18:00.0" in caplog.text and "vendor" in caplog.text and "0000:16:00.0/0000:18:00.0" in caplog.text


def test_missing_information_file_drops_only_that_gpu(host_copy, caplog):
    root = host_copy("hgx-h100")
    (root / "proc/driver/nvidia/gpus/0000:2a:00.0/information").unlink()
    host = Host(str(root))
    gpus = [f for f in discover(host, load_profiles(host)) if f.profile.kind == "nvidia.com/gpu"]
    assert [f.index for f in gpus] == [0, 2, 3, 4, 5, 6, 7]  # indices do not shift


def test_unbound_gpu_keeps_its_index_so_others_are_not_renamed(host_copy):
    root = host_copy("hgx-h100")
    (root / "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0/driver").unlink()
    host = Host(str(root))
    gpus = [f for f in discover(host, load_profiles(host)) if f.profile.kind == "nvidia.com/gpu"]
    assert [(f.index, f.address) for f in gpus][:2] == [(1, "0000:2a:00.0"), (2, "0000:3a:00.0")]


def test_a_real_host_node_gives_its_file_mode_to_the_spec(tmp_path):
    """The node's mode comes from the host's own node when its numbers match (a 0660 node stays 0660)."""
    import os

    from devinject.discovery.discover import HostView
    from tests.e2e.conftest import require

    require(os.geteuid() == 0, "needs root (mknod)")
    (tmp_path / "dev").mkdir()
    os.mknod(tmp_path / "dev/vendor0", 0o020000 | 0o660, os.makedev(1, 3))
    os.chmod(tmp_path / "dev/vendor0", 0o660)
    view = HostView(Host(str(tmp_path)))
    assert view.node("/dev/vendor0", 1, 3).file_mode == 0o660
    assert view.node("/dev/vendor0", 1, 5).file_mode is None  # other numbers: not this node's mode
    assert view.node("/dev/absent", 1, 3).file_mode is None


def test_a_family_added_as_data_only(tmp_path):
    """Tenstorrent came as a profile, a fixture tree and a golden, no code: its class devices have no
    DEVNAME (`tenstorrent!0` is /dev/tenstorrent/0 by the kernel's rule), and the vendor name, models and
    uevent subsystem the agent listens to all come from the profile."""
    from devinject.agent.watch import Watcher, WatchOptions
    from devinject.discovery.node import Node
    from devinject.inventory import inventory
    from devinject.specs.generate import GenerateOptions

    found = _found("tenstorrent-n300")
    assert [(f.profile.kind, [n.path for n in f.nodes]) for f in found] == [
        ("tenstorrent.com/card", ["/dev/tenstorrent/0"]), ("tenstorrent.com/card", ["/dev/tenstorrent/1"])]
    rows = inventory(Node(str(HOSTS / "tenstorrent-n300")))
    assert {(r.vendor, r.model) for r in rows} == {("Tenstorrent", "Tenstorrent Wormhole")}
    watcher = Watcher(WatchOptions(generate=GenerateOptions(root=str(HOSTS / "tenstorrent-n300")),
                                   output_dir=tmp_path / "cdi", state_dir=str(tmp_path / "state")))
    assert {"pci", "tenstorrent", "drm", "infiniband"} <= watcher.uevent_subsystems
