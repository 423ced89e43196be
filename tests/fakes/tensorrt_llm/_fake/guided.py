"""Guided decoding in the fake executor, standing in for upstream's GuidedDecoder
(tensorrt_llm/_torch/pyexecutor/guided_decoder.py, xgrammar backend): the LLM builds one only
with `guided_decoding_backend` set, from its tokenizer (upstream's create_py_executor asserts
`tokenizer is not None`, so `skip_tokenizer_init=True` cannot go with it); each request with
`guided_decoding` gets a grammar matcher that takes every token the request generates, the
context server's first token included.

The fake model's token is kept when the grammar allows it, else replaced by the allowed token
its state picks (a real model's masked logits pick one too). Knowingly simpler: the tokenizer
and grammar compiler load with the first guided request, not with the LLM (the fake's model
directories often hold no real tokenizer); upstream's llguidance backend is served by xgrammar;
structural tags are not modelled.
"""
from __future__ import annotations

import json
from typing import Any

from tensorrt_llm.sampling_params import GuidedDecodingParams


class FakeGuidedDecoder:
    def __init__(self, model_dir: str, vocab_size: int, end_id: int | None) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.model_dir, self.vocab_size, self.end_id = model_dir, vocab_size, end_id
        self._compiler: Any = None

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            info = self._xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size,
                stop_token_ids=None if self.end_id is None else [self.end_id])
            self._compiler = self._xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def matcher(self, params: GuidedDecodingParams) -> Any:
        """A matcher for a request's guide (ValueError for one the fake does not model)."""
        compiler = self._get_compiler()
        if params.json_object:
            compiled = compiler.compile_builtin_json_grammar()
        elif params.json is not None:
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            compiled = compiler.compile_json_schema(schema)
        elif params.regex is not None:
            compiled = compiler.compile_regex(params.regex)
        elif params.grammar is not None:
            compiled = compiler.compile_grammar(params.grammar)
        else:
            raise ValueError("the fake guided decoder models json, json_object, regex and grammar")
        return self._xgr.GrammarMatcher(compiled)

    def pick(self, matcher: Any, token: int, state: int) -> int:
        """`token` if the grammar allows it next, else the allowed token `state` picks."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        row = bitmask[0].tolist()
        allowed = [i for i in range(self.vocab_size) if (row[i // 32] >> (i % 32)) & 1]
        return token if token in allowed else allowed[state % len(allowed)]
