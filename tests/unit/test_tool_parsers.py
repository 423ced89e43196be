"""Tool-call parsers: each family's documented format, whole and streamed in every split."""
from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from tandem.frontend.parsers import (
    TOOL_PARSER_NAMES,
    ContentDelta,
    StreamEvent,
    ToolCallArguments,
    ToolCallStart,
    ToolParse,
    collect,
    tool_parser,
)
from tandem.frontend.parsers._brackets import BracketError, BracketScanner, bracket_end

Calls = list[tuple[str, dict[str, Any]]]
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_BEGIN, DS_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_call(name: str, args: str) -> str:
    return f"{DS_BEGIN}function{DS_SEP}{name}\n```json\n{args}\n```{DS_END}"


PARIS = {"city": "Paris", "unit": "celsius"}
TRICKY = {"query": "café {not json} ☃ \"quoted\" [x]", "n": [1, 2.5, {"k": None}], "ok": True}
TRICKY_JSON = json.dumps(TRICKY, ensure_ascii=False)

# (parser, output text, expected content, expected calls). Outputs follow each family's
# documented format; texts with no valid call must come back unchanged as content.
Case = tuple[str, str, str | None, Calls]  # None: the output itself, unchanged
CASES: list[Case] = [
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
     '"San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>', "",
     [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]),
    ("hermes", "I'll check both cities.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "search", '
     f'"arguments": {TRICKY_JSON}}}\n</tool_call>', "I'll check both cities.",
     [("get_weather", PARIS), ("search", TRICKY)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nDone, see above.',
     "Done, see above.", [("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n', "",
     [("get_time", {"tz": "UTC"})]),  # closing tag never came: complete JSON still counts
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n<tool_call>\n{"name": "b", '
     '"arguments": {"x": 1}}\n</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    ("hermes", "  The weather in Paris is 18 °C.\n\nAnything else? ", "  The weather in Paris is "
     "18 °C.\n\nAnything else? ", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', None, []),
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "argum', None, []),
    ("hermes", "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>.", None, []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"unit": "celsius"}}', "", [("get_weather", PARIS)]),
    ("llama3_json", '\n\n{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}', "", [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     f'"celsius"}}}}; {{"name": "search", "arguments": {TRICKY_JSON}}}', "",
     [("get_weather", PARIS), ("search", TRICKY)]),
    ("llama3_json", '{"type": "function", "name": "search", "parameters": {"query": "llama"}}',
     "", [("search", {"query": "llama"})]),
    ("llama3_json", '{"answer": 42, "unit": "none"}', None, []),
    ("llama3_json", 'Write {"name": "x", "parameters": {}} to call a tool.', None, []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="weather in Paris")', None, []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}', None, []),
    ("llama3_json", '{"name": "get_weather", "parameters": [1, 2]}', None, []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}, "id": "Vfr3sGz1m"}, {"name": "get_time", "arguments": {}}]', "",
     [("get_weather", PARIS), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     f"[TOOL_CALLS]search[ARGS]{TRICKY_JSON}", "", [("get_weather", PARIS), ("search", TRICKY)]),
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", '
     '"unit": "celsius"}', "Let me check.", [("get_weather", PARIS)]),
    ("mistral", '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', None, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', None, []),
    ("mistral", "Bonjour ! [Note] brackets [ARGS] are fine.", None, []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]', "",
     [("get_weather", PARIS), ("get_time", {"tz": "Europe/Paris"})]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", unit="celsius")]<|python_end|>', "",
     [("get_weather", PARIS)]),
    ("pythonic", "[search(query='it\\'s \"quoted\" ) ] (', limit=5, filters={'lang': 'en', "
     "'tags': ('a', 'b')}, exact=True, offset=None, score=-0.5, strict=false)]", "",
     [("search", {"query": "it's \"quoted\" ) ] (", "limit": 5, "filters": {"lang": "en", "tags":
      ["a", "b"]}, "exact": True, "offset": None, "score": -0.5, "strict": False})]),
    ("pythonic", "[1, 2, 3] are the first three numbers.", None, []),
    ("pythonic", "[Note] this is not a call.", None, []),
    ("pythonic", '[get_weather(city=__import__("os").getcwd())]', None, []),
    ("pythonic", '[get_weather("Paris")]', None, []),
    ("pythonic", '[get_weather(city="Par', None, []),
    ("deepseek_v3", DS_CALLS_BEGIN + ds_call("get_weather", '{"city": "Paris", "unit": "celsius"}')
     + DS_CALLS_END, "", [("get_weather", PARIS)]),
    ("deepseek_v3", "Let me look both up.\n\n" + DS_CALLS_BEGIN + ds_call("get_weather", json.dumps(
        PARIS)) + "\n" + ds_call("search", TRICKY_JSON) + DS_CALLS_END, "Let me look both up.",
     [("get_weather", PARIS), ("search", TRICKY)]),
    ("deepseek_v3", f'{DS_CALLS_BEGIN}{DS_BEGIN}get_time{DS_SEP}{{"tz": "UTC"}}{DS_END}'
     f"{DS_CALLS_END}", "", [("get_time", {"tz": "UTC"})]),  # DeepSeek-V3.1 form
    ("deepseek_v3", DS_CALLS_BEGIN + ds_call("get_weather", '{"city": ') + DS_CALLS_END, None, []),
    ("deepseek_v3", DS_CALLS_BEGIN + ds_call("get_weather", json.dumps(PARIS))[:-20], None, []),
    ("deepseek_v3", DS_CALLS_BEGIN + ds_call("f", "{}") + "junk" + DS_CALLS_END, None, []),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Paris", "unit": "celsius"}<|call|>', "", [("get_weather", PARIS)]),
    ("harmony", "<|channel|>analysis<|message|>Need both.<|end|><|start|>assistant<|channel|>"
     "commentary<|message|>Checking two things.<|end|><|start|>assistant to=functions.search"
     f"<|channel|>commentary json<|message|>{TRICKY_JSON}<|call|>",
     "Need both.Checking two things.", [("search", TRICKY)]),
    ("harmony", "<|channel|>final<|message|>2 + 2 = 4.<|return|>", "2 + 2 = 4.", []),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": <|call|>', None, []),
    ("harmony", "Plain text, no harmony at all.", None, []),
]


def case_id(case: Case) -> str:
    return f"{case[0]}-{CASES.index(case)}"


def chunkings(text: str, seed: str) -> list[list[str]]:
    """The whole text, one character at a time, and random splits from a fixed seed."""
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(8):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def stream_events(name: str, chunks: list[str]) -> list[StreamEvent]:
    stream = tool_parser(name).stream()
    events = [e for chunk in chunks for e in stream.feed(chunk)]
    return events + stream.finish()


def assert_matches(result: ToolParse, content: str, calls: Calls) -> None:
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in result.calls)
    assert len({c.id for c in result.calls}) == len(result.calls)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_parse(case: Case) -> None:
    name, text, content, calls = case
    assert_matches(tool_parser(name).parse(text), text if content is None else content, calls)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_stream_equals_parse_in_every_split(case: Case) -> None:
    name, text, content, calls = case
    for chunks in chunkings(text, case_id(case)):
        events = stream_events(name, chunks)
        assert_matches(collect(events), text if content is None else content, calls)
        assert all(e.text for e in events if isinstance(e, ContentDelta))
        started: list[int] = []
        for event in events:  # each call: its start first, then its argument fragments
            if isinstance(event, ToolCallStart):
                assert event.index == len(started)
                started.append(event.index)
            elif isinstance(event, ToolCallArguments):
                assert started and event.index == started[-1]


def test_markup_is_held_and_plain_text_released() -> None:
    stream = tool_parser("hermes").stream()
    assert collect(stream.feed("Hello <tool")).content == "Hello"
    assert collect(stream.feed("box> and <tool_ca")).content == " <toolbox> and"
    assert stream.feed('ll>\n{"name": "f", "arguments": {"a": "x</tool') == []
    events = stream.feed('"}}\n</tool_call>')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments]
    assert events[1] == ToolCallArguments(0, '{"a": "x</tool"}')
    assert stream.finish() == [] and stream.num_calls == 1


def test_arguments_split_across_chunks_arrive_whole() -> None:
    text = f"[TOOL_CALLS]search[ARGS]{TRICKY_JSON}"
    stream = tool_parser("mistral").stream()
    cut = text.index("[x]")
    assert stream.feed(text[:cut]) == []
    start, args = stream.feed(text[cut:])
    assert isinstance(start, ToolCallStart) and start.name == "search"
    assert isinstance(args, ToolCallArguments) and json.loads(args.fragment) == TRICKY
    assert stream.finish() == []


def test_truncated_call_falls_back_to_raw_text_at_finish() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    stream = tool_parser("hermes").stream()
    assert collect(stream.feed(text)).content == "Sure."
    assert collect(stream.finish()).content == text[len("Sure."):]


@pytest.mark.parametrize(("text", "python", "end"), [
    ('{"a": "}\\"]", "b": [1, {"c": "\\\\"}]} tail', False, 36),
    ('{"a": "x\\', False, None),
    ("[f(s=')]\\'(', t=\"'\"), g()] x", True, 26),
    ('{"a": [1, 2}', False, BracketError),
])
def test_bracket_scanner_resumed_per_char_matches_one_shot(text: str, python: bool,
                                                          end: int | type | None) -> None:
    if end is BracketError:
        with pytest.raises(BracketError):
            bracket_end(text, 0, python)
        return
    assert bracket_end(text, 0, python) == end
    scanner = BracketScanner(0, python)
    ends = [scanner.end(text[:i]) for i in range(1, len(text) + 1)]
    assert ends[-1] == end and set(ends[:end - 1 if end else None]) == {None}


def test_registry_names_and_errors() -> None:
    assert set(TOOL_PARSER_NAMES) == {"hermes", "llama3_json", "mistral", "pythonic",
                                      "deepseek_v3", "harmony"}
    assert tool_parser("hermes").name == "hermes"
    with pytest.raises(ValueError, match="valid names: hermes, llama3_json"):
        tool_parser("qwen25")
    stream = tool_parser("hermes").stream()
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")


# Fragments each format's markup is made of, for random (mostly malformed) outputs.
FUZZ_PIECES: dict[str, list[str]] = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', "{", "}",
               '"', "\n", " ", "hi", "<tool_", "\\"],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": {}}', "{", "}", ";", " ",
                    '"name"', ":", "text", '"', "\n"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "f", '{"a": 1}', "[", "]", "{", "}",
                '[{"name": "f", "arguments": {}}]', " ", "x"],
    "pythonic": ["[f(a=1)]", "[", "]", "f(", ")", "a=", "'s'", '"', ",", " ", "<|python_start|>",
                 "<|python_end|>", "x"],
    "deepseek_v3": [DS_CALLS_BEGIN, DS_CALLS_END, DS_BEGIN, DS_END, DS_SEP, "function", "f\n",
                    "```json\n", '{"a": 1}', "\n```", "x", "\n"],
    "harmony": ["<|start|>assistant", "<|channel|>", "commentary", " to=functions.f", "final",
                "analysis", "<|constrain|>json", "<|message|>", '{"a": 1}', "<|call|>",
                "<|end|>", "<|return|>", "text", " "],
}


@pytest.mark.parametrize("name", TOOL_PARSER_NAMES)
def test_fuzz_streaming_is_split_independent(name: str) -> None:
    rng = random.Random(f"fuzz-{name}")
    for _ in range(150):
        text = "".join(rng.choice(FUZZ_PIECES[name]) for _ in range(rng.randint(1, 14)))
        whole = tool_parser(name).parse(text)
        for chunks in chunkings(text, text)[1:4]:
            streamed = collect(stream_events(name, chunks))
            assert streamed.content == whole.content, (text, chunks)
            assert [(c.name, c.arguments) for c in streamed.calls] == \
                [(c.name, c.arguments) for c in whole.calls], (text, chunks)
        if not whole.calls and name not in ("pythonic", "harmony"):
            assert whole.content == text  # no call, no markup consumed: the text is untouched
        if not whole.calls:  # in any case the text survives, less markup and layout whitespace
            assert is_subsequence(whole.content, text)


def is_subsequence(small: str, big: str) -> bool:
    chars = iter(big)
    return all(c in chars for c in small)
