"""GPU placement of `tandem up`'s workers (issue 40): the GPUs and memory share each worker
gets, from the flat flags, YAML pools and models; every refusal; the launcher's environment for
each child; and the reference engine's KV budget under a share of its GPU."""
from __future__ import annotations

import logging
import math
import pathlib
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tandem.engines.args import EngineArgs
from tandem.engines.reference.build import num_kv_blocks
from tandem.errors import InvalidRequest
from tandem.launcher import up
from tandem.launcher.deployment import Deployment
from tandem.launcher.processes import processes
from tandem.launcher.topology import Topology
from tandem.launcher.workers import ServiceProcess
from tandem.runtime import config as config_lib
from tandem.runtime.worker_config import WorkerConfig

GiB, MiB = 2 ** 30, 2 ** 20
PLACED = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _load(argv: list[str], yaml_text: str | None = None, tmp_path: pathlib.Path | None = None,
          environ: dict[str, str] | None = None) -> Deployment:
    if yaml_text is not None:
        assert tmp_path is not None
        spec = tmp_path / "deploy.yaml"
        spec.write_text(yaml_text)
        argv = ["--config", str(spec), *argv]
    # One frontend process (0 would be one per 4 cores); no TANDEM_* of the test's environment.
    return config_lib.load(Deployment, [*argv, "--frontend-processes", "1"], prog="t",
                           environ=environ or {})


def _procs(tmp_path: pathlib.Path, argv: list[str],
           yaml_text: str | None = None) -> dict[str, ServiceProcess]:
    return {p.name: p for p in processes(_load(argv, yaml_text, tmp_path), tmp_path)}


def _refusal(tmp_path: pathlib.Path, argv: list[str],
             yaml_text: str | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        _procs(tmp_path, argv, yaml_text)
    return info.value


def _worker_config(p: ServiceProcess) -> WorkerConfig:
    """What the worker's own parser makes of its command line (after `serve <stage>`)."""
    return config_lib.load(WorkerConfig, p.argv[p.argv.index("serve") + 2:], prog="t",
                           environ={})


# -- what each worker gets -------------------------------------------------------------------


def test_flat_flags_put_prefill_and_decode_on_their_own_gpus(tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, ["--disagg", "--prefill-gpus", "0", "--decode-gpus", "1"])
    assert list(procs) == ["decode-0", "prefill-0", "router", "frontend"]
    assert procs["decode-0"].env == {**PLACED, "CUDA_VISIBLE_DEVICES": "1"}
    assert procs["prefill-0"].env == {**PLACED, "CUDA_VISIBLE_DEVICES": "0"}
    assert procs["router"].env == {} and procs["frontend"].env == {}
    # A GPU of its own: no share asked for, none passed on.
    assert all("--gpu-memory-fraction" not in p.argv for p in procs.values())
    assert _worker_config(procs["decode-0"]).engine_args.gpu_memory_fraction == 0.0


def test_one_entry_per_worker_in_port_order_with_several_gpus_each(
        tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, ["--decode-ports", "9200", "9201", "9202",
                              "--decode-gpus", "2,3", "0", " 05 , 1"])
    assert [procs[f"decode-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in range(3)] == [
        "2,3", "0", "5,1"]  # the worker's order kept: its first GPU is its cuda:0


def test_no_placement_leaves_every_process_environment_alone(tmp_path: pathlib.Path) -> None:
    procs = processes(_load(["--disagg", "--encode-ports", "9500"]), tmp_path)
    assert [p.name for p in procs] == ["decode-0", "prefill-0", "encode-0", "router", "frontend"]
    assert all(p.env == {} for p in procs)
    assert all("--gpu-memory-fraction" not in p.argv for p in procs)


def test_shared_gpu_with_fractions_passes_each_worker_its_share(tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, ["--disagg", "--prefill-gpus", "0", "--decode-gpus", "0",
                              "--prefill-gpu-memory-fraction", "0.5",
                              "--decode-gpu-memory-fraction", "0.5"])
    for name in ("decode-0", "prefill-0"):
        assert procs[name].env == {**PLACED, "CUDA_VISIBLE_DEVICES": "0"}
        argv = procs[name].argv
        assert argv[argv.index("--gpu-memory-fraction") + 1] == "0.5"
        assert _worker_config(procs[name]).engine_args.gpu_memory_fraction == 0.5


def test_a_share_without_placement_is_passed_on_too(tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, ["--decode-gpu-memory-fraction", "0.25"])
    assert procs["decode-0"].env == {}
    assert _worker_config(procs["decode-0"]).engine_args.gpu_memory_fraction == 0.25


def test_the_engine_wide_share_counts_for_a_shared_gpu(tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, ["--disagg", "--prefill-gpus", "0", "--decode-gpus", "0",
                              "--gpu-memory-fraction", "0.5"])
    assert _worker_config(procs["prefill-0"]).engine_args.gpu_memory_fraction == 0.5
    # The pool's own share wins over the engine-wide one.
    procs = _procs(tmp_path, ["--disagg", "--prefill-gpus", "0", "--decode-gpus", "0",
                              "--gpu-memory-fraction", "0.5", "--decode-gpu-memory-fraction",
                              "0.3"])
    assert _worker_config(procs["decode-0"]).engine_args.gpu_memory_fraction == 0.3
    assert _worker_config(procs["prefill-0"]).engine_args.gpu_memory_fraction == 0.5


def test_flat_fields_from_yaml_and_from_the_environment(tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, [], "disagg: true\ndecode_ports: [9200, 9201]\n"
                                 "decode_gpus: ['1', '2,3']\nprefill_gpus: ['0']\n"
                                 "encode_ports: [9500]\nencode_gpus: ['0']\n"
                                 "prefill_gpu_memory_fraction: 0.75\n"
                                 "encode_gpu_memory_fraction: 0.25\n")
    assert {name: p.env.get("CUDA_VISIBLE_DEVICES") for name, p in procs.items()} == {
        "decode-0": "1", "decode-1": "2,3", "prefill-0": "0", "encode-0": "0",
        "router": None, "frontend": None}
    assert _worker_config(procs["encode-0"]).engine_args.gpu_memory_fraction == 0.25
    # TANDEM_*_GPUS splits at commas and spaces: one GPU per worker there.
    d = _load([], environ={"TANDEM_DECODE_GPUS": "0 1", "TANDEM_DECODE_PORTS": "9200,9201"})
    assert d.decode_gpus == ["0", "1"]
    assert [p.env.get("CUDA_VISIBLE_DEVICES") for p in processes(d, tmp_path)[:2]] == ["0", "1"]


def test_pools_from_yaml_as_deploy_local_yaml_shows(tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, [], (
        "pools:\n"
        "  - {name: prefill, kind: prefill, ports: [9300], gpus: ['0'], "
        "gpu_memory_fraction: 0.5}\n"
        "  - {name: decode, kind: decode, ports: [9200], gpus: ['0'], "
        "gpu_memory_fraction: 0.5}\n"))
    for name in ("prefill-0", "decode-0"):
        assert procs[name].env == {**PLACED, "CUDA_VISIBLE_DEVICES": "0"}
        assert _worker_config(procs[name]).engine_args.gpu_memory_fraction == 0.5


def test_models_place_their_pools_and_video_workers_get_their_gpus(
        tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, ["--video-ports", "9600", "--video-gpus", "3"], (
        "models:\n"
        "  - name: a\n"
        "    pools: [{name: decode, kind: decode, ports: [9200], gpus: ['0']}]\n"
        "  - name: b\n"
        "    pools: [{name: decode, kind: decode, ports: [9201], gpus: ['1,2']}]\n"))
    assert {name: p.env.get("CUDA_VISIBLE_DEVICES") for name, p in procs.items()
            if "CUDA_VISIBLE_DEVICES" in p.env} == {
        "a-decode-0": "0", "video-0": "3", "b-decode-0": "1,2"}
    assert "video" in procs["video-0"].argv


def test_video_workers_are_placed_whatever_the_text_engine(tmp_path: pathlib.Path) -> None:
    procs = _procs(tmp_path, ["--engine", "mock", "--video-ports", "9600", "--video-gpus", "0"])
    assert procs["video-0"].env == {**PLACED, "CUDA_VISIBLE_DEVICES": "0"}
    assert procs["decode-0"].env == {}


# -- refusals --------------------------------------------------------------------------------


def test_an_entry_per_worker(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, ["--decode-ports", "9200", "9201", "--decode-gpus", "0"])
    assert error.param == "decode_gpus"
    assert "decode_gpus lists 1 entries for 2 workers" in error.message
    error = _refusal(tmp_path, ["--disagg", "--prefill-gpus", "0", "1"])
    assert error.param == "prefill_gpus" and "2 entries for 1 workers" in error.message


@pytest.mark.parametrize("entry,bad", [("-1", "-1"), ("a", "a"), ("1.5", "1.5"), ("", ""),
                                       ("0,", ""), ("GPU-0", "GPU-0")])
def test_indices_are_non_negative_integers(tmp_path: pathlib.Path, entry: str, bad: str) -> None:
    error = _refusal(tmp_path, [], f"decode_gpus: ['{entry}']\n")
    assert error.param == "decode_gpus"
    assert f"got {bad!r}" in error.message and "non-negative integers" in error.message


def test_no_gpu_twice_within_one_worker(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, ["--decode-gpus", "1,0,1"])
    assert error.param == "decode_gpus"
    assert error.message == "decode_gpus entry '1,0,1' lists GPU 1 twice"


def test_placement_needs_an_engine_and_a_device_that_use_gpus(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, ["--engine", "mock", "--decode-gpus", "0"])
    assert error.param == "decode_gpus" and "the mock engine computes nothing" in error.message
    error = _refusal(tmp_path, ["--device", "cpu", "--disagg", "--prefill-gpus", "0"])
    assert error.param == "prefill_gpus" and "--device is cpu" in error.message
    # A placed worker's GPUs are renumbered from 0: cuda:1 needs two in every entry.
    error = _refusal(tmp_path, ["--device", "cuda:1", "--decode-ports", "9200", "9201",
                                "--decode-gpus", "2,3", "4"])
    assert error.param == "decode_gpus" and "lists 1" in error.message
    assert _procs(tmp_path, ["--device", "cuda:1", "--decode-gpus", "2,3"])[
        "decode-0"].env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_tensor_parallel_worker_takes_as_many_gpus_as_ranks(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, ["--tensor-parallel-size", "2", "--decode-ports", "9200", "9201",
                                "--decode-gpus", "0,1", "2"])
    assert error.param == "decode_gpus"
    assert error.message == ("decode_gpus entry '2' lists 1 GPU(s) for a worker of "
                             "--tensor-parallel-size 2: list 2 GPUs per worker (e.g. \"0,1\")")
    procs = _procs(tmp_path, ["--tensor-parallel-size", "2", "--decode-ports", "9200", "9201",
                              "--decode-gpus", "0,1", "2,3"])
    assert [procs[f"decode-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["0,1", "2,3"]
    assert _worker_config(procs["decode-1"]).engine_args.tensor_parallel_size == 2


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan"])
def test_fractions_within_zero_and_one(tmp_path: pathlib.Path, value: str) -> None:
    error = _refusal(tmp_path, ["--decode-gpu-memory-fraction", value])
    assert error.param == "decode_gpu_memory_fraction"
    assert "must be within [0, 1]" in error.message
    error = _refusal(tmp_path, ["--disagg", "--prefill-gpu-memory-fraction", value])
    assert error.param == "prefill_gpu_memory_fraction"


def test_yaml_pools_and_models_are_named_by_their_path(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, [], (
        "pools:\n"
        "  - {name: a, kind: decode, ports: [9200]}\n"
        "  - {name: b, kind: decode, ports: [9201, 9202], gpus: ['0']}\n"))
    assert error.param == "pools[1].gpus"
    error = _refusal(tmp_path, [], (
        "pools:\n  - {name: a, kind: decode, ports: [9200], gpu_memory_fraction: 2.0}\n"))
    assert error.param == "pools[0].gpu_memory_fraction"
    error = _refusal(tmp_path, [], (
        "models:\n"
        "  - name: m\n"
        "    pools: [{name: decode, kind: decode, ports: [9200], gpus: ['x']}]\n"))
    assert error.param == "models[0].pools[0].gpus"


def test_video_workers_take_no_share(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, [], (
        "pools:\n"
        "  - {name: decode, kind: decode, ports: [9200]}\n"
        "  - {name: video, kind: video, ports: [9600], gpus: ['0'], gpu_memory_fraction: 0.5}\n"))
    assert error.param == "pools[1].gpu_memory_fraction"
    error = _refusal(tmp_path, ["--decode-gpus", "0", "--decode-gpu-memory-fraction", "0.5",
                                "--video-ports", "9600", "--video-gpus", "0"])
    assert error.param == "video_gpus"
    assert error.message == ("GPU 0 is listed for decode-0 and video-0, but video-0 is a video "
                             "worker, which takes no memory share: give it a GPU of its own")


# -- two workers on one GPU only when asked --------------------------------------------------


def test_a_shared_gpu_needs_a_share_for_every_worker(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, ["--disagg", "--prefill-gpus", "0", "--decode-gpus", "0"])
    assert error.param == "decode_gpu_memory_fraction"
    assert error.message.startswith("GPU 0 is listed for decode-0 and prefill-0: workers share "
                                    "a GPU only with a gpu_memory_fraction > 0 each")
    assert "decode-0 has none: set decode_gpu_memory_fraction" in error.message
    error = _refusal(tmp_path, ["--disagg", "--prefill-gpus", "0", "--decode-gpus", "0",
                                "--decode-gpu-memory-fraction", "0.5"])
    assert error.param == "prefill_gpu_memory_fraction"
    assert "prefill-0 has none" in error.message


def test_workers_of_one_pool_may_share_a_gpu_with_shares(tmp_path: pathlib.Path) -> None:
    argv = ["--decode-ports", "9200", "9201", "--decode-gpus", "0", "0"]
    assert _refusal(tmp_path, argv).param == "decode_gpu_memory_fraction"
    procs = _procs(tmp_path, [*argv, "--decode-gpu-memory-fraction", "0.5"])
    assert procs["decode-1"].env["CUDA_VISIBLE_DEVICES"] == "0"


def test_overlapping_lists_share_the_gpu_they_have_in_common(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, ["--decode-ports", "9200", "9201", "--decode-gpus", "0,1",
                                "1,2"])
    assert "GPU 1 is listed for decode-0 and decode-1" in error.message


def test_shares_on_one_gpu_sum_to_at_most_one(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, ["--disagg", "--prefill-gpus", "0", "--decode-gpus", "0",
                                "--decode-gpu-memory-fraction", "0.6",
                                "--prefill-gpu-memory-fraction", "0.5"])
    assert error.param == "decode_gpu_memory_fraction"
    assert error.message == ("GPU 0 is listed for decode-0 and prefill-0, whose "
                             "gpu_memory_fraction values (decode-0 0.6, prefill-0 0.5) sum to "
                             "1.1, more than the whole GPU (1.0): lower them")
    # 0.34 + 0.56 + 0.1 is 1.0000000000000002 in floating point: still the whole GPU.
    assert 0.34 + 0.56 + 0.1 > 1.0
    pools = "".join(f"  - {{name: p{i}, kind: decode, ports: [{9200 + i}], gpus: ['0'], "
                    f"gpu_memory_fraction: {f}}}\n" for i, f in enumerate((0.34, 0.56, 0.1)))
    assert len(_procs(tmp_path, [], "pools:\n" + pools)) == 5


def test_a_pools_worker_flags_share_is_the_one_checked(tmp_path: pathlib.Path) -> None:
    error = _refusal(tmp_path, [], (
        "pools:\n"
        "  - {name: a, kind: decode, ports: [9200], gpus: ['0'], gpu_memory_fraction: 0.5,\n"
        "     worker_flags: [--gpu-memory-fraction, '0.7']}\n"
        "  - {name: b, kind: decode, ports: [9201], gpus: ['0'], gpu_memory_fraction: 0.5}\n"))
    assert "(a-0 0.7, b-0 0.5) sum to 1.2" in error.message


# -- the launcher ----------------------------------------------------------------------------


class _FakePopen:
    """Records what the launcher would start."""

    started: list[dict[str, Any]] = []

    def __init__(self, argv: list[str], env: dict[str, str], **_: Any) -> None:
        self.pid = 4242
        _FakePopen.started.append({"argv": argv, "env": env})


def test_spawn_adds_the_worker_env_over_the_launchers(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    monkeypatch.setenv("SOME_LAUNCHER_VAR", "kept")
    monkeypatch.setattr(subprocess, "Popen", _FakePopen)
    _FakePopen.started = []
    placed = ServiceProcess("decode-0", "127.0.0.1:9200", ["w"],
                            env={**PLACED, "CUDA_VISIBLE_DEVICES": "1,2"})
    unplaced = ServiceProcess("router", "127.0.0.1:9100", ["r"])
    Topology([placed, unplaced], config_lib.build(Deployment, {}).tls, tmp_path).start()
    placed_env, unplaced_env = (s["env"] for s in _FakePopen.started)
    assert placed_env["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert placed_env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert placed_env["SOME_LAUNCHER_VAR"] == "kept"
    assert unplaced_env["CUDA_VISIBLE_DEVICES"] == "7"  # as today: the launcher's own
    assert "CUDA_DEVICE_ORDER" not in unplaced_env


def test_launcher_warns_that_host_indices_replace_its_visible_devices(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    placed = ServiceProcess("decode-0", "a:1", ["w"], env={"CUDA_VISIBLE_DEVICES": "1"})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with caplog.at_level(logging.WARNING, logger="tandem.up"):
        up._warn_of_visible_devices([placed])
        assert caplog.records == []
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
        up._warn_of_visible_devices([placed, ServiceProcess("router", "a:2", ["r"])])
    [record] = caplog.records
    assert record.__dict__["placed"] == ["decode-0"]
    assert record.__dict__["launcher_cuda_visible_devices"] == "4,5"


# -- the reference engine's KV budget under a share ------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """An 80 GiB GPU whose free and held memory the test sets (there is no GPU here)."""
    gpu = SimpleNamespace(free=60 * GiB, total=80 * GiB, held=16 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gpu.free, gpu.total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: gpu.held)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=gpu.total))
    return gpu


CUDA = torch.device("cuda", 0)


def test_kv_budget_is_the_share_less_what_the_weights_hold(fake_gpu: SimpleNamespace) -> None:
    args = EngineArgs(gpu_memory_fraction=0.5, free_gpu_memory_fraction=0.9)
    # (0.5 * 80 GiB - 16 GiB) * 0.9 = 21.6 GiB = 22118.4 MiB.
    assert num_kv_blocks(args, MiB, CUDA) == 22118
    # Without a share: 0.9 of the 60 GiB free.
    assert num_kv_blocks(EngineArgs(free_gpu_memory_fraction=0.9), MiB, CUDA) == 55296


def test_kv_budget_under_a_share_is_capped_by_the_free_memory(
        fake_gpu: SimpleNamespace) -> None:
    fake_gpu.free = 10 * GiB  # another worker holds more than its share
    args = EngineArgs(gpu_memory_fraction=0.5, free_gpu_memory_fraction=0.9)
    assert num_kv_blocks(args, MiB, CUDA) == 9216  # 0.9 * 10 GiB


def test_a_share_the_weights_fill_is_refused_clearly(fake_gpu: SimpleNamespace) -> None:
    fake_gpu.held = 40 * GiB
    with pytest.raises(InvalidRequest) as info:
        num_kv_blocks(EngineArgs(gpu_memory_fraction=0.5), MiB, CUDA)
    assert info.value.param == "gpu_memory_fraction"
    assert info.value.message == (
        f"--gpu-memory-fraction 0.5 gives this worker {40 * GiB} bytes of the GPU's "
        f"{80 * GiB}, the weights and buffers took {40 * GiB}, and {60 * GiB} bytes are free: "
        f"that leaves no KV block of {MiB} bytes; raise --gpu-memory-fraction (and lower the "
        "other workers' on this GPU)")


@pytest.mark.parametrize("fraction", [1.5, -0.5, math.nan])
def test_the_engine_refuses_a_share_outside_zero_and_one(fake_gpu: SimpleNamespace,
                                                         fraction: float) -> None:
    for device in (CUDA, torch.device("cpu")):
        with pytest.raises(InvalidRequest, match=r"within \[0, 1\]") as info:
            num_kv_blocks(EngineArgs(gpu_memory_fraction=fraction), MiB, device)
        assert info.value.param == "gpu_memory_fraction"


def test_on_cpu_the_share_changes_nothing(fake_gpu: SimpleNamespace) -> None:
    args = EngineArgs(gpu_memory_fraction=0.5, kv_cache_cpu_bytes=64 * MiB)
    assert num_kv_blocks(args, MiB, torch.device("cpu")) == 64
    assert num_kv_blocks(EngineArgs(gpu_memory_fraction=0.5, num_gpu_blocks=7), MiB, CUDA) == 7


@pytest.mark.parametrize(("name", "workers"), [
    ("agg-tp2.yaml", {"decode-0": "0,1"}),
    ("disagg.yaml", {"prefill-0": "0,1", "decode-0": "2,3"})])
def test_the_gpt_oss_120b_deployments_place_a_tensor_parallel_worker_on_its_gpus(
        tmp_path: pathlib.Path, name: str, workers: dict[str, str]) -> None:
    path = pathlib.Path(__file__).parents[2] / "deploy" / "gpt-oss-120b" / name
    procs = {p.name: p for p in processes(_load(["--config", str(path)]), tmp_path)}
    for worker, gpus in workers.items():
        assert procs[worker].env["CUDA_VISIBLE_DEVICES"] == gpus
        config = _worker_config(procs[worker])
        assert config.engine_args.tensor_parallel_size == 2
        assert config.engine_args.model == "/models/gpt-oss-120b"
    assert "harmony" in procs["frontend"].argv and "gpt_oss" in procs["frontend"].argv
