"""The hook's own JSON codec and C library (hook/fastjson.py, hook/fastlibc.py) keep the `json` and `ctypes`
packages out of its start, and nothing else gets them: the code outside the hook uses the standard library."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")
USE = {"json": "assert jsonlite.loads(jsonlite.dumps({'a': [1]})) == {'a': [1]}",
       "ctypes": "assert libc.function('getpid')() > 0"}


@pytest.mark.parametrize("installed", [False, True])
@pytest.mark.parametrize(("package", "lean"), [("json", "fastjson"), ("ctypes", "fastlibc")])
def test_only_the_hook_s_backend_keeps_the_package_out(package: str, lean: str, installed: bool) -> None:
    code = (f"import sys\nfrom devinject.core import jsonlite\nfrom devinject.linux import libc\n"
            f"from devinject.hook import {lean}\n"
            f"{lean + '.install()' if installed else ''}\n{USE[package]}\nprint({package!r} in sys.modules)\n")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": SRC})
    assert done.stdout.strip() == str(not installed), done.stderr


def test_the_hook_server_preloads_the_hook_s_backends_and_a_request_keeps_them() -> None:
    """preload() warmed the C library through the ctypes package, and each request's hook/main install threw
    the warmed functions away (and mixed two backends in one process)."""
    code = ("import sys\nfrom devinject.hook import server\nserver.preload()\nfrom devinject.linux import libc\n"
            "from devinject.hook import fastlibc\nwarm = libc.function('syscall')\nfastlibc.install()\n"
            "print('ctypes' in sys.modules, 'json' in sys.modules, libc.function('syscall') is warm)\n")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": SRC})
    assert done.stdout.split() == ["False", "False", "True"], done.stdout + done.stderr
