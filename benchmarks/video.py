"""Video generation: seconds per video, Tandem's video worker (its `VideoRunner`: the reference
engine's pipeline call with the per-step hook, frames to uint8 on the device, H.264 MP4 encoding
on the encoder's thread, the MP4 stored) next to diffusers' own `WanPipeline.__call__` on the
same pipeline object, same seeds, in one run.

  python benchmarks/video.py                 # tiny random-weight Wan, CPU
  python benchmarks/video.py --wan-1.3b      # Wan2.1-T2V-1.3B-shaped transformer and Wan's VAE,
                                             # dummy weights, bf16 on CUDA (480x832 by default)

Two figures per path:
  latency     one job alone, as its user waits for it (submit to MP4 stored; diffusers: the
              call), alternating diffusers and Tandem, median of --repeats;
  throughput  --jobs jobs queued at once, wall / jobs (diffusers: that many calls back to back);
              Tandem's next job denoises while the previous one encodes.
steps/s (denoise) counts only the denoising loop (first step's end to last step's end, over
steps - 1). Before them: which H.264 encoders this machine's PyAV can open, and each encoder
setting's time, size and PSNR on the frames of the warm-up video.
The 1.3B shape keeps Wan's transformer exactly; its text encoder is a one-layer UMT5 of Wan's
width (4096) rather than UMT5-XXL (the prompt is encoded once per video, off the step loop).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tandem.model.tiny_wan import WAN_1_3B, WAN_VAE, build_wan_pipeline
from tandem.video import mp4
from tandem.video.engine import StepHook
from tandem.video.params import ResolvedParams, VideoLimits, VideoRequestParams, as_request
from tandem.video.reference import DiffusersVideoEngine
from tandem.video.runner import RunnerConfig, VideoRunner
from tandem.video.storage import MediaStore

PROMPT = "a red fox running through fresh snow at dawn, cinematic"
#: Encoder settings timed on the warm-up video's frames (the first is PyAV's default threading
#: with the old serial path's settings).
SWEEP: dict[str, mp4.H264Encoder] = {
    "x264 medium crf18 slice (old)": mp4.H264Encoder("libx264", {"crf": "18"}, "SLICE"),
    "x264 veryfast crf18": mp4.H264Encoder("libx264", {"crf": "18", "preset": "veryfast"}),
    "x264 superfast crf18": mp4.H264Encoder("libx264", {"crf": "18", "preset": "superfast"}),
    "x264 superfast crf18 slice": mp4.H264Encoder("libx264", {"crf": "18",
                                                              "preset": "superfast"}, "SLICE"),
    "x264 superfast crf18 8thr": mp4.H264Encoder("libx264", {"crf": "18", "preset": "superfast"},
                                                 num_threads=8),
    "x264 ultrafast crf18": mp4.H264Encoder("libx264", {"crf": "18", "preset": "ultrafast"}),
    "x264 superfast crf23": mp4.H264Encoder("libx264", {"crf": "23", "preset": "superfast"}),
    "nvenc p4 hq cq19": mp4.NVENC,
    "nvenc p1 cq19": mp4.H264Encoder("h264_nvenc", {"preset": "p1", "rc": "vbr", "cq": "19",
                                                    "b": "0"}, "SLICE"),
    "nvenc (FFmpeg defaults)": mp4.H264Encoder("h264_nvenc", {}, "SLICE"),
}


class InMemoryEngine(DiffusersVideoEngine):
    """The reference engine's `generate` on a pipeline built in memory (no model directory),
    timing its denoising steps."""

    def __init__(self, pipe: Any, sync: Callable[[], None]) -> None:
        self._pipe, self.class_name, self.sync = pipe, "WanPipeline", sync
        self.marks: list[float] = []

    def load(self) -> None:
        from tandem.video import pipelines

        self._spec = pipelines.spec_of(self._pipe, self.class_name)

    def generate(self, params: ResolvedParams, on_step: StepHook) -> Any:
        def timed(step: int, num_steps: int) -> None:
            self.sync()
            self.marks.append(time.perf_counter())
            on_step(step, num_steps)
        self.marks = []
        return super().generate(params, timed)


def _denoise_rate(marks: list[float]) -> float:
    return (len(marks) - 1) / (marks[-1] - marks[0]) if len(marks) > 1 else float("nan")


def _diffusers(pipe: Any, p: ResolvedParams, sync: Callable[[], None]) -> tuple[float, float]:
    import torch

    marks: list[float] = []

    def step_end(_pipe: Any, _i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        sync()
        marks.append(time.perf_counter())
        return tensors
    start = time.perf_counter()
    pipe(prompt=p.prompt, negative_prompt=p.negative_prompt or None, height=p.height,
         width=p.width, num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
         guidance_scale=p.guidance_scale, output_type="np",
         generator=torch.Generator().manual_seed(p.seed), callback_on_step_end=step_end)
    sync()
    return time.perf_counter() - start, _denoise_rate(marks)


async def _tandem(runner: VideoRunner, requests: list[VideoRequestParams]) -> float:
    """Seconds from submitting `requests` together to the last MP4 stored."""
    start = time.perf_counter()
    jobs = [runner.submit(r) for r in requests]
    for job in jobs:
        async for _ in runner.follow(job):
            pass
        assert job.video is not None, job.error
    return time.perf_counter() - start


def _psnr(frames: Any, data: bytes) -> float:
    import io

    import av
    import numpy as np

    with av.open(io.BytesIO(data), mode="r") as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    mse = float(np.mean((decoded.astype(np.float64) - frames) ** 2))
    return 10 * np.log10(255**2 / mse) if mse else float("inf")


def _sweep(frames: Any, fps: int) -> None:
    import av

    print(f"\nH.264 encoders: PyAV {av.__version__}; h264_nvenc built in: "
          f"{'h264_nvenc' in av.codecs_available}; opens here: {mp4.is_usable(mp4.NVENC)}; "
          f"the worker picks: {mp4.pick_encoder().codec}")
    print(f"encode of {frames.shape[0]} frames {frames.shape[2]}x{frames.shape[1]} "
          "(median of 3):")
    print(f"{'setting':<32}{'seconds':>9}{'MB':>8}{'PSNR dB':>9}")
    for name, encoder in SWEEP.items():
        if not mp4.is_usable(encoder):
            print(f"{name:<32}{'unusable here':>26}")
            continue
        times, data = [], b""
        for _ in range(3):
            start = time.perf_counter()
            data = mp4.encode_mp4(frames, fps, encoder)
            times.append(time.perf_counter() - start)
        print(f"{name:<32}{statistics.median(times):>9.3f}{len(data) / 1e6:>8.2f}"
              f"{_psnr(frames, data):>9.2f}", flush=True)


async def _measure(pipe: Any, params: ResolvedParams, sync: Callable[[], None], repeats: int,
                   num_jobs: int) -> None:
    engine = InMemoryEngine(pipe, sync)
    engine.load()
    _sweep(engine.generate(params, lambda s, n: None), params.fps)  # also the warm-up
    _diffusers(pipe, params, sync)
    shape = f"{params.width}x{params.height}x{params.num_frames}"
    picked = mp4.pick_encoder()
    encoders = {f"tandem {picked.codec}": picked}
    if picked != mp4.X264:
        encoders[f"tandem {mp4.X264.codec}"] = mp4.X264
    media = tempfile.TemporaryDirectory()
    runners = {}
    for path, encoder in encoders.items():
        runner = VideoRunner(engine, MediaStore(media.name, 2**31),
                             RunnerConfig("wan", VideoLimits(), encoder=encoder))
        await runner.start()
        await _tandem(runner, [as_request(params)])  # warm-up (the encoder's first open)
        runners[path] = runner
    latency: dict[str, list[tuple[float, float]]] = {"diffusers": [], **{p: [] for p in runners}}
    for _ in range(repeats):  # alternate: drift on a shared machine hits every path
        latency["diffusers"].append(_diffusers(pipe, params, sync))
        for path, runner in runners.items():
            seconds = await _tandem(runner, [as_request(params)])
            latency[path].append((seconds, _denoise_rate(engine.marks)))
        print("latency runs:", {p: round(r[-1][0], 3) for p, r in latency.items()}, flush=True)
    requests = [dataclasses.replace(as_request(params), seed=params.seed + i)
                for i in range(num_jobs)]
    throughput = {"diffusers": sum(_diffusers(pipe, params, sync)[0]
                                   for _ in range(num_jobs)) / num_jobs}
    for path, runner in runners.items():
        throughput[path] = await _tandem(runner, requests) / num_jobs
        await runner.close()
    print("throughput s/video:", {p: round(t, 3) for p, t in throughput.items()}, flush=True)
    base = statistics.median(r[0] for r in latency["diffusers"])
    print(f"\n{'shape WxHxF':<14}{'path':<22}{'latency s':>10}{'x diff.':>8}"
          f"{'steps/s denoise':>16}{f'{num_jobs} queued: s/video':>20}{'x diff.':>8}")
    for path, runs in latency.items():
        seconds = statistics.median(r[0] for r in runs)
        denoise = statistics.median(r[1] for r in runs)
        print(f"{shape:<14}{path:<22}{seconds:>10.3f}{seconds / base:>8.3f}{denoise:>16.2f}"
              f"{throughput[path]:>20.3f}{throughput[path] / throughput['diffusers']:>8.3f}")
    media.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wan-1.3b", dest="wan13b", action="store_true",
                        help="Wan2.1-T2V-1.3B-shaped transformer, dummy weights, bf16 on CUDA")
    parser.add_argument("--shapes", default="",
                        help="WxHxFRAMES,... (default: 32x32x9,64x64x17,128x128x17 on CPU; "
                        "832x480x33 with --wan-1.3b)")
    parser.add_argument("--steps", type=int, default=0, help="denoising steps (10 / 20)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=3, help="jobs queued for the throughput")
    args = parser.parse_args()
    import torch

    sync: Callable[[], None] = torch.cuda.synchronize if args.wan13b else (lambda: None)
    if args.wan13b:
        pipe = build_wan_pipeline(0, transformer=WAN_1_3B, vae=WAN_VAE,
                                  text_encoder={"d_model": 4096, "d_kv": 64, "d_ff": 10240,
                                                "num_layers": 1, "num_heads": 64,
                                                "relative_attention_num_buckets": 32})
        pipe.transformer.to(torch.bfloat16)
        pipe.text_encoder.to(torch.bfloat16)
        pipe.to("cuda")
        shapes, steps = args.shapes or "832x480x33", args.steps or 20
    else:
        pipe = build_wan_pipeline(0)
        shapes, steps = args.shapes or "32x32x9,64x64x17,128x128x17", args.steps or 10
    pipe.set_progress_bar_config(disable=True)
    device = torch.cuda.get_device_name() if args.wan13b else "cpu"
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"steps={steps} repeats={args.repeats} (median) jobs={args.jobs}", flush=True)
    for shape in shapes.split(","):
        width, height, frames = (int(x) for x in shape.split("x"))
        params = ResolvedParams(PROMPT, "", width, height, frames, 16, steps, 5.0, 0)
        asyncio.run(_measure(pipe, params, sync, args.repeats, args.jobs))


if __name__ == "__main__":
    main()
