"""Publishing the node's ResourceSlices through the API server (dra/kubeapi.py): the slices of this driver and
node are listed, each pool's generation is bumped when its content changed, slices are created or replaced by
their stable names, and ones no pool needs any more are deleted."""

from __future__ import annotations

import json
import logging
from typing import Any

from devinject.core.errors import DevinjectError
from devinject.dra import kubeapi

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = kubeapi.REQUEST_TIMEOUT  # seconds per API call: a driver never blocks on a dead API server


class PublishError(DevinjectError):
    pass


def api_client(kubeconfig: str | None) -> kubeapi.Credentials:
    """The API server and credentials from --kubeconfig, else the pod's in-cluster service account, else
    ~/.kube/config."""
    try:
        return kubeapi.credentials(kubeconfig)
    except kubeapi.ApiError as err:
        raise PublishError(f"--kubeconfig {kubeconfig or '(in-cluster)'}: {err.message}") from None
    except OSError as err:
        raise PublishError(f"--kubeconfig {kubeconfig or '(in-cluster)'}: {err.strerror}") from None


def _untimed(devices: Any) -> Any:
    """The devices with their taints' timeAdded left out: the API server fills in one the driver leaves out,
    and a restarted driver's clock is not the first one's; neither is a change of the slice."""
    if not isinstance(devices, list):
        return devices
    out = []
    for device in devices:
        if isinstance(device, dict) and isinstance(device.get("taints"), list):
            device = {**device, "taints": [{k: v for k, v in t.items() if k != "timeAdded"} if isinstance(t, dict)
                                           else t for t in device["taints"]]}
        out.append(device)
    return out


def _content(item: dict[str, Any]) -> str:
    spec = dict(item.get("spec", {}))
    pool = dict(spec.get("pool", {}))
    pool.pop("generation", None)
    spec["pool"] = pool
    if "devices" in spec:
        spec["devices"] = _untimed(spec["devices"])
    return json.dumps(spec, sort_keys=True)


def keep_taint_times(item: dict[str, Any], old: dict[str, Any] | None) -> None:
    """A taint the published slice already carries keeps the timeAdded it has there (the same device, key,
    value and effect): a restart or an unrelated change does not make an old fault look new."""
    if old is None:
        return
    before = {(d.get("name"), t.get("key"), t.get("value", ""), t.get("effect")): t.get("timeAdded")
              for d in old.get("spec", {}).get("devices", []) or [] if isinstance(d, dict)
              for t in d.get("taints", []) or [] if isinstance(t, dict)}
    for device in item.get("spec", {}).get("devices", []):
        for taint in device.get("taints", []):
            since = before.get((device["name"], taint["key"], taint.get("value", ""), taint["effect"]))
            if isinstance(since, str):
                taint["timeAdded"] = since


class SlicePublisher:
    def __init__(self, client: kubeapi.Credentials | None, driver: str, node_name: str) -> None:
        self.api: Any = kubeapi.ResourceApi(client, REQUEST_TIMEOUT) if client is not None else None
        self.driver = driver
        self.node_name = node_name

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except kubeapi.ApiError as err:
            raise PublishError(f"{what}: {err.reason}") from None

    def existing(self) -> dict[str, dict[str, Any]]:
        selector = f"spec.nodeName={self.node_name},spec.driver={self.driver}"
        listed = self._call("list resourceslices", self.api.list_resource_slice, field_selector=selector)
        return {item["metadata"]["name"]: item for item in listed.get("items", [])}

    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]:
        """Make the API's slices of this node and driver `desired` (made at generation 1): pool -> the
        generation published."""
        have = self.existing()
        pools: dict[str, list[dict[str, Any]]] = {}
        for item in desired:
            pools.setdefault(item["spec"]["pool"]["name"], []).append(item)
        generations = {}
        for pool, items in pools.items():
            old = [s for s in have.values() if s["spec"]["pool"]["name"] == pool]
            current = max((int(s["spec"]["pool"].get("generation", 0)) for s in old), default=0)
            same = sorted(_content(s) for s in old) == sorted(_content(s) for s in items) and \
                {s["metadata"]["name"] for s in old} == {s["metadata"]["name"] for s in items}
            generation = current if same and current else current + 1
            generations[pool] = generation
            if same and current:
                continue
            for item in items:
                item["spec"]["pool"]["generation"] = generation
                name = item["metadata"]["name"]
                if name in have:
                    item["metadata"]["resourceVersion"] = have[name]["metadata"]["resourceVersion"]
                    keep_taint_times(item, have[name])
                    self._call(f"replace resourceslice {name}", self.api.replace_resource_slice, name, item)
                else:
                    self._call(f"create resourceslice {name}", self.api.create_resource_slice, item)
            log.info("published pool %s: generation %d, %d slice(s), %d device(s)", pool, generation, len(items),
                     sum(len(i["spec"].get("devices", [])) for i in items))
        wanted = {item["metadata"]["name"] for item in desired}
        for name in sorted(set(have) - wanted):
            self._call(f"delete resourceslice {name}", self.api.delete_resource_slice, name)
            log.info("deleted resourceslice %s (no device of its pool left)", name)
        return generations

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        from devinject.dra.claims import PrepareError

        try:
            return self._call(f"get resourceclaim {namespace}/{name}",  # type: ignore[no-any-return]
                              self.api.read_namespaced_resource_claim, name, namespace)
        except PublishError as err:
            raise PrepareError(err.message) from None

    def remove_all(self) -> None:
        for name in sorted(self.existing()):
            self._call(f"delete resourceslice {name}", self.api.delete_resource_slice, name)
