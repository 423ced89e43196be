"""The grammar of a forced harmony tool call (tandem.frontend.parsers.harmony_grammar), followed
by the engine's own guide (tandem.engines.guided.matcher) over the tokens of the tiny harmony
tokenizer: the demo tokenizer with harmony's markers as added special tokens, `<|return|>` and
`<|call|>` its stop tokens, as the gpt-oss e2e model (and gpt-oss itself) has them."""
from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.engines.guided.matcher import Grammars, Guide, allowed_ids, fill_bitmask
from tandem.engines.types import GuidedDecoding, GuidedKind
from tandem.frontend.chat_output import ChatOutput
from tandem.frontend.parsers import ToolCallArguments, ToolCallStart, reasoning_parser, tool_parser
from tandem.frontend.parsers.harmony import HarmonyFormat
from tandem.frontend.parsers.harmony_text import ALL_MARKERS, CALL, RETURN

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
ANALYSIS = ("<|channel|>analysis<|message|>Need the weather; 2 < 3 holds.<|end|>"
            "<|start|>assistant")
CALL_HEAD = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
PARIS = '{"city": "Paris", "unit": "c"}'


class Harmony:
    """The tiny harmony tokenizer and the engine's grammars compiled against it."""

    def __init__(self) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        from tandem.model.demo import ensure_demo_model

        self.tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
        self.tokenizer.add_tokens(list(ALL_MARKERS), special_tokens=True)
        self.stop_ids = self.tokenizer.convert_tokens_to_ids([RETURN, CALL])
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=len(self.tokenizer), stop_token_ids=self.stop_ids)
        self.grammars = Grammars(info)

    def guide(self, functions: dict[str, Any], json_whitespace: int = 0) -> Guide:
        ebnf = HarmonyFormat().forced_grammar(functions, json_whitespace)
        assert ebnf is not None
        return self.grammars.guide(GuidedDecoding(GuidedKind.GRAMMAR, ebnf), [])

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def accepts(self, guide: Guide, text: str) -> bool:
        """Whether the guide takes every token of `text` (it stops at the first refused)."""
        return all(guide.accept(token) for token in self.ids(text))

    def allowed(self, guide: Guide) -> list[int]:
        bitmask = fill_bitmask([guide], self.grammars.vocab_size)
        assert bitmask is not None
        return allowed_ids(bitmask, 0, self.grammars.vocab_size)


@pytest.fixture(scope="module")
def harmony() -> Harmony:
    return Harmony()


@pytest.mark.parametrize("analysis", ["", ANALYSIS])
@pytest.mark.parametrize("head", [
    CALL_HEAD,
    "<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>",
    "<|channel|>commentary to=functions.get_weather json<|message|>",
    "<|channel|>commentary to=functions.get_weather<|message|>",
])
def test_a_harmony_call_is_taken_token_by_token_then_a_stop_token(
        harmony: Harmony, analysis: str, head: str) -> None:
    text = analysis + head + PARIS
    special = harmony.tokenizer.convert_tokens_to_ids(["<|channel|>", "<|message|>"])
    assert set(special) <= set(harmony.ids(text))  # the markers are the special tokens
    guide = harmony.guide({"get_weather": WEATHER})
    assert harmony.accepts(guide, text) and not guide.is_terminated
    assert sorted(harmony.allowed(guide)) == sorted(harmony.stop_ids)  # the call is complete
    assert guide.accept(harmony.tokenizer.convert_tokens_to_ids(CALL)) and guide.is_terminated


def test_the_first_token_is_a_channel_never_bare_json(harmony: Harmony) -> None:
    guide = harmony.guide({"get_weather": WEATHER})
    channel = harmony.tokenizer.convert_tokens_to_ids("<|channel|>")
    assert channel in harmony.allowed(guide)
    for text in (PARIS, '{"name": "get_weather", "arguments": ' + PARIS + "}", "Sure."):
        assert not harmony.accepts(harmony.guide({"get_weather": WEATHER}), text)


@pytest.mark.parametrize("text", [
    "<|channel|>final<|message|>Sunny.",                                  # an answer, no call
    "<|channel|>commentary<|message|>Checking.",                          # a preamble
    "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>",  # not forced
    CALL_HEAD + '{"town": "Paris"}',                                      # off the schema
    CALL_HEAD + '{"city": "Paris", "unit": "k"}',
    "<|channel|>analysis<|message|>Hidden <|start|>",                     # a marker in analysis
    ANALYSIS + ANALYSIS,                                                  # one analysis message
])
def test_what_is_not_the_forced_call_is_refused(harmony: Harmony, text: str) -> None:
    assert not harmony.accepts(harmony.guide({"get_weather": WEATHER}), text)


@pytest.mark.parametrize("text", [ANALYSIS, CALL_HEAD + '{"city": "Paris"', CALL_HEAD + '{"city": "P'])
def test_no_stop_before_the_call_is_complete(harmony: Harmony, text: str) -> None:
    guide = harmony.guide({"get_weather": WEATHER})
    assert harmony.accepts(guide, text)
    assert not set(harmony.stop_ids) & set(harmony.allowed(guide))


def test_required_takes_any_of_the_tools_and_one_call(harmony: Harmony) -> None:
    functions = {"get_weather": WEATHER, "get_time": TIME}
    time_call = ("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
                 '{"zone": "CET"}')
    for text in (CALL_HEAD + PARIS, time_call):
        guide = harmony.guide(functions)
        assert harmony.accepts(guide, text)
        # gpt-oss makes one call per turn: after it, only a stop token (`<|call|>`)
        assert sorted(harmony.allowed(guide)) == sorted(harmony.stop_ids)
    assert not harmony.accepts(harmony.guide(functions), time_call.replace('"CET"', "1"))
    assert not harmony.accepts(harmony.guide(functions), time_call.replace(
        '"zone": "CET"', '"city": "Paris"'))


def test_json_whitespace_reaches_the_arguments(harmony: Harmony) -> None:
    pretty = CALL_HEAD + json.dumps({"city": "Paris"}, indent=2)
    assert not harmony.accepts(harmony.guide({"get_weather": WEATHER}), pretty)
    assert harmony.accepts(harmony.guide({"get_weather": WEATHER}, json_whitespace=4), pretty)


@pytest.mark.parametrize("head", [
    CALL_HEAD, "<|channel|>commentary to=functions.get_weather json<|message|>",
    "<|channel|>commentary to=functions.get_weather<|message|>"])
def test_what_the_grammar_allows_the_parsers_read_as_the_call(harmony: Harmony, head: str) -> None:
    """Fed token by token, as the frontend decodes them (special tokens kept; the final
    `<|call|>` is EOS and never reaches the text)."""
    output = ChatOutput(reasoning=reasoning_parser("gpt_oss").stream(),
                        tools=tool_parser("harmony").stream())
    total = output.feed("")
    for token in harmony.ids(ANALYSIS + head + PARIS):
        total.extend(output.feed(harmony.tokenizer.decode([token], skip_special_tokens=False)))
    total.extend(output.finish())
    assert (total.reasoning, total.content) == ("Need the weather; 2 < 3 holds.", "")
    assert [e.name for e in total.calls if isinstance(e, ToolCallStart)] == ["get_weather"]
    arguments = "".join(e.fragment for e in total.calls if isinstance(e, ToolCallArguments))
    assert json.loads(arguments) == json.loads(PARIS)


def test_properties_come_in_the_schemas_order(harmony: Harmony) -> None:
    backwards = {**WEATHER, "properties": dict(reversed(WEATHER["properties"].items()))}
    for schema, text in ((WEATHER, PARIS), (backwards, '{"unit": "c", "city": "Paris"}')):
        assert harmony.accepts(harmony.guide({"get_weather": schema}), CALL_HEAD + text)


def test_the_grammar_is_built_once_per_set_of_functions() -> None:
    fmt = HarmonyFormat()
    first = fmt.forced_grammar({"get_weather": WEATHER}, 0)
    assert fmt.forced_grammar({"get_weather": json.loads(json.dumps(WEATHER))}, 0) is first
    assert fmt.forced_grammar({"get_weather": WEATHER}, 2) != first
