"""Where bytes are recorded and where a site fans out, read off the library's source (``ast``): the ledger keeps every
byte count of a link and every run of them (the outer engine's bytes between sites included), and one function
broadcasts inside a site."""

import ast
import dataclasses
from pathlib import Path

import lightning_gradcomp
from lightning_gradcomp.sites.hierarchy import SiteExchange

LIBRARY = Path(lightning_gradcomp.__file__).resolve().parent
#: the methods that change a :class:`~lightning_gradcomp.exchange.ledger.RunBytes`
RUN_BYTES_WRITERS = {"add", "end_step", "fold_into_last"}
BROADCASTS = {"broadcast", "broadcast_"}


def _calls() -> list[tuple[str, str, ast.expr, ast.Call]]:
    """Every method call of the library: (module, method name, receiver, call)."""
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        relative = str(path.relative_to(LIBRARY))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                found.append((relative, node.func.attr, node.func.value, node))
    return found


def test_only_the_ledger_steps_a_run_of_bytes() -> None:
    # the outer engine's bytes between sites are the ledger's too (`ledger.record_link`, `close_link_step`): no
    # module outside ledger.py adds to, closes or folds a RunBytes (a receiver named for bytes or a run)
    writers = {
        (where, ast.unparse(receiver), method)
        for where, method, receiver, _ in _calls()
        if method in RUN_BYTES_WRITERS and where != "exchange/ledger.py"
        and any(word in ast.unparse(receiver).lower() for word in ("wan", "lan", "run", "bytes"))
    }
    assert writers == set(), writers


def test_the_outer_engine_records_its_rounds_on_its_exchange_ledger() -> None:
    # every method of the engine that counts bytes between sites hands them to the exchange's ledger
    callers = {where for where, method, receiver, _ in _calls()
               if method in {"record_link", "close_link_step", "fold_link_step", "restore_link_run"}
               and ast.unparse(receiver).endswith("exchange.ledger")}
    assert callers == {"outer/engine.py"}, callers


def test_a_site_keeps_no_byte_count_of_its_own() -> None:
    fields = {f.name for f in dataclasses.fields(SiteExchange)}
    assert not any("bytes" in name for name in fields), fields
    assert not any("bytes" in name for name in vars(SiteExchange)), sorted(vars(SiteExchange))


def test_one_function_broadcasts_inside_a_site() -> None:
    fan_outs = {where for where, method, _, node in _calls() if method in BROADCASTS and "site_group" in ast.unparse(node)}
    assert fan_outs == {"sites/transport.py"}, fan_outs


def test_only_the_ledger_counts_what_crosses_a_link_by_itself() -> None:
    # a tuple of (WAN, LAN) bytes or a per-bucket dict computed beside a collective is a second ledger: every byte
    # count of a link is recorded with one of the ledger's `record*` methods and read back from it
    computed = []
    for path in sorted(LIBRARY.rglob("*.py")):
        relative = str(path.relative_to(LIBRARY))
        if relative == "exchange/ledger.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and ast.unparse(t.value).endswith("_bytes") for t in node.targets
            ):
                computed.append(f"{relative}:{node.lineno}")
    assert computed == []
