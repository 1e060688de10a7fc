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
  const proc = spawn(args.bin, ['serve', '--model', args.model, '--tokenizer', args.tokenizer, '--port', '0', ...extra],
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
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    const c = chunk.choices[0];
    if (!c) continue;
    text += c.delta?.content ?? c.text ?? '';
    if (c.finish_reason) finish = c.finish_reason;
  }
  return { text, finish, usage, chunks };
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

test('bad requests get the right 4xx', async ({ url, client }) => {
  await expectStatus(client.completions.create({ model: 'no-such-model', prompt: 'a' }), 404);
  await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', max_tokens: 100000 }), 400);
  await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', temperature: 'hot' }), 400);
  await expectStatus(client.completions.create({ model: MODEL, prompt: 'a', n: 2 }), 400);
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
                                 '--vocab-size', '512', '--output-file', out], { encoding: 'utf8', timeout: 60000 });
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /Serving Benchmark Result/);
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
test('serve flags: --geometry needs dummy weights and --tokenizer', async () => {
  const serve = (...flags) => spawnSync(args.bin, ['serve', '--port', '0', ...flags], { encoding: 'utf8', timeout: 30000 });
  const cases = [[[], '--model'],
                 [['--geometry', 'qwen3-30b-a3b'], '--load-format'],
                 [['--geometry', 'qwen3-30b-a3b', '--load-format', 'dummy'], '--tokenizer'],
                 [['--geometry', 'qwen3-30b-a3b', '--model', args.model, '--load-format', 'dummy'], '--geometry'],
                 [['--geometry', 'qwen3-30b-a3b', '--load-format', 'dummy', '--tokenizer', args.tokenizer], '--load-format'],
                 [['--geometry', 'no-such-model', '--load-format', 'dummy', '--tokenizer', args.tokenizer, '--backend', 'cuda'],
                  '--geometry']];
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
