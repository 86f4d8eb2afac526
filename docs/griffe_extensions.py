"""A griffe extension for the API reference: memfit's docstrings follow the Google style with a few
Sphinx habits that griffe's Google parser does not read. For the docs only (the docstrings stay as
they are):

- ``Example:`` (the style guide's word) is read as griffe's ``Examples:`` section, whose ``>>>`` lines
  are code; otherwise it is an admonition of plain Markdown.
- Sphinx roles (``:func:`memfit.profile```, ``:class:`~memfit.plan.Plan```) become code spans, as
  Sphinx would show them (``~`` keeps the last name); Markdown would print the role as written.
"""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:$", re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    name = m.group(2)
    return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"


class DocstringStyle(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_role, _EXAMPLE.sub(r"\1Examples:", obj.docstring.value))
