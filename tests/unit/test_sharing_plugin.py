"""Time-slicing through the device plugin as plain rules (deviceplugin/sharing.py): NVIDIA's `sharing.timeSlicing`
config read with one line per bad field, replicas `<ID>::<k>`, a request's replicas on different devices (or
refused by failRequestsGreaterThanOne), the preferred allocation over the least-shared devices, one CDI device
per device in Allocate. Over gRPC with the kubelet's side: tests/integration/test_sharing_plugin.py."""

from __future__ import annotations

import pytest

from devinject.deviceplugin.allocation import AllocationError, PluginDevice, answer
from devinject.deviceplugin.sharing import (
    SharingConfig,
    SharingConfigError,
    TimeSliced,
    check_replicas,
    parse_sharing,
    preferred_replicas,
    replicated,
)
from devinject.discovery.topology import Place
from tests.unit.test_cli import run

SOURCE = "/etc/devinject/device-plugin.yaml"


def _gpus(count: int) -> dict[str, PluginDevice]:
    devices = {}
    for i in range(count):
        address = f"0000:{0x18 + i:02x}:00.0"
        devices[address] = PluginDevice(address, f"nvidia.com/gpu={i}", True, Place(address, (address,), i % 2, ""))
    return devices


def test_nvidia_shape_carries_over() -> None:
    config = parse_sharing({"timeSlicing": {"renameByDefault": True, "failRequestsGreaterThanOne": True,
                                            "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}, SOURCE)
    assert config == SharingConfig((TimeSliced("nvidia.com/gpu", 4),), True, True)
    assert config.served_as("nvidia.com/gpu", "nvidia.com/gpu") == "nvidia.com/gpu.shared"
    assert config.served_as("nvidia.com/rdma", "nvidia.com/rdma") == "nvidia.com/rdma"  # not time-sliced
    plain = parse_sharing({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}, SOURCE)
    assert plain.served_as("nvidia.com/gpu", "nvidia.com/gpu") == "nvidia.com/gpu"  # no rename asked for
    renamed = parse_sharing({"timeSlicing": {"renameByDefault": True, "resources": [
        {"name": "nvidia.com/gpu", "replicas": 2, "rename": "gpu-quarter"}]}}, SOURCE)
    assert renamed.served_as("nvidia.com/gpu", "nvidia.com/gpu") == "nvidia.com/gpu-quarter"  # a bare name
    assert parse_sharing({}, SOURCE) == SharingConfig()


@pytest.mark.parametrize(("section", "field"), [
    ("nope", "sharing: expected a mapping"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 0}]}},
     "sharing.timeSlicing.resources[0].replicas: expected a whole number from 1 to 1024, got 0"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": "4"}]}},
     "sharing.timeSlicing.resources[0].replicas"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": True}]}},
     "sharing.timeSlicing.resources[0].replicas"),
    ({"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2}]}},
     "sharing.timeSlicing.resources[0].name: expected a resource name domain/name"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "rename": "a b"}]}},
     "sharing.timeSlicing.resources[0].rename"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "replica": 3}]}},
     "sharing.timeSlicing.resources[0].replica: unknown field"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "devices": [0, 1]}]}},
     "sharing.timeSlicing.resources[0].devices: only 'all'"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2},
                                    {"name": "nvidia.com/gpu", "replicas": 3}]}},
     "sharing.timeSlicing.resources[1].name: nvidia.com/gpu is listed twice"),
    ({"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "rename": "nvidia.com/x"},
                                    {"name": "amd.com/gpu", "replicas": 2, "rename": "nvidia.com/x"}]}},
     "sharing.timeSlicing.resources[1]: served as nvidia.com/x"),
    ({"timeSlicing": {"renameByDefault": "yes"}}, "sharing.timeSlicing.renameByDefault: expected true or false"),
    ({"timeSlicing": {"failRequestsGreaterThanOne": 1}}, "sharing.timeSlicing.failRequestsGreaterThanOne"),
    ({"timeSlicing": {"resources": {"name": "nvidia.com/gpu"}}}, "sharing.timeSlicing.resources: expected a list"),
    ({"mps": {"resources": []}, "timeSlicing": {"resources": []}}, "sharing: timeSlicing and mps cannot both be set"),
    ({"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, "rename": 3}]}},
     "sharing.mps.resources[0].rename: expected a resource name"),
    ({"timeslicing": {}}, "sharing.timeslicing: unknown field"),
])
def test_a_bad_field_is_one_line_naming_the_file_and_field(section: object, field: str) -> None:
    with pytest.raises(SharingConfigError) as refused:
        parse_sharing(section, SOURCE)
    message = refused.value.message
    assert message.startswith(f"{SOURCE}: ") and field in message and "\n" not in message


def test_replicas_name_their_device_and_share_its_health() -> None:
    gpus = _gpus(2)
    gpus["0000:19:00.0"] = PluginDevice("0000:19:00.0", "nvidia.com/gpu=1", False, gpus["0000:19:00.0"].place)
    replicas = replicated(gpus, 3)
    assert sorted(replicas) == [f"0000:{b}:00.0::{k}" for b in ("18", "19") for k in range(3)]
    assert {r.parent for r in replicas.values()} == set(gpus)
    assert [r.healthy for i, r in sorted(replicas.items()) if i.startswith("0000:19")] == [False] * 3
    assert replicated(gpus, 3) == replicas  # the same IDs every time (a restart)


def test_a_request_gets_replicas_of_different_devices_or_is_refused() -> None:
    replicas = replicated(_gpus(2), 4)
    check_replicas(replicas, ["0000:18:00.0::0", "0000:19:00.0::3"], fail_greater_than_one=False)
    with pytest.raises(AllocationError, match="are one device"):
        check_replicas(replicas, ["0000:18:00.0::0", "0000:18:00.0::1"], fail_greater_than_one=False)
    with pytest.raises(AllocationError, match="failRequestsGreaterThanOne"):
        check_replicas(replicas, ["0000:18:00.0::0", "0000:19:00.0::3"], fail_greater_than_one=True)
    check_replicas(replicas, ["0000:18:00.0::2"], fail_greater_than_one=True)


def test_preferred_spreads_over_the_least_shared_devices() -> None:
    replicas = replicated(_gpus(3), 4)
    every = sorted(replicas)
    # GPU 18 has 3 replicas out, GPU 19 one, GPU 1a none: the least shared first, then the next
    available = [i for i in every if i not in {"0000:18:00.0::0", "0000:18:00.0::1", "0000:18:00.0::2",
                                                "0000:19:00.0::0"}]
    assert preferred_replicas(replicas, available, [], 1) == ["0000:1a:00.0::0"]
    assert preferred_replicas(replicas, available, [], 2) == ["0000:1a:00.0::0", "0000:19:00.0::1"]
    assert preferred_replicas(replicas, available, [], 3) == ["0000:1a:00.0::0", "0000:19:00.0::1",
                                                              "0000:18:00.0::3"]
    assert preferred_replicas(replicas, available, ["0000:19:00.0::2"], 2) == ["0000:19:00.0::2", "0000:1a:00.0::0"]
    # a device the other path holds comes last
    assert preferred_replicas(replicas, available, [], 1, avoid={"0000:1a:00.0"}) == ["0000:19:00.0::1"]
    # one replica after another spreads them: 3 GPUs x 4 replicas, taken one at a time, round-robin
    free, order = list(every), []
    for _ in range(6):
        pick = preferred_replicas(replicas, free, [], 1)[0]
        free.remove(pick)
        order.append(replicas[pick].parent)
    assert order == ["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"] * 2


def test_allocate_answers_a_device_once_for_its_replicas() -> None:
    from devinject.cdi.model import ContainerEdits, Device, DeviceNode, Spec

    spec = Spec(kind="nvidia.com/gpu", devices=(
        Device(name="0", edits=ContainerEdits(device_nodes=(DeviceNode(path="/dev/nvidia0"),))),))
    replicas = replicated(_gpus(1), 4)
    given = answer("nvidia.com/gpu.shared", spec, replicas, ["0000:18:00.0::1", "0000:18:00.0::2"])
    assert given.cdi_devices == ("nvidia.com/gpu=0",)
    assert [d[0] for d in given.devices] == ["/dev/nvidia0"]
    assert given.annotations == {"cdi.k8s.io/devinject_nvidia.com_gpu.shared": "nvidia.com/gpu=0"}


def test_the_config_file_takes_nvidias_sharing_and_names_a_bad_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from devinject import cli

    config = tmp_path / "dp.yaml"
    config.write_text("version: v1\ninterval: 7\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
                      "    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n")
    context = cli.cli.commands["device-plugin"].make_context("device-plugin", ["--config", str(config)])
    assert context.meta["devinject.sharing"].resources == (TimeSliced("nvidia.com/gpu", 4),)
    assert context.params["interval"] == 7.0
    config.write_text("sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: four\n")
    done = run("device-plugin", "--config", str(config))
    assert done.returncode == 2
    assert f"{config}: sharing.timeSlicing.resources[0].replicas: expected a whole number" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    config.write_text("version: v2\n")
    done = run("device-plugin", "--config", str(config))
    assert done.returncode == 2 and f"{config}: version: expected v1" in done.stderr


def test_the_configmaps_sharing_example_is_read_when_uncommented(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    import yaml

    from devinject import cli

    configmap = Path(__file__).parents[2] / "deploy" / "kubernetes" / "configmap.yaml"
    text = yaml.safe_load(configmap.read_text())["data"]["device-plugin.yaml"]
    head, sep, example = text.partition("# sharing:")
    assert sep, "the ConfigMap carries a sharing example"
    uncommented = "sharing:" + "".join(line.replace("# ", "", 1) + "\n" for line in example.splitlines())
    config = tmp_path / "dp.yaml"
    config.write_text(head + uncommented)
    context = cli.cli.commands["device-plugin"].make_context("device-plugin", ["--config", str(config)])
    sharing = context.meta["devinject.sharing"]
    assert sharing.served_as("nvidia.com/gpu", "nvidia.com/gpu") == "nvidia.com/gpu.shared"
    assert sharing.resources == (TimeSliced("nvidia.com/gpu", 4),)
