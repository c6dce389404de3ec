// Per-stream bookkeeping for resume: the last contiguous seq, duplicate and gap detection,
// segment marks taken once, and the reconnect backoff. Pure (no sockets, no timers).

/**
 * What to do with an arriving frame.
 * - `new`: the next seq; play it.
 * - `duplicate`: seq already received (replayed after a resume); drop it.
 * - `gap`: seq beyond the next one; frames were lost, so resume from `lastSeq`.
 * @typedef {'new' | 'duplicate' | 'gap'} FrameVerdict
 */

/**
 * A stream's lifecycle phase on the client.
 * @typedef {'pending' | 'starting' | 'live' | 'detached' | 'done' | 'failed' | 'cancelled'} StreamPhase
 */

/** Sequence bookkeeping of one stream, across connections. */
export class StreamState {
  /** @param {string} id the client's stream id */
  constructor(id) {
    this.id = id;
    /** @type {string | null} resume token from `started` */
    this.token = null;
    /** @type {number | null} slot on the current connection */
    this.slot = null;
    /** Last seq received with no gap before it (-1: none); `after_seq` of a resume. */
    this.lastSeq = -1;
    /** The `sample` offset the next frame must have (PCM: checked; Opus: informative). */
    this.nextSample = 0;
    /** @type {number | null} seq of the frame with the last flag, once received */
    this.lastFrameSeq = null;
    /** @type {Record<string, any> | null} the `done` message, once received */
    this.done = null;
    /** @type {StreamPhase} */
    this.phase = 'pending';
    this.framesReceived = 0; // frames taken (duplicates not counted)
    this.duplicates = 0;
    this.resumes = 0;
    /** @type {Set<string>} segment marks taken, as `seq:sample` */
    this.segmentKeys = new Set();
    /** @type {Record<string, unknown> | null} the `start` message sent (its fields) */
    this.start = null;
    /** @type {number | null} the stream's seed (`started.seed`, or the one asked for) */
    this.seed = null;
    /** @type {{index: number, seq: number, sample: number} | null} the last segment mark taken with its `index` */
    this.lastMark = null;
    /** @type {{index: number, seq: number, sample: number}[]} marks taken whose frame has not arrived yet */
    this.pendingMarks = [];
  }

  /** @returns {boolean} every frame up to the last one was received */
  get complete() {
    return this.lastFrameSeq !== null && this.lastSeq === this.lastFrameSeq;
  }

  /** @returns {boolean} the stream needs nothing more from the server */
  get finished() {
    return this.phase === 'done' || this.phase === 'failed' || this.phase === 'cancelled';
  }

  /**
   * Classify a frame by seq and take it when it is the next one.
   * @param {{seq: number, sample: number, last: boolean}} frame
   * @returns {FrameVerdict}
   */
  accept(frame) {
    if (frame.seq <= this.lastSeq) {
      this.duplicates += 1;
      return 'duplicate';
    }
    if (frame.seq !== this.lastSeq + 1) return 'gap';
    this.lastSeq = frame.seq;
    while (this.pendingMarks.length && this.pendingMarks[0].seq <= frame.seq) {
      this.lastMark = /** @type {{index: number, seq: number, sample: number}} */ (this.pendingMarks.shift());
    }
    this.framesReceived += 1;
    if (frame.last) this.lastFrameSeq = frame.seq;
    return 'new';
  }

  /**
   * Take a `segment` message once (a resume replays the marks of frames after `after_seq`, and a
   * connection may drop between a mark and its frame).
   * @param {{seq: number, sample: number}} msg
   * @returns {boolean} true the first time this mark is seen
   */
  takeSegment(msg) {
    const key = `${msg.seq}:${msg.sample}`;
    if (this.segmentKeys.has(key)) return false;
    this.segmentKeys.add(key);
    const index = /** @type {{index?: unknown}} */ (msg).index;
    if (typeof index === 'number' && msg.seq > this.lastSeq) this.pendingMarks.push({ index, seq: msg.seq, sample: msg.sample });
    return true;
  }

  /**
   * The `resume` request for this stream, or null when it cannot or need not be resumed. With the
   * stream's seed known it carries the `start` request and the last segment taken, so that a
   * replica that no longer holds the stream can regenerate it.
   * @returns {{stream: string, after_seq: number, request?: Record<string, unknown>, segment?: number,
   *   segment_sample?: number} | null}
   */
  resumeRequest() {
    if (this.finished || this.token === null) return null;
    /** @type {{stream: string, after_seq: number, request?: Record<string, unknown>, segment?: number, segment_sample?: number}} */
    const req = { stream: this.token, after_seq: this.lastSeq };
    if (this.start === null || this.seed === null) return req;
    req.request = { ...this.start, seed: this.seed };
    if (this.lastMark !== null) {
      req.segment = this.lastMark.index;
      req.segment_sample = this.lastMark.sample;
    }
    return req;
  }
}

/**
 * What a new connection must send for the streams that were live on a lost one.
 * @param {Iterable<StreamState>} states
 * @returns {{resume: StreamState[], restart: StreamState[]}} resume those with a token; start
 *   again those the server never acknowledged (nothing was received, so nothing is repeated)
 */
export function reconnectPlan(states) {
  /** @type {StreamState[]} */
  const resume = [];
  /** @type {StreamState[]} */
  const restart = [];
  for (const state of states) {
    if (state.finished) continue;
    if (state.token !== null) resume.push(state);
    else restart.push(state);
  }
  return { resume, restart };
}

/** Exponential backoff with jitter and a deadline (the server's `resume_ttl_s`). */
export class Backoff {
  /**
   * @param {object} [options]
   * @param {number} [options.initialMs] first delay (default 250)
   * @param {number} [options.maxMs] longest delay (default 4000)
   * @param {number} [options.factor] growth per attempt (default 2)
   * @param {number} [options.jitter] ± fraction of random spread (default 0.2)
   * @param {number} [options.maxAttempts] give up after this many attempts (default 20)
   * @param {() => number} [options.random] source of [0, 1) numbers (tests pass a fixed one)
   */
  constructor({ initialMs = 250, maxMs = 4000, factor = 2, jitter = 0.2, maxAttempts = 20, random = Math.random } = {}) {
    this.initialMs = initialMs;
    this.maxMs = maxMs;
    this.factor = factor;
    this.jitter = jitter;
    this.maxAttempts = maxAttempts;
    this.random = random;
    this.attempt = 0;
  }

  /**
   * The delay before the next attempt, or null to give up.
   * @param {number} [msLeft] time left before the deadline (null/undefined: none)
   * @returns {number | null}
   */
  next(msLeft) {
    if (this.attempt >= this.maxAttempts) return null;
    if (msLeft !== undefined && msLeft !== null && msLeft <= 0) return null;
    const base = Math.min(this.maxMs, this.initialMs * this.factor ** this.attempt);
    this.attempt += 1;
    const spread = base * this.jitter * (2 * this.random() - 1);
    let delay = Math.max(0, Math.round(base + spread));
    if (msLeft !== undefined && msLeft !== null) delay = Math.min(delay, Math.max(0, msLeft - 1));
    return delay;
  }

  /** A connection succeeded: start again from the initial delay. */
  reset() {
    this.attempt = 0;
  }
}
