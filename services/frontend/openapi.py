"""The OpenAPI 3.0 document of the frontend's REST API (`GET /openapi.json`), written by hand: it
describes what clients may send (the subset of OpenAI's API that Tandem serves) and every status
the routes answer with. Fuzzers (schemathesis) read it to generate requests."""
from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/schemas/Error"}
_NUMBER = {"type": "number"}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
         "nullable": True}
#: Sampling fields both generation endpoints take (OpenAI's, then vLLM's extensions).
_SAMPLING: dict[str, Any] = {
    "max_tokens": {"type": "integer", "nullable": True},
    "temperature": _NUMBER, "top_p": _NUMBER, "seed": {"type": "integer", "nullable": True},
    "frequency_penalty": _NUMBER, "presence_penalty": _NUMBER,
    "stop": _STOP, "stream": {"type": "boolean"}, "n": {"type": "integer"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "ignore_eos": {"type": "boolean"}, "min_tokens": {"type": "integer"},
    "top_k": {"type": "integer"}, "min_p": _NUMBER, "repetition_penalty": _NUMBER,
    "stop_token_ids": {"type": "array", "items": {"type": "integer"}},
}
_TOOL = {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"type": "string", "enum": ["function"]}, "function": {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                       "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}},
}
_TOOL_CHOICE = {"oneOf": [
    {"type": "string", "enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}}}}}]}
_MESSAGE = {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]},
                           "text": {"type": "string"}}}}]},
    },
}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _responses(ok: str) -> dict[str, Any]:
    errors = {"400": "Invalid request", "401": "Missing or wrong API key",
              "404": "Unknown model", "413": "Body too large",
              "429": "Overloaded; retry after Retry-After seconds",
              "503": "Draining or no worker available; retry after Retry-After seconds",
              "504": "The request's deadline passed"}
    out: dict[str, Any] = {"200": {"description": ok, "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {"schema": {"type": "string"}}}}}
    out.update({code: {"description": text, "content": {"application/json": {"schema": _ERROR}}}
                for code, text in errors.items()})
    return out


def _other_apis() -> dict[str, Any]:
    """Responses, Anthropic Messages and embeddings: their required fields and main options
    (the routes refuse, with a 400 naming it, what they do not honour)."""
    responses = {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": "string", "nullable": True},
        "max_output_tokens": {"type": "integer", "nullable": True},
        "temperature": _NUMBER, "top_p": _NUMBER, "stream": {"type": "boolean"},
        "store": {"type": "boolean"},
        "previous_response_id": {"type": "string", "nullable": True},
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
        "text": {"type": "object"}, "reasoning": {"type": "object"}}}
    block = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}
    messages = {"type": "object", "required": ["model", "messages", "max_tokens"], "properties": {
        "model": {"type": "string"}, "max_tokens": {"type": "integer"},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": block}]},
        "messages": {"type": "array", "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"type": "string", "enum": ["user", "assistant"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": block}]}}}},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "temperature": _NUMBER, "top_p": _NUMBER, "top_k": {"type": "integer"},
        "stream": {"type": "boolean"}, "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"type": "object"}, "thinking": {"type": "object"}}}
    embeddings = {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                            {"type": "array", "items": {"type": "integer"}}]},
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"type": "integer"}}}
    by_id = [{"name": "response_id", "in": "path", "required": True,
              "schema": {"type": "string"}}]
    stored = {"200": {"description": "The stored response", "content": {
        "application/json": {"schema": {"type": "object"}}}},
        "404": {"description": "No stored response has that id",
                "content": {"application/json": {"schema": _ERROR}}}}
    return {
        "/v1/responses": {"post": {
            "operationId": "createResponse", "requestBody": _json_body(responses),
            "responses": _responses("A response, or its SSE stream of events")}},
        "/v1/responses/{response_id}": {
            "get": {"operationId": "getResponse", "parameters": by_id, "responses": stored},
            "delete": {"operationId": "deleteResponse", "parameters": by_id,
                       "responses": stored}},
        "/v1/messages": {"post": {
            "operationId": "createMessage", "requestBody": _json_body(messages),
            "responses": _responses("An Anthropic message, or its SSE stream of events")}},
        "/v1/messages/count_tokens": {"post": {
            "operationId": "countMessageTokens", "requestBody": _json_body(messages),
            "responses": _responses("{input_tokens}")}},
        "/v1/embeddings": {"post": {
            "operationId": "createEmbedding", "requestBody": _json_body(embeddings),
            "responses": _responses("One embedding per input")}},
    }


def openapi_document() -> dict[str, Any]:
    chat = {"type": "object", "required": ["model", "messages"], "properties": {
        "model": {"type": "string"}, "messages": {"type": "array", "items": _MESSAGE},
        "max_completion_tokens": {"type": "integer", "nullable": True},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer"},
        "tools": {"type": "array", "items": _TOOL}, "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": {"type": "boolean"},
        "chat_template_kwargs": {"type": "object"},
        "reasoning_effort": {"type": "string", "enum": ["low", "medium", "high"]},
        **_SAMPLING}}
    completion = {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": {"type": "string"},
        "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
        "logprobs": {"type": "integer", "nullable": True}, **_SAMPLING}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "Tandem OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion", "requestBody": _json_body(chat),
                "responses": _responses("A chat completion, or its SSE stream")}},
            "/v1/completions": {"post": {
                "operationId": "createCompletion", "requestBody": _json_body(completion),
                "responses": _responses("A completion, or its SSE stream")}},
            "/v1/models": {"get": {
                "operationId": "listModels",
                "responses": {"200": {"description": "The served model", "content": {
                    "application/json": {"schema": {"type": "object"}}}},
                    "401": {"description": "Missing or wrong API key",
                            "content": {"application/json": {"schema": _ERROR}}}}}},
            **_other_apis(),
        },
        "components": {"schemas": {"Error": {
            "type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message", "type"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": "string", "nullable": True},
                               "code": {"nullable": True}}}}}}},
    }
