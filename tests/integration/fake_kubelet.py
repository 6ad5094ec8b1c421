"""The kubelet's side of the device plugin API, as the kubelet speaks it, over real unix sockets: it serves
`Registration` on `<dir>/kubelet.sock`, and on each registration dials the plugin's endpoint back, asks its
options and keeps a `ListAndWatch` stream open, recording every list it is sent. On start it removes the
plugin sockets in its directory, as the kubelet's device manager does."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from devinject.deviceplugin.api import v1beta1_pb2 as api
from devinject.deviceplugin.api import v1beta1_pb2_grpc as api_grpc


@dataclass
class Plugin:
    request: api.RegisterRequest
    channel: grpc.Channel
    stub: api_grpc.DevicePluginStub
    options: api.DevicePluginOptions | None = None
    lists: list[dict[str, tuple[str, list[int]]]] = field(default_factory=list)  # id -> (health, numa ids)


class FakeKubelet(api_grpc.RegistrationServicer):
    def __init__(self, plugin_dir: str) -> None:
        self.plugin_dir = plugin_dir
        self.plugins: dict[str, Plugin] = {}  # by resource name, the latest registration
        self.registrations: list[api.RegisterRequest] = []
        self.server: grpc.Server | None = None
        self.changed = threading.Condition()

    def start(self) -> None:
        for name in os.listdir(self.plugin_dir):  # the device manager's start: stale plugin sockets go
            if name.endswith(".sock"):
                os.unlink(os.path.join(self.plugin_dir, name))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{os.path.join(self.plugin_dir, 'kubelet.sock')}")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait(5)
        for plugin in self.plugins.values():
            plugin.channel.close()
        self.plugins.clear()
        try:
            os.unlink(os.path.join(self.plugin_dir, "kubelet.sock"))
        except FileNotFoundError:
            pass

    def Register(self, request: api.RegisterRequest, context: grpc.ServicerContext) -> api.Empty:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}")
        channel = grpc.insecure_channel(f"unix://{os.path.join(self.plugin_dir, request.endpoint)}")
        plugin = Plugin(request, channel, api_grpc.DevicePluginStub(channel))
        with self.changed:
            self.registrations.append(request)
            self.plugins[request.resource_name] = plugin
            self.changed.notify_all()
        threading.Thread(target=self._watch, args=(plugin,), daemon=True).start()
        return api.Empty()

    def _watch(self, plugin: Plugin) -> None:
        try:
            plugin.options = plugin.stub.GetDevicePluginOptions(api.Empty(), timeout=5)
            for response in plugin.stub.ListAndWatch(api.Empty()):
                devices = {d.ID: (d.health, [n.ID for n in d.topology.nodes]) for d in response.devices}
                with self.changed:
                    plugin.lists.append(devices)
                    self.changed.notify_all()
        except grpc.RpcError:
            pass  # the plugin or this kubelet went away

    def wait_for(self, condition, timeout: float = 10.0):  # type: ignore[no-untyped-def]
        """Wait until `condition()` is truthy (checked on every change); returns its value or None."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                value = condition()
                if value or time.monotonic() >= deadline:
                    return value or None
                self.changed.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))

    def latest(self, resource: str) -> dict[str, tuple[str, list[int]]] | None:
        plugin = self.plugins.get(resource)
        return plugin.lists[-1] if plugin and plugin.lists else None
