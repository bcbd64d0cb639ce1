"""First-line errors for the ``gradcomp`` CLI: the option, the value and the fix, not jsonargparse's nested report.

A typo deep in a YAML file (a compressor option, a ``class_path``, a string where a list belongs) makes jsonargparse
report every alternative of every ``Union`` on the way down: dozens of lines whose first one names only
``trainer.strategy``. :func:`summarize` walks that report to its deepest cause and says it in one line.

A value that parses but that a constructor refuses (``sync_every: 0``, ``warmup_steps`` past ``max_steps``, a
misspelt compressor name) raises our own ``Expected `name` ... Fix: ...`` message inside jsonargparse's traceback;
:func:`instantiation_error` finds it and names the option by its full key in the configuration.
"""

import ast
import importlib
import inspect
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional

from lightning_gradcomp.registry import did_you_mean

_KEY = re.compile(r'^Parser key "([^"]+)":$')
_CLASS = re.compile(r"^(?:- )?Problem with given class_path '([^']+)':$")
_OPTION = re.compile(r"^Option '([^']+)' is not accepted$")
_IMPORT = re.compile(r"^(?:module '[^']+' has no attribute '[^']+'|No module named .*|Import path .*)$")
_DOTTED = re.compile(r"^(?:- )?Expected a dot import path string: (.*)$")
#: a Union's alternative that the value is not (``- Expected a <class 'str'>``): the weakest cause
_EXPECTED = re.compile(r"^- Expected a (.+?)(?:\. Got value: (.*))?$")
#: the key's own type, with the value (``Expected a <class 'float'>. Got value: two``)
_OWN_TYPE = re.compile(r"^Expected a (.+?)\. Got value: (.*)$")
#: an alternative that says what it wanted (``- Not of type timedelta: Expected a string with form "h:m:s" ...``)
_NOT_OF_TYPE = re.compile(r"^- Not of type (\w+): (.*)$")
_GIVEN = re.compile(r"^Given value: (.*)$")
_NESTED_ARG = re.compile(r"^NestedArg\(key='[^']*', val=(.*)\)$")
#: our constructors' messages (lightning_gradcomp.validation): ``Expected `name` to be ..., but got .... Fix: ...``
_OWN_MESSAGE = re.compile(r"(Expected `([A-Za-z_]\w*)`.*\bFix: .*)$")
_BACKTICKED = re.compile(r"`([A-Za-z_]\w*)`")


def _signature(class_path: str) -> dict[str, inspect.Parameter]:
    try:
        module, name = class_path.rsplit(".", 1)
        target = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(target).parameters
    except Exception:  # only for the suggestion: an unimportable class has no options to suggest
        return {}
    return {n: p for n, p in parameters.items() if n not in ("self", "args", "kwargs")}


def _parameters(class_path: str) -> list[str]:
    return list(_signature(class_path))


def _importable_near(class_path: str) -> list[str]:
    if "." not in class_path:  # a bare class name: the packages whose classes a recipe names
        modules = ["lightning_gradcomp", "lightning_gradcomp.compressors", "lightning_gradcomp.callbacks"]
    else:
        modules = [class_path.rsplit(".", 1)[0]]
    near: list[str] = []
    for module in modules:
        try:
            names = [n for n in dir(importlib.import_module(module)) if n[:1].isupper()]
        except Exception:
            continue
        near += [f"{module}.{n}" for n in names]
    return near


def _did_you_mean_class(bad: str) -> str:
    near = _importable_near(bad)
    if "." in bad:
        return did_you_mean(bad, near)
    # compare the class names alone: 'TernGrads' against 'TernGrad', not against the full paths
    by_name = {path.rsplit(".", 1)[1]: path for path in near}
    close = did_you_mean(bad, by_name)
    match = re.match(r"did you mean '([^']+)'", close)
    return f"did you mean {by_name[match.group(1)]!r}? " if match else ""


def _dotted(path: list[tuple[str, str]]) -> str:
    parts: list[str] = []
    for kind, name in path:
        if kind == "key":
            parts.append(name)
        elif kind == "class":
            parts.append("init_args")
    return ".".join(parts)


def _literal(text: str) -> Any:
    match = _NESTED_ARG.match(text)  # a command-line value: `--a.b.c=v` reaches the report as NestedArg(key, val)
    if match:
        text = match.group(1)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _type_name(expected: str) -> str:
    """``<class 'float'>`` -> ``float``; ``collections.abc.Sequence[str]`` -> ``Sequence[str]``."""
    match = re.match(r"^<class '([^']+)'>$", expected)
    name = match.group(1) if match else expected
    return re.sub(r"\b(?:[a-z_][\w]*\.)+", "", name)


def _choices(expected: str) -> Optional[list[Any]]:
    match = re.match(r"^(?:typing\.)?Literal\[(.*)\]$", expected)
    if not match:
        return None
    choices = _literal(f"[{match.group(1)}]")
    return choices if isinstance(choices, list) else None


def _type_fix(expected: str, value: Any, option: str, default: Any) -> str:
    """The fix for a value of the wrong type: how to write one of the expected type in YAML."""
    name = _type_name(expected)
    shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default  # as YAML
    example = f" (its default: `{option}: {shown}`)" if default is not inspect.Parameter.empty else ""
    if name.startswith("Sequence") or name.startswith(("list", "tuple")):
        return f"write a YAML list, e.g. `{option}: [{value!r}]`" if isinstance(value, str) else "write a YAML list"
    if name in ("float", "int"):
        return f"write {'an integer' if name == 'int' else 'a number'}{example}"
    if name == "bool":
        return f"write true or false{example}"
    return f"give a value of that type{example}"


class _Cause:
    """The deepest problem found in a report: where it is and what it says."""

    def __init__(self, rank: int, kind: str, path: list[tuple[str, str]], expected: str, given: str) -> None:
        self.rank, self.kind, self.path, self.expected, self.given = rank, kind, path, expected, given

    def beats(self, other: Optional["_Cause"]) -> bool:
        # deeper first (the cause, not the Unions it travelled through), then the more specific kind
        return other is None or (len(self.path), self.rank) > (len(other.path), other.rank)

    def owner(self) -> Optional[str]:
        """The class whose option this is (the innermost ``class_path`` above the key)."""
        classes = [n for k, n in self.path if k == "class"]
        return classes[-1] if classes else None

    def default(self) -> Any:
        owner = self.owner()
        parameter = _signature(owner).get(self.path[-1][1]) if owner and self.path[-1][0] == "key" else None
        return inspect.Parameter.empty if parameter is None else parameter.default


def _next_given(lines: list[str]) -> str:
    return next((g.group(1) for g in map(_GIVEN.match, (ln.strip() for ln in lines)) if g), "")


def summarize(message: str) -> Optional[str]:
    """One line naming the option, the value and the fix for the deepest cause in a jsonargparse report.

    Returns ``None`` when the report has no nested cause this function recognises (the caller shows it as it is).
    """
    lines = message.splitlines()
    stack: list[tuple[int, str, str]] = []  # (indent, "key" | "class", name)
    best: Optional[_Cause] = None
    for i, raw in enumerate(lines):
        indent = len(raw) - len(raw.lstrip(" "))
        text = raw.strip()
        if text.startswith("error: "):
            text = text[len("error: "):]
        while stack and stack[-1][0] >= indent:  # a line closes every entry at its own indent or deeper
            stack.pop()
        path = [(k, n) for _, k, n in stack]
        cause: Optional[_Cause] = None
        if m := _KEY.match(text):
            stack.append((indent, "key", m.group(1)))
            continue
        elif m := _CLASS.match(text):
            stack.append((indent, "class", m.group(1)))
            continue
        elif m := _OPTION.match(text):
            cause = _Cause(3, "option", path, m.group(1), _next_given(lines[i + 1:]))
        elif m := _DOTTED.match(text):
            cause = _Cause(3, "import", path, "a dot import path", m.group(1))
        elif _IMPORT.match(text):
            bad = path[-1][1] if path and path[-1][0] == "class" else "?"
            cause = _Cause(3, "import", path, text, bad)
        elif m := _OWN_TYPE.match(text):
            cause = _Cause(3, "type", path, m.group(1), m.group(2))
        elif m := _NOT_OF_TYPE.match(text):
            cause = _Cause(2, "detail", path, m.group(1), f"{m.group(2)}\0{_next_given(lines[i + 1:])}")
        elif m := _EXPECTED.match(text):
            cause = _Cause(1, "type", path, m.group(1), m.group(2) or _next_given(lines[i + 1:]))
        if cause is not None and cause.beats(best):
            best = cause
    if best is None or len(best.path) < 2:
        return None  # a top-level mistake: jsonargparse's own one-line message already names it
    return _say(best)


def _say(cause: _Cause) -> str:
    path = cause.path
    if cause.kind == "option":
        owner = cause.owner() or "the class"
        options = _parameters(owner)
        block = _literal(cause.given)
        value = block.get("init_args", {}).get(cause.expected) if isinstance(block, dict) else block
        return (
            f"Expected `{_dotted(path)}.{cause.expected}` to be an option of {owner}, but it has no option "
            f"{cause.expected!r} (given {value!r}). Fix: {did_you_mean(cause.expected, options)}its options are {options}."
        )
    if cause.kind == "import":
        if path and path[-1][0] == "class":
            where, bad, detail = _dotted(path[:-1]), path[-1][1], f" ({cause.expected})"
        else:  # a bare class name, not a dotted path
            where, bad, detail = _dotted(path), cause.given, ""
        return (
            f"Expected `{where}.class_path` to name an importable class, but got {bad!r}{detail}. "
            f"Fix: {_did_you_mean_class(bad)}give the full import path, e.g. 'lightning_gradcomp.compressors.TernGrad'."
        )
    option, key = _dotted(path), path[-1][1]
    if cause.kind == "detail":  # e.g. a duration written as a number of seconds
        detail, given = cause.given.split("\0")
        value = _literal(given)
        if cause.expected == "timedelta":
            example = str(timedelta(seconds=value)) if isinstance(value, (int, float)) else "0:30:00"
            return (
                f"Expected `{option}` to be a duration \"h:m:s\" or \"d days, h:m:s\", but got {value!r}. "
                f"Fix: write it as a string, e.g. `{key}: '{example}'`"
                + (f" ({value} seconds)." if isinstance(value, (int, float)) else ".")
            )
        return f"Expected `{option}` to be a {cause.expected}, but got {value!r} ({detail}). Fix: give a {cause.expected}."
    value = _literal(cause.given)
    choices = _choices(cause.expected)
    if choices is not None:
        return (
            f"Expected `{option}` to be one of {choices}, but got {value!r}. "
            f"Fix: {did_you_mean(str(value), [str(c) for c in choices])}write one of {choices}."
        )
    return (
        f"Expected `{option}` to be a {_type_name(cause.expected)}, but got {value!r}. "
        f"Fix: {_type_fix(cause.expected, value, key, cause.default())}."
    )


def _options(node: Any, prefix: str = "", owner: Optional[str] = None) -> list[tuple[str, Optional[str]]]:
    """Every option of a parsed configuration: (full key, the ``class_path`` whose ``init_args`` hold it)."""
    found: list[tuple[str, Optional[str]]] = []
    if isinstance(node, Mapping) and isinstance(node.get("class_path"), str) and isinstance(node.get("init_args"), Mapping):
        for key, value in node["init_args"].items():
            full = f"{prefix}init_args.{key}"
            found += [(full, node["class_path"]), *_options(value, full + ".", node["class_path"])]
    elif isinstance(node, Mapping):
        for key, value in node.items():
            full = f"{prefix}{key}"
            found += [(full, owner), *_options(value, full + ".", owner)]
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _options(value, f"{prefix}{index}.", owner)
    return found


def instantiation_error(report: str, config: Mapping[str, Any], links: Mapping[str, str]) -> Optional[str]:
    """Our constructor's ``Expected `name` ... Fix: ...`` message in ``report`` with the option's full key.

    Args:
        report: the text of the exception (and of its causes) that instantiating the configuration raised.
        config: the parsed configuration of the subcommand, as nested dicts.
        links: linked keys, target -> source (the source is what a user sets).

    Returns:
        The message with every option it names written as its full key (``sync_every`` ->
        ``trainer.strategy.init_args.sync_every``), or ``None`` when the report holds no such message.
    """
    message: Optional[str] = None
    for raw in report.splitlines():
        match = _OWN_MESSAGE.search(raw.strip())
        if match:
            message, name = match.group(1), match.group(2)
            break
    if message is None:
        return None
    options = _options(config)
    candidates = [(key, owner) for key, owner in options if key.rsplit(".", 1)[-1] == name]
    # the class that refused the value is in the report (jsonargparse shows the value it tried to instantiate)
    mentioned = [key for key, owner in candidates if owner is not None and f"'{owner}'" in report]
    keys_named = mentioned or [key for key, _ in candidates]
    if not keys_named:
        return message
    full = min(keys_named, key=lambda key: key.count("."))
    block = full.rsplit(".", 1)[0] + "." if "." in full else ""
    keys = {key for key, _ in options}

    def qualify(match: "re.Match[str]") -> str:
        key = block + match.group(1)
        return f"`{links.get(key, key)}`" if key in keys else match.group(0)

    return _BACKTICKED.sub(qualify, message)
