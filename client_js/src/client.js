// The client: one WebSocket connection shared by any number of streams, `speak()` returning a
// stream object with events and metrics, automatic reconnect with `resume`.

import { Emitter } from './emitter.js';
import {
  RETRYABLE_CODES,
  ProtocolViolation,
  cancelMessage,
  decodePcm,
  parseFrame,
  parseMessage,
  resumeMessage,
  startFields,
  streamUrl,
} from './protocol.js';
import { webAudioBackend } from './player.js';
import { Backoff, StreamState, reconnectPlan } from './stream-state.js';

/**
 * What the client needs from the audio side (the browser's is `webAudioBackend` in player.js).
 * @typedef {object} AudioBackend
 * @property {(sampleRate: number) => void} prepare create/resume the output for this rate now
 *   (called synchronously inside `speak()`, so a click handler unlocks audio)
 * @property {(sampleRate: number) => Promise<boolean>} opusSupported
 * @property {(options: {sampleRate: number, startThresholdMs?: number, maxThresholdMs?: number, tap?: boolean,
 *   onEvent: (event: any) => void}) => Player} createPlayer
 * @property {(options: {sampleRate: number, onSamples: (s: Float32Array) => void,
 *   onError: (e: Error) => void, frameMs?: number}) => OpusDecoder} createOpusDecoder
 */

/**
 * @typedef {object} Player
 * @property {(samples: Float32Array) => void} push
 * @property {() => void} end
 * @property {() => void} stop
 * @property {() => void} close
 * @property {() => Promise<Float32Array>} [tapped]
 * @property {(ms: number) => void} [setStartThreshold] raise the start threshold (the server's advice)
 */

/**
 * @typedef {object} OpusDecoder
 * @property {(frame: import('./protocol.js').Frame) => void} push
 * @property {(total: number) => Promise<void>} end
 * @property {() => void} close
 * @property {(frameMs: number) => void} [setFrameMs] the packet length `started` announced
 */

/**
 * Options of {@link TTSClient.speak}: the `start` fields plus client-side settings.
 * @typedef {object} SpeakOptions
 * @property {'auto'|'opus'|'pcm16'|'f32'} [format] `auto` (default): Opus where WebCodecs decodes
 *   it, else pcm16. `opus` falls back to pcm16 where it cannot be decoded.
 * @property {number} [sampleRate] PCM output rate (default 24000; Opus always uses 48000)
 * @property {string} [voice]
 * @property {number} [speed]
 * @property {number} [seed]
 * @property {number} [temperature]
 * @property {number} [top_p]
 * @property {number} [top_k]
 * @property {20|40|60} [frameMs] frame length asked of the server (client default: 60 ms, fewer
 *   messages for the same audio; a server without `frame_ms` sends 20 ms and says so)
 * @property {string} [id] the stream id (default: generated)
 * @property {number} [startThresholdMs] jitter buffer start threshold (client default)
 * @property {boolean} [bufferAdvice] honour the server's `started.buffer_ms` (client default)
 * @property {boolean} [tap] record the played samples (`stream.tapped()`), for tests
 */

/**
 * Live numbers of a stream.
 * @typedef {object} StreamMetrics
 * @property {number | null} timeToFirstFrameMs speak() → first audio frame received
 * @property {number | null} timeToFirstAudioMs speak() → first sample rendered by the player
 * @property {number} underruns times the jitter buffer ran dry mid-stream
 * @property {number} underrunMs silence rendered because of underruns
 * @property {number} bufferedMs audio queued in the jitter buffer
 * @property {number} playedMs audio rendered
 * @property {number} framesReceived distinct frames received
 * @property {number} samplesReceived stream samples handed to the player
 * @property {number} reconnects connections lost and resumed
 */

/**
 * Events of a {@link SpeechStream}.
 * @typedef {object} StreamEvents
 * @property {{token: string, slot: number, format: string, sampleRate: number, bufferMs: number | null, expectedRtf: number | null}} started
 *   `bufferMs`/`expectedRtf`: the server's advice (null from a server without it); playback waits for
 *   the larger of `bufferMs` and `startThresholdMs`
 * @property {{text: string, seq: number, sample: number}} segment
 * @property {{seq: number, sample: number, bytes: number, last: boolean}} audio a frame arrived
 * @property {{timeToFirstAudioMs: number}} playing the first sample was rendered
 * @property {StreamMetrics} underrun
 * @property {StreamMetrics} metrics about every 100 ms while playing
 * @property {{attempt: number, delayMs: number}} reconnecting
 * @property {{afterSeq: number}} resumed
 * @property {{reason: string}} degraded a replica regenerated the stream and cannot promise the same audio
 * @property {{reason: string, samples: number, lastSeq: number}} done the server finished the stream
 * @property {{reason: string}} ended playback finished (or the stream stopped)
 * @property {{code: string, message: string, fatal: boolean}} error
 */

/**
 * @typedef {object} ClientOptions
 * @property {string} [url] `ws(s)://host:port/v1/stream`, or an http(s) origin (default: the page's)
 * @property {string} [apiKey] sent as `?api_key=` when the server requires keys
 * @property {typeof WebSocket} [WebSocket] the WebSocket constructor (tests inject a fake)
 * @property {AudioBackend} [audio] default: Web Audio + WebCodecs (player.js)
 * @property {ConstructorParameters<typeof Backoff>[0]} [reconnect] backoff settings
 * @property {boolean} [autoReconnect] default true
 * @property {number} [startThresholdMs] jitter buffer start threshold (default 150)
 * @property {number} [maxThresholdMs] adaptive threshold bound (default 1500)
 * @property {boolean} [bufferAdvice] start playback on the server's `started.buffer_ms` when it is larger
 *   than `startThresholdMs` (default true; false: the fixed threshold alone)
 * @property {20|40|60} [frameMs] frame length streams ask for (default 60: a third of the messages of
 *   20 ms frames, so less of the server's CPU a second of audio; bench/results/harness/frontend-cost-epyc-2core.md)
 * @property {number} [maxStartRetries] retries of a `start` refused with retry_after_ms (default 3)
 * @property {() => number} [now] milliseconds clock (default performance.now)
 */

let idCounter = 0;

/** One spoken text: events, metrics, `cancel()`, and `finished`. */
export class SpeechStream extends Emitter {
  /**
   * @param {TTSClient} client
   * @param {string} id
   * @param {string} text
   * @param {SpeakOptions} options
   */
  constructor(client, id, text, options) {
    super();
    /** @private */
    this.client = client;
    this.id = id;
    this.text = text;
    this.options = options;
    this.state = new StreamState(id);
    /** @type {number} the frame length asked for (`frame_ms`) */
    this.frameMs = options.frameMs ?? client.frameMs;
    /** @type {'opus' | 'pcm16' | 'f32' | null} the wire format, once decided */
    this.format = null;
    /** @type {number | null} */
    this.sampleRate = null;
    /** Opus was asked for but cannot be decoded here: PCM is used instead. */
    this.fellBack = false;
    /** @type {Player | null} */
    this.player = null;
    /** @type {OpusDecoder | null} */
    this.decoder = null;
    this.startedAt = client.now();
    this.startRetries = 0;
    /** @type {StreamMetrics} */
    this.metrics = {
      timeToFirstFrameMs: null,
      timeToFirstAudioMs: null,
      underruns: 0,
      underrunMs: 0,
      bufferedMs: 0,
      playedMs: 0,
      framesReceived: 0,
      samplesReceived: 0,
      reconnects: 0,
    };
    /** @type {string | null} why the stream ended, once it did */
    this.endReason = null;
    /** @type {(value: {reason: string, metrics: StreamMetrics}) => void} */
    this.resolveFinished = () => {};
    /** Resolves when playback is over (complete, cancelled or failed). */
    this.finished = new Promise((resolve) => {
      this.resolveFinished = resolve;
    });
    this.formatReady = false;
  }

  /** @returns {import('./stream-state.js').StreamPhase} */
  get phase() {
    return this.state.phase;
  }

  /** Stop the stream now: playback stops and the server stops generating. */
  cancel() {
    if (this.endReason !== null) return;
    const phase = this.state.phase;
    this.player?.stop();
    this.decoder?.close();
    if (!this.state.finished) {
      // Still generating: tell the server. (After `done` only the local playback stops.)
      if ((phase === 'starting' || phase === 'live') && this.client.canSend()) {
        this.client.send(cancelMessage(this.id));
      }
      this.state.phase = 'cancelled';
      this.client.forget(this);
    }
    this.finish('cancelled');
  }

  /** @returns {Promise<Float32Array>} samples the player rendered (only with `tap: true`) */
  async tapped() {
    if (!this.player?.tapped) throw new Error('speak(..., {tap: true}) records the played samples');
    return this.player.tapped();
  }

  // --- called by the client -------------------------------------------------------

  /**
   * Decide format and rate (Opus needs WebCodecs and 48 kHz). Sets `format`, `sampleRate`.
   * @param {AudioBackend} audio
   */
  async resolveFormat(audio) {
    const wanted = this.options.format ?? 'auto';
    if (wanted === 'opus' || wanted === 'auto') {
      if (await audio.opusSupported(48000)) {
        this.format = 'opus';
        this.sampleRate = 48000;
      } else {
        this.format = 'pcm16';
        this.sampleRate = wanted === 'opus' ? 48000 : (this.options.sampleRate ?? 24000);
        this.fellBack = wanted === 'opus';
      }
    } else if (wanted === 'pcm16' || wanted === 'f32') {
      this.format = wanted;
      this.sampleRate = this.options.sampleRate ?? 24000;
    } else {
      throw new TypeError(`format ${wanted} cannot be played by this client (use opus, pcm16 or f32)`);
    }
    this.formatReady = true;
  }

  /** @returns {string} the `start` message (kept: a resume on another replica may need it) */
  startMessage() {
    const o = this.options;
    this.state.start = startFields(this.id, this.text, {
      voice: o.voice,
      speed: o.speed,
      format: /** @type {'opus'|'pcm16'|'f32'} */ (this.format),
      sample_rate: /** @type {number} */ (this.sampleRate),
      seed: o.seed,
      temperature: o.temperature,
      top_p: o.top_p,
      top_k: o.top_k,
      // 20 is the server's default: not sent, so the start is the one clients always sent.
      frame_ms: this.frameMs === 20 ? undefined : this.frameMs,
    });
    return JSON.stringify(this.state.start);
  }

  /** The audio path: decoder (Opus) → jitter-buffer player. */
  ensurePlayer() {
    if (this.player) return;
    const audio = this.client.audio;
    const rate = /** @type {number} */ (this.sampleRate);
    this.player = audio.createPlayer({
      sampleRate: rate,
      startThresholdMs: this.options.startThresholdMs ?? this.client.startThresholdMs,
      maxThresholdMs: this.client.maxThresholdMs,
      tap: Boolean(this.options.tap),
      onEvent: (event) => this.onPlayerEvent(event),
    });
    if (this.format === 'opus') {
      this.decoder = audio.createOpusDecoder({
        sampleRate: rate,
        frameMs: this.frameMs,
        onSamples: (samples) => this.play(samples),
        onError: (err) => this.fail('decode_error', String(err?.message ?? err)),
      });
    }
  }

  /** @param {Float32Array} samples */
  play(samples) {
    this.metrics.samplesReceived += samples.length;
    this.player?.push(samples);
  }

  /** @param {Record<string, any>} msg `started` */
  onStarted(msg) {
    this.state.token = msg.stream;
    this.state.seed = typeof msg.seed === 'number' ? msg.seed : (this.options.seed ?? null);
    this.state.slot = msg.slot;
    this.state.phase = 'live';
    if (msg.format !== this.format || msg.sample_rate !== this.sampleRate) {
      this.fail('unsupported', `server started ${msg.format} at ${msg.sample_rate} Hz, asked for ${this.format} at ${this.sampleRate} Hz`);
      return;
    }
    // The frame length the server uses (a server without `frame_ms` in `start` sends 20 ms).
    this.decoder?.setFrameMs?.(typeof msg.frame_ms === 'number' ? msg.frame_ms : 20);
    // The server's advice: audio to hold so that the whole stream plays without a stall.
    const bufferMs = typeof msg.buffer_ms === 'number' && msg.buffer_ms >= 0 ? msg.buffer_ms : null;
    const expectedRtf = typeof msg.expected_rtf === 'number' ? msg.expected_rtf : null;
    const honour = this.options.bufferAdvice ?? this.client.bufferAdvice;
    if (bufferMs !== null && honour) this.player?.setStartThreshold?.(bufferMs);
    this.emit('started', { token: msg.stream, slot: msg.slot, format: msg.format, sampleRate: msg.sample_rate, bufferMs, expectedRtf });
  }

  /** @param {Record<string, any>} msg `resumed` */
  onResumed(msg) {
    this.state.slot = msg.slot;
    if (typeof msg.stream === 'string') this.state.token = msg.stream; // a regenerated stream's own token
    this.state.phase = 'live';
    this.state.resumes += 1;
    this.metrics.reconnects += 1;
    this.emit('resumed', { afterSeq: msg.after_seq });
  }

  /** @param {Record<string, any>} msg `segment` */
  onSegment(msg) {
    if (this.state.takeSegment(msg)) this.emit('segment', { text: msg.text, seq: msg.seq, sample: msg.sample });
  }

  /**
   * @param {import('./protocol.js').Frame} frame
   * @returns {import('./stream-state.js').FrameVerdict}
   */
  onFrame(frame) {
    const verdict = this.state.accept(frame);
    if (verdict !== 'new') return verdict;
    if (this.metrics.timeToFirstFrameMs === null) this.metrics.timeToFirstFrameMs = this.client.now() - this.startedAt;
    this.metrics.framesReceived = this.state.framesReceived;
    this.emit('audio', { seq: frame.seq, sample: frame.sample, bytes: frame.payload.byteLength, last: frame.last });
    if (this.format === 'opus') {
      this.decoder?.push(frame);
    } else {
      const samples = decodePcm(frame.payload, /** @type {'pcm16'|'f32'} */ (this.format));
      if (frame.sample !== this.state.nextSample) {
        throw new ProtocolViolation(`frame ${frame.seq} starts at sample ${frame.sample}, expected ${this.state.nextSample}`);
      }
      this.state.nextSample += samples.length;
      this.play(samples);
    }
    return verdict;
  }

  /** @param {Record<string, any>} msg `done` */
  async onDone(msg) {
    this.state.done = msg;
    this.state.phase = 'done';
    this.client.forget(this);
    this.emit('done', { reason: msg.reason, samples: msg.samples, lastSeq: msg.last_seq });
    if (msg.reason === 'cancelled') {
      this.player?.stop();
      this.finish('cancelled');
      return;
    }
    try {
      if (this.decoder) await this.decoder.end(msg.samples);
    } catch (err) {
      this.fail('decode_error', String(/** @type {Error} */ (err)?.message ?? err));
      return;
    }
    this.player?.end(); // 'ended' from the player finishes the stream
    if (!this.player) this.finish(msg.reason);
  }

  /** @param {any} event from the player worklet */
  onPlayerEvent(event) {
    const rate = /** @type {number} */ (this.sampleRate);
    const m = this.metrics;
    if (typeof event.buffered === 'number') m.bufferedMs = (1000 * event.buffered) / rate;
    if (typeof event.played === 'number') m.playedMs = (1000 * event.played) / rate;
    if (typeof event.underruns === 'number') m.underruns = event.underruns;
    if (typeof event.underrunSamples === 'number') m.underrunMs = (1000 * event.underrunSamples) / rate;
    if (event.type === 'playing') {
      m.timeToFirstAudioMs = this.client.now() - this.startedAt;
      this.emit('playing', { timeToFirstAudioMs: m.timeToFirstAudioMs });
    } else if (event.type === 'underrun') {
      this.emit('underrun', { ...m });
    } else if (event.type === 'stats') {
      this.emit('metrics', { ...m });
    } else if (event.type === 'ended') {
      this.emit('metrics', { ...m });
      if (this.state.phase === 'done') this.finish(this.state.done?.reason ?? 'complete');
    }
  }

  /**
   * The stream failed for good.
   * @param {string} code
   * @param {string} message
   */
  fail(code, message) {
    if (this.endReason !== null) return;
    this.emit('error', { code, message, fatal: true });
    if (!this.state.finished) this.state.phase = 'failed';
    this.client.forget(this);
    this.player?.stop();
    this.decoder?.close();
    this.finish('error');
  }

  /** @param {string} reason */
  finish(reason) {
    if (this.endReason !== null) return;
    this.endReason = reason;
    this.decoder?.close();
    if (!this.options.tap) this.player?.close(); // a tapped player stays for tapped()
    this.emit('ended', { reason });
    this.resolveFinished({ reason, metrics: { ...this.metrics } });
  }
}

/**
 * Client of one chattts-stream server. Streams share one WebSocket; a lost connection is
 * re-opened with backoff and every unfinished stream resumes after its last contiguous seq.
 * @extends {Emitter<{connected: {hello: Record<string, any>}, disconnected: {code: number, reason: string},
 *   error: {code: string, message: string}}>}
 */
export class TTSClient extends Emitter {
  /** @param {ClientOptions} [options] */
  constructor(options = {}) {
    super();
    const base = options.url ?? globalThis.location?.origin;
    if (!base) throw new TypeError('TTSClient needs a url outside a browser page');
    this.url = streamUrl(base, { apiKey: options.apiKey });
    this.WebSocket = options.WebSocket ?? globalThis.WebSocket;
    /** @type {AudioBackend} */
    this.audio = options.audio ?? webAudioBackend;
    this.autoReconnect = options.autoReconnect ?? true;
    this.backoff = new Backoff(options.reconnect);
    this.startThresholdMs = options.startThresholdMs ?? 150;
    this.maxThresholdMs = options.maxThresholdMs ?? 1500;
    this.bufferAdvice = options.bufferAdvice ?? true;
    this.frameMs = options.frameMs ?? 60;
    this.maxStartRetries = options.maxStartRetries ?? 3;
    this.now = options.now ?? (() => globalThis.performance.now());
    /** @type {Map<string, SpeechStream>} unfinished streams by id */
    this.streams = new Map();
    /** @type {Map<number, SpeechStream>} streams on the current connection by slot */
    this.bySlot = new Map();
    /** @type {WebSocket | null} */
    this.ws = null;
    /** @type {Record<string, any> | null} the current connection's `hello` */
    this.hello = null;
    /** @type {SpeechStream[]} resumes sent on this connection and not yet answered, in order */
    this.pendingResumes = [];
    /** @type {number | null} when the connection was lost (for the resume deadline) */
    this.lostAt = null;
    /** @type {ReturnType<typeof setTimeout> | null} */
    this.reconnectTimer = null;
    this.closed = false;
    this.connections = 0;
    /** @type {number | undefined} `hello.resume_ttl_s` of the last connection */
    this.lastResumeTtlS = undefined;
  }

  /** @returns {boolean} a connection is open and greeted */
  get connected() {
    return this.ws !== null && this.hello !== null;
  }

  /**
   * Speak `text`. Call it from a user gesture the first time so the browser lets audio play.
   * @param {string} text
   * @param {SpeakOptions} [options]
   * @returns {SpeechStream}
   */
  speak(text, options = {}) {
    if (this.closed) throw new Error('this client is closed');
    const id = options.id ?? `s${Date.now().toString(36)}${(idCounter++).toString(36)}`;
    if (this.streams.has(id)) throw new Error(`stream id ${id} is live`);
    const stream = new SpeechStream(this, id, text, options);
    this.streams.set(id, stream);
    const wanted = options.format ?? 'auto';
    const guessRate = wanted === 'pcm16' || wanted === 'f32' ? (options.sampleRate ?? 24000) : 48000;
    this.audio.prepare(guessRate); // synchronous: inside the user gesture that called speak()
    stream
      .resolveFormat(this.audio)
      .then(() => this.pump())
      .catch((err) => stream.fail('unsupported', String(err?.message ?? err)));
    this.ensureConnection();
    return stream;
  }

  /**
   * Connect now (speak() connects on its own) and get the server's `hello`: voices, formats.
   * @returns {Promise<Record<string, any>>}
   */
  open() {
    if (this.connected) return Promise.resolve(/** @type {Record<string, any>} */ (this.hello));
    return new Promise((resolve, reject) => {
      const offOk = this.once('connected', ({ hello }) => {
        offFail();
        resolve(hello);
      });
      const offFail = this.once('disconnected', ({ code, reason }) => {
        offOk();
        reject(new Error(`connection closed (${code}${reason ? ` ${reason}` : ''})`));
      });
      this.ensureConnection();
    });
  }

  /** Close the connection and stop every stream. */
  close() {
    this.closed = true;
    if (this.reconnectTimer) clearTimeout(this.reconnectTimer);
    for (const stream of [...this.streams.values()]) stream.cancel();
    this.ws?.close(1000, 'client closed');
    this.ws = null;
  }

  /**
   * Test and demo hook: drop the connection as if the network went away (the client then
   * reconnects and resumes). The socket is closed without telling the rest of the client.
   */
  debugDropConnection() {
    const ws = this.ws;
    if (!ws) return;
    this.lose(ws, 4000, 'dropped by debugDropConnection');
    ws.close(4000, 'dropped');
  }

  // --- internals -----------------------------------------------------------------

  /** @returns {boolean} */
  canSend() {
    return this.connected;
  }

  /** @param {string} text */
  send(text) {
    /** @type {WebSocket} */ (this.ws).send(text);
  }

  /** @param {SpeechStream} stream finished: no more routing */
  forget(stream) {
    this.streams.delete(stream.id);
    if (stream.state.slot !== null && this.bySlot.get(stream.state.slot) === stream) this.bySlot.delete(stream.state.slot);
  }

  ensureConnection() {
    if (this.ws || this.reconnectTimer || this.closed) return;
    this.connect();
  }

  connect() {
    this.reconnectTimer = null;
    const firstToken = [...this.streams.values()].find((s) => s.state.token && !s.state.finished)?.state.token;
    const ws = new this.WebSocket(streamUrl(this.url, { resume: firstToken ?? undefined }));
    ws.binaryType = 'arraybuffer';
    this.ws = ws;
    this.hello = null;
    this.bySlot.clear();
    this.pendingResumes = [];
    this.connections += 1;
    ws.onmessage = (event) => {
      if (this.ws !== ws) return;
      try {
        this.onMessage(event.data);
      } catch (err) {
        // The server broke the protocol on this connection: drop it and resume elsewhere.
        this.emit('error', { code: 'protocol', message: String(/** @type {Error} */ (err)?.message ?? err) });
        this.lose(ws, 4002, 'protocol violation');
        ws.close(4002, 'protocol violation');
      }
    };
    ws.onclose = (event) => {
      if (this.ws === ws) this.lose(ws, event.code, event.reason);
    };
    ws.onerror = () => {}; // a close event follows
  }

  /**
   * The connection `ws` is gone: detach its streams and plan the reconnect.
   * @param {WebSocket} ws
   * @param {number} code
   * @param {string} reason
   */
  lose(ws, code, reason) {
    if (this.ws !== ws) return;
    this.ws = null;
    this.hello = null;
    this.bySlot.clear();
    this.pendingResumes = [];
    this.lostAt = this.lostAt ?? this.now(); // the resume deadline runs from the first loss
    for (const stream of this.streams.values()) {
      if (stream.state.phase === 'live') stream.state.phase = 'detached';
      else if (stream.state.phase === 'starting') stream.state.phase = stream.state.token ? 'detached' : 'pending';
    }
    this.emit('disconnected', { code, reason });
    if (this.closed) return;
    const waiting = [...this.streams.values()].filter((s) => !s.state.finished);
    if (waiting.length === 0) {
      this.lostAt = null;
      return; // nothing to resume; the next speak() connects again
    }
    if (!this.autoReconnect) {
      for (const s of waiting) s.fail('connection_lost', `connection closed (${code} ${reason})`);
      return;
    }
    const ttlMs = 1000 * (this.lastResumeTtlS ?? 30);
    const delay = this.backoff.next(ttlMs - (this.now() - /** @type {number} */ (this.lostAt)));
    if (delay === null) {
      for (const s of waiting) s.fail('connection_lost', `gave up reconnecting after ${this.backoff.attempt} attempts`);
      this.lostAt = null;
      return;
    }
    for (const s of waiting) s.emit('reconnecting', { attempt: this.backoff.attempt, delayMs: delay });
    this.reconnectTimer = setTimeout(() => this.connect(), delay);
  }

  /** Send what the greeted connection owes: resumes, then starts whose format is decided. */
  pump() {
    if (!this.connected) {
      this.ensureConnection();
      return;
    }
    const { resume, restart } = reconnectPlan([...this.streams.values()].map((s) => s.state));
    for (const state of resume) {
      const stream = /** @type {SpeechStream} */ (this.streams.get(state.id));
      if (state.phase !== 'detached') continue;
      const { stream: token, after_seq: afterSeq, ...regenerate } = /** @type {NonNullable<ReturnType<StreamState['resumeRequest']>>} */ (state.resumeRequest());
      state.phase = 'starting';
      this.pendingResumes.push(stream);
      this.send(resumeMessage(token, afterSeq, regenerate));
    }
    for (const state of restart) {
      const stream = /** @type {SpeechStream} */ (this.streams.get(state.id));
      if (state.phase !== 'pending' || !stream.formatReady) continue;
      state.phase = 'starting';
      stream.ensurePlayer();
      this.send(stream.startMessage());
    }
  }

  /** @param {string | ArrayBuffer} data */
  onMessage(data) {
    if (typeof data !== 'string') {
      const frame = parseFrame(data);
      const stream = this.bySlot.get(frame.slot);
      if (!stream) return; // a stream cancelled locally; its last frames may still come
      const verdict = stream.onFrame(frame);
      if (verdict === 'gap') throw new ProtocolViolation(`stream ${stream.id}: seq ${frame.seq} after ${stream.state.lastSeq}`);
      return;
    }
    const msg = parseMessage(data);
    if (msg.type === 'hello') {
      if (msg.protocol !== 1) throw new ProtocolViolation(`server speaks protocol ${msg.protocol}`);
      this.hello = msg;
      this.lastResumeTtlS = msg.resume_ttl_s;
      this.lostAt = null;
      this.backoff.reset();
      this.emit('connected', { hello: msg });
      this.pump();
      return;
    }
    const stream = typeof msg.id === 'string' ? this.streams.get(msg.id) : undefined;
    switch (msg.type) {
      case 'started':
        if (!stream) return;
        this.bySlot.set(msg.slot, stream);
        stream.onStarted(msg);
        return;
      case 'resumed': {
        if (!stream) return;
        this.pendingResumes = this.pendingResumes.filter((s) => s !== stream);
        this.bySlot.set(msg.slot, stream);
        stream.onResumed(msg);
        return;
      }
      case 'segment':
        stream?.onSegment(msg);
        return;
      case 'resume_degraded':
        stream?.emit('degraded', { reason: String(msg.reason ?? '') });
        return;
      case 'done':
        if (!stream) return;
        if (this.bySlot.get(msg.slot) === stream) this.bySlot.delete(msg.slot);
        void stream.onDone(msg);
        return;
      case 'error':
        this.onError(msg, stream);
        return;
      default:
        return; // unknown message types are ignored (forward compatibility)
    }
  }

  /**
   * @param {Record<string, any>} msg
   * @param {SpeechStream | undefined} stream
   */
  onError(msg, stream) {
    if (!stream && (msg.code === 'unknown_stream' || msg.code === 'resume_expired')) {
      // Resume errors carry no id: the server answers resumes in order.
      stream = this.pendingResumes.shift();
      if (stream) {
        stream.fail(msg.code, msg.message);
        return;
      }
    }
    if (!stream) {
      this.emit('error', { code: msg.code, message: msg.message });
      return; // connection-level (e.g. shutting_down: a 1012 close and a reconnect follow)
    }
    if (stream.state.phase === 'starting' && !stream.state.token && RETRYABLE_CODES.includes(msg.code)
      && stream.startRetries < this.maxStartRetries) {
      // Refused start (rate_limited / overloaded): ask again after the server's hint.
      stream.startRetries += 1;
      stream.state.phase = 'pending';
      stream.emit('error', { code: msg.code, message: msg.message, fatal: false });
      setTimeout(() => this.pump(), msg.retry_after_ms ?? 500);
      return;
    }
    if (stream.state.phase === 'live') {
      // engine_error: the last frame and done (reason error) follow.
      stream.emit('error', { code: msg.code, message: msg.message, fatal: false });
      return;
    }
    stream.fail(msg.code, msg.message);
  }
}
