"""What the communication hook records for :class:`~lightning_gradcomp.callbacks.CompressionMonitor`.

The hook calls a :class:`HookStats` at a few points (bucket start, blocking collectives, after each
compression, collective launch, decode). Two regimes keep monitoring cheap:

* every step: only the time split, with host perf counters on CPU and CUDA events on GPU; nothing is read
  back from the device, so no host sync;
* capture steps (the monitor arms :attr:`HookStats.capture` just before a logging step): also histograms
  of the original, clipped, compressed and averaged gradient of chosen layers (``torch.histc`` on device)
  and the share of zeros sent by compressors that do not report it themselves. They stay device tensors
  until the monitor reads them once, after the step.

Time split per bucket (summed over buckets, averaged over the steps since the last read):

* ``compress``: the hook body up to the launch of the payload collectives (transforms, error feedback,
  compression, packing), minus the blocking collectives inside it;
* ``collective_wait``: the blocking collectives inside the hook body (shared-scaler max, payload sizes),
  which also absorb the other ranks' lateness, plus the time from launching the payload collectives to the
  start of the decode callback. Buckets overlap backward and each other, so this is latency, not idle time;
* ``decompress``: the decode callback (decode, average, write into the bucket).
"""

import contextlib
import fnmatch
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

#: the gradient views a histogram is taken of, in pipeline order (TernGrad Fig. 2)
HISTOGRAM_KINDS = ("original", "clipped", "compressed", "averaged")
#: the phases of the time split
PHASES = ("compress", "collective_wait", "decompress")

_Mark = Union[float, "torch.cuda.Event"]


def histogram(tensor: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    """Counts and edges of ``tensor``'s values over its own range, computed on its device.

    ``torch.histc`` needs its range as Python numbers. On an accelerator reading them would be a host sync
    inside the hook, so the values are first mapped onto [0, 1] with device-side min and max; on CPU the
    range is read directly. Every finite element is counted: the counts sum to ``numel``.

    Args:
        tensor: any floating-point tensor.
        bins: number of equal-width bins.

    Returns:
        ``(counts, edges)``: float32 tensors of ``bins`` and ``bins + 1`` elements.
    """
    flat = tensor.detach().reshape(-1).float()
    if flat.device.type == "cpu":
        # on CPU reading the range costs nothing (no device to wait for) and saves two passes over the tensor
        lo_t, hi_t = torch.aminmax(flat)
        lo_f, hi_f = lo_t.item(), hi_t.item()
        top = hi_f if hi_f > lo_f else lo_f + max(abs(lo_f), 1.0) * 1e-3
        counts = torch.histc(flat, bins=bins, min=lo_f, max=top)
        return counts, torch.linspace(lo_f, top, bins + 1)
    return _device_histogram(flat, bins)


def _device_histogram(flat: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    """:func:`histogram` without reading anything back to the host (for accelerators)."""
    lo, hi = torch.aminmax(flat)
    # a constant tensor still gets distinct edges (all its values land in the first bin)
    width = torch.where(hi > lo, hi - lo, lo.abs().clamp_min(1.0) * 1e-3)
    # (x - lo) / width <= 1 for every x <= hi: rounding is monotone and (hi - lo) / (hi - lo) == 1 exactly
    counts = torch.histc((flat - lo) / width, bins=bins, min=0.0, max=1.0)
    edges = lo + width * torch.linspace(0.0, 1.0, bins + 1, device=flat.device)
    return counts, edges


class _Clock:
    """Timestamps for the time split: perf counters on CPU, CUDA events (read later) on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> _Mark:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: _Mark, end: _Mark) -> float:
        if isinstance(start, float) and isinstance(end, float):
            return end - start
        assert not isinstance(start, float) and not isinstance(end, float)  # one clock per run: both CUDA events
        return start.elapsed_time(end) / 1e3


class BucketTimer:
    """Marks of one bucket's hook call; created by :meth:`HookStats.start_bucket`."""

    def __init__(self, stats: "HookStats") -> None:
        self._stats = stats
        self._start = stats._clock.mark()
        self._blocking: list[tuple[_Mark, _Mark]] = []
        self._launched: Optional[_Mark] = None
        self._decode_start: Optional[_Mark] = None

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Wrap a collective the hook body waits for."""
        start = self._stats._clock.mark()
        yield
        self._blocking.append((start, self._stats._clock.mark()))

    def launched(self) -> None:
        """The payload collectives have been launched: compression is over."""
        self._launched = self._stats._clock.mark()

    def decode_started(self) -> None:
        """The decode callback runs: the collectives have completed."""
        self._decode_start = self._stats._clock.mark()
        if self._launched is None:  # nothing was launched (one rank, or nothing to send)
            self._launched = self._decode_start

    def decode_done(self) -> None:
        """The bucket's buffer holds the averaged gradient."""
        assert self._launched is not None and self._decode_start is not None, "decode_done before decode_started"
        self._stats._record(self._start, self._launched, self._decode_start, self._stats._clock.mark(), self._blocking)


class _NoTimer:
    """Stands in for :class:`BucketTimer` when nobody monitors: every mark is a no-op."""

    def blocking(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def launched(self) -> None:
        pass

    def decode_started(self) -> None:
        pass

    def decode_done(self) -> None:
        pass


NO_TIMER = _NoTimer()


class HookObserver:
    """What the hook tells an observer; every method a no-op, so the hook calls them without asking who listens.

    :class:`HookStats` (the monitor's) overrides them all.
    """

    #: whether anyone listens: the hook skips its per-layer loops for an observer that does not
    active: bool = False

    def start_bucket(self) -> Union[BucketTimer, _NoTimer]:
        """Start timing one bucket's hook call."""
        return NO_TIMER

    def blocking(self) -> contextlib.AbstractContextManager[None]:
        """Time a collective the current bucket's hook body waits for."""
        return contextlib.nullcontext()

    def observe_input(self, name: str, original: Tensor, clipped: Tensor, compressor: Any) -> None:
        """This rank's gradient before and after the transforms (before error feedback)."""

    def observe_group(self, segments: Any, compressor: Any, compressed_input: Tensor, packet: Any,
                      sent: Optional[Tensor]) -> None:
        """A group's packet (:class:`~lightning_gradcomp.flat.FlatPacket`), flat input and local decode."""

    def observe_averaged(self, name: str, averaged: Tensor) -> None:
        """One layer's decoded, averaged gradient."""


#: the observer of an unmonitored hook state
NO_OBSERVER = HookObserver()


class HookStats(HookObserver):
    """Statistics gathered inside the hook for one rank, read by the monitor on logging steps.

    Args:
        histogram_layers: fnmatch patterns of the parameter names to take histograms of (``()``: none).
        bins: bins per histogram.
        device: the device gradients live on (picks the clock).
    """

    active = True

    def __init__(self, histogram_layers: Sequence[str] = ("*",), bins: int = 64,
                 device: torch.device = torch.device("cpu")) -> None:
        self.histogram_layers = tuple(histogram_layers)
        self.bins = bins
        #: set by the monitor before a logging step; histograms and fallbacks are computed only then
        self.capture = False
        #: whether the captured step also takes histograms (the monitor's ``histogram_every``)
        self.capture_histograms = True
        self._clock = _Clock(device)
        self._lock = threading.Lock()  # decode callbacks may run on the collective backend's threads
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._pending: list[tuple[Any, ...]] = []  # CUDA marks, resolved when read
        self._current: Optional[BucketTimer] = None
        self._wants: dict[str, bool] = {}
        #: parameter name -> histogram kind -> (counts, edges), device tensors of the captured step
        self.histograms: dict[str, dict[str, tuple[Tensor, Tensor]]] = {}
        #: parameter name -> statistic -> 0-d device tensor computed on the captured step (e.g. ``sparsity``)
        self.layer_stats: dict[str, dict[str, Tensor]] = {}

    # -- called from the hook -----------------------------------------------------------------------------
    def start_bucket(self) -> BucketTimer:
        """Start timing one bucket's hook call."""
        # hook bodies run one after another on the autograd thread: one current bucket at a time
        self._current = BucketTimer(self)
        return self._current

    def blocking(self) -> contextlib.AbstractContextManager[None]:
        """Time a collective the current bucket's hook body waits for."""
        return self._current.blocking() if self._current is not None else contextlib.nullcontext()

    def wants_histogram(self, name: str) -> bool:
        if not self.capture_histograms:
            return False
        wanted = self._wants.get(name)
        if wanted is None:
            wanted = self._wants[name] = any(fnmatch.fnmatchcase(name, p) for p in self.histogram_layers)
        return wanted

    def observe_input(self, name: str, original: Tensor, clipped: Tensor, compressor: Any) -> None:
        """This rank's gradient before and after the pipeline's transforms (before error feedback).

        A compressor that clips internally (TernGrad's ``clip_factor``) may expose ``clipped(tensor)``; the
        clipped histogram then shows its clipping too.
        """
        if not self.capture or not self.wants_histogram(name):
            return
        own_clip = getattr(compressor, "clipped", None)
        if callable(own_clip):
            clipped = own_clip(clipped)
        layer = self.histograms.setdefault(name, {})
        layer["original"] = histogram(original, self.bins)
        layer["clipped"] = histogram(clipped, self.bins)

    def observe_group(self, segments: Any, compressor: Any, compressed_input: Tensor, packet: Any,
                      sent: Optional[Tensor]) -> None:
        """A group's packet: each layer's sparsity (unless its packet reports one) and histogram of what it sent."""
        if not self.capture:
            return
        reported = [
            "sparsity" in packet.stats or (packet.layers is not None and "sparsity" in packet.layers[i].stats)
            for i in range(len(segments))
        ]
        if all(reported) and not any(self.wants_histogram(n) for n in segments.names):
            return
        if sent is None:
            sent = compressor.sent_flat(compressed_input, packet)
        for name, view, has in zip(segments.names, segments.views(sent), reported):
            if not has:
                self.layer_stats.setdefault(name, {})["sparsity"] = (view == 0).float().mean()
            if self.wants_histogram(name):
                self.histograms.setdefault(name, {})["compressed"] = histogram(view, self.bins)

    def observe_averaged(self, name: str, averaged: Tensor) -> None:
        """The decoded average every rank applies (called from the decode callback)."""
        if self.capture and self.wants_histogram(name):
            self.histograms.setdefault(name, {})["averaged"] = histogram(averaged, self.bins)

    # -- called by the monitor ----------------------------------------------------------------------------
    def _record(self, start: _Mark, launched: _Mark, decode_start: _Mark, decode_end: _Mark,
                blocking: list[tuple[_Mark, _Mark]]) -> None:
        with self._lock:
            if self._clock.cuda:  # reading an event now would wait for the device
                self._pending.append((start, launched, decode_start, decode_end, blocking))
            else:
                self._add(start, launched, decode_start, decode_end, blocking)

    def _add(self, start: _Mark, launched: _Mark, decode_start: _Mark, decode_end: _Mark,
             blocking: list[tuple[_Mark, _Mark]]) -> None:
        seconds = self._clock.seconds
        waited = sum(seconds(a, b) for a, b in blocking)
        self._totals["compress"] += seconds(start, launched) - waited
        self._totals["collective_wait"] += waited + seconds(launched, decode_start)
        self._totals["decompress"] += seconds(decode_start, decode_end)

    def take_times(self) -> dict[str, float]:
        """Seconds per phase summed over every bucket since the last call (reads CUDA events: a sync)."""
        with self._lock:
            if self._pending:
                torch.cuda.synchronize()
                for interval in self._pending:
                    self._add(*interval)
                self._pending.clear()
            totals, self._totals = self._totals, dict.fromkeys(PHASES, 0.0)
        return totals

    def clear_capture(self) -> None:
        """Forget the captured step's tensors and disarm capturing."""
        self.capture = False
        self.histograms = {}
        self.layer_stats = {}
