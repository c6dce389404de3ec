// Wire protocol v1 (docs/protocol.md): audio frame headers, control messages, payload decoding.
// Pure functions only: no sockets, no Web Audio; runs in browsers, worklets and Node.

/** Protocol version this client speaks (`hello.protocol`, header byte 0). */
export const PROTOCOL_VERSION = 1;
/** Size of the binary audio frame header in bytes. */
export const HEADER_SIZE = 12;
/** Header flag bit 0: the last frame of the stream. */
export const FLAG_LAST = 0x01;
/** Header flag bit 1: the frame holds the first sample of a new text segment. */
export const FLAG_SEGMENT_START = 0x02;
/** Audio formats of the protocol. */
export const FORMATS = Object.freeze(['pcm16', 'f32', 'opus', 'ogg']);

/**
 * One binary audio frame.
 * @typedef {object} Frame
 * @property {number} version  header byte 0 (1)
 * @property {number} flags    raw flag bits
 * @property {boolean} last    flag bit 0: last frame of the stream
 * @property {boolean} segmentStart flag bit 1: first frame of a new text segment
 * @property {number} slot     stream slot on this connection
 * @property {number} seq      per-stream sequence number, 0, 1, 2, ...
 * @property {number} sample   offset of the first sample from the stream start (output rate)
 * @property {Uint8Array} payload the bytes after the header (a view, not a copy)
 */

/**
 * Parse a binary frame (12-byte little-endian header, then the payload).
 * @param {ArrayBuffer | ArrayBufferView} data
 * @returns {Frame}
 * @throws {ProtocolViolation} shorter than the header or an unknown version
 */
export function parseFrame(data) {
  const bytes = toBytes(data);
  if (bytes.byteLength < HEADER_SIZE) {
    throw new ProtocolViolation(`frame of ${bytes.byteLength} bytes is shorter than the ${HEADER_SIZE}-byte header`);
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, HEADER_SIZE);
  const version = view.getUint8(0);
  if (version !== PROTOCOL_VERSION) {
    throw new ProtocolViolation(`unknown frame version ${version}`);
  }
  const flags = view.getUint8(1);
  return {
    version,
    flags,
    last: (flags & FLAG_LAST) !== 0,
    segmentStart: (flags & FLAG_SEGMENT_START) !== 0,
    slot: view.getUint16(2, true),
    seq: view.getUint32(4, true),
    sample: view.getUint32(8, true),
    payload: bytes.subarray(HEADER_SIZE),
  };
}

/**
 * Build a binary frame (for tests and tools; the server is the only real sender).
 * @param {{flags?: number, slot?: number, seq: number, sample: number, version?: number}} header
 * @param {Uint8Array} [payload]
 * @returns {Uint8Array}
 */
export function packFrame(header, payload = new Uint8Array(0)) {
  const out = new Uint8Array(HEADER_SIZE + payload.byteLength);
  const view = new DataView(out.buffer);
  view.setUint8(0, header.version ?? PROTOCOL_VERSION);
  view.setUint8(1, header.flags ?? 0);
  view.setUint16(2, header.slot ?? 0, true);
  view.setUint32(4, header.seq, true);
  view.setUint32(8, header.sample, true);
  out.set(payload, HEADER_SIZE);
  return out;
}

/**
 * Samples of a PCM payload as float32 in [-1, 1): `pcm16` → s16 / 32768 (exact), `f32` as is.
 * Always returns a fresh array (safe to transfer to a worklet).
 * @param {Uint8Array} payload
 * @param {'pcm16' | 'f32'} format
 * @returns {Float32Array}
 */
export function decodePcm(payload, format) {
  const view = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
  if (format === 'pcm16') {
    if (payload.byteLength % 2) throw new ProtocolViolation('pcm16 payload with an odd byte count');
    const out = new Float32Array(payload.byteLength / 2);
    for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32768;
    return out;
  }
  if (format === 'f32') {
    if (payload.byteLength % 4) throw new ProtocolViolation('f32 payload not a multiple of 4 bytes');
    const out = new Float32Array(payload.byteLength / 4);
    for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
    return out;
  }
  throw new TypeError(`not a PCM format: ${format}`);
}

/** Bytes per sample of a PCM format (`sample` header offsets count samples, not bytes). */
export const PCM_BYTES = Object.freeze({ pcm16: 2, f32: 4 });

/**
 * Options of a `start` message (docs/protocol.md, "Client to server").
 * @typedef {object} StartOptions
 * @property {string} [voice]
 * @property {number} [speed]
 * @property {'pcm16'|'f32'|'opus'|'ogg'} [format]
 * @property {number} [sample_rate]
 * @property {number} [seed]
 * @property {number} [temperature]
 * @property {number} [top_p]
 * @property {number} [top_k]
 */

const START_FIELDS = ['voice', 'speed', 'format', 'sample_rate', 'seed', 'temperature', 'top_p', 'top_k', 'frame_ms'];

/**
 * The `start` message as an object; undefined options are left out (the server's defaults apply).
 * @param {string} id
 * @param {string} text
 * @param {StartOptions} [options]
 * @returns {Record<string, unknown>}
 */
export function startFields(id, text, options = {}) {
  /** @type {Record<string, unknown>} */
  const msg = { type: 'start', id, text };
  for (const key of START_FIELDS) {
    const value = /** @type {Record<string, unknown>} */ (options)[key];
    if (value !== undefined && value !== null && value !== '') msg[key] = value;
  }
  return msg;
}

/**
 * The `start` message; undefined options are left out (the server's defaults apply).
 * @param {string} id
 * @param {string} text
 * @param {StartOptions} [options]
 * @returns {string} JSON text
 */
export function startMessage(id, text, options = {}) {
  return JSON.stringify(startFields(id, text, options));
}

/**
 * @param {string} id
 * @returns {string} JSON text of a `cancel` message
 */
export function cancelMessage(id) {
  return JSON.stringify({ type: 'cancel', id });
}

/**
 * @param {string} token the stream token from `started`
 * @param {number} afterSeq last seq received with no gap before it (-1 for none)
 * @param {{request?: Record<string, unknown>, segment?: number, segment_sample?: number}} [regenerate]
 *   what a replica that no longer holds the stream needs to regenerate it: the `start` request
 *   with its seed, and the last segment taken (docs/protocol.md, Resume on any replica)
 * @returns {string} JSON text of a `resume` message
 */
export function resumeMessage(token, afterSeq, regenerate = {}) {
  return JSON.stringify({ type: 'resume', stream: token, after_seq: afterSeq, ...regenerate });
}

/**
 * Parse a server text frame.
 * @param {string} text
 * @returns {{type: string, [key: string]: any}}
 * @throws {ProtocolViolation} not JSON or no string `type`
 */
export function parseMessage(text) {
  let msg;
  try {
    msg = JSON.parse(text);
  } catch {
    throw new ProtocolViolation('server sent a text frame that is not JSON');
  }
  if (msg === null || typeof msg !== 'object' || typeof msg.type !== 'string') {
    throw new ProtocolViolation('server message without a string "type"');
  }
  return msg;
}

/** Error codes after which retrying the same request may help (`retry_after_ms`). */
export const RETRYABLE_CODES = Object.freeze(['rate_limited', 'overloaded']);

/**
 * The WebSocket URL for the stream endpoint, with `?resume=<token>` for load-balancer affinity
 * and `?api_key=` where the server wants a key (browsers cannot set WebSocket headers). Other
 * query parameters of `base` are kept.
 * @param {string} base `ws://host:port/v1/stream` or an http(s) page URL / origin
 * @param {{resume?: string, apiKey?: string}} [params]
 * @returns {string}
 */
export function streamUrl(base, params = {}) {
  const url = new URL(base);
  if (url.protocol === 'http:') url.protocol = 'ws:';
  if (url.protocol === 'https:') url.protocol = 'wss:';
  if (!url.pathname.endsWith('/v1/stream')) url.pathname = '/v1/stream';
  url.hash = '';
  url.searchParams.delete('resume');
  if (params.apiKey) url.searchParams.set('api_key', params.apiKey);
  if (params.resume) url.searchParams.set('resume', params.resume);
  return url.toString();
}

/** The server broke the protocol (malformed frame or message). */
export class ProtocolViolation extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = 'ProtocolViolation';
  }
}

/**
 * @param {ArrayBuffer | ArrayBufferView} data
 * @returns {Uint8Array}
 */
function toBytes(data) {
  if (data instanceof Uint8Array) return data;
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  return new Uint8Array(data);
}
