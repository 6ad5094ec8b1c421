"""The package's real import graph, read from the source (every `import`, at module level or inside a
function, under TYPE_CHECKING or not): no import circle, and each package imports only the layers below it
(docs/architecture.md). tests/e2e/test_hook_edges.py checks what a real hook run loads; this checks what
the code may load at all."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "devinject"

# What each package may import besides itself (docs/architecture.md); a module directly in devinject/ is
# a command (cli, entry, doctor, __main__) or the public API (api, inventory, results): the top, which may
# import anything; so are the CLI's commands, one module each in the `commands` package. Every package may
# import the top-level `devinject` (its __version__), which imports nothing.
BASE = {"core", "cdi", "linux"}  # the floors every package may stand on
MAY_IMPORT = {
    "core": set(),
    "cdi": {"core"},
    "linux": {"core"},
    "discovery": BASE,
    "nodestate": BASE | {"discovery"},
    "specs": BASE | {"discovery"},
    "hook": BASE | {"nodestate"},
    "runtimes": BASE,
    "agent": BASE | {"discovery", "nodestate", "specs"},
    "install": BASE | {"discovery", "specs", "hook", "runtimes"},
    "deviceplugin": BASE | {"discovery", "nodestate", "specs", "agent"},
    "dra": BASE | {"discovery", "nodestate", "specs", "agent"},
}
# Scripts a runtime runs by path, at the top like the commands although they sit in a package: the hook
# launcher's path is in every hooks.d file and runc config `install-hook` wrote, so it stays where it is.
SCRIPTS = {"devinject.hook.launcher"}
TOP_PACKAGES = {"commands"}  # the click commands cli.py assembles: the top, as cli.py is


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import of `name` loads (`devinject.hook.cgroup.CgroupGrant` is devinject.hook.cgroup)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the devinject modules it imports (its parent packages not counted: they import nothing
    but the top-level __init__'s __version__)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                names += [f"{base}.{alias.name}" for alias in node.names]
        graph[module] = {target for name in names if name.split(".")[0] == "devinject"
                         and (target := _imported(name, modules)) not in (None, module)}
    return graph


def _layer(module: str) -> str | None:
    """The package a module belongs to; None for the top (devinject itself and the commands beside it)."""
    if module in SCRIPTS or module.split(".")[1:2] in [[package] for package in TOP_PACKAGES]:
        return None
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        layer = _layer(module)
        for target in sorted(targets):
            theirs = _layer(target)
            if target == "devinject" or layer is None or theirs == layer:
                continue
            if theirs is None or theirs not in MAY_IMPORT[layer]:
                wrong.append(f"{module} imports {target}")
    return wrong


def test_the_walk_sees_imports_at_every_level() -> None:
    """The walk itself: module-level, function-level and TYPE_CHECKING imports are all edges."""
    graph = import_graph()
    assert "devinject.core.errors" in graph["devinject.hook.plan"]  # module level
    assert "devinject.hook.executor" in graph["devinject.hook.main"]  # imported inside a function
    assert {"devinject.cli", "devinject.core", "devinject.hook", "devinject.deviceplugin.api.v1beta1_pb2"} <= set(graph)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward_imports({"devinject.core.x": {"devinject.hook.y"}, "devinject.hook.y": {"devinject.core.x"},
                           "devinject.cli": {"devinject.hook.y"}}) == ["devinject.core.x imports devinject.hook.y"]


def test_no_import_circle() -> None:
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_each_package_imports_only_the_layers_below_it() -> None:
    wrong = upward_imports(import_graph())
    assert not wrong, "imports against the layers (docs/architecture.md):\n" + "\n".join(wrong)


def test_every_package_has_a_layer_and_the_top_level_imports_nothing() -> None:
    graph = import_graph()
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert packages == set(MAY_IMPORT) | TOP_PACKAGES, (
        "a new package: give it a layer here and in docs/architecture.md")
    assert graph["devinject"] == set()
    assert not [module for module, targets in graph.items() if targets & SCRIPTS]  # run, never imported


def test_the_hand_over_to_the_hook_server_is_routed_in_one_place() -> None:
    """`hook` to the server, else in-process: entry.py decides it for the console script and the launcher
    alike (it was written twice, in entry.py and hook/client.py's launcher, and the two could drift)."""
    callers = set()
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name == "run_via_server":
                    callers.add(module)
    assert callers == {"devinject.entry"}



def _callers(function: str) -> set[str]:
    callers = set()
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name == function:
                    callers.add(module)
    return callers


def test_profiles_are_loaded_in_one_place() -> None:
    """One way in (devinject.api.Node, discovery/node.py): the node loads the profiles, from the one search path
    (core/paths.py), and every command, the agent and the hook's cache miss ask a node. `Host(root) ->
    load_profiles -> discover` was wired by hand in seven places, two of them without --profile-dir."""
    assert _callers("load_profiles") == {"devinject.discovery.node"}
    assert _callers("profile_search_path") == {"devinject.discovery.profiles", "devinject.nodestate.profilefacts"}
    assert "devinject.api" in import_graph()["devinject.commands.common"]  # the node of every command (`_node`)


def test_the_agent_and_the_device_plugin_read_the_host_through_a_node() -> None:
    """agent/ and deviceplugin/ (watch's loop, the device plugin over it) take a discovery Node or make one from
    their options, and rescan it (`Node.rescanned`): none builds a Host, a HostView or the profiles itself, so
    the loop serves what `generate` and `list` find. watch.py built a Host, selected the profiles and discovered
    with them by hand."""
    builders = ("Host", "HostView", "load_profiles", "select_profiles", "discover", "discover_devices",
                "profile_search_path")
    wrong = sorted(f"{module} calls {name}" for name in builders for module in _callers(name)
                   if module.split(".")[1:2] in (["agent"], ["deviceplugin"]))
    assert not wrong, "\n".join(wrong)
    assert "devinject.discovery.node" in import_graph()["devinject.agent.watch"]


def test_each_default_path_is_written_once_in_core_paths() -> None:
    """The state dir, the hook server's socket, the kernel log and the CDI spec dirs by default: one definition each, in
    core/paths.py (the rest name its constants). watch's state dir, the hook client's socket, and the kernel log
    of cli.py and agent/health.py were literals of their own, and help texts spelled them out again."""
    from devinject.core import paths

    values = (paths.DEFAULT_STATE_DIR, paths.HOOK_SOCKET, paths.DEFAULT_KERNEL_LOG, paths.STATIC_SPEC_DIR,
              paths.DYNAMIC_SPEC_DIR)
    found = []
    for module, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        found += [f"{module}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and any(value in node.value for value in values) and module != "devinject.core.paths"]
    assert not found, "\n".join(found)
    assert paths.HOOK_SOCKET.startswith(paths.DEFAULT_STATE_DIR + "/")


def _private_stdlib_imports() -> dict[str, set[str]]:
    """module -> the interpreter's private modules it imports (`_ctypes`, `_json`, `_collections`...)."""
    import sys

    found: dict[str, set[str]] = {}
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top.startswith("_") and top != "__future__" and top in sys.stdlib_module_names:
                    found.setdefault(module, set()).add(top)
    return found


def test_private_cpython_modules_are_the_hook_s_alone() -> None:
    """The hook's start path reaches into CPython's private modules where a benchmark shows the public ones
    cost it (bench/bench_hook_imports.py); the code generate, the agent and the device plugin share uses the
    standard library. `_ctypes`, `_json` and `_collections._tuplegetter` sat in core/."""
    private = _private_stdlib_imports()
    assert {"_ctypes", "_json"} <= set().union(*private.values())  # the walk sees them where they are
    wrong = sorted(f"{module} imports {', '.join(sorted(names))}" for module, names in private.items()
                   if _layer(module) != "hook")
    assert not wrong, "\n".join(wrong)
