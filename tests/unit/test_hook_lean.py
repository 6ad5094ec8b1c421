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
    code = (f"import sys\nfrom devinject.core import jsonlite, libc\nfrom devinject.hook import {lean}\n"
            f"{lean + '.install()' if installed else ''}\n{USE[package]}\nprint({package!r} in sys.modules)\n")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": SRC})
    assert done.stdout.strip() == str(not installed), done.stderr
