"""Public names that moved keep their earlier spelling for one release, with a DeprecationWarning naming the new place."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: (module, old name, new module, new name): every public name that moved since the previous release
MOVED = [
    ("lightning_gradcomp", "Compressor", "lightning_gradcomp.compressors", "Compressor"),
    ("lightning_gradcomp", "Identity", "lightning_gradcomp.compressors", "Identity"),
    ("lightning_gradcomp", "LayerTransform", "lightning_gradcomp.exchange.pipeline", "LayerTransform"),
    ("lightning_gradcomp", "Packet", "lightning_gradcomp.compressors", "Packet"),
    ("lightning_gradcomp", "TernGrad", "lightning_gradcomp.compressors", "TernGrad"),
    ("lightning_gradcomp.weightgrad", "SiteGroups", "lightning_gradcomp.sites.layout", "SiteGroups"),
    ("lightning_gradcomp.weightgrad", "SiteLayout", "lightning_gradcomp.sites.layout", "SiteLayout"),
    ("lightning_gradcomp.weightgrad", "new_site_groups", "lightning_gradcomp.sites.layout", "new_site_groups"),
    ("lightning_gradcomp.weightgrad", "register", "lightning_gradcomp.weightgrad.strategy", "register"),
    ("lightning_gradcomp.weightgrad", "site_layout", "lightning_gradcomp.sites.layout", "site_layout"),
    ("lightning_gradcomp.outer", "register", "lightning_gradcomp.outer.strategy", "register"),
    ("lightning_gradcomp.callbacks", "ExponentialMovingAverage", "gradcomp_lab.ema", "ExponentialMovingAverage"),
    # modules that moved: their names resolve at the old module path
    ("lightning_gradcomp.weightgrad.sites", "site_layout", "lightning_gradcomp.sites.layout", "site_layout"),
    ("lightning_gradcomp.weightgrad.sites", "new_site_groups", "lightning_gradcomp.sites.layout", "new_site_groups"),
    ("lightning_gradcomp.callbacks.ema", "ExponentialMovingAverage", "gradcomp_lab.ema", "ExponentialMovingAverage"),
    ("lightning_gradcomp.callbacks.ema", "tf_ema_avg_fn", "gradcomp_lab.ema", "tf_ema_avg_fn"),
]


@pytest.mark.parametrize(("module", "old", "new_module", "new"), MOVED, ids=[f"{m}.{o}" for m, o, _, _ in MOVED])
def test_a_moved_name_resolves_at_its_old_place_with_a_deprecation_warning(
    module: str, old: str, new_module: str, new: str
) -> None:
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning) as caught:
        exec(f"from {module} import {old}", namespace)  # the spelling of a script written for the earlier release
    assert namespace[old] is getattr(importlib.import_module(new_module), new)
    message = str(caught[0].message)
    assert f"`{module}.{old}` moved to `{new_module}.{new}`" in message and "Fix:" in message, message
    assert caught[0].filename == "<string>"  # attributed to the script's line, where the default filter shows it
    assert old not in getattr(importlib.import_module(module), "__all__", [])  # not a second current spelling


def test_unknown_names_still_raise_attribute_error() -> None:
    import lightning_gradcomp.weightgrad

    with pytest.raises(AttributeError, match="has no attribute 'TernGradd'"):
        lightning_gradcomp.TernGradd  # noqa: B018
    with pytest.raises(ImportError):
        exec("from lightning_gradcomp.weightgrad import no_such_name", {})


def test_a_script_of_the_earlier_release_runs_and_is_told_where_the_names_went() -> None:
    """Run as a script (``__main__``), with Python's default warning filters: the warnings are shown."""
    script = (
        "from lightning_gradcomp import TernGrad\n"
        "from lightning_gradcomp.weightgrad import new_site_groups, site_layout\n"
        "from lightning_gradcomp.callbacks import ExponentialMovingAverage\n"
        "print(TernGrad.__module__, site_layout(4, site_size=2).sizes, ExponentialMovingAverage.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["lightning_gradcomp.compressors.terngrad", "(2,", "2)", "gradcomp_lab.ema"]
    for new_place in ("lightning_gradcomp.compressors.TernGrad", "lightning_gradcomp.sites.layout.new_site_groups",
                      "lightning_gradcomp.sites.layout.site_layout", "gradcomp_lab.ema.ExponentialMovingAverage"):
        assert f"moved to `{new_place}`" in out.stderr, out.stderr[-3000:]
