"""The video engines on the tiny random-weight Wan (tandem.model.tiny_wan), CPU, float32.

Reference: the worker's uint8 frames (converted on the pipeline's device) equal diffusers' own
`WanPipeline.__call__` float frames rounded to uint8 on the host, for the same seed, bit for bit
(same library, same weights, same CPU noise generator, same thread count in one process:
nothing may differ). trtllm: the visual_gen adapter against the fake built from
visual_gen's source (tests/fakes/visual_gen): the configs Dynamo's worker passes, upstream's
refusals, and frames equal to diffusers' too (the fake runs WanPipeline's modules)."""
from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from tandem.errors import InvalidRequest
from tandem.model.tiny_wan import write_tiny_wan
from tandem.video.config import VideoEngineArgs
from tandem.video.engine import create_video_engine
from tandem.video.mp4 import to_uint8
from tandem.video.params import PipelineSpec, ResolvedParams
from tests.unit.fake_packages import faked

PARAMS = ResolvedParams("a red fox running in the snow", "blurry", width=48, height=32,
                        num_frames=9, fps=16, num_inference_steps=3, guidance_scale=5.0,
                        seed=1234)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # visual_gen looks up TeaCache coefficients by the size named in the path.
    return write_tiny_wan(tmp_path_factory.mktemp("wan") / "Wan2.1-T2V-1.3B-tiny", seed=0)


@pytest.fixture(scope="module")
def diffusers_frames(wan_dir: pathlib.Path) -> np.ndarray:
    import torch
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan_dir)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=PARAMS.prompt, negative_prompt=PARAMS.negative_prompt,
               height=PARAMS.height, width=PARAMS.width, num_frames=PARAMS.num_frames,
               num_inference_steps=PARAMS.num_inference_steps,
               guidance_scale=PARAMS.guidance_scale,
               generator=torch.Generator().manual_seed(PARAMS.seed), output_type="np")
    return to_uint8(out.frames[0])


@pytest.fixture
def fake_visual_gen() -> Iterator[None]:
    with faked("visual_gen"):
        yield


def _run(engine_name: str, model: pathlib.Path, **args: object) -> tuple[np.ndarray, list[int]]:
    engine = create_video_engine(engine_name, VideoEngineArgs(model=str(model), **args))
    engine.load()
    steps: list[int] = []
    frames = engine.generate(PARAMS, lambda step, n: steps.append(step))
    assert engine.spec == PipelineSpec(size_multiple=16, temporal_factor=4)
    return frames, steps


def test_reference_frames_equal_diffusers(wan_dir: pathlib.Path,
                                          diffusers_frames: np.ndarray) -> None:
    frames, steps = _run("reference", wan_dir)
    assert frames.shape == (9, 32, 48, 3) and frames.dtype == np.uint8
    assert np.array_equal(frames, diffusers_frames)
    assert steps == [1, 2, 3]
    assert float(frames.std()) > 2  # not a blank video that any seed would match


def test_another_seed_gives_other_frames(wan_dir: pathlib.Path,
                                         diffusers_frames: np.ndarray) -> None:
    from dataclasses import replace

    engine = create_video_engine("reference", VideoEngineArgs(model=str(wan_dir)))
    engine.load()
    other = engine.generate(replace(PARAMS, seed=PARAMS.seed + 1), lambda s, n: None)
    assert not np.array_equal(other, diffusers_frames)


def test_step_hook_stops_the_loop(wan_dir: pathlib.Path) -> None:
    engine = create_video_engine("reference", VideoEngineArgs(model=str(wan_dir)))
    engine.load()
    steps: list[int] = []

    class Stop(Exception):
        pass

    def hook(step: int, n: int) -> None:
        steps.append(step)
        if step == 1:
            raise Stop
    with pytest.raises(Stop):
        engine.generate(PARAMS, hook)
    assert steps == [1]


def test_not_a_pipeline_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidRequest, match="not a diffusers pipeline") as info:
        create_video_engine("reference", VideoEngineArgs(model=str(tmp_path)))
    assert info.value.param == "model"


@pytest.mark.usefixtures("fake_visual_gen")
def test_trtllm_engine_on_the_fake(wan_dir: pathlib.Path, diffusers_frames: np.ndarray) -> None:
    frames, steps = _run("trtllm", wan_dir, attn_type="sage-attn",
                         linear_type="trtllm-fp8-blockwise", enable_async_cpu_offload=True)
    from visual_gen.configs.op_manager import AttentionOpManager, LinearOpManager
    from visual_gen.configs.pipeline import PipelineConfig
    from visual_gen.utils.setup_configs import last_configs

    assert (AttentionOpManager.attn_type, LinearOpManager.linear_type) == (
        "sage-attn", "trtllm-fp8-blockwise")
    assert PipelineConfig.transformer_type == "ditWanTransformer3DModel"
    # Wan 2.1 has no transformer_2: only the one transformer is named for torch.compile.
    assert last_configs["pipeline"]["torch_compile_models"] == "transformer"
    assert last_configs["linear"] == {"type": "trtllm-fp8-blockwise", "recipe": "dynamic"}
    assert np.array_equal(frames, diffusers_frames) and steps == [1, 2, 3]


@pytest.mark.usefixtures("fake_visual_gen")
def test_trtllm_engine_compiles_when_asked(wan_dir: pathlib.Path) -> None:
    engine = create_video_engine("trtllm", VideoEngineArgs(model=str(wan_dir),
                                                           enable_torch_compile=True))
    engine.load()
    assert engine._pipe.compiled == ["transformer"]  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fake_visual_gen")
def test_trtllm_refuses_a_path_without_the_model_size(wan_dir: pathlib.Path,
                                                      tmp_path: pathlib.Path) -> None:
    unnamed = shutil.copytree(wan_dir, tmp_path / "tiny-wan")
    engine = create_video_engine("trtllm", VideoEngineArgs(model=str(unnamed)))
    with pytest.raises(InvalidRequest, match="not supported for TeaCache") as info:
        engine.load()
    assert info.value.param == "model"


def test_trtllm_without_visual_gen_says_how_to_install(wan_dir: pathlib.Path) -> None:
    from tandem.errors import Unavailable

    engine = create_video_engine("trtllm", VideoEngineArgs(model=str(wan_dir)))
    with pytest.raises(Unavailable, match="visual_gen"):
        engine.load()


def test_unknown_kernel_names_are_flag_errors() -> None:
    with pytest.raises(InvalidRequest) as info:
        VideoEngineArgs(attn_type="flash")
    assert info.value.param == "attn_type"
