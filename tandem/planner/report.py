"""The planner's status file: its targets, what each pool has, the load it predicted and its last
decisions with their reasons, rewritten after every interval (atomically) for `tandem status`.

It is a report, not state: a restarted planner starts from the metrics, and overwrites it."""
from __future__ import annotations

import json
import os
import pathlib
import time
from collections import deque
from typing import Any

from tandem.planner.decision import Decision
from tandem.planner.predictor import Load

#: Decisions kept in the file, newest last.
KEEP_DECISIONS = 8


class ReportWriter:
    def __init__(self, path: str, interval_s: float, keep: int = KEEP_DECISIONS) -> None:
        self.path = pathlib.Path(path)
        self.interval_s = interval_s
        self._decisions: deque[dict[str, Any]] = deque(maxlen=keep)
        self._body: dict[str, Any] = {"pid": os.getpid(), "interval_s": interval_s,
                                      "started_at": time.time(), "targets": {}, "actual": {},
                                      "load": None, "note": "waiting for the first interval",
                                      "decisions": []}
        self._write()

    def record(self, decision: Decision, load: Load, actual: dict[str, int]) -> None:
        self._decisions.append({
            "interval": decision.interval, "fast": decision.fast, "at": time.time(),
            "summary": decision.summary(),
            "pools": [{"pool": p.pool, "role": p.role, "previous": p.previous,
                       "wanted": p.wanted, "target": p.target,
                       "demand": p.demand if p.demand != float("inf") else None,
                       "reason": p.reason} for p in decision.pools]})
        self._body.update(targets=decision.targets(), actual=actual, note="",
                          load={"request_rate": load.request_rate, "mean_isl": load.mean_isl,
                                "mean_osl": load.mean_osl})
        self._write()

    def note(self, text: str, actual: dict[str, int] | None = None) -> None:
        """An interval without a decision, and why."""
        self._body["note"] = text
        if actual is not None:
            self._body["actual"] = actual
        self._write()

    def _write(self) -> None:
        body = {**self._body, "updated_at": time.time(), "decisions": list(self._decisions)}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.path)


def read_report(path: str) -> dict[str, Any] | None:
    """The report at `path`; None when there is none (yet) or it cannot be read."""
    try:
        body = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def format_report(report: dict[str, Any], now: float | None = None) -> str:
    """The report for people: targets against actual counts, the predicted load, then the last
    decisions (newest first) with each pool's reason."""
    now = time.time() if now is None else now
    pools = sorted(set(report.get("targets", {})) | set(report.get("actual", {})))
    sizes = ", ".join(f"{p} {report.get('actual', {}).get(p, '?')} (target "
                      f"{report.get('targets', {}).get(p, '?')})" for p in pools)
    age = now - float(report.get("updated_at", now))
    lines = [f"planner (pid {report.get('pid')}, every {report.get('interval_s')} s, updated "
             f"{age:.0f}s ago): {sizes or 'no decision yet'}"]
    if load := report.get("load"):
        lines.append(f"  predicted load: {load['request_rate']:.3g} req/s, ISL "
                     f"{load['mean_isl']:.0f}, OSL {load['mean_osl']:.0f}")
    if report.get("note"):
        lines.append(f"  note: {report['note']}")
    for decision in reversed(report.get("decisions", [])):
        ago = now - float(decision.get("at", now))
        lines.append(f"  {ago:.0f}s ago, {decision['summary']}")
        lines += [f"    {p['pool']}: {p['reason']}" for p in decision.get("pools", [])]
    return "\n".join(lines)
