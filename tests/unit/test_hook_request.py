import json

import pytest

from devinject.core.errors import HookError
from devinject.hook.request import requested_devices
from devinject.hook.state import parse_state


def test_annotations_win_over_env():
    request = requested_devices({"cdi.k8s.io/plugin_dev": "nvidia.com/gpu=0, nvidia.com/gpu=1"},
                                ("DEVINJECT_DEVICES=amd.com/gpu=0",))
    assert request.names == ("nvidia.com/gpu=0", "nvidia.com/gpu=1")
    assert request.source == "annotation"


def test_devinject_devices_env_and_dedup():
    request = requested_devices({}, ("PATH=/bin", "DEVINJECT_DEVICES=amd.com/gpu=0,amd.com/gpu=0,amd.com/gpu=1"),
                                allow_env=True)
    assert request.names == ("amd.com/gpu=0", "amd.com/gpu=1")


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ("NVIDIA_VISIBLE_DEVICES=all", ("nvidia.com/gpu=all",)),
        ("NVIDIA_VISIBLE_DEVICES=0,2", ("nvidia.com/gpu=0", "nvidia.com/gpu=2")),
        ("NVIDIA_VISIBLE_DEVICES=GPU-5b3c0a1e-7c1d", ("nvidia.com/gpu=GPU-5b3c0a1e-7c1d",)),
        ("NVIDIA_VISIBLE_DEVICES=void", ()),
        ("NVIDIA_VISIBLE_DEVICES=none", ()),
        ("NVIDIA_VISIBLE_DEVICES=", ()),
        ("AMD_VISIBLE_DEVICES=1", ("amd.com/gpu=1",)),
        ("HABANA_VISIBLE_DEVICES=all", ("habana.ai/gaudi=all",)),
        ("ASCEND_VISIBLE_DEVICES=0,1", ("huawei.com/npu=0", "huawei.com/npu=1")),
    ],
)
def test_vendor_variables(env, names, tmp_path):
    """The variables and their kinds come from the shipped profiles' `request-env`."""
    from devinject.nodestate.profilefacts import request_variables

    vendor_env = request_variables(str(tmp_path))
    assert requested_devices({}, (env,), allow_env=True, vendor_env=vendor_env).names == names


def test_env_requests_are_off_unless_the_admin_turns_them_on():
    vendor_env = {"NVIDIA_VISIBLE_DEVICES": "nvidia.com/gpu", "AMD_VISIBLE_DEVICES": "amd.com/gpu"}
    for env in ("NVIDIA_VISIBLE_DEVICES=all", "DEVINJECT_DEVICES=a.com/b=c", "AMD_VISIBLE_DEVICES=0"):
        assert requested_devices({}, (env,), vendor_env=vendor_env).names == ()
        assert requested_devices({}, (env,), allow_env=False, vendor_env=vendor_env).names == ()
    assert requested_devices({"cdi.k8s.io/x": "a.com/b=c"}, ()).names == ("a.com/b=c",)


@pytest.mark.parametrize("blank", ["", " ", " , ,", "\t"])
def test_a_blank_annotation_is_no_request(blank):
    request = requested_devices({"cdi.k8s.io/x": blank}, ("DEVINJECT_DEVICES=a.com/b=c",), allow_env=True)
    assert (request.names, request.source) == (("a.com/b=c",), "DEVINJECT_DEVICES")  # env decides, if on
    assert requested_devices({"cdi.k8s.io/x": blank}, ()) == ((), "")


def test_hook_options_default_to_no_env_requests(tmp_path):
    from devinject.hook.main import parse_hook_args

    config = tmp_path / "hook.json"
    config.write_text('{"env_requests": true}')
    assert parse_hook_args(["--config", str(config)]).env_requests is True
    assert parse_hook_args(["--config", str(config), "--no-env-requests"]).env_requests is False
    config.write_text("{}")
    assert parse_hook_args(["--config", str(config)]).env_requests is False
    assert parse_hook_args(["--config", str(config), "--env-requests"]).env_requests is True


def test_last_env_definition_wins():
    vendor_env = {"AMD_VISIBLE_DEVICES": "amd.com/gpu"}
    assert requested_devices({}, ("AMD_VISIBLE_DEVICES=0", "AMD_VISIBLE_DEVICES=1"), allow_env=True,
                             vendor_env=vendor_env).names == ("amd.com/gpu=1",)


def test_bad_names_are_errors_naming_the_source():
    with pytest.raises(HookError, match="annotation cdi.k8s.io/x: invalid device 'nogood'"):
        requested_devices({"cdi.k8s.io/x": "nogood"}, ())
    with pytest.raises(HookError, match="DEVINJECT_DEVICES"):
        requested_devices({}, ("DEVINJECT_DEVICES=a.com/b",), allow_env=True)


def test_too_many_devices():
    with pytest.raises(HookError, match="at most 256"):
        requested_devices({"cdi.k8s.io/x": ",".join(f"a.com/b={i}" for i in range(300))}, ())


def test_state_parsing_including_crun_root():
    state = parse_state(json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 42,
                                    "bundle": "/b", "annotations": {"k": "v"}, "root": "/r"}).encode())
    assert (state.id, state.pid, state.bundle, state.root, state.annotations) == ("c1", 42, "/b", "/r", {"k": "v"})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"{not json", "invalid JSON"),
        (b"[]", "expected a JSON object"),
        (b'{"id": "c"}', "'bundle'"),
        (b'{"id": "c", "bundle": "/b", "pid": -3}', "'pid'"),
        (b'{"id": "c", "bundle": "/b", "annotations": {"a": 1}}', "annotations"),
    ],
)
def test_bad_state(data, message):
    with pytest.raises(HookError, match=message):
        parse_state(data)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("vendor.com/gpu=0", True), ("foo.bar.baz/foo-bar123.B_az=a:b", True), ("a/b=c", True),
        ("v/c=GPU-5b3c0a1e-7c1d", True), ("vendor.com/gpu=0000:18:00.0", True),
        ("foo/bar", False), ("vendor.com/foo/=x", False), ("vendor.com/foo/bar=x", False), ("1v/c=x", False),
        ("v/c=-x", False), ("v/c=x-", False), ("v/c-=x", False), ("v/c=", False), ("v/c=a b", False),
        ("v/c=é", False), ("/c=x", False),
    ],
)
def test_qualified_name_rules_match_cdi_parser(text, ok):
    from devinject.cdi.names import parse_qualified_name

    if ok:
        assert str(parse_qualified_name(text)) == text
    else:
        with pytest.raises(ValueError):
            parse_qualified_name(text)


def test_state_on_stdin_has_one_deadline_not_one_per_chunk():
    """A writer that drips a byte at a time never gets a fresh timeout: the whole read has one deadline."""
    import os
    import threading
    import time

    from devinject.hook.state import read_stdin

    read_end, write_end = os.pipe()
    stop = threading.Event()

    def drip() -> None:
        while not stop.is_set():
            os.write(write_end, b" ")
            time.sleep(0.2)

    writer = threading.Thread(target=drip, daemon=True)
    writer.start()
    started = time.monotonic()
    try:
        with pytest.raises(HookError, match="no complete OCI state on stdin within 1s"):
            read_stdin(read_end, timeout=1.0)
        assert time.monotonic() - started < 3  # cut off at the deadline, not kept alive by the drip
    finally:
        stop.set()
        writer.join()
        os.close(read_end)
        os.close(write_end)


def test_the_hooks_own_flags_apply_before_a_bad_config_is_reported(tmp_path):
    """Was: `hook --log-file X --dry-run` with a config that is not JSON logged its error into the default
    /var/log/devinject/hook.log (made for it), as if neither flag had been given."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from devinject.hook.main import DEFAULT_LOG

    config = tmp_path / "hook.json"
    config.write_text("{bad")
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"ociVersion": "1.0.2", "id": "x", "status": "creating", "pid": 1,
                                 "bundle": str(tmp_path)}))
    default_log = Path(DEFAULT_LOG)
    before = default_log.read_bytes() if default_log.exists() else None
    log = tmp_path / "hook.log"

    def hook(*flags: str) -> subprocess.CompletedProcess[str]:
        with state.open() as stdin:
            return subprocess.run([str(Path(sys.executable).parent / "devinject"), "hook", "--config", str(config),
                                   "--log-file", str(log), "--state-dir", str(tmp_path / "st"), *flags],
                                  stdin=stdin, capture_output=True, text=True, timeout=60)

    done = hook("--dry-run")
    assert done.returncode == 1 and done.stderr.startswith(f"devinject: error: {config}:1:2: ")
    assert not log.exists()  # a dry run changes nothing, its log included
    done = hook()
    assert done.returncode == 1 and json.loads(log.read_text())["error"].startswith(f"{config}:1:2: ")
    assert (default_log.read_bytes() if default_log.exists() else None) == before
    assert not (tmp_path / "st").exists()
