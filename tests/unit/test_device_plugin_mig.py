"""The device plugin's MIG strategies (deviceplugin/migstrategy.py) on the DGX A100 fixture, whose GPU
0000:07:00.0 is split into two MIG devices (GIs 1 and 2, each `3g.40gb` in the stub libnvidia-ml built from
it) beside a whole GPU: `single` offers all three as nvidia.com/gpu (and warns, as NVIDIA's single strategy
refuses such a node), `mixed` offers the whole GPU as nvidia.com/gpu and the MIG devices as
nvidia.com/mig-3g.40gb with their own CDI names; without NVML's profiles, no per-profile resource and one
warning."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from devinject.agent.watch import WatchOptions
from devinject.deviceplugin.agent import DevicePluginAgent, PluginOptions, endpoint_for
from devinject.deviceplugin.allocation import answer
from devinject.deviceplugin.migstrategy import (
    MIXED,
    SINGLE,
    kind_of,
    mig_resource,
    offer_keys,
    profile_key,
    profile_of,
    single_mismatch,
)
from devinject.discovery import nvml
from devinject.discovery.nvml import GpuFacts, MigFacts
from devinject.discovery.partitions import Partition
from devinject.specs.generate import GenerateOptions

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-3g.40gb"
MIG_IDS = ["0000:07:00.0-gi1-ci0", "0000:07:00.0-gi2-ci0"]
WHOLE = "0000:87:00.0"


def options(root: Path, state: Path, plugin_dir: Path, strategy: str) -> PluginOptions:
    gen = GenerateOptions(root=str(root), hook_path="/usr/bin/devinject", kinds=(GPU,), nvml=True)
    watch = WatchOptions(generate=gen, output_dir=state / "cdi", state_dir=str(state / "state"), interval=0.1,
                         recheck=0.05, threshold=2, rescan=3600, uevents=False, probe_timeout=1.0)
    return PluginOptions(watch=watch, plugin_dir=str(plugin_dir), kubelet_poll=0.2, mig_strategy=strategy)


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "_warned", set())


def one_round(root: Path, state: Path, plugin_dir: Path, strategy: str) -> DevicePluginAgent:
    agent = DevicePluginAgent(options(root, state, plugin_dir, strategy))
    agent.watcher.rescan()
    agent.watcher.check()
    agent.watcher.write()  # its listener publishes the round to the resources
    return agent


def served(agent: DevicePluginAgent) -> dict[str, dict[str, str]]:
    """resource -> device ID -> CDI name, as the kubelet is offered them."""
    return {s.resource: {i: d.cdi_name for i, d in s.devices.items()} for s in agent.states.values()}


def test_mixed_offers_one_resource_per_profile_with_its_cdi_names(nvml_host, tmp_path, plugin_dir) -> None:  # type: ignore[no-untyped-def]
    root = nvml_host("dgx-a100-mig")
    agent = one_round(root, tmp_path, plugin_dir, MIXED)
    assert served(agent) == {GPU: {WHOLE: f"{GPU}=1"},
                             MIG: {MIG_IDS[0]: f"{GPU}=0:0", MIG_IDS[1]: f"{GPU}=0:1"}}
    state = agent.states[profile_key(GPU, "3g.40gb")]
    assert state.kind == profile_key(GPU, "3g.40gb") and state.spec is not None and state.spec.kind == GPU
    assert endpoint_for(state.resource) == "devinject-nvidia.com-mig-3g.40gb.sock"
    given = answer(state.resource, state.spec, state.devices, [MIG_IDS[1]])
    assert given.cdi_devices == (f"{GPU}=0:1",)
    assert given.annotations == {"cdi.k8s.io/devinject_nvidia.com_mig-3g.40gb": f"{GPU}=0:1"}
    paths = [host for _, host, _ in given.devices]
    assert f"{root}/dev/nvidia0" in paths and any("nvidia-caps" in p for p in paths)  # the GPU and its caps
    # the MIG devices share their GPU's node, as the ledger books them (with the DRA driver's MIG devices)
    mig = state.devices[MIG_IDS[0]]
    assert mig.nodes[0] in mig.shared
    with pytest.raises(Exception, match="unknown device ID"):  # the whole GPU is not the profile's
        answer(state.resource, state.spec, state.devices, [WHOLE])


def test_single_offers_every_mig_device_as_the_kind_and_says_what_nvidia_refuses(  # type: ignore[no-untyped-def]
        nvml_host, tmp_path, plugin_dir, caplog) -> None:
    root = nvml_host("dgx-a100-mig")
    with caplog.at_level(logging.WARNING):
        agent = one_round(root, tmp_path, plugin_dir, SINGLE)
    assert served(agent) == {GPU: {WHOLE: f"{GPU}=1", MIG_IDS[0]: f"{GPU}=0:0", MIG_IDS[1]: f"{GPU}=0:1"}}
    said = [r.getMessage() for r in caplog.records if "--mig-strategy single" in r.getMessage()]
    assert said == [f"{GPU}: 2 MIG devices and 1 whole GPUs are all offered as {GPU} "
                    "(--mig-strategy single; mixed offers one resource per MIG profile)"]


def test_mixed_without_nvml_offers_no_profile_resource_and_warns_once(host_copy, tmp_path, plugin_dir,  # type: ignore[no-untyped-def]
                                                                     caplog) -> None:
    root = host_copy("dgx-a100-mig")  # no libnvidia-ml that answers
    with caplog.at_level(logging.WARNING):
        agent = one_round(root, tmp_path, plugin_dir, MIXED)
        agent.watcher.rescan()
        agent.watcher.check()
        agent.watcher.write()
    assert served(agent) == {GPU: {WHOLE: f"{GPU}=1"}}
    said = [r.getMessage() for r in caplog.records if "--mig-strategy mixed" in r.getMessage()]
    assert said == [f"{GPU} 0000:07:00.0: NVML gives no profile for 2 of its MIG devices (no NVML facts: --nvml, "
                    "the driver root's libnvidia-ml); under --mig-strategy mixed they are not offered"]


def _part(gi: int, kind: str = "mig") -> Partition:
    return Partition(kind, f"0:{gi}", gi, 0, ())


def test_keys_names_and_the_single_check() -> None:
    gpu = GpuFacts("0000:07:00.0", mig_devices=(MigFacts(1, 0, profile="1g.10gb"), MigFacts(2, 0, profile="3g.40gb")))
    parts = [_part(1), _part(2), _part(3)]  # GI 3: a MIG device NVML did not list
    assert offer_keys(MIXED, GPU, parts, gpu) == [profile_key(GPU, "1g.10gb"), profile_key(GPU, "3g.40gb"), None]
    assert offer_keys(SINGLE, GPU, parts, gpu) == [GPU] * 3
    assert offer_keys(MIXED, GPU, [], None) == [GPU]  # a whole GPU
    assert offer_keys(MIXED, "amd.com/gpu", [_part(0, "amd"), _part(1, "amd")], None) == ["amd.com/gpu"] * 2
    key = profile_key(GPU, "1g.10gb")
    assert (kind_of(key), profile_of(key), profile_of(GPU), kind_of(GPU)) == (GPU, "1g.10gb", None, GPU)
    assert mig_resource(GPU, "1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert single_mismatch(GPU, 0, ["3g.40gb", "3g.40gb"]) is None
    assert single_mismatch(GPU, 4, []) is None
    assert "profiles 1g.10gb, 3g.40gb" in (single_mismatch(GPU, 0, ["3g.40gb", "1g.10gb"]) or "")
    assert "2 MIG devices and 1 whole GPUs" in (single_mismatch(GPU, 1, [None, None]) or "")


def test_the_cli_refuses_mixed_with_sharing_and_an_unknown_strategy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from tests.conftest import HOSTS

    config = tmp_path / "dp.yaml"
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
                      "      replicas: 2\n")
    base = [sys.executable, "-m", "devinject", "device-plugin", "--root", str(HOSTS / "dgx-a100-mig"),
            "--plugin-dir", str(tmp_path), "--state-dir", str(tmp_path / "state"), "--output-dir",
            str(tmp_path / "cdi"), "--no-uevents", "--metrics-address", ""]
    done = subprocess.run([*base, "--config", str(config), "--mig-strategy", "mixed"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "devinject: error: --mig-strategy mixed: not with a sharing: section (time-slicing or MPS of "
        "nvidia.com/gpu); use single"]
    done = subprocess.run([*base, "--mig-strategy", "none"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "'none' is not one of 'single', 'mixed'" in done.stderr


def test_resource_name_renames_the_whole_gpus_resource_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    opts = replace(options(tmp_path, tmp_path, tmp_path, MIXED), resource_names={GPU: "example.com/gpu"})
    assert opts.resource_of(GPU) == "example.com/gpu"
    assert opts.resource_of(profile_key(GPU, "1g.10gb")) == "nvidia.com/mig-1g.10gb"
    assert opts.time_sliced(profile_key(GPU, "1g.10gb")) is None


def test_a_profile_no_resource_name_can_take_is_not_offered_under_mixed(caplog) -> None:  # type: ignore[no-untyped-def]
    """NVML names media-extension profiles `1g.10gb+me` (A100, H100): `nvidia.com/mig-1g.10gb+me` is no
    extended resource name (the kubelet refuses the registration, and with it the profile's every device), so
    such a MIG device is left out, said once, while the node's other profiles are served."""
    from devinject.deviceplugin.migstrategy import unnameable_profiles

    gpu = GpuFacts("0000:07:00.0", mig_devices=(MigFacts(1, 0, profile="1g.10gb+me"), MigFacts(2, 0, profile="3g.40gb"),
                                                 MigFacts(3, 0, profile="1g.10gb é")))
    parts = [_part(1), _part(2), _part(3)]
    assert offer_keys(MIXED, GPU, parts, gpu) == [None, profile_key(GPU, "3g.40gb"), None]
    assert unnameable_profiles(parts, gpu) == ["1g.10gb é", "1g.10gb+me"]
    assert offer_keys(SINGLE, GPU, parts, gpu) == [GPU] * 3  # single names no profile: all of them offered


def test_the_agent_serves_the_nameable_profiles_and_says_which_it_left_out(host_copy, tmp_path, plugin_dir,  # type: ignore[no-untyped-def]
                                                                          monkeypatch, caplog) -> None:
    from devinject.discovery.node import Node

    facts = GpuFacts("0000:07:00.0", mig_devices=(MigFacts(1, 0, profile="1g.10gb+me"),
                                                   MigFacts(2, 0, profile="3g.40gb")))
    monkeypatch.setattr(Node, "gpu_facts", lambda self, found: facts if found.address == "0000:07:00.0" else None)
    with caplog.at_level(logging.WARNING):
        agent = one_round(host_copy("dgx-a100-mig"), tmp_path, plugin_dir, MIXED)
        agent.watcher.rescan()
        agent.watcher.check()
        agent.watcher.write()
    assert served(agent) == {GPU: {WHOLE: f"{GPU}=1"}, MIG: {MIG_IDS[1]: f"{GPU}=0:1"}}
    said = [r.getMessage() for r in caplog.records if "--mig-strategy mixed" in r.getMessage()]
    assert said == [f"{GPU} 0000:07:00.0: MIG profile 1g.10gb+me is no resource name (nvidia.com/mig-1g.10gb+me); "
                    "under --mig-strategy mixed its MIG devices are not offered"]


def test_mixed_refuses_a_resource_name_a_profiles_resource_has(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--resource-name nvidia.com/gpu=nvidia.com/mig-3g.40gb under mixed would register the whole GPUs and the
    3g.40gb MIG devices as one resource from two sockets: the kubelet keeps the later registration, and one set
    of devices silently goes. Refused, as sharing's two entries under one name are."""
    from dataclasses import replace

    from devinject.core.errors import UsageError

    base = options(tmp_path, tmp_path, tmp_path, SINGLE)
    assert replace(base, resource_names={GPU: MIG}).resource_of(GPU) == MIG  # single: no profile's resource
    with pytest.raises(UsageError, match=r"^--resource-name nvidia.com/gpu=nvidia.com/mig-3g.40gb: under "
                                         r"--mig-strategy mixed a MIG profile's resource is named so"):
        replace(base, resource_names={GPU: MIG}, mig_strategy=MIXED)
    assert replace(base, resource_names={GPU: "example.com/gpu"}, mig_strategy=MIXED).resource_of(GPU) == \
        "example.com/gpu"
