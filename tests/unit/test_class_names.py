"""Each class name says what it is: no class subclasses one of its own name (api.Node was a discovery Node
plus the node's live state, under the same name), and no two Protocols share a name (agent/publishers.py's
and dra/driver.py's Publisher meant different things)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "devinject"


def _classes(package: Path) -> list[tuple[str, str, list[str]]]:
    """(module path, class name, the names of its bases) for every class in the package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base).rpartition(".")[2] for base in node.bases]
                found.append((str(path.relative_to(package)), node.name, bases))
    return found


def _same_names(classes: list[tuple[str, str, list[str]]]) -> list[str]:
    protocols = Counter(name for _, name, bases in classes if "Protocol" in bases)
    return sorted({f"{path}: {name} subclasses a {name}" for path, name, bases in classes if name in bases}
                  | {f"{name}: {count} Protocols" for name, count in protocols.items() if count > 1})


def test_no_class_shares_its_name_with_its_base_or_another_protocol() -> None:
    assert _same_names(_classes(PACKAGE)) == []


def test_the_check_sees_both(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("class Node(node.Node): ...\nclass Publisher(Protocol): ...\n")
    (tmp_path / "b.py").write_text("class Publisher(typing.Protocol): ...\n")
    assert _same_names(_classes(tmp_path)) == ["Publisher: 2 Protocols", "a.py: Node subclasses a Node"]


def test_the_former_name_of_the_live_node_still_imports() -> None:
    from devinject import api
    from devinject.discovery import node

    assert api.Node is api.LiveNode and issubclass(api.LiveNode, node.Node) and api.LiveNode is not node.Node
