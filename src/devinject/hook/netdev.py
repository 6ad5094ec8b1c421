"""CDI 1.1.0 `netDevices`: host network interfaces moved into the container's network namespace.

The move and the rename are one netlink request (IFLA_NET_NS_FD with IFLA_IFNAME), so the new name is
taken inside the container and never collides with a host interface. Rollback moves each one back under its
host name, from inside the container's namespace. pyroute2 is imported only when a spec asks for this.
"""

from __future__ import annotations

import os

from devinject.cdi.model import NetDevice
from devinject.core.errors import HookError
from devinject.hook.nsenter import run_in_namespace


def _same_namespace(pid: int) -> bool:
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino


def move_in(pid: int, devices: tuple[NetDevice, ...]) -> list[NetDevice]:
    """Move every device into process `pid`'s network namespace; returns those moved (for `move_out`).
    All or nothing: a failure moves the ones already moved back before raising."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    if _same_namespace(pid):
        raise HookError("netDevices: the container shares the host's network namespace; nothing can be moved "
                        "into it")
    moved: list[NetDevice] = []
    ns_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with IPRoute() as ipr:
            for device in devices:
                found = ipr.link_lookup(ifname=device.host_interface_name)
                if not found:
                    raise HookError(f"netDevices: host interface {device.host_interface_name!r} not found")
                try:
                    ipr.link("set", index=found[0], net_ns_fd=ns_fd, ifname=device.name)
                except NetlinkError as err:
                    raise HookError(f"netDevices: moving {device.host_interface_name!r} into the container as "
                                    f"{device.name!r}: {os.strerror(err.code)}") from None
                moved.append(device)
    except BaseException:
        move_out(pid, moved)
        raise
    finally:
        os.close(ns_fd)
    return moved


def move_out(pid: int, devices: list[NetDevice]) -> None:
    """Best effort: move `devices` back to this (the host's) namespace under their host names."""
    if not devices:
        return
    host_ns = f"/proc/{os.getpid()}/ns/net"

    def back() -> None:
        from pyroute2 import IPRoute

        fd = os.open(host_ns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with IPRoute() as ipr:
                for device in devices:
                    found = ipr.link_lookup(ifname=device.name)
                    if found:
                        ipr.link("set", index=found[0], net_ns_fd=fd, ifname=device.host_interface_name)
        finally:
            os.close(fd)

    try:
        run_in_namespace(pid, "net", back)
    except HookError:
        pass  # the container (and its namespace) is gone: the kernel hands physical devices back itself
