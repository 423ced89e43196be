"""Prometheus text exposition as data: one scrape round parsed into samples, and what two rounds
say about the interval between them (counter increases, histogram bucket increases, quantiles).

Pure functions over text, so the planner reads the services' /metrics pages directly, with no
Prometheus server in between, and the tests feed it what prometheus_client writes.

Increases follow Prometheus' `increase()` without its extrapolation: a series whose process
restarted within the interval (its ``_created`` sample changed, or its value went down)
contributes its whole new value; a series first seen in the later scrape (a new process, or a
label value seen for the first time) contributes its whole value; a series gone from the later
scrape contributes nothing.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

#: (instance, sample name, sorted label pairs): one time series of one scrape round.
SeriesKey = tuple[str, str, tuple[tuple[str, str], ...]]
#: Suffixes that prometheus_client adds to a family's name in its samples.
_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


@dataclass(frozen=True)
class Scrape:
    """The samples of one scrape round over one or more /metrics pages (instances)."""

    #: When the round was taken, seconds on the planner's monotonic clock.
    time_s: float
    samples: Mapping[SeriesKey, float]

    def gauges(self, name: str, match: Mapping[str, str] | None = None
               ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The samples called `name` whose labels include `match`, by (instance, labels)."""
        return {(inst, labels): value for (inst, sample, labels), value in self.samples.items()
                if sample == name and _matches(labels, match)}


def parse_scrape(pages: Mapping[str, str], time_s: float) -> Scrape:
    """Parses the text of each instance's /metrics page (instance name -> text). Raises
    ValueError when a page is not valid exposition text."""
    samples: dict[SeriesKey, float] = {}
    for instance, text in pages.items():
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(instance, s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return Scrape(time_s, samples)


def counter_increase(before: Scrape, after: Scrape, name: str,
                     match: Mapping[str, str] | None = None) -> float:
    """How much the counter family `name` (without ``_total``) grew between the two scrapes,
    summed over its series whose labels include `match`."""
    total = 0.0
    for key, value in after.samples.items():
        if key[1] == name + "_total" and _matches(key[2], match):
            total += value if _is_reset(before, after, key) else value - before.samples[key]
    return total


@dataclass(frozen=True)
class HistogramDelta:
    """The observations a histogram family took in an interval, over the series summed."""

    #: (upper bound, cumulative count), ascending, ending with the +Inf bucket.
    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile as Prometheus' histogram_quantile estimates it: linear inside the
        bucket where the rank falls (the first bucket starting at 0); the highest finite bound
        when it falls in the +Inf bucket. None without observations. Raises ValueError for q
        outside (0, 1]."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {q}")
        if not self.buckets or self.buckets[-1][1] <= 0:
            return None
        rank = q * self.buckets[-1][1]
        lower, below = 0.0, 0.0
        for upper, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower
                return lower + (upper - lower) * (rank - below) / (cumulative - below)
            lower, below = upper, cumulative
        return lower


def histogram_increase(before: Scrape, after: Scrape, name: str,
                       match: Mapping[str, str] | None = None) -> HistogramDelta:
    """The histogram family `name`'s observations between the two scrapes, summed over its
    series whose labels include `match`. A series' reset is judged on its ``_count``."""
    resets: dict[tuple[str, tuple[tuple[str, str], ...]], bool] = {}
    for key in after.samples:
        if key[1] == name + "_count" and _matches(key[2], match):
            resets[(key[0], key[2])] = _is_reset(before, after, key)
    by_bound: dict[float, float] = {}
    count = total = 0.0
    for key, value in after.samples.items():
        instance, sample, labels = key
        if _family(sample) != name or sample == name + "_total":
            continue
        reset = resets.get((instance, _without(labels, "le")))
        if reset is None:
            continue
        grown = value if reset else value - before.samples.get(key, 0.0)
        if sample == name + "_count":
            count += grown
        elif sample == name + "_sum":
            total += grown
        elif (le := dict(labels).get("le")) is not None:
            by_bound[float(le)] = by_bound.get(float(le), 0.0) + grown
    buckets, running = [], 0.0
    for bound in sorted(by_bound):
        # Cumulative counts never fall; a bucket that seems to (a scrape caught mid-update)
        # is lifted to the one below, as Prometheus does.
        running = max(running, by_bound[bound])
        buckets.append((bound, running))
    return HistogramDelta(tuple(buckets), count, total)


def _is_reset(before: Scrape, after: Scrape, key: SeriesKey) -> bool:
    old = before.samples.get(key)
    if old is None:
        return True
    instance, sample, labels = key
    created = (instance, _family(sample) + "_created", _without(labels, "le"))
    c0, c1 = before.samples.get(created), after.samples.get(created)
    return (c0 is not None and c1 is not None and c0 != c1) or after.samples[key] < old


def _family(sample: str) -> str:
    for suffix in _SUFFIXES:
        if sample.endswith(suffix):
            return sample[: -len(suffix)]
    return sample


def _without(labels: tuple[tuple[str, str], ...], name: str) -> tuple[tuple[str, str], ...]:
    return tuple(pair for pair in labels if pair[0] != name)


def _matches(labels: tuple[tuple[str, str], ...], match: Mapping[str, str] | None) -> bool:
    if not match:
        return True
    have = dict(labels)
    return all(have.get(k) == v for k, v in match.items())
