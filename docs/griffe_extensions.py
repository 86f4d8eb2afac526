"""A griffe extension for the API reference: memfit's docstrings title their examples ``Example:``
(the style guide's word); griffe's Google parser reads only ``Examples:`` as the section whose ``>>>``
lines are code, and would render ``Example:`` as an admonition of plain Markdown. This reads the one
as the other, for the docs only; the docstrings stay as they are."""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
