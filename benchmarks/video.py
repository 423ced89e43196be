"""Video generation: seconds per video and denoising steps/s, Tandem's reference video engine
(the worker's path: diffusers pipeline + per-step hook + H.264 MP4 encoding) next to diffusers'
own `WanPipeline.__call__` on the same pipeline object, same seeds, alternating, in one run.

  python benchmarks/video.py                 # tiny random-weight Wan, CPU
  python benchmarks/video.py --wan-1.3b      # Wan2.1-T2V-1.3B-shaped transformer and Wan's VAE,
                                             # dummy weights, bf16 on CUDA (480x832 by default)

steps/s (denoise) counts only the denoising loop (first step's end to last step's end, over
steps - 1); s/video is everything (text encoding, denoising, VAE decode, and for Tandem the MP4).
The 1.3B shape keeps Wan's transformer exactly; its text encoder is a one-layer UMT5 of Wan's
width (4096) rather than UMT5-XXL (the prompt is encoded once per video, off the step loop).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from tandem.model.tiny_wan import WAN_1_3B, WAN_VAE, build_wan_pipeline
from tandem.video import mp4, pipelines
from tandem.video.params import ResolvedParams

PROMPT = "a red fox running through fresh snow at dawn, cinematic"


def _diffusers(pipe: Any, p: ResolvedParams, on_step: Callable[[], None]) -> Any:
    import torch

    def step_end(_pipe: Any, _i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        on_step()
        return tensors
    return pipe(prompt=p.prompt, negative_prompt=p.negative_prompt or None, height=p.height,
                width=p.width, num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                guidance_scale=p.guidance_scale, output_type="np",
                generator=torch.Generator().manual_seed(p.seed),
                callback_on_step_end=step_end).frames[0]


def _tandem(pipe: Any, p: ResolvedParams, on_step: Callable[[], None]) -> Any:
    frames = pipelines.run(pipe, p, lambda step, n: on_step())
    return mp4.encode_mp4(frames, p.fps)


def _timed(run: Callable[..., Any], pipe: Any, p: ResolvedParams, sync: Callable[[], None]
           ) -> tuple[float, float]:
    marks: list[float] = []

    def on_step() -> None:
        sync()
        marks.append(time.perf_counter())
    start = time.perf_counter()
    run(pipe, p, on_step)
    sync()
    total = time.perf_counter() - start
    denoise = (len(marks) - 1) / (marks[-1] - marks[0]) if len(marks) > 1 else float("nan")
    return total, denoise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wan-1.3b", dest="wan13b", action="store_true",
                        help="Wan2.1-T2V-1.3B-shaped transformer, dummy weights, bf16 on CUDA")
    parser.add_argument("--shapes", default="",
                        help="WxHxFRAMES,... (default: 32x32x9,64x64x17,128x128x17 on CPU; "
                        "832x480x33 with --wan-1.3b)")
    parser.add_argument("--steps", type=int, default=0, help="denoising steps (10 / 20)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    if args.wan13b:
        pipe = build_wan_pipeline(0, transformer=WAN_1_3B, vae=WAN_VAE,
                                  text_encoder={"d_model": 4096, "d_kv": 64, "d_ff": 10240,
                                                "num_layers": 1, "num_heads": 64,
                                                "relative_attention_num_buckets": 32})
        pipe.transformer.to(torch.bfloat16)
        pipe.text_encoder.to(torch.bfloat16)
        pipe.to("cuda")
        shapes, steps, sync = args.shapes or "832x480x33", args.steps or 20, torch.cuda.synchronize
    else:
        pipe = build_wan_pipeline(0)
        shapes, steps, sync = args.shapes or "32x32x9,64x64x17,128x128x17", args.steps or 10, (
            lambda: None)
    pipe.set_progress_bar_config(disable=True)
    device = "cuda" if args.wan13b else "cpu"
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"steps={steps} repeats={args.repeats} (median)")
    print(f"{'shape WxHxF':<14}{'path':<10}{'s/video':>10}{'steps/s (denoise)':>20}"
          f"{'steps/s (whole)':>18}")
    for shape in shapes.split(","):
        width, height, frames = (int(x) for x in shape.split("x"))
        params = ResolvedParams(PROMPT, "", width, height, frames, 16, steps, 5.0, 0)
        _timed(_tandem, pipe, params, sync)  # warm-up (allocator, kernels, tokenizer)
        results: dict[str, list[tuple[float, float]]] = {"diffusers": [], "tandem": []}
        for _ in range(args.repeats):  # alternate: drift on a shared machine hits both
            results["diffusers"].append(_timed(_diffusers, pipe, params, sync))
            results["tandem"].append(_timed(_tandem, pipe, params, sync))
        for path, runs in results.items():
            total = statistics.median(r[0] for r in runs)
            denoise = statistics.median(r[1] for r in runs)
            print(f"{shape:<14}{path:<10}{total:>10.3f}{denoise:>20.1f}{steps / total:>18.1f}")


if __name__ == "__main__":
    main()
