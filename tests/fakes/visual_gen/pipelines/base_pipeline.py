"""visual_gen/pipelines/base_pipeline.py (upstream commit 85e1104f): `ditBasePipeline`.

`from_pretrained(path, *args, **kwargs)` loads with diffusers' DiffusionPipeline.from_pretrained
(which ignores the dit_configs sections passed along with a warning), swaps the instance's class
to the visual_gen class, runs `_after_load(path, **kwargs)`, then FSDP (sizes are 1 here: a
no-op) and `torch_compile`. `enable_async_cpu_offload(model_wise, block_wise,
offloading_stride)` refuses a model in both lists and block-wise offload of anything but the
transformer; upstream then moves weights between CPU and GPU, the fake records the plan (fake
attribute `offload_plan`) and leaves the modules where they are.
"""
from __future__ import annotations

from typing import Any

from diffusers import DiffusionPipeline

from visual_gen.configs.pipeline import PipelineConfig


class ditBasePipeline(DiffusionPipeline):  # noqa: N801 - upstream's name
    offload_plan: dict[str, Any] | None = None
    #: Models torch.compile was asked for (fake-only record).
    compiled: list[str] = []

    def _after_load(self, pretrained_model_name_or_path: str, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("Subclass should implement this method")

    def torch_compile(self) -> None:
        if not PipelineConfig.enable_torch_compile:
            return
        names = PipelineConfig.torch_compile_models
        names = names.split(",") if isinstance(names, str) else list(names)
        for name in names:
            if getattr(self, name, None) is None:
                raise ValueError(f"Model {name} is not found in the pipeline")
        # Upstream compiles a diffusers (non-dit) transformer without keeping the result; the
        # dit transformer it would load instead has its blocks compiled. Recorded, not run.
        self.compiled = names

    def enable_async_cpu_offload(self, model_wise: list[str] | None = None,
                                 block_wise: list[str] | None = None,
                                 offloading_stride: int = 1) -> None:
        model_wise, block_wise = model_wise or [], block_wise or []
        if set(model_wise) & set(block_wise):
            raise ValueError(f"model_wise and block_wise cannot have the same model, got "
                             f"{model_wise} and {block_wise}")
        for name in block_wise:
            if not name.startswith("transformer"):
                raise ValueError(f"Currently, only support block-wise offloading for "
                                 f"transformer, got {name}")
        supported = ["text_encoder", "image_encoder", "transformer"]
        for name in model_wise:
            if name not in supported:
                raise ValueError(f"Currently, only support model-wise offloading for "
                                 f"{supported}, got {name}")
        self.offload_plan = {"model_wise": model_wise, "block_wise": block_wise,
                             "offloading_stride": offloading_stride}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any,
                        **kwargs: Any) -> Any:
        pipeline = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        pipeline.__class__ = cls
        pipeline._after_load(str(pretrained_model_name_or_path), *args, **kwargs)
        pipeline.torch_compile()
        return pipeline
