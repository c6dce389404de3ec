// AudioWorklet processors (loaded with audioWorklet.addModule; not for the main thread).
//
// `tts-player`: renders one stream from its jitter buffer. Output 0 is the audio, output 1 a
//   gate (1.0 where output 0 holds stream samples, 0.0 for silence before the start, during an
//   underrun and after the end). Samples arrive from the main thread with
//   {type: 'push', samples: Float32Array}; {type: 'end'} and {type: 'stop'} finish the stream.
// `tts-tap`: passes input 0 through to output 0 and records the gated samples, so tests can
//   compare exactly what the graph played with what the server sent.

import { JitterBuffer } from './jitter-buffer.js';

/* global AudioWorkletProcessor, registerProcessor, sampleRate, currentTime, currentFrame */

class PlayerProcessor extends AudioWorkletProcessor {
  /** @param {{processorOptions?: {threshold?: number, maxThreshold?: number, adapt?: number, statsMs?: number}}} options */
  constructor(options) {
    super();
    const o = options.processorOptions ?? {};
    this.jb = new JitterBuffer({
      threshold: o.threshold ?? Math.round(sampleRate * 0.15),
      maxThreshold: o.maxThreshold,
      adapt: o.adapt ?? 1.5,
    });
    this.statsBlocks = Math.max(1, Math.round((sampleRate * (o.statsMs ?? 100)) / 1000 / 128));
    this.blocks = 0;
    this.underrunsSent = 0;
    this.announced = false;
    this.finished = false;
    this.port.onmessage = (event) => {
      const msg = event.data;
      if (msg.type === 'push') this.jb.push(msg.samples);
      else if (msg.type === 'end') this.jb.end();
      else if (msg.type === 'stop') this.jb.stop();
      else if (msg.type === 'threshold') this.jb.raiseThreshold(msg.threshold);
    };
  }

  stats() {
    const jb = this.jb;
    return {
      state: jb.state,
      buffered: jb.buffered,
      played: jb.played,
      received: jb.received,
      underruns: jb.underruns,
      underrunSamples: jb.underrunSamples,
      threshold: jb.threshold,
    };
  }

  /**
   * @param {Float32Array[][]} _inputs
   * @param {Float32Array[][]} outputs
   */
  process(_inputs, outputs) {
    const out = outputs[0][0];
    const gate = outputs[1] && outputs[1][0];
    const n = this.jb.render(out);
    if (gate) {
      gate.fill(1, 0, n);
      gate.fill(0, n);
    }
    if (n > 0 && !this.announced) {
      this.announced = true;
      this.port.postMessage({ type: 'playing', contextTime: currentTime, frame: currentFrame });
    }
    if (this.jb.underruns !== this.underrunsSent) {
      this.underrunsSent = this.jb.underruns;
      this.port.postMessage({ type: 'underrun', ...this.stats() });
    }
    this.blocks += 1;
    if (this.blocks % this.statsBlocks === 0) this.port.postMessage({ type: 'stats', ...this.stats() });
    if (this.jb.state === 'ended' && !this.finished) {
      this.finished = true;
      this.port.postMessage({ type: 'ended', ...this.stats() });
    }
    return !this.finished;
  }
}

class TapProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    /** @type {Float32Array[]} */
    this.chunks = [];
    this.count = 0;
    this.done = false;
    this.port.onmessage = (event) => {
      if (event.data.type === 'flush') this.flush(true);
      else if (event.data.type === 'close') this.done = true;
    };
  }

  /** @param {boolean} reply */
  flush(reply) {
    const chunks = this.chunks;
    this.chunks = [];
    this.count = 0;
    if (chunks.length || reply) this.port.postMessage({ type: reply ? 'flushed' : 'samples', chunks });
  }

  /**
   * @param {Float32Array[][]} inputs
   * @param {Float32Array[][]} outputs
   */
  process(inputs, outputs) {
    const audio = inputs[0] && inputs[0][0];
    const gate = inputs[1] && inputs[1][0];
    const out = outputs[0] && outputs[0][0];
    if (audio && out) out.set(audio);
    if (audio && gate) {
      let n = 0;
      for (let i = 0; i < gate.length; i++) if (gate[i] > 0.5) n++;
      if (n) {
        const kept = new Float32Array(n);
        let j = 0;
        for (let i = 0; i < gate.length; i++) if (gate[i] > 0.5) kept[j++] = audio[i];
        this.chunks.push(kept);
        this.count += n;
        if (this.count >= 16384) this.flush(false);
      }
    }
    return !this.done;
  }
}

registerProcessor('tts-player', PlayerProcessor);
registerProcessor('tts-tap', TapProcessor);
