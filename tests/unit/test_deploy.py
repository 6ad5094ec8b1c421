"""deploy/kubernetes: every manifest is valid against the Kubernetes API schemas (kubernetes-validate, offline,
strict: unknown fields are errors), the kustomization holds them all, and the DaemonSet's command line and its
ConfigMap are ones devinject itself accepts. deploy/*.service and the unit `install-hook --server-unit` writes:
valid to systemd's own parser."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from devinject import cli

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted(p for p in (DEPLOY / "kubernetes").glob("*.yaml") if p.name != "kustomization.yaml")
INSTALLED = str(Path(sys.executable).parent / "devinject")
KUBERNETES_VERSION = "1.33.0"  # the oldest release we document; the schemas ship with kubernetes-validate
POD_UID = "0b7f8e7c-4444-4c1b-9a55-0000000000ff"  # a pod's metadata.uid, as the downward API gives it


def documents(path: Path) -> list[dict[str, object]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_would_catch_a_mistake() -> None:
    daemonset = documents(DEPLOY / "kubernetes" / "daemonset.yaml")[0]
    broken = yaml.safe_load(yaml.safe_dump(daemonset))
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privilged"] = False  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = documents(DEPLOY / "kubernetes" / "kustomization.yaml")[0]
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]  # type: ignore[call-overload]


def test_daemonset_runs_a_command_line_devinject_accepts(tmp_path: Path) -> None:
    daemonset = documents(DEPLOY / "kubernetes" / "daemonset.yaml")[0]
    pod = daemonset["spec"]["template"]["spec"]  # type: ignore[index]
    (container,) = pod["containers"]
    assert container["command"] == ["devinject"]
    configmap = documents(DEPLOY / "kubernetes" / "configmap.yaml")[0]
    config = tmp_path / "device-plugin.yaml"
    config.write_text(configmap["data"]["device-plugin.yaml"])  # type: ignore[index]
    args = [f"--config={config}" if a.startswith("--config=") else a for a in container["args"]]
    args = [a.replace("$(POD_UID)", POD_UID) for a in args]  # as the kubelet expands it
    assert args[0] == "device-plugin"
    command = cli.cli.commands["device-plugin"]
    params = command.make_context("device-plugin", args[1:]).params  # raises on any unknown option or value
    assert params["root"] == "/host" and params["target_root"] == "/"
    assert params["plugin_dir"] == "/var/lib/kubelet/device-plugins" and params["allocate"] == "both"
    assert params["metrics_address"].endswith(":9400") and params["pod_uid"] == POD_UID
    assert container["livenessProbe"]["httpGet"]["port"] == 9400
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/host", "/var/lib/kubelet/device-plugins", "/var/run/cdi", "/run/devinject"} <= mounted
    assert container["securityContext"]["privileged"] is False


# --- what the agent is granted: taking the pod over is root on the node (docs/hook.md), so it gets no more
# than each piece needs.

WRITTEN = {"/var/lib/kubelet/device-plugins", "/var/run/cdi", "/run/devinject"}  # plugin sockets, specs, health
RBAC = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


def _daemonset() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = documents(DEPLOY / "kubernetes" / "daemonset.yaml")[0]["spec"]["template"]["spec"]  # type: ignore[index]
    (container,) = pod["containers"]
    return pod, container


def test_the_agent_runs_with_no_capability_and_no_api_access() -> None:
    pod, container = _daemonset()
    security = container["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}  # nothing added back
    assert security["runAsUser"] == 0  # the spec directory must be root's (see the manifest's comment)
    seccomp = security.get("seccompProfile") or pod.get("securityContext", {}).get("seccompProfile")
    assert seccomp == {"type": "RuntimeDefault"}
    # the node's pids, for the ledger it shares with the DRA driver (what Allocate hands out is booked there)
    assert pod["hostPID"] is True and not pod.get("hostIPC")
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    (account,) = documents(DEPLOY / "kubernetes" / "serviceaccount.yaml")
    assert account["automountServiceAccountToken"] is False
    kinds = {doc["kind"] for path in MANIFESTS for doc in documents(path)}
    assert not kinds & (RBAC | {"Secret"}), kinds


def test_the_agent_writes_only_its_three_host_directories_and_reads_the_rest_all_the_way_down() -> None:
    pod, container = _daemonset()
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"] if m["name"] in host_paths}
    assert {path for path, m in mounts.items() if not m.get("readOnly")} == WRITTEN
    for path, mount in mounts.items():
        if path not in WRITTEN:  # a plain read-only bind leaves the host's submounts writable
            assert mount.get("recursiveReadOnly") in ("IfPossible", "Enabled"), path
            assert mount.get("mountPropagation", "None") == "None", path  # the API refuses it with the above
    # /proc/sys stays read-only on a runtime without recursive read-only mounts: /proc has a mount of its own
    assert host_paths[mounts["/host/proc"]["name"]] == "/proc" and mounts["/host/proc"]["readOnly"] is True
    assert {host_paths[mounts[p]["name"]] for p in ("/host", "/host/sys", "/host/dev")} == {"/", "/sys", "/dev"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def pod_annotations() -> dict[str, str]:
    daemonset = documents(DEPLOY / "kubernetes" / "daemonset.yaml")[0]
    return daemonset["spec"]["template"]["metadata"]["annotations"]  # type: ignore[index,no-any-return]


def test_the_endpoints_listen_on_the_nodes_address_from_the_downward_api() -> None:
    _, container = _daemonset()
    (address,) = [a.partition("=")[2] for a in container["args"] if a.startswith("--metrics-address=")]
    assert address == "$(NODE_IP):9400"  # not 0.0.0.0: not every interface
    # no port declared: a host-network pod's port is the node's, which a roll's surge pod could not have
    assert "ports" not in container and pod_annotations()["prometheus.io/port"] == "9400"
    (node_ip,) = [e for e in container["env"] if e["name"] == "NODE_IP"]
    assert node_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    # hostNetwork: the pod's IP, which the kubelet probes, is that address
    pod, _ = _daemonset()
    assert pod["hostNetwork"] is True and "host" not in container["livenessProbe"]["httpGet"]


# --- systemd units: checked by systemd's own parser (`systemd-analyze verify`), which also finds the programs
# they start; the shipped ones name /usr/local/bin/devinject, here pointed at this installation's.

def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    from tests.e2e.conftest import require

    require(shutil.which("systemd-analyze") is not None, "systemd-analyze not installed (make system-deps)")
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "SYSTEMD_LOG_COLOR": "0"})


@pytest.mark.parametrize("shipped", sorted(DEPLOY.glob("*.service")), ids=lambda p: p.name)
def test_shipped_unit_is_valid_systemd(shipped: Path, tmp_path: Path) -> None:
    unit = tmp_path / shipped.name
    unit.write_text(shipped.read_text().replace("/usr/local/bin/devinject", INSTALLED))
    done = _verify(unit)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_unit_validation_would_catch_a_mistake(tmp_path: Path) -> None:
    unit = tmp_path / "devinject-hook-server.service"
    text = (DEPLOY / unit.name).read_text().replace("/usr/local/bin/devinject", INSTALLED)
    unit.write_text(text.replace("Restart=on-failure", "Restart=on-faillure"))
    assert "Failed to parse service restart specifier" in _verify(unit).stderr
    unit.write_text(text.replace(INSTALLED, INSTALLED + "-absent"))
    assert _verify(unit).returncode != 0


def test_the_server_unit_install_hook_writes_is_valid_even_for_an_awkward_path(tmp_path: Path) -> None:
    """A program path with a blank, `%` (a systemd specifier) and `$` (a variable) must reach systemd
    whole: were it split or expanded, systemd would not find the program."""
    awkward = tmp_path / "dev inject %i $HOME"
    awkward.mkdir()
    (awkward / "devinject").symlink_to(INSTALLED)
    for executable in (None, str(awkward / "devinject")):
        units = tmp_path / ("default" if executable is None else "awkward")
        done = subprocess.run([INSTALLED, "install-hook", "--runc-snippet", "--server-unit", "--unit-dir", str(units),
                               *(["--executable", executable] if executable else [])],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        checked = _verify(units / "devinject-hook-server.service")
        assert checked.returncode == 0 and checked.stderr == "", checked.stderr


def test_the_node_hook_installer_is_held_to_the_agents_rules_and_writes_only_its_own_directory() -> None:
    """The specs' CDI hooks run on the host: an init container installs the agent's self-contained hook
    there (docs/node-hook.md), and the agent names that bundle, never a devinject the node may not have."""
    pod, container = _daemonset()
    (installer,) = pod["initContainers"]
    assert installer["image"] == container["image"] and installer["command"] == ["devinject"]
    assert installer["securityContext"] == container["securityContext"]
    args = installer["args"]
    params = cli.cli.commands[args[0]].make_context(args[0], args[1:]).params  # raises on an unknown option
    assert params["root"] == "/host" and params["directory"] == "/opt/devinject/hook"
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    written = {host_paths[m["name"]]: m["mountPath"] for m in installer["volumeMounts"] if not m.get("readOnly")}
    assert written == {"/opt/devinject": "/host/opt/devinject"}
    assert "--node-hook=/opt/devinject/hook" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--hook-path")]
