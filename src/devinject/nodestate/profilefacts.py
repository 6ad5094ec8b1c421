"""The profile facts: what the hook and the ledger need to know of the device families, read from the
profiles through the node (discovery/node.py) and cached as JSON in the state dir, so a container start never
parses YAML: each kind's sharing mode ("exclusive" or "shared", which the ledger books by), and the env
variables other vendors' hooks read, mapped onto kinds (`NVIDIA_VISIBLE_DEVICES` -> `nvidia.com/gpu`). The
cache is keyed on the identity of every profile file, so an edit (even a `touch -r` one) is read again."""

from __future__ import annotations

import os

from devinject.core import jsonlite
from devinject.core.identity import file_identity
from devinject.core.paths import SHIPPED_PROFILE_DIR, profile_search_path
from devinject.core.trusteddir import trusted_dir

CACHE_NAME = "profile-facts.json"


def _profile_files(root: str, profile_dirs: tuple[str, ...]) -> list[str]:
    """Every profile file load_profiles reads, in its order: shipped, then the search path (core/paths.py)."""
    files = [os.path.join(SHIPPED_PROFILE_DIR, n) for n in sorted(os.listdir(SHIPPED_PROFILE_DIR))
             if n.endswith(".yaml")]
    for directory in profile_search_path(root, profile_dirs):
        if os.path.isdir(directory):
            files += [os.path.join(directory, n) for n in sorted(os.listdir(directory))
                      if n.endswith((".yaml", ".yml"))]
    return files  # in load order: the fingerprint changes when a file moves between directories


def _fingerprint(files: list[str]) -> str:
    parts = []
    for path in files:
        try:
            parts.append(f"{path}:{file_identity(os.stat(path))}")  # ctime too: an edit cannot hide
        except OSError:
            parts.append(f"{path}:-")
    return "|".join(parts)


def _facts(state_dir: str, root: str, profile_dirs: tuple[str, ...]) -> dict[str, dict[str, str]]:
    files = _profile_files(root, profile_dirs)
    fingerprint = _fingerprint(files)
    cache = os.path.join(state_dir, CACHE_NAME)
    trusted_dir(state_dir)  # the hook books by these facts: read only from a directory that is root's alone
    try:
        with open(cache, encoding="utf-8") as handle:
            data = jsonlite.loads(handle.read())
        if data.get("fingerprint") == fingerprint:
            return {"policy": dict(data["policy"]), "request_env": dict(data["request_env"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    from devinject.discovery.node import Node

    policy: dict[str, str] = {}
    request_env: dict[str, str] = {}
    # unchecked, as the hook always read them: a --profile-dir of hook.json that is not there adds no profiles
    node = Node(root, profile_dirs=profile_dirs, check=False)
    for profile in reversed(node.profiles):  # highest priority last, so it wins
        policy[profile.kind] = profile.sharing
        request_env.update(dict.fromkeys(profile.request_env, profile.kind))
    facts = {"policy": policy, "request_env": request_env}
    try:
        jsonlite.replace_file(cache, {"fingerprint": fingerprint, **facts})
    except OSError:
        pass
    return facts


SHARING_FILE = "sharing.json"  # the device plugin's time-slicing: {"time-slicing": {kind: replicas}}
MAX_REPLICAS = 1024


def time_slicing(state_dir: str) -> dict[str, int]:
    """kind -> how many containers may share each of its devices, as the device plugin time-slices them (its
    config's sharing.timeSlicing, written to the state dir when it starts); {} when none, or unreadable."""
    try:
        with open(os.path.join(state_dir, SHARING_FILE), encoding="utf-8") as handle:
            data = jsonlite.loads(handle.read())
        kinds = data["time-slicing"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(kinds, dict):
        return {}
    return {k: v for k, v in kinds.items() if isinstance(k, str) and type(v) is int and 1 <= v <= MAX_REPLICAS}


def write_time_slicing(state_dir: str, kinds: dict[str, int], resources: dict[str, str] | None = None) -> None:
    """The device plugin's word on which kinds it time-slices, and the resource each is served as (`doctor`
    looks for its socket by it). OSError is the caller's."""
    data = {"time-slicing": kinds, "resources": resources or {}}
    try:
        with open(os.path.join(state_dir, SHARING_FILE), encoding="utf-8") as handle:
            if jsonlite.loads(handle.read()) == data:
                return
    except (OSError, ValueError):
        pass
    trusted_dir(state_dir)
    jsonlite.replace_file(os.path.join(state_dir, SHARING_FILE), data, sort_keys=True)


def served_resources(state_dir: str) -> dict[str, str]:
    """kind -> the resource the device plugin serves it as when it renamed it (time-slicing)."""
    try:
        with open(os.path.join(state_dir, SHARING_FILE), encoding="utf-8") as handle:
            names = jsonlite.loads(handle.read()).get("resources", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in names.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(names, dict) else {}


def sharing_policy(state_dir: str, root: str = "/", profile_dirs: tuple[str, ...] = (), *,
                   containers: bool = True) -> dict[str, str]:
    """kind -> "exclusive" or "shared": the profiles' `sharing:`, and, for containers, "shared" for a kind the
    device plugin time-slices (its containers share each device, up to its replicas: the ledger counts them;
    a DRA claim without a sharing config stays exclusive, so it never meets them)."""
    policy = _facts(state_dir, root, profile_dirs)["policy"]
    sliced = time_slicing(state_dir) if containers else {}
    return {**policy, **dict.fromkeys(sliced, "shared")} if sliced else policy


def request_variables(state_dir: str, root: str = "/", profile_dirs: tuple[str, ...] = ()) -> dict[str, str]:
    """env variable -> the kind its value names devices of (profiles' `request-env`)."""
    return _facts(state_dir, root, profile_dirs)["request_env"]
