"""Unknown options to any registered compressor (one mechanism in ``Compressor``, so every compressor has it)."""

from functools import partial

from lightning_gradcomp import registry
from lightning_gradcomp.compressors import TernGrad
from lightning_gradcomp.compressors.adacomp import AdaComp
from tests.bad_configs import BadConfig


def _misspelt_option(name: str) -> None:
    registry.COMPRESSORS[name][0](drop_rate=0.99)  # type: ignore[call-arg]


# wrong types on purpose: each `type: ignore` marks a case whose wrong type mypy sees too
BAD_CONFIGS = [
    BadConfig(f"compressor-{name}-unknown-option", partial(_misspelt_option, name), "drop_rate", "0.99")
    for name in registry.compressor_names()
] + [
    # Gradient Dropping's option passed to the other sparsifiers: the message lists what they take instead
    BadConfig("compressor-terngrad-drop-ratio", lambda: TernGrad(drop_ratio=0.99), "drop_ratio", "clip_factor"),  # type: ignore[call-arg]
    BadConfig("compressor-adacomp-drop-ratio", lambda: AdaComp(drop_ratio=0.99), "drop_ratio", "bin_size_conv"),  # type: ignore[call-arg]
]
