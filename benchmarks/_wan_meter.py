"""A callback for benchmarks/repro_weightgrad.py: bytes this rank sent over the WAN and the LAN, whole run.

WeightGrad's strategy reports ``wan_bytes`` / ``lan_bytes`` per step (``strategy.stats``). A flat strategy has no
sites, so everything it sends crosses between sites: its per-step bytes (the gradcomp hook's accounting, or 4
bytes per parameter for plain DDP) count as WAN bytes, as ``benchmarks/weightgrad_wan.py`` counts them.
Totals are logged to the Trainer's logger at the end of training (rank 0, a site leader).
"""

from typing import Any

from lightning.pytorch import Callback


class WanBytes(Callback):
    """Sums WAN and LAN bytes sent by this rank over all training steps and logs ``wan_mb`` and ``lan_mb``."""

    def __init__(self) -> None:
        self.wan = 0
        self.lan = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        stats = getattr(trainer.strategy, "stats", None)
        if stats and "wan_bytes" in stats:
            self.wan += int(stats["wan_bytes"])
            self.lan += int(stats["lan_bytes"])
            return
        state = getattr(trainer.strategy, "comm_state", None)
        if state is not None:
            self.wan += int(state.last_step_bytes())
        else:
            self.wan += 4 * sum(p.numel() for p in pl_module.parameters() if p.requires_grad)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        for logger in trainer.loggers:
            logger.log_metrics({"wan_mb": self.wan / 2**20, "lan_mb": self.lan / 2**20}, step=trainer.global_step)
            logger.save()
