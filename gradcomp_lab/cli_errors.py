"""First-line errors for the ``gradcomp`` CLI: the option, the value and the fix, not jsonargparse's nested report.

A typo deep in a YAML file (a compressor option, a ``class_path``, a string where a list belongs) makes jsonargparse
report every alternative of every ``Union`` on the way down: dozens of lines whose first one names only
``trainer.strategy``. :func:`summarize` walks that report to its deepest cause and says it in one line.
"""

import ast
import importlib
import inspect
import re
from typing import Any, Optional

from lightning_gradcomp.registry import did_you_mean

_KEY = re.compile(r'^Parser key "([^"]+)":$')
_CLASS = re.compile(r"^(?:- )?Problem with given class_path '([^']+)':$")
_OPTION = re.compile(r"^Option '([^']+)' is not accepted$")
_IMPORT = re.compile(r"^(?:module '[^']+' has no attribute '[^']+'|No module named .*|Import path .*)$")
_EXPECTED = re.compile(r"^- Expected a <class '([^']+)'>$")
_GIVEN = re.compile(r"^Given value: (.*)$")


def _parameters(class_path: str) -> list[str]:
    try:
        module, name = class_path.rsplit(".", 1)
        target = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(target).parameters if p not in ("self", "args", "kwargs")]
    except Exception:  # only for the suggestion: an unimportable class has no options to suggest
        return []


def _importable_near(class_path: str) -> list[str]:
    module = class_path.rsplit(".", 1)[0]
    try:
        names = [n for n in dir(importlib.import_module(module)) if n[:1].isupper()]
    except Exception:
        return []
    return [f"{module}.{n}" for n in names]


def _dotted(path: list[tuple[str, str]]) -> str:
    parts: list[str] = []
    for kind, name in path:
        if kind == "key":
            parts.append(name)
        elif kind == "class":
            parts.append("init_args")
    return ".".join(parts)


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def summarize(message: str) -> Optional[str]:
    """One line naming the option, the value and the fix for the deepest cause in a jsonargparse report.

    Returns ``None`` when the report has no nested cause this function recognises (the caller shows it as it is).
    """
    lines = message.splitlines()
    stack: list[tuple[int, str, str]] = []  # (indent, "key" | "class", name)
    best: Optional[tuple[int, int, str, list[tuple[str, str]], str]] = None  # (depth, rank, kind, path, detail)
    for i, raw in enumerate(lines):
        indent = len(raw) - len(raw.lstrip(" "))
        text = raw.strip()
        if text.startswith("error: "):
            text = text[len("error: "):]
        while stack and stack[-1][0] >= indent:  # a line closes every entry at its own indent or deeper
            stack.pop()
        path = [(k, n) for _, k, n in stack]
        found: Optional[tuple[int, str, str]] = None  # (rank: a specific cause beats a type mismatch, kind, detail)
        if m := _KEY.match(text):
            stack.append((indent, "key", m.group(1)))
            continue
        if m := _CLASS.match(text):
            stack.append((indent, "class", m.group(1)))
            continue
        if m := _OPTION.match(text):
            given = next((g.group(1) for g in map(_GIVEN.match, (ln.strip() for ln in lines[i + 1:])) if g), "")
            found = (2, "option", f"{m.group(1)}\0{given}")
        elif _IMPORT.match(text):
            found = (2, "import", text)
        elif m := _EXPECTED.match(text):
            given = next((g.group(1) for g in map(_GIVEN.match, (ln.strip() for ln in lines[i + 1:])) if g), "")
            found = (1, "type", f"{m.group(1)}\0{given}")
        if found is not None and (best is None or (len(path), found[0]) > (best[0], best[1])):
            best = (len(path), found[0], found[1], path, found[2])
    if best is None or best[0] < 2:
        return None  # a top-level mistake: jsonargparse's own one-line message already names it
    _, _, kind, path, detail = best
    classes = [n for k, n in path if k == "class"]
    if kind == "option":
        option, given = detail.split("\0")
        owner = classes[-1] if classes else "the class"
        options = _parameters(owner)
        block = _literal(given)
        value = block.get("init_args", {}).get(option) if isinstance(block, dict) else None
        return (
            f"Expected `{_dotted(path)}.{option}` to be an option of {owner}, but it has no option {option!r} "
            f"(given {value!r}). Fix: {did_you_mean(option, options)}its options are {options}."
        )
    if kind == "import":
        bad = path[-1][1] if path and path[-1][0] == "class" else "?"
        where = _dotted(path[:-1]) if path and path[-1][0] == "class" else _dotted(path)
        return (
            f"Expected `{where}.class_path` to name an importable class, but got {bad!r} ({detail}). "
            f"Fix: {did_you_mean(bad, _importable_near(bad))}give the full import path, e.g. 'lightning_gradcomp.compressors.TernGrad'."
        )
    expected, given = detail.split("\0")
    value = _literal(given)
    fix = "give a value of that type"
    if expected.endswith("Sequence") or expected in ("list", "tuple"):
        fix = f"write a YAML list, e.g. `{path[-1][1]}: [{value!r}]`" if isinstance(value, str) else "write a YAML list"
    return f"Expected `{_dotted(path)}` to be a {expected.rsplit('.', 1)[-1]}, but got {value!r}. Fix: {fix}."
