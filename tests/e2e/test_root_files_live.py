"""Files root writes are root's alone, on real runc: whatever umask the runtime runs the hook under, what the
hook creates gets its own mode; its log is never followed through a link; a state dir others could write is
refused; and a spec edited in place with its size and mtime put back (`touch -r`) is read anew."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import Bundle, container_name, write_spec_dir

pytestmark = pytest.mark.live
GPU = {"cdi.k8s.io/test": "nvidia.com/gpu=0"}
DIR = {"cdi.k8s.io/test": "rw.example/dir=a"}


def set_hook_arg(bundle: Bundle, flag: str, value: Path) -> None:
    for hook in bundle.config["hooks"]["prestart"] + bundle.config["hooks"].get("poststop", []):
        args = hook["args"]
        args[args.index(flag) + 1] = str(value)


def run_under_umask(bundle: Bundle, umask: int) -> subprocess.CompletedProcess[str]:
    """`runc run` from a shell with this umask, which runc's hooks inherit (a login shell, a unit without
    UMask=)."""
    return subprocess.run(["sh", "-c", f"umask {umask:03o}; exec runc run {container_name()}"], cwd=bundle.path,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def modes(top: Path) -> dict[str, str]:
    return {str(p.relative_to(top)): f"{stat.S_IMODE(p.lstat().st_mode):04o}" for p in sorted(top.rglob("*"))}


def test_under_umask_0_the_hook_creates_its_state_and_log_in_their_own_modes(bundle: Bundle, tmp_path: Path) -> None:
    state, logs = tmp_path / "fresh" / "state", tmp_path / "logs" / "devinject"
    set_hook_arg(bundle, "--state-dir", state)
    set_hook_arg(bundle, "--log-file", logs / "hook.log")
    bundle.save(["true"], annotations=GPU)
    done = run_under_umask(bundle, 0)
    assert done.returncode == 0, done.stderr
    made = {**{f"fresh/{k}": v for k, v in modes(tmp_path / "fresh").items()},
            **{f"logs/{k}": v for k, v in modes(tmp_path / "logs").items()}}
    assert {"fresh/state/ledger.json", "fresh/state/events.jsonl", "logs/devinject/hook.log"} <= made.keys()
    expected = {name: "0600" if name.endswith(".lock") else
                "0755" if (tmp_path / name).is_dir() else "0644" for name in made}
    assert made == expected


def test_a_link_planted_at_the_hook_log_is_not_followed(bundle: Bundle, tmp_path: Path) -> None:
    """Someone replaced hook.log with a link to a file root owns: the hook neither appends to it nor fails
    the container for its log."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    bundle.log.symlink_to(victim)
    bundle.save(["sh", "-c", "test -e /dev/nvidia0 && echo started"], annotations=GPU)
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "started"
    assert victim.read_text() == "precious\n"
    assert bundle.log.is_symlink()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_state_dir_others_can_write_fails_the_start_in_one_line(bundle: Bundle, tmp_path: Path, mode: int) -> None:
    bundle.state_dir.mkdir()
    bundle.state_dir.chmod(mode)
    bundle.save(["sh", "-c", "echo started"], annotations=GPU)
    done = bundle.run(container_name())
    assert done.returncode != 0 and "started" not in done.stdout
    assert (f"devinject: error: {bundle.state_dir}: the state directory is writable by group or others "
            f"(mode {mode:04o}); refused") in done.stderr
    assert list(bundle.state_dir.iterdir()) == []  # nothing read, nothing booked


def test_a_spec_edited_in_place_with_its_size_and_mtime_kept_is_read_anew(bundle: Bundle, tmp_path: Path) -> None:
    """An admin revokes a host mount's `rw`; an editor (or `touch -r`) keeps the file's size, inode and mtime:
    the next container still gets the mount read-only, not the cached parse."""
    share = tmp_path / "share"
    share.mkdir()
    spec_dir = write_spec_dir(tmp_path / "cdi", "dir.yaml", (
        "cdiVersion: 0.5.0\nkind: rw.example/dir\ndevices:\n- name: a\n  containerEdits:\n"
        f"    mounts: [{{hostPath: {share}, containerPath: /mnt/share, options: [rw, bind]}}]\n"))
    spec = spec_dir / "dir.yaml"
    bundle.use_spec_dir(spec_dir)
    bundle.save(["sh", "-c", "echo one > /mnt/share/first && echo wrote"], annotations=DIR)
    done = bundle.run(container_name())
    assert done.returncode == 0 and done.stdout.strip() == "wrote", done.stderr
    before = spec.stat()
    with open(spec, "r+b") as handle:  # in place: the same inode, the same size
        text = handle.read()
        handle.seek(0)
        handle.write(text.replace(b"[rw, bind]", b"[ro, bind]"))
    os.utime(spec, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = spec.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    bundle.save(["sh", "-c", "echo two > /mnt/share/second && echo wrote || echo refused"],
                annotations=DIR)
    done = bundle.run(container_name())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "refused"
    assert not (share / "second").exists()
