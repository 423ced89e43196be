"""GPU investigation: why a NIXL READ between two agents on one GPU ran at ~0.6 GB/s while a
device-to-device copy runs at ~2,000 GB/s. Standalone (PyTorch with CUDA and a nixl wheel; no
tandem import), one run of about 5 minutes:

    python benchmarks/probes/kv_transfer_gpu.py                # on the GPU host
    python benchmarks/probes/kv_transfer_gpu.py --device cpu   # the same code paths on DRAM (no GPU)
    python benchmarks/probes/kv_transfer_gpu.py --dry-run      # the plan and the transport report only

It first reports the transport stack: versions, UCX_/NIXL_/CUDA environment, `ucx_info` if it is
on PATH, else the UCX bundled with the nixl wheel (its version, and whether each of its transport
modules, libuct_cuda among them, can be loaded: one that cannot is silently missing from UCX).
Then every case runs in its own process with a timeout, so a hang costs one case:

  mode       "2proc": the source agent in a second process on the same GPU (as a prefill and a
             decode worker); "1proc": both agents in one process.
  direction  "vram->vram", or "vram->dram" into pinned host memory.
  UCX_TLS    unset, "cuda_ipc,cuda_copy,tcp", "cuda_copy,tcp", "all".

Inside a case, each (descriptors, registration) pair is timed: descriptors "one" (a single
descriptor of --mib MiB, 256 by default), "coalesced" (a KV layout of --layers x K|V runs, one descriptor per
run, as tandem's NixlTransfer sends) or "blocks" (one --region-kib descriptor per (layer, K|V,
block), 64 KiB by default: nothing merges); registration "once" (the whole destination before
timing) or "per-transfer" (registered and deregistered around every read, inside the timing).
A read is initialize_xfer + transfer + polling to DONE + release; the figure is the median
after one warm-up read, verified against the source's pattern. The baseline is a torch copy of
as many bytes in the same process (device to device, or device to pinned host). UCX runs with
UCX_PROTO_INFO=y; the "UCX read path" column is what UCX chose for the GET (e.g. cuda_ipc/cuda,
or tcp/lo: bytes through sockets, which would explain 0.6 GB/s), and UCX warnings (e.g.
"transports 'cuda_ipc' are not available") are listed under the table. Raw logs: --log-dir.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.metadata
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

MODES = ("2proc", "1proc")
DIRECTIONS = ("vram->vram", "vram->dram")
TLS_SETTINGS = ("unset", "cuda_ipc,cuda_copy,tcp", "cuda_copy,tcp", "all")
DESCRIPTORS = ("one", "coalesced", "blocks")
REGISTRATIONS = ("once", "per-transfer")


@dataclass(frozen=True)
class Case:
    mode: str
    direction: str
    tls: str
    device: str
    mib: int
    layers: int
    region_kib: int
    repeats: int
    cap_s: float

    @property
    def region_bytes(self) -> int:
        return self.region_kib * 1024

    @property
    def num_blocks(self) -> int:
        """Blocks per read (each 2 * layers regions)."""
        return max(1, self.mib * 2**20 // (2 * self.layers * self.region_bytes))

    @property
    def nbytes(self) -> int:
        return self.num_blocks * 2 * self.layers * self.region_bytes

    @property
    def pool_blocks(self) -> int:
        # One spare block: a read of num_blocks never covers a whole pool.
        return self.num_blocks + 1


# ----------------------------------------------------------------------------- pools and descriptors
def make_pool(case: Case, role: str) -> Any:
    """A pool of pool_blocks KV blocks as int32; the source holds arange (so misplaced bytes
    show), the reader zeros. Reader pools of "vram->dram" cases are pinned host memory."""
    import torch

    numel = case.pool_blocks * 2 * case.layers * case.region_bytes // 4
    if role == "source":
        return torch.arange(numel, dtype=torch.int32, device=case.device)
    if case.direction == "vram->dram" or case.device == "cpu":
        return torch.zeros(numel, dtype=torch.int32, pin_memory=case.device != "cpu")
    return torch.zeros(numel, dtype=torch.int32, device=case.device)


def block_plan(case: Case, kind: str) -> tuple[list[int], list[int]]:
    """(local block ids, remote block ids) of a read: "coalesced" keeps the order on both sides,
    "blocks" reverses the local one, so that no two regions merge."""
    remote = list(range(case.num_blocks))
    return (remote if kind == "coalesced" else remote[::-1]), remote


def region_offsets(case: Case, block_ids: list[int]) -> list[int]:
    """Byte offsets of the blocks' regions in pool order (layer, K|V, block), as NixlTransfer."""
    return [((plane * case.pool_blocks) + block) * case.region_bytes
            for plane in range(2 * case.layers) for block in block_ids]


def descriptors(case: Case, kind: str, local_base: int, local_dev: int, remote_base: int,
                remote_dev: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    if kind == "one":
        return [(local_base, case.nbytes, local_dev)], [(remote_base, case.nbytes, remote_dev)]
    local_ids, remote_ids = block_plan(case, kind)
    pairs = list(zip(region_offsets(case, local_ids), region_offsets(case, remote_ids)))
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    for lo, ro in pairs:
        if local and local[-1][0] + local[-1][1] == local_base + lo \
                and remote[-1][0] + remote[-1][1] == remote_base + ro:
            local[-1] = (local[-1][0], local[-1][1] + case.region_bytes, local_dev)
            remote[-1] = (remote[-1][0], remote[-1][1] + case.region_bytes, remote_dev)
        else:
            local.append((local_base + lo, case.region_bytes, local_dev))
            remote.append((remote_base + ro, case.region_bytes, remote_dev))
    return local, remote


def verify(case: Case, kind: str, dst: Any) -> bool:
    import torch

    expected = torch.arange(dst.numel(), dtype=torch.int32, device=dst.device)
    if kind == "one":
        count = case.nbytes // 4
        return bool(torch.equal(dst[:count], expected[:count]))
    local_ids, remote_ids = block_plan(case, kind)
    shape = (2 * case.layers, case.pool_blocks, case.region_bytes // 4)
    return bool(torch.equal(dst.view(shape)[:, local_ids], expected.view(shape)[:, remote_ids]))


def memory_type(tensor: Any) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def device_id(tensor: Any) -> int:
    return tensor.device.index or 0


# ----------------------------------------------------------------------------- agents
def nixl_api() -> Any:
    """nixl._api from the `nixl` meta package, or straight from a nixl-cuXX wheel without it."""
    import importlib

    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            error = exc
    raise error


def new_agent(name: str) -> Any:
    api = nixl_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    # The progress thread answers peers' reads when the source process does nothing.
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))


def _source_main(conn: Connection, case: Case) -> None:
    """The 2proc source: registers its pool, publishes it, waits for the end."""
    import torch

    if case.device != "cpu":
        torch.cuda.set_device(0)
    pool = make_pool(case, "source")
    agent = new_agent(f"source-{os.getpid()}")
    registration = agent.register_memory(pool)
    conn.send((agent.name, agent.get_agent_metadata(), pool.data_ptr(), device_id(pool),
               memory_type(pool)))
    conn.recv()
    agent.deregister_memory(registration)


#: A read still running after this is reported as hung (its case goes on).
READ_DEADLINE_S = 20.0


def read_once(agent: Any, local: Any, remote: Any, local_type: str, remote_type: str,
              peer: str) -> None:
    xfer = agent.initialize_xfer("READ", agent.get_xfer_descs(local, local_type),
                                 agent.get_xfer_descs(remote, remote_type), peer)
    deadline = time.perf_counter() + READ_DEADLINE_S
    try:
        state = agent.transfer(xfer)
        while state == "PROC":
            if time.perf_counter() > deadline:
                raise TimeoutError(f"read still running after {READ_DEADLINE_S} s")
            state = agent.check_xfer_state(xfer)
        if state != "DONE":
            raise RuntimeError(f"transfer ended in state {state}")
    finally:
        xfer.release()


def baseline_gbps(case: Case, src: Any, dst: Any) -> float:
    import torch

    count = case.nbytes // 4
    times = []
    for i in range(case.repeats + 1):
        if case.device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst[:count].copy_(src[:count], non_blocking=True)
        if case.device != "cpu":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return case.nbytes / statistics.median(times) / 1e9


def run_case(case: Case) -> None:
    """One case, in its own process: prints one RESULT line per measurement."""
    import torch

    if case.device != "cpu":
        torch.cuda.set_device(0)
    source_pool = source_process = source_conn = None
    if case.mode == "2proc":
        context = multiprocessing.get_context("spawn")
        source_conn, child = context.Pipe()
        source_process = context.Process(target=_source_main, args=(child, case), daemon=True)
        source_process.start()
    dst = make_pool(case, "reader")
    reader = new_agent(f"reader-{os.getpid()}")
    if case.mode == "2proc":
        assert source_conn is not None
        peer, metadata, src_base, src_dev, src_type = source_conn.recv()
    else:
        source_pool = make_pool(case, "source")
        source_agent = new_agent(f"source-{os.getpid()}")
        source_agent.register_memory(source_pool)
        peer, metadata = source_agent.name, source_agent.get_agent_metadata()
        src_base, src_dev, src_type = (source_pool.data_ptr(), device_id(source_pool),
                                       memory_type(source_pool))
    reader.add_remote_agent(metadata)
    copy_src = source_pool if source_pool is not None else make_pool(case, "source")
    emit({"case": asdict(case), "kind": "baseline", "gbps": baseline_gbps(case, copy_src, dst)})
    del copy_src
    local_type = memory_type(dst)
    registration = None
    for reg in ("per-transfer", "once"):  # per-transfer first: nothing registered yet
        if reg == "once":
            registration = reader.register_memory(dst)
        for kind in DESCRIPTORS:
            local, remote = descriptors(case, kind, dst.data_ptr(), device_id(dst), src_base,
                                        src_dev)
            dst.zero_()
            if case.device != "cpu":
                torch.cuda.synchronize()  # UCX copies on its own streams
            times: list[float] = []
            started = time.perf_counter()
            try:
                for i in range(case.repeats + 1):
                    start = time.perf_counter()
                    per = reader.register_memory(dst) if reg == "per-transfer" else None
                    read_once(reader, local, remote, local_type, src_type, peer)
                    if per is not None:
                        reader.deregister_memory(per)
                    if i:
                        times.append(time.perf_counter() - start)
                    if time.perf_counter() - started > case.cap_s and times:
                        break
                result: dict[str, Any] = {
                    "gbps": case.nbytes / statistics.median(times) / 1e9,
                    "ok": verify(case, kind, dst), "reads": len(times)}
            except Exception as exc:  # one failing pair must not hide the others
                result = {"error": f"{type(exc).__name__}: {exc}"}
            emit({"case": asdict(case), "kind": "read", "descriptors": kind,
                  "num_descriptors": len(local), "registration": reg, **result})
    if registration is not None:
        reader.deregister_memory(registration)
    if source_conn is not None and source_process is not None:
        source_conn.send(None)
        source_process.join(10)


def emit(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- transport report
def report_transports(device: str) -> None:
    print("## Transport stack")
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
    if device != "cpu" and torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible")
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            print(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("UCX_", "NIXL_", "CUDA_")) or k == "LD_LIBRARY_PATH"}
    print(f"environment: {env or 'no UCX_/NIXL_/CUDA_ variables'}")
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
        print(f"nvidia-smi: {out}")
    try:
        _api = nixl_api()
        agent = new_agent(f"probe-{os.getpid()}")
        print(f"nixl backend module: {_api.__name__}; plugins: {agent.get_plugin_list()}; "
              f"UCX memory types: {agent.get_backend_mem_types('UCX')}; "
              f"UCX params: {agent.get_backend_params('UCX')}")
        # nixl._api is the nixl_cuXX._api module; its libraries sit in nixl_cuXX.libs.
        libs = os.path.join(os.path.dirname(os.path.dirname(_api.__file__)),
                            _api.__name__.split(".")[0] + ".libs")
    except Exception as exc:  # the report goes on without it
        print(f"nixl: cannot create an agent: {exc!r}")
        libs = ""
    if shutil.which("ucx_info"):
        for flags in (["-v"], ["-d"]):
            out = subprocess.run(["ucx_info", *flags], capture_output=True, text=True,
                                 timeout=60).stdout
            keep = [line for line in out.splitlines()
                    if flags == ["-v"] or re.search(r"Transport|Device|Memory domain", line)]
            print(f"ucx_info {' '.join(flags)}:\n  " + "\n  ".join(keep))
    else:
        print("ucx_info: not on PATH; UCX bundled with the nixl wheel:")
    for lib in sorted(glob.glob(os.path.join(libs, "libucp-*.so*")))[:1]:
        ucp = ctypes.CDLL(lib)
        ucp.ucp_get_version_string.restype = ctypes.c_char_p
        print(f"  {os.path.basename(lib)}: UCX {ucp.ucp_get_version_string().decode()}")
    for module in sorted(glob.glob(os.path.join(libs, "ucx", "*.so*"))):
        try:
            ctypes.CDLL(module)
            status = "loads"
        except OSError as exc:
            status = f"CANNOT LOAD: {exc}"
        print(f"  ucx/{os.path.basename(module)}: {status}")
    print(flush=True)


# ----------------------------------------------------------------------------- orchestration
def ucx_summary(stderr: str) -> tuple[str, list[str]]:
    """(the protocols UCX chose for GETs, its unique warnings) from UCX_PROTO_INFO output, whose
    tables read: a title row "remote memory read by ucp_get* into <mem> memory from <mem>", a
    "Range | Description | Config" header, then one row per message-size range."""
    paths: list[str] = []
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        title = re.search(r"remote memory read by ucp_get\S* into (\S+) memory from (\S+)", line)
        if not title:
            continue
        in_rows, num_rows = False, 0
        for row in lines[i + 1:i + 24]:
            cells = [cell.strip() for cell in row.split("|")[1:-1]]
            if not cells:  # a +----+ rule; the one after the rows ends the table
                if num_rows:
                    break
            elif cells[0] == "Range":
                in_rows = True
            elif in_rows and len(cells) >= 3:
                paths.append(f"{title[2]}->{title[1]} {cells[1]} {cells[2]}".strip())
                num_rows += 1
    warnings = sorted({re.sub(r"^.*UCX\s+(WARN|ERROR)\s+", r"\1 ", line)
                       for line in lines if re.search(r"UCX\s+(WARN|ERROR)", line)})
    return "; ".join(dict.fromkeys(paths)) or "-", warnings


def run_subprocess(case: Case, timeout_s: float, log_dir: str) -> tuple[list[dict], str]:
    env = dict(os.environ, UCX_PROTO_INFO="y")
    env.pop("UCX_TLS", None)
    if case.tls != "unset":
        env["UCX_TLS"] = case.tls
    cmd = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(asdict(case))]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        stdout, stderr, note = proc.stdout, proc.stderr, ""
        if proc.returncode:
            note = f"exit code {proc.returncode}: " + (stderr.strip().splitlines() or ["?"])[-1]
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        note = f"timed out after {timeout_s:.0f} s"
    name = f"{case.mode}_{case.direction.replace('->', '-')}_{case.tls.replace(',', '+')}.log"
    with open(os.path.join(log_dir, name), "w") as log:
        log.write(f"$ UCX_TLS={case.tls} {' '.join(cmd)}\n{stdout}\n--- stderr ---\n{stderr}")
    results = [json.loads(line[7:]) for line in stdout.splitlines()
               if line.startswith("RESULT ")]
    path, warnings = ucx_summary(stdout + "\n" + stderr)  # UCX logs to stdout
    for result in results:
        result["ucx_path"] = path
        result["warnings"] = warnings
    return results, note


def plan(args: argparse.Namespace) -> list[Case]:
    return [Case(mode, direction, tls, args.device, args.mib, args.layers, args.region_kib,
                 args.repeats, args.cap_s)
            for mode in args.modes for direction in args.directions for tls in args.tls]


def print_table(rows: list[dict], notes: list[tuple[Case, str]]) -> None:
    print("| mode | direction | UCX_TLS | descriptors | registration | GB/s | copy GB/s | "
          "NIXL / copy | ok | UCX read path |")
    print("|---|---|---|---|---|---:|---:|---:|---|---|")
    baselines = {json.dumps(r["case"]): r["gbps"] for r in rows if r["kind"] == "baseline"}
    warnings: dict[str, set[str]] = {}
    for r in rows:
        if r["kind"] != "read":
            continue
        c = r["case"]
        copy = baselines.get(json.dumps(c), 0.0)
        desc = f"{r['descriptors']} ({r['num_descriptors']})"
        if "error" in r:
            cells = f"{r['error'][:60]} | {copy:.1f} | - | - |"
        else:
            cells = (f"{r['gbps']:.2f} | {copy:.1f} | {r['gbps'] / copy:.4f} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
        print(f"| {c['mode']} | {c['direction']} | {c['tls']} | {desc} | {r['registration']} | "
              f"{cells} {r['ucx_path']} |")
        for warning in r["warnings"]:
            warnings.setdefault(warning, set()).add(c["tls"])
    for case, note in notes:
        print(f"| {case.mode} | {case.direction} | {case.tls} | - | - | {note[:80]} | - | - | - "
              "| - |")
    for warning, settings in sorted(warnings.items()):
        print(f"# UCX said (UCX_TLS {', '.join(sorted(settings))}): {warning[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: every pool in DRAM (runs the same code without a GPU)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--directions", nargs="+", default=list(DIRECTIONS), choices=DIRECTIONS)
    parser.add_argument("--tls", nargs="+", default=list(TLS_SETTINGS),
                        help="UCX_TLS settings; 'unset' leaves it out of the environment")
    parser.add_argument("--mib", type=int, default=256, help="bytes per read, MiB")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--region-kib", type=int, default=64,
                        help="bytes of one (layer, K|V) region of a block, KiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cap-s", type=float, default=1.0,
                        help="stop repeating a measurement after this long")
    parser.add_argument("--case-timeout-s", type=float, default=60.0)
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="cases not started within this are skipped")
    parser.add_argument("--log-dir", default="/tmp/kv_transfer_gpu_logs")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the transport report and the plan, run nothing")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        run_case(Case(**json.loads(args.case)))
        return
    began = time.monotonic()
    cases = plan(args)
    report_transports(args.device)
    print(f"## {len(cases)} cases, {cases[0].nbytes / 2**20:.0f} MiB per read "
          f"({cases[0].num_blocks} blocks x {args.layers} layers x K|V x {args.region_kib} KiB), "
          f"{args.repeats} timed reads (or {args.cap_s} s) per measurement; logs in "
          f"{args.log_dir}", flush=True)
    if args.dry_run:
        for case in cases:
            print(f"  {case.mode} {case.direction} UCX_TLS={case.tls}")
        return
    os.makedirs(args.log_dir, exist_ok=True)
    rows: list[dict] = []
    notes: list[tuple[Case, str]] = []
    for case in cases:
        if time.monotonic() - began > args.budget_s:
            notes.append((case, "skipped: out of time budget"))
            continue
        started = time.monotonic()
        results, note = run_subprocess(case, args.case_timeout_s, args.log_dir)
        rows += results
        if note:
            notes.append((case, note))
        print(f"  {case.mode} {case.direction} UCX_TLS={case.tls}: {len(results)} results "
              f"in {time.monotonic() - started:.0f} s {note}", file=sys.stderr, flush=True)
    print_table(rows, notes)
    print(f"# total {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
