"""Where things live by default, each defined here once. Constants only: reading this module imports nothing
(the hook's socket client reads it on every container start, in an interpreter started without `site`, where
`os` alone costs more than the rest of the hand-over; tests/e2e/test_hook_server.py checks what a served start
imports)."""

STATIC_SPEC_DIR = "/etc/cdi"  # specs an admin writes and keeps: `generate`
DYNAMIC_SPEC_DIR = "/var/run/cdi"  # specs written at run time and gone at reboot: watch, the plugins, DRA claims
DEFAULT_SPEC_DIRS = (STATIC_SPEC_DIR, DYNAMIC_SPEC_DIR)  # CDI's own defaults, in priority order (later wins)
DEFAULT_STATE_DIR = "/run/devinject"  # the node's state: ledger, health, events, caches
HOOK_SOCKET = DEFAULT_STATE_DIR + "/hook.sock"  # where `devinject hook-server` listens and the hook looks
DEFAULT_KERNEL_LOG = "/var/log/kern.log"  # read (under the host root) for the kernel's device errors
ADMIN_PROFILE_DIR = "/etc/devinject/profiles.d"  # an admin's device profiles, under the host root
NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"  # nfd-worker's local feature files
# the package's data/profiles beside this package (importlib makes a module's __file__ absolute)
SHIPPED_PROFILE_DIR = __file__.rsplit("/", 2)[0] + "/data/profiles"


def profile_search_path(root: str, extra_dirs: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The directories admin profiles are read from, in load order (a later file of the same name wins):
    `<root>/etc/devinject/profiles.d`, then each --profile-dir. The shipped profiles come before them all."""
    import os.path  # here, not at the top: the hook's client reads this module's constants alone

    return (os.path.join(os.path.abspath(root), ADMIN_PROFILE_DIR.lstrip("/")), *extra_dirs)
