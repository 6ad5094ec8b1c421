"""The generated kubelet API modules are what `make proto` makes from the committed .proto, and they carry
the kubelet's own service and method names (what the kubelet dials)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "src" / "devinject" / "deviceplugin" / "api"


def test_generated_modules_match_the_proto(tmp_path: Path) -> None:
    target = tmp_path / "devinject" / "deviceplugin" / "api"
    target.mkdir(parents=True)
    shutil.copy(API / "v1beta1.proto", target)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(target / "v1beta1.proto")], check=True)
    for name in ("v1beta1_pb2.py", "v1beta1_pb2.pyi", "v1beta1_pb2_grpc.py"):
        assert (target / name).read_text() == (API / name).read_text(), f"{name} is stale: run `make proto`"


def test_the_kubelets_service_and_method_names() -> None:
    from devinject.deviceplugin.api import v1beta1_pb2 as api

    services = {s.full_name: [m.name for m in s.methods] for s in api.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
                                 "PreStartContainer"],
    }
    fields = {f.name: f.number for f in api.ContainerAllocateResponse.DESCRIPTOR.fields}
    assert fields == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
