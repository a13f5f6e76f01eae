"""A chat template that renders OpenAI tools, tool results and calls the way Qwen 2.5's
does (hermes `<tool_call>` JSON), and Qwen3's `enable_thinking` switch; the tools and
conversations the tool tests send."""
from __future__ import annotations

TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Write each call as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{{ m.content }}
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}},
        "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
TOOLS = [WEATHER, NOOP]

# a whole round: the user asks, the assistant calls, the tool answers
ROUND = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
]

CALL_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris, \\"FR\\"", "days": 3}}\n</tool_call>')
CALL_ARGUMENTS = '{"city": "Paris, \\"FR\\"", "days": 3}'
