"""Quantized checkpoints in the reference engine: which format a checkpoint is in (`scheme`),
FP8 linear layers and their kernels (`fp8`, `fp8_kernels`), the reading of quantized tensors
into a model (`reader`) and MXFP4 experts (`mxfp4`)."""
