import assert from 'node:assert/strict';
import { test } from 'node:test';
import { OpusTimeline, defaultPreskip } from '../src/opus.js';

/**
 * Simulate the server's packets for a stream of `total` samples (server/audio/opus.py) and a
 * decoder whose output sample i of packet k has the value k·F + i (its decoded position), then
 * check that exactly decoded positions L … L+N−1 come out, in order.
 */
function run(rate, total, { preskip, decodeBeforeHeaders = false, frameMs = 20, announced = true } = {}) {
  const F = (rate * frameMs) / 1000;
  const L = defaultPreskip(rate);
  const packets = Math.max(1, Math.ceil((total + L) / F));
  // The stream's packet length: given at construction, or (announced) by `started` after it.
  const t = new OpusTimeline({ sampleRate: rate, preskip, frameMs: announced ? undefined : frameMs });
  if (announced) t.setFrameMs(frameMs);
  const out = [];
  const take = (parts) => parts.forEach((p) => out.push(...p));
  const frames = Array.from({ length: packets }, (_, k) => ({ seq: k, sample: Math.max(0, k * F - L), last: k === packets - 1 }));
  const decoded = (k) => Float32Array.from({ length: F }, (_, i) => k * F + i);
  if (decodeBeforeHeaders) {
    // Packet 0 decoded before packet 1's header is known: it must wait for it.
    t.packet(frames[0]);
    take(t.decoded(0, decoded(0)));
    if (packets > 1) assert.equal(out.length, 0);
    for (let k = 1; k < packets; k++) {
      t.packet(frames[k]);
      take(t.decoded(k, decoded(k)));
    }
  } else {
    for (let k = 0; k < packets; k++) t.packet(frames[k]);
    for (let k = 0; k < packets; k++) take(t.decoded(k, decoded(k)));
  }
  const beforeEnd = out.length;
  take(t.end(total));
  return { out, beforeEnd, L };
}

test('pre-skips by rate are the libopus lookahead', () => {
  assert.equal(defaultPreskip(48000), 312);
  assert.equal(defaultPreskip(24000), 156);
  assert.equal(defaultPreskip(16000), 104);
});

for (const rate of [48000, 24000, 16000]) {
  for (const total of [0, 1, 100, 647, 648, 649, 960, 5000, 96000, 96001]) {
    test(`${rate} Hz, ${total} samples: pre-skip dropped, end cut, nothing else`, () => {
      for (const decodeBeforeHeaders of [false, true]) {
        const { out, L } = run(rate, total, { decodeBeforeHeaders });
        assert.equal(out.length, total);
        out.forEach((v, i) => assert.equal(v, i + L));
      }
    });
  }
}

for (const frameMs of [40, 60]) {
  for (const total of [0, 1, 2567, 2568, 2569, 5000, 96001]) {
    test(`${frameMs} ms packets at 48 kHz, ${total} samples: the same stream samples as 20 ms`, () => {
      for (const decodeBeforeHeaders of [false, true]) {
        for (const announced of [false, true]) {
          const { out, L } = run(48000, total, { decodeBeforeHeaders, frameMs, announced });
          assert.equal(out.length, total);
          out.forEach((v, i) => assert.equal(v, i + L));
        }
      }
    });
  }
}

test('the last packet waits for done.samples', () => {
  const { beforeEnd } = run(48000, 5000);
  const F = 960;
  const packets = Math.ceil((5000 + 312) / F);
  assert.equal(beforeEnd, (packets - 1) * F - 312);
});

test('packet 1 states the pre-skip even when the default would be wrong', () => {
  // A server whose encoder lookahead is 200 samples at 48 kHz.
  const t = new OpusTimeline({ sampleRate: 48000 });
  t.packet({ seq: 0, sample: 0, last: false });
  t.packet({ seq: 1, sample: 760, last: true });
  const out = [];
  for (const k of [0, 1]) for (const p of t.decoded(k, Float32Array.from({ length: 960 }, (_, i) => k * 960 + i))) out.push(...p);
  for (const p of t.end(1000)) out.push(...p);
  assert.equal(t.preskip, 200);
  assert.deepEqual(out, Array.from({ length: 1000 }, (_, i) => i + 200));
});
