// The demo page: speak the text box with the chosen voice and format, show live metrics.
// The API key (a server with --api-keys) goes as `?api_key=`, the one way a browser's WebSocket
// can carry it; a banner says when the server's weights are random (hello.weights).
import { TTSClient } from '/client_js/src/index.js';

const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));
const text = /** @type {HTMLTextAreaElement} */ ($('text'));
const voice = /** @type {HTMLSelectElement} */ ($('voice'));
const format = /** @type {HTMLSelectElement} */ ($('format'));
const seed = /** @type {HTMLInputElement} */ ($('seed'));
const speed = /** @type {HTMLInputElement} */ ($('speed'));
const play = /** @type {HTMLButtonElement} */ ($('play'));
const stop = /** @type {HTMLButtonElement} */ ($('stop'));
const drop = /** @type {HTMLButtonElement} */ ($('drop'));
const apiKey = /** @type {HTMLInputElement} */ ($('api-key'));
const connectButton = /** @type {HTMLButtonElement} */ ($('connect'));
const banner = $('banner');

// This tab only (sessionStorage), so a reload keeps the key and closing the tab forgets it.
const KEY_STORAGE = 'chattts-stream-demo.api-key';
apiKey.value = sessionStorage.getItem(KEY_STORAGE) ?? '';

/** @type {TTSClient} */
let client;
/** @type {import('/client_js/src/client.js').SpeechStream | null} */
let current = null;
const t0 = performance.now();

/** @param {string} line */
function log(line) {
  const el = $('log');
  el.textContent += `${((performance.now() - t0) / 1000).toFixed(2).padStart(7)}s  ${line}\n`;
  el.scrollTop = el.scrollHeight;
}

/** @param {string} state */
function setState(state) {
  const el = $('state');
  el.textContent = state;
  el.className = `value ${state}`;
}

/**
 * @param {string} message
 * @param {'' | 'good' | 'bad'} [tone]
 */
function setConnection(message, tone = '') {
  const el = $('connection');
  el.textContent = message;
  el.className = `connection-state ${tone}`;
}

/**
 * A dev model's random weights make noise: say so, or a user hears noise and cannot tell why.
 * (`hello.weights`: `official`, `unverified`, `random`; absent with the test engine.)
 * @param {Record<string, any>} hello
 */
function showWeights(hello) {
  const random = hello.weights === 'random';
  banner.hidden = !random;
  banner.dataset.weights = hello.weights ?? 'none';
  if (random) {
    const strong = document.createElement('strong');
    strong.textContent = 'Random weights: this is not speech.';
    banner.replaceChildren(
      strong,
      ' The server runs a dev model (--dev-model, make-dev-model): its weights are random numbers, so it plays noise.' +
        ' Serve the real ChatTTS weights to hear speech.',
    );
  }
}

/** @param {number | null} ms */
const fmtMs = (ms) => (ms === null || ms === undefined ? '–' : `${Math.round(ms)} ms`);

/** (Re)connect with the key in the field; the previous client, if any, is closed. */
function connect() {
  current?.cancel();
  client?.close();
  const key = apiKey.value.trim();
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  const mine = new TTSClient({ url: location.origin, apiKey: key || undefined });
  client = mine;
  play.disabled = true;
  setConnection('connecting…');
  mine.on('connected', ({ hello }) => {
    if (mine !== client) return;
    $('server').textContent = `${hello.server} · protocol ${hello.protocol} · formats ${hello.formats.join(', ')}`;
    setConnection(key ? 'connected with the API key' : 'connected', 'good');
    showWeights(hello);
    const chosen = voice.value;
    voice.replaceChildren(
      ...hello.voices.map((/** @type {string} */ name) => new Option(name, name, false, name === chosen)),
    );
    play.disabled = false;
  });
  mine.on('disconnected', ({ code, reason }) => {
    if (mine !== client) return;
    log(`connection closed (${code}${reason ? ` ${reason}` : ''})`);
    if (code === 1008 && /API key/.test(reason)) {
      // The server has --api-keys: ask for one (or say that this one was refused).
      play.disabled = true;
      setConnection(
        key ? 'the server refused this API key: check it, then Connect' : 'this server needs an API key: type it, then Connect',
        'bad',
      );
      apiKey.focus();
    } else if (code === 1008) {
      play.disabled = true;
      setConnection(`refused: ${reason}`, 'bad');
    }
  });
  mine.on('error', ({ code, message }) => log(`error ${code}: ${message}`));
  mine.open().catch((err) => {
    if (mine !== client) return;
    $('server').textContent = `cannot connect: ${err.message}`;
    if (!$('connection').classList.contains('bad')) setConnection(`cannot connect: ${err.message}`, 'bad');
  });
}

connectButton.addEventListener('click', connect);
apiKey.addEventListener('keydown', (event) => {
  if (event.key === 'Enter') connect();
});
connect();

play.addEventListener('click', () => {
  current?.cancel();
  const options = {
    format: /** @type {any} */ (format.value),
    voice: voice.value,
    speed: Number(speed.value) || 1,
    seed: seed.value === '' ? undefined : Number(seed.value),
  };
  // speak() from the click handler: the browser lets the AudioContext start.
  const stream = client.speak(text.value, options);
  current = stream;
  setState('starting');
  for (const id of ['ttfa', 'ttff']) $(id).textContent = '–';
  $('underruns').textContent = '0';
  $('underruns').className = 'value';
  $('reconnects').textContent = '0';
  $('wire-format').textContent = '–';
  $('segments').replaceChildren();
  /** @type {{sample: number, el: HTMLElement}[]} */
  const segments = [];
  stop.disabled = false;
  drop.disabled = false;

  const show = (/** @type {import('/client_js/src/client.js').StreamMetrics} */ m) => {
    if (stream !== current) return;
    $('ttfa').textContent = fmtMs(m.timeToFirstAudioMs);
    $('ttff').textContent = fmtMs(m.timeToFirstFrameMs);
    $('underruns').textContent = String(m.underruns);
    $('underruns').className = m.underruns ? 'value bad' : 'value';
    $('reconnects').textContent = String(m.reconnects);
    $('buffered').textContent = `${Math.round(m.bufferedMs)} ms`;
    $('played').textContent = `${(m.playedMs / 1000).toFixed(2)} s`;
    $('buffer-bar').style.width = `${Math.min(100, m.bufferedMs / 20)}%`;
    const playedSamples = (m.playedMs / 1000) * (stream.sampleRate ?? 24000);
    segments.forEach((s, i) => {
      const next = segments[i + 1]?.sample ?? Number.POSITIVE_INFINITY;
      s.el.className = playedSamples >= next ? 'played' : playedSamples >= s.sample && m.playedMs > 0 ? 'current' : '';
    });
  };

  stream.on('started', (e) => {
    $('wire-format').textContent = `${e.format} ${e.sampleRate / 1000} kHz${stream.fellBack ? ' (fallback)' : ''}`;
    setState('buffering');
    log(`started: ${e.format} at ${e.sampleRate} Hz, slot ${e.slot}`);
  });
  stream.on('segment', (e) => {
    const el = document.createElement('li');
    el.textContent = e.text;
    $('segments').append(el);
    segments.push({ sample: e.sample, el });
  });
  stream.on('playing', (e) => {
    setState('playing');
    log(`first audio after ${Math.round(e.timeToFirstAudioMs)} ms`);
    show(stream.metrics);
  });
  stream.on('metrics', show);
  stream.on('underrun', (m) => {
    log(`underrun #${m.underruns}`);
    show(m);
  });
  stream.on('reconnecting', (e) => {
    setState('reconnecting');
    log(`reconnecting in ${e.delayMs} ms (attempt ${e.attempt})`);
  });
  stream.on('resumed', (e) => {
    setState('playing');
    log(`resumed after seq ${e.afterSeq}`);
  });
  stream.on('done', (e) => log(`done: ${e.reason}, ${e.samples} samples, last seq ${e.lastSeq}`));
  stream.on('error', (e) => log(`stream error ${e.code}: ${e.message}`));
  stream.on('ended', (e) => {
    if (stream !== current) return;
    show(stream.metrics);
    setState(e.reason === 'complete' ? 'finished' : e.reason);
    segments.forEach((s) => (s.el.className = e.reason === 'complete' ? 'played' : s.el.className));
    stop.disabled = true;
    drop.disabled = true;
  });
});

stop.addEventListener('click', () => current?.cancel());
drop.addEventListener('click', () => {
  log('dropping the connection');
  client.debugDropConnection();
});
