"""The next interval's load, predicted from the last ones.

The rule is the simplest that follows a ramp: each series (request rate, mean ISL, mean OSL)
predicts its last value plus its trend, the mean change per interval over the last `window`
intervals, clamped at 0:

    next = x[t] + (x[t] - x[t - w]) / w        (w = min(window, intervals seen - 1))

On a ramp it leads by one interval's growth, so new workers are asked for before the load
reaches them; when the load stops, the negative trend takes the prediction to 0 at once. A
better predictor (a Kalman filter, as Dynamo has) is for when a load test measures it better.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """The traffic of one interval, observed or predicted."""

    #: Requests per second.
    request_rate: float
    #: Mean prompt length, tokens.
    mean_isl: float
    #: Mean generated length, tokens.
    mean_osl: float
    #: Requests in flight at the interval's end (the frontends' gauge: decoding and queued)
    #: while the load goes on (FrontendInterval.inflight_floor); not predicted, set by the loop
    #: from the last interval; 0 when unknown or once the load stopped.
    inflight: float = 0.0
    #: Generations, and their prompt tokens, waiting to be prefilled at the interval's end
    #: (the frontends' gauges); not predicted, set by the loop like `inflight`.
    queued: float = 0.0
    queued_prompt_tokens: float = 0.0

    @property
    def waiting_isl(self) -> float:
        """Mean prompt length of the generations waiting to be prefilled (the interval's mean
        when none waits)."""
        return self.queued_prompt_tokens / self.queued if self.queued else self.mean_isl

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.request_rate * self.mean_isl

    def __str__(self) -> str:
        return f"{self.request_rate:.3g} req/s, ISL {self.mean_isl:.0f}, OSL {self.mean_osl:.0f}"


class LoadPredictor:
    """Keeps the last `window` + 1 intervals and predicts the next (see the module docstring)."""

    def __init__(self, window: int = 3) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._rates: deque[float] = deque(maxlen=window + 1)
        self._isls: deque[float] = deque(maxlen=window + 1)
        self._osls: deque[float] = deque(maxlen=window + 1)

    @property
    def num_observed(self) -> int:
        """Intervals in the window (at most window + 1)."""
        return len(self._rates)

    def observe(self, request_rate: float, mean_isl: float | None = None,
                mean_osl: float | None = None) -> None:
        """Adds one interval. A mean that is None (no request finished in the interval, so
        none was measured) repeats the last known one (0 before any). Raises ValueError on a
        negative or non-finite value."""
        for name, value in (("request_rate", request_rate), ("mean_isl", mean_isl),
                            ("mean_osl", mean_osl)):
            if value is not None and not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        self._rates.append(request_rate)
        self._isls.append(_last(self._isls) if mean_isl is None else mean_isl)
        self._osls.append(_last(self._osls) if mean_osl is None else mean_osl)

    def predict(self) -> Load | None:
        """The next interval's load; None before the first observation."""
        if not self._rates:
            return None
        return Load(_next(self._rates), _next(self._isls), _next(self._osls))


def _last(values: deque[float]) -> float:
    return values[-1] if values else 0.0


def _next(values: deque[float]) -> float:
    if len(values) == 1:
        return values[0]
    trend = (values[-1] - values[0]) / (len(values) - 1)
    return max(values[-1] + trend, 0.0)
