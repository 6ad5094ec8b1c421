"""Fault injection on fixture hosts: each fault ends in the right verdict."""

import os
import shutil

import pytest

from devinject.agent.health import check_host, parse_kernel_log
from devinject.discovery.node import Node

GPU = "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
KEY = "nvidia.com/gpu=0000:18:00.0"


def _verdicts(root, **kw):
    return {v.key: v for v in check_host(Node(str(root)), **kw)}


def _write(root, rel, text):
    path = root / rel
    if path.is_symlink() or path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_all_healthy_on_pristine_fixture():
    verdicts = _verdicts(__import__("tests.conftest", fromlist=["HOSTS"]).HOSTS / "hgx-h100")
    assert len(verdicts) == 16 and all(v.healthy for v in verdicts.values())


@pytest.mark.parametrize(
    ("fault", "status", "reason", "definite"),
    [
        (lambda r: _write(r, f"{GPU}/current_link_width", "8\n"), "degraded", "PCIe link x8 of x16", False),
        (lambda r: _write(r, f"{GPU}/current_link_speed", "16.0 GT/s PCIe\n"), "degraded", "PCIe link 16 of 32", False),
        (lambda r: _write(r, f"{GPU}/enable", "0\n"), "unhealthy", "enable=0", False),
        (lambda r: _write(r, f"{GPU}/aer_dev_fatal", "Undefined 0\nTOTAL_ERR_FATAL 2\n"), "unhealthy", "AER fatal",
         False),
        (lambda r: _write(r, f"{GPU}/aer_dev_nonfatal", "TOTAL_ERR_NONFATAL 1\n"), "degraded", "AER non-fatal", False),
        (lambda r: _write(r, "proc/driver/nvidia/gpus/0000:18:00.0/information",
                          "Device Minor: \t 2\nGPU Excluded:\t Yes\n"), "unhealthy", "GPU Excluded", False),
        (lambda r: _write(r, "var/log/kern.log",
                          "kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.\n"),
         "unhealthy", "fatal Xid 79", True),
        (lambda r: (r / GPU / "driver").unlink(), "unhealthy", "driver unbound", True),
    ],
    ids=["link-width", "link-speed", "disabled", "aer-fatal", "aer-nonfatal", "excluded", "xid-79", "unbound"],
)
def test_fault_gives_verdict(host_copy, fault, status, reason, definite):
    """`definite`: the kernel's own statement (acted on at once by the agents), not a reading to confirm."""
    root = host_copy("hgx-h100")
    fault(root)
    verdict = _verdicts(root)[KEY]
    assert verdict.status == status
    assert any(reason in r for r in verdict.reasons), verdict.reasons
    assert verdict.definite is definite
    others = [v for k, v in _verdicts(root).items() if k != KEY]
    assert all(v.healthy for v in others)


def test_application_xids_are_ignored(host_copy):
    root = host_copy("hgx-h100")
    _write(root, "var/log/kern.log", "NVRM: Xid (PCI:0000:18:00): 13, Graphics SM Warp Exception\n"
                                     "NVRM: Xid (PCI:0000:18:00): 31, Ch 00000010, intr 10000000\n")
    assert _verdicts(root)[KEY].healthy


def test_hanging_probe_becomes_unhealthy_probe_timed_out(host_copy):
    root = host_copy("hgx-h100")
    info = root / GPU / "current_link_width"
    info.unlink()
    os.mkfifo(info)  # opening a FIFO with no writer blocks, like config-space reads of a dead device
    verdict = _verdicts(root, timeout=0.3)[KEY]
    assert verdict.status == "unhealthy" and "probe timed out" in verdict.reasons[0]
    with open(info, "w") as unblock:  # release the stuck probe thread
        unblock.write("")


def test_removed_function_is_reported_by_watch_not_one_shot(host_copy):
    root = host_copy("hgx-h100")
    shutil.rmtree(root / GPU)
    (root / "sys/bus/pci/devices/0000:18:00.0").unlink()
    assert KEY not in _verdicts(root)


def test_kernel_log_errors_come_from_the_profile():
    """NVIDIA's Xid pattern and fatal codes are data in its profile, read by the generic parser."""
    from devinject.discovery.profiles import builtin_profiles

    (nvidia,) = [p for p in builtin_profiles() if p.kind == "nvidia.com/gpu"]
    assert nvidia.kernel_log is not None and 79 in nvidia.kernel_log.fatal and 13 not in nvidia.kernel_log.fatal
    text = "NVRM: Xid (PCI:0000:3B:00): 48, DBE\nNVRM: Xid (PCI:0000:3b:00): 94, x\nother line\n"
    assert parse_kernel_log(text, (nvidia.kernel_log.pattern,)) == {"0000:3b:00": [48, 94]}


@pytest.mark.parametrize(("health", "message"), [
    ("health: {kernel-log: {pattern: 'Xid (\\d+)', fatal: [1]}}", "needs the named groups"),
    ("health: {kernel-log: {pattern: '(unclosed', fatal: [1]}}", "not a regular expression"),
    ("health: {flags: [{proc-file: /x, key: K}]}", r"x\.yaml\.health\.flags\[0\]\.unhealthy: required"),
])
def test_bad_health_sections_name_the_field(health, message):
    from devinject.core.errors import ConfigError
    from devinject.discovery.profiles import _load_yaml, parse_profile

    text = f"name: x\nkind: a.com/b\n{health}\n"
    with pytest.raises(ConfigError, match=message):
        parse_profile(_load_yaml(text, "x.yaml"), "x.yaml")
