"""The command line as users meet it: real subprocesses, one-line errors, exit codes, nothing half-written."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import HOSTS

DEVINJECT = str(Path(sys.executable).parent / "devinject")


def run(*args, stdin=None):
    return subprocess.run([DEVINJECT, *args], capture_output=True, text=True, input=stdin, timeout=60)


def one_error_line(done):
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0
    assert lines and lines[0].startswith("devinject: error: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


def test_generate_to_stdout_and_list_json():
    done = run("generate", "--root", str(HOSTS / "mi300x"), "--output", "-", "--hook-path", "/usr/bin/devinject")
    assert done.returncode == 0 and done.stdout.startswith("---\ncdiVersion: 0.5.0\nkind: amd.com/gpu\n")
    rows = json.loads(run("list", "--root", str(HOSTS / "mi300x"), "--json", "--state-dir", "/nonexistent").stdout)
    assert rows[0]["names"] == ["amd.com/gpu=0", "amd.com/gpu=0000:05:00.0"] and rows[0]["health"] == "healthy"


def test_generate_under_a_root_that_is_not_slash_writes_to_stdout_not_the_nodes_spec_dir(tmp_path):
    """Was: `generate --root <fixture>` (the README's line without `-o -`) wrote the fixture's paths into
    /etc/cdi, where every runtime on the machine reads them."""
    watched = Path("/etc/cdi")
    before = sorted(watched.iterdir()) if watched.is_dir() else None
    done = run("generate", "--root", str(HOSTS / "mi300x"), "--hook-path", "/usr/bin/devinject")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("---\ncdiVersion: 0.5.0\nkind: amd.com/gpu\n")
    assert (sorted(watched.iterdir()) if watched.is_dir() else None) == before
    out = tmp_path / "cdi"
    done = run("generate", "--root", str(HOSTS / "mi300x"), "--hook-path", "/usr/bin/devinject",
               "--output-dir", str(out))
    assert done.returncode == 0 and done.stdout == "" and [p.name for p in out.iterdir()] == ["amd.com-gpu.yaml"]


def test_generate_is_a_pure_function_of_the_host(tmp_path):
    """Two runs on the same host write the same bytes, into the same or a fresh directory; no hidden counter."""
    # a hook path that exists here: validate checks that the specs' hooks will run on this host
    args = ("generate", "--root", str(HOSTS / "gaudi2"), "--hook-path", "/bin/true", "--output-dir")
    assert run(*args, str(tmp_path / "a")).returncode == 0
    first = (tmp_path / "a" / "habana.ai-gaudi.yaml").read_bytes()
    assert b"devinject-generation" not in first
    assert run(*args, str(tmp_path / "a")).returncode == 0
    assert run(*args, str(tmp_path / "b")).returncode == 0
    assert (tmp_path / "a" / "habana.ai-gaudi.yaml").read_bytes() == first
    assert (tmp_path / "b" / "habana.ai-gaudi.yaml").read_bytes() == first
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["habana.ai-gaudi.yaml"]
    assert oct(os.stat(tmp_path / "a" / "habana.ai-gaudi.yaml").st_mode & 0o777) == "0o644"
    assert run("validate", str(tmp_path / "a")).returncode == 0


def test_generate_into_a_directory_watch_manages_joins_its_generations(tmp_path):
    out = tmp_path / "cdi"
    out.mkdir()
    (out / ".devinject-generation").write_text("7\n")  # watch manages this directory
    args = ("generate", "--root", str(HOSTS / "gaudi2"), "--hook-path", "/usr/bin/devinject", "--output-dir", str(out))
    assert run(*args).returncode == 0
    assert b"# devinject-generation: 8\n" in (out / "habana.ai-gaudi.yaml").read_bytes()
    assert run(*args).returncode == 0  # unchanged content: no new generation
    assert (out / ".devinject-generation").read_text() == "8\n"


def test_output_file_needs_one_kind(tmp_path):
    line = one_error_line(run("generate", "--root", str(HOSTS / "hgx-h100"), "--output", str(tmp_path / "x.yaml")))
    assert "2 kinds found" in line and not (tmp_path / "x.yaml").exists()


def test_bad_root_and_bad_version():
    assert "--root" in one_error_line(run("generate", "--root", "/nonexistent/root", "--output", "-"))
    done = run("generate", "--cdi-version", "9.9.9")
    assert done.returncode == 2 and "9.9.9" in done.stderr


def test_validate_reports_field_path_and_exits_1(tmp_path):
    (tmp_path / "bad.yaml").write_text("cdiVersion: 0.5.0\nkind: a.com/b\ndevices:\n- name: x\n  containerEdits:\n"
                                       "    deviceNodes: [{path: /dev/x, permissions: rwz}]\n")
    done = run("validate", str(tmp_path / "bad.yaml"))
    assert done.returncode == 1
    assert f"{tmp_path / 'bad.yaml'}: devices[0].containerEdits.deviceNodes[0].permissions:" in done.stderr


def test_health_exit_codes(host_copy):
    assert run("health", "--root", str(HOSTS / "gaudi2")).returncode == 0
    assert run("health", "--root", str(HOSTS / "empty-vm")).returncode == 0
    root = host_copy("hgx-h100")
    gpu = root / "sys/devices/pci0000:12/0000:12:01.0/0000:15:00.0/0000:16:00.0/0000:18:00.0"
    (gpu / "enable").write_text("0\n")
    done = run("health", "--root", str(root))
    assert done.returncode != 0  # exit 0 only when every device is healthy
    assert "enable=0" in done.stdout + done.stderr


def test_hook_with_garbage_state_is_one_line_error():
    line = one_error_line(run("hook", "--log-file", "/dev/null", "--no-ledger", stdin="{nope"))
    assert "invalid JSON" in line


def test_hook_with_missing_bundle(tmp_path):
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": os.getpid(),
                        "bundle": str(tmp_path / "gone")})
    line = one_error_line(run("hook", "--log-file", "/dev/null", "--no-ledger", stdin=state))
    assert str(tmp_path / "gone" / "config.json") in line


def test_hook_with_no_request_exits_zero_quickly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "process": {"env": []}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": os.getpid(),
                        "bundle": str(tmp_path)})
    done = run("hook", "--log-file", str(tmp_path / "log"), "--state-dir", str(tmp_path / "state"), stdin=state)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
    assert not (tmp_path / "log").exists() and not (tmp_path / "state").exists()


def test_hook_with_dead_pid(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "annotations": {
        "cdi.k8s.io/x": "a.com/b=c"}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": 999999999,
                        "bundle": str(tmp_path)})
    assert "process 999999999 is gone" in one_error_line(run("hook", "--log-file", "/dev/null", stdin=state))


def test_hook_unknown_flag():
    assert "unknown argument '--frobnicate'" in one_error_line(run("hook", "--frobnicate"))


def test_poststop_for_unknown_container_is_quick_noop(tmp_path):
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "stopped", "bundle": str(tmp_path)})
    done = run("hook", "--state-dir", str(tmp_path / "state"), "--log-file", str(tmp_path / "log"), stdin=state)
    assert done.returncode == 0 and not (tmp_path / "state").exists()


def test_install_hook_writes_hooks_d_file(tmp_path):
    done = run("install-hook", "--hooks-dir", str(tmp_path), "--executable", DEVINJECT)
    assert done.returncode == 0
    entry = json.loads((tmp_path / "10-devinject.json").read_text())
    assert entry["hook"]["path"] == DEVINJECT and entry["stages"] == ["prestart"]  # release needs no hook
    assert entry["when"] == {"annotations": {r"^cdi\.k8s\.io/.+$": r"[^\s,]"}}
    assert run("install-hook", "--hooks-dir", str(tmp_path), "--executable", DEVINJECT, "--poststop").returncode == 0
    assert json.loads((tmp_path / "10-devinject.json").read_text())["stages"] == ["prestart", "poststop"]
    snippet = json.loads(run("install-hook", "--runc-snippet", "--executable", DEVINJECT).stdout)["hooks"]
    assert list(snippet) == ["prestart"]
    snippet = json.loads(run("install-hook", "--runc-snippet", "--executable", DEVINJECT, "--poststop").stdout)
    assert list(snippet["hooks"]) == ["prestart", "poststop"]
    assert "--executable" in one_error_line(run("install-hook", "--hooks-dir", str(tmp_path), "--executable",
                                                "/nonexistent"))


def test_hook_server_refuses_an_unsafe_or_impossible_socket_in_one_line(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # others could replace the socket
    assert "the hook server's directory is writable by group or others (mode 0777); refused" in one_error_line(
        run("hook-server", "--socket", str(shared / "hook.sock")))
    (tmp_path / "file").write_text("")
    assert "exists and is not a socket" in one_error_line(run("hook-server", "--socket", str(tmp_path / "file")))
    long = tmp_path / ("x" * 120) / "hook.sock"
    assert "too long for a unix socket" in one_error_line(run("hook-server", "--socket", str(long)))
    assert not long.parent.exists()  # nothing made on the way to the error


def test_install_hook_default_runs_the_launcher_isolated_and_it_works(tmp_path):
    """The default hooks.d entry runs this interpreter with -IS on the launcher; without `site` the launcher
    must still find the package and yaml (a fresh state dir is a spec-cache miss, which parses YAML)."""
    spec_dir = tmp_path / "cdi"
    assert run("generate", "--root", str(HOSTS / "hgx-h100"), "--output-dir", str(spec_dir)).returncode == 0
    done = run("install-hook", "--hooks-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    hook = json.loads((tmp_path / "10-devinject.json").read_text())["hook"]
    assert hook["path"] == sys.executable and hook["args"][1] == "-IS"
    assert hook["args"][2].endswith("/devinject/hook/launcher.py") and hook["args"][3] == "hook"
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                                                     "process": {"env": [], "args": ["true"]},
                                                     "annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0"}}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "created", "pid": os.getpid(),
                        "bundle": str(bundle)})
    args = [*hook["args"][1:], "--dry-run", "--spec-dir", str(spec_dir), "--state-dir", str(tmp_path / "state"),
            "--log-file", str(tmp_path / "log")]
    done = subprocess.run([hook["path"], *args], input=state, capture_output=True, text=True, env={})
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)  # --dry-run prints its record
    assert record["result"] == "dry run" and record["devices"] == ["nvidia.com/gpu=0"]
    assert "c 195:255 rwm" in record["cgroup"] and record["steps"], record  # nvidiactl and the plan


def test_create_dev_char_links(host_copy):
    root = host_copy("hgx-h100")
    done = run("create-dev-char-links", "--root", str(root))
    assert done.returncode == 0, done.stderr
    link = root / "dev/char/195:2"
    assert os.readlink(link) == "../nvidia2" and link.resolve() == (root / "dev/nvidia2").resolve()
    assert os.readlink(root / "dev/char/231:192") == "../infiniband/uverbs0"
    assert run("create-dev-char-links", "--root", str(root), "--dry-run").stdout == ""  # all present now


def test_who_lists_processes_holding_a_device_node(host_copy, tmp_path):
    root = host_copy("workstation")
    card = next(root.glob("sys/devices/pci0000:00/0000:00:02.0/drm/card0"))
    (card / "dev").write_text("1:3\n")  # make the iGPU's card node /dev/null's numbers, which we can hold open
    with open("/dev/null") as held:  # noqa: F841 - held open for the scan
        done = run("who", "--root", str(root), "--state-dir", str(tmp_path / "state"), "--json")
    assert done.returncode == 0, done.stderr
    rows = [r for r in json.loads(done.stdout) if r["name"] == "intel.com/gpu=0"]
    assert any(r["pid"] == os.getpid() and r["node"] == "c 1:3" for r in rows)


def test_shipped_hook_files_match_what_install_hook_writes():
    from devinject.hook.client import DEFAULT_SOCKET
    from devinject.install.hooksd import hook_command, hooks_d_entry, render, runc_hooks, server_unit

    hooks = Path(__file__).resolve().parents[2] / "hooks"
    exe = hook_command("/usr/local/bin/devinject")
    assert (hooks / "10-devinject.json").read_text() == render(hooks_d_entry(exe))
    assert (hooks / "10-devinject-env.json").read_text() == render(hooks_d_entry(exe, env_requests=True))
    assert (hooks / "runc-config-snippet.json").read_text() == render(runc_hooks(exe))
    unit = Path(__file__).resolve().parents[2] / "deploy" / "devinject-hook-server.service"
    assert unit.read_text() == server_unit(exe, DEFAULT_SOCKET)


def test_install_hook_writes_the_servers_unit_for_this_installation_on_the_hooks_socket(tmp_path):
    socket = tmp_path / "run" / "hook.sock"
    done = run("install-hook", "--hooks-dir", str(tmp_path / "hooks.d"), "--server", str(socket), "--server-unit",
               "--unit-dir", str(tmp_path / "units"))
    assert done.returncode == 0, done.stderr
    unit = tmp_path / "units" / "devinject-hook-server.service"
    assert f"wrote {unit}; start it: systemctl daemon-reload && systemctl enable --now" in done.stderr
    hook = json.loads((tmp_path / "hooks.d" / "10-devinject.json").read_text())["hook"]
    exec_start = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
    # the same interpreter and launcher as the hook, serving the socket the hook hands its starts to
    assert exec_start.split("=", 1)[1].split() == [hook["path"], *hook["args"][1:-3], "hook-server", "--socket",
                                                   str(socket)]
    assert hook["args"][-3:] == ["hook", "--server", str(socket)]
    blocked = tmp_path / "file"
    blocked.write_text("")
    refused = one_error_line(run("install-hook", "--runc-snippet", "--server-unit", "--unit-dir",
                                 str(blocked / "units")))
    assert "file: is not a directory, above the directory of the systemd unit" in refused


def test_device_plugin_config_file_gives_defaults_flags_win_and_unknown_names_fail(tmp_path):
    from devinject import cli

    config = tmp_path / "dp.yaml"
    config.write_text("plugin-dir: /x\nkind: [nvidia.com/gpu]\ninterval: 7\n")
    command = cli.cli.commands["device-plugin"]
    params = command.make_context("device-plugin", ["--config", str(config), "--interval", "9"]).params
    assert (params["plugin_dir"], params["kinds"], params["interval"]) == ("/x", ("nvidia.com/gpu",), 9.0)
    config.write_text("plugin_dirr: /x\n")
    done = run("device-plugin", "--config", str(config))
    assert done.returncode == 2 and "unknown option 'plugin_dirr'" in done.stderr
    done = run("device-plugin", "--config", str(tmp_path / "absent.yaml"))
    assert done.returncode == 2 and "absent.yaml" in done.stderr
    done = run("device-plugin", "--resource-name", "gpu", "--root", str(tmp_path))
    assert done.returncode == 2 and "--resource-name 'gpu'" in done.stderr  # a usage error


def test_device_plugin_metrics_port_taken_is_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run("device-plugin", "--root", str(HOSTS / "hgx-h100"), "--plugin-dir", str(tmp_path),
                   "--state-dir", str(tmp_path / "state"), "--output-dir", str(tmp_path / "cdi"),
                   "--metrics-address", f"127.0.0.1:{port}", "--no-uevents")
    assert done.returncode == 1
    assert one_error_line(done) == f"devinject: error: --metrics-address 127.0.0.1:{port}: cannot listen: " \
                                   "Address already in use"
