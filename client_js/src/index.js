// chattts-stream browser client: `new TTSClient({url}).speak(text, options)`.
export { TTSClient, SpeechStream } from './client.js';
export { StreamPlayer, audioContextFor, unlockAudio, webAudioBackend } from './player.js';
export { OpusTimeline, WebCodecsOpusDecoder, defaultPreskip, hasWebCodecsOpus, opusDecodingSupported } from './opus.js';
export { JitterBuffer, SampleRing } from './jitter-buffer.js';
export { Backoff, StreamState, reconnectPlan } from './stream-state.js';
export * from './protocol.js';
