"""gradcomp_lab: the harness that runs lightning_gradcomp's recipes and benchmarks; not part of the library.

The library (``lightning_gradcomp``) never imports this package; this package imports the library as a user would.

* :mod:`gradcomp_lab.data`, :mod:`gradcomp_lab.models`, :mod:`gradcomp_lab.tasks`: the papers' datasets, models and
  LightningModules that the recipes name by ``class_path``;
* :mod:`gradcomp_lab.schedules`, :mod:`gradcomp_lab.ema`: the papers' LR schedules and TF-style weight averaging;
* :mod:`gradcomp_lab.cli`: the ``gradcomp`` console script (LightningCLI) and its ``report`` subcommand
  (:mod:`gradcomp_lab.report`);
* :mod:`gradcomp_lab.perfmodel` (``gradcomp-perf``) and :mod:`gradcomp_lab.emulate` (``gradcomp-emulate``): the
  performance model and the emulated cluster its predictions are checked against.
"""
