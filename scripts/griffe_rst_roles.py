"""Griffe extension for `make docs` (mkdocs.yml): the docstrings cross-reference in
reStructuredText roles (:func:`x`, :class:`~a.b.C`), which Markdown would print
literally; the API reference shows them as code (`x`, `C`)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|data|exc|attr|obj):`(~?)([^`]+)`")


def _code(m: re.Match) -> str:
    name = m.group(2)
    return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"


class RstRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
