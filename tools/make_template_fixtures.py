#!/usr/bin/env python3
"""Chat-template parity fixtures for moeinfer's Jinja renderer.

Every template below was written for these tests: one per feature group (whitespace control,
loops, filters, tests, macros, ...) and a few full chat templates in the style of the ones
Qwen3, Llama 3, Mistral, DeepSeek-V3, Gemma, Phi and OLMoE publish. Each is rendered with Python's
jinja2, configured the way transformers configures it for apply_chat_template, on a handful of
contexts; the template, the contexts and jinja2's output (or its error) are written to
tests/fixtures/templates/:

    NAME.jinja        the template
    NAME.cases.json   [{"context": {...}, "output": "..."} | {"context": {...}, "error": "...",
                        "error_type": "TemplateError"}, ...]

Usage: python3 tools/make_template_fixtures.py [--out tests/fixtures/templates]
Needs jinja2 (3.1.x). tests/e2e/test_chat_template_diff.py imports `make_environment` from here.
"""

import argparse
import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


# ----------------------------------------------------------------------------------------------
# The environment, as transformers' chat_template_utils builds it.


def make_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")

    class GenerationTag(jinja2.ext.Extension):
        # transformers' {% generation %} ... {% endgeneration %} marks assistant text; it renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = lambda *a, **k: dict(*a, **k)
    env.globals["namespace"] = TemplateNamespace
    return env


def render(env, source, context):
    """Returns {"output": str} or {"error": str, "error_type": str}."""
    try:
        return {"output": env.from_string(source).render(**context)}
    except Exception as e:  # noqa: BLE001 - every jinja2 failure is an expected outcome here
        return {"error": str(e), "error_type": type(e).__name__}


# ----------------------------------------------------------------------------------------------
# Feature templates. Each entry: name -> (template, [contexts]).

CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Say ünïcödé 🎉"},
]

FEATURES = {}

FEATURES["whitespace"] = ("""\
{# a comment on its own line disappears with its newline #}
<start>
  {% if true %}
    indented by four
  {% endif %}
{% for i in [1, 2] %}
    item {{ i }}
{% endfor %}
a   {%- if true %} glued-left{% endif %}
b {% if true -%}   glued-right   {%- endif %} c
d {%+ if true %}keep-left{% endif %}
e {% if true +%}
keep-newline{% endif %}
    {{ "var tags are not lstripped" }}
   {#- comment strips left #} f
{% raw %}{{ not rendered }} {% if %}{% endraw %}
{%- raw %} raw-with-strip {% endraw -%}
   tail
{{ 'x' -}}
   {{- 'y' }}
{% set z = 1 %}    after set
line with {# inline comment #} inside
end
""", [{}])

FEATURES["whitespace_crlf"] = ("line1\r\n{% if true %}\r\n  x\r\n{% endif %}\r\nline2\r\n", [{}])

FEATURES["literals_and_printing"] = ("""\
{{ 42 }} {{ -7 }} {{ 1_000 }} {{ 0x1F }} {{ 3.0 }} {{ 2.5e3 }} {{ 1e-7 }} {{ 1e16 }} {{ 1e15 }} {{ 123456789.123 }}
{{ 0.1 + 0.2 }} {{ 1 / 3 }} {{ 2 / 2 }} {{ -0.0 }} {{ 1e300 * 1e10 }}
{{ true }} {{ True }} {{ false }} {{ none }} {{ None }}
{{ "dq" }} {{ 'sq' }} {{ "a" "b" 'c' }} {{ 'esc\\tapes\\n\\u00e9\\x41' }} {{ "it's" }}
{{ [1, 'two', 3.5, none, true, [], {}] }}
{{ ('t', 1) }} {{ (1,) }} {{ () }}
{{ {'k': 'v', 'n': 1, 'nested': {'l': [1, 2]}} }}
{{ ["it's", 'say "hi"', 'both \\' and "', 'tab\\there', 'nl\\n', 'uni é 中 🎉', '\\x00\\x7f'] }}
{{ value }} {{ floats }} {{ obj }}
""", [{"value": "plain", "floats": [1.0, 0.5, 1e20, 1.5e-5, -2.25, 100.0], "obj": {"a": [1, {"b": None}], "c": True}}])

FEATURES["operators"] = ("""\
{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }}
{{ 7.5 // 2 }} {{ 7.5 % 2 }} {{ 2 ** -1 }} {{ 10 / 4 }} {{ 1 + 1.5 }} {{ true + 1 }} {{ 3 * 'ab' }} {{ [1] * 2 }}
{{ 'a' + 'b' }} {{ [1, 2] + [3] }} {{ 'n=' ~ 5 ~ none ~ true ~ [1] }}
{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ 'abc' < 'abd' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 2 }} {{ 1 <= 0 }}
{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ 3 not in [1] }}
{{ true and 'yes' }} {{ false or 'fallback' }} {{ 0 or '' }} {{ not none }} {{ not 1 }} {{ none and 1 }}
{{ 'yes' if x else 'no' }} {{ 'a' if false else 'b' if true else 'c' }} {{ ('shown' if false) is defined }}
{{ x is none }} {{ x is not none }} {{ not x is none }} {{ -x if x is number else 'n/a' }} {{ +3 }}
""", [{"x": 5}, {"x": None}, {"x": "str"}])

FEATURES["conditionals"] = ("""\
{% for v in values %}
{% if v is none %}
none
{% elif v is boolean %}
bool {{ v }}
{% elif v is integer and v > 10 %}
big int {{ v }}
{% elif v is number %}
number {{ v }}
{% elif v is string and v %}
string {{ v }}
{% elif v is mapping %}
mapping with {{ v | length }} keys
{% elif v is iterable %}
iterable of {{ v | length }}
{% else %}
other
{% endif %}
{% endfor %}
{% if missing %}never{% elif missing is undefined %}missing is undefined{% endif %}
""", [{"values": [None, True, False, 3, 30, 2.5, "s", "", {"a": 1}, [1, 2], []]}])

FEATURES["loops"] = ("""\
{% for m in messages %}
{{ loop.index }}/{{ loop.length }} {{ loop.index0 }} {{ loop.revindex }} {{ loop.revindex0 }} first={{ loop.first }} last={{ loop.last }} prev={{ loop.previtem.role if loop.previtem is defined else '-' }} next={{ loop.nextitem.role if loop.nextitem is defined else '-' }} {{ loop.cycle('odd', 'even') }}: {{ m.role }}
{% else %}
no messages
{% endfor %}
{% for m in messages if m.role == 'user' %}
user #{{ loop.index }} of {{ loop.length }}: {{ m.content }}
{% endfor %}
{% for k, v in d.items() %}{{ k }}={{ v }}{{ ', ' if not loop.last }}{% endfor %}

{% for k in d %}{{ k }} {% endfor %}| {% for k in d.keys() %}{{ k }} {% endfor %}| {% for v in d.values() %}{{ v }} {% endfor %}

{% for a, b in pairs %}{{ a }}-{{ b }} {% endfor %}
{% for (a, b) in pairs %}{{ b }}{{ a }} {% endfor %}
{% for c in 'héllo' %}[{{ c }}]{% endfor %}

{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 6 %}{% break %}{% endif %}{{ i }}{% endfor %}

{% for i in range(3) %}{% for j in range(i) %}{{ i }}{{ j }} {% endfor %}{% endfor %}

{% for i in range(1, 10, 3) %}{{ i }}{% endfor %} {% for i in range(5, 0, -2) %}{{ i }}{% endfor %}

{% set outer = 'o' %}{% for i in [1, 2] %}{{ outer }}{% set outer = 'inner' ~ i %}{{ outer }} {% endfor %}{{ outer }}
{% for x in [] %}x{% else %}empty-else{% endfor %}
{% for x in undefined_var %}x{% else %}undefined-iterates-empty{% endfor %}
{% for x in [1, 2, 3] if x > 5 %}x{% else %}filtered-empty{% endfor %}
""", [
    {"messages": CONVO, "d": {"z": 1, "a": 2, "m": [3]}, "pairs": [[1, 2], ["x", "y"]]},
    {"messages": [], "d": {}, "pairs": []},
])

FEATURES["set_and_namespace"] = ("""\
{% set a = 1 %}{% set b, c = 'x', 'y' %}{% set l = [a, b, c] %}{{ a }}{{ b }}{{ c }} {{ l }}
{% set block %}
  captured {{ a }}
{% endset %}[{{ block }}]
{% set shouted | upper | trim %}  quiet words  {% endset %}[{{ shouted }}]
{% if true %}{% set in_if = 'visible after if' %}{% endif %}{{ in_if }}
{% for i in [1] %}{% set in_loop = 'gone' %}{% endfor %}[{{ in_loop }}]
{% set ns = namespace(count=0, names=[], last=none) %}
{% for m in messages %}
{% set ns.count = ns.count + 1 %}
{% set ns.names = ns.names + [m.role] %}
{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}
{% endfor %}
{{ ns.count }} {{ ns.names }} {{ ns.last }} {{ ns.missing is defined }}
{% set ns2 = namespace({'from_dict': 1}, extra=2) %}{{ ns2.from_dict }}{{ ns2.extra }}
{% set d = dict(a=1, b='two') %}{{ d }} {{ dict([('x', 1)]) }}
""", [{"messages": CONVO}, {"messages": [{"role": "assistant", "content": "only"}]}])

FEATURES["macros"] = ("""\
{% macro tag(name, body='', attrs={}) -%}
<{{ name }}{% for k, v in attrs.items() %} {{ k }}="{{ v }}"{% endfor %}>{{ body }}</{{ name }}>
{%- endmacro %}
{% macro count_down(n) %}{{ n }}{% if n > 0 %},{{ count_down(n - 1) }}{% endif %}{% endmacro %}
{% macro show_extra() %}{{ varargs }} {{ kwargs }}{% endmacro %}
{% macro wrap(cls) %}<div class="{{ cls }}">{{ caller() }}</div>{% endmacro %}
{% macro each(items) %}{% for i in items %}{{ caller(i) }}{% endfor %}{% endmacro %}
{{ tag('b') }} {{ tag('i', 'text') }} {{ tag('a', body='link', attrs={'href': 'u', 'id': 1}) }}
{{ count_down(3) }}
{{ show_extra(1, 2, k='v') }}
{% call wrap('box') %}inside {{ 1 + 1 }}{% endcall %}
{% call(item) each(['x', 'y']) %}<{{ item }}>{% endcall %}
{% set rendered = tag('p', 'para') %}{{ rendered | length }} {{ rendered | upper }}
{{ tag('missing-arg-is-undefined', body=undefined_thing) }}
""", [{}])

FEATURES["filters_string"] = ("""\
[{{ s | trim }}] [{{ s | trim('. ') }}] [{{ '  x ' | trim }}]
{{ s | upper }} {{ s | lower }} {{ 'hello wORLD-foo(bar) [x]<y>' | capitalize }} {{ 'hello wORLD-foo(bar) [x]<y> x_y' | title }}
{{ s | replace(' ', '_') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ 'abc' | replace('', '-') }}
{{ s | length }} {{ s | count }} {{ 'héllo' | length }} {{ s | wordcount }} {{ 'one, two;three_four 5' | wordcount }}
{{ 'abc' | reverse }} {{ 'hé' | center(7) }}| {{ 'x' | center(4) }}|
{{ 'line1\\nline2\\n\\nline4' | indent }}
{{ 'line1\\nline2\\n\\nline4' | indent(2, true) }}
{{ 'line1\\nline2\\n\\nline4' | indent('> ', first=true, blank=true) }}
{{ 'a <b> & "c" \\'d\\'' | e }} {{ '<safe>' | safe }} {{ 42 | string }} {{ [1, 'a'] | string }}
{{ 'The quick brown fox jumps over the lazy dog' | truncate(20) }} {{ 'short' | truncate(20) }} {{ 'The quick brown fox jumps' | truncate(12, true, '…', 0) }}
{{ '%s is %d years, %.2f%%' | format('Ann', 30, 99.5) }} {{ '%-5s|%5s|%03d' | format('a', 'b', 7) }} {{ '%(x)s' | format(x='kw') }}
{{ s | first }} {{ s | last }} {{ s | list | join('.') }}
""", [{"s": "  Hello World. "}, {"s": "x"}])

FEATURES["filters_list"] = ("""\
{{ items | length }} {{ items | first }} {{ items | last }} {{ items | join(', ') }} {{ items | join }}
{{ nums | sort }} {{ nums | sort(reverse=true) }} {{ words | sort }} {{ words | sort(case_sensitive=true) }} {{ nums | unique | list }} {{ words | unique | list }}
{{ nums | min }} {{ nums | max }} {{ words | min }} {{ words | max(case_sensitive=true) }} {{ nums | sum }} {{ nums | sum(start=10) }} {{ [0.5, 1] | sum }}
{{ nums | reverse | list }} {{ nums | batch(3) | list }} {{ nums | batch(3, 'f') | list }}
{{ people | map(attribute='name') | join('/') }} {{ people | map(attribute='age', default=0) | list }} {{ words | map('upper') | list }} {{ nums | map('string') | join }}
{{ people | selectattr('age') | map(attribute='name') | list }} {{ people | rejectattr('age') | map(attribute='name') | list }}
{{ people | selectattr('age', 'gt', 30) | map(attribute='name') | list }} {{ people | selectattr('name', 'equalto', 'bo') | list }}
{{ people | selectattr('name', 'in', ['al', 'cy']) | map(attribute='name') | list }} {{ people | sort(attribute='name', reverse=true) | map(attribute='name') | list }}
{{ nums | select('odd') | list }} {{ nums | reject('odd') | list }} {{ nums | select('divisibleby', 3) | list }} {{ [0, 1, '', 'a', none] | select | list }}
{{ d | dictsort }} {{ d | dictsort(by='value') }} {{ d | dictsort(reverse=true) }} {{ d | items | list }} {{ d | list }}
{{ people | map(attribute='meta.tag') | list }} {{ nested | map(attribute='0') | list }} {{ people | sum(attribute='age') }}
{{ items[0] }} {{ items | list | length }} {{ (items | list)[1:] }}
""", [{
    "items": ["a", "b", "c"], "nums": [3, 1, 2, 3, 6, 5], "words": ["b", "A", "a", "C"],
    "people": [{"name": "al", "age": 31, "meta": {"tag": "x"}}, {"name": "bo", "age": 0, "meta": {"tag": "y"}},
               {"name": "cy", "age": 45, "meta": {}}],
    "d": {"b": 2, "a": 3, "C": 1}, "nested": [[1, 2], [3, 4]],
}])

FEATURES["filters_number"] = ("""\
{{ '42' | int }} {{ '  -7 ' | int }} {{ '3.9' | int }} {{ 'x' | int }} {{ 'x' | int(5) }} {{ 'ff' | int(base=16) }} {{ 3.99 | int }} {{ true | int }} {{ none | int }}
{{ '1.5' | float }} {{ 2 | float }} {{ 'bad' | float }} {{ 'bad' | float(1.25) }} {{ '1e3' | float }}
{{ 2.5 | round }} {{ 3.5 | round }} {{ 2.675 | round(2) }} {{ 2.1 | round(0, 'ceil') }} {{ 2.9 | round(0, 'floor') }} {{ 7 | round }} {{ 1.23456 | round(3) }}
{{ -5 | abs }} {{ -2.5 | abs }} {{ x | default(0) }} {{ x | d('dflt') }} {{ '' | default('empty', true) }} {{ 0 | default('zero') }} {{ none | default('none-is-defined') }}
""", [{}, {"x": 9}])

FEATURES["tests"] = ("""\
{% for v in values %}
{{ v }}: {{ v is defined }} {{ v is none }} {{ v is string }} {{ v is number }} {{ v is integer }} {{ v is float }} {{ v is boolean }} {{ v is true }} {{ v is false }} {{ v is mapping }} {{ v is iterable }} {{ v is sequence }} {{ v is callable }}
{% endfor %}
{{ undefined_name is defined }} {{ undefined_name is undefined }} {{ 4 is divisibleby 2 }} {{ 4 is divisibleby(3) }} {{ 3 is odd }} {{ 3 is even }} {{ 0 is even }}
{{ 1 is eq 1 }} {{ 1 is equalto 2 }} {{ 1 is ne 2 }} {{ 2 is gt 1 }} {{ 2 is ge 2 }} {{ 1 is lt 0 }} {{ 1 is le 1 }} {{ 2 is in [1, 2] }} {{ 'a' is in 'cat' }}
{{ 'abc' is lower }} {{ 'ABC' is upper }} {{ 'aBc' is lower }} {{ none is sameas none }} {{ true is sameas true }} {{ 'upper' is filter }} {{ 'odd' is test }} {{ 'nope' is filter }}
{{ x is not defined }} {{ x is not none }} {{ range is callable }}
""", [{"values": [None, True, False, 0, 7, 1.5, "", "s", [], [1], {}, {"k": 1}], "x": 1}])

FEATURES["methods"] = ("""\
[{{ s.strip() }}] [{{ s.lstrip() }}] [{{ s.rstrip() }}] [{{ s.strip(' .H') }}] [{{ '<x>'.strip('<>') }}]
{{ s.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} {{ 'a b  c'.split(' ') }} {{ 'a,b,c'.rsplit(',', 1) }} {{ '  a  b  '.split(none, 1) }}
{{ s.upper() }} {{ s.lower() }} {{ 'hello wORLD x_y 3rd'.title() }} {{ 'hELLO'.capitalize() }} {{ 'AbC'.swapcase() }}
{{ s.startswith('  He') }} {{ s.endswith('. ') }} {{ 'x.py'.endswith(('.py', '.js')) }} {{ 'abc'.startswith('b', 1) }}
{{ s.replace('l', 'L') }} {{ s.replace('l', 'L', 1) }} {{ 'héllo wörld'.find('w') }} {{ 'abc'.find('z') }} {{ 'abcabc'.rfind('b') }} {{ 'abcabc'.count('bc') }} {{ 'abcabc'.index('c') }}
{{ '-'.join(['a', 'b']) }} {{ ', '.join(names) }} {{ 'a\\nb\\r\\nc'.splitlines() }} {{ '123'.isdigit() }} {{ 'ab1'.isalpha() }} {{ ' \\t'.isspace() }} {{ 'ab1'.isalnum() }} {{ 'abc'.islower() }} {{ 'ABC'.isupper() }}
{{ 'x'.center(5, '*') }} {{ 'x'.ljust(3, '.') }} {{ 'x'.rjust(3) }} {{ '42'.zfill(5) }} {{ 'k=v=w'.partition('=') }} {{ 'k=v=w'.rpartition('=') }}
{{ 'prefix_body'.removeprefix('prefix_') }} {{ 'body.txt'.removesuffix('.txt') }} {{ '{} and {}'.format('a', 'b') }} {{ '{0}{name}'.format(1, name='n') }}
{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 'dflt') }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.items() | list }} {{ d.copy() }}
{{ names.index('bo') }} {{ names.count('al') }} {{ d['a'] }} {{ d.a }} {{ d['items'] is defined }}
""", [{"s": "  Hello world. ", "d": {"a": 1, "b": [2]}, "names": ["al", "bo", "al"]}])

FEATURES["subscripts"] = ("""\
{{ l[0] }} {{ l[-1] }} {{ l[1:] }} {{ l[:-1] }} {{ l[::2] }} {{ l[::-1] }} {{ l[1:3] }} {{ l[5:] }} {{ l[-10:2] }} {{ l[3:1:-1] }}
{{ s[0] }} {{ s[-1] }} {{ s[1:4] }} {{ s[::-1] }} {{ s[2:] }}
[{{ l[10] }}] [{{ s[99] }}] [{{ d['missing'] }}] [{{ d.missing }}] {{ d['k'] }} {{ d.k }} {{ d['nested']['x'] }} {{ d.nested.x }} {{ d.list.0 }} {{ d['list'][1] }}
[{{ none_value.attr }}] [{{ none_value['x'] }}] {{ messages[-1].content }} {{ messages[0]['role'] }} {{ (messages | last).role }}
""", [{"l": [1, 2, 3, 4], "s": "hé中🎉x", "d": {"k": "v", "nested": {"x": 1}, "list": [7, 8]},
       "none_value": None, "messages": CONVO}])

FEATURES["tojson"] = ("""\
{{ v | tojson }}
{{ v | tojson(indent=2) }}
{{ v | tojson(indent=4, sort_keys=true) }}
{{ v | tojson(ensure_ascii=true) }}
{{ v | tojson(separators=(',', ':')) }}
{{ v | tojson(indent='\\t') }}
{{ 'plain "quoted" <tag> & \\' \\\\ / \\n\\t\\b\\f\\r \\x01' | tojson }} {{ none | tojson }} {{ 1.0 | tojson }} {{ [] | tojson(indent=2) }} {{ {} | tojson }}
""", [{"v": {"name": "get_weather", "description": "Weather for a city 🌤 — ünïcödé", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "東京"]},
                                      "days": {"type": "integer", "minimum": 1.5e-3}},
    "required": ["city"], "additionalProperties": False}, "empty": [], "n": None}}])

FEATURES["undefined"] = ("""\
[{{ nope }}] [{{ nope | default('d') }}] [{{ nope | length }}] [{{ nope | string }}] [{{ nope ~ 'x' }}] [{{ nope | join(',') }}]
[{{ nope is defined }}] [{{ not nope }}] [{{ nope == nope }}] [{{ 'x' in nope }}] [{{ nope | list }}] [{{ nope | trim }}] [{{ nope | upper }}]
[{{ d.absent }}] [{{ d['absent'] }}] [{{ d.absent is defined }}] [{{ d.absent | default('fallback') }}]
{% if nope %}truthy{% else %}falsy{% endif %} {% for x in nope %}{{ x }}{% endfor %}
""", [{"d": {}}])

FEATURES["whitespace_blocks_in_lines"] = ("""\
<|system|>
{% if system %}
{{ system }}
{% else %}
    default system
{% endif %}
<|end|>
{% for m in messages %}
  {%- if m.role == 'user' %}
  <user>{{ m.content }}</user>
  {%- elif m.role == 'assistant' -%}
  <assistant>{{ m.content }}</assistant>
  {% endif %}
{% endfor %}
  {% if add_generation_prompt %}  <assistant>{% endif %}

""", [{"system": "Be nice.", "messages": CONVO[1:], "add_generation_prompt": True},
      {"system": "", "messages": CONVO, "add_generation_prompt": False}])

FEATURES["blocks_and_formatting"] = ("""\
{% filter upper %}shout {{ name }}{% endfilter %} {% filter trim | replace('a', 'o') %}   banana   {% endfilter %}
{% with greeting = 'hi', n = 2 %}{{ greeting * n }}{% endwith %} [{{ greeting is defined }}]
{% generation %}generated {{ name }}{% endgeneration %}

{{ '%s has %d items (%.1f%%)' % (name, 3, 42.25) }} {{ '%5s|%-5s|%05d|%x|%o|%e' % ('r', 'l', 42, 255, 8, 12345.678) }} {{ '%(a)s-%(b)r' % {'a': 1, 'b': 'q'} }}
{{ '{} + {} = {}'.format(1, 2, 3) }} {{ '{0}{0}{name}'.format('x', name='y') }} {{ '{{literal}}'.format() }}
{% set pieces %}{% for i in range(3) %}<{{ i }}>{% endfor %}{% endset %}{{ pieces }} {{ pieces | length }}
""", [{"name": "Ann"}])

FEATURES["macros_advanced"] = ("""\
{%- macro visible(content) -%}
    {%- if content is string -%}
        {{ content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}{{ part.text }}{%- elif part is string -%}{{ part }}{%- endif -%}
        {%- endfor -%}
    {%- elif content is none -%}
    {%- else -%}
        {{ content }}
    {%- endif -%}
{%- endmacro -%}
{%- macro ts_type(spec, nullable=false) -%}
    {%- if spec.type == 'array' -%}
        {{ ts_type(spec['items']) if spec['items'] is defined else 'any' }}[]
    {%- elif spec.type == 'object' -%}
        {{ '{' }}{% for key, sub in (spec.properties or {}).items() %}{{ key }}{{ '' if key in (spec.required or []) else '?' }}: {{ ts_type(sub) }}{{ ', ' if not loop.last }}{% endfor %}{{ '}' }}
    {%- elif spec.enum is defined -%}
        {{ spec.enum | map('tojson') | join(' | ') }}
    {%- elif spec.type is string -%}
        {{ {'integer': 'number', 'string': 'string', 'boolean': 'boolean', 'number': 'number'}.get(spec.type, 'any') }}
    {%- elif spec.type is iterable -%}
        {{ spec.type | join(' | ') }}
    {%- else -%}
        any
    {%- endif -%}
    {{- ' | null' if nullable }}
{%- endmacro -%}
[{{ visible('plain') }}][{{ visible([{'type': 'text', 'text': 'a'}, 'b', {'type': 'image'}]) }}][{{ visible(none) }}][{{ visible(7) }}]
{% for t in tools %}
type {{ t.function.name }} = ({{ ts_type(t.function.parameters) }}) => {{ ts_type(t.function.returns | default({}), nullable=true) }};
{% endfor %}
""", [{"tools": [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}, "limit": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
        "mode": {"enum": ["fast", "deep"]}, "filters": {"type": "object", "properties": {"lang": {"type": ["string", "null"]}}}},
        "required": ["q"]}, "returns": {"type": "array", "items": {"type": "object", "properties": {"url": {"type": "string"}}}}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]}])

FEATURES["scoping"] = ("""\
{#- jinja2 resolves names per scope at compile time: a name first assigned at the top level is a
    template variable that is undefined until assigned, even inside loops that run earlier #}
{% for i in [1, 2] %}[{{ late }}:{{ early }}]{% endfor %}
{% set late = 'set late' %}{% set early = early ~ '+' %}[{{ late }}:{{ early }}]
{% for i in [1, 2] %}{% if i == 2 %}{{ carried }}{% endif %}{% set carried = i %}{% endfor %}[{{ carried }}]
{% set x = 'outer' %}{% for i in [1] %}{% if flag %}{% set x = 'inner' %}{% endif %}({{ x }}){% endfor %}({{ x }})
{% set blk %}{% set leaked = 1 %}{% endset %}{% filter upper %}{% set leaked2 = 1 %}f{% endfilter %} [{{ leaked is defined }}{{ leaked2 is defined }}]
{% macro show(v=fallback) %}{{ v }}{% endmacro %}{% set fallback = 'default from later set' %}{{ show() }}
{% for i in range(3) %}{% if i == 0 %}{% continue %}{% endif %}{{ i }}{% else %}else-after-continue-only{% endfor %}
{% for i in range(3) %}{% if i == 0 %}{% break %}{% endif %}{{ i }}{% else %}else-after-break{% endfor %}
{% for i in range(3) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% else %}not-shown{% endfor %}
{% for i in range(3) %}{% set acc %}{{ i }}{% if i == 1 %}{% break %}{% endif %}{% endset %}{{ acc }}{% endfor %}
{% for m in messages %}{% set content = m.content %}{% if m.role == 'assistant' %}{% set content = content | upper %}{% endif %}{{ content }};{% endfor %}
""", [{"early": "ctx", "late": "ctx-late", "flag": False, "messages": CONVO},
      {"early": "e", "flag": True, "messages": []}])

FEATURES["generators_and_views"] = ("""\
{{ 'yes' if messages | selectattr('role', 'equalto', 'nobody') else 'no' }} {{ 'yes' if messages | selectattr('role', 'equalto', 'nobody') | list else 'no' }}
{{ d.items() }} {{ d.keys() }} {{ d.values() }} {{ d.items() | list }} {{ (d.keys() | list)[0] }} {{ d.items() | length }}
{{ messages | map(attribute='role') | list }} {{ messages | map(attribute='role') | first }} {{ messages | map(attribute='role') | join('/') }}
{{ [3, 1, 3] | unique | list }} {{ [1, 2] | reverse | list }} {{ 'abc' | reverse }} {{ d | reverse | list }}
{{ 'user' in messages | map(attribute='role') }} {% for r in messages | map(attribute='role') | unique %}{{ loop.index }}:{{ r }}/{{ loop.length }} {% endfor %}
""", [{"messages": CONVO, "d": {"a": 1, "b": [2]}}])

# ----------------------------------------------------------------------------------------------
# Error cases: jinja2 raises while parsing or rendering; moeinfer must raise too.

ERRORS = {
    "error_raise_exception": ("""\
{% for m in messages %}
{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{{ m.content }}
{% endfor %}
""", [{"messages": CONVO[1:]}, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}]),
    "error_unknown_filter": ("{{ 'x' | no_such_filter }}\n", [{}]),
    "error_unknown_filter_in_if": ("{% if flag %}{{ 'x' | no_such_filter }}{% endif %}ok\n",
                                   [{"flag": False}, {"flag": True}]),
    "error_unknown_test": ("{{ 1 is no_such_test }}\n", [{}]),
    "error_unclosed_block": ("{% for x in y %}\nbody\n", [{}]),
    "error_bad_expression": ("line one\n{{ 1 + }}\n", [{}]),
    "error_unknown_tag": ("{% frobnicate %}\n", [{}]),
    "error_unbalanced_end": ("{% if true %}x{% endfor %}\n", [{}]),
    "error_undefined_attribute": ("{{ nope.attr }}\n", [{}]),
    "error_undefined_call": ("{{ nope() }}\n", [{}]),
    "error_undefined_arithmetic": ("{{ nope + 1 }}\n", [{}]),
    "error_type_mismatch": ("{{ 'a' + 1 }}\n", [{}]),
    "error_division_by_zero": ("{{ 1 / 0 }}\n", [{}]),
    "error_list_append": ("{% set l = [] %}{% set _ = l.append(1) %}{{ l }}\n", [{}]),
    "error_none_iteration": ("{% for x in v %}{{ x }}{% endfor %}\n", [{"v": None}]),
    "error_namespace_underscore": ("{% set ns = namespace() %}{% set ns._x = 1 %}\n", [{}]),
    "error_tojson_undefined": ("{{ nope | tojson }}\n", [{}]),
    "error_compare_types": ("{{ 1 < 'a' }}\n", [{}]),
    "error_generator_length": ("{{ messages | selectattr('role', 'equalto', 'user') | length }}\n",
                               [{"messages": CONVO}]),
    "error_slice_dict": ("{{ d[1:] }}\n", [{"d": {"a": 1}}]),
}

# ----------------------------------------------------------------------------------------------
# Full chat templates in the style of published ones (written for these tests).

# Each of these is an original template that uses the constructs the named family's published
# template relies on (ChatML turns, tool schemas through tojson, <think> splitting, namespace
# counters, role-alternation checks, special-token variables), not a copy of it.

CHAT_QWEN3_STYLE = """\
{#- ChatML turns; tools listed in the system turn; reasoning kept only after the last real query #}
{%- set ns = namespace(query_at=(messages | length) - 1, still_tools=true) %}
{%- for m in messages[::-1] %}
    {%- set at = (messages | length) - loop.index %}
    {%- if ns.still_tools and m.role == 'user' and m.content is string %}
        {%- if not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
            {%- set ns.still_tools = false %}
            {%- set ns.query_at = at %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools or has_system %}
    {{- '<|im_start|>system\\n' }}
    {%- if has_system %}
        {{- messages[0].content }}
        {%- if tools %}{{- '\\n\\n' }}{% endif %}
    {%- endif %}
    {%- if tools %}
        {{- '# Available functions\\n<tools>' }}
        {%- for t in tools %}
            {{- '\\n' ~ (t | tojson) }}
        {%- endfor %}
        {{- '\\n</tools>\\nCall one with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.' }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' ~ m.role ~ '\\n' ~ text ~ '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set thought = m.reasoning_content if m.reasoning_content is string else '' %}
        {%- if not thought and '</think>' in text %}
            {%- set parts = text.split('</think>') %}
            {%- set thought = parts[0].split('<think>')[-1].strip('\\n') %}
            {%- set text = parts[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.query_at and (loop.last or thought) %}
            {{- '<think>\\n' ~ thought.strip('\\n') ~ '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- text.lstrip('\\n') }}
        {%- for call in m.tool_calls | default([]) %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if text or not loop.first %}{{- '\\n' }}{% endif %}
            {{- '<tool_call>\\n{"name": "' ~ fn.name ~ '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- set prev_tool = not loop.first and messages[loop.index0 - 1].role == 'tool' %}
        {%- set next_tool = not loop.last and messages[loop.index0 + 1].role == 'tool' %}
        {%- if not prev_tool %}{{- '<|im_start|>user' }}{% endif %}
        {{- '\\n<tool_response>\\n' ~ text ~ '\\n</tool_response>' }}
        {%- if not next_tool %}{{- '<|im_end|>\\n' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

CHAT_LLAMA3_STYLE = """\
{#- Header-id turns; the date comes from the caller or from strftime_now #}
{{- bos_token }}
{%- set today = date_string if date_string is defined else strftime_now('%d %b %Y') %}
{%- set tools_first_user = tools_in_user_message if tools_in_user_message is defined else true %}
{%- if messages[0]['role'] == 'system' %}
    {%- set sys_text = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set sys_text = '' %}
    {%- set turns = messages %}
{%- endif %}
{%- macro header(role) %}{{ '<|start_header_id|>' ~ role ~ '<|end_header_id|>\\n\\n' }}{% endmacro %}
{%- macro tool_list() %}
{%- for t in tools %}
{{ t | tojson(indent=4) }}

{% endfor %}
{%- endmacro %}
{{- header('system') }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{% endif %}
{{- 'Knowledge cutoff: 2023-12\\nToday: ' ~ today ~ '\\n\\n' }}
{%- if tools is not none and not tools_first_user %}
    {{- 'Functions you may call:\\n\\n' ~ tool_list() }}
{%- endif %}
{{- sys_text ~ '<|eot_id|>' }}
{%- if tools is not none and tools_first_user %}
    {%- if turns | length == 0 %}
        {{- raise_exception('tools_in_user_message needs a first user message') }}
    {%- endif %}
    {{- header('user') ~ 'Answer with a JSON function call if one helps.\\n\\n' ~ tool_list() }}
    {{- turns[0]['content'] | trim ~ '<|eot_id|>' }}
    {%- set turns = turns[1:] %}
{%- endif %}
{%- for m in turns %}
    {%- if m.role in ['tool', 'ipython'] %}
        {{- header('ipython') }}
        {{- m.content | tojson if m.content is mapping or (m.content is iterable and m.content is not string) else m.content }}
        {{- '<|eot_id|>' }}
    {%- elif 'tool_calls' in m %}
        {%- if m.tool_calls | length != 1 %}
            {{- raise_exception('one tool call per turn, got ' ~ m.tool_calls | length) }}
        {%- endif %}
        {%- set f = m.tool_calls[0].function %}
        {{- header('assistant') ~ '{"name": "' ~ f.name ~ '", "parameters": ' ~ f.arguments | tojson ~ '}<|eot_id|>' }}
    {%- else %}
        {{- header(m['role']) ~ m['content'] | trim ~ '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- header('assistant') }}{% endif %}
"""

CHAT_MISTRAL_STYLE = """\
{#- [INST] turns; tool schemas before the last user turn; 9-character tool call ids #}
{%- set sys = messages[0].content if messages[0].role == 'system' else none %}
{%- set turns = messages[1:] if sys is not none else messages %}
{%- set last_user = turns | selectattr('role', 'eq', 'user') | list | last %}
{{- bos_token }}
{%- for m in turns %}
    {%- if m.role == 'user' %}
        {%- if tools and m == last_user %}
            {{- '[AVAILABLE_TOOLS] [' }}
            {%- for t in tools %}
                {%- set fields = [] %}
                {%- for key, val in t.function.items() if key != 'return' %}
                    {%- set fields = fields + ['"' ~ key ~ '": ' ~ (('"' ~ val ~ '"') if val is string else val | tojson)] %}
                {%- endfor %}
                {{- '{"type": "function", "function": {' ~ fields | join(', ') ~ '}}' }}
                {{- ', ' if not loop.last else ']' }}
            {%- endfor %}
            {{- '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST] ' ~ ((sys ~ '\\n\\n') if loop.last and sys is not none else '') ~ m.content ~ '[/INST]' }}
    {%- elif m.role == 'assistant' and m.tool_calls is defined %}
        {{- '[TOOL_CALLS] [' }}
        {%- for c in m.tool_calls %}
            {%- if c.id is not defined or c.id | length != 9 %}
                {{- raise_exception('tool call ids must be 9 characters: ' ~ c.id | default('missing')) }}
            {%- endif %}
            {{- (c.function | tojson)[:-1] ~ ', "id": "' ~ c.id ~ '"}' }}
            {{- ', ' if not loop.last else ']' ~ eos_token }}
        {%- endfor %}
    {%- elif m.role == 'assistant' %}
        {{- ' ' ~ m.content | trim ~ eos_token }}
    {%- elif m.role in ('tool', 'tool_results') %}
        {%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}
            {{- raise_exception('tool results need a 9-character tool_call_id') }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' ~ m.content | string ~ ', "call_id": "' ~ m.tool_call_id ~ '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('unsupported role: ' ~ m.role) }}
    {%- endif %}
{%- endfor %}
"""

CHAT_MIXTRAL_STYLE = """\
{{ bos_token }}{% for m in messages %}{% set expect_user = loop.index is odd %}{% if (m.role == 'user') != expect_user %}{{ raise_exception('roles must go user, assistant, user, ... (message ' ~ loop.index ~ ' is ' ~ m.role ~ ')') }}{% endif %}{% if m.role == 'user' %}{{ '[INST] ' ~ m.content ~ ' [/INST]' }}{% elif m.role == 'assistant' %}{{ m.content ~ eos_token }}{% else %}{{ raise_exception('only user and assistant turns') }}{% endif %}{% endfor %}"""

CHAT_DEEPSEEK_STYLE = """\
{%- set ns = namespace(system='', in_tools=false, first_output=true, first_call=true) %}
{%- for m in messages | selectattr('role', 'equalto', 'system') %}
    {%- set ns.system = ns.system ~ ('\\n\\n' if not loop.first else '') ~ m.content %}
{%- endfor %}
{{- bos_token ~ ns.system }}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {%- set ns.in_tools = false %}
        {{- '<｜User｜>' ~ m.content }}
    {%- elif m.role == 'assistant' and m.tool_calls is defined %}
        {%- set ns.in_tools = false %}
        {{- '<｜Assistant｜>' ~ (m.content | default('', true)) ~ '<｜tool▁calls▁begin｜>' }}
        {%- for c in m.tool_calls %}
            {%- set args = c.function.arguments if c.function.arguments is string else c.function.arguments | tojson %}
            {{- '\\n' if not loop.first }}
            {{- '<｜tool▁call▁begin｜>' ~ c.type ~ '<｜tool▁sep｜>' ~ c.function.name ~ '\\n```json\\n' ~ args ~ '\\n```<｜tool▁call▁end｜>' }}
        {%- endfor %}
        {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
    {%- elif m.role == 'assistant' %}
        {%- set answer = m.content.split('</think>') | last if '</think>' in m.content else m.content %}
        {%- if ns.in_tools %}
            {{- '<｜tool▁outputs▁end｜>' ~ answer ~ '<｜end▁of▁sentence｜>' }}
            {%- set ns.in_tools = false %}
        {%- else %}
            {{- '<｜Assistant｜>' ~ answer ~ '<｜end▁of▁sentence｜>' }}
        {%- endif %}
    {%- elif m.role == 'tool' %}
        {{- '<｜tool▁outputs▁begin｜>' if not ns.in_tools }}
        {%- set ns.in_tools = true %}
        {{- '<｜tool▁output▁begin｜>' ~ m.content ~ '<｜tool▁output▁end｜>' }}
    {%- endif %}
{%- endfor %}
{%- if ns.in_tools %}{{- '<｜tool▁outputs▁end｜>' }}{% endif %}
{%- if add_generation_prompt and not ns.in_tools %}{{- '<｜Assistant｜><think>\\n' }}{% endif %}
"""

CHAT_GEMMA_STYLE = """\
{{ bos_token }}
{%- set first = messages[0] -%}
{%- if first.role == 'system' -%}
    {%- set prefix = (first.content if first.content is string else first.content[0].text) ~ '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
    {%- if (m.role == 'user') != loop.index0 is even -%}
        {{ raise_exception('user and assistant turns must alternate') }}
    {%- endif -%}
    {{ '<start_of_turn>' ~ ('model' if m.role == 'assistant' else m.role) ~ '\\n' ~ (prefix if loop.first else '') }}
    {%- if m.content is string -%}
        {{ m.content | trim }}
    {%- elif m.content is iterable -%}
        {%- for part in m.content -%}
            {{ '<start_of_image>' if part.type == 'image' else (part.text | trim if part.type == 'text' else '') }}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception('content must be a string or a list of parts') }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

CHAT_PHI_STYLE = """\
{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] and (m.role != 'system' or m.content) %}{{ '<|' ~ m.role ~ '|>\\n' ~ m.content ~ '<|end|>\\n' }}{% endif %}{% endfor %}{{ '<|assistant|>\\n' if add_generation_prompt else eos_token }}"""

CHAT_OLMOE_STYLE = """\
{{ bos_token }}
{% for m in messages %}
{% if m.role == 'assistant' %}
<|assistant|>
{{ m.content ~ eos_token }}
{% else %}
<|{{ m.role }}|>
{{ m.content }}
{% endif %}
{% if loop.last and add_generation_prompt %}
<|assistant|>
{% endif %}
{% endfor %}"""

CHAT_HARMONY_STYLE = """\
{#- Channel-tagged turns; tool schemas rendered as TypeScript by a recursive macro #}
{%- macro ts(spec) -%}
    {%- if spec.type == 'array' -%}{{ ts(spec['items'] | default({})) }}[]
    {%- elif spec.type == 'object' and spec.properties is defined -%}
        {{- '{ ' }}{% for k, v in spec.properties.items() %}{{ k ~ ('' if k in (spec.required or []) else '?') ~ ': ' ~ ts(v) }}{{ '; ' if not loop.last }}{% endfor %}{{ ' }' }}
    {%- elif spec.enum is defined -%}{{ spec.enum | map('tojson') | join(' | ') }}
    {%- elif spec.type in ['integer', 'number'] -%}number
    {%- elif spec.type is defined -%}{{ spec.type }}
    {%- else -%}any
    {%- endif -%}
{%- endmacro -%}
{%- set effort = reasoning_effort | default('medium') %}
{%- set today = current_date if current_date is defined else strftime_now('%Y-%m-%d') %}
{{- '<|start|>system<|message|>Knowledge cutoff: 2024-06\nCurrent date: ' ~ today ~ '\n\nReasoning: ' ~ effort ~ '<|end|>' }}
{%- set first = messages[0] if messages else {} %}
{%- set turns = messages[1:] if first.role in ['system', 'developer'] else messages %}
{%- if first.role in ['system', 'developer'] or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if first.role in ['system', 'developer'] %}{{- '# Instructions\n\n' ~ first.content ~ '\n\n' }}{% endif %}
    {%- if tools %}
        {{- '# Tools\n\nnamespace functions {\n' }}
        {%- for t in tools %}
            {%- set f = t.function if t.function is defined else t %}
            {{- '\n// ' ~ f.description | default('') ~ '\ntype ' ~ f.name ~ ' = (_: ' ~ ts(f.parameters | default({})) ~ ') => any;\n' }}
        {%- endfor %}
        {{- '\n} // namespace functions' }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- set last = namespace(tool=none, final_seen=false) %}
{%- for m in turns %}
    {%- if m.role == 'assistant' %}
        {%- set later = turns[loop.index0 + 1:] | selectattr('role', 'equalto', 'user') | list %}
        {%- if m.thinking is defined and m.thinking and not later %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' ~ m.thinking ~ '<|end|>' }}
        {%- endif %}
        {%- if m.tool_calls is defined and m.tool_calls %}
            {%- set call = m.tool_calls[0].function %}
            {{- '<|start|>assistant to=functions.' ~ call.name ~ '<|channel|>commentary json<|message|>' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '<|call|>' }}
            {%- set last.tool = call.name %}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' ~ (m.content | default('')) ~ ('<|return|>' if loop.last else '<|end|>') }}
            {%- set last.final_seen = true %}
        {%- endif %}
    {%- elif m.role == 'tool' %}
        {%- if last.tool is none %}
            {{- raise_exception('a tool result needs an earlier tool call') }}
        {%- endif %}
        {{- '<|start|>functions.' ~ last.tool ~ ' to=assistant<|channel|>commentary<|message|>' ~ m.content | default('') | tojson ~ '<|end|>' }}
    {%- elif m.role == 'user' %}
        {{- '<|start|>user<|message|>' ~ m.content | default('') ~ '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{% endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city — °C",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    "return": {"type": "string"}}}

TOOL_CONVO = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in 東京?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call12345", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call12345", "content": "{\"temp\": 21.5}"},
    {"role": "assistant", "content": "<think>\nIt is mild.\n</think>\n\nIt is 21.5 °C in 東京."},
    {"role": "user", "content": "Thanks! 🙏"},
]

THINK_CONVO = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them.", "thinking": "Add them."},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "<think>\nsix\n</think>\n\n6"},
]

STRING_ARGS_CONVO = [
    {"role": "user", "content": "Find cats"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "abcdefghi", "type": "function",
                     "function": {"name": "search", "arguments": "{\"q\": \"cats\"}"}},
                    {"id": "jklmnopqr", "type": "function",
                     "function": {"name": "search", "arguments": "{\"q\": \"dogs\"}"}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "cats: many"},
    {"role": "tool", "tool_call_id": "jklmnopqr", "content": "dogs: some"},
]


def chat_contexts(convos, tools_options=(None,), extra=None):
    out = []
    for convo in convos:
        for tools in tools_options:
            for agp in (True, False):
                ctx = {"messages": convo, "tools": tools, "add_generation_prompt": agp,
                       "bos_token": "<s>", "eos_token": "</s>"}
                ctx.update(extra or {})
                out.append(ctx)
    return out


ALTERNATING = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
               {"role": "user", "content": "Bye ✋"}]
WITH_SYSTEM = [{"role": "system", "content": "  Sys prompt.  "}] + ALTERNATING

CHATS = {
    "chat_qwen3_style": (CHAT_QWEN3_STYLE,
                         chat_contexts([WITH_SYSTEM, TOOL_CONVO, THINK_CONVO], (None, [WEATHER_TOOL, SEARCH_TOOL]))
                         + chat_contexts([THINK_CONVO], extra={"enable_thinking": False})),
    "chat_llama3_style": (CHAT_LLAMA3_STYLE,
                          chat_contexts([WITH_SYSTEM, ALTERNATING], (None, [WEATHER_TOOL]), {"date_string": "01 Jan 2025"})
                          + chat_contexts([TOOL_CONVO[:4]], ([WEATHER_TOOL],), {"date_string": "02 Feb 2025",
                                                                               "tools_in_user_message": False})),
    "chat_mistral_style": (CHAT_MISTRAL_STYLE,
                           chat_contexts([WITH_SYSTEM, ALTERNATING, STRING_ARGS_CONVO], (None, [SEARCH_TOOL]))
                           + chat_contexts([TOOL_CONVO])),
    "chat_mixtral_style": (CHAT_MIXTRAL_STYLE, chat_contexts([ALTERNATING, WITH_SYSTEM])),
    "chat_deepseek_style": (CHAT_DEEPSEEK_STYLE, chat_contexts([WITH_SYSTEM, STRING_ARGS_CONVO, THINK_CONVO,
                                                                TOOL_CONVO])),
    "chat_gemma_style": (CHAT_GEMMA_STYLE, chat_contexts([WITH_SYSTEM, ALTERNATING, [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe. "}]}]])),
    "chat_phi_style": (CHAT_PHI_STYLE, chat_contexts([WITH_SYSTEM, [{"role": "system", "content": ""}] + ALTERNATING])),
    "chat_olmoe_style": (CHAT_OLMOE_STYLE, chat_contexts([WITH_SYSTEM, ALTERNATING])),
    "chat_harmony_style": (CHAT_HARMONY_STYLE,
                           chat_contexts([WITH_SYSTEM, TOOL_CONVO, THINK_CONVO], (None, [WEATHER_TOOL, SEARCH_TOOL]),
                                         {"current_date": "2025-08-05"})
                           + chat_contexts([[{"role": "developer", "content": "Be brief."}] + ALTERNATING],
                                           extra={"current_date": "2025-08-06", "reasoning_effort": "high"})),
}


def all_templates():
    out = {}
    out.update(FEATURES)
    out.update(ERRORS)
    out.update(CHATS)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "templates"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = make_environment()
    num_cases = 0
    for name, (source, contexts) in sorted(all_templates().items()):
        cases = []
        for ctx in contexts:
            ctx = json.loads(json.dumps(ctx))  # exactly what the JSON file will hold
            case = {"context": ctx}
            case.update(render(env, source, ctx))
            cases.append(case)
        if name.startswith("error_"):
            assert any("error" in c for c in cases), f"{name}: jinja2 raised nothing"
        elif name.startswith("chat_"):
            assert any("output" in c for c in cases), f"{name}: {[c.get('error') for c in cases]}"
        else:
            assert all("output" in c for c in cases), f"{name}: {[c.get('error') for c in cases]}"
        with open(os.path.join(args.out, name + ".jinja"), "w", encoding="utf-8", newline="") as f:
            f.write(source)
        with open(os.path.join(args.out, name + ".cases.json"), "w", encoding="utf-8") as f:
            json.dump(cases, f, ensure_ascii=False, indent=1)
            f.write("\n")
        num_cases += len(cases)
    print(f"wrote {len(all_templates())} templates, {num_cases} cases to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
