"""The hook's launcher: `python3 -IS <this file> hook ...` (what `devinject install-hook` writes). Isolated
(-I) and without `site` (-S), the interpreter starts ~3 ms sooner on every container start and stop. A
`devinject hook-server` that answers gets the invocation before anything else is loaded (hook/client.py).

Without `site`, the package is found from this file's own location (a wheel install and a source checkout
alike), and the package directories are added as `site` would add them (a virtual environment's, found by its
pyvenv.cfg, or the system's; no .pth files) for what a cold path imports: yaml on a spec-cache miss, pyroute2
for network devices."""

import os
import sys

sys.path.insert(0, __file__.rsplit("/", 3)[0])

if sys.argv[1:2] == ["hook"]:  # a hook server takes it when one answers: nothing else to load
    from devinject.hook.client import run_via_server

    served = run_via_server(sys.argv[1:])
    if served is not None:
        sys.stderr.flush()
        os._exit(served)


def _package_dirs() -> list[str]:
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    prefixes = [sys.prefix, sys.exec_prefix, "/usr/local"]
    venv = os.path.dirname(os.path.dirname(sys.executable))
    try:
        with open(f"{venv}/pyvenv.cfg", encoding="utf-8") as cfg:
            shared = any(line.replace(" ", "").lower() == "include-system-site-packages=true\n" for line in cfg)
        prefixes = [venv, *(prefixes if shared else [])]
    except OSError:
        pass  # not a virtual environment
    subdirs = (f"lib/{version}/site-packages", f"lib/{version}/dist-packages", "lib/python3/dist-packages")
    candidates = (f"{prefix}/{sub}" for prefix in dict.fromkeys(prefixes) for sub in subdirs)
    return [path for path in candidates if os.path.isdir(path)]


sys.path += _package_dirs()

if sys.argv[1:2] == ["hook"]:
    from devinject.hook.main import main  # the server was tried above
else:
    from devinject.entry import main

status = main(sys.argv[1:])
# Everything the hook writes is written and closed by now (its log line, the spec cache): skip the
# interpreter's teardown of every loaded module, ~1.7 ms on each container start and stop.
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
