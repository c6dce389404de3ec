// TTSClient message handling and reconnect/resume bookkeeping against a scripted fake server.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { TTSClient } from '../src/client.js';
import { FLAG_LAST, FLAG_SEGMENT_START, packFrame } from '../src/protocol.js';

const HELLO = {
  type: 'hello',
  protocol: 1,
  server: 'fake',
  sample_rate: 24000,
  sample_rates: [16000, 24000, 48000],
  formats: ['pcm16', 'f32', 'opus', 'ogg'],
  voices: ['default'],
  max_text_chars: 2000,
  max_streams: 4,
  resume_ttl_s: 30,
};

const tick = () => new Promise((resolve) => setTimeout(resolve, 0));
/** Wait until `predicate()` holds (timers of the client run meanwhile). */
async function until(predicate, ms = 2000) {
  const end = Date.now() + ms;
  while (!predicate()) {
    if (Date.now() > end) throw new Error('condition not reached');
    await new Promise((resolve) => setTimeout(resolve, 2));
  }
}

/** A WebSocket stand-in the test plays the server through. */
class FakeSocket {
  /** @type {FakeSocket[]} */
  static all = [];
  /** @param {string} url */
  constructor(url) {
    this.url = url;
    /** @type {any[]} */
    this.sent = [];
    this.closed = null;
    this.binaryType = 'blob';
    /** @type {((e: any) => void) | null} */
    this.onmessage = null;
    /** @type {((e: any) => void) | null} */
    this.onclose = null;
    this.onerror = null;
    FakeSocket.all.push(this);
  }

  /** @param {string} data */
  send(data) {
    if (this.closed) throw new Error('send on a closed socket');
    this.sent.push(JSON.parse(data));
  }

  close(code = 1000, reason = '') {
    if (this.closed) return;
    this.closed = { code, reason };
    setTimeout(() => this.onclose?.({ code, reason }), 0);
  }

  // --- the test's side ---
  /** @param {Record<string, any>} msg */
  json(msg) {
    this.onmessage?.({ data: JSON.stringify(msg) });
  }

  /** Send a pcm16 frame whose samples are seq·1000 + i. */
  frame({ slot = 0, seq, n = 4, flags = 0 }) {
    const pcm = Int16Array.from({ length: n }, (_, i) => seq * 10 + i);
    const data = packFrame({ flags, slot, seq, sample: seq * 4 }, new Uint8Array(pcm.buffer));
    this.onmessage?.({ data: data.buffer });
  }

  /** The network goes away (no close handshake). */
  drop(code = 1006) {
    this.closed = { code, reason: '' };
    this.onclose?.({ code, reason: '' });
  }
}

/** Audio backend recording what each stream's player got. */
function fakeAudio({ opus = false } = {}) {
  const players = [];
  const decoders = [];
  return {
    players,
    decoders,
    prepare() {},
    opusSupported: async () => opus,
    createPlayer(options) {
      const player = {
        options,
        samples: [],
        ended: false,
        stopped: false,
        push(s) {
          player.samples.push(...s);
        },
        end() {
          player.ended = true;
          setTimeout(() => options.onEvent({ type: 'ended', played: player.samples.length, buffered: 0, underruns: 0 }), 0);
        },
        stop() {
          player.stopped = true;
        },
        thresholds: [],
        setStartThreshold(ms) {
          player.thresholds.push(ms);
        },
        close() {},
      };
      players.push(player);
      return player;
    },
    createOpusDecoder(options) {
      const decoder = {
        frames: [],
        endedWith: null,
        push(frame) {
          decoder.frames.push(frame.seq);
          options.onSamples(Float32Array.from([frame.seq]));
        },
        async end(total) {
          decoder.endedWith = total;
        },
        close() {},
      };
      decoders.push(decoder);
      return decoder;
    },
  };
}

function makeClient(audio = fakeAudio(), extra = {}) {
  FakeSocket.all = [];
  const client = new TTSClient({
    url: 'http://tts.test:8080',
    WebSocket: /** @type {any} */ (FakeSocket),
    audio: /** @type {any} */ (audio),
    reconnect: { initialMs: 1, maxMs: 5, jitter: 0 },
    ...extra,
  });
  return { client, audio };
}

const pcmValues = (seqs, n = 4) => seqs.flatMap((seq) => Array.from({ length: n }, (_, i) => Math.fround((seq * 10 + i) / 32768)));

test('speak: start after hello, frames routed by slot, done then played out', async () => {
  const { client, audio } = makeClient();
  const stream = client.speak('Hello.', { format: 'pcm16', seed: 1, id: 'a', voice: 'default' });
  const events = [];
  for (const type of ['started', 'segment', 'audio', 'done', 'ended']) stream.on(type, (e) => events.push(type));
  const ws = FakeSocket.all[0];
  assert.equal(ws.url, 'ws://tts.test:8080/v1/stream');
  assert.equal(ws.binaryType, 'arraybuffer');
  await tick();
  assert.deepEqual(ws.sent, []); // nothing before hello
  ws.json(HELLO);
  await until(() => ws.sent.length === 1);
  assert.deepEqual(ws.sent[0], { type: 'start', id: 'a', text: 'Hello.', voice: 'default', format: 'pcm16', sample_rate: 24000, seed: 1, frame_ms: 60 });
  ws.json({ type: 'started', id: 'a', slot: 2, stream: 'tok', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws.json({ type: 'segment', id: 'a', slot: 2, seq: 0, sample: 0, text: 'Hello.' });
  ws.frame({ slot: 2, seq: 0, flags: FLAG_SEGMENT_START });
  ws.frame({ slot: 7, seq: 0 }); // another slot: not this stream's
  ws.frame({ slot: 2, seq: 1 });
  ws.frame({ slot: 2, seq: 2, flags: FLAG_LAST });
  ws.json({ type: 'done', id: 'a', slot: 2, reason: 'complete', last_seq: 2, samples: 12 });
  const result = await stream.finished;
  assert.equal(result.reason, 'complete');
  assert.deepEqual(audio.players[0].samples, pcmValues([0, 1, 2]));
  assert.equal(audio.players[0].ended, true);
  assert.deepEqual(events, ['started', 'segment', 'audio', 'audio', 'audio', 'done', 'ended']);
  assert.equal(stream.metrics.framesReceived, 3);
  assert.ok(stream.metrics.timeToFirstFrameMs >= 0);
  client.close();
});

test('a lost connection reconnects with ?resume= and resumes after the last contiguous seq', async () => {
  const { client, audio } = makeClient();
  const stream = client.speak('Long text.', { format: 'pcm16', id: 'a' });
  const seen = [];
  for (const type of ['reconnecting', 'resumed', 'segment']) stream.on(type, (e) => seen.push([type, e]));
  const ws1 = FakeSocket.all[0];
  ws1.json(HELLO);
  await until(() => ws1.sent.length === 1);
  ws1.json({ type: 'started', id: 'a', slot: 0, stream: 'tok/1', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws1.json({ type: 'segment', id: 'a', slot: 0, seq: 0, sample: 0, text: 'Long text.' });
  for (const seq of [0, 1, 2]) ws1.frame({ seq });
  ws1.drop();
  assert.equal(stream.phase, 'detached');
  await until(() => FakeSocket.all.length === 2);
  const ws2 = FakeSocket.all[1];
  assert.equal(ws2.url, 'ws://tts.test:8080/v1/stream?resume=tok%2F1');
  ws2.json(HELLO);
  await until(() => ws2.sent.length === 1);
  assert.deepEqual(ws2.sent[0], { type: 'resume', stream: 'tok/1', after_seq: 2 });
  ws2.json({ type: 'resumed', id: 'a', slot: 1, stream: 'tok/1', after_seq: 2, format: 'pcm16', sample_rate: 24000 });
  ws2.json({ type: 'segment', id: 'a', slot: 1, seq: 0, sample: 0, text: 'Long text.' }); // a replay
  ws2.frame({ slot: 1, seq: 2 }); // a duplicate (a server may replay): dropped
  ws2.frame({ slot: 1, seq: 3 });
  ws2.frame({ slot: 1, seq: 4, flags: FLAG_LAST });
  ws2.json({ type: 'done', id: 'a', slot: 1, reason: 'complete', last_seq: 4, samples: 20 });
  assert.equal((await stream.finished).reason, 'complete');
  assert.deepEqual(audio.players[0].samples, pcmValues([0, 1, 2, 3, 4])); // one player, no gap, no repeat
  assert.equal(audio.players.length, 1);
  assert.equal(stream.metrics.reconnects, 1);
  assert.equal(stream.state.duplicates, 1);
  assert.deepEqual(seen.map(([t]) => t), ['segment', 'reconnecting', 'resumed']); // the replayed mark is not repeated
  assert.equal(seen[1][1].attempt, 1);
  assert.deepEqual(seen[2][1], { afterSeq: 2 });
  client.close();
});

test('a resume carries the start request, the seed and the segment; a regenerated stream\'s new token is kept', async () => {
  const { client } = makeClient();
  const stream = client.speak('One. Two.', { format: 'pcm16', id: 'a' });
  const degraded = [];
  stream.on('degraded', (e) => degraded.push(e.reason));
  const ws1 = FakeSocket.all[0];
  ws1.json(HELLO);
  await until(() => ws1.sent.length === 1);
  assert.equal(ws1.sent[0].seed, undefined); // none asked: the server picks one
  ws1.json({ type: 'started', id: 'a', slot: 0, stream: 't1', format: 'pcm16', sample_rate: 24000, frame_ms: 20, seed: 4242 });
  ws1.json({ type: 'segment', id: 'a', slot: 0, seq: 0, sample: 0, text: 'One.', index: 0 });
  for (const seq of [0, 1, 2]) ws1.frame({ seq });
  ws1.json({ type: 'segment', id: 'a', slot: 0, seq: 3, sample: 1500, text: 'Two.', index: 1 });
  ws1.frame({ seq: 3 });
  ws1.drop();
  await until(() => FakeSocket.all.length === 2);
  const ws2 = FakeSocket.all[1];
  ws2.json(HELLO);
  await until(() => ws2.sent.length === 1);
  assert.deepEqual(ws2.sent[0], {
    type: 'resume',
    stream: 't1',
    after_seq: 3,
    request: { type: 'start', id: 'a', text: 'One. Two.', format: 'pcm16', sample_rate: 24000, seed: 4242, frame_ms: 60 },
    segment: 1,
    segment_sample: 1500,
  });
  // Another replica regenerated it: it says the audio may differ, and gives it a token of its own.
  ws2.json({ type: 'resume_degraded', id: 'a', stream: 't1', reason: 'another engine' });
  ws2.json({ type: 'resumed', id: 'a', slot: 0, stream: 't2', after_seq: 3, format: 'pcm16', sample_rate: 24000 });
  ws2.frame({ seq: 4 });
  ws2.drop();
  await until(() => FakeSocket.all.length === 3);
  const ws3 = FakeSocket.all[2];
  assert.equal(ws3.url, 'ws://tts.test:8080/v1/stream?resume=t2');
  ws3.json(HELLO);
  await until(() => ws3.sent.length === 1);
  assert.equal(ws3.sent[0].stream, 't2');
  assert.equal(ws3.sent[0].after_seq, 4);
  assert.deepEqual(degraded, ['another engine']);
  client.close();
});

test('a gap in seq drops the connection and resumes from before it', async () => {
  const { client, audio } = makeClient();
  const errors = [];
  client.on('error', (e) => errors.push(e.code));
  const stream = client.speak('x', { format: 'pcm16', id: 'a' });
  const ws1 = FakeSocket.all[0];
  ws1.json(HELLO);
  await until(() => ws1.sent.length === 1);
  ws1.json({ type: 'started', id: 'a', slot: 0, stream: 'tok', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws1.frame({ seq: 0 });
  ws1.frame({ seq: 2 }); // seq 1 missing
  assert.deepEqual(errors, ['protocol']);
  assert.equal(ws1.closed.code, 4002);
  await until(() => FakeSocket.all.length === 2);
  const ws2 = FakeSocket.all[1];
  ws2.json(HELLO);
  await until(() => ws2.sent.length === 1);
  assert.deepEqual(ws2.sent[0], { type: 'resume', stream: 'tok', after_seq: 0 });
  ws2.json({ type: 'resumed', id: 'a', slot: 0, stream: 'tok', after_seq: 0, format: 'pcm16', sample_rate: 24000 });
  ws2.frame({ seq: 1, flags: FLAG_LAST });
  ws2.json({ type: 'done', id: 'a', slot: 0, reason: 'complete', last_seq: 1, samples: 8 });
  await stream.finished;
  assert.deepEqual(audio.players[0].samples, pcmValues([0, 1]));
  client.close();
});

test('resume errors carry no id: they go to the resumes in the order sent', async () => {
  const { client } = makeClient();
  const a = client.speak('a', { format: 'pcm16', id: 'a' });
  const b = client.speak('b', { format: 'pcm16', id: 'b' });
  const ws1 = FakeSocket.all[0];
  ws1.json(HELLO);
  await until(() => ws1.sent.length === 2);
  ws1.json({ type: 'started', id: 'a', slot: 0, stream: 'ta', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws1.json({ type: 'started', id: 'b', slot: 1, stream: 'tb', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws1.frame({ slot: 1, seq: 0 });
  ws1.drop();
  await until(() => FakeSocket.all.length === 2);
  const ws2 = FakeSocket.all[1];
  assert.equal(ws2.url, 'ws://tts.test:8080/v1/stream?resume=ta');
  ws2.json(HELLO);
  await until(() => ws2.sent.length === 2);
  assert.deepEqual(ws2.sent, [
    { type: 'resume', stream: 'ta', after_seq: -1 },
    { type: 'resume', stream: 'tb', after_seq: 0 },
  ]);
  const errors = [];
  a.on('error', (e) => errors.push(['a', e.code]));
  b.on('error', (e) => errors.push(['b', e.code]));
  ws2.json({ type: 'error', code: 'unknown_stream', message: 'no stream with this token is held here' });
  ws2.json({ type: 'resumed', id: 'b', slot: 0, stream: 'tb', after_seq: 0, format: 'pcm16', sample_rate: 24000 });
  assert.equal((await a.finished).reason, 'error');
  assert.deepEqual(errors, [['a', 'unknown_stream']]);
  assert.equal(b.phase, 'live');
  client.close();
});

test('a stream the server never acknowledged is started again on the new connection', async () => {
  const { client } = makeClient();
  client.speak('x', { format: 'f32', sampleRate: 16000, id: 'a' });
  const ws1 = FakeSocket.all[0];
  ws1.json(HELLO);
  await until(() => ws1.sent.length === 1);
  ws1.drop();
  await until(() => FakeSocket.all.length === 2);
  const ws2 = FakeSocket.all[1];
  assert.equal(ws2.url, 'ws://tts.test:8080/v1/stream'); // no token to route by
  ws2.json(HELLO);
  await until(() => ws2.sent.length === 1);
  assert.deepEqual(ws2.sent[0], { type: 'start', id: 'a', text: 'x', format: 'f32', sample_rate: 16000, frame_ms: 60 });
  client.close();
});

test('overloaded starts are retried after retry_after_ms; other refusals fail the stream', async () => {
  const { client } = makeClient();
  const stream = client.speak('x', { format: 'pcm16', id: 'a' });
  const nonFatal = [];
  stream.on('error', (e) => nonFatal.push([e.code, e.fatal]));
  const ws = FakeSocket.all[0];
  ws.json(HELLO);
  await until(() => ws.sent.length === 1);
  ws.json({ type: 'error', id: 'a', code: 'overloaded', message: 'busy', retry_after_ms: 5 });
  await until(() => ws.sent.length === 2);
  assert.equal(ws.sent[1].type, 'start');
  ws.json({ type: 'error', id: 'a', code: 'text_too_long', message: 'too long' });
  assert.equal((await stream.finished).reason, 'error');
  assert.deepEqual(nonFatal, [['overloaded', false], ['text_too_long', true]]);
  client.close();
});

test('cancel stops the player and tells the server', async () => {
  const { client, audio } = makeClient();
  const stream = client.speak('x', { format: 'pcm16', id: 'a' });
  const ws = FakeSocket.all[0];
  ws.json(HELLO);
  await until(() => ws.sent.length === 1);
  ws.json({ type: 'started', id: 'a', slot: 0, stream: 'tok', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws.frame({ seq: 0 });
  stream.cancel();
  assert.deepEqual(ws.sent[1], { type: 'cancel', id: 'a' });
  assert.equal(audio.players[0].stopped, true);
  assert.equal((await stream.finished).reason, 'cancelled');
  ws.frame({ seq: 1 }); // in flight: ignored
  ws.json({ type: 'done', id: 'a', slot: 0, reason: 'cancelled', last_seq: 1, samples: 8 });
  assert.equal(audio.players[0].samples.length, 4);
  // The connection stays; nothing is left to resume, so a drop does not reconnect.
  ws.drop();
  await new Promise((resolve) => setTimeout(resolve, 20));
  assert.equal(FakeSocket.all.length, 1);
  client.close();
});

test('cancel after done stops the playback only', async () => {
  const { client, audio } = makeClient();
  const stream = client.speak('x', { format: 'pcm16', id: 'a' });
  const ws = FakeSocket.all[0];
  ws.json(HELLO);
  await until(() => ws.sent.length === 1);
  ws.json({ type: 'started', id: 'a', slot: 0, stream: 'tok', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws.frame({ seq: 0, flags: FLAG_LAST });
  audio.createPlayer = () => assert.fail('no second player');
  const player = audio.players[0];
  player.end = () => {}; // still playing out: 'ended' does not come yet
  ws.json({ type: 'done', id: 'a', slot: 0, reason: 'complete', last_seq: 0, samples: 4 });
  stream.cancel();
  assert.equal(player.stopped, true);
  assert.equal(ws.sent.length, 1); // no cancel for a stream the server finished
  assert.equal((await stream.finished).reason, 'cancelled');
  client.close();
});

test('opus: 48 kHz, packets to the decoder, done.samples ends it; PCM fallback without WebCodecs', async () => {
  const { client, audio } = makeClient(fakeAudio({ opus: true }));
  const stream = client.speak('x', { format: 'opus', id: 'a' });
  const ws = FakeSocket.all[0];
  ws.json(HELLO);
  await until(() => ws.sent.length === 1);
  assert.equal(ws.sent[0].format, 'opus');
  assert.equal(ws.sent[0].sample_rate, 48000);
  ws.json({ type: 'started', id: 'a', slot: 0, stream: 'tok', format: 'opus', sample_rate: 48000, frame_ms: 20 });
  ws.frame({ seq: 0 });
  ws.frame({ seq: 1, flags: FLAG_LAST });
  ws.json({ type: 'done', id: 'a', slot: 0, reason: 'complete', last_seq: 1, samples: 1300 });
  await stream.finished;
  assert.deepEqual(audio.decoders[0].frames, [0, 1]);
  assert.equal(audio.decoders[0].endedWith, 1300);
  assert.deepEqual(audio.players[0].samples, [0, 1]);
  assert.equal(audio.players[0].options.sampleRate, 48000);
  client.close();

  const fallback = makeClient(fakeAudio({ opus: false }));
  const s2 = fallback.client.speak('x', { format: 'opus', id: 'b' });
  const ws2 = FakeSocket.all[0];
  ws2.json(HELLO);
  await until(() => ws2.sent.length === 1);
  assert.deepEqual([ws2.sent[0].format, ws2.sent[0].sample_rate], ['pcm16', 48000]);
  assert.equal(s2.fellBack, true);
  fallback.client.close();
});

test('reconnecting gives up at the attempt limit and fails the streams', async () => {
  const { client } = makeClient(fakeAudio(), { reconnect: { initialMs: 1, maxMs: 2, jitter: 0, maxAttempts: 3 } });
  const stream = client.speak('x', { format: 'pcm16', id: 'a' });
  const errors = [];
  stream.on('error', (e) => errors.push(e.code));
  const ws = FakeSocket.all[0];
  ws.json(HELLO);
  await until(() => ws.sent.length === 1);
  ws.json({ type: 'started', id: 'a', slot: 0, stream: 'tok', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws.drop();
  // Each new socket fails before its hello.
  for (let i = 1; i <= 3; i++) {
    await until(() => FakeSocket.all.length === i + 1);
    FakeSocket.all[i].drop();
  }
  assert.equal((await stream.finished).reason, 'error');
  assert.deepEqual(errors, ['connection_lost']);
  assert.equal(FakeSocket.all.length, 4);
  client.close();
});

test('an API key rides on every connection URL, with the resume token after a drop', async () => {
  const { client } = makeClient(fakeAudio(), { apiKey: 'sekrit' });
  client.speak('x', { format: 'pcm16', id: 'a' });
  const ws1 = FakeSocket.all[0];
  assert.equal(ws1.url, 'ws://tts.test:8080/v1/stream?api_key=sekrit');
  ws1.json(HELLO);
  await until(() => ws1.sent.length === 1);
  ws1.json({ type: 'started', id: 'a', slot: 0, stream: 'tok', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  ws1.drop();
  await until(() => FakeSocket.all.length === 2);
  assert.equal(FakeSocket.all[1].url, 'ws://tts.test:8080/v1/stream?api_key=sekrit&resume=tok');
  client.close();
});

test("started's buffer_ms raises the player's start threshold; without it the client's own stays", async () => {
  const { client, audio } = makeClient();
  const advised = client.speak('Slow text.', { format: 'pcm16', id: 'a' });
  const plain = client.speak('Old server.', { format: 'pcm16', id: 'b' });
  const seen = [];
  advised.on('started', (e) => seen.push(e));
  plain.on('started', (e) => seen.push(e));
  const ws = FakeSocket.all[0];
  ws.json(HELLO);
  await until(() => ws.sent.length === 2);
  ws.json({ type: 'started', id: 'a', slot: 0, stream: 't1', format: 'pcm16', sample_rate: 24000, frame_ms: 20, expected_rtf: 1.6, buffer_ms: 2400, buffer_ms_per_s: 375 });
  ws.json({ type: 'started', id: 'b', slot: 1, stream: 't2', format: 'pcm16', sample_rate: 24000, frame_ms: 20 });
  assert.deepEqual(audio.players[0].thresholds, [2400]);
  assert.deepEqual(audio.players[1].thresholds, []); // v1's started: the client's startThresholdMs alone
  assert.equal(audio.players[1].options.startThresholdMs, 150);
  assert.deepEqual(seen.map((e) => [e.bufferMs, e.expectedRtf]), [[2400, 1.6], [null, null]]);
  client.close();
});

test('bufferAdvice: false keeps the fixed threshold whatever the server advises', async () => {
  const { client, audio } = makeClient(fakeAudio(), { bufferAdvice: false });
  client.speak('Slow text.', { format: 'pcm16', id: 'a' });
  const ws = FakeSocket.all[0];
  ws.json(HELLO);
  await until(() => ws.sent.length === 1);
  ws.json({ type: 'started', id: 'a', slot: 0, stream: 't1', format: 'pcm16', sample_rate: 24000, frame_ms: 20, expected_rtf: 1.6, buffer_ms: 2400, buffer_ms_per_s: 375 });
  assert.deepEqual(audio.players[0].thresholds, []);
  client.close();
});

test('frameMs: 60 by default, 20 not sent (the start old clients sent), another per stream', async () => {
  const { client } = makeClient();
  client.speak('x', { format: 'pcm16', id: 'a' });
  client.speak('y', { format: 'pcm16', id: 'b', frameMs: 20 });
  client.speak('z', { format: 'pcm16', id: 'c', frameMs: 40 });
  const ws = FakeSocket.all[0];
  ws.json(HELLO);
  await until(() => ws.sent.length === 3);
  assert.deepEqual(ws.sent.map((m) => m.frame_ms), [60, undefined, 40]);
  assert.ok(!('frame_ms' in ws.sent[1]));
  client.close();
  const { client: twenty } = makeClient(fakeAudio(), { frameMs: 20 });
  twenty.speak('x', { format: 'pcm16', id: 'a' });
  const ws2 = FakeSocket.all.at(-1);
  ws2.json(HELLO);
  await until(() => ws2.sent.length === 1);
  assert.ok(!('frame_ms' in ws2.sent[0]));
  twenty.close();
});
