import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  FLAG_LAST,
  FLAG_SEGMENT_START,
  HEADER_SIZE,
  ProtocolViolation,
  cancelMessage,
  decodePcm,
  packFrame,
  parseFrame,
  parseMessage,
  resumeMessage,
  startMessage,
  streamUrl,
} from '../src/protocol.js';

test('header fields are little-endian at their offsets', () => {
  const bytes = new Uint8Array([1, 0x03, 0x34, 0x12, 0x78, 0x56, 0x34, 0x12, 0xff, 0xff, 0xff, 0xff, 0xaa, 0xbb]);
  const frame = parseFrame(bytes.buffer);
  assert.equal(frame.version, 1);
  assert.equal(frame.flags, 3);
  assert.equal(frame.last, true);
  assert.equal(frame.segmentStart, true);
  assert.equal(frame.slot, 0x1234);
  assert.equal(frame.seq, 0x12345678);
  assert.equal(frame.sample, 0xffffffff); // uint32, not negative
  assert.deepEqual([...frame.payload], [0xaa, 0xbb]);
});

test('flags are independent bits', () => {
  const seg = parseFrame(packFrame({ flags: FLAG_SEGMENT_START, seq: 0, sample: 0 }));
  assert.equal(seg.segmentStart, true);
  assert.equal(seg.last, false);
  const last = parseFrame(packFrame({ flags: FLAG_LAST, seq: 7, sample: 3360 }));
  assert.equal(last.last, true);
  assert.equal(last.segmentStart, false);
  assert.equal(last.payload.byteLength, 0); // the last frame may be empty
});

test('pack and parse round-trip, also from a view inside a larger buffer', () => {
  const payload = new Uint8Array([1, 2, 3, 4, 5]);
  const packed = packFrame({ flags: 2, slot: 3, seq: 4294967295, sample: 123456 }, payload);
  assert.equal(packed.byteLength, HEADER_SIZE + 5);
  const big = new Uint8Array(packed.byteLength + 7);
  big.set(packed, 7);
  const frame = parseFrame(big.subarray(7));
  assert.deepEqual(
    { flags: frame.flags, slot: frame.slot, seq: frame.seq, sample: frame.sample },
    { flags: 2, slot: 3, seq: 4294967295, sample: 123456 },
  );
  assert.deepEqual([...frame.payload], [...payload]);
});

test('short frames and unknown versions are protocol violations', () => {
  assert.throws(() => parseFrame(new Uint8Array(11)), ProtocolViolation);
  assert.throws(() => parseFrame(packFrame({ version: 2, seq: 0, sample: 0 })), /version 2/);
});

test('pcm16 decodes to s16 / 32768 exactly', () => {
  const pcm = new Int16Array([0, 1, -1, 32767, -32768, 12345]);
  const bytes = new Uint8Array(pcm.buffer);
  const out = decodePcm(bytes, 'pcm16');
  assert.deepEqual([...out], [...pcm].map((v) => Math.fround(v / 32768)));
  assert.equal(out[4], -1);
  assert.throws(() => decodePcm(new Uint8Array(3), 'pcm16'), ProtocolViolation);
});

test('f32 decodes from an unaligned payload', () => {
  const values = new Float32Array([0.25, -0.5, 1e-7, -0.999]);
  const frame = packFrame({ seq: 0, sample: 0 }, new Uint8Array(values.buffer));
  const shifted = new Uint8Array(frame.byteLength + 1);
  shifted.set(frame, 1); // payload now starts at byte 13: not 4-aligned
  const out = decodePcm(parseFrame(shifted.subarray(1)).payload, 'f32');
  assert.deepEqual([...out], [...values]);
  assert.throws(() => decodePcm(new Uint8Array(6), 'f32'), ProtocolViolation);
  assert.throws(() => decodePcm(new Uint8Array(4), /** @type {any} */ ('opus')), TypeError);
});

test('client messages', () => {
  assert.deepEqual(JSON.parse(startMessage('a', 'hi', { format: 'opus', sample_rate: 48000, seed: 0, voice: undefined })), {
    type: 'start',
    id: 'a',
    text: 'hi',
    format: 'opus',
    sample_rate: 48000,
    seed: 0,
  });
  assert.deepEqual(JSON.parse(cancelMessage('a')), { type: 'cancel', id: 'a' });
  assert.deepEqual(JSON.parse(resumeMessage('tok', -1)), { type: 'resume', stream: 'tok', after_seq: -1 });
});

test('server messages need JSON with a string type', () => {
  assert.deepEqual(parseMessage('{"type":"hello","protocol":1}'), { type: 'hello', protocol: 1 });
  assert.throws(() => parseMessage('nope'), ProtocolViolation);
  assert.throws(() => parseMessage('{"kind":"x"}'), ProtocolViolation);
  assert.throws(() => parseMessage('null'), ProtocolViolation);
});

test('stream URLs from origins, with the resume token for affinity', () => {
  assert.equal(streamUrl('http://127.0.0.1:8080'), 'ws://127.0.0.1:8080/v1/stream');
  assert.equal(streamUrl('https://tts.example/'), 'wss://tts.example/v1/stream');
  assert.equal(streamUrl('ws://h:1/v1/stream?resume=old', { resume: 'a_b-c' }), 'ws://h:1/v1/stream?resume=a_b-c');
  assert.equal(streamUrl('ws://h:1/v1/stream?resume=old&x=1'), 'ws://h:1/v1/stream?x=1');
  assert.equal(
    streamUrl('http://h:1', { apiKey: 'k+/=', resume: 't' }),
    'ws://h:1/v1/stream?api_key=k%2B%2F%3D&resume=t',
  );
});
