"""The soaks (``python -m bench.soak``): mixed requests, start/cancel churn, ElevenLabs interruptions."""
