"""MkDocs hook: the API reference must document every public name, or ``mkdocs build --strict`` fails.

mkdocstrings renders what the ``:::`` blocks under ``docs/api/`` ask for and silently leaves out a name without a
docstring, so a new export would be missing from the site without a warning. After the build this hook reads each
public module's ``__all__`` (statically, with griffe, as mkdocstrings does: no import of torch or the package) and
warns for every name the built pages have no anchor for; ``--strict`` turns the warning into a failed build.
"""

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.api_coverage")

#: the modules whose public names the reference must cover: the package's ``__all__``, its compressors, callbacks,
#: WeightGrad's pieces, DiLoCo's strategy module, the optimizers and the presets (the strategies are in the package's ``__all__``)
PUBLIC_MODULES = (
    "lightning_gradcomp",
    "lightning_gradcomp.compressors",
    "lightning_gradcomp.callbacks",
    "lightning_gradcomp.weightgrad",
    "lightning_gradcomp.optimizers",
    "lightning_gradcomp.strategies.presets",
)


def public_names(module: str, root: Path) -> list[str]:
    """``module``'s ``__all__``, or, without one, the names it defines (not imports) without a leading underscore."""
    import griffe  # mkdocstrings' reader, in the `[docs]` extra; imported here so tests can read PUBLIC_MODULES

    loaded = griffe.load(module, search_paths=[str(root)])
    assert isinstance(loaded, griffe.Module)
    if loaded.exports is not None:
        return [str(name) for name in loaded.exports]
    return [name for name, member in loaded.members.items() if not name.startswith("_") and not member.is_alias]


def missing_names(site_dir: Path, root: Path) -> list[str]:
    """Every public name (``module.name``) without an anchor in the built pages under ``site_dir/api``."""
    html = "".join(page.read_text(encoding="utf-8") for page in (site_dir / "api").rglob("*.html"))
    anchors = set(re.findall(r'id="(lightning_gradcomp[\w.]*)"', html))
    return [f"{module}.{name}" for module in PUBLIC_MODULES for name in public_names(module, root)
            if f"{module}.{name}" not in anchors]


def on_post_build(config: Any, **kwargs: Any) -> None:
    """Warn (an error under ``--strict``) for each public name the API reference leaves out."""
    root = Path(config["config_file_path"]).parent
    for name in missing_names(Path(config["site_dir"]), root):
        log.warning("API reference: %s is public but not documented (a `:::` block under docs/api/ and a docstring "
                    "render it)", name)
