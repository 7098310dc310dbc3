"""Chat templates: HF-compatible rendering, and hostile templates failing cleanly and quickly."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from services.gateway.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]

# A Llama-3-style template, written the way tokenizer_config.json files write them:
# whitespace control, bos_token, raise_exception for bad conversations, strftime_now.
LLAMA_LIKE = """
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = 'Today is ' + strftime_now('%d %b %Y') %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def test_default_template_is_chatml() -> None:
    text = ChatTemplate().render(MESSAGES[:2])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(MESSAGES[:2], add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_custom_template_with_bos_and_date() -> None:
    tmpl = ChatTemplate(LLAMA_LIKE, bos_token="<|begin_of_text|>", now=lambda: 1_700_000_000.0)
    text = tmpl.render(MESSAGES)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    dated = tmpl.render([{"role": "user", "content": "x"}])
    assert "Today is 14 Nov 2023" in dated or "Today is 15 Nov 2023" in dated  # depends on local TZ


def test_raise_exception_is_a_clean_error() -> None:
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(LLAMA_LIKE).render([{"role": "assistant", "content": "x"}])
    assert info.value.reason == "raised"
    assert "alternate" in info.value.message


def test_tojson_keeps_non_ascii_and_generation_tag_is_accepted() -> None:
    tmpl = ChatTemplate("{{ messages[0]|tojson }}{% generation %}[{{ messages[0].content }}]{% endgeneration %}")
    assert tmpl.render([{"role": "user", "content": "héllo <b>"}]) == '{"role": "user", "content": "héllo <b>"}[héllo <b>]'


def test_tools_and_documents_are_none_like_in_transformers() -> None:
    tmpl = ChatTemplate("{{ 'tools' if tools is not none else 'plain' }}/{{ documents is none }}")
    assert tmpl.render([]) == "plain/True"
    assert tmpl.render([], extra_context={"tools": []}) == "tools/True"


def test_loopcontrols_and_trim_blocks() -> None:
    tmpl = ChatTemplate("{% for m in messages %}\n{% if loop.index > 2 %}{% break %}{% endif %}\n{{ m.role }};\n{% endfor %}")
    assert tmpl.render(MESSAGES) == "system;\nuser;\n"


def test_for_tokenizer_uses_its_template_and_special_tokens() -> None:
    tok = SimpleNamespace(chat_template="{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", bos_token="<s>", eos_token="</s>")
    assert ChatTemplate.for_tokenizer(tok).render([{"role": "user", "content": "x"}]) == "<s>x</s>"
    plain = SimpleNamespace(chat_template=None)
    assert ChatTemplate.for_tokenizer(plain).source == DEFAULT_CHAT_TEMPLATE


def test_syntax_error_fails_at_construction() -> None:
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate("{% for %}")
    assert info.value.reason == "broken"


HOSTILE = {
    "sandbox escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "broken"),
    "mutation": ("{{ messages.append(1) }}", "broken"),
    "undefined": ("{{ nope.deeper }}", "broken"),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "broken"),
    "string times huge": ("{{ 'x' * 1000000000 }}", "too_long"),
    "list times huge": ("{{ ([1] * 1000000000)|length }}", "too_long"),
    "doubling with ~": (
        "{% set ns = namespace(s='ab') %}{% for i in range(200) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "too_long",
    ),
    "doubling with +": (
        "{% set ns = namespace(s='ab') %}{% for i in range(200) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "too_long",
    ),
    "center filter": ("{{ 'a'|center(1000000000) }}", "too_long"),
    "str.ljust": ("{{ 'a'.ljust(1000000000) }}", "too_long"),
    "percent width": ("{{ '%999999999d' % 1 }}", "too_long"),
    "format filter width": ("{{ '%999999999d'|format(1) }}", "too_long"),
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", "too_long"),
    "huge power": ("{{ 2 ** 100000 }}", "budget"),
    "squaring": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "budget"),
    "silent nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "budget"),
    "nested loops over messages": (
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}",
        "budget",
    ),
    "endless output": ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}", "too_long"),
    "lipsum removed": ("{{ lipsum(100000) }}", "broken"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_fail_cleanly(name: str) -> None:
    source, reason = HOSTILE[name]
    # Small budgets keep the test fast; the defaults only scale the same checks.
    tmpl = ChatTemplate(source, max_output_chars=100_000, max_steps=50_000)
    with pytest.raises(ChatTemplateError) as info:
        tmpl.render([{"role": "user", "content": "hi"}] * 50)
    assert info.value.reason == reason, info.value.message


def test_time_budget_uses_the_injected_clock() -> None:
    ticks = itertools.count()
    tmpl = ChatTemplate(
        "{% for i in range(1000) %}{{ i }}{% endfor %}", max_seconds=10.0, clock=lambda: float(next(ticks))
    )
    with pytest.raises(ChatTemplateError) as info:
        tmpl.render([])
    assert info.value.reason == "budget" and "time" in info.value.message


def test_output_limit_per_render() -> None:
    tmpl = ChatTemplate()
    long = [{"role": "user", "content": "x" * 1000}]
    assert len(tmpl.render(long, max_output_chars=2000)) > 1000
    with pytest.raises(ChatTemplateError) as info:
        tmpl.render(long, max_output_chars=500)
    assert info.value.reason == "too_long"


def test_budgets_do_not_leak_between_renders() -> None:
    tmpl = ChatTemplate(max_steps=200)
    for _ in range(50):  # each render gets a fresh budget
        tmpl.render(MESSAGES)
