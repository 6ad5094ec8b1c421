"""Device metadata for workloads (KEP-5304: alpha in 1.36, beta in 1.37): per claim and request, the devices
the claim got there with their attributes (every attribute the slice publishes for them: the standard
`resource.kubernetes.io/` ones, PCI bus ID, PCIe root, NUMA node, and the driver's own: model, driver
version, ...), as a `DeviceMetadata` object (`metadata.resource.k8s.io/v1alpha1`) in a file of the driver's
own directory, written atomically, and mounted read-only into the claim's containers through the claim's CDI
spec at the path the Kubernetes documentation gives:

    /var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json
    /var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/<pod claim>/<request>/<driver>-metadata.json

(the second for a claim made from a template: the pod's name for it, the claim's
`resource.kubernetes.io/pod-claim-name` annotation). Removed at unprepare. Opt-in (`--device-metadata`)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from devinject.cdi.model import ContainerEdits, Mount, Spec
from devinject.core.atomicfile import replace as replace_file
from devinject.core.errors import DevinjectError

API_VERSION = "metadata.resource.k8s.io/v1alpha1"
KIND = "DeviceMetadata"
IN_CONTAINER = "/var/run/kubernetes.io/dra-device-attributes"
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"  # set by the claim controller on a template's claim
MOUNT_OPTIONS = ("ro", "rbind", "nosuid", "nodev", "noexec")
_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


class MetadataError(DevinjectError):
    pass


def _label(value: object) -> str | None:
    """A DNS label (a request's, a pod claim's name), or None: nothing else goes into a path."""
    if isinstance(value, str) and 0 < len(value) <= 63 and set(value) <= _LABEL_CHARS and \
            not value.startswith("-") and not value.endswith("-"):
        return value
    return None


def container_dir(claim: Mapping[str, object], name: str) -> str:
    """Where a claim's requests' files are in its containers: by the pod's name for a template's claim (its
    annotation, when a DNS label), else by the claim's own name."""
    meta = claim.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    pod_claim = _label(annotations.get(POD_CLAIM_NAME)) if isinstance(annotations, dict) else None
    if pod_claim is not None:
        return f"{IN_CONTAINER}/resourceclaimtemplates/{pod_claim}"
    return f"{IN_CONTAINER}/resourceclaims/{name}"


def document(claim: Mapping[str, object], namespace: str, name: str, uid: str, request: str,
             devices: Iterable[tuple[str, str, str, dict[str, object]]]) -> dict[str, object]:
    """One request's DeviceMetadata: `devices` as (driver, pool, device, attributes)."""
    meta = claim.get("metadata")
    generation = meta.get("generation") if isinstance(meta, dict) else None
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": uid,
                         **({"generation": generation} if isinstance(generation, int) else {})},
            "requests": [{"name": request, "devices": [
                {"name": device, "driver": driver, "pool": pool, "attributes": attributes}
                for driver, pool, device, attributes in devices]}]}


MetadataDevice = tuple[str, str, str, dict[str, object]]  # (driver, pool, device, its attributes)


class MetadataFile(NamedTuple):
    """One request's metadata file: its path on the host, its bytes, and its mount in the containers."""

    request: str
    path: str
    content: bytes
    mount: Mount


class MetadataFiles:
    """The claims' metadata files under `root` (`<kubelet plugins dir>/<driver>/dra-device-metadata`): one
    directory per claim, by its UID, one `<request>/metadata.json` per request."""

    def __init__(self, root: str, driver: str) -> None:
        self.root, self.driver = root, driver

    def claim_dir(self, uid: str) -> str:
        return os.path.join(self.root, uid)

    def planned(self, claim: Mapping[str, object], namespace: str, name: str, uid: str,
                requests: dict[str, list[MetadataDevice]]) -> tuple[MetadataFile, ...]:
        """Each request's file as it is to be written, and the mount that puts it in a container (nothing
        written: MetadataError for a request that is not a DNS label)."""
        inside = container_dir(claim, name)
        out = []
        for request, devices in sorted(requests.items()):
            label = _label(request)
            if label is None:
                raise MetadataError(f"claim {namespace}/{name}: request {request!r} is not a DNS label")
            path = os.path.join(self.claim_dir(uid), label, "metadata.json")
            text = json.dumps(document(claim, namespace, name, uid, request, devices), indent=2, sort_keys=True)
            out.append(MetadataFile(request, path, (text + "\n").encode(), Mount(
                host_path=path, container_path=f"{inside}/{label}/{self.driver}-metadata.json",
                options=MOUNT_OPTIONS)))
        return tuple(out)

    def write_files(self, uid: str, files: tuple[MetadataFile, ...], what: str) -> None:
        """The planned files written (atomically); a failure removes the claim's directory (`what`: the
        claim, for the message)."""
        try:
            for file in files:
                os.makedirs(os.path.dirname(file.path), mode=0o755, exist_ok=True)
                replace_file(file.path, file.content, 0o644, sync=False)
        except OSError as err:
            self.remove(uid)
            raise MetadataError(f"claim {what}: cannot write its device metadata in {self.claim_dir(uid)}: "
                                f"{err.strerror}") from None

    def write(self, claim: Mapping[str, object], namespace: str, name: str, uid: str,
              requests: dict[str, list[MetadataDevice]]) -> dict[str, Mount]:
        """Each request's file written (atomically); request -> the mount that puts it in a container."""
        files = self.planned(claim, namespace, name, uid, requests)
        self.write_files(uid, files, f"{namespace}/{name}")
        return {file.request: file.mount for file in files}

    def remove(self, uid: str) -> None:
        shutil.rmtree(self.claim_dir(uid), ignore_errors=True)

    def close(self) -> None:
        """At the driver's stop: its directory goes when no claim's files are left in it (an uninstall leaves
        nothing of devinject in the kubelet's plugin directory); a prepared claim's stay for the next driver."""
        try:
            os.rmdir(self.root)
        except OSError:
            pass  # not empty (claims prepared), or not made

    def orphans(self, known: Iterable[str]) -> list[str]:
        """The claim directories no prepared claim has (a crash mid-prepare), removed."""
        keep = set(known)
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return []
        gone = [n for n in names if n not in keep]
        for name in gone:
            self.remove(name)
        return gone


def with_mounts(spec: Spec, mounts: dict[int, Mount]) -> Spec:
    """The claim's spec with each mount in the edits of the device at its index (a request's first device:
    every container given the request gets it)."""
    return spec._replace(devices=tuple(
        device._replace(edits=device.edits.merge(ContainerEdits(mounts=(mounts[i],)))) if i in mounts else device
        for i, device in enumerate(spec.devices)))
