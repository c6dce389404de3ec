import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Backoff, StreamState, reconnectPlan } from '../src/stream-state.js';

const frame = (seq, last = false) => ({ seq, sample: seq * 480, last });

test('frames are taken in seq order; replays are duplicates; a skip is a gap', () => {
  const s = new StreamState('a');
  assert.equal(s.accept(frame(0)), 'new');
  assert.equal(s.accept(frame(1)), 'new');
  assert.equal(s.accept(frame(1)), 'duplicate');
  assert.equal(s.accept(frame(0)), 'duplicate');
  assert.equal(s.accept(frame(3)), 'gap');
  assert.equal(s.lastSeq, 1); // a gap does not advance the contiguous seq
  assert.equal(s.accept(frame(2)), 'new');
  assert.equal(s.accept(frame(3, true)), 'new');
  assert.equal(s.complete, true);
  assert.equal(s.framesReceived, 4);
  assert.equal(s.duplicates, 2);
});

test('resume asks for the frames after the last contiguous seq', () => {
  const s = new StreamState('a');
  assert.equal(s.resumeRequest(), null); // no token yet: cannot resume
  s.token = 'tok';
  s.phase = 'detached';
  assert.deepEqual(s.resumeRequest(), { stream: 'tok', after_seq: -1 });
  for (let i = 0; i < 42; i++) s.accept(frame(i));
  s.accept(frame(44)); // lost 42 and 43: resume after 41
  assert.deepEqual(s.resumeRequest(), { stream: 'tok', after_seq: 41 });
  s.phase = 'done';
  assert.equal(s.resumeRequest(), null);
});

test('segment marks are taken once across replays', () => {
  const s = new StreamState('a');
  assert.equal(s.takeSegment({ seq: 0, sample: 0 }), true);
  assert.equal(s.takeSegment({ seq: 17, sample: 8000 }), true);
  assert.equal(s.takeSegment({ seq: 17, sample: 8000 }), false);
  assert.equal(s.takeSegment({ seq: 17, sample: 8100 }), true); // two short segments in one frame
});

test('the reconnect plan resumes streams with a token and restarts unacknowledged ones', () => {
  const live = Object.assign(new StreamState('live'), { token: 't1', phase: 'detached' });
  const fresh = Object.assign(new StreamState('fresh'), { phase: 'pending' });
  const done = Object.assign(new StreamState('done'), { token: 't2', phase: 'done' });
  const cancelled = Object.assign(new StreamState('c'), { phase: 'cancelled' });
  const plan = reconnectPlan([live, fresh, done, cancelled]);
  assert.deepEqual(plan.resume.map((s) => s.id), ['live']);
  assert.deepEqual(plan.restart.map((s) => s.id), ['fresh']);
});

test('backoff doubles up to its cap, with bounded jitter, and resets', () => {
  const b = new Backoff({ initialMs: 100, maxMs: 1000, jitter: 0, maxAttempts: 10 });
  assert.deepEqual([1, 2, 3, 4, 5, 6].map(() => b.next()), [100, 200, 400, 800, 1000, 1000]);
  b.reset();
  assert.equal(b.next(), 100);
  const low = new Backoff({ initialMs: 1000, jitter: 0.2, random: () => 0 });
  const high = new Backoff({ initialMs: 1000, jitter: 0.2, random: () => 0.999999 });
  assert.equal(low.next(), 800);
  assert.equal(high.next(), 1200);
});

test('backoff gives up after its attempts or at the deadline, never waiting past it', () => {
  const b = new Backoff({ initialMs: 100, jitter: 0, maxAttempts: 2 });
  assert.equal(b.next(), 100);
  assert.equal(b.next(), 200);
  assert.equal(b.next(), null);
  const d = new Backoff({ initialMs: 1000, jitter: 0 });
  assert.equal(d.next(300), 299); // the last try lands before the resume TTL runs out
  assert.equal(d.next(0), null);
});

test('with its seed and start known, a resume carries what a regeneration needs', () => {
  const s = new StreamState('a');
  s.token = 'tok';
  s.phase = 'detached';
  s.start = { type: 'start', id: 'a', text: 'One. Two.', format: 'pcm16' };
  assert.deepEqual(s.resumeRequest(), { stream: 'tok', after_seq: -1 }); // no seed yet
  s.seed = 77;
  s.takeSegment({ seq: 0, sample: 0, index: 0 });
  for (let i = 0; i < 10; i++) s.accept(frame(i));
  s.takeSegment({ seq: 9, sample: 4400, index: 1 }); // a mark of a frame already taken: not counted
  s.takeSegment({ seq: 12, sample: 5900, index: 2 }); // its frame has not come
  assert.deepEqual(s.resumeRequest(), {
    stream: 'tok',
    after_seq: 9,
    request: { type: 'start', id: 'a', text: 'One. Two.', format: 'pcm16', seed: 77 },
    segment: 0,
    segment_sample: 0,
  });
  for (let i = 10; i < 13; i++) s.accept(frame(i));
  assert.equal(s.resumeRequest()?.segment, 2);
  assert.equal(s.resumeRequest()?.segment_sample, 5900);
});
