"""Where a served request's time to first token goes, from its trace (a script, not a test).

Reads the spans that `tandem up` printed with `OTEL_TRACES_EXPORTER=console` (serve_gpu.py
--trace sets it) and splits each streamed request's TTFT, as the frontend's span sees it:

- `before the call`: the frontend's HTTP span start -> its Decode/Generate client span start
  (parsing, chat template, tokenization, routing);
- `to the worker`: client span start -> the decode worker's server span start (the session
  frame's trip and the worker's read of it);
- `worker to first token`: server span start -> its `first_token` event (admission, the
  engine's scheduling and prefill, the first sample);
- the client's TTFT (from the load generator) minus the three: the first token's way back
  (session frame, detokenization, SSE) and the client's own send and read.

With --wave N, how the first N requests (a burst) reach the worker, hop by hop. With --steps,
also the engine's steps (`engine.step` spans): which step admitted and finished
which prompts, and how long each took.

    python3 benchmarks/probes/ttft_split.py LOG [--client-ttft-ms 30.4 ...] [--wave 64] [--steps]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics


def spans(text: str) -> list[dict]:
    """The JSON objects that start at a line holding only `{` and end at the next `}` line."""
    out, lines, block = [], text.splitlines(), None
    for line in lines:
        if block is None and line == "{":
            block = [line]
        elif block is not None:
            block.append(line)
            if line == "}":
                try:
                    out.append(json.loads("\n".join(block)))
                except json.JSONDecodeError:
                    pass
                block = None
    return [s for s in out if "context" in s and "name" in s]


def _ns(stamp: str) -> int:
    when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return int(when.timestamp()) * 10**9 + when.microsecond * 1000


def split(all_spans: list[dict]) -> list[dict]:
    """Per traced streamed request, in start order: ms of each part (see the docstring)."""
    by_trace: dict[str, list[dict]] = {}
    for s in all_spans:
        by_trace.setdefault(s["context"]["trace_id"], []).append(s)
    rows = []
    for group in by_trace.values():
        http = next((s for s in group if s["name"].startswith("POST /v1/")), None)
        client = next((s for s in group if s["name"] == "tandem.v1.Decode/Generate"
                       and s["kind"].endswith("CLIENT")), None)
        server = next((s for s in group if s["name"] == "tandem.v1.Decode/Generate"
                       and s["kind"].endswith("SERVER")), None)
        if not (http and client and server):
            continue
        first = next((e for e in server.get("events", []) if e["name"] == "first_token"), None)
        if first is None:
            continue
        t0, t1 = _ns(http["start_time"]), _ns(client["start_time"])
        t2, t3 = _ns(server["start_time"]), _ns(first["timestamp"])
        rows.append({"start": t0, "at": (t0, t1, t2, t3), "before the call": (t1 - t0) / 1e6,
                     "to the worker": (t2 - t1) / 1e6, "worker to first token": (t3 - t2) / 1e6,
                     "first token at the worker": (t3 - t0) / 1e6})
    return sorted(rows, key=lambda r: r["start"])


def step_table(all_spans: list[dict]) -> str:
    """The engine's steps (the workers' `engine.step` spans) in order, from the first: each
    step that computed prompt tokens, admitted or gave a first token on a row of its own, the
    plain decode steps between them as one row."""
    steps = sorted((s for s in all_spans if s["name"] == "engine.step"),
                   key=lambda s: _ns(s["start_time"]))
    if not steps:
        return "(no engine.step spans)"
    t0 = _ns(steps[0]["start_time"])
    out = ["| start ms | ms | scheduled | prompt tokens | admitted | first tokens | waiting | "
           "running |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    decodes: list[float] = []

    def flush() -> None:
        if decodes:
            out.append(f"| | {statistics.fmean(decodes):.1f} each | {len(decodes)} decode "
                       "steps | | | | | |")
            decodes.clear()

    for s in steps:
        a = s["attributes"]
        start, ms = (_ns(s["start_time"]) - t0) / 1e6, (_ns(s["end_time"]) -
                                                         _ns(s["start_time"])) / 1e6
        if not (a["tandem.step.prefill_tokens"] or a["tandem.step.admitted"]
                or a["tandem.step.first_tokens"]):
            decodes.append(ms)
            continue
        flush()
        out.append(f"| {start:.1f} | {ms:.1f} | {a['tandem.step.scheduled']} | "
                   f"{a['tandem.step.prefill_tokens']} | {a['tandem.step.admitted']} | "
                   f"{a['tandem.step.first_tokens']} | {a['tandem.step.waiting']} | "
                   f"{a['tandem.step.running']} |")
    flush()
    return "\n".join(out)


def arrival_table(rows: list[dict], wave: int) -> str:
    """How a burst of `wave` requests (the first, in start order) reaches the worker: each hop's
    start, ms after the first request's HTTP span began, at quantiles over the burst. A hop
    whose spread is much wider than the one before it serializes the burst."""
    burst = rows[:wave]
    if not burst:
        return "(no traced requests)"
    t0 = burst[0]["at"][0]
    hops = ["HTTP request", "call to the worker", "worker received", "first token"]
    out = ["| hop starts, ms after the first request | min | p25 | p50 | p75 | max |",
           "|---|---:|---:|---:|---:|---:|"]
    for i, hop in enumerate(hops):
        at = sorted((r["at"][i] - t0) / 1e6 for r in burst)
        q = [at[round(f * (len(at) - 1))] for f in (0, 0.25, 0.5, 0.75, 1)]
        out.append(f"| {hop} | " + " | ".join(f"{v:.1f}" for v in q) + " |")
    return "\n".join(out)


def table(rows: list[dict], client_ttft_ms: list[float] | None = None) -> str:
    """Medians of each part; with the client's TTFTs (same order and count), the rest."""
    keys = ["before the call", "to the worker", "worker to first token",
            "first token at the worker"]
    out = ["| part | p50 ms | min ms | max ms |", "|---|---:|---:|---:|"]
    if client_ttft_ms and len(client_ttft_ms) == len(rows):
        for row, ttft in zip(rows, client_ttft_ms, strict=True):
            row["client TTFT"] = ttft
            row["back to the client"] = ttft - row["first token at the worker"]
        keys += ["back to the client", "client TTFT"]
    for key in keys:
        values = [r[key] for r in rows]
        out.append(f"| {key} | {statistics.median(values):.2f} | {min(values):.2f} | "
                   f"{max(values):.2f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=pathlib.Path)
    parser.add_argument("--client-ttft-ms", type=float, nargs="*")
    parser.add_argument("--steps", action="store_true", help="also the engine's steps")
    parser.add_argument("--wave", type=int, default=0,
                        help="also how the first WAVE requests reach the worker")
    args = parser.parse_args()
    found = spans(args.log.read_text(errors="replace"))
    rows = split(found)
    print(f"{len(rows)} traced requests")
    if rows:
        print(table(rows, args.client_ttft_ms))
    if rows and args.wave:
        print(arrival_table(rows, args.wave))
    if args.steps:
        print(step_table(found))


if __name__ == "__main__":
    main()
