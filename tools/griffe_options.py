"""Griffe extension for the API reference: a constructor under ``with_options(X)`` shown with the signature users call.

:func:`lightning_gradcomp.strategies.options.with_options` gives a strategy's ``__init__(self, ..., options: X, ...)``
every field of the options dataclass ``X`` as a named parameter at run time (``inspect.signature``, LightningCLI).
Griffe reads the source, so it would show ``options``; this extension does at documentation time what the decorator
does at run time: the ``options`` parameter is replaced by the fields of ``X`` and of the option classes it extends
(base first, with their annotations and defaults), and the ``options:`` entry of the class docstring by those
classes' ``Args:`` entries. Loaded by mkdocs.yml (``extensions``); the sources are untouched.
"""

import re
from typing import Any, Optional

import griffe

_DECORATOR = "with_options"


def _options_class(init: griffe.Function, pkg: griffe.Module) -> Optional[griffe.Class]:
    """The options dataclass named in ``init``'s ``with_options(X)`` decorator, if it has one."""
    for decorator in init.decorators:
        call = decorator.value
        if isinstance(call, griffe.ExprCall) and str(call.function).endswith(_DECORATOR) and call.arguments:
            path = str(call.arguments[0].canonical_path)  # type: ignore[union-attr]
            target = pkg.modules_collection[path]
            return target if isinstance(target, griffe.Class) else None
    return None


def _lineage(options: griffe.Class) -> list[griffe.Class]:
    """``options`` and the option classes it extends, base first (a dataclass's field order)."""
    chain = [options]
    while chain[-1].resolved_bases:
        base = chain[-1].resolved_bases[0]
        if not isinstance(base, griffe.Class) or base.path.split(".")[0] != options.path.split(".")[0]:
            break
        chain.append(base)
    return chain[::-1]


def _fields(lineage: list[griffe.Class]) -> list[griffe.Parameter]:
    """The dataclass fields of ``lineage`` as parameters: annotated class attributes, in declaration order."""
    fields = []
    for cls in lineage:
        for member in cls.members.values():
            if isinstance(member, griffe.Attribute) and member.annotation is not None and member.parent is cls:
                fields.append(griffe.Parameter(member.name, annotation=member.annotation,
                                               kind=griffe.ParameterKind("positional or keyword"),
                                               default=member.value))
    return fields


def _args_entries(lineage: list[griffe.Class], indent: str) -> str:
    """The ``Args:`` entries of ``lineage``'s docstrings, base first, indented as ``indent``."""
    lines: list[str] = []
    for cls in lineage:
        if cls.docstring is None or "Args:" not in cls.docstring.value:
            continue
        entries = cls.docstring.value.split("Args:", 1)[1].strip("\n").splitlines()
        depth = min(len(line) - len(line.lstrip()) for line in entries if line.strip())
        lines += [indent + line[depth:] if line.strip() else "" for line in entries]
    return "\n".join(lines)


def _expand(cls: griffe.Class, pkg: griffe.Module) -> None:
    init = cls.members.get("__init__")
    if not isinstance(init, griffe.Function):
        return
    options = _options_class(init, pkg)
    if options is None or "options" not in init.parameters:
        return
    lineage = _lineage(options)
    params = list(init.parameters)
    at = next(i for i, p in enumerate(params) if p.name == "options")
    init.parameters = griffe.Parameters(*params[:at], *_fields(lineage), *params[at + 1:])
    if cls.docstring is not None:
        entry = re.compile(r"^(?P<indent>[ \t]+)options: .*?(?=^(?P=indent)\S|^\S|\Z)", re.MULTILINE | re.DOTALL)
        cls.docstring.value = entry.sub(lambda m: _args_entries(lineage, m.group("indent")) + "\n",
                                        cls.docstring.value, count=1)


def _classes(obj: griffe.Object) -> Any:
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Class):
            yield member
        if isinstance(member, (griffe.Module, griffe.Class)):
            yield from _classes(member)


class OptionsSignatures(griffe.Extension):
    """Expands the constructors under ``with_options`` once the package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Expand every ``with_options`` constructor of ``pkg``."""
        for cls in list(_classes(pkg)):
            _expand(cls, pkg)
