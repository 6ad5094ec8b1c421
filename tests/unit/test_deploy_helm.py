"""deploy/helm/devinject, through Helm's own engine (helm-python-sdk binds Helm v4's Go SDK; no helm binary):
lint clean, every rendering valid against the Kubernetes API schemas (kubernetes-validate, strict), the
default rendering the same objects as deploy/kubernetes/ built by the real kustomize (`kubectl kustomize`),
values.schema.json refusing a misspelled key, and the agents' command lines and configs ones devinject
accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from devinject import cli
from tests.unit.test_deploy import POD_UID

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CHART = DEPLOY / "helm" / "devinject"
NAMESPACE = "devinject-system"
KUBERNETES_VERSION = "1.36.0"  # resource.k8s.io/v1 with extendedResourceName, as tests/unit/test_deploy_dra.py
OLDEST = "1.33.0"  # the oldest release we document: the device plugin alone runs there
HELM_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart")
# kustomize puts its namespace on some of these (v5.5 on a ValidatingAdmissionPolicy); the API server ignores it
CLUSTER_SCOPED = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DeviceClass", "ClusterRole",
                  "ClusterRoleBinding", "NodeFeatureRule"}
# what the agents' command lines pin (the chart's paths): a config key for one would be overridden unseen
PINNED = {"device-plugin": {"config", "host-root", "target-root", "output-dir", "state-dir", "plugin-dir", "node-hook",
                            "metrics-address", "kernel-log", "pod-uid"},
          "dra-driver": {"config", "host-root", "target-root", "output-dir", "state-dir", "plugin-dir", "registry-dir",
                         "node-hook", "metrics-address", "pod-uid"}}
# value sets every rendering of which must be valid Kubernetes
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "device-plugin-only": {"draDriver": {"enabled": False}},
    "dra-only": {"devicePlugin": {"enabled": False}},
    "everything-set": {
        "image": {"repository": "registry.example.com/devinject", "tag": "0.2.0", "pullPolicy": "Always"},
        "hostRoot": "/var/lib/fake/host", "stateDir": "/var/lib/fake/run/devinject",
        "extraArgs": {"devicePlugin": ["--rescan=30"], "draDriver": ["--kind=nvidia.com/gpu"]},
        "nodeSelector": {"gpu": "yes"}, "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"devicePlugin": {"requests": {"cpu": "50m"}}},
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "devicePlugin": {"config": {"allocate": "cdi", "sharing": {"timeSlicing": {"resources": [
            {"name": "nvidia.com/gpu", "replicas": 4}]}}}},
        "draDriver": {"config": {"health": "check", "fatal-taint-effect": "NoExecute",
                                 "consumable-capacity": "shares=4,memory=80Gi"}},
    },
    "no-selector-no-tolerations": {"nodeSelector": {}, "tolerations": []},
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        rendered = chart.render(values or {}, name="devinject", namespace=NAMESPACE, is_install=True)
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def kustomized(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (its kustomize builds deploy/kubernetes/) on PATH"
    built = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120,
                           check=False)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` without Helm's own labels (nor a namespace, cluster-scoped), and a ConfigMap's YAML files as what
    they hold (the shipped ones carry comments)."""
    doc = yaml.safe_load(yaml.safe_dump(doc))
    if doc["kind"] in CLUSTER_SCOPED:
        doc["metadata"].pop("namespace", None)
    for label in HELM_LABELS:
        doc["metadata"].get("labels", {}).pop(label, None)
    if doc["kind"] == "ConfigMap":
        doc["data"] = {k: yaml.safe_load(v) if k.endswith(".yaml") else v for k, v in doc["data"].items()}
    return doc


def key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def test_lint_is_clean() -> None:
    report = helm.lint(CHART, strict=True, namespace=NAMESPACE, kube_version="v1.36.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report  # info ("icon is recommended") only


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendering_is_valid_kubernetes(name: str) -> None:
    docs = render(VALUE_SETS[name])
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        if name == "device-plugin-only":
            kubernetes_validate.validate(doc, OLDEST, strict=True)


def test_validation_would_catch_a_mistake() -> None:
    daemonset = one(render(), "DaemonSet", "devinject")
    daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxSurg"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


def test_the_default_rendering_is_what_deploy_kubernetes_holds() -> None:
    """The two never drift: kustomize's objects (both bases; the Namespace aside, which `helm install
    --create-namespace` or the admin makes) are the chart's with its default values, Helm's labels aside."""
    shipped = {key(d): comparable(d) for base in (DEPLOY / "kubernetes", DEPLOY / "kubernetes" / "dra")
               for d in kustomized(base) if d["kind"] != "Namespace"}
    charted = {key(d): comparable(d) for d in render()}
    assert sorted(charted) == sorted(shipped)
    for name, doc in shipped.items():
        assert charted[name] == doc, name
    assert all(set(HELM_LABELS) <= set(d["metadata"]["labels"]) for d in render())


def test_the_node_feature_rule_is_the_shipped_one() -> None:
    assert not [d for d in render() if d["kind"] == "NodeFeatureRule"]  # NFD's CRD may not be there
    (rule,) = [d for d in render({"nodeFeatureRule": {"enabled": True}}) if d["kind"] == "NodeFeatureRule"]
    (shipped,) = yaml.safe_load_all((DEPLOY / "kubernetes" / "nfd" / "nodefeaturerule.yaml").read_text())
    assert comparable(rule) == shipped


@pytest.mark.parametrize("values", [
    {"hostroot": "/"},  # hostRoot
    {"image": {"tg": "1"}},
    {"devicePlugin": {"enabeld": True}},
    {"devicePlugin": {"config": {"intervall": 5}}},
    {"devicePlugin": {"config": {"state-dir": "/x"}}},  # pinned by the chart: would be overridden unseen
    {"draDriver": {"config": {"fatal-taint-effect": "NoExecut"}}},
    {"extraArgs": {"dra": ["--x"]}},
    {"updateStrategy": {"rollingUpdate": {"maxSurg": 1}}},
    {"resources": {"devicePlugin": {"request": {"cpu": "1"}}}},
    {"hostRoot": "relative/path"},
], ids=str)
def test_the_schema_refuses_a_misspelled_or_wrong_value(values: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema({})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(values)
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] or [m for m in report["messages"] if m["severity"] == 3], report


@pytest.mark.parametrize("command", ["device-plugin", "dra-driver"])
def test_the_schemas_config_keys_are_the_commands_options_the_chart_leaves_open(command: str) -> None:
    section = "devicePlugin" if command == "device-plugin" else "draDriver"
    with helm.Chart.load(CHART) as chart:
        schema = chart.schema
    assert schema is not None
    keys = set(schema["properties"][section]["properties"]["config"]["properties"])
    options = {opt.lstrip("-") for p in cli.cli.commands[command].params for opt in p.opts if opt.startswith("--")}
    extra = {"sharing", "version"} if command == "device-plugin" else set()  # NVIDIA's config shape
    assert keys - extra <= options - PINNED[command]
    assert not keys & PINNED[command]


def container_args(docs: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], list[str]]:
    pod = one(docs, "DaemonSet", name)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container["args"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_agents_run_command_lines_and_configs_devinject_accepts(name: str, tmp_path: Path) -> None:
    docs = render(VALUE_SETS[name])
    for daemonset, command, configmap in (("devinject", "device-plugin", "devinject-config"),
                                          ("devinject-dra", "dra-driver", "devinject-dra-config")):
        if not [d for d in docs if key(d) == ("DaemonSet", daemonset)]:
            assert not [d for d in docs if key(d) == ("ConfigMap", configmap)]
            continue
        _, args = container_args(docs, daemonset)
        ((file, text),) = one(docs, "ConfigMap", configmap)["data"].items()
        (tmp_path / file).write_text(text)
        args = [f"--config={tmp_path / file}" if a.startswith("--config=") else a for a in args]
        args = [a.replace("$(POD_UID)", POD_UID) for a in args]  # as the kubelet expands it
        assert args[0] == command
        # raises on an unknown option or value, in the file or on the line
        cli.cli.commands[command].make_context(command, args[1:], default_map={"node_name": "n"})


def test_host_root_moves_the_host_paths_and_the_specs_paths_and_nothing_else() -> None:
    default, moved = render(), render({"hostRoot": "/var/lib/fake/host/", "stateDir": "/var/lib/fake/run"})
    for name in ("devinject", "devinject-dra"):
        pod, args = container_args(default, name)
        moved_pod, moved_args = container_args(moved, name)
        paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        moved_paths = {v["name"]: v["hostPath"]["path"] for v in moved_pod["volumes"] if "hostPath" in v}
        changed = {n: moved_paths[n] for n in paths if moved_paths[n] != paths[n]}
        assert changed == {"host-root": "/var/lib/fake/host/", "proc": "/var/lib/fake/host/proc",
                           "sys": "/var/lib/fake/host/sys", "dev": "/var/lib/fake/host/dev",
                           "node-hook": "/var/lib/fake/host/opt/devinject", "state": "/var/lib/fake/run"}
        assert [a for a in moved_args if a not in args] == ["--target-root=/var/lib/fake/host/"]
        assert "--target-root=/" in args


def test_extra_args_come_last_and_win() -> None:
    docs = render({"extraArgs": {"devicePlugin": ["--rescan=30", "--kind=nvidia.com/gpu"],
                                 "draDriver": ["--threshold=5"]}})
    assert container_args(docs, "devinject")[1][-2:] == ["--rescan=30", "--kind=nvidia.com/gpu"]
    assert container_args(docs, "devinject-dra")[1][-1] == "--threshold=5"


def test_the_image_and_its_pull_policy_are_every_containers() -> None:
    docs = render({"image": {"repository": "registry.example.com/devinject", "tag": "9.9", "pullPolicy": "Always"}})
    for name in ("devinject", "devinject-dra"):
        pod = one(docs, "DaemonSet", name)["spec"]["template"]["spec"]
        containers = pod["initContainers"] + pod["containers"]
        assert {(c["image"], c["imagePullPolicy"]) for c in containers} == {
            ("registry.example.com/devinject:9.9", "Always")}
    with helm.Chart.load(CHART) as chart:
        version = chart.metadata["appVersion"]
    assert {c["image"] for c in one(render(), "DaemonSet", "devinject")["spec"]["template"]["spec"]["containers"]} \
        == {f"localhost/devinject:{version}"}


def test_the_slice_policy_names_the_release_namespaces_driver() -> None:
    with helm.Chart.load(CHART) as chart:
        docs = [d for text in chart.render({}, name="x", namespace="gpu-system").values()
                for d in yaml.safe_load_all(text) if d]
    policy = one(docs, "ValidatingAdmissionPolicy", "devinject-dra-node-slices")
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == 'request.userInfo.username == "system:serviceaccount:gpu-system:devinject-dra"'
    binding = one(docs, "ClusterRoleBinding", "devinject-dra")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "devinject-dra", "namespace": "gpu-system"}]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] in ("DaemonSet", "ConfigMap")} == {"gpu-system"}


def test_a_path_is_turned_off_whole() -> None:
    kinds = {d["kind"] for d in render({"draDriver": {"enabled": False}})}
    assert not kinds & {"DeviceClass", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy"}
    assert [key(d) for d in render({"devicePlugin": {"enabled": False}}) if d["metadata"]["name"] == "devinject"
            or d["metadata"]["name"] == "devinject-config"] == []


def test_the_default_roll_surges_and_nothing_of_the_old_pod_blocks_the_new_one() -> None:
    """maxSurge 1, maxUnavailable 0: a node's new agent starts beside the old one, which goes once the new one
    is ready. Before, both declared their metrics port in the host's network (a port on the node), so the
    surge pod stayed Pending ("didn't have free ports for the requested pod ports", seen live), and their
    sockets had fixed names. Now no port is declared, the sockets carry the pod's UID, and ready is the
    pod's own socket (the old pod still answers on the shared metrics port)."""
    for name in ("devinject", "devinject-dra"):
        daemonset = one(render(), "DaemonSet", name)
        pod = daemonset["spec"]["template"]["spec"]
        assert daemonset["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                                       "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
        (container,) = pod["containers"]
        assert not any(c.get("ports") for c in pod["containers"] + pod.get("initContainers", [])), name
        assert "--pod-uid=$(POD_UID)" in container["args"]
        (uid,) = [e for e in container["env"] if e["name"] == "POD_UID"]
        assert uid["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
        assert '"$POD_UID"' in container["readinessProbe"]["exec"]["command"][2], name
