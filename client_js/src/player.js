// Web Audio output: one AudioContext per sample rate (so stream samples reach the graph
// unresampled), one AudioWorklet player node per stream, an optional tap node for tests.

import { WebCodecsOpusDecoder, opusDecodingSupported } from './opus.js';

const WORKLET_URL = new URL('./worklets.js', import.meta.url).href;

/** @type {Map<number, {context: AudioContext, ready: Promise<void>}>} */
const contexts = new Map();

/**
 * The AudioContext for `sampleRate`, created on first use; its worklet module starts loading
 * at once. Call it (or {@link unlockAudio}) from a user gesture the first time: browsers keep an
 * AudioContext suspended until the page had one.
 * @param {number} sampleRate
 * @returns {{context: AudioContext, ready: Promise<void>}}
 */
export function audioContextFor(sampleRate) {
  let entry = contexts.get(sampleRate);
  if (!entry || entry.context.state === 'closed') {
    const context = new AudioContext({ sampleRate, latencyHint: 'interactive' });
    const ready = context.audioWorklet.addModule(WORKLET_URL);
    entry = { context, ready };
    contexts.set(sampleRate, entry);
  }
  if (entry.context.state === 'suspended') entry.context.resume().catch(() => {});
  return entry;
}

/**
 * Unlock audio output from a user gesture (click, key press): creates and resumes the context.
 * @param {number} [sampleRate]
 * @returns {Promise<void>} resolves when the context runs
 */
export async function unlockAudio(sampleRate = 48000) {
  const { context, ready } = audioContextFor(sampleRate);
  await Promise.all([context.resume(), ready]);
}

/**
 * Events a player reports (from the worklet).
 * @typedef {{type: 'playing' | 'underrun' | 'stats' | 'ended', buffered?: number, played?: number,
 *   underruns?: number, underrunSamples?: number, state?: string}} PlayerEvent
 */

/** Plays one stream's samples through an AudioWorklet jitter buffer. */
export class StreamPlayer {
  /**
   * @param {object} options
   * @param {number} options.sampleRate the stream's rate (the context runs at it)
   * @param {number} [options.startThresholdMs] samples buffered before playback starts (default 150 ms)
   * @param {number} [options.maxThresholdMs] upper bound of the adaptive threshold (default 1500 ms)
   * @param {boolean} [options.tap] record the played samples (tests); see {@link tapped}
   * @param {(event: PlayerEvent) => void} options.onEvent
   */
  constructor({ sampleRate, startThresholdMs = 150, maxThresholdMs = 1500, tap = false, onEvent }) {
    this.sampleRate = sampleRate;
    this.onEvent = onEvent;
    const { context, ready } = audioContextFor(sampleRate);
    this.context = context;
    /** @type {Float32Array[]} samples pushed before the node exists */
    this.backlog = [];
    this.ended = false;
    this.stopped = false;
    this.pendingThreshold = 0; // samples: an advice that came before the node existed
    /** @type {AudioWorkletNode | null} */
    this.node = null;
    /** @type {AudioWorkletNode | null} */
    this.tapNode = null;
    /** @type {Float32Array[]} */
    this.tapChunks = [];
    /** @type {((chunks: Float32Array[]) => void) | null} */
    this.onFlushed = null;
    this.ready = ready.then(() => {
      if (this.stopped) return;
      const threshold = Math.max(this.pendingThreshold, Math.round((sampleRate * startThresholdMs) / 1000));
      const node = new AudioWorkletNode(context, 'tts-player', {
        numberOfInputs: 0,
        numberOfOutputs: 2,
        outputChannelCount: [1, 1],
        processorOptions: {
          threshold,
          maxThreshold: Math.max(threshold, Math.round((sampleRate * maxThresholdMs) / 1000)),
        },
      });
      node.port.onmessage = (event) => this.onEvent(event.data);
      if (tap) {
        const tapNode = new AudioWorkletNode(context, 'tts-tap', {
          numberOfInputs: 2,
          numberOfOutputs: 1,
          outputChannelCount: [1],
          channelCount: 1,
          channelCountMode: 'explicit',
          channelInterpretation: 'discrete',
        });
        tapNode.port.onmessage = (event) => {
          this.tapChunks.push(...event.data.chunks);
          if (event.data.type === 'flushed' && this.onFlushed) this.onFlushed(this.tapChunks);
        };
        node.connect(tapNode, 0, 0);
        node.connect(tapNode, 1, 1);
        tapNode.connect(context.destination);
        this.tapNode = tapNode;
      } else {
        node.connect(context.destination, 0);
      }
      this.node = node;
      for (const samples of this.backlog) this.post(samples);
      this.backlog = [];
      if (this.ended) node.port.postMessage({ type: 'end' });
    });
  }

  /** @param {Float32Array} samples */
  post(samples) {
    const copy = samples.byteOffset === 0 && samples.byteLength === samples.buffer.byteLength ? samples : samples.slice();
    /** @type {AudioWorkletNode} */ (this.node).port.postMessage({ type: 'push', samples: copy }, [copy.buffer]);
  }

  /** @param {Float32Array} samples the stream's next samples */
  push(samples) {
    if (this.stopped || this.ended || samples.length === 0) return;
    if (this.node) this.post(samples);
    else this.backlog.push(samples.slice());
  }

  /**
   * Start playback only once this much audio is buffered (the server's `started.buffer_ms`);
   * raises the start threshold, never lowers it.
   * @param {number} ms
   */
  setStartThreshold(ms) {
    const threshold = Math.round((this.sampleRate * ms) / 1000);
    if (this.node) this.node.port.postMessage({ type: 'threshold', threshold });
    else this.pendingThreshold = Math.max(this.pendingThreshold, threshold);
  }

  /** No more samples: play out the buffer. */
  end() {
    if (this.ended) return;
    this.ended = true;
    this.node?.port.postMessage({ type: 'end' });
  }

  /** Stop at once (cancel): the buffer is dropped. */
  stop() {
    this.stopped = true;
    this.ended = true;
    this.node?.port.postMessage({ type: 'stop' });
  }

  /** @returns {Promise<Float32Array>} every sample the graph played so far (needs `tap`) */
  async tapped() {
    await this.ready;
    if (!this.tapNode) throw new Error('this player was created without tap: true');
    const chunks = await new Promise((resolve) => {
      this.onFlushed = resolve;
      /** @type {AudioWorkletNode} */ (this.tapNode).port.postMessage({ type: 'flush' });
    });
    const total = chunks.reduce((n, c) => n + c.length, 0);
    const out = new Float32Array(total);
    let at = 0;
    for (const c of chunks) {
      out.set(c, at);
      at += c.length;
    }
    return out;
  }

  /** Disconnect the nodes (after the stream ended). */
  close() {
    this.stopped = true;
    this.node?.disconnect();
    this.tapNode?.port.postMessage({ type: 'close' });
    this.tapNode?.disconnect();
  }
}

/**
 * The browser audio backend of {@link TTSClient}: Web Audio players and WebCodecs Opus.
 * Node tests pass a fake with the same shape.
 * @type {import('./client.js').AudioBackend}
 */
export const webAudioBackend = {
  prepare(sampleRate) {
    audioContextFor(sampleRate);
  },
  opusSupported(sampleRate) {
    return opusDecodingSupported(sampleRate);
  },
  createPlayer(options) {
    return new StreamPlayer(options);
  },
  createOpusDecoder(options) {
    return new WebCodecsOpusDecoder(options);
  },
};
