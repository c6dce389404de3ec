import assert from 'node:assert/strict';
import { test } from 'node:test';
import { JitterBuffer, SampleRing } from '../src/jitter-buffer.js';

const ramp = (from, n) => Float32Array.from({ length: n }, (_, i) => from + i);

/** Render blocks until `ended`, keeping the stream samples (the gate's head of each block). */
function drain(jb, block = 128, maxBlocks = 10000) {
  const out = [];
  for (let i = 0; i < maxBlocks && jb.state !== 'ended'; i++) {
    const buf = new Float32Array(block);
    const n = jb.render(buf);
    out.push(...buf.subarray(0, n));
    assert.ok(buf.subarray(n).every((v) => v === 0), 'silence after the stream samples');
  }
  return out;
}

test('the ring wraps around and grows without losing samples', () => {
  const ring = new SampleRing(16);
  const got = [];
  let next = 0;
  for (let round = 0; round < 50; round++) {
    const n = (round * 7) % 23;
    ring.push(ramp(next, n));
    next += n;
    const out = new Float32Array((round * 5) % 19);
    const read = ring.read(out);
    got.push(...out.subarray(0, read));
  }
  const rest = new Float32Array(ring.size);
  ring.read(rest);
  got.push(...rest);
  assert.deepEqual(got, [...ramp(0, next)]);
  assert.ok(ring.capacity >= 16);
});

test('playback starts at the threshold and is gapless across odd-sized pushes', () => {
  const jb = new JitterBuffer({ threshold: 300, adapt: 1 });
  const block = new Float32Array(128);
  jb.push(ramp(0, 299));
  assert.equal(jb.render(block), 0);
  assert.equal(jb.state, 'buffering');
  jb.push(ramp(299, 1)); // threshold reached
  assert.equal(jb.render(block), 128);
  assert.equal(jb.state, 'playing');
  assert.deepEqual([...block], [...ramp(0, 128)]);
  let next = 300;
  for (const n of [5, 480, 77, 1000, 1]) {
    jb.push(ramp(next, n));
    next += n;
  }
  jb.end();
  const rest = drain(jb);
  assert.deepEqual(rest, [...ramp(128, next - 128)]);
  assert.equal(jb.underruns, 0);
  assert.equal(jb.played, next);
  assert.equal(jb.state, 'ended');
});

test('a short stream plays at its end even below the threshold', () => {
  const jb = new JitterBuffer({ threshold: 10000 });
  jb.push(ramp(1, 200));
  assert.equal(jb.render(new Float32Array(128)), 0);
  jb.end();
  assert.deepEqual(drain(jb), [...ramp(1, 200)]);
  assert.equal(jb.underruns, 0);
});

test('running dry mid-stream counts one underrun, rebuffers, then continues where it stopped', () => {
  const jb = new JitterBuffer({ threshold: 256, adapt: 1 });
  const block = new Float32Array(128);
  jb.push(ramp(0, 300));
  assert.equal(jb.render(block), 128);
  assert.equal(jb.render(block), 128);
  assert.equal(jb.render(block), 44); // 44 left: the rest of the block is silence
  assert.equal(jb.underruns, 1);
  assert.equal(jb.underrunSamples, 84);
  assert.equal(jb.state, 'buffering');
  assert.equal(jb.render(block), 0); // still rebuffering: silence, no second underrun
  assert.equal(jb.underruns, 1);
  assert.equal(jb.underrunSamples, 84 + 128);
  jb.push(ramp(300, 256));
  assert.equal(jb.render(block), 128);
  assert.equal(block[0], 300); // no sample lost or repeated
  jb.end();
  drain(jb);
  assert.equal(jb.played, 556);
  assert.equal(jb.underruns, 1);
});

test('the threshold grows after underruns, up to its bound', () => {
  const jb = new JitterBuffer({ threshold: 100, maxThreshold: 200, adapt: 1.5 });
  const block = new Float32Array(128);
  for (let i = 0; i < 4; i++) {
    jb.push(ramp(0, jb.threshold));
    while (jb.render(block) === 128);
  }
  assert.equal(jb.underruns, 4);
  assert.equal(jb.threshold, 200);
});

test('stop drops the queue at once', () => {
  const jb = new JitterBuffer({ threshold: 0 });
  jb.push(ramp(0, 1000));
  jb.stop();
  const block = new Float32Array(128).fill(9);
  assert.equal(jb.render(block), 0);
  assert.ok(block.every((v) => v === 0));
  jb.push(ramp(0, 10)); // ignored after the end
  assert.equal(jb.buffered, 0);
});

test("the server's advice raises the start threshold, never lowers it", () => {
  const jb = new JitterBuffer({ threshold: 4, adapt: 1 });
  jb.raiseThreshold(10);
  jb.raiseThreshold(2); // a smaller advice changes nothing
  assert.equal(jb.threshold, 10);
  const out = new Float32Array(4);
  jb.push(new Float32Array(8).fill(1));
  assert.equal(jb.render(out), 0); // 8 of 10 samples: still buffering
  assert.equal(jb.state, 'buffering');
  jb.push(new Float32Array(2).fill(1));
  assert.equal(jb.render(out), 4); // 10 queued: playing
  assert.equal(jb.state, 'playing');
});
