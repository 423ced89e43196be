"""What the backbone benchmark watches besides aiperf: per-process CPU time (from /proc), the
decode worker's KV utilisation (from its public KvEvents stream) and py-spy profiles.

Linux only; standard library, plus tandem's generated gRPC stubs for the KV probe.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
ROLES = ("frontend", "router", "prefill", "decode", "encode")


def read_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime + stime ticks) of a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid in _pids():
        stat = read_stat(pid)
        if stat:
            children[stat[0]].append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def label_processes(tandem_pid: int) -> dict[int, str]:
    """Readable names for tandem's processes and aiperf's services; other processes are left out."""
    labels: dict[int, str] = {}
    tandem = descendants(tandem_pid)
    for pid in _pids():
        cmd = _cmdline(pid)
        if not cmd:
            continue
        if pid == tandem_pid:
            name = "tandem up"
        elif pid == os.getpid():
            name = "bench driver"
        elif Path(cmd[0]).name == "py-spy":
            name = "py-spy"
        elif pid in tandem:
            text = " ".join(cmd)
            role = next((r for r in ROLES if re.search(rf"\b{r}\b", text)), None)
            name = f"tandem {role}" if role else "tandem " + Path(cmd[-1]).name
        elif cmd[0].startswith("aiperf"):
            # aiperf sets its services' titles, e.g. "aiperf worker_c8593056".
            parts = cmd[0].split() + cmd[1:]
            service = re.sub(r"_[0-9a-f]{6,}$", "", parts[1]) if len(parts) > 1 else "cli"
            name = f"aiperf {service}"
        else:
            continue
        if name in labels.values():
            name = f"{name}[{pid}]"
        labels[pid] = name
    return labels


def machine_ticks() -> tuple[int, int, int]:
    """(busy, total, steal) jiffies over all cores from /proc/stat (guest time is in user)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = values
    return user + nice + system + irq + softirq, sum(values), steal


class CpuSampler:
    """Samples the CPU time of tandem's and aiperf's processes every interval_s."""

    def __init__(self, tandem_pid: int, interval_s: float = 0.5):
        self.tandem_pid = tandem_pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, tuple[int, int], dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        labels: dict[int, str] = {}
        next_relabel = 0.0
        while not self._stop.is_set():
            now = time.time()
            if now >= next_relabel:  # aiperf spawns its services after we start
                labels = label_processes(self.tandem_pid)
                next_relabel = now + 2.0
            ticks = {}
            for pid, name in labels.items():
                stat = read_stat(pid)
                if stat:
                    ticks[name] = stat[1]
            self.samples.append((now, machine_ticks(), ticks))
            self._stop.wait(self.interval_s)

    def percent_between(self, start: float, end: float) -> dict[str, float]:
        """CPU use of each process over [start, end], percent of one core; plus the machine's."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, m0, p0), (t1, m1, p1) = inside[0], inside[-1]
        seconds = t1 - t0
        result = {
            name: 100.0 * (p1[name] - p0[name]) / CLK_TCK / seconds
            for name in p1 if name in p0
        }
        cores = os.cpu_count() or 1
        total = max(1, m1[1] - m0[1])
        machine = 100.0 * cores * (m1[0] - m0[0]) / total
        # Everything not named above: other users of this shared machine, kernel (softirq of
        # loopback TCP), short-lived processes.
        result["other (unattributed)"] = max(0.0, machine - sum(result.values()))
        result["machine busy (all cores)"] = machine
        result["steal (hypervisor)"] = 100.0 * cores * (m1[2] - m0[2]) / total
        return result


class KvLoadSampler:
    """Follows a decode worker's WorkerLoad messages (KvEvents.Subscribe) to know u = used/total."""

    def __init__(self, address: str | None):
        self.address = address
        self.samples: list[tuple[float, float, int]] = []  # (time, u, num_running)
        # (time, requests whose prompt blocks the pass stored): one KvEventBatch per engine pass;
        # a prefill stores a chain of several blocks (or a root block) for a request at once,
        # a decode pass at most one block per request.
        self.prefill_batches: list[tuple[float, int]] = []
        self.batch_times: list[float] = []  # every KvEventBatch: passes that changed the cache
        self.error: str | None = None
        self._call = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def for_decode_worker(
        cls, tandem_lines: list[str], frontend_address: str, override: str
    ) -> KvLoadSampler:
        """Finds the decode worker's address in `tandem up`'s output unless given one."""
        if override:
            return cls(override)
        # tandem up relays its services' JSON logs: {"service": "decode", "msg": "serving",
        # "address": "127.0.0.1:9200", ...}
        for line in tandem_lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if (isinstance(record, dict) and str(record.get("service", "")).startswith("decode")
                    and record.get("msg") == "serving" and record.get("address")):
                return cls(record["address"])
        for line in tandem_lines:
            if re.search(r"\bdecode\b", line, re.IGNORECASE):
                match = re.search(r"(?:127\.0\.0\.1|localhost|0\.0\.0\.0|\[::1?\]):(\d+)", line)
                if match and not match.group(0).endswith(frontend_address.rsplit(":", 1)[-1]):
                    return cls(f"127.0.0.1:{match.group(1)}")
        return cls(None)

    def start(self) -> None:
        if self.address:
            self._thread.start()

    def stop(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            import grpc

            from tandem.v1 import kv_events_pb2, kv_events_pb2_grpc

            channel = grpc.insecure_channel(self.address)
            stub = kv_events_pb2_grpc.KvEventsStub(channel)
            self._call = stub.Subscribe(kv_events_pb2.SubscribeRequest())
            for message in self._call:
                kind = message.WhichOneof("payload")
                if kind == "batch":
                    self.batch_times.append(time.time())
                    prefills = sum(
                        1 for event in message.batch.events
                        if event.WhichOneof("kind") == "stored" and (
                            len(event.stored.block_hashes) >= 2
                            or not event.stored.HasField("parent_hash")))
                    if prefills:
                        self.prefill_batches.append((time.time(), prefills))
                elif kind == "load":
                    load = message.load
                    if load.kv_blocks_total:
                        u = load.kv_blocks_used / load.kv_blocks_total
                        self.samples.append((time.time(), u, load.num_running))
        except Exception as exc:  # the probe is optional: report why it saw nothing
            if "CANCELLED" not in str(exc):
                self.error = f"{type(exc).__name__}: {exc}"

    def utilisation_between(self, start: float, end: float) -> dict | None:
        """Time-weighted mean, min and max of u over [start, end]; None without samples."""
        if not self.samples:
            return None
        before = [s for s in self.samples if s[0] <= start]
        points = ([(start, before[-1][1], before[-1][2])] if before else []) + [
            s for s in self.samples if start < s[0] <= end]
        if not points:
            return None
        weighted, running, total = 0.0, 0.0, 0.0
        for (t, u, n), nxt in zip(points, points[1:] + [(end, 0.0, 0)]):
            weighted += u * (nxt[0] - t)
            running += n * (nxt[0] - t)
            total += nxt[0] - t
        us = [p[1] for p in points]
        return {
            "mean": weighted / total if total > 0 else us[-1],
            "mean_running": running / total if total > 0 else points[-1][2],
            "min": min(us),
            "max": max(us),
            "samples": len(points),
            "event_batches": sum(1 for t in self.batch_times if start <= t <= end),
            "prefill_passes": sum(1 for t, _ in self.prefill_batches if start <= t <= end),
            "prefilled_requests": sum(n for t, n in self.prefill_batches if start <= t <= end),
            "max_running": max(p[2] for p in points),
            "address": self.address,
        }


def summarize_collapsed(path: Path, top: int = 15) -> list[str]:
    """Top self and inclusive frames of a py-spy raw (collapsed stacks) profile."""
    self_counts: collections.Counter[str] = collections.Counter()
    incl_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            incl_counts[frame] += count
    lines = [f"{total} samples"]
    lines += ["  self:"] + [f"    {100 * c / total:5.1f}%  {f}" for f, c in self_counts.most_common(top)]
    lines += ["  inclusive:"] + [
        f"    {100 * c / total:5.1f}%  {f}" for f, c in incl_counts.most_common(top * 2)
        if not f.startswith(("<module>", "run (", "_run_once", "run_forever", "run_until_complete",
                             "_bootstrap", "main ("))
    ][: top]
    return lines


def profile_with_py_spy(
    py_spy: Path, tandem_pid: int, out_dir: Path, seconds: float, delay_s: float,
    native: bool = False,
) -> None:
    """py-spy records every tandem process at once for `seconds`, after `delay_s`."""
    time.sleep(delay_s)
    labels = {pid: name for pid, name in label_processes(tandem_pid).items()
              if name.startswith("tandem") and name != "tandem up"}
    procs = []
    for pid, name in labels.items():
        out = out_dir / f"py-spy-{name.replace(' ', '_')}.txt"
        cmd = [str(py_spy), "record", "--pid", str(pid), "--duration", str(int(seconds)),
               "--rate", "100", "--format", "raw", "--output", str(out)]
        # --native adds C frames (grpc core, protobuf, tokenizers) but must pause the process
        # to unwind; without it py-spy reads memory without stopping the target.
        cmd.append("--native" if native else "--nonblocking")
        procs.append((name, out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, text=True)))
    for name, out, proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0 or not out.exists():
            print(f"py-spy on {name} failed: {err.strip()[-300:]}", flush=True)
            continue
        summary = "\n".join(summarize_collapsed(out))
        (out.with_suffix(".summary.txt")).write_text(summary + "\n")
        print(f"--- py-spy {name} ({out}) ---\n{summary}", flush=True)
