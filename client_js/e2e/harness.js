// Browser side of the e2e tests: speak with a tap on the player's output and report what the
// audio graph rendered, the stream's events and its metrics.
import { TTSClient, hasWebCodecsOpus } from '../src/index.js';

/** @param {Float32Array} samples */
function toBase64(samples) {
  const bytes = new Uint8Array(samples.buffer, samples.byteOffset, samples.byteLength);
  let text = '';
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

/**
 * @param {{url: string, text: string, format?: string, seed?: number, sampleRate?: number,
 *   startThresholdMs?: number, bufferAdvice?: boolean, dropAfterFrames?: number[], timeoutMs?: number}} spec
 */
window.runScenario = async (spec) => {
  const client = new TTSClient({ url: spec.url, reconnect: { initialMs: 100, maxMs: 1000 } });
  const events = [];
  const connections = [];
  client.on('connected', ({ hello }) => connections.push({ at: performance.now(), protocol: hello.protocol }));
  client.on('disconnected', (e) => events.push({ type: 'disconnected', code: e.code }));
  const stream = client.speak(spec.text, {
    format: spec.format,
    seed: spec.seed,
    sampleRate: spec.sampleRate,
    startThresholdMs: spec.startThresholdMs,
    bufferAdvice: spec.bufferAdvice,
    tap: true,
  });
  const drops = [...(spec.dropAfterFrames ?? [])];
  let frames = 0;
  for (const type of ['started', 'segment', 'playing', 'underrun', 'reconnecting', 'resumed', 'done', 'ended', 'error']) {
    stream.on(type, (payload) => events.push({ type, ...payload }));
  }
  stream.on('audio', () => {
    frames += 1;
    if (drops.length && frames >= drops[0]) {
      drops.shift();
      client.debugDropConnection();
    }
  });
  const timeout = new Promise((_, reject) => setTimeout(() => reject(new Error('scenario timed out')), spec.timeoutMs ?? 60000));
  let result;
  try {
    result = await Promise.race([stream.finished, timeout]);
  } catch (err) {
    client.close();
    return { failed: String(err), events, metrics: stream.metrics, phase: stream.phase, connections: connections.length,
      format: stream.format, lastSeq: stream.state.lastSeq };
  }
  const samples = await stream.tapped();
  client.close();
  return {
    reason: result.reason,
    metrics: result.metrics,
    format: stream.format,
    sampleRate: stream.sampleRate,
    fellBack: stream.fellBack,
    webcodecs: hasWebCodecsOpus(),
    events,
    connections: connections.length,
    samples: toBase64(samples),
    count: samples.length,
  };
};
window.harnessReady = true;
