"""run_hook's orchestration through its seams: the order of the steps, the rollback in reverse order when
one fails, and `--dry-run`, which plans for real and changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devinject.core.errors import HookError
from devinject.hook.main import HookOptions, HostParts, run_hook

DEVINJECT = str(Path(sys.executable).parent / "devinject")
SPEC = ("cdiVersion: 1.1.0\nkind: example.com/dev\ndevices:\n- name: a\n  containerEdits:\n"
        "    deviceNodes: [{path: /dev/example0, type: c, major: 1, minor: 7}]\n"
        "    mounts: [{hostPath: /etc/hostname, containerPath: /opt/example/name,\n"
        "              options: [ro, nosuid, nodev, bind]}]\n"
        "    netDevices: [{hostInterfaceName: eth9, name: net0}]\n")


class Recorder(HostParts):
    """Records every effect instead of making it; `fail_at` makes that step raise."""

    def __init__(self, opts: HookOptions, fail_at: str | None = None) -> None:
        super().__init__(opts)
        self.calls: list[str] = []
        self.fail_at = fail_at

    def _step(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_at:
            raise HookError(f"{name} failed")

    def book(self, container_id, pid, resolved):  # type: ignore[no-untyped-def]
        self._step("book")
        recorder = self

        class Booking:
            def cancel(self) -> None:
                recorder.calls.append("cancel booking")

        return Booking()

    def grant(self, pid, rules):  # type: ignore[no-untyped-def]
        self._step("grant " + ",".join(r.rule for r in rules))
        recorder = self

        class Grant:
            def revert(self) -> None:
                recorder.calls.append("revert grant")

            def done(self) -> None:
                recorder.calls.append("grant done")

        return Grant(), "v1 /fake"

    def move_in(self, pid, devices):  # type: ignore[no-untyped-def]
        self._step("move in " + ",".join(d.name for d in devices))
        return list(devices)

    def move_out(self, pid, devices):  # type: ignore[no-untyped-def]
        self.calls.append("move out " + ",".join(d.name for d in devices))

    def apply(self, pid, rootfs, steps):  # type: ignore[no-untyped-def]
        self._step("apply")
        return ["done"]


@pytest.fixture
def setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "x.yaml").write_text(SPEC)
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"},
                                                    "annotations": {"cdi.k8s.io/x": "example.com/dev=a"}}))
    opts = HookOptions()
    opts.spec_dirs = (str(tmp_path / "cdi"),)
    opts.state_dir = str(tmp_path / "state")
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(),
                        "bundle": str(bundle)})
    return opts, state, tmp_path


def _run(opts: HookOptions, state: str, parts: HostParts) -> dict[str, object]:
    read_end, write_end = os.pipe()
    os.write(write_end, state.encode())
    os.close(write_end)
    try:
        return run_hook(opts, read_end, parts=parts)
    finally:
        os.close(read_end)


def test_steps_run_in_order(setup) -> None:  # type: ignore[no-untyped-def]
    opts, state, _ = setup
    parts = Recorder(opts)
    record = _run(opts, state, parts)
    assert parts.calls == ["book", "grant c 1:7 rwm", "move in net0", "apply", "grant done"]
    assert record["result"] == "ok" and record["cgroup"] == "v1 /fake"


@pytest.mark.parametrize(("fail_at", "undone"), [
    ("apply", ["move out net0", "revert grant", "cancel booking"]),
    ("move in net0", ["revert grant", "cancel booking"]),
    ("grant c 1:7 rwm", ["cancel booking"]),
])
def test_a_failing_step_undoes_everything_before_it_in_reverse(setup, fail_at: str, undone: list[str]) -> None:  # type: ignore[no-untyped-def]
    opts, state, _ = setup
    parts = Recorder(opts, fail_at=fail_at)
    with pytest.raises(HookError, match=f"{fail_at} failed"):
        _run(opts, state, parts)
    assert parts.calls[parts.calls.index(fail_at) + 1:] == undone


def test_dry_run_prints_the_plan_and_changes_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    opts, state, tmp_path = setup
    state = state.replace(f'"pid": {os.getpid()}', '"pid": 0')  # no container needs to exist
    done = subprocess.run([DEVINJECT, "hook", "--dry-run", "--spec-dir", str(tmp_path / "cdi"), "--state-dir",
                           str(tmp_path / "state"), "--log-file", str(tmp_path / "log")], input=state,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["result"] == "dry run" and record["cgroup"] == "dry run: c 1:7 rwm"
    assert record["steps"] == ["mknod /dev/example0 c 1:7 mode 666 owner 0:0",
                               "bind /etc/hostname -> /opt/example/name (ro)"]
    assert record["net_devices"] == ["eth9 -> net0"]
    assert list((tmp_path / "bundle" / "rootfs").iterdir()) == []
    assert not (tmp_path / "state" / "ledger.json").exists() and not (tmp_path / "log").exists()
