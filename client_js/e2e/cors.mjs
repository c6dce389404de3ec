#!/usr/bin/env node
// A page calls the HTTP API from another origin (issue 25, CORS): headless Chromium opens a page
// on each origin of SPEC.pages and, from it, asks the OpenAI-compatible endpoint for speech
// (JSON body, Authorization header: the browser sends a preflight first), uploads a voice
// (multipart) and deletes it. tests/integration/test_browser.py starts the server and reads
// what each page could do.
//
//   node e2e/cors.mjs SPEC.json OUT.json
//
// SPEC: {"pages": ["http://127.0.0.1:PORT/health", ...], "api": "http://127.0.0.1:PORT/v1",
//        "key": "...", "wav": "<base64 of a WAV recording>", "transcript": "..."}
// OUT:  {"<page>": {"speech": {"status", "bytes"} | {"error"}, "upload": ..., "delete": ...}}

import { readFileSync, writeFileSync } from 'node:fs';
import { launch } from './run.mjs';

/** Runs in the page: every call as a page script makes it (the browser enforces CORS). */
async function callApi({ api, key, wav, transcript }) {
  const auth = { Authorization: `Bearer ${key}` };
  const attempt = async (make) => {
    try {
      return await make();
    } catch (err) {
      return { error: String(err) }; // a CORS refusal: "TypeError: Failed to fetch"
    }
  };
  const speech = await attempt(async () => {
    const res = await fetch(`${api}/audio/speech`, {
      method: 'POST',
      headers: { ...auth, 'Content-Type': 'application/json' },
      body: JSON.stringify({ input: 'Spoken for a page on another origin.', response_format: 'pcm' }),
    });
    return { status: res.status, bytes: (await res.arrayBuffer()).byteLength };
  });
  let id = null;
  const upload = await attempt(async () => {
    const form = new FormData();
    const bytes = Uint8Array.from(atob(wav), (c) => c.charCodeAt(0));
    form.append('audio_sample', new Blob([bytes], { type: 'audio/wav' }), 'me.wav');
    form.append('transcript', transcript);
    const res = await fetch(`${api}/audio/voices`, { method: 'POST', headers: auth, body: form });
    const body = await res.json();
    id = body.id ?? null;
    return { status: res.status, id };
  });
  const remove = await attempt(async () => {
    const res = await fetch(`${api}/audio/voices/${id ?? 'voice_0000000000000000'}`, {
      method: 'DELETE',
      headers: auth,
    });
    return { status: res.status };
  });
  return { speech, upload, delete: remove };
}

async function main() {
  const [specPath, outPath] = process.argv.slice(2);
  const spec = JSON.parse(readFileSync(specPath, 'utf8'));
  const browser = await launch();
  const out = {};
  try {
    for (const url of spec.pages) {
      const page = await browser.newPage();
      await page.goto(url);
      out[url] = await page.evaluate(callApi, spec);
      await page.close();
    }
  } finally {
    await browser.close();
  }
  writeFileSync(outPath, JSON.stringify(out));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
