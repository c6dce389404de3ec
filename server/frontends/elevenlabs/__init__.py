"""ElevenLabs' text-to-speech API (WebSockets stream-input, multi-stream-input; REST), a front end."""
