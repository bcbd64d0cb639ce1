"""Deprecated module: the EMA callback is the recipes' and lives in the lab, :mod:`gradcomp_lab.ema`.

Its names still resolve here for one release, each with a ``DeprecationWarning`` naming the new place; the lab is
imported only when one of them is used, never when this module is (the library imports without the lab).
"""

from lightning_gradcomp._deprecated import moved_names as _moved_names

__getattr__ = _moved_names(__name__, {
    "ExponentialMovingAverage": "gradcomp_lab.ema:ExponentialMovingAverage",
    "tf_decay": "gradcomp_lab.ema:tf_decay",
    "tf_ema_avg_fn": "gradcomp_lab.ema:tf_ema_avg_fn",
})
