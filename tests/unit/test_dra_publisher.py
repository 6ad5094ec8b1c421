"""The ResourceSlice publisher (dra/publisher.py) against a recording stand-in for dra/kubeapi.py's
ResourceApi: created at generation 1, left alone while nothing changed, replaced at the next generation
(with the resourceVersion it read) when a pool's devices changed, and slices no pool needs deleted."""

from __future__ import annotations

import json
from typing import Any

from devinject.discovery.node import Node
from devinject.dra.publisher import SlicePublisher
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
