"""The TensorRT-LLM backend: TensorRT-LLM's LLM API (PyTorch backend) behind Tandem's Engine
interface, the way Dynamo's TensorRT-LLM worker drives it.

Nothing here imports `tensorrt_llm` at module import time: `create_trtllm_engine` does, so that
machines without TensorRT-LLM can import Tandem. The backend is verified against a fake of the
TensorRT-LLM API built from its source (tests/fakes/tensorrt_llm), not run in Tandem's CI.
"""
