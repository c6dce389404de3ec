#!/usr/bin/env node
// End-to-end runner: headless Chromium (Debian's, driven by playwright-core) plays streams from
// a running chattts-stream server through the real client and reports what the audio graph
// rendered. tests/integration/test_browser.py starts the server, runs this script and checks
// the samples against the server's audio.
//
//   node e2e/run.mjs SPEC.json OUT.json
//
// SPEC: {"server": "http://127.0.0.1:PORT", "scenarios": [{"name": ..., "text": ..., "seed": ...,
//        "format": "pcm16"|"f32"|"opus", "cutAfterBytes": [n, ...], "dropAfterFrames": [n, ...],
//        "startThresholdMs": ...}],
//        "screenshots": [{"path": "...", "text": "...", "apiKey": "...", ...}]   (optional: the
//        demo page, driven as a user would: see demo() below)}
// A scenario with cutAfterBytes goes through a TCP proxy that kills its WebSocket connections
// abruptly (RST, no close handshake) after forwarding that many bytes to the browser: the first
// number for the first connection, and so on.

import { readFileSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import { chromium } from 'playwright-core';

export const CHROMIUM = process.env.CHROMIUM_PATH || '/usr/bin/chromium';
export const CHROMIUM_ARGS = [
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--autoplay-policy=no-user-gesture-required',
];

/**
 * A TCP proxy in front of the server that can kill WebSocket connections mid-stream.
 * @param {number} targetPort
 * @param {number[]} cuts bytes server→browser after which the n-th WebSocket connection dies
 */
async function startProxy(targetPort, cuts) {
  const sockets = new Set();
  let wsConnections = 0;
  const killed = [];
  const server = net.createServer((client) => {
    const upstream = net.connect(targetPort, '127.0.0.1');
    sockets.add(client);
    sockets.add(upstream);
    let limit = null; // bytes to forward before the kill, for WebSocket connections only
    let forwarded = 0;
    let sniffed = false;
    client.on('data', (chunk) => {
      if (!sniffed) {
        sniffed = true;
        if (chunk.toString('latin1', 0, 64).startsWith('GET /v1/stream')) {
          const index = wsConnections++;
          if (index < cuts.length) limit = cuts[index];
        }
      }
      upstream.write(chunk);
    });
    upstream.on('data', (chunk) => {
      if (limit === null) {
        client.write(chunk);
        return;
      }
      if (limit < 0) return; // cut: drop everything after the kill point
      const room = limit - forwarded;
      if (chunk.length < room) {
        forwarded += chunk.length;
        client.write(chunk);
        return;
      }
      client.write(chunk.subarray(0, Math.max(0, room)));
      killed.push(limit);
      limit = -1;
      forwarded = 0;
      // Nothing more gets through; once the browser has read what was forwarded (a reset
      // discards unread data, which would make the cut point random), the network goes away:
      // both sides are reset, no close handshake.
      upstream.pause();
      setTimeout(() => {
        client.resetAndDestroy();
        upstream.resetAndDestroy();
      }, 150);
    });
    const end = () => {
      client.destroy();
      upstream.destroy();
      sockets.delete(client);
      sockets.delete(upstream);
    };
    client.on('error', end);
    upstream.on('error', end);
    client.on('close', end);
    upstream.on('close', end);
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    port: /** @type {net.AddressInfo} */ (server.address()).port,
    killed,
    close() {
      for (const s of sockets) s.destroy();
      server.close();
    },
  };
}

export async function launch() {
  return chromium.launch({ executablePath: CHROMIUM, headless: true, args: CHROMIUM_ARGS });
}

async function runScenario(browser, serverUrl, scenario) {
  const target = new URL(serverUrl);
  const proxy = scenario.cutAfterBytes ? await startProxy(Number(target.port), scenario.cutAfterBytes) : null;
  const base = proxy ? `http://127.0.0.1:${proxy.port}` : serverUrl;
  const page = await browser.newPage();
  const logs = [];
  page.on('console', (msg) => logs.push(`${msg.type()}: ${msg.text()}`));
  page.on('pageerror', (err) => logs.push(`pageerror: ${err.message}`));
  try {
    await page.goto(`${base}/client_js/e2e/harness.html`);
    await page.waitForFunction(() => window.harnessReady === true);
    const result = await page.evaluate((spec) => window.runScenario(spec), { ...scenario, url: base });
    return { name: scenario.name, ...result, killed: proxy ? proxy.killed : [], logs };
  } catch (err) {
    return { name: scenario.name, failed: String(err?.stack ?? err), logs };
  } finally {
    await page.close();
    proxy?.close();
  }
}

/**
 * The demo page as a user drives it: (type the API key it asks for,) play a text, look at it.
 * spec: {path? (a screenshot), text?, format?, voice?, apiKey? (wait for the page to ask for a
 * key, then type it and press Connect), refused? (the key is wrong: wait for the page to say
 * so), play? (default true), dropAfterMs? (press "Drop connection"), shotAfterMs? (shoot while
 * playing instead of when finished), shotWhen? ({element id: text} the page must show first)}
 */
async function demo(browser, serverUrl, spec) {
  const page = await browser.newPage({ viewport: { width: 1000, height: 720 }, deviceScaleFactor: 1 });
  const logs = [];
  page.on('pageerror', (err) => logs.push(`pageerror: ${err.message}`));
  page.on('console', (msg) => msg.type() === 'error' && logs.push(`console: ${msg.text()}`));
  const text = (selector) => page.evaluate((s) => document.querySelector(s)?.textContent ?? null, selector);
  const stats = () =>
    page.evaluate(() => ({
      ttfa: document.querySelector('#ttfa')?.textContent,
      underruns: document.querySelector('#underruns')?.textContent,
      reconnects: document.querySelector('#reconnects')?.textContent,
      state: document.querySelector('#state')?.textContent,
      format: document.querySelector('#wire-format')?.textContent,
      segments: document.querySelectorAll('#segments li').length,
      connection: document.querySelector('#connection')?.textContent,
      banner: {
        hidden: /** @type {HTMLElement} */ (document.querySelector('#banner')).hidden,
        text: document.querySelector('#banner')?.textContent,
        weights: /** @type {HTMLElement} */ (document.querySelector('#banner')).dataset.weights ?? null,
      },
      voices: [...document.querySelectorAll('#voice option')].map((o) => o.textContent),
    }));
  const out = { name: spec.name ?? null, logs };
  try {
    await page.goto(`${serverUrl}/`);
    if (spec.apiKey !== undefined) {
      // A server with --api-keys refuses the page's first connection (1008): the page asks.
      await page.waitForSelector('#connection.bad', { timeout: 30000 });
      out.beforeKey = { connection: await text('#connection'), playDisabled: await page.isDisabled('#play') };
      await page.fill('#api-key', spec.apiKey);
      await page.click('#connect');
      if (spec.refused) {
        await page.waitForFunction(() => /refused/.test(document.querySelector('#connection.bad')?.textContent ?? ''));
        return { ...out, ...(await stats()), playDisabled: await page.isDisabled('#play') };
      }
    }
    await page.waitForSelector('#play:not([disabled])', { timeout: 60000 });
    if (spec.voice) await page.selectOption('#voice', spec.voice);
    if (spec.play === false) {
      if (spec.path) await page.screenshot({ path: spec.path, fullPage: true });
      return { ...out, ...(await stats()) };
    }
    if (spec.text) await page.fill('#text', spec.text);
    if (spec.format) await page.selectOption('#format', spec.format);
    const clicked = Date.now();
    await page.click('#play');
    if (spec.dropAfterMs !== undefined) {
      await page.waitForTimeout(spec.dropAfterMs);
      await page.click('#drop');
    }
    if (spec.shotAfterMs !== undefined) {
      await page.waitForTimeout(Math.max(0, spec.shotAfterMs - (Date.now() - clicked)));
      if (spec.shotWhen) {
        // What the picture must show, whatever the machine's speed (a resume may take longer).
        await page.waitForFunction(
          (want) => Object.entries(want).every(([id, value]) => document.getElementById(id)?.textContent === value),
          spec.shotWhen,
          { timeout: 30000 },
        );
      }
      if (spec.path) await page.screenshot({ path: spec.path, fullPage: true });
      return { ...out, ...(await stats()) };
    }
    await page.waitForFunction(() => document.querySelector('#state')?.textContent === 'finished', null, {
      timeout: 120000,
    });
    if (spec.path) await page.screenshot({ path: spec.path, fullPage: true });
    return { ...out, ...(await stats()) };
  } catch (err) {
    return { ...out, failed: String(err?.stack ?? err), page: await stats().catch(() => null) };
  } finally {
    await page.close();
  }
}

async function main() {
  const [specPath, outPath] = process.argv.slice(2);
  if (!specPath || !outPath) {
    console.error('usage: node e2e/run.mjs SPEC.json OUT.json');
    process.exit(2);
  }
  const spec = JSON.parse(readFileSync(specPath, 'utf8'));
  const browser = await launch();
  const out = { browser: browser.version(), scenarios: [] };
  try {
    for (const scenario of spec.scenarios ?? []) {
      const started = Date.now();
      const result = await runScenario(browser, scenario.server ?? spec.server, scenario);
      result.wallMs = Date.now() - started;
      out.scenarios.push(result);
      console.error(`[e2e] ${scenario.name}: ${result.failed ? 'FAILED' : result.reason} in ${result.wallMs} ms`);
    }
    out.screenshots = [];
    for (const shot of spec.screenshots ?? []) {
      out.screenshots.push(await demo(browser, shot.server ?? spec.server, shot));
    }
  } finally {
    await browser.close();
  }
  writeFileSync(outPath, JSON.stringify(out));
}

if (import.meta.url === `file://${process.argv[1]}`) {
  main().catch((err) => {
    console.error(err);
    process.exit(1);
  });
}
