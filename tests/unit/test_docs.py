"""The README and the pages under ``docs/`` describe the product as it is, and everything they cite exists.

Three rules, checked on ``README.md`` and ``docs/*.md`` (the checker is exercised on sample text first, so a rule
that silently matches nothing fails too):

1. **No development-process vocabulary.** Flagged (case-insensitive): "landing", "landings", "landed"; "merged",
   "merging"; an issue of this project's tracker ("issue 8", "issues 17 and 18", "the issue's targets", "#12");
   a branch ("branch `sparsek`", "on another branch", "branches are merged"). The history of the work lives in
   git, not in the pages. External references stay allowed when they name their project: a ``#N`` or "issue N"
   whose preceding 40 characters name PyTorch/torch, Lightning, DeepSpeed, Triton, NCCL, Gloo or GitHub
   ("PyTorch #64665", "Lightning issue 123"), a ``#N`` right after a GitHub ``owner/repo``
   ("pytorch/pytorch#64665"), or one inside a URL. Ordinary words
   ("a branch of the Inception block", "DGC's branches") are not matched: only the patterns above are.
2. **Every cited repository path exists.** A path is a token inside backticks, or a Markdown link target, whose
   first component is a top-level entry of the repository (``docs/``, ``benchmarks/``, ``recipes/``, ...) or
   ``..``, or any backticked token with a ``/`` and a file suffix (``compressors/demo.py`` must be written from
   the root: ``lightning_gradcomp/compressors/demo.py``). Backticked paths are relative to the repository root;
   link targets relative to the page (``[x](img/y.png)`` in ``docs/`` is ``docs/img/y.png``). ``path::test`` is
   checked as ``path``; ``{a,b}`` and ``{1..3}`` are expanded and globs must match something; a placeholder
   (``<label>``, ``NAME``, ``$VAR``) checks the folder before it. URLs and absolute or home paths are not
   repository paths.
3. **Every shown command runs something that exists.** In code blocks and backticks: ``python SCRIPT.py`` (the
   script), ``python -m MODULE`` (importable), ``--config RECIPE`` (the file), and a ``gradcomp*`` console
   script (declared in ``pyproject.toml``).
"""

import importlib.util
import itertools
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_EXTERNAL = re.compile(r"\b(pytorch|torch|lightning|deepspeed|triton|nccl|gloo|github)\b", re.I)
_REPO_REF = re.compile(r"[\w-]+/[\w.-]+$")  # pytorch/pytorch#64665: the repository is named right before the number
_VOCABULARY = [
    (re.compile(r"\b(landings?|landed)\b", re.I), "development history ('landing')"),
    (re.compile(r"\b(merged|merging)\b", re.I), "development history ('merged')"),
    (re.compile(r"\bthe issue(?:'s)?\b(?!\s+(?:of|with|is|that)\b)", re.I), "a reference to our tracker ('the issue')"),
    (re.compile(r"\bbranch(?:es)?\s+`", re.I), "a branch name"),
    (re.compile(r"\b(?:on|from|in|of)\s+(?:this|another|that|a|the|other|each|its)\s+branch\b", re.I), "a branch"),
    (re.compile(r"\bbranch(?:es)?\s+(?:are|is|was|were)\s+merged\b", re.I), "a branch"),
]
_ISSUE = re.compile(r"\bissues?\s+#?\d+(?:\s*(?:,|and|or)\s*#?\d+)*|(?<![\w/&])#\d+\b", re.I)
_URL = re.compile(r"(?:https?://|www\.|github\.com/)\S+")
_CODE_BLOCK = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_BACKTICKS = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_SUFFIX = re.compile(r"\.(md|py|yaml|yml|json|log|png|txt|toml|sh|cpp|h|cfg|ini|csv)$")
_PLACEHOLDER = re.compile(r"[<$]|\b[A-Z][A-Z_]{2,}\b|\.\.\.")


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if not p.name.startswith(".git")} | {".."}


def _expand(pattern: str) -> list[str]:
    """Shell-style brace expansion: ``a_{1..3}`` and ``{x,y}``."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    body = match.group(1)
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    options = [str(i) for i in range(int(span.group(1)), int(span.group(2)) + 1)] if span else body.split(",")
    return [e for option in options for e in _expand(pattern[: match.start()] + option + pattern[match.end():])]


def _path_exists(token: str, base: Path) -> bool:
    token = token.split("::")[0].rstrip(".,;:)")
    placeholder = _PLACEHOLDER.search(token)
    if placeholder:  # `benchmarks/results/lm/<label>.json`: the folder before the placeholder
        token = token[: placeholder.start()].rsplit("/", 1)[0]
    for candidate in _expand(token):
        target = (base / candidate).resolve()
        if any(c in candidate for c in "*?["):
            if not list(base.glob(candidate)):
                return False
        elif not target.exists() or ROOT not in (target, *target.parents):
            return False
    return True


def _is_repo_path(token: str, top: set[str]) -> bool:
    if _URL.match(token) or token.startswith(("/", "~", "-", "http")) or " " in token or "=" in token:
        return False
    first = token.split("/")[0]
    return "/" in token and (first in top or bool(_SUFFIX.search(token.split("::")[0])))


def _commands(text: str) -> list[str]:
    """Candidate command lines: each line of a code block, and each backticked span."""
    lines = [line for block in _CODE_BLOCK.finditer(text) for line in block.group(0).splitlines()[1:-1]]
    return lines + _BACKTICKS.findall(_CODE_BLOCK.sub("", text))


def _command_problems(command: str, scripts: set[str]) -> list[str]:
    command = command.split("#")[0] if " #" in command else command
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    problems = []
    for i, word in enumerate(words):
        following = words[i + 1] if i + 1 < len(words) else ""
        if re.fullmatch(r"python3?", word) and following == "-m" and i + 2 < len(words):
            module = words[i + 2]
            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                problems.append(f"module `{module}` does not exist")
        elif re.fullmatch(r"python3?", word) and following.endswith(".py") and not _PLACEHOLDER.search(following):
            if not (ROOT / following).is_file():
                problems.append(f"script `{following}` does not exist")
        elif word == "--config" and following:
            if not _path_exists(following, ROOT):
                problems.append(f"recipe `{following}` does not exist")
        elif i == 0 and re.fullmatch(r"gradcomp(?:-[a-z]+)*", word) and word not in scripts:
            problems.append(f"console script `{word}` is not declared in pyproject.toml")
    return problems


def check(text: str, page: Path) -> list[str]:
    """Every problem of one page's text, as ``line N: what``."""
    top = _top_level()
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        plain = _URL.sub("", line)
        for pattern, what in _VOCABULARY:
            for match in pattern.finditer(plain):
                problems.append(f"line {number}: {what}: {match.group(0)!r}")
        for match in _ISSUE.finditer(plain):
            before = plain[max(0, match.start() - 40): match.start()]
            if not (_EXTERNAL.search(before) or (match.group(0).startswith("#") and _REPO_REF.search(before))):
                problems.append(f"line {number}: an issue number of our tracker: {match.group(0)!r}")
        for span in _BACKTICKS.findall(line):
            for token in span.split():
                if _is_repo_path(token, top) and not _path_exists(token, ROOT):
                    problems.append(f"line {number}: cites `{token}`, which is not in the repository")
        for target in _LINK.findall(line):
            target = target.split("#")[0]
            if target and not _URL.match(target) and not target.startswith("mailto:"):
                if not _path_exists(target, page.parent):
                    problems.append(f"line {number}: links to {target}, which is not in the repository")
    for command in _commands(text):
        problems.extend(f"command `{command.strip()}`: {p}" for p in _command_problems(command, scripts))
    return problems


def test_the_checker_flags_each_rule_and_passes_legitimate_text() -> None:
    page = ROOT / "docs" / "sample.md"
    bad = {
        "Third landing: faster": "landing",
        "Re-measured on merged `main`": "merged",
        "as asked in issue 8, part 4": "issue number",
        "see #12 for the plan": "issue number",
        "## Hierarchical exchange (`lightning_gradcomp/sites/hierarchy.py`, issue 18)": "issue number",
        "Gradient Dropping on the fused kernels (branch `sparsek`)": "branch",
        "the launcher is on another branch": "branch",
        "the issue's targets": "the issue",
        "see `docs/nonexistent.md`": "not in the repository",
        "data in `../shared/notes.md`": "not in the repository",
        "![plot](img/nothing_here.png)": "not in the repository",
        "```bash\npython benchmarks/nothing_here.py --x\n```": "script",
        "```bash\ngradcomp fit --config recipes/nothing_here.yaml\n```": "recipe",
        "run `python -m gradcomp_lab.nothing_here`": "module",
        "run `gradcomp-nothing --help`": "console script",
    }
    for text, what in bad.items():
        problems = check(text, page)
        assert problems and what in " ".join(problems), (text, problems)
    good = [
        "PyTorch #64665 tracks it; see pytorch/pytorch#64665 and https://github.com/x/y/issues/3",
        "Inception's 5x5 branches; DGC's branches are taken; the issue of scale",
        "see `docs/design.md`, [perf](performance.md), ![fig](img/fig5a.png), `tests/unit/test_docs.py::test_x`",
        "`benchmarks/results/lm/<label>.json` and `benchmarks/results/step_time_target_default_{1..8}.json`",
        "```bash\npython benchmarks/lm.py --saved\ngradcomp fit --config recipes/quickstart.yaml\n```",
        "`python -m gradcomp_lab.emulate --nproc 2` and `gradcomp-perf --help`",
    ]
    for text in good:
        assert check(text, ROOT / "docs" / "sample.md") == [], text


def test_readme_and_docs_have_no_history_no_missing_file_and_no_dead_command() -> None:
    assert len(PAGES) > 10
    problems = [f"{page.relative_to(ROOT)}: {p}" for page in PAGES for p in check(page.read_text(), page)]
    assert problems == []


def test_brace_expansion() -> None:
    assert _expand("a_{1..3}.json") == ["a_1.json", "a_2.json", "a_3.json"]
    assert list(itertools.chain(_expand("{x,y}_{1..2}"))) == ["x_1", "x_2", "y_1", "y_2"]


def test_generated_tables_in_the_pages_equal_what_the_stored_results_print(capsys: pytest.CaptureFixture[str]) -> None:
    """Each ``<!-- results:NAME -->`` block is ``tools/results_tables.py``'s rendering of the stored runs: a page
    cannot drift from its data (``python tools/results_tables.py --write`` regenerates them)."""
    from tools import results_tables

    pages = results_tables._pages_with_blocks()
    names = {m.group(2) for text in pages.values() for m in results_tables.BLOCK.finditer(text)}
    # the key tables are in the pages, and every block names a known table
    key = {"lm-long-best", "step-time-grid", "diloco", "choosing-transformer", "choosing-cnn", "model-parameters",
           "sparse-fashion-mnist", "repro-terngrad-lenet", "repro-graddrop", "repro-graddrop-longer",
           "repro-graddrop-variants", "repro-adacomp", "repro-weightgrad"}
    assert key <= names <= {t.name for t in results_tables.TABLES}
    assert results_tables.main(["--check"]) == 0, capsys.readouterr().out


def test_the_check_sees_a_changed_number_and_the_write_restores_it() -> None:
    from tools import results_tables

    page = ROOT / "docs" / "transformers.md"
    text = page.read_text()
    assert "| demo |" in text
    drifted = text.replace("| demo |", "| demo | 0.0 |", 1)
    rendered = {t.name: results_tables.render(t) for t in results_tables.TABLES}
    assert results_tables.rewrite(drifted, rendered) == text != drifted
