"""Chat templates with tool support for tests, on the demo tokenizer's ChatML tokens.

QWEN_TOOLS is Qwen2.5-Instruct's template (tools in the system turn, calls as hermes
`<tool_call>` JSON, results as `<tool_response>`), without its default system prompt, plus
Qwen3's `enable_thinking=false` empty think block.
"""
from __future__ import annotations

import json
import pathlib

QWEN_TOOLS = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and " }}
    {{- "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": " }}
    {{- "<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or
          (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def use_template(model_dir: pathlib.Path, template: str) -> None:
    """Makes `template` the chat template of the model directory's tokenizer."""
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_file.write_text(json.dumps(config), encoding="utf-8")
    for stray in ("chat_template.jinja", "chat_template.json"):
        (model_dir / stray).unlink(missing_ok=True)


#: gpt-oss's harmony format, written from OpenAI's harmony spec (transformers' copy of the real
#: template is not available offline): a system message with the reasoning effort (default
#: medium) and the channel rules, a developer message with the system prompt as `# Instructions`
#: and the tools as a TypeScript `namespace functions`, past tool calls as commentary messages to
#: `functions.NAME` ending with `<|call|>`, tool results from `functions.NAME` to the assistant,
#: and the generation prompt `<|start|>assistant`. Unlike the real template it leaves out the
#: knowledge cutoff and current date lines (a date would make renders differ across midnight)
#: and renders nested parameter types as `object` / `any[]`.
HARMONY = """
{%- macro ts_type(p) -%}
    {%- if p.enum is defined -%}{{ p.enum | map('tojson') | join(' | ') }}
    {%- elif p.type == 'string' -%}string
    {%- elif p.type in ('number', 'integer') -%}number
    {%- elif p.type == 'boolean' -%}boolean
    {%- elif p.type == 'array' -%}any[]
    {%- elif p.type == 'object' -%}object
    {%- else -%}any{%- endif -%}
{%- endmacro -%}
{%- if reasoning_effort is not defined or reasoning_effort is none %}
    {%- set reasoning_effort = 'medium' %}
{%- endif %}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n\\n' }}
{{- 'Reasoning: ' + reasoning_effort + '\\n\\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}
    {{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- '<|end|>' }}
{%- set system = messages[0].content if messages and messages[0].role in ('system', 'developer')
    else none %}
{%- if system or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if system %}{{- '# Instructions\\n\\n' + system + '\\n\\n' }}{%- endif %}
    {%- if tools %}
        {{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}
        {%- for tool in tools %}
            {%- set f = tool.function if tool.function is defined else tool %}
            {%- if f.description %}{{- '// ' + f.description + '\\n' }}{%- endif %}
            {%- set params = f.parameters if f.parameters is defined else none %}
            {%- if params and params.properties %}
                {{- 'type ' + f.name + ' = (_: {\\n' }}
                {%- for name, p in params.properties.items() %}
                    {%- if p.description %}{{- '// ' + p.description + '\\n' }}{%- endif %}
                    {{- name }}
                    {%- if name not in (params.required or []) %}{{- '?' }}{%- endif %}
                    {{- ': ' + ts_type(p) + ',\\n' }}
                {%- endfor %}
                {{- '}) => any;\\n\\n' }}
            {%- else %}
                {{- 'type ' + f.name + ' = () => any;\\n\\n' }}
            {%- endif %}
        {%- endfor %}
        {{- '} // namespace functions' }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- set ns = namespace(last_call='') %}
{%- for message in messages %}
    {%- if message.role in ('system', 'developer') and loop.first %}
    {%- elif message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.reasoning_content %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content
                + '<|end|>' }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- if message.content %}
                {{- '<|start|>assistant<|channel|>commentary<|message|>' + message.content
                    + '<|end|>' }}
            {%- endif %}
            {%- for call in message.tool_calls %}
                {%- set call = call.function if call.function is defined else call %}
                {%- set ns.last_call = call.name %}
                {{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary '
                    + '<|constrain|>json<|message|>' + call.arguments | tojson + '<|call|>' }}
            {%- endfor %}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {%- set name = message.name if message.name else ns.last_call %}
        {{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>'
            + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""
