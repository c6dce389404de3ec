// Opus: turning decoded packets into exactly the stream's samples (pre-skip and end trim), and
// a WebCodecs AudioDecoder wrapper. The timeline part is pure and tested in Node.
//
// Server rule (server/audio/opus.py): decode every packet in order; the first L decoded samples
// (the encoder lookahead, "pre-skip": 156 at 24 kHz, 312 at 48 kHz, 104 at 16 kHz) are not
// stream audio; packet k carries the stream interval [k·F − L, (k+1)·F − L) ∩ [0, N), and its
// header `sample` is max(0, k·F − L). Only the first and the last packet are partial. F is the
// stream's packet length (`started.frame_ms`: 20 ms unless the start asked for 40 or 60).

/** The libopus encoder lookahead (6.5 ms) in samples at `sampleRate`. */
export function defaultPreskip(sampleRate) {
  return Math.round((sampleRate * 65) / 10000);
}

/** Maps decoded packets onto the stream timeline; releases samples in order once certain. */
export class OpusTimeline {
  /**
   * @param {object} options
   * @param {number} options.sampleRate the stream's (and the decoder's output) rate
   * @param {number} [options.preskip] decoded samples to drop at the start (default: 6.5 ms)
   * @param {number} [options.frameMs] each packet's length (default 20; `setFrameMs` once `started` says)
   */
  constructor({ sampleRate, preskip, frameMs }) {
    this.sampleRate = sampleRate;
    this.frameSamples = (sampleRate * (frameMs ?? 20)) / 1000;
    this.preskip = preskip ?? defaultPreskip(sampleRate);
    this.preskipConfirmed = preskip !== undefined;
    /** @type {Map<number, {sample: number, last: boolean}>} header facts by seq */
    this.packets = new Map();
    /** @type {{seq: number, samples: Float32Array}[]} decoded, not yet released */
    this.queue = [];
    this.emitted = 0; // stream samples released so far
    /** @type {number | null} the stream's total samples (`done.samples`) */
    this.total = null;
  }

  /**
   * The stream's packet length, from `started.frame_ms` (before its first packet arrives).
   * @param {number} frameMs
   */
  setFrameMs(frameMs) {
    this.frameSamples = (this.sampleRate * frameMs) / 1000;
  }

  /**
   * Record a packet's header (call when the frame arrives, before decoding it).
   * @param {{seq: number, sample: number, last: boolean}} frame
   */
  packet(frame) {
    this.packets.set(frame.seq, { sample: frame.sample, last: frame.last });
    if (frame.seq === 1 && frame.sample > 0) {
      // Packet 1 starts at F − L on the stream timeline: this states the pre-skip exactly.
      this.preskip = this.frameSamples - frame.sample;
      this.preskipConfirmed = true;
    }
  }

  /**
   * A packet's decoded samples (in seq order).
   * @param {number} seq
   * @param {Float32Array} samples
   * @returns {Float32Array[]} stream samples to play now, in order
   */
  decoded(seq, samples) {
    this.queue.push({ seq, samples });
    return this.release();
  }

  /**
   * The stream's total length is known (`done.samples`): release the rest, cut at the end.
   * @param {number} total
   * @returns {Float32Array[]}
   */
  end(total) {
    this.total = total;
    this.preskipConfirmed = true; // no packet 1 will come to tell otherwise
    return this.release();
  }

  /** @returns {Float32Array[]} */
  release() {
    /** @type {Float32Array[]} */
    const out = [];
    while (this.queue.length) {
      const { seq, samples } = this.queue[0];
      const meta = this.packets.get(seq);
      if (seq === 0 && !this.preskipConfirmed) break; // wait for packet 1's header or the end
      if (meta?.last && this.total === null) break; // the end trim needs done.samples
      // Where this packet's decoded output lies on the stream timeline.
      const start = seq === 0 ? -this.preskip : (meta?.sample ?? seq * this.frameSamples - this.preskip);
      const from = Math.max(this.emitted, start, 0);
      const limit = this.total ?? Number.POSITIVE_INFINITY;
      const to = Math.min(start + samples.length, limit);
      if (to > from) {
        out.push(samples.subarray(from - start, to - start));
        this.emitted = to;
      }
      this.queue.shift();
      this.packets.delete(seq);
    }
    return out;
  }
}

/** @returns {boolean} WebCodecs AudioDecoder exists here */
export function hasWebCodecsOpus() {
  return typeof globalThis.AudioDecoder === 'function' && typeof globalThis.EncodedAudioChunk === 'function';
}

/**
 * @param {number} sampleRate
 * @returns {Promise<boolean>} WebCodecs can decode mono Opus at this rate
 */
export async function opusDecodingSupported(sampleRate = 48000) {
  if (!hasWebCodecsOpus()) return false;
  try {
    const { supported } = await globalThis.AudioDecoder.isConfigSupported({
      codec: 'opus',
      sampleRate,
      numberOfChannels: 1,
    });
    return Boolean(supported);
  } catch {
    return false;
  }
}

/**
 * Decode raw Opus packets with WebCodecs and hand on exactly the stream's samples.
 * WebCodecs' Opus output is 48 kHz, so the stream must be requested at 48000.
 */
export class WebCodecsOpusDecoder {
  /**
   * @param {object} options
   * @param {number} options.sampleRate the stream's rate (must equal the decoder output: 48000)
   * @param {(samples: Float32Array) => void} options.onSamples stream samples, in order
   * @param {(error: Error) => void} options.onError
   * @param {number} [options.frameMs] the packet length asked for (`setFrameMs` when `started` says)
   */
  constructor({ sampleRate, onSamples, onError, frameMs }) {
    this.sampleRate = sampleRate;
    this.timeline = new OpusTimeline({ sampleRate, frameMs });
    this.onSamples = onSamples;
    this.onError = onError;
    this.closed = false;
    this.decoder = new globalThis.AudioDecoder({
      output: (/** @type {AudioData} */ data) => this.output(data),
      error: (/** @type {Error} */ err) => {
        if (!this.closed) this.onError(err);
      },
    });
    this.decoder.configure({ codec: 'opus', sampleRate, numberOfChannels: 1 });
  }

  /** @param {import('./protocol.js').Frame} frame a frame of an `opus` stream */
  push(frame) {
    if (this.closed) return;
    this.timeline.packet(frame);
    // Timestamps carry the seq (µs, one packet's length apart) so each output maps back to its
    // packet. They must be the packets' true length: a decoder may time its outputs by the audio
    // it made, and 60 ms packets stamped 20 ms apart then map to the wrong packets.
    const packetUs = this.packetUs();
    const chunk = new globalThis.EncodedAudioChunk({
      type: 'key',
      timestamp: frame.seq * packetUs,
      duration: packetUs,
      data: frame.payload,
    });
    this.decoder.decode(chunk);
  }

  /** @param {AudioData} data */
  output(data) {
    try {
      if (this.closed) return;
      if (data.sampleRate !== this.sampleRate) {
        throw new Error(`Opus decoder gave ${data.sampleRate} Hz audio for a ${this.sampleRate} Hz stream`);
      }
      const samples = new Float32Array(data.numberOfFrames);
      data.copyTo(samples, { planeIndex: 0, format: 'f32-planar' });
      const seq = Math.round(data.timestamp / this.packetUs());
      for (const part of this.timeline.decoded(seq, samples)) this.onSamples(part);
    } catch (err) {
      this.onError(/** @type {Error} */ (err));
    } finally {
      data.close();
    }
  }

  /** @param {number} frameMs the packet length `started` announced */
  setFrameMs(frameMs) {
    this.timeline.setFrameMs(frameMs);
  }

  /** @returns {number} one packet's length in µs (the stream's `frame_ms`) */
  packetUs() {
    return Math.round((1e6 * this.timeline.frameSamples) / this.sampleRate);
  }

  /**
   * No more packets; `total` is `done.samples`. Resolves once every sample was handed on.
   * @param {number} total
   */
  async end(total) {
    if (this.closed) return;
    await this.decoder.flush();
    for (const part of this.timeline.end(total)) this.onSamples(part);
  }

  close() {
    this.closed = true;
    if (this.decoder.state !== 'closed') this.decoder.close();
  }
}
