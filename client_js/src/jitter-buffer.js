// The jitter buffer the player worklet renders from: a growable ring of float32 samples with a
// start threshold, underrun counting and rebuffering. Pure (no Web Audio): the worklet imports
// it, and Node's test runner tests it.

/**
 * Playback states.
 * - `buffering`: waiting until `threshold` samples are queued (or the stream ended) before
 *   starting or, after an underrun, restarting.
 * - `playing`: rendering queued samples.
 * - `ended`: the stream ended and every sample was rendered.
 * @typedef {'buffering' | 'playing' | 'ended'} PlaybackState
 */

/** A ring buffer of float32 samples that grows instead of ever dropping audio. */
export class SampleRing {
  /** @param {number} [capacity] initial capacity in samples */
  constructor(capacity = 1 << 15) {
    this.buf = new Float32Array(Math.max(16, capacity));
    this.head = 0; // next sample to read
    this.size = 0; // samples queued
  }

  /** @returns {number} the capacity in samples */
  get capacity() {
    return this.buf.length;
  }

  /** @param {Float32Array} samples appended in order; grows the ring when full */
  push(samples) {
    if (this.size + samples.length > this.buf.length) this.grow(this.size + samples.length);
    const cap = this.buf.length;
    const tail = (this.head + this.size) % cap;
    const first = Math.min(samples.length, cap - tail);
    this.buf.set(samples.subarray(0, first), tail);
    if (first < samples.length) this.buf.set(samples.subarray(first), 0);
    this.size += samples.length;
  }

  /**
   * Move up to `out.length - offset` samples into `out` starting at `offset`.
   * @param {Float32Array} out
   * @param {number} [offset]
   * @returns {number} samples read
   */
  read(out, offset = 0) {
    const n = Math.min(this.size, out.length - offset);
    const cap = this.buf.length;
    const first = Math.min(n, cap - this.head);
    out.set(this.buf.subarray(this.head, this.head + first), offset);
    if (first < n) out.set(this.buf.subarray(0, n - first), offset + first);
    this.head = (this.head + n) % cap;
    this.size -= n;
    return n;
  }

  /** Drop everything queued. */
  clear() {
    this.head = 0;
    this.size = 0;
  }

  /** @param {number} needed */
  grow(needed) {
    let cap = this.buf.length * 2;
    while (cap < needed) cap *= 2;
    const next = new Float32Array(cap);
    const size = this.size;
    this.read(next);
    this.buf = next;
    this.head = 0;
    this.size = size;
  }
}

/**
 * Jitter buffer: starts rendering once `threshold` samples are queued, counts an underrun each
 * time it runs dry while the stream is still going, then rebuffers up to the (raised) threshold.
 */
export class JitterBuffer {
  /**
   * @param {object} options
   * @param {number} options.threshold start threshold in samples
   * @param {number} [options.maxThreshold] upper bound when the threshold adapts (default 8× threshold)
   * @param {number} [options.adapt] factor applied to the threshold after each underrun (1 = fixed)
   * @param {number} [options.capacity] initial ring capacity in samples
   */
  constructor({ threshold, maxThreshold, adapt = 1.5, capacity }) {
    this.ring = new SampleRing(capacity ?? Math.max(1 << 15, 4 * threshold));
    this.threshold = Math.max(0, Math.floor(threshold));
    this.maxThreshold = Math.max(this.threshold, Math.floor(maxThreshold ?? 8 * this.threshold));
    this.adapt = adapt;
    /** @type {PlaybackState} */
    this.state = 'buffering';
    this.ended = false; // no more samples will come
    this.started = false; // rendered at least one sample
    this.underruns = 0; // times the buffer ran dry while playing
    this.underrunSamples = 0; // silent samples rendered because of underruns
    this.played = 0; // stream samples rendered
    this.received = 0; // stream samples queued in total
  }

  /**
   * Raise the start threshold (the server's advice: `started.buffer_ms`); never lowers it.
   * While buffering, playback then waits for that much (or the stream's end).
   * @param {number} threshold samples
   */
  raiseThreshold(threshold) {
    this.threshold = Math.max(this.threshold, Math.floor(threshold));
    this.maxThreshold = Math.max(this.maxThreshold, this.threshold);
  }

  /** @returns {number} samples queued and not yet rendered */
  get buffered() {
    return this.ring.size;
  }

  /** @param {Float32Array} samples the next samples of the stream */
  push(samples) {
    if (this.ended) return;
    this.ring.push(samples);
    this.received += samples.length;
  }

  /** The stream has no more samples: play out what is queued, even below the threshold. */
  end() {
    this.ended = true;
  }

  /** Stop at once: drop the queue and end. */
  stop() {
    this.ring.clear();
    this.ended = true;
    this.state = 'ended';
  }

  /**
   * Render one block: fills `out` with stream samples first, then silence.
   * @param {Float32Array} out
   * @returns {number} stream samples at the head of `out` (the rest is silence)
   */
  render(out) {
    if (this.state === 'ended') {
      out.fill(0);
      return 0;
    }
    if (this.state === 'buffering') {
      if (this.ring.size >= this.threshold || (this.ended && this.ring.size > 0) || this.threshold === 0) {
        this.state = 'playing';
      } else {
        if (this.ended) this.state = 'ended';
        else if (this.started) this.underrunSamples += out.length; // still rebuffering
        out.fill(0);
        return 0;
      }
    }
    const n = this.ring.read(out);
    if (n > 0) this.started = true;
    this.played += n;
    if (n < out.length) {
      out.fill(0, n);
      if (this.ended) {
        if (this.ring.size === 0) this.state = 'ended';
      } else {
        // Ran dry while the stream goes on: an underrun. Rebuffer before playing again.
        this.underruns += 1;
        this.underrunSamples += out.length - n;
        this.state = 'buffering';
        if (this.adapt > 1) {
          this.threshold = Math.min(this.maxThreshold, Math.ceil(Math.max(this.threshold, 1) * this.adapt));
        }
      }
    } else if (this.ended && this.ring.size === 0) {
      this.state = 'ended';
    }
    return n;
  }
}
