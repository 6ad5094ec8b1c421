"""The ResourceSlice publisher (dra/publisher.py) against a recording stand-in for dra/kubeapi.py's
ResourceApi: created at generation 1, left alone while nothing changed, replaced at the next generation
(with the resourceVersion it read) when a pool's devices changed, and slices no pool needs deleted."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devinject.discovery.node import Node
from devinject.dra.kubeapi import ApiError
from devinject.dra.publisher import PublishError, SlicePublisher
from devinject.dra.slices import DRIVER, offers, resource_slices
from tests.conftest import HOSTS


class FakeResourceApi:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.version = 0

    def list_resource_slice(self, field_selector: str, **_: object) -> dict[str, Any]:
        assert field_selector == f"spec.nodeName=node1,spec.driver={DRIVER}"
        return {"items": list(self.objects.values())}

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        body = json.loads(json.dumps(body))
        body["metadata"]["resourceVersion"] = str(self.version)
        self.objects[body["metadata"]["name"]] = body
        return body

    def create_resource_slice(self, body: dict[str, Any], **_: object) -> dict[str, Any]:
        assert body["metadata"]["name"] not in self.objects
        self.calls.append(("create", body["metadata"]["name"]))
        return self._store(body)

    def replace_resource_slice(self, name: str, body: dict[str, Any], **_: object) -> dict[str, Any]:
        assert body["metadata"]["resourceVersion"] == self.objects[name]["metadata"]["resourceVersion"]
        self.calls.append(("replace", name))
        return self._store(body)

    def delete_resource_slice(self, name: str, **_: object) -> dict[str, Any]:
        self.calls.append(("delete", name))
        return self.objects.pop(name)


def publisher() -> tuple[SlicePublisher, FakeResourceApi]:
    pub = SlicePublisher(None, DRIVER, "node1")
    fake = FakeResourceApi()
    pub.api = fake
    return pub, fake


def slices(host: str = "hgx-h100", drop: str | None = None) -> list[dict[str, Any]]:
    offered = [o for o in offers(Node(str(HOSTS / host)), "node1") if o.name != drop]
    return resource_slices(DRIVER, "node1", offered)


def test_generations_bump_only_on_change_and_stale_slices_go() -> None:
    pub, fake = publisher()
    assert pub.publish(slices()) == {"node1-nvidia-com-gpu": 1, "node1-nvidia-com-rdma": 1}
    assert sorted(fake.calls) == [("create", f"dra-devinject-io-node1-nvidia-com-{k}-0") for k in ("gpu", "rdma")]
    fake.calls.clear()
    assert pub.publish(slices()) == {"node1-nvidia-com-gpu": 1, "node1-nvidia-com-rdma": 1}
    assert fake.calls == []  # nothing changed: nothing written
    assert pub.publish(slices(drop="gpu-0000-18-00-0")) == {"node1-nvidia-com-gpu": 2, "node1-nvidia-com-rdma": 1}
    assert fake.calls == [("replace", "dra-devinject-io-node1-nvidia-com-gpu-0")]
    gpu = fake.objects["dra-devinject-io-node1-nvidia-com-gpu-0"]["spec"]
    assert gpu["pool"]["generation"] == 2 and len(gpu["devices"]) == 7
    fake.calls.clear()
    only_gpus = [s for s in slices() if s["spec"]["pool"]["name"].endswith("gpu")]
    pub.publish(only_gpus)
    assert ("delete", "dra-devinject-io-node1-nvidia-com-rdma-0") in fake.calls
    assert set(fake.objects) == {"dra-devinject-io-node1-nvidia-com-gpu-0"}


# --- the API's copy, not memory: a watch of the node's slices ------------------------------------------------
class WatchedApi(FakeResourceApi):
    """FakeResourceApi with a watch: every change (the driver's or someone else's) is an event, as the API
    server sends them; `down` makes every call fail as a dead API server's would, and ends the watch."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        self.down = False
        self.fail_writes = 0  # the next writes answered 503
        self.requests: list[str] = []

    def _check(self, what: str) -> None:
        self.requests.append(what)
        if self.down:
            raise ApiError(f"{what}: [Errno 111] Connection refused", retry=True)

    def _event(self, kind: str, body: dict[str, Any]) -> None:
        with self.changed:
            self.events.append({"type": kind, "object": json.loads(json.dumps(body))})
            self.changed.notify_all()

    def list_resource_slice(self, field_selector: str, **_: object) -> dict[str, Any]:
        self._check("list")
        listed = super().list_resource_slice(field_selector)
        return {**listed, "metadata": {"resourceVersion": str(self.version)}}

    def create_resource_slice(self, body: dict[str, Any], **_: object) -> dict[str, Any]:
        self._check("create")
        if self.fail_writes:
            self.fail_writes -= 1
            raise ApiError("POST: 503 unavailable", 503, "503 unavailable", retry=True)
        if body["metadata"]["name"] in self.objects:
            raise ApiError("POST: 409 already exists", 409, "409 already exists")
        stored = super().create_resource_slice(body)
        self._event("ADDED", stored)
        return stored

    def replace_resource_slice(self, name: str, body: dict[str, Any], **_: object) -> dict[str, Any]:
        self._check("replace")
        if body["metadata"]["resourceVersion"] != self.objects[name]["metadata"]["resourceVersion"]:
            raise ApiError("PUT: 409 conflict", 409, "409 the object has been modified")
        stored = super().replace_resource_slice(name, body)
        self._event("MODIFIED", stored)
        return stored

    def delete_resource_slice(self, name: str, **_: object) -> dict[str, Any]:
        self._check("delete")
        gone = super().delete_resource_slice(name)
        self._event("DELETED", gone)
        return gone

    def someone_deletes(self, name: str) -> None:
        self.version += 1
        gone = self.objects.pop(name)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self._event("DELETED", gone)

    def someone_edits(self, name: str) -> None:
        edited = json.loads(json.dumps(self.objects[name]))
        edited["spec"]["devices"] = edited["spec"]["devices"][:1]
        self.version += 1
        edited["metadata"]["resourceVersion"] = str(self.version)
        self.objects[name] = edited
        self._event("MODIFIED", edited)

    def watch_resource_slice(self, field_selector: str, resource_version: str) -> Iterator[dict[str, Any]]:
        self._check("watch")
        seen = next((i for i, e in enumerate(self.events)
                     if int(e["object"]["metadata"]["resourceVersion"]) > int(resource_version or 0)),
                    len(self.events))
        while True:
            with self.changed:
                self.changed.wait_for(lambda seen=seen: len(self.events) > seen or self.down,  # type: ignore[misc]
                                      timeout=0.2)
                if self.down:
                    raise ApiError("watch: connection reset", retry=True)
                pending, seen = self.events[seen:], len(self.events)
            yield from pending


@pytest.fixture
def watched() -> Iterator[tuple[SlicePublisher, WatchedApi]]:
    pub = SlicePublisher(None, DRIVER, "node1", watch=True)
    fake = WatchedApi()
    pub.api = fake
    yield pub, fake
    pub.close()


def settled(fake: WatchedApi, expected: list[dict[str, Any]], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    want = {s["metadata"]["name"]: json.dumps(s["spec"]["devices"], sort_keys=True) for s in expected}
    while {n: json.dumps(o["spec"]["devices"], sort_keys=True) for n, o in fake.objects.items()} != want:
        assert time.monotonic() < deadline, sorted(fake.objects)
        time.sleep(0.02)


def test_a_slice_someone_else_deletes_or_edits_is_restored_at_once_by_the_watch(
        watched: tuple[SlicePublisher, WatchedApi]) -> None:
    pub, fake = watched
    pub.publish(slices())
    settled(fake, slices())
    gpu = "dra-devinject-io-node1-nvidia-com-gpu-0"
    fake.someone_deletes(gpu)
    settled(fake, slices(), timeout=5)
    assert fake.objects[gpu]["spec"]["pool"]["generation"] == 2  # the pool changed: the scheduler re-reads it
    fake.someone_edits(gpu)
    settled(fake, slices(), timeout=5)
    assert fake.objects[gpu]["spec"]["pool"]["generation"] == 3


def test_a_restore_that_fails_is_tried_again_with_the_watch_still_open(
        watched: tuple[SlicePublisher, WatchedApi]) -> None:
    """No second event comes to set off another try: the watch backs off, lists again and restores."""
    pub, fake = watched
    pub.publish(slices())
    settled(fake, slices())
    fake.fail_writes = 1
    fake.someone_deletes("dra-devinject-io-node1-nvidia-com-rdma-0")
    settled(fake, slices(), timeout=10)
    assert fake.fail_writes == 0


def test_an_idle_node_costs_the_api_server_the_watch_alone(watched: tuple[SlicePublisher, WatchedApi]) -> None:
    pub, fake = watched
    pub.publish(slices())
    settled(fake, slices())
    time.sleep(0.5)
    before = list(fake.requests)
    assert before.count("watch") == 1
    for _ in range(20):
        pub.publish(slices())  # every rescan, nothing changed: compared with the watch's copy, no call
    time.sleep(1)
    assert fake.requests == before


def test_an_api_server_away_costs_a_delay_and_the_slices_are_back_when_it_is(
        watched: tuple[SlicePublisher, WatchedApi]) -> None:
    pub, fake = watched
    pub.publish(slices())
    settled(fake, slices())
    with fake.changed:
        fake.down = True
        fake.changed.notify_all()
    rdma = "dra-devinject-io-node1-nvidia-com-rdma-0"
    fake.objects.pop(rdma)  # lost meanwhile (etcd restored from a backup): no event comes for it
    with pytest.raises(PublishError, match="Connection refused"):
        pub.publish(slices(drop="gpu-0000-18-00-0"))
    time.sleep(0.5)
    fake.down = False
    settled(fake, slices(drop="gpu-0000-18-00-0"), timeout=15)  # the watch lists again and publishes


def test_a_write_refused_as_stale_is_done_again_on_a_fresh_list() -> None:
    pub = SlicePublisher(None, DRIVER, "node1")
    fake = WatchedApi()
    pub.api = fake
    pub.publish(slices())
    pub.cache = {name: json.loads(json.dumps(item)) for name, item in fake.objects.items()}  # a copy...
    fake.someone_edits("dra-devinject-io-node1-nvidia-com-gpu-0")  # ...that no event reached
    pub.publish(slices(drop="gpu-0000-18-00-0"))
    settled(fake, slices(drop="gpu-0000-18-00-0"))


def test_without_a_watch_a_slice_someone_else_deleted_is_restored_within_one_rescan(tmp_path: Path) -> None:
    """The driver compared what it would publish with what it had published (its memory): a slice deleted
    by someone else stayed deleted until the node's devices changed."""
    from tests.integration.test_dra_driver import make_driver

    pub, fake = publisher()
    dirs = {name: str(tmp_path / name) for name in ("plugins", "registry", "cdi", "state")}
    os.makedirs(dirs["state"])
    driver = make_driver(dirs, pub)  # type: ignore[arg-type]
    driver.refresh()
    published = dict(fake.objects)
    name = sorted(published)[0]
    del fake.objects[name]
    assert not driver.refresh()  # the node did not change...
    assert sorted(fake.objects) == sorted(published)  # ...but the API's copy did: restored
    fake.calls.clear()
    driver.refresh()
    assert fake.calls == []
