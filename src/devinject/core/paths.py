"""Where things live by default, each defined here once. Constants and one path join: reading this module
loads nothing else (the hook reads it on every container start)."""

import os

DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # CDI's own defaults, in priority order (later wins)
DEFAULT_STATE_DIR = "/run/devinject"  # the node's state: ledger, health, events, caches
ADMIN_PROFILE_DIR = "/etc/devinject/profiles.d"  # an admin's device profiles, under the host root
SHIPPED_PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "profiles")


def profile_search_path(root: str, extra_dirs: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The directories admin profiles are read from, in load order (a later file of the same name wins):
    `<root>/etc/devinject/profiles.d`, then each --profile-dir. The shipped profiles come before them all."""
    return (os.path.join(os.path.abspath(root), ADMIN_PROFILE_DIR.lstrip("/")), *extra_dirs)
