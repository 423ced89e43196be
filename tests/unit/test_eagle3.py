"""EAGLE-3 speculative decoding in the reference engine: heads written with the published layout
(config.json + midlayer.* safetensors + d2t), the same tokens and logprobs as without
speculation with the rollback invariants after every step, the head's forward against explicit
float32 operations, the target's hidden states against transformers', a head built to guess
right really accepted, and checkpoints that do not fit refused by name."""
from __future__ import annotations

import asyncio
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.engines.reference.attention import Attention
from tandem.engines.reference.batch import allocate_kv_cache
from tandem.engines.reference.spec import ModelSpec
from tandem.engines.speculative.draft_kv import draft_batch
from tandem.engines.speculative.eagle3_head import aux_layers, load_eagle3_head
from tandem.engines.types import SamplingParams
from tandem.errors import InvalidRequest
from tandem.model.tiny import write_tiny_model
from tandem.model.tiny_eagle3 import eagle3_config, eagle3_tensors, write_eagle3
from tests.unit.test_speculative_engine import (
    compare,
    copy_prompts,
    engine_for,
    generate,
    guided_case,
    guided_tokenizer,
    logprobs,
    tokens,
)

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5)


@pytest.fixture(scope="module")
def head(tiny: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A random head with a draft vocabulary of 1,000 of the target's 4,096 tokens (d2t)."""
    config = eagle3_config(_config(tiny), draft_vocab_size=1000)
    return write_eagle3(tmp_path_factory.mktemp("head"), config, eagle3_tensors(config, 3))


def spec_config(head_dir: pathlib.Path, k: int = 3, limit: int = 0) -> str:
    return json.dumps({"method": "eagle3", "num_speculative_tokens": k, "model": str(head_dir),
                       "disable_by_batch_size": limit})


def _config(path: pathlib.Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config


def test_greedy_equal_with_logprobs_preemption_and_prefix_hits(tiny: pathlib.Path,
                                                               head: pathlib.Path) -> None:
    batch = copy_prompts(256, 5, seed=11)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, top_logprobs=2)
    plain, spec, engine = compare(tiny, batch, greedy, spec_config(head))
    for p, s in zip(plain, spec, strict=True):
        assert logprobs(s) == pytest.approx(logprobs(p), abs=1e-4)
    assert engine.stats().spec_proposed_tokens > 0
    assert engine.overlap is None  # a launched step would overwrite the states
    # Preemption (blocks replaced: the head's KV is rebuilt) and prefix hits (positions the
    # request never computed), seeded sampling, and a batch-size policy that turns it down.
    shared = copy_prompts(256, 1, seed=3)[0]
    batch = [shared + p for p in copy_prompts(256, 8, seed=4)]
    _, _, engine = compare(tiny, batch, SamplingParams(max_tokens=20, temperature=0.0,
                                                       ignore_eos=True),
                           spec_config(head, k=4), num_gpu_blocks=40)
    assert engine.scheduler.num_preemptions > 0 and engine.pool.prefix_hit_rate > 0
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    compare(tiny, batch[:4], seeded, spec_config(head, limit=2))


def test_guided_requests_equal_with_guesses_the_grammar_cuts(tiny: pathlib.Path,
                                                             head: pathlib.Path) -> None:
    """A random head's guesses are mostly cut by the grammar, to none at all: the blocks taken
    for them go back (the invariants), and the JSON is the same as without speculation."""
    _, spec, _ = compare(tiny, *guided_case(tiny), spec=spec_config(head))
    for chunks in spec:
        json.loads(guided_tokenizer(tiny).decode(tokens(chunks), skip_special_tokens=True))


def test_target_hidden_states_are_transformers_at_every_position(tiny: pathlib.Path,
                                                                 head: pathlib.Path) -> None:
    """What the proposer is handed for each computed position: the residual stream entering
    layers 0 and 1 and leaving layer 1 (its config's ids [0, 1, 2]), as transformers computes
    them for the request's final tokens (rows of rejected proposals aside)."""
    import transformers

    engine = engine_for(tiny, spec_config(head))
    assert engine.speculation is not None
    proposer = engine.speculation.proposer
    seen: dict[str, dict[int, tuple[torch.Tensor, int]]] = {}
    observe = proposer.observe

    def recording(spans: Any, states: torch.Tensor, keep_all: bool) -> None:
        for req, row, start, count in spans:
            for i in range(count):
                seen.setdefault(req.request_id, {})[start + i] = (
                    states[row + i].clone(), req.token_ids[start + i])
        observe(spans, states, keep_all)

    proposer.observe = recording  # type: ignore[method-assign]
    batch = copy_prompts(256, 3, seed=12)
    out = asyncio.run(generate(engine, batch, SamplingParams(max_tokens=12, temperature=0.0,
                                                             ignore_eos=True)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for i, (prompt, chunks) in enumerate(zip(batch, out, strict=True)):
        full = list(prompt) + tokens(chunks)
        with torch.no_grad():
            run = hf.model(torch.tensor([full]), output_hidden_states=True)
        stream_0, stream_1 = run.hidden_states[0][0], run.hidden_states[1][0]
        last = _prenorm_last(hf, stream_1, full)
        checked = 0
        for position, (states, token) in seen[f"r{i}"].items():
            if position >= len(full) - 1 or token != full[position]:
                continue  # the last token, or a rejected proposal's row
            want = torch.cat([stream_0[position], stream_1[position], last[position]])
            torch.testing.assert_close(states, want, atol=1e-4, rtol=1e-4)
            checked += 1
        assert checked >= len(full) - 2


def _prenorm_last(hf: Any, stream_1: torch.Tensor, full: list[int]) -> torch.Tensor:
    """The residual stream leaving the last layer (before the final norm) of a 2-layer
    transformers Llama, by a hook on that layer."""
    out: list[torch.Tensor] = []
    hook = hf.model.layers[-1].register_forward_hook(
        lambda _m, _i, o: out.append((o[0] if isinstance(o, tuple) else o)[0]))
    try:
        with torch.no_grad():
            hf.model(torch.tensor([full]))
    finally:
        hook.remove()
    return out[0]


def test_head_forward_matches_explicit_float32(tiny: pathlib.Path,
                                               tmp_path: pathlib.Path) -> None:
    """The head through the engine's paged cache against its architecture written out in
    plain torch: norms on the right inputs, [embedding | hidden] in that order, attention,
    residuals, MLP, final norm, lm_head, d2t; its own embedding; norm_before_residual off."""
    target = ModelSpec.from_dir(tiny)
    config = eagle3_config(_config(tiny), draft_vocab_size=500)
    w = eagle3_tensors(config, 21, embed=True)
    head = load_eagle3_head(str(write_eagle3(tmp_path / "h", config, w)), target,
                            torch.zeros(1), torch.float32, torch.device("cpu"))
    n, hidden = 7, config["hidden_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (n,), generator=g)
    aux = torch.randn(n, 3 * hidden, generator=g)
    kv = allocate_kv_cache(1, 8, BS, 2, 16, torch.float32, torch.device("cpu"))
    batch = draft_batch([(ids.tolist(), 0)], [[3, 5]], BS, torch.device("cpu"))
    with torch.inference_mode():
        out = head(batch.input_ids, batch.positions, head.combine(aux), batch.meta, kv)
        got = head.next_tokens(out)
    want_out, want_tokens = _explicit_forward(w, config, ids, aux)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    assert got.tolist() == want_tokens.tolist()


def _explicit_forward(w: dict[str, torch.Tensor], config: dict[str, Any], ids: torch.Tensor,
                      aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    eps, n = config["rms_norm_eps"], ids.shape[0]
    heads, kv_heads, d = (config["num_attention_heads"], config["num_key_value_heads"],
                          config["head_dim"])

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x: torch.Tensor) -> torch.Tensor:  # x [n, h, d], rotate_half convention
        inv = 1.0 / config["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        angles = torch.arange(n).float()[:, None] * inv[None, :]
        cos = torch.cat([angles.cos()] * 2, -1)[:, None, :]
        sin = torch.cat([angles.sin()] * 2, -1)[:, None, :]
        rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    m = "midlayer."
    h = aux @ w["fc.weight"].T
    e = w["embed_tokens.weight"][ids]
    x = torch.cat([rms(e, w[m + "input_layernorm.weight"]),
                   rms(h, w[m + "hidden_norm.weight"])], -1)
    q = rope((x @ w[m + "self_attn.q_proj.weight"].T).view(n, heads, d))
    k = rope((x @ w[m + "self_attn.k_proj.weight"].T).view(n, kv_heads, d))
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    residual = attn @ w[m + "self_attn.o_proj.weight"].T + h
    y = rms(residual, w[m + "post_attention_layernorm.weight"])
    mlp = (F.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)
           ) @ w[m + "mlp.down_proj.weight"].T
    out = mlp + residual
    draft = (rms(out, w["norm.weight"]) @ w["lm_head.weight"].T).argmax(-1)
    return out, draft + w["d2t"][draft]


def test_a_head_built_to_guess_right_is_accepted(tmp_path: pathlib.Path) -> None:
    """A target whose layers add nothing (o_proj and down_proj zero: the next token is a
    function of the last one) and a head built to compute that function: its attention reads
    only the current position (constant q and k, aligned after RoPE at distance 0 alone), whose
    value is the normed embedding of the token it is fed minus its normed input hidden state
    (which cancels the residual), and its norm and lm_head are the target's. Every guess is
    then the target's token: the chain, its positions and fed-back states, the KV writes and
    the token shift are right, or acceptance falls."""
    target = write_tiny_model(tmp_path / "bigram", "llama", seed=8, tie_word_embeddings=False)
    weights = load_file(str(target / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = eagle3_config(_config(target), num_key_value_heads=4, attention_bias=True)
    w = eagle3_tensors(config, 4)
    hidden, m = config["hidden_size"], "midlayer."
    u = torch.zeros(16)
    u[[0, 1, 2, 3, 8, 9, 10, 11]] = 20.0  # RoPE's four fastest frequencies
    eye = torch.eye(hidden)
    w.update({
        "fc.weight": torch.zeros_like(w["fc.weight"]),
        m + "input_layernorm.weight": torch.ones(hidden),
        m + "hidden_norm.weight": torch.ones(hidden),
        m + "self_attn.q_proj.weight": torch.zeros(hidden, 2 * hidden),
        m + "self_attn.k_proj.weight": torch.zeros(hidden, 2 * hidden),
        m + "self_attn.q_proj.bias": u.repeat(4),
        m + "self_attn.k_proj.bias": u.repeat(4),
        m + "self_attn.v_proj.weight": torch.cat([eye, -eye], 1),
        m + "self_attn.v_proj.bias": torch.zeros(hidden),
        m + "self_attn.o_proj.weight": eye,
        m + "self_attn.o_proj.bias": torch.zeros(hidden),
        m + "mlp.down_proj.weight": torch.zeros_like(w[m + "mlp.down_proj.weight"]),
        "norm.weight": weights["model.norm.weight"],
        "lm_head.weight": weights["lm_head.weight"],
    })
    head_dir = write_eagle3(tmp_path / "head", config, w)
    batch = copy_prompts(256, 3, seed=13)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    _, spec, engine = compare(target, batch, greedy, spec_config(head_dir))
    assert all(len(set(tokens(c))) > 4 for c in spec)  # not one token over and over
    assert engine.speculation is not None
    counters = engine.speculation.counters
    assert counters.accepted_tokens >= 0.9 * counters.proposed_tokens > 0
    assert counters.mean_accepted_length > 3.0


def test_aux_layer_conventions() -> None:
    assert aux_layers({}, 32) == (2, 16, 29)  # EAGLE-3's default, vLLM's convention
    assert aux_layers({"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}, 10) == (1, 5, 9)
    # NVIDIA ModelOpt numbers layer outputs: one more in vLLM's convention.
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert aux_layers(nested, 32) == (2, 16, 29)
    with pytest.raises(InvalidRequest, match="too few"):
        aux_layers({}, 4)
    with pytest.raises(InvalidRequest, match=r"\[11\] are outside"):
        aux_layers({"eagle_aux_hidden_state_layer_ids": [1, 5, 11]}, 10)


def _broken(name: str) -> Callable[[dict[str, Any], dict[str, torch.Tensor]], None]:
    def drop(config: dict[str, Any], w: dict[str, torch.Tensor]) -> None:
        del w[name]
    return drop


@pytest.mark.parametrize("breaks, message", [
    (_broken("midlayer.hidden_norm.weight"), r"missing midlayer\.hidden_norm\.weight"),
    (_broken("d2t"), "no d2t mapping"),
    (lambda c, w: w.update({"fc.weight": w["fc.weight"][:, :100]}),
     r"fc\.weight has shape \(64, 100\), expected \(64, 192\)"),
    (lambda c, w: w.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)}),
     r"q_proj\.weight has shape \(64, 64\), expected \(64, 128\)"),
    (lambda c, w: w.update({"midlayer.extra.weight": torch.zeros(2)}),
     r"unexpected midlayer\.extra\.weight"),
    (lambda c, w: c.update({"architectures": ["LlamaForCausalLM"]}), "not an EAGLE-3 head"),
    (lambda c, w: c.update({"vocab_size": 5000}), "vocab_size 5000 is not the target's"),
    (lambda c, w: c.update({"target_hidden_size": 96}), "hidden states of size 96"),
    (lambda c, w: c.update({"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}),
     r"\[3\] are outside the target's \[0, 2\]"),
    (lambda c, w: w.update({"d2t": w["d2t"] + 4096}), "outside the target's vocabulary"),
])
def test_heads_that_do_not_fit_refused(tiny: pathlib.Path, tmp_path: pathlib.Path,
                                       breaks: Callable[[dict[str, Any], dict[str, Any]], None],
                                       message: str) -> None:
    config = eagle3_config(_config(tiny), draft_vocab_size=1000)
    w = eagle3_tensors(config, 5)
    breaks(config, w)
    head_dir = write_eagle3(tmp_path / "bad", config, w)
    with pytest.raises(InvalidRequest, match=message) as info:
        engine_for(tiny, spec_config(head_dir))
    assert info.value.param == "speculative_config"


def test_a_head_whose_weights_live_in_layers_0_loads(tiny: pathlib.Path,
                                                     tmp_path: pathlib.Path) -> None:
    """Speculators-style names (layers.0. for midlayer.) and the head's own embedding."""
    config = eagle3_config(_config(tiny))
    w = {k.replace("midlayer.", "layers.0."): v
         for k, v in eagle3_tensors(config, 6, embed=True).items()}
    head = load_eagle3_head(str(write_eagle3(tmp_path / "h", config, w)),
                            ModelSpec.from_dir(tiny), torch.zeros(1), torch.float32,
                            torch.device("cpu"))
    assert head.embed_tokens is not None
    torch.testing.assert_close(head.midlayer.hidden_norm.weight,
                               w["layers.0.hidden_norm.weight"])
    assert isinstance(head.midlayer.self_attn, Attention)


def test_kept_states_follow_the_positions_the_target_computed() -> None:
    from tandem.engines.speculative.eagle3 import Eagle3State

    def rows(first: int, count: int) -> torch.Tensor:
        return torch.arange(first, first + count, dtype=torch.float32)[:, None]

    state = Eagle3State()
    state.add(0, rows(0, 5))  # a prompt chunk
    state.add(5, rows(5, 3))  # the next chunk
    state.add(8, rows(8, 4))  # a verify pass: positions 8..11
    state.add(10, rows(10, 1) + 100)  # 10 and 11 were rejected: 10 computed again
    assert (state.first, state.end) == (0, 11)
    assert state.take(3, 11)[:, 0].tolist() == [3, 4, 5, 6, 7, 8, 9, 110]
    assert state.pieces == []  # consumed
    state.add(11, rows(11, 2))
    state.add(4, rows(4, 1))  # recomputed from earlier (preemption): only that is kept
    assert (state.first, state.end) == (4, 5)
    state.add(9, rows(9, 1))  # a gap (positions computed without states): starts again
    assert (state.first, state.end) == (9, 10)


def test_a_head_of_another_width_needs_its_own_embedding(tiny: pathlib.Path,
                                                         tmp_path: pathlib.Path) -> None:
    config = eagle3_config(_config(tiny), hidden_size=96, target_hidden_size=64)
    w = eagle3_tensors(config, 7, target_hidden=64)
    with pytest.raises(InvalidRequest, match="no embed_tokens.weight and its hidden size 96"):
        engine_for(tiny, spec_config(write_eagle3(tmp_path / "narrow", config, w)))
    w = eagle3_tensors(config, 7, target_hidden=64, embed=True)
    head_dir = write_eagle3(tmp_path / "own", config, w)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    compare(tiny, copy_prompts(256, 2, seed=14), greedy, spec_config(head_dir))
