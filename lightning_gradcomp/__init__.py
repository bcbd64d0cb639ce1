"""lightning_gradcomp: gradient compression for PyTorch Lightning's data-parallel training.

Importing the package registers the strategy names (``Trainer(strategy="terngrad")``, ``Fabric(strategy="terngrad")``,
and ``"terngrad_notebook"`` for interactive sessions).
"""

import logging as _logging

# INFO lines (what compresses, with which collectives and bytes; a kernel compile) reach the terminal by default,
# exactly as Lightning makes its own visible: a handler of our own unless the application configured logging
_logger = _logging.getLogger(__name__)
_logger.setLevel(_logging.INFO)
if not _logging.getLogger().hasHandlers():
    _logger.addHandler(_logging.StreamHandler())
    _logger.propagate = False

from lightning_gradcomp import registry as _registry  # noqa: E402
from lightning_gradcomp.compressors import Compressor, Identity, Packet, TernGrad  # noqa: E402
from lightning_gradcomp.hook import GradCompState, gradcomp_hook  # noqa: E402
from lightning_gradcomp.pipeline import LayerTransform  # noqa: E402
from lightning_gradcomp.strategy import GradCompStrategy  # noqa: E402

_registry.register_strategies(GradCompStrategy)

from lightning_gradcomp.weightgrad import WeightGradStrategy  # noqa: E402  (needs the modules above)
from lightning_gradcomp.weightgrad import register as _register_weightgrad  # noqa: E402

_register_weightgrad()

from lightning_gradcomp.outer import DiLoCoStrategy  # noqa: E402
from lightning_gradcomp.outer import register as _register_diloco  # noqa: E402

_register_diloco()

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_STRATEGIES  # noqa: E402

from lightning_gradcomp.fabric import GradCompFabricStrategy  # noqa: E402

_registry.register_strategies(GradCompFabricStrategy, _FABRIC_STRATEGIES)

__version__ = "0.1.0"

__all__ = [
    "Compressor",
    "DiLoCoStrategy",
    "GradCompFabricStrategy",
    "GradCompState",
    "GradCompStrategy",
    "Identity",
    "LayerTransform",
    "Packet",
    "TernGrad",
    "WeightGradStrategy",
    "gradcomp_hook",
]
