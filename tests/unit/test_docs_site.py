"""The documentation site (mkdocs.yml): every page in the nav, the API reference over the public API, built in CI.

``mkdocs build --strict`` in ``.ci/run`` is the full check (links, anchors, docstrings rendered; it needs the
``[docs]`` extra); these tests check the same coverage from the sources alone, so they run in the test suite too.
"""

import importlib
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _nav_pages(entries: list) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = _nav_pages(_mkdocs_config()["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] != "data")
    assert sorted(nav) == pages


def _api_blocks() -> set[str]:
    return {m for page in (DOCS / "api").glob("*.md") for m in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M)}


def test_api_reference_covers_the_public_api() -> None:
    from tools.mkdocs_api_coverage import PUBLIC_MODULES

    assert {"lightning_gradcomp", "lightning_gradcomp.compressors", "lightning_gradcomp.callbacks"} <= set(PUBLIC_MODULES)
    blocks = _api_blocks()
    for block in blocks:  # each block names something that exists
        module, _, name = block.rpartition(".")
        target = importlib.import_module(block) if block in PUBLIC_MODULES else getattr(importlib.import_module(module), name)
        assert target is not None, block
    for module_name in PUBLIC_MODULES:
        public = importlib.import_module(module_name)
        names = getattr(public, "__all__", None) or [
            n for n, v in vars(public).items() if not n.startswith("_") and getattr(v, "__module__", None) == module_name]
        assert names, module_name
        # a block for the module renders all of its public names; otherwise each name needs its own block
        uncovered = [n for n in names if module_name not in blocks and f"{module_name}.{n}" not in blocks]
        assert not uncovered, f"{module_name}: {uncovered} have no `:::` block under docs/api/"


def test_ci_builds_the_site_strictly_after_the_lint_step() -> None:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    for needed in ("mkdocs>", "mkdocs-material", "mkdocstrings[python]"):
        assert any(d.startswith(needed) for d in extra), needed
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    # the docs extra comes with the lint extra (one pip call); the site is built after the lint step
    assert ci.index("mkdocs build --strict") > ci.index("mypy") > ci.index('pip install -e ".[lint,docs]"')
    assert _mkdocs_config()["strict"] is True
    assert "mkdocs build --strict" in (ROOT / "README.md").read_text()  # the one local command is documented


def _css_rules(text: str) -> dict[str, dict[str, str]]:
    """selector -> {property: value} of a flat stylesheet (comments dropped; no nesting, as extra.css is)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    rules: dict[str, dict[str, str]] = {}
    for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", text):
        declarations = dict(
            (name.strip(), value.strip()) for name, _, value in (d.partition(":") for d in body.split(";")) if value
        )
        for selector in selectors.split(","):
            rules.setdefault(" ".join(selector.split()), {}).update(declarations)
    return rules


def test_api_parameter_tables_wrap_their_code_cells_instead_of_overflowing() -> None:
    """mkdocstrings' parameter tables (Name, Type, Description, Default) hold code, which Material keeps on one line:
    without these rules a long type pushed the table past the content column at 1280 px and cut the Default column
    (``'terngra``). The site's own stylesheet must let type and default cells wrap, and a table still too wide scroll.
    (A browser's view of it is not in CI; this pins the rules that make it.)"""
    assert "stylesheets/extra.css" in _mkdocs_config()["extra_css"]
    rules = _css_rules((DOCS / "stylesheets" / "extra.css").read_text())
    cells = rules.get(".md-typeset .doc-contents td code", {})
    assert cells.get("overflow-wrap") == "anywhere", f"code in parameter-table cells does not wrap: {cells}"
    tables = rules.get(".md-typeset .doc-contents table:not([class])", {})
    assert tables.get("overflow-x") == "auto" and tables.get("max-width") == "100%", f"wide tables are cut: {tables}"
