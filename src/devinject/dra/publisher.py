"""Publishing the node's ResourceSlices through the API server (dra/kubeapi.py): each pool's generation is
bumped when its content changed, slices are created or replaced by their stable names, and ones no pool needs
any more are deleted.

What is compared is the API's copy, never the driver's memory: with `watch`, a watch of this node's and
driver's slices (a list, then a watch from its resourceVersion, bookmarks keeping it current, started again
where it ended) keeps a copy of them, and a slice someone else deleted or edited is put back at once; an idle
node costs the API server that one watch, no polling. Without a watch (or while it is down) each publish
lists them first. A write refused as stale (409) or aimed at a slice gone meanwhile (404) is done again once
on a fresh list. While the API server is away publishing fails (the driver tries again every rescan) and the
watch backs off; when it is back, the watch lists again and publishes what is missing.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from typing import Any

from devinject.core.errors import DevinjectError
from devinject.dra import kubeapi

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = kubeapi.REQUEST_TIMEOUT  # seconds per API call: a driver never blocks on a dead API server
PUBLISH_BUDGET = 5.0  # seconds a slice call may take with its retries: then the rescan or the watch tries again
CLAIM_BUDGET = 15.0  # seconds a claim's read may take with its retries (the kubelet's call has its own deadline)
WATCH_BACKOFF_CAP = 30.0


class PublishError(DevinjectError):
    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def api_client(kubeconfig: str | None) -> kubeapi.Credentials:
    """The API server and credentials from --kubeconfig, else $KUBECONFIG, else the pod's in-cluster service
    account, else ~/.kube/config."""
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


def _copy(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return json.loads(json.dumps(items))  # type: ignore[no-any-return]


class SlicePublisher:
    def __init__(self, client: kubeapi.Credentials | None, driver: str, node_name: str,
                 watch: bool = False) -> None:
        self.api: Any = kubeapi.ResourceApi(client, REQUEST_TIMEOUT, PUBLISH_BUDGET) if client is not None else None
        self.driver = driver
        self.node_name = node_name
        self.selector = f"spec.nodeName={node_name},spec.driver={driver}"
        self.lock = threading.RLock()
        self.cache: dict[str, dict[str, Any]] | None = None  # the API's slices as the watch saw them last
        self.desired: list[dict[str, Any]] | None = None
        self.generations: dict[str, int] = {}  # pool -> the generation published last
        self.watching = watch
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except kubeapi.ApiError as err:
            raise PublishError(f"{what}: {err.reason}", err.status) from None

    def _list(self) -> dict[str, Any]:
        return self._call("list resourceslices", self.api.list_resource_slice,  # type: ignore[no-any-return]
                          field_selector=self.selector)

    def existing(self) -> dict[str, dict[str, Any]]:
        """The API's slices of this node and driver: the watch's copy when it has one, else a list."""
        with self.lock:
            if self.cache is not None:
                return dict(self.cache)
        return {item["metadata"]["name"]: item for item in self._list().get("items", [])}

    def publish(self, desired: list[dict[str, Any]]) -> dict[str, int]:
        """Make the API's slices of this node and driver `desired` (made at generation 1): pool -> the
        generation published."""
        with self.lock:
            self.desired = _copy(desired)
            if self.watching and self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="resourceslice-watch", daemon=True)
                self.thread.start()
            return self._publish()

    def _publish(self) -> dict[str, int]:
        assert self.desired is not None
        try:
            return self._apply(_copy(self.desired), self.existing())
        except PublishError as err:
            if err.status not in (404, 409):
                raise
            log.info("%s: publishing again on a fresh list", err.message)
            with self.lock:
                self.cache = None  # stale: the watch lists again too
            return self._apply(_copy(self.desired), self.existing())

    def _stored(self, name: str, item: dict[str, Any] | None) -> None:
        with self.lock:
            if self.cache is not None:
                if item is None:
                    self.cache.pop(name, None)
                elif item.get("metadata", {}).get("name") == name:
                    self.cache[name] = item

    def _apply(self, desired: list[dict[str, Any]], have: dict[str, dict[str, Any]]) -> dict[str, int]:
        pools: dict[str, list[dict[str, Any]]] = {}
        for item in desired:
            pools.setdefault(item["spec"]["pool"]["name"], []).append(item)
        generations = {}
        for pool, items in pools.items():
            old = [s for s in have.values() if s["spec"]["pool"]["name"] == pool]
            current = max((int(s["spec"]["pool"].get("generation", 0)) for s in old), default=0)
            same = sorted(_content(s) for s in old) == sorted(_content(s) for s in items) and \
                {s["metadata"]["name"] for s in old} == {s["metadata"]["name"] for s in items}
            # a pool's generation never goes back, even when its slices were all deleted by someone else
            generation = current if same and current else max(current, self.generations.get(pool, 0)) + 1
            generations[pool] = self.generations[pool] = generation
            if same and current:
                continue
            for item in items:
                item["spec"]["pool"]["generation"] = generation
                name = item["metadata"]["name"]
                if name in have:
                    item["metadata"]["resourceVersion"] = have[name]["metadata"]["resourceVersion"]
                    keep_taint_times(item, have[name])
                    stored = self._call(f"replace resourceslice {name}", self.api.replace_resource_slice, name, item)
                else:
                    stored = self._call(f"create resourceslice {name}", self.api.create_resource_slice, item)
                self._stored(name, stored)
            log.info("published pool %s: generation %d, %d slice(s), %d device(s)", pool, generation, len(items),
                     sum(len(i["spec"].get("devices", [])) for i in items))
        wanted = {item["metadata"]["name"] for item in desired}
        for name in sorted(set(have) - wanted):
            try:
                self._call(f"delete resourceslice {name}", self.api.delete_resource_slice, name)
            except PublishError as err:
                if err.status != 404:  # gone already: what was wanted
                    raise
            self._stored(name, None)
            log.info("deleted resourceslice %s (no device of its pool left)", name)
        return generations

    # --- the watch ------------------------------------------------------------------------------------------
    def _reconcile(self) -> None:
        """Publish again when the API's slices are no longer what was published (nothing is written when they
        are). A failure ends the watch: it backs off, lists again and tries again, the watch kept alive or not."""
        with self.lock:
            if self.desired is None or self.cache is None:
                return
            try:
                self._publish()
            except PublishError as err:
                raise PublishError(f"restoring ResourceSlices: {err.message}", err.status) from None

    def _watch(self) -> None:
        version: str | None = None
        failures = 0
        while not self.stopping.is_set():
            try:
                if version is None:
                    with self.lock:  # no publish between the list and the copy made of it
                        listed = self._list()
                        self.cache = {item["metadata"]["name"]: item for item in listed.get("items", [])}
                    version = str(listed.get("metadata", {}).get("resourceVersion") or "")
                    self._reconcile()
                started = time.monotonic()
                for event in self.api.watch_resource_slice(self.selector, version):
                    if self.stopping.is_set():
                        return
                    version = self._event(event, version)
                    if version is None:
                        break  # expired (410): list again
                failures = 0
                if time.monotonic() - started < 1:  # a server that ends watches at once is not asked in a loop
                    self.stopping.wait(1)
            except (kubeapi.ApiError, PublishError) as err:
                failures += 1
                version = None  # out of step: listed again once it answers
                with self.lock:
                    self.cache = None
                wait = random.uniform(0.5, min(WATCH_BACKOFF_CAP, 0.5 * 2 ** failures))
                log.warning("watching ResourceSlices: %s (again in %.1fs)", err.message, wait)
                self.stopping.wait(wait)

    def _event(self, event: dict[str, Any], version: str) -> str | None:
        """One watch event into the copy (ours or someone else's change); the resourceVersion to go on from,
        None when the server says it is too old."""
        kind, item = event.get("type"), event.get("object")
        if not isinstance(item, dict):
            return version
        if kind == "ERROR":
            if item.get("code") == 410:
                return None
            raise kubeapi.ApiError(f"watch resourceslices: {item.get('code')} {item.get('message')}",
                                   int(item.get("code") or 0))
        meta = item.get("metadata") or {}
        version = str(meta.get("resourceVersion") or version)
        if kind == "BOOKMARK" or not meta.get("name"):
            return version
        with self.lock:
            if self.cache is None:
                return version
            if kind == "DELETED":
                self.cache.pop(meta["name"], None)
            else:
                self.cache[meta["name"]] = item
        self._reconcile()
        return version

    def close(self) -> None:
        self.stopping.set()
        self.watching = False

    # --- claims ---------------------------------------------------------------------------------------------
    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        from devinject.dra.claims import ClaimReadError

        try:
            return self._call(f"get resourceclaim {namespace}/{name}",  # type: ignore[no-any-return]
                              self.api.read_namespaced_resource_claim, name, namespace, budget=CLAIM_BUDGET)
        except PublishError as err:
            raise ClaimReadError(err.message, err.status) from None

    def group_pods(self, namespace: str, group: str) -> tuple[str, ...]:
        """The UIDs of this node's pods in PodGroup `namespace`/`group` (a claim reserved for the group is
        theirs): one list of the namespace's pods on this node."""
        from devinject.dra.claims import ClaimReadError, group_members

        try:
            pods = self._call(f"list pods of podgroup {namespace}/{group} on {self.node_name}",
                              self.api.list_namespaced_pod, namespace, f"spec.nodeName={self.node_name}",
                              budget=CLAIM_BUDGET)
        except PublishError as err:
            raise ClaimReadError(err.message, err.status) from None
        return group_members(pods, group)

    def apply_claim_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A server-side apply of the claim's status with the driver as field manager (dra/claimstatus.py)."""
        return self._call(f"apply resourceclaim {namespace}/{name} status",  # type: ignore[no-any-return]
                          self.api.apply_resource_claim_status, name, namespace, body, self.driver,
                          budget=CLAIM_BUDGET)

    def remove_all(self) -> None:
        self.close()
        with self.lock:
            self.cache, self.desired = None, None
        for name in sorted(self.existing()):
            self._call(f"delete resourceslice {name}", self.api.delete_resource_slice, name)
