"""Private torch APIs are used through ``cloudckpt._torch_compat`` only: a torch
upgrade is checked in one file."""

from __future__ import annotations

import ast
import pathlib

import cloudckpt
from cloudckpt import _torch_compat

PACKAGE = pathlib.Path(cloudckpt.__file__).parent
# modules that still import a private torch name themselves, until they import it from
# _torch_compat (remove each entry with that change)
PENDING: set[str] = set()


def _private_torch_uses(path: pathlib.Path) -> list[str]:
    """``from torch... import _x`` / imports from a private torch module / ``torch...._x``."""
    tree = ast.parse(path.read_text(), str(path))
    torch_names = {"torch"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                torch_names.add(alias.asname or alias.name)
                if private_module or alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_torch_compat_uses_a_private_torch_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_torch_compat.py" or rel in PENDING:
            continue
        found += _private_torch_uses(path)
    assert found == [], ("import these from cloudckpt._torch_compat (with the torch versions checked):\n"
                         + "\n".join(found))


def test_the_scan_finds_what_torch_compat_holds():
    """The scan above can fail: it sees every private name _torch_compat imports."""
    found = _private_torch_uses(PACKAGE / "_torch_compat.py")
    assert len(found) == 14, found


def test_every_entry_of_torch_compat_resolves_and_says_what_it_was_checked_against():
    text = (PACKAGE / "_torch_compat.py").read_text()
    for name in _torch_compat.__all__:
        assert getattr(_torch_compat, name) is not None
    assert text.count("checked: 2.13") == len(_torch_compat.__all__)
