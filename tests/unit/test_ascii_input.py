"""Parsers of what others write take ASCII where they mean digits, names or keys (issue 40, item 4): '²' passes
str.isdigit() and fails int(), '٣' passes both (as 3); each is refused in one line, never a ValueError."""

from __future__ import annotations

import pytest

from devinject.core.asciitext import is_digits
from devinject.dra.capacity import CapacityError, parse_capacity_sharing, quantity
from devinject.dra.gpuconfig import GpuConfigError, megabytes, parse_gpu_config
from devinject.hook.plan import newer_than

NOT_ASCII_DIGITS = ["²", "٣", "1²", "\uff10", "\U0001d7d7"]  # superscript, Arabic-Indic, fullwidth, bold


@pytest.mark.parametrize("text", NOT_ASCII_DIGITS)
def test_only_ascii_digits_are_digits(text: str) -> None:
    assert text.isdigit() and not is_digits(text)


def test_digits() -> None:
    assert is_digits("0") and is_digits("0123456789") and not is_digits("") and not is_digits("1a")


@pytest.mark.parametrize("key", NOT_ASCII_DIGITS)
def test_a_gpu_configs_device_index_is_ascii(key: str) -> None:
    parameters = {"apiVersion": "dra.devinject.io/v1alpha1", "kind": "GpuConfig",
                  "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {key: "1Gi"}}}}
    with pytest.raises(GpuConfigError, match=r"defaultPerDevicePinnedMemoryLimit\..*: expected a device index"):
        parse_gpu_config(parameters, "c", "dra.devinject.io")


@pytest.mark.parametrize("value", ["٤Gi", "4Gi\n", "²", "1.\u0665Gi"])
def test_quantities_are_ascii_and_whole(value: str) -> None:
    with pytest.raises(GpuConfigError, match="expected a quantity"):
        megabytes("c", "limit", value)
    with pytest.raises(CapacityError, match="expected a quantity"):
        quantity(value, "x")


@pytest.mark.parametrize("shares", ["٤", "²"])
def test_the_capacity_settings_shares_are_ascii(shares: str) -> None:
    with pytest.raises(CapacityError, match="shares: expected a whole number from 1 to 1024"):
        parse_capacity_sharing(f"shares={shares}")


def test_a_library_version_in_an_image_is_ascii() -> None:
    """A file name in the image (libcuda.so.5²0.1) crashed the hook's forward-compat check with a ValueError."""
    assert not newer_than("5²0.1", "550.54.14") and not newer_than("٩٩٩.1", "550.54.14")
    assert newer_than("560.35.03", "550.54.14")
