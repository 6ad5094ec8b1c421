"""Root's writes go through one helper (linux/trusteddir.write_file): what devinject makes gets an explicit mode
whatever the umask, and a directory on the way that someone other than root could change, or a file there that
is someone else's, is refused in one line with nothing written. The attack (issue 40, item 2): `runtime
configure` under umask 000 made conf.d 0777, and uid 1000 rewrote containerd's drop-in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from devinject.cli import cli
from devinject.core.errors import DevinjectError
from devinject.linux.trusteddir import ancestor_problem, remove_file, trusted_dir, write_file
from tests.e2e.conftest import require
from tests.unit.test_root_files import mode, umask_0  # noqa: F401  (umask_0: a fixture)

USER = 1000  # an unprivileged user on the node


@pytest.fixture
def top() -> Iterator[Path]:
    """A directory uid 1000 can walk into (pytest's tmp_path is 0700: the attack could not even reach it)."""
    require(os.geteuid() == 0, "needs root (another uid, chown)")
    path = Path(tempfile.mkdtemp(prefix="di-rw-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def configure(config: Path, *more: str) -> tuple[int, str]:
    # a spec dir containerd 2 does not read by default: a config must be written (CDI's own dirs need none)
    done = CliRunner().invoke(cli, ["runtime", "configure", "--runtime", "containerd", "--config", str(config),
                                    "--runtime-version", "2.1", "--spec-dir", "/opt/cdi", *more])
    return done.exit_code, done.output


# the attacker's rewrite: a file of its own renamed over the drop-in, as any user who can write the directory can
REWRITE = """
import os, sys
target = sys.argv[1]
tmp = os.path.join(os.path.dirname(target), ".evil")
try:
    with open(tmp, "w") as handle:
        handle.write('[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]\\n'
                     'BinaryName = "/tmp/evil-runc"\\n')
    os.replace(tmp, target)
except PermissionError:
    sys.exit(3)
"""


def as_user(*args: str) -> int:
    return subprocess.run([sys.executable, "-c", REWRITE, *args], user=USER, group=USER, extra_groups=[],
                          timeout=60).returncode


@pytest.mark.usefixtures("umask_0")
def test_runtime_configure_under_umask_0_leaves_no_drop_in_a_user_can_rewrite(top: Path) -> None:
    config = top / "containerd" / "config.toml"
    code, out = configure(config)
    assert code == 0, out
    drop_in = top / "containerd" / "conf.d" / "99-devinject.toml"
    before = drop_in.read_bytes()
    assert as_user(str(drop_in)) == 3  # refused: conf.d is root's alone
    assert drop_in.read_bytes() == before and b"evil" not in drop_in.read_bytes()
    assert (mode(top / "containerd"), mode(drop_in.parent), mode(drop_in), mode(config)) == (0o755, 0o755,
                                                                                               0o644, 0o644)


def test_a_conf_d_others_can_write_is_refused_in_one_line_and_nothing_written(top: Path) -> None:
    """An older devinject under umask 000 left conf.d 0777: the drop-in there may already be anyone's."""
    config = top / "config.toml"
    config.write_text("version = 3\n")
    (top / "conf.d").mkdir()
    (top / "conf.d").chmod(0o777)
    code, out = configure(config)
    assert code != 0 and out.strip().splitlines() == [
        f"devinject: error: {top}/conf.d: the directory of the runtime config is writable by group or others "
        "(mode 0777); refused (devinject keeps root's files there)"]
    assert config.read_text() == "version = 3\n" and list((top / "conf.d").iterdir()) == []


def test_a_drop_in_someone_else_owns_is_refused(top: Path) -> None:
    config = top / "config.toml"
    (top / "conf.d").mkdir()
    drop_in = top / "conf.d" / "99-devinject.toml"
    drop_in.write_text("version = 3\n")
    os.chown(drop_in, USER, USER)
    code, out = configure(config)
    assert code != 0 and out.strip().splitlines() == [
        f"devinject: error: {drop_in}: the runtime config is owned by uid {USER}; refused (devinject keeps root's "
        "files there)"]
    assert not config.exists()
    code, out = configure(config, "--revert")  # nor removed: it is not devinject's
    assert drop_in.exists()


def test_a_directory_others_can_write_above_the_config_is_refused(top: Path) -> None:
    """conf.d itself 0755 does not help when a user can rename it away from a directory above it."""
    (top / "etc").mkdir()
    (top / "etc").chmod(0o777)
    config = top / "etc" / "containerd" / "config.toml"
    code, out = configure(config)
    assert code != 0 and out.strip().splitlines() == [
        f"devinject: error: {top}/etc: is writable by group or others (mode 0777), above the directory of the "
        f"runtime config {top}/etc/containerd/conf.d; refused (devinject keeps root's files there)"]
    assert list((top / "etc").iterdir()) == []


def test_a_sticky_directory_is_passed_as_the_kernel_guards_it(top: Path) -> None:
    """/tmp-like: the entries on the way must be root's (no one else may rename or remove them there)."""
    sticky = top / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    write_file(str(sticky / "mine" / "a.conf"), b"x\n")  # made here by root: fine
    assert (sticky / "mine" / "a.conf").read_bytes() == b"x\n"
    (sticky / "theirs").mkdir()
    os.chown(sticky / "theirs", USER, USER)
    (sticky / "theirs").chmod(0o755)
    with pytest.raises(DevinjectError) as caught:
        write_file(str(sticky / "theirs" / "conf.d" / "a.conf"), b"x\n")
    assert caught.value.message.startswith(f"{sticky}/theirs: is owned by uid {USER} in the sticky directory "
                                           f"{sticky}, above the directory of the file {sticky}/theirs/conf.d;")
    assert list((sticky / "theirs").iterdir()) == []
    # a link a user planted in the sticky dir, pointing at a directory of root's, is not followed
    (sticky / "link").symlink_to(sticky / "mine")
    os.lchown(sticky / "link", USER, USER)
    planted = f"^{sticky}/link: the directory of the file is owned by uid {USER} in the sticky directory"
    with pytest.raises(DevinjectError, match=planted):
        write_file(str(sticky / "link" / "b.conf"), b"x\n")
    assert not (sticky / "mine" / "b.conf").exists()
    with pytest.raises(DevinjectError, match="the directory of the file is writable by group or others"):
        write_file(str(sticky / "c.conf"), b"x\n")  # into the sticky directory itself: never


def test_links_on_the_way_are_followed_and_their_targets_checked(top: Path) -> None:
    (top / "open").mkdir()
    (top / "open").chmod(0o777)
    (top / "root").mkdir()
    (top / "to-open").symlink_to("open")  # a relative link to a directory anyone can write
    (top / "to-root").symlink_to(top / "root")
    assert ancestor_problem(str(top / "to-open" / "x" / "y")) == (f"{top}/open",
                                                                 "is writable by group or others (mode 0777)")
    assert ancestor_problem(str(top / "to-root" / "x" / "y")) is None
    (top / "root" / "up").symlink_to("../open")
    assert ancestor_problem(str(top / "root" / "up" / "x" / "y")) == (f"{top}/open",
                                                                     "is writable by group or others (mode 0777)")
    (top / "loop").symlink_to("loop")
    assert ancestor_problem(str(top / "loop" / "x")) == (f"{top}/loop", "has too many levels of symbolic links")


@pytest.mark.usefixtures("umask_0")
def test_files_get_their_mode_whatever_the_umask_and_an_old_mode_loses_others_write(top: Path) -> None:
    path = top / "a" / "b" / "c.json"
    write_file(str(path), b"{}", 0o600)
    assert (mode(top / "a"), mode(top / "a" / "b"), mode(path)) == (0o755, 0o755, 0o600)
    path.chmod(0o666)
    write_file(str(path), b"{}\n", None)  # the existing file's mode, less others' write
    assert mode(path) == 0o644
    assert remove_file(str(path)) and not path.exists() and not remove_file(str(path))


def test_trusted_dir_checks_the_path_above_it(top: Path) -> None:
    (top / "open").mkdir()
    (top / "open").chmod(0o777)
    with pytest.raises(DevinjectError) as caught:
        trusted_dir(str(top / "open" / "state"))
    assert caught.value.message == (f"{top}/open: is writable by group or others (mode 0777), above the state "
                                    f"directory {top}/open/state; refused (devinject keeps root's files there)")
    assert not (top / "open" / "state").exists()


# --- every root writer goes through it: what the runtimes and the hook run as root -------------------------

DEVINJECT = str(Path(sys.executable).parent / "devinject")


def under_umask_0(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", 'umask 0; exec "$0" "$@"', DEVINJECT, *args], capture_output=True, text=True,
                          timeout=120)


def test_install_hook_under_umask_0_writes_what_the_runtime_runs_as_roots_alone(top: Path) -> None:
    """hooks.d and the hook server's unit: the runtime and systemd run what they name as root."""
    done = under_umask_0("install-hook", "--hooks-dir", str(top / "hooks.d"), "--executable", DEVINJECT,
                         "--server-unit", "--unit-dir", str(top / "etc" / "systemd"))
    assert done.returncode == 0, done.stderr
    assert as_user(str(top / "hooks.d" / "10-devinject.json")) == 3  # the hook runs as root at every start
    assert [mode(top / p) for p in ("hooks.d", "hooks.d/10-devinject.json", "etc", "etc/systemd",
                                    "etc/systemd/devinject-hook-server.service")] == [0o755, 0o644, 0o755, 0o755,
                                                                                       0o644]
    (top / "hooks.d").chmod(0o777)  # as an older devinject under umask 0 left it
    done = under_umask_0("install-hook", "--hooks-dir", str(top / "hooks.d"), "--executable", DEVINJECT)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"devinject: error: {top}/hooks.d: the directory of the hooks.d file is writable by group or others "
        "(mode 0777); refused (devinject keeps root's files there)"]


def test_generate_refuses_a_spec_dir_under_a_directory_others_can_write(top: Path) -> None:
    """Specs are code the runtime runs as root: a user who can rename the spec dir's parent can swap the dir."""
    from tests.conftest import HOSTS

    (top / "open").mkdir()
    (top / "open").chmod(0o777)
    out = top / "open" / "cdi"
    done = under_umask_0("generate", "--root", str(HOSTS / "hgx-h100"), "--output-dir", str(out))
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"devinject: error: {top}/open: is writable by group or others (mode 0777), above the spec directory "
        f"{out}; refused (devinject keeps root's files there)"]
    assert list((top / "open").iterdir()) == []


def test_a_dra_claims_spec_is_not_written_where_others_could_swap_it(top: Path) -> None:
    """The claim's CDI spec names the nodes and mounts containerd gives the pod: its directory is root's alone."""
    from devinject.dra.claims import PrepareError
    from tests.integration.test_dra_driver import GPU_POOL, FakeApi, make_driver

    (top / "state").mkdir()
    (top / "open").mkdir()
    (top / "open").chmod(0o777)
    dirs = {"plugins": str(top / "plugins"), "registry": str(top / "registry"), "state": str(top / "state"),
            "cdi": str(top / "open" / "cdi")}
    api = FakeApi()
    uid = "0b7f8e7c-8888-4c1b-9a55-000000000001"
    api.add("a", uid, [(GPU_POOL, "gpu-0000-18-00-0")])
    with pytest.raises(PrepareError) as caught:
        make_driver(dirs, api).preparer.prepare("default", "a", uid)
    assert caught.value.message == (f"{top}/open: is writable by group or others (mode 0777), above the directory "
                                    f"of the claim's CDI spec {top}/open/cdi; refused (devinject keeps root's files "
                                    "there)")
    assert list((top / "open").iterdir()) == []


def test_the_hook_servers_socket_is_not_made_under_a_directory_others_can_write(top: Path) -> None:
    """Whoever can rename a directory above the socket's can put a server of their own where the hook looks."""
    from tests.e2e.conftest import terminate

    (top / "open").mkdir()
    (top / "open").chmod(0o777)
    server = subprocess.Popen([DEVINJECT, "hook-server", "--socket", str(top / "open" / "run" / "hook.sock")],
                              stderr=subprocess.PIPE, text=True)
    try:
        _, errors = server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the hook server started under a directory anyone can write")
    finally:
        terminate(server, timeout=10)  # never left running
    assert server.returncode != 0 and errors.strip().splitlines() == [
        f"devinject: error: {top}/open: is writable by group or others (mode 0777), above the hook server's "
        f"directory {top}/open/run; refused (devinject keeps root's files there)"]
    assert list((top / "open").iterdir()) == []


def test_nfds_feature_file_is_not_written_where_others_could_swap_it(top: Path) -> None:
    from devinject.agent.nfd import write_features

    features = top / "features.d"
    features.mkdir()
    features.chmod(0o777)
    with pytest.raises(OSError) as caught:
        write_features(str(features), ["devinject.io/nvidia-com-gpu.count=8"])
    assert caught.value.strerror == (f"{features}: the directory of the NFD feature file is writable by group or "
                                     "others (mode 0777); refused (devinject keeps root's files there)")
    assert list(features.iterdir()) == []
