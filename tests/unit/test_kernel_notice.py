"""A first use that compiles the CPU kernels says so on the terminal, with the expected duration; a cached load is silent."""

import logging

import pytest
from torch.utils import cpp_extension

from lightning_gradcomp.kernels import _build


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("cached", [False, True])
def test_compile_is_announced_at_warning_level(monkeypatch: pytest.MonkeyPatch, cached: bool) -> None:
    if not _build.is_compiled():
        pytest.skip("needs the cached build (tests/conftest.py compiles it): this test must not pay a compile")
    # a fresh first use in this process, `is_compiled` deciding the notice. The build is the one already loaded: a
    # second load_inline of a name this process imported would compile the kernels again under a new version
    # (about 35 s each time)
    loaded = _build.cpu_extension()
    monkeypatch.setattr(cpp_extension, "load_inline", lambda **_: loaded)
    monkeypatch.setattr(_build, "_tried", False)
    monkeypatch.setattr(_build, "_module", None)
    monkeypatch.setattr(_build, "is_compiled", lambda: cached)
    records = _Records()
    logger = logging.getLogger(_build.__name__)
    logger.addHandler(records)
    try:
        assert _build.cpu_extension() is not None
    finally:
        logger.removeHandler(records)
    notices = [m for m in records.messages if "compiling the fused CPU kernels once" in m]
    if cached:
        assert notices == []
    else:
        directory = _build.build_directory()
        assert directory is not None
        assert len(notices) == 1 and "about 30 s" in notices[0] and directory in notices[0]
        assert logging.getLogger("lightning_gradcomp").getEffectiveLevel() <= logging.WARNING  # reaches the terminal
