"""The generated DRA API modules are what `make proto` makes from the committed .proto files, and they carry
the kubelet's own packages, services, methods and field numbers (what the kubelet dials and decodes)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[2] / "src" / "devinject" / "dra" / "api"
PROTOS = ("dra_v1", "pluginregistration_v1", "health_v1", "health_v1alpha1")


@pytest.mark.parametrize("proto", PROTOS)
def test_generated_modules_match_the_proto(tmp_path: Path, proto: str) -> None:
    target = tmp_path / "devinject" / "dra" / "api"
    target.mkdir(parents=True)
    shutil.copy(API / f"{proto}.proto", target)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(target / f"{proto}.proto")],
                   check=True)
    for name in (f"{proto}_pb2.py", f"{proto}_pb2.pyi", f"{proto}_pb2_grpc.py"):
        assert (target / name).read_text() == (API / name).read_text(), f"{name} is stale: run `make proto`"


def _services(module: object) -> dict[str, list[str]]:
    descriptor = module.DESCRIPTOR  # type: ignore[attr-defined]
    return {s.full_name: [m.name for m in s.methods] for s in descriptor.services_by_name.values()}


def _fields(message: object) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_the_kubelets_dra_service() -> None:
    from devinject.dra.api import dra_v1_pb2 as api

    assert _services(api) == {"k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": ["NodePrepareResources",
                                                                          "NodeUnprepareResources"]}
    assert _fields(api.Claim) == {"namespace": 1, "uid": 2, "name": 3}
    # share_id: DRAConsumableCapacity's share (kubelet 1.36: `protobuf:"bytes,5,opt,name=share_id,...,oneof"`)
    assert _fields(api.Device) == {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4,
                                   "share_id": 5}
    assert _fields(api.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
    assert _fields(api.NodeUnprepareResourceResponse) == {"error": 1}
    assert _fields(api.NodePrepareResourcesResponse) == {"claims": 1}


def test_the_kubelets_registration_service() -> None:
    from devinject.dra.api import pluginregistration_v1_pb2 as api

    assert _services(api) == {"pluginregistration.Registration": ["GetInfo", "NotifyRegistrationStatus"]}
    assert _fields(api.PluginInfo) == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert _fields(api.RegistrationStatus) == {"plugin_registered": 1, "error": 2}


def test_the_kubelets_health_services() -> None:
    """v1 (1.37) and v1alpha1 carry the same released messages, fields 4 and 5 included; no v1beta1 was ever
    released."""
    from devinject.dra.api import health_v1_pb2 as v1
    from devinject.dra.api import health_v1alpha1_pb2 as alpha

    assert _services(v1) == {"v1.DRAResourceHealth": ["NodeWatchResources"]}
    assert _services(alpha) == {"v1alpha1.DRAResourceHealth": ["NodeWatchResources"]}
    for api in (v1, alpha):
        assert _fields(api.DeviceHealth) == {"device": 1, "health": 2, "last_updated_time": 3,
                                             "health_check_timeout_seconds": 4, "message": 5}
        assert _fields(api.DeviceIdentifier) == {"pool_name": 1, "device_name": 2}
        assert _fields(api.NodeWatchResourcesResponse) == {"devices": 1}
        assert dict(api.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    assert not list(API.glob("*v1beta1*")), "v1beta1 of the health API was never released"
