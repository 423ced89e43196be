"""Triton kernels of gpt-oss's MoE layer for decode-sized batches on CUDA (half precision).

A decode step's MoE layer is bound by reading the routed experts' weights. Two launches do the
work after the router's projection:

* `_route_kernel` (one program): top-k of each token's router logits, the softmax of those k,
  and a counting sort of the (token, slot) pairs by expert: each expert's rows end at
  `ends[e]`, `order` lists the pairs expert by expert (stable: token order within an expert),
  `active` the experts that received a row, first, then -1.
* `_expert_gemm_kernel`, twice: a grouped GEMM, one program per (column tile, active expert),
  that reads its expert's weight tile once for all the rows routed to it. The first runs
  gate_up with its bias and gpt-oss's clamped SwiGLU fused in; the second down with its bias
  and the routing weight, writing each row back at its (token, slot) place, so that the sum
  over slots is one more read (kernels.add_rms_norm sums them with the residual).

With MXFP4 experts (quant.mxfp4.PackedExperts) the same kernel runs W4A16 (`MXFP4`): it reads
each expert's packed 4-bit codes and their e8m0 scales (a quarter of the bf16 bytes, plus one
byte per 32 values), decodes them in registers (each code's sign, exponent and mantissa bits
placed into a float32, times 2^126 and the scale: exact), rounds them to the model dtype and
runs tl.dot on them: no dequantized copy of a layer ever exists. Three decode variants, all
autotuned: a group of 32 inputs at a time (two K=16 dots, no tile reshaped), a whole
[BLOCK_N, BLOCK_K] tile (one dot), or tl.dot_scaled with bf16 activations (Triton's own e2m1
upcast and scale). One token (a batch-1 decode step: one row per expert) takes a fourth
that runs no dot at all (`_mxfp4_row_dot`): at one row a tl.dot pads it to 16 and pays, per
value, the float32 decode, its multiply and its conversion to bf16; the row path places each
value's bits with integer operations and multiplies once per value and once per word (on an
H200, gpt-oss-120b's expert GEMMs at one token: 26 us a launch against the tile decode's
30; both far from the bytes' ~6 us). Prefill (too many tokens for the
routing kernel) sorts its pairs with torch (`sort_by_expert`) and runs the same GEMMs over
every expert (those without rows return at once).

Everything stays on the device and every shape depends only on the token count: no host sync,
so a CUDA graph can hold it. Rounding follows moe.GptOssMoeBlock's torch path op by op (bf16
after the GEMM, after each bias add and after each step of the activation); the GEMMs
accumulate in float32 in another order than torch's grouped GEMM, so results agree to bf16
rounding, not bit for bit.
"""
from __future__ import annotations

import torch

from tandem.engines.reference import kernels

triton = kernels.triton
#: Most (pairs x experts) cells the one-program routing kernel holds (padded to powers of 2):
#: 256 tokens of gpt-oss-20b (top 4 of 32), 64 of gpt-oss-120b (top 4 of 128). Twice that
#: asks for 256 KiB of shared memory, past an H200's 227 KiB (seen at 512 tokens of 20b).
MAX_ROUTE_CELLS = 1 << 15

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _mxfp4_group_dot(acc, x_ptr, src, r_mask, w_base, s_base, cols, n_mask, group,
                         k_cols):
        """acc + x[src, inputs of `group`] @ W[those inputs, cols], W read from MXFP4: the
        group's 16 bytes of each output row (byte j holds inputs 2j, low nibble, and 2j + 1)
        and its e8m0 scale, decoded to x's dtype; the even and the odd inputs are two dots, so
        that no tile is interleaved or reshaped."""
        groups = k_cols // 32
        j = tl.arange(0, 16)
        byte = group * 16 + j  # < k_cols / 2 exactly when the group exists
        cols64 = cols.to(tl.int64)
        codes = tl.load(w_base + cols64[None, :] * (k_cols // 2) + byte[:, None],
                        mask=(byte < k_cols // 2)[:, None] & n_mask[None, :],
                        other=0).to(tl.uint32)  # [16, BLOCK_N]
        exps = tl.load(s_base + cols64 * groups + group,
                       mask=n_mask & (cols * 0 + group < groups), other=0).to(tl.uint32)
        scale = (exps << 23).to(tl.float32, bitcast=True)[None, :]  # 2^(e - 127); e = 0: 0
        # e2m1 s.ee.m -> float32 bits s at 31, ee.m at 24..22: 2^(ee - 127) * 1.m (ee > 0) or
        # the subnormal m * 2^-127; times 2^126 that is the e2m1 value in both cases.
        low = (((codes & 0x8) << 28) | ((codes & 0x7) << 22)).to(tl.float32, bitcast=True)
        high = (((codes & 0x80) << 24) | ((codes & 0x70) << 18)).to(tl.float32, bitcast=True)
        dtype = x_ptr.dtype.element_ty
        low = (low * 8.507059173023462e37 * scale).to(dtype)
        high = (high * 8.507059173023462e37 * scale).to(dtype)
        k = group * 32 + 2 * j
        x_rows = x_ptr + src.to(tl.int64)[:, None] * k_cols + k[None, :]
        x_mask = r_mask[:, None] & (k < k_cols)[None, :]
        acc += tl.dot(tl.load(x_rows, mask=x_mask, other=0.0), low)
        acc += tl.dot(tl.load(x_rows + 1, mask=x_mask, other=0.0), high)
        return acc

    @triton.jit
    def _mxfp4_tile(w_base, s_base, cols, n_mask, k0, k_cols, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """float32 [BLOCK_N, BLOCK_K]: the weights of output rows `cols`, inputs [k0, k0 +
        BLOCK_K), decoded from MXFP4 as _mxfp4_group_dot does (k0 a multiple of 32), the two
        nibbles of a byte interleaved, each group of 32 times its scale."""
        half_k = k_cols // 2
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        codes = tl.load(w_base + cols.to(tl.int64)[:, None] * half_k + kb[None, :],
                        mask=n_mask[:, None] & (kb < half_k)[None, :], other=0).to(tl.uint32)
        low = ((codes & 0x8) << 28) | ((codes & 0x7) << 22)
        high = ((codes & 0x80) << 24) | ((codes & 0x70) << 18)
        bits = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K])
        values = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126
        groups = k_cols // 32
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        exps = tl.load(s_base + cols.to(tl.int64)[:, None] * groups + kg[None, :],
                       mask=n_mask[:, None] & (kg < groups)[None, :], other=0).to(tl.uint32)
        scales = (exps << 23).to(tl.float32, bitcast=True)
        values = tl.reshape(values, [BLOCK_N, BLOCK_K // 32, 32]) * scales[:, :, None]
        return tl.reshape(values, [BLOCK_N, BLOCK_K])

    @triton.jit
    def _mxfp4_row_dot(x_row, w_base, s_base, cols, n_mask, k0, k_cols,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """float32 [BLOCK_N]: W[cols, inputs k0 .. k0 + BLOCK_K) @ x_row[those inputs] for one
        row of activations (x_row points at it), without tl.dot: the codes read as 32-bit words
        (8 values each), every value's bits placed into a float32 by integer operations alone
        (2^-126 times its e2m1 value, as in _mxfp4_group_dot, with no multiply or conversion
        per value), times x * 2^64 (so that no product is subnormal), summed over each word
        and only then times the group's scale (2^(e - 127) * 2^126 * 2^-64)."""
        words_per_row = k_cols // 8
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        kw_mask = kw < words_per_row
        words = tl.load(w_base.to(tl.pointer_type(tl.uint32))
                        + cols.to(tl.int64)[:, None] * words_per_row + kw[None, :],
                        mask=n_mask[:, None] & kw_mask[None, :], other=0)
        part = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
        for i in tl.static_range(8):  # value i of each word: input 8 * word + i
            x = tl.load(x_row + kw * 8 + i, mask=kw_mask, other=0.0).to(tl.float32)
            bits = (((words >> (4 * i)) & 0x7) << 22) | (((words >> (4 * i + 3)) & 0x1) << 31)
            part += bits.to(tl.float32, bitcast=True) * (x * 18446744073709551616.0)[None, :]
        # Each word's group scale (4 words a group: a cached re-read, no tile reshaped).
        exps = tl.load(s_base + cols.to(tl.int64)[:, None] * (k_cols // 32) + (kw // 4)[None, :],
                       mask=n_mask[:, None] & kw_mask[None, :], other=0).to(tl.uint32)
        scales = ((exps + 62) << 23).to(tl.float32, bitcast=True)  # 2^(e - 65)
        return tl.sum(part * scales, 1)

    # Token counts unspecialized, as kernels._skinny_gemm_kernel's rows: they only mask.
    @triton.jit(do_not_specialize=["num_tokens", "num_slots"])
    def _route_kernel(logits_ptr, weights_ptr, order_ptr, ends_ptr, active_ptr, num_tokens,
                      num_slots, E: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.arange(0, BLOCK_T)
        e = tl.arange(0, BLOCK_E)
        kk = tl.arange(0, BLOCK_K)
        t_mask = t < num_tokens
        e_mask = e < E
        k_mask = kk < K
        logits = tl.load(logits_ptr + t[:, None] * E + e[None, :],
                         mask=t_mask[:, None] & e_mask[None, :], other=float("-inf"))
        logits = logits.to(tl.float32)
        top_v = tl.full([BLOCK_T, BLOCK_K], float("-inf"), tl.float32)
        top_i = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
        for k in tl.static_range(K):  # the largest logit left; the lowest expert on a tie
            best = tl.max(logits, 1)
            idx = tl.min(tl.where(logits == best[:, None], e[None, :], BLOCK_E), 1)
            top_v = tl.where(kk[None, :] == k, best[:, None], top_v)
            top_i = tl.where(kk[None, :] == k, idx[:, None], top_i)
            logits = tl.where(e[None, :] == idx[:, None], float("-inf"), logits)
        # Softmax of the k logits, in float32, rounded once to the model dtype (torch.softmax).
        valid = t_mask[:, None] & k_mask[None, :]
        shifted = tl.where(valid, top_v - tl.max(top_v, 1)[:, None], float("-inf"))
        p = tl.exp(shifted)
        p = p / tl.maximum(tl.sum(p, 1), 1e-30)[:, None]
        pair = t[:, None] * K + kk[None, :]
        tl.store(weights_ptr + pair, p.to(weights_ptr.dtype.element_ty), mask=valid)
        # Counting sort of the pairs by expert, stable in (token, slot) order.
        flat_ids = tl.reshape(top_i, [BLOCK_T * BLOCK_K])
        flat_pair = tl.reshape(pair, [BLOCK_T * BLOCK_K])
        flat_valid = tl.reshape(valid, [BLOCK_T * BLOCK_K])
        one_hot = ((flat_ids[:, None] == e[None, :]) & flat_valid[:, None]).to(tl.int32)
        counts = tl.sum(one_hot, 0)
        ends = tl.cumsum(counts, 0)
        rank = tl.cumsum(one_hot, 0) - 1 + (ends - counts)[None, :]
        position = tl.sum(tl.where(one_hot != 0, rank, 0), 1)
        tl.store(order_ptr + position, flat_pair, mask=flat_valid)
        tl.store(ends_ptr + e, ends, mask=e_mask)
        # Experts with rows first (in expert order), then the rest as -1: a permutation, so
        # no two stores meet.
        has_rows = (counts > 0).to(tl.int32)
        before = tl.cumsum(has_rows, 0) - has_rows  # experts with rows before e
        num_active = tl.sum(has_rows, 0)
        slot = tl.where(has_rows != 0, before, num_active + e - before)
        tl.store(active_ptr + slot, tl.where(has_rows != 0, e, -1),
                 mask=e_mask & (slot < num_slots))

    _TILES = ((64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3),
              (32, 256, 4, 4), (128, 64, 8, 4), (64, 64, 4, 6), (128, 128, 8, 4),
              (256, 64, 8, 4), (256, 32, 8, 6))

    #: One row's tiles (ROWS): few columns, long runs of inputs, no tl.dot.
    _ROW_TILES = ((16, 512, 4, 2), (32, 256, 4, 3), (32, 512, 4, 2), (64, 256, 4, 2),
                  (16, 256, 4, 4), (64, 128, 4, 4), (32, 1024, 8, 2), (128, 256, 8, 2))

    #: The ways MXFP4 weights reach the sums: a group of 32 inputs at a time (two K=16 dots),
    #: a whole [BLOCK_N, BLOCK_K] tile (one dot), tl.dot_scaled (the compiler's own e2m1
    #: upcast and scale, bf16 activations only), or, for one row of activations (BLOCK_M 1),
    #: no dot at all (_mxfp4_row_dot). bf16 weights have one way.
    GROUP, TILE, SCALED, ROWS = 0, 1, 2, 3

    def _prune_decode(configs, nargs, **kwargs):  # type: ignore[no-untyped-def]
        """The configs whose decode variant applies: bf16 weights have one; one row of
        activations takes ROWS and only it; tl.dot_scaled takes bf16 activations only."""
        if not kwargs.get("MXFP4", nargs.get("MXFP4")):
            return [c for c in configs if c.kwargs["DECODE"] == GROUP]
        one_row = kwargs.get("BLOCK_M", nargs.get("BLOCK_M")) == 1
        configs = [c for c in configs if (c.kwargs["DECODE"] == ROWS) == one_row]
        if nargs["x_ptr"].dtype != torch.bfloat16:
            return [c for c in configs if c.kwargs["DECODE"] != SCALED]
        return configs

    # Autotuning measures every decode variant that applies.
    @triton.autotune(configs=[
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "DECODE": decode}, num_warps=w,
                      num_stages=st)
        for decode in (GROUP, TILE, SCALED) for n, k, w, st in _TILES] + [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "DECODE": ROWS}, num_warps=w,
                      num_stages=st) for n, k, w, st in _ROW_TILES],
        key=["n_cols", "k_cols", "BLOCK_M", "GATE_UP", "MXFP4"],
        prune_configs_by={"early_config_prune": _prune_decode})
    @triton.jit
    def _expert_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, order_ptr, ends_ptr,
                            active_ptr, route_w_ptr, n_cols, k_cols, top_k, alpha, limit,
                            GATE_UP: tl.constexpr, MXFP4: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            DECODE: tl.constexpr):
        pid_n = tl.program_id(0)
        expert = tl.load(active_ptr + tl.program_id(1))
        end = tl.load(ends_ptr + expert, mask=expert >= 0, other=0)
        start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
        dtype = out_ptr.dtype.element_ty
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = cols < n_cols
        kk = tl.arange(0, BLOCK_K)
        if MXFP4:  # [E, n_cols, k_cols / 2] codes, [E, n_cols, k_cols / 32] scales
            w_base = w_ptr + expert.to(tl.int64) * n_cols * (k_cols // 2)
            s_base = scale_ptr + expert.to(tl.int64) * n_cols * (k_cols // 32)
        else:
            w_base = w_ptr + expert.to(tl.int64) * k_cols * n_cols
        for m0 in range(start, end, BLOCK_M):  # no trip for an inactive program (-1)
            rows = m0 + tl.arange(0, BLOCK_M)
            r_mask = rows < end
            pair = tl.load(order_ptr + rows, mask=r_mask, other=0)
            # gate_up reads the token's hidden row; down the activation row, in sorted order.
            if GATE_UP:
                src = pair // top_k
            else:
                src = rows
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, k_cols, BLOCK_K):
                if MXFP4 and DECODE == 3:  # ROWS: one row (BLOCK_M 1)
                    tl.static_assert(BLOCK_M == 1)
                    acc += _mxfp4_row_dot(x_ptr + src.to(tl.int64) * k_cols, w_base, s_base,
                                          cols, n_mask, k0, k_cols, BLOCK_N, BLOCK_K)[None, :]
                elif MXFP4 and DECODE == 2:  # SCALED: codes [BLOCK_K / 2, BLOCK_N], k-packed
                    k = k0 + kk
                    x = tl.load(x_ptr + src.to(tl.int64)[:, None] * k_cols + k[None, :],
                                mask=r_mask[:, None] & (k < k_cols)[None, :], other=0.0)
                    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                    codes = tl.load(w_base + cols.to(tl.int64)[None, :] * (k_cols // 2)
                                    + kb[:, None],
                                    mask=(kb < k_cols // 2)[:, None] & n_mask[None, :], other=0)
                    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
                    exps = tl.load(s_base + cols.to(tl.int64)[:, None] * (k_cols // 32)
                                   + kg[None, :],
                                   mask=n_mask[:, None] & (kg < k_cols // 32)[None, :], other=0)
                    acc = tl.dot_scaled(x, None, "bf16", codes, exps, "e2m1", acc=acc)
                elif MXFP4 and DECODE == 1:  # TILE
                    k = k0 + kk
                    x = tl.load(x_ptr + src.to(tl.int64)[:, None] * k_cols + k[None, :],
                                mask=r_mask[:, None] & (k < k_cols)[None, :], other=0.0)
                    w_t = _mxfp4_tile(w_base, s_base, cols, n_mask, k0, k_cols, BLOCK_N,
                                      BLOCK_K)
                    acc += tl.dot(x, tl.trans(w_t.to(x.dtype)))
                elif MXFP4:  # GROUP: BLOCK_K / 32 groups of 32 inputs
                    for g in tl.static_range(BLOCK_K // 32):
                        acc = _mxfp4_group_dot(acc, x_ptr, src, r_mask, w_base, s_base, cols,
                                               n_mask, k0 // 32 + g, k_cols)
                else:
                    k = k0 + kk
                    k_mask = k < k_cols
                    x = tl.load(x_ptr + src.to(tl.int64)[:, None] * k_cols + k[None, :],
                                mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                    w = tl.load(w_base + k.to(tl.int64)[:, None] * n_cols + cols[None, :],
                                mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                    acc += tl.dot(x, w)
            bias = tl.load(bias_ptr + expert.to(tl.int64) * n_cols + cols, mask=n_mask,
                           other=0.0)
            y = (acc.to(dtype).to(tl.float32) + bias.to(tl.float32)[None, :]).to(dtype)
            y = y.to(tl.float32)
            if GATE_UP:
                # Interleaved columns: even ones gate, odd ones up (moe.clamped_swiglu).
                gate, up = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                scaled = (gate * alpha).to(dtype).to(tl.float32)
                sig = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
                glu = (gate * sig).to(dtype).to(tl.float32)
                act = ((up + 1.0).to(dtype).to(tl.float32) * glu).to(dtype)
                half = n_cols // 2
                out_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * half + out_cols[None, :], act,
                         mask=r_mask[:, None] & (out_cols < half)[None, :])
            else:
                route_w = tl.load(route_w_ptr + pair, mask=r_mask, other=0.0)
                y = (y * route_w.to(tl.float32)[:, None]).to(dtype)
                tl.store(out_ptr + pair.to(tl.int64)[:, None] * n_cols + cols[None, :], y,
                         mask=r_mask[:, None] & n_mask[None, :])


def serves(num_tokens: int, num_experts: int, top_k: int, device: torch.device,
           dtype: torch.dtype) -> bool:
    """Whether these kernels take `num_tokens` tokens of this device and dtype through an MoE
    layer: CUDA, half precision, Triton present, and few enough tokens for the one-program
    routing kernel."""
    return (kernels.serves(device, dtype)
            and route_cells(num_tokens, num_experts, top_k) <= MAX_ROUTE_CELLS)


def route_cells(num_tokens: int, num_experts: int, top_k: int) -> int:
    """The routing kernel's (pairs x experts) tile for `num_tokens` tokens."""
    def pow2(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()
    return max(4, pow2(num_tokens)) * pow2(top_k) * pow2(num_experts)


def route(logits: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of router logits [T, E] (the model dtype): (weights [T * K] in logits'
    dtype, (token, slot) order; order [T * K] int32, the pairs t * K + k grouped by expert;
    ends [E] int32, where each expert's group ends in `order`; active [min(E, T * K)] int32,
    the experts with rows, then -1)."""
    num_tokens, num_experts = logits.shape
    pairs = num_tokens * top_k
    device = logits.device
    weights = torch.empty(pairs, dtype=logits.dtype, device=device)
    order = torch.empty(pairs, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    active = torch.empty(min(num_experts, pairs), dtype=torch.int32, device=device)
    block_t = max(4, triton.next_power_of_2(num_tokens))
    _route_kernel[(1,)](logits, weights, order, ends, active, num_tokens, active.numel(),
                        E=num_experts, K=top_k, BLOCK_T=block_t,
                        BLOCK_E=triton.next_power_of_2(num_experts),
                        BLOCK_K=triton.next_power_of_2(top_k), num_warps=8)
    return weights, order, ends, active


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`route`'s (order, ends, active) for any number of tokens, through torch (an on-device
    sort, no host sync) from expert ids [T, K]; `active` lists every expert."""
    sorted_ids, order = torch.sort(expert_ids.reshape(-1), stable=True)
    all_ids = torch.arange(num_experts, device=expert_ids.device)
    ends = torch.searchsorted(sorted_ids, all_ids, right=True).to(torch.int32)
    return order.to(torch.int32), ends, all_ids.to(torch.int32)


def experts(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
            gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor,
            top_k: int, alpha: float, limit: float,
            scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """gpt-oss's routed experts for tokens x [T, H], router logits [T, E]: [T, K, H], each
    slot's down(clamped_swiglu(gate_up(x))) with biases, times its routing weight (sum over K
    for the layer's output). Weights in moe.BiasedExperts' layout: gate_up [E, H, 2I] with
    interleaved gate/up columns, down [E, I, H]; or, with `scales` (gate_up's, down's), the
    MXFP4 blocks and scales of quant.mxfp4.PackedExperts."""
    weights, order, ends, active = route(logits.contiguous(), top_k)
    return sorted_experts(x, weights, order, ends, active, gate_up, gate_up_bias, down,
                          down_bias, top_k, alpha, limit, scales)


def sorted_experts(x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                   ends: torch.Tensor, active: torch.Tensor, gate_up: torch.Tensor,
                   gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor,
                   top_k: int, alpha: float, limit: float,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`experts` past the routing: weights [T * K] and (order, ends, active) as `route` or
    `sort_by_expert` give them."""
    num_tokens, hidden = x.shape
    x = x.contiguous()
    pairs = num_tokens * top_k
    num_experts = gate_up.shape[0]
    is_mxfp4 = scales is not None
    # Packed: [E, rows, cols / 32, 16] -> [E, rows, cols / 2] (a view, as the file holds it)
    width = gate_up.shape[1] if is_mxfp4 else gate_up.shape[2]
    gate_up_w = gate_up.flatten(2) if is_mxfp4 else gate_up
    down_w = down.flatten(2) if is_mxfp4 else down
    gate_up_s, down_s = scales if scales is not None else (gate_up, down)  # unread unless MXFP4
    # Rows per program: the average expert gets one tile of rows; one token's MXFP4 experts
    # one row each, summed without tl.dot (the ROWS decode).
    block_m = min(64, max(16, triton.next_power_of_2(-(-pairs // num_experts))))
    if is_mxfp4 and num_tokens == 1:
        block_m = 1
    act = torch.empty(pairs, width // 2, dtype=x.dtype, device=x.device)
    out = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    for source, weight, scale, bias, dest, n_cols, k_cols, is_gate_up in (
            (x, gate_up_w, gate_up_s, gate_up_bias, act, width, hidden, True),
            (act, down_w, down_s, down_bias, out, hidden, width // 2, False)):
        _expert_gemm_kernel[lambda meta, n=n_cols: (triton.cdiv(n, meta["BLOCK_N"]),
                                                     active.numel())](
            source, weight, scale, bias, dest, order, ends, active, weights, n_cols, k_cols,
            top_k, alpha, limit, GATE_UP=is_gate_up, MXFP4=is_mxfp4, BLOCK_M=block_m)
    return out
