"""A number the pages state twice is the same number.

The README's headline states each compressor's loss against DDP and its bytes ratio at its best setting (``int8
-1.5 % at 4.0x``); [Transformers]'s ``lm-long-best`` table and [Choosing]'s transformer table state them again.
Each page's statements are read into ``(compressor, quantity) -> value`` (a range, ``+0.1 to +1.8 %``, is an
interval) and every two pages that state the same thing must agree: equal values, or a value inside a range. The
readers are exercised on sample text first, so a page that stops stating a number (or a reader that matches
nothing) fails too. docs/monitoring.md's setup line is compared with what the quickstart's strategy logs.
"""

import logging
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (low, high): a number as printed (low == high), or a range
Interval = tuple[float, float]
Claims = dict[tuple[str, str], Interval]

_ITEM = re.compile(r"(?P<who>\S+)(?: \([^)]*\))? (?P<loss>[+-]\d+\.\d) % at (?P<ratio>\d+(?:\.\d+)?)x")
_NUMBER = re.compile(r"^(?P<low>[+-]?\d+(?:\.\d+)?)(?: to (?P<high>[+-]?\d+(?:\.\d+)?))? ?[%x]?$")


def _block(text: str, name: str) -> str:
    """A generated block's text (between ``<!-- results:NAME -->`` and its end marker)."""
    match = re.search(rf"<!-- results:{re.escape(name)} -->(.*?)<!-- /results:{re.escape(name)} -->", text, re.S)
    assert match, f"no `results:{name}` block"
    return match.group(1)


def _rows(block: str) -> Iterator[list[str]]:
    """The cells of each body row of a Markdown table."""
    for line in block.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            yield [cell.strip() for cell in line.strip().strip("|").split("|")]


def _interval(cell: str) -> Interval:
    """``-1.5 %``, ``-1.5%``, ``4.0x`` or ``+0.1 to +1.8 %`` (a footnote mark such as ``(g)`` dropped)."""
    text = re.sub(r"\s*\([a-z]\)$", "", cell.strip())
    match = _NUMBER.match(text)
    assert match, f"not a number: {cell!r}"
    low = float(match.group("low"))
    return low, float(match.group("high") or low)


def headline_claims(readme: str) -> Claims:
    """The README headline's ``<compressor> <loss> % at <ratio>x`` items (keyed by the lower-cased name)."""
    claims: Claims = {}
    row = next(cells for cells in _rows(_block(readme, "headline")) if "best setting" in cells[0])
    for item in row[1].split("; "):
        match = _ITEM.fullmatch(item)
        if match:
            who = match.group("who").lower()
            claims[(who, "loss vs DDP, %")] = _interval(match.group("loss"))
            claims[(who, "fewer bytes, x")] = _interval(match.group("ratio"))
    return claims


def best_table_claims(transformers: str) -> Claims:
    """[Transformers]' ``lm-long-best`` rows: the mean loss against DDP and the bytes ratio of each compressor."""
    claims: Claims = {}
    for cells in _rows(_block(transformers, "lm-long-best")):
        if cells[0] != "compressor":
            claims[(cells[0], "loss vs DDP, %")] = _interval(cells[3])
            claims[(cells[0], "fewer bytes, x")] = _interval(cells[4])
    return claims


def choosing_claims(choosing: str, names: set[str]) -> Claims:
    """[Choosing]'s transformer rows that recommend one of ``names`` (a compressor, not DiLoCo with it): the loss and
    bytes of that compressor (the last of ``0; -1.5 %``, after DDP's)."""
    claims: Claims = {}
    for cells in _rows(_block(choosing, "choosing-transformer")):
        use = cells[2]
        found = [n for n in names if re.search(rf"\b{re.escape(n)}\b", use, re.I)]
        if cells[0] == "link" or "DiLoCo" in use or len(found) != 1:
            continue
        for quantity, cell in (("loss vs DDP, %", cells[3]), ("fewer bytes, x", cells[4])):
            value = _interval(cell.split(";")[-1])
            key = (found[0], quantity)
            # the same compressor recommended on several links: one statement, which must not differ either
            assert claims.setdefault(key, value) == value, f"{key} differs between Choosing's rows"
    return claims


def disagreements(pages: dict[str, Claims]) -> list[str]:
    """Every claim two pages state with values that cannot both hold."""
    problems = []
    keys = sorted({key for claims in pages.values() for key in claims})
    for key in keys:
        stated = [(page, claims[key]) for page, claims in pages.items() if key in claims]
        for i, (page_a, (low_a, high_a)) in enumerate(stated):
            for page_b, (low_b, high_b) in stated[i + 1:]:
                if max(low_a, low_b) > min(high_a, high_b):
                    problems.append(f"{key[0]} {key[1]}: {page_a} says {low_a:g}..{high_a:g}, "
                                    f"{page_b} says {low_b:g}..{high_b:g}")
    return problems


def _pages() -> dict[str, Claims]:
    readme = headline_claims((ROOT / "README.md").read_text())
    names = {who for who, _ in readme}
    return {
        "README.md": readme,
        "docs/transformers.md": best_table_claims((ROOT / "docs" / "transformers.md").read_text()),
        "docs/choosing.md": choosing_claims((ROOT / "docs" / "choosing.md").read_text(), names),
    }


_SAMPLE_README = """<!-- results:headline -->
| what | result | hardware | page |
| --- | --- | --- | --- |
| Transformer with AdamW: loss against DDP's at each compressor's best setting | int8 -1.5 % at 4.0x; TernGrad (per-64 scalers) +1.1 % at 4.3x; 1-bit Adam -4.3 % and 0/1 Adam -0.3 % at 4.6x and 5.7x fewer bytes | CPU | x |
<!-- /results:headline -->"""
_SAMPLE_CHOOSING = """<!-- results:choosing-transformer -->
| link | goal | use | loss vs DDP | bytes | step / DDP's (here) | speed-up (projected) |
| --- | --- | --- | --- | --- | --- | --- |
| 1 Gbit/s | DDP's loss | `"ddp"` here; `"int8"` on GPUs | 0; {int8} | 1x; 4.0x | 1; not run | 1x; 3.8x |
| 1 Gbit/s | fewer bytes | TernGrad per-64 (a) | +0.1 to +1.8 % | 4.3x | 1.08 (b) | 6.1x (h) |
| 100 Mbit/s | most bytes | DiLoCo, int8, H = 50 (e) | +24.1 % | 200x | 0.44 | 164x |
<!-- /results:choosing-transformer -->"""


def test_the_readers_find_the_claims_and_report_two_that_differ() -> None:
    readme = headline_claims(_SAMPLE_README)
    assert readme == {("int8", "loss vs DDP, %"): (-1.5, -1.5), ("int8", "fewer bytes, x"): (4.0, 4.0),
                      ("terngrad", "loss vs DDP, %"): (1.1, 1.1), ("terngrad", "fewer bytes, x"): (4.3, 4.3)}
    names = {who for who, _ in readme}
    agreeing = choosing_claims(_SAMPLE_CHOOSING.format(int8="-1.5 % (g)"), names)
    assert agreeing[("int8", "loss vs DDP, %")] == (-1.5, -1.5)  # DDP's 0 and the footnote mark are not the claim
    assert agreeing[("terngrad", "loss vs DDP, %")] == (0.1, 1.8)  # a range; DiLoCo's row is not int8's
    assert disagreements({"README": readme, "choosing": agreeing}) == []
    differing = choosing_claims(_SAMPLE_CHOOSING.format(int8="-2.3 %"), names)
    assert disagreements({"README": readme, "choosing": differing}) == [
        "int8 loss vs DDP, %: README says -1.5..-1.5, choosing says -2.3..-2.3"
    ]


def test_every_headline_number_is_stated_alike_wherever_it_is_stated_again() -> None:
    pages = _pages()
    # the README's four headline compressors are each stated again, so this compares something
    assert {who for who, _ in pages["README.md"]} == {"int8", "qsgd", "terngrad", "demo"}
    for key in pages["README.md"]:
        assert key in pages["docs/transformers.md"], key
    assert {who for who, _ in pages["docs/choosing.md"]} >= {"int8", "terngrad", "demo"}
    assert disagreements(pages) == []


def test_the_setup_line_monitoring_shows_is_the_one_the_quickstart_logs() -> None:
    """docs/monitoring.md shows the line ``python examples/quickstart.py`` logs for TernGrad: computed here as the
    strategy computes it at setup (the same model, the same 2 ranks), without training."""
    from lightning.pytorch.strategies import StrategyRegistry

    from examples.quickstart import build_task

    page = (ROOT / "docs" / "monitoring.md").read_text()
    shown = re.search(r"From `python examples/quickstart\.py`:\s*```\s*\n\s*(.+?)\n\s*```", page)
    assert shown, "docs/monitoring.md no longer shows the quickstart's setup line"
    strategy = StrategyRegistry.get("terngrad")  # what the quickstart's `strategy="terngrad"` builds
    named = {n: p for n, p in build_task().named_parameters() if p.requires_grad}
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning_gradcomp")
    logger.addHandler(handler)
    try:
        strategy._announce(named, strategy._float_names(named), world_size=2)
    finally:
        logger.removeHandler(handler)
    assert logged == [shown.group(1).strip()]

