"""Griffe extension for the API reference: Sphinx roles in the docstrings shown as code, not as raw markup.

The docstrings cross-reference with Sphinx roles (``:class:`~lightning_gradcomp.compressors.Compressor```), which
mkdocstrings' Google-style parser leaves as text. This turns each into the code span Sphinx would have shown: the
last component with ``~``, the whole path without. Loaded by mkdocs.yml (``extensions``); the sources are untouched.
"""

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const|ref):`(~?)([^`]+)`")


def _as_code(match: "re.Match[str]") -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites each object's docstring as it is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Replace the roles in ``obj``'s docstring by code spans."""
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
