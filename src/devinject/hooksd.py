"""The CRI-O / podman hooks.d file (schema 1.0.0) that runs `devinject hook`, and a runc config snippet."""

from __future__ import annotations

import json
from typing import Any

DEFAULT_HOOKS_DIR = "/etc/containers/oci/hooks.d"
HOOK_FILE = "10-devinject.json"
HOOK_TIMEOUT = 30
ANNOTATION_KEY = r"^cdi\.k8s\.io/.+$"
ANNOTATION_VALUE = r"[^\s,]"  # Go regexp, unanchored: some character that is not blank or a comma


def hooks_d_entry(executable: str, *, env_requests: bool = False) -> dict[str, Any]:
    """hooks.d cannot match environment variables: the env variant turns env requests on and runs for every
    container (exiting at once when nothing is requested); the default runs only when a `cdi.k8s.io/`
    annotation names something (a blank or comma-only value is no request)."""
    when: dict[str, Any] = {"always": True} if env_requests else {"annotations": {ANNOTATION_KEY: ANNOTATION_VALUE}}
    args = ["devinject", "hook", *(["--env-requests"] if env_requests else [])]
    return {
        "version": "1.0.0",
        "hook": {"path": executable, "args": args, "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
                 "timeout": HOOK_TIMEOUT},
        "when": when,
        "stages": ["prestart", "poststop"],
    }


def runc_hooks(executable: str) -> dict[str, Any]:
    hook = {"path": executable, "args": ["devinject", "hook"], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "timeout": HOOK_TIMEOUT}
    return {"hooks": {"prestart": [hook], "poststop": [hook]}}


def render(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"
