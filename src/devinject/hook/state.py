"""The OCI state on stdin and the bundle's config.json: read with size caps and a deadline."""

from __future__ import annotations

from devinject.core import jsonlite
from devinject.core.deadline import TooLarge, read_to_eof
from devinject.core.errors import HookError
from devinject.hook.purepath import join, normpath

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import Any, NamedTuple
else:
    from devinject.core.records import NamedTuple


MAX_STATE_BYTES = 1 << 20
MAX_CONFIG_BYTES = 16 << 20
STDIN_TIMEOUT = 5.0


class ContainerState(NamedTuple):
    id: str
    status: str
    pid: int
    bundle: str
    annotations: dict[str, str] = {}
    root: str | None = None  # crun's extension: the rootfs


class BundleConfig(NamedTuple):
    rootfs: str
    env: tuple[str, ...]
    annotations: dict[str, str]
    raw: dict[str, Any]


def read_stdin(fd: int = 0, *, limit: int = MAX_STATE_BYTES, timeout: float = STDIN_TIMEOUT) -> bytes:
    try:
        return read_to_eof(fd, timeout, limit)
    except TimeoutError:
        raise HookError(f"no complete OCI state on stdin within {timeout:g}s") from None
    except TooLarge:
        raise HookError(f"OCI state on stdin is larger than {limit} bytes") from None


def _strings(value: object, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise HookError(f"{where}: expected a map of strings")
    return value


def parse_state(data: bytes) -> ContainerState:
    try:
        raw = jsonlite.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise HookError(f"OCI state on stdin: invalid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise HookError("OCI state on stdin: expected a JSON object")
    for key in ("id", "bundle"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise HookError(f"OCI state on stdin: missing or invalid {key!r}")
    pid = raw.get("pid", 0)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise HookError("OCI state on stdin: invalid 'pid'")
    root = raw.get("root")
    return ContainerState(
        id=raw["id"],
        status=str(raw.get("status", "")),
        pid=pid,
        bundle=raw["bundle"],
        annotations=_strings(raw.get("annotations"), "OCI state annotations"),
        root=root if isinstance(root, str) and root else None,
    )


def load_bundle(state: ContainerState) -> BundleConfig:
    path = join(state.bundle, "config.json")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise HookError(f"{path}: cannot read: {err.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise HookError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = jsonlite.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise HookError(f"{path}: invalid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise HookError(f"{path}: expected a JSON object")
    root = raw.get("root") or {}
    root_path = state.root or (root.get("path") if isinstance(root, dict) else None)
    if not isinstance(root_path, str) or not root_path:
        raise HookError(f"{path}: root.path missing")
    rootfs = root_path if root_path.startswith("/") else join(state.bundle, root_path)
    process = raw.get("process") or {}
    env = process.get("env") if isinstance(process, dict) else None
    if env is not None and (not isinstance(env, list) or not all(isinstance(e, str) for e in env)):
        raise HookError(f"{path}: process.env must be a list of strings")
    return BundleConfig(
        rootfs=normpath(rootfs),
        env=tuple(env or ()),
        annotations=_strings(raw.get("annotations"), f"{path}: annotations"),
        raw=raw,
    )


def given_devices(bundle: BundleConfig) -> set[str]:
    """The device nodes the runtime gives the container (config.json `linux.devices`, normalized container
    paths); anything not in the shape the runtime spec gives is no device."""
    linux = bundle.raw.get("linux")
    devices = linux.get("devices") if isinstance(linux, dict) else None
    if not isinstance(devices, list):
        return set()
    return {normpath(d["path"]) for d in devices
            if isinstance(d, dict) and isinstance(d.get("path"), str) and d["path"].startswith("/")}


def given_char_minors(bundle: BundleConfig) -> dict[str, int]:
    """The minor of each char device node the runtime gives the container (`linux.devices`, by normalized
    container path): the numbers the runtime makes the node with, as NVIDIA's hook reads them from the
    container's /dev."""
    linux = bundle.raw.get("linux")
    devices = linux.get("devices") if isinstance(linux, dict) else None
    if not isinstance(devices, list):
        return {}
    return {normpath(d["path"]): d["minor"] for d in devices
            if isinstance(d, dict) and d.get("type") == "c" and isinstance(d.get("path"), str)
            and d["path"].startswith("/") and isinstance(d.get("minor"), int) and not isinstance(d["minor"], bool)}
