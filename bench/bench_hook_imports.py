#!/usr/bin/env python3
"""Benchmark what the hook's private-API shortcuts save on the paths that run in-process on every container
start: a `hook` no hook server takes, and every `cdi-hook` (the CDI runtimes' path, never handed over).

Each variant is a fresh `python -I -S` (as the hook launcher starts one) that imports the modules a real hook
run loads (tests/e2e/test_hook_edges.py sees the same set) and makes one JSON round trip and one C call:
- `hook`: as the hook runs, with its JSON codec (hook/fastjson.py, `_json`) and C library
  (hook/fastlibc.py, `_ctypes`) installed, and core/records.py's NamedTuple;
- `+json`, `+ctypes`, `+typing`: one shortcut replaced by the standard library (the `json` package; the
  `ctypes` package; `typing.NamedTuple` for every record), to show what each one pays on its own;
- `stdlib`: all three replaced, what the hook's start would be with the standard library alone;
- `python`: the interpreter alone, the floor;
- `cdi-hook`: the modules an in-process `cdi-hook links-and-ldcache` imports (tests/unit/test_cdi_hook_lean.py
  lists them) and one JSON round trip: the specs' hook's start on a CDI runtime.
Medians of BENCH_RUNS (60) interleaved runs; prints figures (added ms against `hook`), asserts nothing.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.bench_hook import compile_bytecode  # noqa: E402
from tests.unit.test_cdi_hook_lean import CDI_HOOK_MODULES  # noqa: E402

HOOK_MODULES = ("devinject.hook.main", "devinject.hook.state", "devinject.hook.request", "devinject.hook.registry",
                "devinject.hook.plan", "devinject.hook.executor", "devinject.hook.nsenter",
                "devinject.hook.linkercache", "devinject.hook.cgroup", "devinject.hook.bpf",
                "devinject.nodestate.ledger", "devinject.nodestate.profilefacts", "devinject.cdi.spec")


def variant(json_package: bool, ctypes_package: bool, typing_records: bool) -> str:
    lines = ["import sys", f"sys.path.insert(0, {str(REPO / 'src')!r})"]  # -I: PYTHONPATH is not read
    if typing_records:  # every `class X(NamedTuple)` the modules define becomes typing's
        lines += ["import typing, devinject.core.records as records", "records.NamedTuple = typing.NamedTuple"]
    lines += [f"import {module}" for module in HOOK_MODULES]
    lines += ["from devinject.core import jsonlite", "from devinject.linux import libc"]
    if not json_package:
        lines += ["from devinject.hook import fastjson", "fastjson.install()"]
    if not ctypes_package:
        lines += ["from devinject.hook import fastlibc", "fastlibc.install()"]
    lines += ["state = {'ociVersion': '1.0.2', 'pid': 1}", "assert jsonlite.loads(jsonlite.dumps(state)) == state",
              "assert libc.function('getpid')() > 0",
              f"assert ('json' in sys.modules) == {json_package} and ('ctypes' in sys.modules) == {ctypes_package}",
              f"assert ('typing' in sys.modules) == {typing_records}"]
    return "\n".join(lines)


CDI_HOOK = "\n".join(["import sys", f"sys.path.insert(0, {str(REPO / 'src')!r})",
                      *(f"import {module}" for module in sorted(CDI_HOOK_MODULES)),
                      "from devinject.core import jsonlite", "from devinject.hook import fastjson",
                      "fastjson.install()", "assert jsonlite.loads(jsonlite.dumps({'pid': 1})) == {'pid': 1}"])

VARIANTS = {
    "python": "pass",
    "cdi-hook": CDI_HOOK,
    "hook": variant(False, False, False),
    "+json": variant(True, False, False),
    "+ctypes": variant(False, True, False),
    "+typing": variant(False, False, True),
    "stdlib": variant(True, True, True),
}


def main() -> int:
    compile_bytecode()
    runs = int(os.environ.get("BENCH_RUNS", "60"))
    env = {"PATH": "/usr/bin:/bin"}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for code in VARIANTS.values():  # once each first: a failing variant says so before the timing
        subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True, env=env)
    for _ in range(runs):
        for name, code in VARIANTS.items():
            started = time.perf_counter()
            subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True, env=env)
            times[name].append((time.perf_counter() - started) * 1000)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"bench_hook_imports: {runs} runs of each, interleaved; median ms of a fresh `python -I -S`")
    print(f"  {'python (floor)':<16} {medians['python']:7.2f}")
    for name in ("cdi-hook", "hook"):
        print(f"  {name:<16} {medians[name]:7.2f}   (+{medians[name] - medians['python']:.2f} over the floor)")
    for name in ("+json", "+ctypes", "+typing", "stdlib"):
        print(f"  {name:<16} {medians[name]:7.2f}   ({medians[name] - medians['hook']:+.2f} against hook)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
