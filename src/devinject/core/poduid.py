"""The UID of the pod an agent runs in, as the DaemonSets hand it over (the downward API's metadata.uid): the
agents put it in their kubelet socket names, so that two pods of one DaemonSet overlap on a node during a
rolling update (maxSurge) and each removes only its own sockets."""

from __future__ import annotations

import re

from devinject.core.errors import DevinjectError

POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # a UUID, lower case


def checked_pod_uid(uid: str) -> str:
    """`uid` when it is a pod UID; otherwise one line naming it (it becomes part of a path)."""
    if not POD_UID.fullmatch(uid):
        raise DevinjectError(f"--pod-uid {uid!r}: not a pod UID (a UUID in lower case, as the downward API's "
                             "metadata.uid gives it)")
    return uid
