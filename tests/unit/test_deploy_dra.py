"""deploy/kubernetes/dra: every manifest valid against the Kubernetes 1.36 API schemas (kubernetes-validate,
offline, strict), the kustomization holds them all, the DaemonSet runs a command line dra-driver accepts with
the kubelet's plugin directories, the RBAC is what the driver does, and the DeviceClasses select the kinds
and partitions dra/slices.py publishes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from devinject import cli
from devinject.discovery.node import Node
from devinject.dra.slices import DRIVER
from tests.unit.test_deploy import POD_UID

DRA = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "dra"
MANIFESTS = sorted(p for p in DRA.glob("*.yaml") if p.name != "kustomization.yaml")
KUBERNETES_VERSION = "1.36.0"  # resource.k8s.io/v1 with extendedResourceName


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in documents(path) if doc["kind"] == kind]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_would_catch_a_mistake() -> None:
    (deviceclass, *_) = by_kind("DeviceClass")
    broken = yaml.safe_load(yaml.safe_dump(deviceclass))
    broken["spec"]["selectors"][0]["cell"] = broken["spec"]["selectors"][0].pop("cel")  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = documents(DRA / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]


def dra_driver_params(args: list[str], tmp_path: Path) -> dict[str, Any]:
    """The DaemonSet's dra-driver command line as click parses it, its --config the shipped ConfigMap's file
    (written under tmp_path: the pod's mount is not here)."""
    (configmap,) = by_kind("ConfigMap")
    config = tmp_path / "dra-driver.yaml"
    config.write_text(configmap["data"]["dra-driver.yaml"])
    args = [f"--config={config}" if a.startswith("--config=") else a for a in args]
    args = [a.replace("$(POD_UID)", POD_UID) for a in args]  # as the kubelet expands it
    return dict(cli.cli.commands["dra-driver"].make_context("dra-driver", args[1:],
                                                             default_map={"node_name": "n"}).params)


def test_daemonset_runs_a_command_line_dra_driver_accepts(tmp_path: Path) -> None:
    (daemonset,) = by_kind("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert container["command"] == ["devinject"] and args[0] == "dra-driver"
    params = dra_driver_params(args, tmp_path)
    assert params["plugin_dir"] == "/var/lib/kubelet/plugins"
    assert params["registry_dir"] == "/var/lib/kubelet/plugins_registry"
    assert (params["root"], params["target_root"], params["cdi_dir"]) == ("/host", "/", "/var/run/cdi")
    (node_name,) = [e for e in container["env"] if e["name"] == "NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    written = {host_paths[m["name"]] for m in container["volumeMounts"]
               if m["name"] in host_paths and not m.get("readOnly")}
    assert written == {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi",
                       "/run/devinject"}
    assert pod["hostPID"] is True  # the ledger counts the node's pids
    # the node's health loop, as the device plugin's DaemonSet runs it: its own here, the kernel log under the
    # host root wherever the node keeps it (auto: the journal on a journald-only node, else kern.log), uevents
    # in the host's network namespace, NoSchedule unless the admin opts in
    assert (params["health_mode"], params["kernel_log"], params["uevents"]) == ("auto", "auto", True)
    assert params["fatal_taint_effect"] == "NoSchedule"
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    mounts = {m["mountPath"]: host_paths.get(m["name"]) for m in container["volumeMounts"]}
    assert mounts["/host"] == "/" and mounts["/host/sys"] == "/sys"
    # the node's journal dirs (/var/log/journal, and /run/log/journal on the host's /run submount) are read
    # through the host root, mounted read-only all the way down, with the image's journalctl
    (root_mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/host"]
    assert root_mount["readOnly"] is True and root_mount["recursiveReadOnly"] == "IfPossible"
    assert "systemd /usr/bin/journalctl" in (DRA.parents[1] / "image" / "files.txt").read_text()
    security = container["securityContext"]
    assert security["privileged"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert pod["serviceAccountName"] == "devinject-dra"


def test_rbac_is_what_the_driver_does() -> None:
    (role,) = by_kind("ClusterRole")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules == {(("resource.k8s.io",), ("resourceslices",)): {"list", "watch", "create", "update", "delete"},
                     (("resource.k8s.io",), ("resourceclaims",)): {"get"},
                     (("",), ("pods",)): {"list"},  # a PodGroup's pods on the node (dra/claims.py)
                     # status.devices (dra/claimstatus.py), its driver's entries on its node's claims alone
                     (("resource.k8s.io",), ("resourceclaims/status",)): {"patch"},
                     (("resource.k8s.io",), ("resourceclaims/driver",)): {"associated-node:patch"}}
    (driver_rule,) = [r for r in role["rules"] if r["resources"] == ["resourceclaims/driver"]]
    assert driver_rule["resourceNames"] == ["dra.devinject.io"]
    (binding,) = by_kind("ClusterRoleBinding")
    (account,) = by_kind("ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert not by_kind("Role") and not by_kind("Secret")


def test_a_device_class_per_kind_and_partition_the_driver_publishes() -> None:
    """Every kind (an IMEX channel's too: its class selects `type` `channel`, the attribute dra/slices.py gives
    a channel, and maps the device plugin's `nvidia.com/imex-channel`)."""
    profiles = Node("/", check=False).profiles
    kinds = {p.kind for p in profiles}
    channel_kinds = {p.kind for p in profiles if p.channels is not None}
    assert channel_kinds == {"nvidia.com/imex-channel"}
    selected = set()
    for deviceclass in by_kind("DeviceClass"):
        (selector,) = deviceclass["spec"]["selectors"]
        expression = selector["cel"]["expression"]
        assert f'device.driver == "{DRIVER}"' in expression
        (kind,) = re.findall(r'\.kind == "([^"]+)"', expression)
        selected.add(kind)
        if kind in channel_kinds:
            assert re.findall(r'\.type == "([^"]+)"', expression) == ["channel"] and ".partition" not in expression
            assert deviceclass["spec"]["extendedResourceName"] == kind
            continue
        (partition,) = re.findall(r'\.partition == "([^"]+)"', expression)
        assert partition in ("whole", "mig", "amd")
        if partition == "whole" and "extendedResourceName" in deviceclass["spec"]:
            assert deviceclass["spec"]["extendedResourceName"] == kind  # the device plugin's resource name
    assert selected == kinds


def test_the_channel_class_selects_exactly_the_published_channels() -> None:
    """The channel class's selector, read as the scheduler reads its two tests, against the DGX fixture's slices:
    its two channels, none of its GPUs (the attributes it tests are the ones published)."""
    from devinject.dra.slices import offers, resource_slices
    from tests.conftest import HOSTS

    (deviceclass,) = [d for d in by_kind("DeviceClass") if "imex-channel" in d["metadata"]["name"]]
    expression = deviceclass["spec"]["selectors"][0]["cel"]["expression"]
    tests = dict(re.findall(rf'device\.attributes\["{re.escape(DRIVER)}"\]\.(\w+) == "([^"]+)"', expression))
    assert set(tests) == {"kind", "type"}
    slices = resource_slices(DRIVER, "n", offers(Node(str(HOSTS / "dgx-a100-mig")), "n"))
    devices = [d for s in slices for d in s["spec"].get("devices", [])]
    chosen = [d["name"] for d in devices if all(d["attributes"].get(k) == {"string": v} for k, v in tests.items())]
    assert chosen == ["channel-0", "channel-1"]


def test_the_slice_admission_policy_names_the_drivers_service_account() -> None:
    """A policy matching another name than the driver's would hold nobody to its node, silently."""
    (policy,) = by_kind("ValidatingAdmissionPolicy")
    (binding,) = by_kind("ValidatingAdmissionPolicyBinding")
    (account,) = by_kind("ServiceAccount")
    (kustomization,) = documents(DRA / "kustomization.yaml")
    namespace = kustomization["namespace"]
    assert account["metadata"]["namespace"] == namespace
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == (f'request.userInfo.username == "system:serviceaccount:{namespace}:'
                                       f'{account["metadata"]["name"]}"')
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"


def test_daemonset_serves_the_drivers_metrics_on_the_pods_address(tmp_path: Path) -> None:
    (daemonset,) = by_kind("DaemonSet")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    params = dra_driver_params(container["args"], tmp_path)
    assert params["metrics_address"] == "$(POD_IP):9401"  # the kubelet expands it from the env below
    (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # no port declared: a host-network pod's port is the node's, which a roll's surge pod could not have
    assert "ports" not in container
    assert daemonset["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9401"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 9401}
    assert params["pod_uid"] == POD_UID
