"""KEP-5304's device metadata (dra/devicemetadata.py, `--device-metadata`): a claim prepared with it on has a
metadata.json per request (the request's devices with every attribute the slice publishes for them),
written under the kubelet's plugin dir and mounted read-only through the claim's CDI spec at the documented
path in the container; unprepared, the files go; off, nothing is written or mounted. Before, a workload on
devinject could not learn which GPU and NIC it got without asking the API server."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from devinject.dra.devicemetadata import container_dir
from devinject.dra.driver import DraDriver
from tests.integration.test_dra_driver import GPU_POOL, NIC_POOL, FakeApi, make_driver
from tests.unit.test_dra_claims import dirs

__all__ = ["dirs"]  # test_dra_claims' fixture

DRIVER = "dra.devinject.io"
UID = "0b7f8e7c-6666-4c1b-9a55-000000000001"
GPU, NIC = "gpu-0000-18-00-0", "rdma-0000-19-00-0"
INSIDE = "/var/run/kubernetes.io/dra-device-attributes"


def two_requests(api: FakeApi, annotations: dict[str, str] | None = None) -> None:
    """A claim `pair` with a request `gpu` and a request `nic`, allocated on the fixture's co-located pair."""
    api.add("pair", UID, [])
    claim = api.claims[("default", "pair")]
    claim["metadata"]["generation"] = 3
    if annotations:
        claim["metadata"]["annotations"] = annotations
    claim["status"]["allocation"]["devices"]["results"] = [
        {"request": "gpu", "driver": DRIVER, "pool": GPU_POOL, "device": GPU},
        {"request": "nic", "driver": DRIVER, "pool": NIC_POOL, "device": NIC}]


def metadata_driver(dirs: dict[str, str], api: FakeApi, on: bool = True) -> DraDriver:
    made = make_driver(dirs, api)
    return DraDriver(replace(made.opts, device_metadata=on), api)


def spec_of(dirs: dict[str, str]) -> dict[str, Any]:
    return json.loads(Path(dirs["cdi"], f"{DRIVER}-{UID}.json").read_text())  # type: ignore[no-any-return]


def test_where_the_files_are_in_the_container() -> None:
    assert container_dir({"metadata": {}}, "pair") == f"{INSIDE}/resourceclaims/pair"
    template = {"metadata": {"annotations": {"resource.kubernetes.io/pod-claim-name": "devices"}}}
    assert container_dir(template, "pod-devices-x7k2") == f"{INSIDE}/resourceclaimtemplates/devices"
    hostile = {"metadata": {"annotations": {"resource.kubernetes.io/pod-claim-name": "../../etc"}}}
    assert container_dir(hostile, "pair") == f"{INSIDE}/resourceclaims/pair"  # a name that is not a label: unused


def test_each_request_gets_its_devices_and_attributes_mounted_read_only(dirs: dict[str, str]) -> None:
    api = FakeApi()
    two_requests(api)
    driver = metadata_driver(dirs, api)
    driver.preparer.prepare("default", "pair", UID)
    root = Path(dirs["plugins"], DRIVER, "dra-device-metadata", UID)
    gpu = json.loads((root / "gpu" / "metadata.json").read_text())
    assert (gpu["apiVersion"], gpu["kind"]) == ("metadata.resource.k8s.io/v1alpha1", "DeviceMetadata")
    assert gpu["metadata"] == {"name": "pair", "namespace": "default", "uid": UID, "generation": 3}
    ((request,),) = [gpu["requests"]]
    (device,) = request["devices"]
    assert (request["name"], device["name"], device["driver"], device["pool"]) == ("gpu", GPU, DRIVER, GPU_POOL)
    attributes = device["attributes"]
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    assert attributes["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:12"}
    assert attributes["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert attributes["model"] == {"string": "NVIDIA H100 80GB HBM3"}
    published = {d["name"]: d for s in driver.desired() for d in s["spec"].get("devices", [])}
    assert attributes == published[GPU]["attributes"]  # every attribute the slice publishes
    nic = json.loads((root / "nic" / "metadata.json").read_text())
    assert nic["requests"][0]["devices"][0]["attributes"]["model"] == {"string": "ConnectX-7"}
    mounts = {d["name"]: d["containerEdits"].get("mounts", []) for d in spec_of(dirs)["devices"]}
    assert mounts[f"{UID}-{GPU}"] == [{"hostPath": str(root / "gpu" / "metadata.json"),
                                       "containerPath": f"{INSIDE}/resourceclaims/pair/gpu/{DRIVER}-metadata.json",
                                       "options": ["ro", "rbind", "nosuid", "nodev", "noexec"]}]
    assert mounts[f"{UID}-{NIC}"][0]["containerPath"] == f"{INSIDE}/resourceclaims/pair/nic/{DRIVER}-metadata.json"
    assert oct(os.stat(root / "gpu" / "metadata.json").st_mode & 0o777) == "0o644"
    driver.preparer.unprepare(UID)
    assert not root.exists()


def test_a_template_claim_is_found_under_the_pods_name_for_it(dirs: dict[str, str]) -> None:
    api = FakeApi()
    two_requests(api, {"resource.kubernetes.io/pod-claim-name": "devices"})
    metadata_driver(dirs, api).preparer.prepare("default", "pair", UID)
    paths = {m["containerPath"] for d in spec_of(dirs)["devices"] for m in d["containerEdits"].get("mounts", [])}
    assert paths == {f"{INSIDE}/resourceclaimtemplates/devices/{r}/{DRIVER}-metadata.json" for r in ("gpu", "nic")}


def test_off_nothing_is_written_or_mounted_and_a_crash_leaves_nothing_after_a_start(
        dirs: dict[str, str]) -> None:
    api = FakeApi()
    two_requests(api)
    metadata_driver(dirs, api, on=False).preparer.prepare("default", "pair", UID)
    assert not Path(dirs["plugins"], DRIVER, "dra-device-metadata").exists()
    assert not any(d["containerEdits"].get("mounts") for d in spec_of(dirs)["devices"])
    stray = Path(dirs["plugins"], DRIVER, "dra-device-metadata", "0b7f8e7c-7777-4c1b-9a55-000000000001", "gpu")
    stray.mkdir(parents=True)
    (stray / "metadata.json").write_text("{}")
    assert "0b7f8e7c-7777-4c1b-9a55-000000000001" in metadata_driver(dirs, api).preparer.clean_orphans()
    assert not stray.parent.exists()


@pytest.mark.parametrize("request_name", ["GPU", "a" * 64])
def test_a_request_name_that_is_no_label_is_the_claims_error_and_nothing_is_left(
        dirs: dict[str, str], request_name: str) -> None:
    from devinject.core.errors import DevinjectError

    api = FakeApi()
    two_requests(api)
    api.claims[("default", "pair")]["status"]["allocation"]["devices"]["results"][0]["request"] = request_name
    with pytest.raises(DevinjectError, match=f"claim default/pair: request '{request_name}' is not a DNS label"):
        metadata_driver(dirs, api).preparer.prepare("default", "pair", UID)
    assert not Path(dirs["plugins"], DRIVER, "dra-device-metadata", UID).exists()
    assert not Path(dirs["cdi"], f"{DRIVER}-{UID}.json").exists()


def test_the_driver_stopped_leaves_no_metadata_dir_once_its_claims_are_unprepared(dirs: dict[str, str]) -> None:
    """An uninstall left `dra-device-metadata/` in the kubelet's plugin directory after the last claim was
    unprepared (the chart's live uninstall test found it); a prepared claim's files stay for the next driver."""
    import threading

    api = FakeApi()
    two_requests(api)
    root = Path(dirs["plugins"], DRIVER, "dra-device-metadata")

    def run_and_stop(driver: DraDriver) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=driver.run, args=(stop,), daemon=True)
        thread.start()
        time.sleep(0.5)
        stop.set()
        driver.wake.set()
        thread.join(30)
        assert not thread.is_alive()

    driver = metadata_driver(dirs, api)
    driver.preparer.prepare("default", "pair", UID)
    run_and_stop(driver)
    assert (root / UID / "gpu" / "metadata.json").exists()  # prepared: kept
    driver = metadata_driver(dirs, api)
    driver.preparer.unprepare(UID)
    run_and_stop(driver)
    assert not root.exists()
