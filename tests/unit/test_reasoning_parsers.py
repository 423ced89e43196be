"""Reasoning parsers: <think> blocks (DeepSeek-R1, Qwen3) and harmony channels (gpt-oss)."""
from __future__ import annotations

import json
import random

import pytest

from tandem.frontend.parsers import (
    REASONING_PARSER_NAMES,
    ReasoningDelta,
    ReasoningParse,
    collect,
    reasoning_parser,
    tool_parser,
)
from tandem.frontend.parsers.reasoning import collect_reasoning

CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location": "San Francisco"}<|call|>')

# (parser, output text, expected reasoning_content, expected content); None content: unchanged.
CASES: list[tuple[str, str, str | None, str | None]] = [
    ("deepseek_r1", "Okay, the user asks for 2 + 2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
     "Okay, the user asks for 2 + 2.\nThat is 4.", "The answer is **4**."),
    ("deepseek_r1", "<think>\nHmm, capital of France.\n</think>\n\nParis.", "Hmm, capital of France.",
     "Paris."),
    ("deepseek_r1", "Let me think about this carefully, step by", "Let me think about this "
     "carefully, step by", ""),
    ("deepseek_r1", "</think>\n\nHello!", "", "Hello!"),
    ("deepseek_r1", "Plan.</think>Write <think> and </think> literally.", "Plan.",
     "Write <think> and </think> literally."),
    ("qwen3", "<think>\nThe user wants the capital of France.\n</think>\n\nThe capital is Paris.",
     "The user wants the capital of France.", "The capital is Paris."),
    ("qwen3", "The capital of France is Paris.", None, None),  # enable_thinking=False
    ("qwen3", "\n\n  Paris, of course.\n", None, None),
    ("qwen3", "<think>\n\n</think>\n\nParis.", "", "Paris."),
    ("qwen3", "<think>\nStill thinking about", "Still thinking about", ""),
    ("qwen3", "<thinking> is not a tag", None, None),
    ("qwen3", "Close with </think> when done.", None, None),
    ("gpt_oss", '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. '
     "Provide answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
     'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4."),
    ("gpt_oss", "<|channel|>final<|message|>Hello! How can I help?<|return|>", None,
     "Hello! How can I help?"),
    ("gpt_oss", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
     "<|channel|>commentary<|message|>Checking the forecast.<|end|>" + CALL,
     "Need the weather.", "Checking the forecast." + CALL),
    ("gpt_oss", "<|channel|>analysis<|message|>First, \n<|end|><|start|>assistant<|channel|>"
     "analysis<|message|>second.<|end|><|start|>assistant<|channel|>final<|message|> ok <|return|>",
     "First, \nsecond.", " ok "),
    ("gpt_oss", "<|channel|>analysis<|message|>Thinking about it", "Thinking about it", ""),
    ("gpt_oss", "No harmony markup here <|at all.", None, None),
]


def chunkings(text: str, seed: str) -> list[list[str]]:
    """The whole text, one character at a time, and random splits from a fixed seed."""
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(8):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def run_stream(name: str, chunks: list[str]) -> ReasoningParse:
    stream = reasoning_parser(name).stream()
    deltas = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
    return collect_reasoning(deltas, stream.found_reasoning)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{CASES.index(c)}")
def test_parse_and_stream_in_every_split(case: tuple[str, str, str | None, str | None]) -> None:
    name, text, reasoning, content = case
    expected = ReasoningParse(reasoning, text if content is None else content)
    assert reasoning_parser(name).parse(text) == expected
    for chunks in chunkings(text, text):
        assert run_stream(name, chunks) == expected, chunks


def test_tags_split_mid_tag_are_held() -> None:
    stream = reasoning_parser("qwen3").stream()
    assert not stream.feed("\n<thi")
    assert stream.feed("nk>\nStep one.") == ReasoningDelta(reasoning="Step one.")
    assert stream.feed(" Done.\n</th") == ReasoningDelta(reasoning=" Done.")
    assert stream.feed("ink>\n\nAnswer") == ReasoningDelta(content="Answer")
    assert stream.finish() == ReasoningDelta() and stream.found_reasoning


def test_plain_text_is_released_at_once_without_thinking() -> None:
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("Paris is") == ReasoningDelta(content="Paris is")
    assert stream.feed(" nice") == ReasoningDelta(content=" nice")
    assert not stream.finish() and not stream.found_reasoning


def test_gpt_oss_then_harmony_tool_parser_streams() -> None:
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
            "commentary<|message|>One moment.<|end|>" + CALL)
    for chunks in chunkings(text, "pipeline"):
        reasoning = reasoning_parser("gpt_oss").stream()
        tools = tool_parser("harmony").stream()
        events, thought = [], []
        for delta in [*(reasoning.feed(c) for c in chunks), reasoning.finish()]:
            thought.append(delta.reasoning)
            events += tools.feed(delta.content)
        result = collect(events + tools.finish())
        assert "".join(thought) == "Need the weather."
        assert result.content == "One moment."
        assert [(c.name, json.loads(c.arguments)) for c in result.calls] == \
            [("get_weather", {"location": "San Francisco"})]


def test_registry_names_and_errors() -> None:
    assert set(REASONING_PARSER_NAMES) == {"deepseek_r1", "qwen3", "gpt_oss"}
    with pytest.raises(ValueError, match="valid names: deepseek_r1, qwen3, gpt_oss"):
        reasoning_parser("r1")
    stream = reasoning_parser("deepseek_r1").stream()
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.finish()


FUZZ_PIECES = {
    "deepseek_r1": ["<think>", "</think>", "<th", "ink>", "</", "\n", " ", "a", "b c"],
    "qwen3": ["<think>", "</think>", "<th", "ink>", "</", "\n", " ", "a", "b c"],
    "gpt_oss": ["<|start|>assistant", "<|channel|>", "analysis", "final", "commentary",
                " to=functions.f", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "x", " "],
}


@pytest.mark.parametrize("name", REASONING_PARSER_NAMES)
def test_fuzz_streaming_is_split_independent(name: str) -> None:
    rng = random.Random(f"fuzz-{name}")
    for _ in range(200):
        text = "".join(rng.choice(FUZZ_PIECES[name]) for _ in range(rng.randint(1, 14)))
        whole = reasoning_parser(name).parse(text)
        for chunks in chunkings(text, text)[1:4]:
            assert run_stream(name, chunks) == whole, (text, chunks)
