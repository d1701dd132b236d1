"""A griffe extension for the API reference: the code's docstrings cite names with Sphinx roles
(``:class:`Trainer```, ``:func:`~embedtrain.fit```), which Markdown would print as written. Each
role becomes a code span of the name (``~`` drops the module path, as Sphinx shows it); the
docstrings stay readable in ``help()`` and editors, which show the roles as text."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const|ref):"
                  r"`(~?)([^`<]+?)(?: <[^`]+>)?`")


def plain(text: str) -> str:
    """``text`` with every Sphinx role written as a Markdown code span of its target."""
    def span(m: re.Match) -> str:
        name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
        return f"`{name}`"

    return ROLE.sub(span, text)


class ReSTRoles(griffe.Extension):
    """Rewrites the roles of every docstring griffe loads (see the module's docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: D102
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
