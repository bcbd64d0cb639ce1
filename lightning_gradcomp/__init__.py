"""lightning_gradcomp: gradient compression for PyTorch Lightning's data-parallel training.

Importing the package registers the strategy names (``Trainer(strategy="terngrad")``).
"""

from lightning_gradcomp import registry as _registry
from lightning_gradcomp.compressors import Compressor, Identity, Packet, TernGrad
from lightning_gradcomp.hook import GradCompState, gradcomp_hook
from lightning_gradcomp.pipeline import LayerTransform
from lightning_gradcomp.strategy import GradCompStrategy

_registry.register_strategies(GradCompStrategy)

from lightning_gradcomp.weightgrad import WeightGradStrategy  # noqa: E402  (needs the modules above)
from lightning_gradcomp.weightgrad import register as _register_weightgrad  # noqa: E402

_register_weightgrad()

__version__ = "0.1.0"

__all__ = [
    "Compressor",
    "GradCompState",
    "GradCompStrategy",
    "Identity",
    "LayerTransform",
    "Packet",
    "TernGrad",
    "WeightGradStrategy",
    "gradcomp_hook",
]
