"""A claim's GpuConfig (dra/gpuconfig.py): NVIDIA's fields in the driver's own API group, one line per bad
field naming where it is, each request's strategy from the configs that name it (a claim without config stays
exclusive)."""

from __future__ import annotations

import pytest

from devinject.dra.gpuconfig import (
    EXCLUSIVE,
    GpuConfigError,
    GpuSharing,
    MpsSettings,
    megabytes,
    parse_gpu_config,
    request_sharing,
)

GROUP = "dra.devinject.io"
WHERE = "claim default/c: status.allocation.devices.config[0].opaque"


def config(**sharing: object) -> dict[str, object]:
    return {"apiVersion": f"{GROUP}/v1alpha1", "kind": "GpuConfig", "sharing": sharing}


def test_nvidias_gpuconfig_translates_by_its_api_version() -> None:
    assert parse_gpu_config(config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}), WHERE, GROUP) \
        == GpuSharing("TimeSlicing", "Long")
    assert parse_gpu_config(config(strategy="TimeSlicing"), WHERE, GROUP) == GpuSharing("TimeSlicing", "Default")
    mps = parse_gpu_config(config(strategy="MPS", mpsConfig={
        "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi",
        "defaultPerDevicePinnedMemoryLimit": {"0": "512Mi"}}), WHERE, GROUP)
    assert mps == GpuSharing("MPS", mps=MpsSettings(50, 10240, {"0": 512}))
    assert mps.mode == "mps" and EXCLUSIVE.mode == "exclusive"
    assert parse_gpu_config({"apiVersion": f"{GROUP}/v1alpha1", "kind": "GpuConfig"}, WHERE, GROUP) == EXCLUSIVE
    assert [megabytes(WHERE, "x", q) for q in ("1Gi", "1.5Gi", "2G", 1048576, "1024Mi")] == [1024, 1536, 1907, 1, 1024]


@pytest.mark.parametrize(("parameters", "field"), [
    ({"mode": "fast"}, "parameters.'mode': unknown field"),
    ("MPS", "parameters: expected an object"),
    ({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"},
     "apiVersion: expected dra.devinject.io/v1alpha1, got 'resource.nvidia.com/v1beta1' (NVIDIA's"),
    ({"apiVersion": "dra.devinject.io/v1", "kind": "GpuConfig"}, "apiVersion: expected dra.devinject.io/v1alpha1"),
    ({"apiVersion": "dra.devinject.io/v1alpha1", "kind": "MigDeviceConfig"}, "kind: expected GpuConfig"),
    (config(strategy="Exclusive"), "sharing.strategy: expected TimeSlicing or MPS, got 'Exclusive'"),
    (config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Forever"}),
     "sharing.timeSlicingConfig.interval: expected one of Default, Short, Medium, Long, got 'Forever'"),
    (config(strategy="TimeSlicing", mpsConfig={}), "sharing.mpsConfig: cannot be used with the TimeSlicing"),
    (config(strategy="MPS", timeSlicingConfig={}), "sharing.timeSlicingConfig: cannot be used with the MPS"),
    (config(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 101}),
     "sharing.mpsConfig.defaultActiveThreadPercentage: expected a whole number from 1 to 100, got 101"),
    (config(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": "50"}),
     "sharing.mpsConfig.defaultActiveThreadPercentage"),
    (config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "10 GB"}),
     "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: expected a quantity such as 4Gi, got '10 GB'"),
    (config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "100Ki"}), "100Ki is less than 1Mi"),
    (config(strategy="MPS", mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"GPU-x": "1Gi"}}),
     "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.'GPU-x': expected a device index"),
    (config(strategy="MPS", mpsConfig={"threads": 5}), "sharing.mpsConfig.'threads': unknown field"),
    (config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "9" * 100}), "got '99999"),
])
def test_a_bad_field_is_one_line_naming_where_it_is(parameters: object, field: str) -> None:
    with pytest.raises(GpuConfigError) as refused:
        parse_gpu_config(parameters, WHERE, GROUP)
    message = refused.value.message
    assert message.startswith(f"{WHERE}: ") and field in message and "\n" not in message and len(message) < 300


def test_each_request_takes_the_last_config_naming_it() -> None:
    where = "claim default/c: status.allocation.devices"
    sliced = {"driver": GROUP, "parameters": config(strategy="TimeSlicing")}
    mps = {"driver": GROUP, "parameters": config(strategy="MPS")}
    configs = [{"source": "FromClass", "opaque": sliced},
               {"source": "FromClaim", "requests": ["b"], "opaque": mps},
               {"source": "FromClaim", "opaque": {"driver": "gpu.example.com", "parameters": {"any": 1}}}]
    shared = request_sharing(configs, GROUP, where, ["a", "b/sub", "c"])
    assert shared["a"].strategy == "TimeSlicing" and shared["c"].strategy == "TimeSlicing"
    assert shared["b/sub"].strategy == "MPS"  # a subrequest takes its request's config
    assert request_sharing([], GROUP, where, ["a"]) == {"a": EXCLUSIVE}  # no config: exclusive
    with pytest.raises(GpuConfigError, match=r"config\[0\]\.requests: expected a list"):
        request_sharing([{"requests": "a", "opaque": sliced}], GROUP, where, ["a"])
