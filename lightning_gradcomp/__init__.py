"""lightning_gradcomp: gradient compression for PyTorch Lightning's data-parallel training.

Importing the package registers the strategy names (``Trainer(strategy="terngrad")``, ``Fabric(strategy="terngrad")``,
and ``"terngrad_notebook"`` for interactive sessions), and the presets measured on transformers with AdamW
(``"terngrad_lm"``, :mod:`lightning_gradcomp.strategies.presets`).

The top level holds the strategies, the DDP communication hook and the registry of names; compressors are spelt
from their subpackage (``lightning_gradcomp.compressors.TernGrad``), callbacks from theirs
(``lightning_gradcomp.callbacks.CompressionMonitor``). The recipes' data, models and tasks are not part of the
library: they live in ``gradcomp_lab``.
"""

import logging as _logging

from lightning_gradcomp._deprecated import install_moved_modules as _install_moved_modules

_install_moved_modules()  # `lightning_gradcomp.hook` and the other moved module paths still import, with a warning

# INFO lines (what compresses, with which collectives and bytes; a kernel compile) reach the terminal by default,
# exactly as Lightning makes its own visible: a handler of our own unless the application configured logging
_logger = _logging.getLogger(__name__)
_logger.setLevel(_logging.INFO)
if not _logging.getLogger().hasHandlers():
    _logger.addHandler(_logging.StreamHandler())
    _logger.propagate = False

from lightning_gradcomp.exchange.hook import GradCompState, gradcomp_hook  # noqa: E402
from lightning_gradcomp.registry import (  # noqa: E402
    compressor_names,
    make_compressor,
    register_compressor,
    register_strategies,
    strategy_names,
)
from lightning_gradcomp.strategies.presets import register as _register_presets  # noqa: E402
from lightning_gradcomp.strategies.strategy import GradCompStrategy, PresetStrategy  # noqa: E402
from lightning_gradcomp.strategies.towers import TowerStrategy  # noqa: E402

register_strategies(GradCompStrategy)
_register_presets(PresetStrategy)  # "terngrad_lm", ...: each compressor's setting measured to reach AdamW DDP (presets.PRESETS)

from lightning_gradcomp.weightgrad import WeightGradStrategy  # noqa: E402  (needs the modules above)
from lightning_gradcomp.weightgrad.strategy import register as _register_weightgrad  # noqa: E402

_register_weightgrad()

from lightning_gradcomp.outer import DiLoCoStrategy  # noqa: E402
from lightning_gradcomp.outer.strategy import register as _register_diloco  # noqa: E402

_register_diloco()

from lightning_gradcomp.onebit_adam import OneBitAdamStrategy, ZeroOneAdamStrategy  # noqa: E402
from lightning_gradcomp.onebit_adam.strategy import register as _register_frozen_adam  # noqa: E402

_register_frozen_adam()

from lightning_gradcomp.strategies.sharded import ShardedGradCompStrategy  # noqa: E402

ShardedGradCompStrategy.register_strategies(None)

from lightning_gradcomp.outer import ShardedDiLoCoStrategy  # noqa: E402

ShardedDiLoCoStrategy.register_strategies(None)

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_STRATEGIES  # noqa: E402

from lightning_gradcomp.strategies.fabric import (  # noqa: E402
    GradCompFabricStrategy,
    PresetFabricStrategy,
    ShardedGradCompFabricStrategy,
    register_trainer_only_names,
)
from lightning_gradcomp.registry import SHARDED_PREFIX as _SHARDED_PREFIX  # noqa: E402

register_strategies(GradCompFabricStrategy, _FABRIC_STRATEGIES)
register_strategies(ShardedGradCompFabricStrategy, _FABRIC_STRATEGIES, prefix=_SHARDED_PREFIX, notebook=False)
_register_presets(PresetFabricStrategy, _FABRIC_STRATEGIES)
register_trainer_only_names(_FABRIC_STRATEGIES)  # Fabric(strategy="diloco") says it is Trainer-only, and what to use

from lightning_gradcomp.strategies.argument import install as _install_strategy_checks  # noqa: E402

# Trainer(strategy="terngard") and Fabric(strategy=GradCompStrategy(...)) get our errors, with the fix
_install_strategy_checks()

__version__ = "0.1.0"

from lightning_gradcomp._deprecated import moved_names as _moved_names  # noqa: E402

# spellings of an earlier release, kept for one more with a DeprecationWarning (not in __all__)
__getattr__ = _moved_names(__name__, {
    "Compressor": "lightning_gradcomp.compressors:Compressor",
    "Identity": "lightning_gradcomp.compressors:Identity",
    "LayerTransform": "lightning_gradcomp.exchange.pipeline:LayerTransform",
    "Packet": "lightning_gradcomp.compressors:Packet",
    "TernGrad": "lightning_gradcomp.compressors:TernGrad",
})

__all__ = [
    "DiLoCoStrategy",
    "GradCompFabricStrategy",
    "GradCompState",
    "GradCompStrategy",
    "OneBitAdamStrategy",
    "PresetFabricStrategy",
    "PresetStrategy",
    "ShardedDiLoCoStrategy",
    "ShardedGradCompFabricStrategy",
    "ShardedGradCompStrategy",
    "TowerStrategy",
    "WeightGradStrategy",
    "ZeroOneAdamStrategy",
    "compressor_names",
    "gradcomp_hook",
    "make_compressor",
    "register_compressor",
    "register_strategies",
    "strategy_names",
]
