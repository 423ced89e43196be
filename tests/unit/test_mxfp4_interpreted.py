"""gpt-oss's W4A16 MXFP4 expert GEMMs (moe_kernels with quant.mxfp4.PackedExperts), run by
Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a subprocess, as
test_reference_triton_interpreted.py does; skipped where Triton is not installed, as in CI):
decode batches through the routing kernel and prefill batches through torch's sort, against
the same block with its experts dequantized (float32, where the kernel's only difference is
the order of its sums). test_mxfp4_cuda.py checks the compiled kernel in bfloat16."""
from __future__ import annotations

import pytest

from tests.unit.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = r'''
import copy

from tandem.engines.reference import moe_kernels
from tandem.engines.reference.moe import GptOssMoeBlock, pack_experts
from tandem.engines.reference.quant import mxfp4


tuner = moe_kernels._expert_gemm_kernel
torch.manual_seed(0)
experts, top_k, hidden, inter = 8, 2, 96, 64
dense = GptOssMoeBlock(hidden, inter, experts, top_k, 1.702, 7.0)
with torch.no_grad():
    for param in dense.parameters():
        param.copy_(0.3 * torch.randn(param.shape))
packed = copy.deepcopy(dense)
pack_experts(packed)
e, p = dense.experts, packed.experts
with torch.no_grad():
    for name in ("gate_up_proj", "down_proj"):
        blocks, scales = mxfp4.quantize(getattr(e, name).transpose(1, 2))
        getattr(p, name + "_blocks").copy_(blocks)
        getattr(p, name + "_scales").copy_(scales)
        getattr(p, name + "_bias").copy_(getattr(e, name + "_bias"))
    gate_up, down = p.dequantized()
    e.gate_up_proj.copy_(gate_up)
    e.down_proj.copy_(down)
    assert (p.gate_up_proj_scales.float().std() > 0), "scales must vary for the test to bite"


with torch.no_grad():
    for index in (0, len(tuner.configs) // 2):  # the first group-decoding and tile-decoding
        moe_kernels._expert_gemm_kernel = Tile(tuner, index)
        assert tuner.configs[index].kwargs["DECODE_TILE"] is (index > 0)
        for tokens in (1, 5, 40):
            x = torch.randn(tokens, hidden)
            ref = dense.forward_grouped(x)
            slots = moe_kernels.experts(x, packed.router(x), *packed._kernel_weights(), top_k,
                                        packed.alpha, packed.limit, packed._kernel_scales())
            assert rel(slots.sum(1), ref) < 1e-5, (tokens, rel(slots.sum(1), ref))
            assert rel(packed.forward_packed(x), ref) < 1e-5, tokens
        # A nibble swap or a scale off by one would show far above float error:
        x = torch.randn(3, hidden)
        wrong = copy.deepcopy(packed)
        wrong.experts.down_proj_scales.add_(1)
        assert rel(wrong.forward_packed(x), dense.forward_grouped(x)) > 0.1
print("ok")
'''


def test_mxfp4_expert_gemms_in_the_interpreter() -> None:
    run_interpreted(SCRIPT)
