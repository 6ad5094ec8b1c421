import pytest

from devinject.discovery.procfs import (
    parse_dev_numbers,
    parse_key_values,
    parse_nvidia_version,
    parse_proc_devices,
    parse_uevent,
)

PROC_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
195 nvidia
195 nvidiactl
226 drm
510 nvidia-uvm

Block devices:
  7 loop
259 blkext
"""


def test_proc_devices_reads_char_section_only_and_keeps_every_region_name():
    majors = parse_proc_devices(PROC_DEVICES)
    assert majors["nvidia"] == 195 and majors["nvidiactl"] == 195
    assert majors["tty"] == 4 and majors["/dev/vc/0"] == 4
    assert majors["nvidia-uvm"] == 510
    assert "loop" not in majors and "blkext" not in majors


def test_proc_devices_treats_old_nvidia_frontend_as_nvidia():
    assert parse_proc_devices("Character devices:\n195 nvidia-frontend\n")["nvidia"] == 195


INFORMATION = (
    "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 100\nGPU UUID: \t GPU-5b3c0a1e-7c1d-4c1b-9a55-0e1f2a3b4c00\n"
    "Bus Location: \t 0000:18:00.0\nDevice Minor: \t 2\nGPU Excluded:\t No\n"
)


def test_information_file_splits_on_first_colon_and_trims_tabs():
    info = parse_key_values(INFORMATION)
    assert info["Device Minor"] == "2"
    assert info["Bus Location"] == "0000:18:00.0"
    assert info["GPU UUID"].startswith("GPU-5b3c")
    assert info["GPU Excluded"] == "No"


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n", "550.54.14"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  (dvs@x)  Date\n",
         "575.57.08"),
        ("garbage\n", None),
    ],
    ids=["proprietary", "open", "garbage"],
)
def test_nvidia_version(text, version):
    assert parse_nvidia_version(text) == version


@pytest.mark.parametrize(
    ("text", "numbers"),
    [("195:0\n", (195, 0)), ("231:192", (231, 192)), ("x:1\n", None), ("12\n", None), ("", None)],
)
def test_dev_numbers(text, numbers):
    assert parse_dev_numbers(text) == numbers


def test_uevent():
    assert parse_uevent("MAJOR=226\nMINOR=128\nDEVNAME=dri/renderD128\nDEVTYPE=drm_minor\n")["DEVNAME"] == (
        "dri/renderD128"
    )
