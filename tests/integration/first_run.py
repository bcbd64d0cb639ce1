"""One short fit as a new user runs it (``python first_run.py STRATEGY``): prints what the terminal and the Trainer show.

Stdout's last line is JSON: the progress-bar metrics and every warning raised during the fit; the log lines go to
stderr as they would on a terminal.
"""

import json
import os
import sys
import warnings

import lightning.pytorch as pl

import lightning_gradcomp  # noqa: F401  (registers the strategy names)
from gradcomp_lab.cli import close_process_group
from tests.distributed.lightning_ranks import TinyClassifier, random_loader

if __name__ == "__main__":
    # 2 CPU ranks, as the README's first run (on one rank nothing is exchanged, and the strategy warns so)
    trainer = pl.Trainer(strategy=sys.argv[1], accelerator="cpu", devices=2, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyClassifier(), random_loader(batch_size=16))
    metrics = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
    if trainer.global_rank == 0:  # the launched rank 1 shares this stdout
        print(json.dumps({"progress_bar": metrics, "warnings": [str(w.message) for w in caught]}))
    # ended as the gradcomp CLI ends a run: torch's native teardown of a Gloo group's threads aborts a finished 2-rank
    # fit now and then ("terminate called without an active exception", docs/compatibility.md)
    close_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
