"""The profile facts: what the hook and the ledger need to know of the device families, read from the
profiles through the node (discovery/node.py) and cached as JSON in the state dir, so a container start never
parses YAML: each kind's sharing mode ("exclusive" or "shared", which the ledger books by), and the env
variables other vendors' hooks read, mapped onto kinds (`NVIDIA_VISIBLE_DEVICES` -> `nvidia.com/gpu`). The
cache is keyed on the identity of every profile file, so an edit (even a `touch -r` one) is read again.

Two state files, each with its record and one reader: `profile-facts.json` (`ProfileFacts`), a cache, so a
file that fails (corrupt, truncated, another version) is a miss, read again from the profiles and rewritten;
`sharing.json` (`TimeSlicing`), the device plugin's time-slicing, where a file that fails counts as no
time-slicing at all: every kind is booked as its profile says (exclusive GPUs stay exclusive), until the
plugin writes it again when it starts."""

from __future__ import annotations

import os

from devinject.cdi.identity import file_identity
from devinject.core import jsonlite
from devinject.core.paths import SHIPPED_PROFILE_DIR, profile_search_path
from devinject.linux.trusteddir import trusted_dir
from devinject.nodestate.statefile import StateFileError, need_int, need_object, need_str, need_version, read_document

TYPE_CHECKING = False  # the hook reads these facts on every container start: `typing` stays off it
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple

CACHE_NAME = "profile-facts.json"
FACTS_VERSION = 1


def _str_map(raw: object, at: str) -> dict[str, str]:
    return {str(k): need_str(v, f"{at}[{k!r}]") for k, v in need_object(raw, at).items()}


class ProfileFacts(NamedTuple):
    """profile-facts.json: the facts of the profile files whose identities make `fingerprint`."""
    fingerprint: str
    policy: dict[str, str]  # kind -> "exclusive" or "shared"
    request_env: dict[str, str]  # env variable -> kind
    version: int = FACTS_VERSION

    def to_json(self) -> dict[str, object]:
        return {"version": self.version, "fingerprint": self.fingerprint, "policy": self.policy,
                "request_env": self.request_env}

    @classmethod
    def from_json(cls, raw: object, path: str) -> ProfileFacts:
        data = need_object(raw, path)
        version = need_version(data, path, (FACTS_VERSION,), absent=None)
        return cls(need_str(data.get("fingerprint"), f"{path}.fingerprint"),
                   _str_map(data.get("policy"), f"{path}.policy"),
                   _str_map(data.get("request_env"), f"{path}.request_env"), version)


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
        raw = read_document(cache)
        cached = None if raw is None else ProfileFacts.from_json(raw, cache)
    except StateFileError:  # a cache: read again from the profiles, and rewritten
        cached = None
    if cached is not None and cached.fingerprint == fingerprint:
        return {"policy": cached.policy, "request_env": cached.request_env}
    from devinject.discovery.node import Node

    policy: dict[str, str] = {}
    request_env: dict[str, str] = {}
    # unchecked, as the hook always read them: a --profile-dir of hook.json that is not there adds no profiles
    node = Node(root, profile_dirs=profile_dirs, check=False)
    for profile in reversed(node.profiles):  # highest priority last, so it wins
        policy[profile.kind] = profile.sharing
        request_env.update(dict.fromkeys(profile.request_env, profile.kind))
    try:
        jsonlite.replace_file(cache, ProfileFacts(fingerprint, policy, request_env).to_json())
    except OSError:
        pass
    return {"policy": policy, "request_env": request_env}


SHARING_FILE = "sharing.json"  # the device plugin's time-slicing
SHARING_VERSION = 1  # a file without `version` (written before it had one) is version 1
MAX_REPLICAS = 1024


class TimeSlicing(NamedTuple):
    """sharing.json: kind -> how many containers may share each of its devices (the device plugin's config's
    sharing.timeSlicing), and kind -> the resource it is served as (`doctor` looks for its socket by it)."""
    replicas: dict[str, int]
    resources: dict[str, str]
    version: int = SHARING_VERSION

    def to_json(self) -> dict[str, object]:
        return {"version": self.version, "time-slicing": self.replicas, "resources": self.resources}

    @classmethod
    def from_json(cls, raw: object, path: str) -> TimeSlicing:
        data = need_object(raw, path)
        version = need_version(data, path, (SHARING_VERSION,))
        replicas: dict[str, int] = {}
        for kind, count in need_object(data.get("time-slicing"), f"{path}.time-slicing").items():
            at = f"{path}.time-slicing[{kind!r}]"
            number = need_int(count, at)
            if not 1 <= number <= MAX_REPLICAS:
                raise StateFileError(f"{at}: expected 1 to {MAX_REPLICAS} replicas")
            replicas[str(kind)] = number
        return cls(replicas, _str_map(data.get("resources", {}), f"{path}.resources"), version)


def read_time_slicing(state_dir: str) -> TimeSlicing | None:
    """sharing.json; None when the device plugin wrote none. StateFileError naming the file and field."""
    path = os.path.join(state_dir, SHARING_FILE)
    raw = read_document(path)
    return None if raw is None else TimeSlicing.from_json(raw, path)


def _time_slicing(state_dir: str) -> TimeSlicing:
    """sharing.json as every reader takes it: one that fails is no time-slicing (see the module's doc)."""
    try:
        return read_time_slicing(state_dir) or TimeSlicing({}, {})
    except StateFileError:
        return TimeSlicing({}, {})


def time_slicing(state_dir: str) -> dict[str, int]:
    """kind -> how many containers may share each of its devices, as the device plugin time-slices them (its
    config's sharing.timeSlicing, written to the state dir when it starts); {} when none, or unreadable."""
    return _time_slicing(state_dir).replicas


def write_time_slicing(state_dir: str, kinds: dict[str, int], resources: dict[str, str] | None = None) -> None:
    """The device plugin's word on which kinds it time-slices, and the resource each is served as (`doctor`
    looks for its socket by it). OSError is the caller's."""
    wanted = TimeSlicing(dict(kinds), dict(resources or {}))
    try:
        if read_time_slicing(state_dir) == wanted:
            return
    except StateFileError:
        pass  # replaced below
    trusted_dir(state_dir)
    jsonlite.replace_file(os.path.join(state_dir, SHARING_FILE), wanted.to_json(), sort_keys=True)


def served_resources(state_dir: str) -> dict[str, str]:
    """kind -> the resource the device plugin serves it as when it renamed it (time-slicing)."""
    return _time_slicing(state_dir).resources


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
