"""The value rules of a CDI spec, as CDI's reference library enforces them when it loads a spec — every
message in words, naming the field (`devices[0].containerEdits.deviceNodes[0].permissions: ...`).

The shape (fields, types) is spec.spec_from_dict's; this module checks what is inside. Lean: the hook runs
it on every spec it parses (the parse is cached).
"""

from __future__ import annotations

from devinject.cdi.cdiversion import KNOWN_VERSIONS, released_version, version_key, version_needs
from devinject.cdi.model import ContainerEdits, DeviceNode, Hook, IntelRdt, Mount, NetDevice, Spec
from devinject.cdi.names import device_name_problem, kind_problem

HOOK_NAMES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")
NODE_TYPES = ("", "b", "c", "u", "p")
UINT32_MAX = (1 << 32) - 1
INT64 = (-(1 << 63), (1 << 63) - 1)
REMOVED_IN_1_1 = (("enable_cmt", "enableCMT"), ("enable_mbm", "enableMBM"))


def _env_problems(env: tuple[str, ...], where: str) -> list[str]:
    return [f"{where}[{i}]: {entry!r} is not NAME=VALUE" for i, entry in enumerate(env)
            if "=" not in entry or entry.startswith("=")]


def _interface_problem(name: str) -> str | None:
    if not name:
        return "empty"
    if len(name) > 15:
        return f"{name!r} is longer than 15 characters"
    if name in (".", "..") or any(ch in name for ch in "/: \t\n"):
        return f"{name!r} is not a valid interface name"
    return None


def _clos_id_problem(clos_id: str) -> bool:
    """A class of service is a resctrl directory name, or `/`, the root class (CDI's IntelRdt.Validate)."""
    if clos_id == "/":
        return False
    return len(clos_id) >= 4096 or clos_id in (".", "..") or "/" in clos_id or "\n" in clos_id


def edits_problems(edits: ContainerEdits, where: str, version: str) -> list[str]:
    problems = _env_problems(edits.env, f"{where}.env")
    for i, node in enumerate(edits.device_nodes):
        problems += _device_node_problems(node, f"{where}.deviceNodes[{i}]")
    for i, mount in enumerate(edits.mounts):
        problems += _mount_problems(mount, f"{where}.mounts[{i}]")
    for i, hook in enumerate(edits.hooks):
        problems += _hook_problems(hook, f"{where}.hooks[{i}]")
    problems += _net_devices_problems(edits.net_devices, where)
    for i, gid in enumerate(edits.additional_gids):
        if not 0 <= gid <= UINT32_MAX:
            problems.append(f"{where}.additionalGids[{i}]: must be between 0 and {UINT32_MAX}")
    if edits.intel_rdt is not None:
        problems += _intel_rdt_problems(edits.intel_rdt, f"{where}.intelRdt", version)
    return problems


def _device_node_problems(node: DeviceNode, at: str) -> list[str]:
    problems: list[str] = []
    if not node.path.startswith("/"):
        problems.append(f"{at}.path: must be an absolute path, not {node.path!r}")
    if node.host_path is not None and not node.host_path.startswith("/"):
        problems.append(f"{at}.hostPath: must be an absolute path, not {node.host_path!r}")
    if node.type not in (None, *NODE_TYPES):
        problems.append(f"{at}.type: must be b (block), c (char), u (unbuffered char) or p (FIFO), "
                        f"not {node.type!r}")
    for field, value in (("major", node.major), ("minor", node.minor)):
        if value is not None and not INT64[0] <= value <= INT64[1]:
            problems.append(f"{at}.{field}: out of range")
    if node.type in ("b", "c") and (node.major is None) != (node.minor is None):
        problems.append(f"{at}: major and minor go together")
    for field, value in (("fileMode", node.file_mode), ("uid", node.uid), ("gid", node.gid)):
        if value is not None and not 0 <= value <= UINT32_MAX:
            problems.append(f"{at}.{field}: must be between 0 and {UINT32_MAX}")
    if node.permissions is not None:
        if any(ch not in "rwm" for ch in node.permissions):
            problems.append(f"{at}.permissions: only r, w and m are allowed, not {node.permissions!r}")
        elif len(set(node.permissions)) != len(node.permissions):
            problems.append(f"{at}.permissions: repeated letters in {node.permissions!r}")
    return problems


def _mount_problems(mount: Mount, at: str) -> list[str]:
    problems: list[str] = []
    if not mount.host_path:
        problems.append(f"{at}.hostPath: empty")
    if not mount.container_path.startswith("/"):
        problems.append(f"{at}.containerPath: must be an absolute path, not {mount.container_path!r}")
    return problems


def _hook_problems(hook: Hook, at: str) -> list[str]:
    problems: list[str] = []
    if hook.hook_name not in HOOK_NAMES:
        problems.append(f"{at}.hookName: {hook.hook_name!r} is not one of {', '.join(HOOK_NAMES)}")
    if not hook.path.startswith("/"):
        problems.append(f"{at}.path: must be an absolute path, not {hook.path!r}")
    problems += _env_problems(hook.env, f"{at}.env")
    if hook.timeout is not None and hook.timeout <= 0:
        problems.append(f"{at}.timeout: must be more than 0 seconds")
    return problems


def _net_devices_problems(nets: tuple[NetDevice, ...], where: str) -> list[str]:
    """Each interface name valid, and no container-side name given twice."""
    problems: list[str] = []
    names: set[str] = set()
    for i, net in enumerate(nets):
        at = f"{where}.netDevices[{i}]"
        for field, interface in (("hostInterfaceName", net.host_interface_name), ("name", net.name)):
            if (problem := _interface_problem(interface)) is not None:
                problems.append(f"{at}.{field}: {problem}")
        if net.name in names:
            problems.append(f"{at}.name: {net.name!r} given twice")
        names.add(net.name)
    return problems


def _intel_rdt_problems(rdt: IntelRdt, at: str, version: str) -> list[str]:
    problems: list[str] = []
    if rdt.clos_id is not None and _clos_id_problem(rdt.clos_id):
        problems.append(f"{at}.closID: {rdt.clos_id!r} is not a valid class of service name")
    if version in KNOWN_VERSIONS and version_key(version) >= (1, 1, 0):
        problems += [f"{at}.{field}: removed in CDI 1.1.0 (use enableMonitoring)"
                     for attr, field in REMOVED_IN_1_1 if getattr(rdt, attr) is not None]
    return problems


def spec_problems(spec: Spec) -> list[str]:
    """Everything wrong with the spec's values, in words; [] when CDI would load it."""
    problems: list[str] = []
    version = released_version(spec.cdi_version)
    if version is None:
        problems.append(f"cdiVersion: {spec.cdi_version!r} is not a released CDI version "
                        f"({', '.join(KNOWN_VERSIONS)})")
    else:
        too_new = [(v, what) for v, what in version_needs(spec) if version_key(v) > version_key(version)]
        if too_new:
            version, what = too_new[0]
            problems.append(f"cdiVersion: {spec.cdi_version} is too low for the fields used "
                            f"({what} needs {version})")
    if (problem := kind_problem(spec.kind)) is not None:
        problems.append(problem)
    if not spec.devices:
        problems.append("devices: a spec needs at least one device")
    seen: set[str] = set()
    for i, device in enumerate(spec.devices):
        at = f"devices[{i}]"
        if (problem := device_name_problem(device.name)) is not None:
            problems.append(f"{at}.name: {problem}")
        if device.name in seen:
            problems.append(f"{at}.name: device {device.name!r} defined twice")
        seen.add(device.name)
        if device.edits.is_empty():
            problems.append(f"{at}.containerEdits: empty device edits (CDI refuses a device without any)")
        problems += edits_problems(device.edits, f"{at}.containerEdits", version or "")
    problems += edits_problems(spec.edits, "containerEdits", version or "")
    return problems
