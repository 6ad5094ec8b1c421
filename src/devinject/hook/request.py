"""What a container asked for: CDI annotations first, then DEVINJECT_DEVICES, then vendor env variables."""

from __future__ import annotations

from devinject.cdi.identity import qualified
from devinject.cdi.names import parse_qualified_name
from devinject.core.errors import HookError

TYPE_CHECKING = False  # `typing` costs the hook ~2 ms per container start: type checkers only
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    from devinject.core.records import NamedTuple


ANNOTATION_PREFIX = "cdi.k8s.io/"
DEVICES_ENV = "DEVINJECT_DEVICES"
NO_DEVICES = ("", "none", "void")
MAX_REQUESTED = 256


class Request(NamedTuple):
    names: tuple[str, ...]  # qualified names, in request order, deduplicated
    source: str  # where they came from: annotation, env, or a vendor variable


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _checked(names: list[str], source: str) -> list[str]:
    for name in names:
        try:
            parse_qualified_name(name)
        except ValueError as err:
            raise HookError(f"{source}: {err}") from None
    return names


def _env_map(env: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for entry in env:
        key, sep, value = entry.partition("=")
        if sep:
            out[key] = value  # the last definition wins, as in execve
    return out


def requested_devices(annotations: dict[str, str], env: tuple[str, ...], *, allow_env: bool = False,
                      vendor_env: dict[str, str] | None = None) -> Request:
    """Annotations (set by kubelet device plugins and admins) always count; env variables, which the image
    and the pod user control, only with `allow_env`; `vendor_env` maps other vendors' variables onto kinds
    (the profiles' `request-env`). A blank value is no request."""
    names: list[str] = []
    sources: list[str] = []
    for key in sorted(annotations):
        found = _split(annotations[key]) if key.startswith(ANNOTATION_PREFIX) else []
        if found:
            names += _checked(found, f"annotation {key}")
            sources.append("annotation")
    if not names and allow_env:
        variables = _env_map(env)
        found = _split(variables.get(DEVICES_ENV, ""))
        if found:
            names += _checked(found, DEVICES_ENV)
            sources.append(DEVICES_ENV)
        for variable, kind in sorted((vendor_env or {}).items()):
            value = variables.get(variable)
            if value is None or value.strip().lower() in NO_DEVICES:
                continue
            ids = ["all"] if value.strip().lower() == "all" else _split(value)
            names += _checked([qualified(kind, i) for i in ids], variable)
            sources.append(variable)
    unique = tuple(dict.fromkeys(names))
    if len(unique) > MAX_REQUESTED:
        raise HookError(f"{len(unique)} devices requested; at most {MAX_REQUESTED}")
    return Request(unique, "+".join(dict.fromkeys(sources)))


def pod_request(requested: Request, env: tuple[str, ...], pod: str, state_dir: str) -> tuple[Request, list[str]]:
    """What a container of Kubernetes pod `pod` gets: annotations and env are the pod user's to write
    (containerd's `pod_annotations`, a pod spec's env), so only what the node's agents handed out for the pod
    counts (nodestate/grants.py): the device plugin's grants the container presents, and the devices of DRA
    claims booked for the pod when the container names them. (the request, what was ignored and why)."""
    from devinject.nodestate.grants import claimed_for_pod, redeem, tokens_in

    tokens = tokens_in(env)
    granted, refused = redeem(state_dir, tokens, pod) if tokens else ([], [])
    claimed = set(claimed_for_pod(state_dir, pod)) if requested.names else set()
    names = list(dict.fromkeys(granted))
    from_claims = [n for n in requested.names if n in claimed and n not in names]
    ignored = [n for n in requested.names if n not in names and n not in claimed]
    notes = refused + ([f"pod {pod}: {', '.join(ignored)} not granted to this pod by the node's device plugin or "
                        "DRA driver; ignored"] if ignored else [])
    sources = (["grant"] if granted else []) + ([requested.source] if from_claims else [])
    unique = tuple(dict.fromkeys(names + from_claims))
    if len(unique) > MAX_REQUESTED:
        raise HookError(f"{len(unique)} devices requested; at most {MAX_REQUESTED}")
    return Request(unique, "+".join(sources)), notes
