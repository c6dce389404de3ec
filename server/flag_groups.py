"""The topics ``chattts-stream serve --help`` lists its flags under, in the order an operator needs them.

A flat list of ninety flags hides the few that matter; each topic here is an argparse argument
group with a one-line description. Every field of :class:`server.config.Settings` belongs to exactly
one topic: :func:`group_of` refuses a field that has none, so a new flag cannot slip into argparse's
untitled "options" list (``tests/unit/test_serve_help_groups.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlagGroup:
    """One topic of ``serve --help``: its title, a line saying what it is for, its fields in help order."""

    title: str
    description: str
    fields: tuple[str, ...]


def _group(title: str, description: str, fields: str) -> FlagGroup:
    return FlagGroup(title, description, tuple(fields.split()))


GROUPS: tuple[FlagGroup, ...] = (
    _group(
        "Network and protocols",
        "where the server listens and which APIs it speaks",
        "host port http_port elevenlabs elevenlabs_seed wyoming_port wyoming_seed",
    ),
    _group(
        "Model and engine",
        "which weights, on which device, in which precision, and how the token step runs",
        "engine model_dir dev_model verify_weights cache_dir device profile dtype quantize vocoder_dtype "
        "compile_step cuda_graphs warmup engine_process frontend_processes frontend_priority engine_socket "
        "sibling_ports",
    ),
    _group(
        "CPU threads",
        "how torch's threads use the CPU (a CPU server's speed depends on these)",
        "threads engine_cpus omp_wait_policy omp_spin_count",
    ),
    _group(
        "Batching and scheduling",
        "how many streams share a step, how the work is cut into blocks, when new streams are refused",
        "max_batch max_queue max_wait_ms block_schedule quantum_tokens overlap_quanta segment_max_chars "
        "segment_max_tokens segment_lookahead lookahead_lead_s prefill_bucket cache_bytes breaker_threshold "
        "breaker_probe_s",
    ),
    _group(
        "Text, refinement and voices",
        "incremental text, ChatTTS's refinement pass, and voices made from recordings",
        "max_buffer_delay_ms refine_max_tokens voices_dir voices_max voices_max_bytes voice_max_seconds "
        "voice_upload_max_bytes",
    ),
    _group(
        "Audio formats",
        "the encoders' settings",
        "opus_bitrate opus_complexity ogg_page_ms mp3_bitrate encode_threads",
    ),
    _group(
        "Limits and memory",
        "what one client may send, hold and open, and how long the server waits for it",
        "max_text_chars max_pending_chars max_streams max_connections max_connections_per_client "
        "rate_limit_per_min rate_limit_burst max_message_bytes max_json_depth invalid_messages_per_s "
        "memory_budget_bytes max_buffered_s send_timeout_s header_timeout_s body_timeout_s close_timeout_s "
        "wyoming_idle_timeout_s wyoming_text_timeout_s fd_reserve",
    ),
    _group(
        "Security",
        "API keys, browser origins, client addresses",
        "api_keys api_keys_file allowed_origins trust_forwarded_for wyoming_allow_unauthenticated",
    ),
    _group(
        "Resume, replicas and shutdown",
        "how long a cut stream can be resumed, resume on any replica, the drain on SIGTERM",
        "resume_ttl_s replay_max_s replay_max_bytes replay_total_bytes max_ended_streams_per_client "
        "max_ended_streams resume_secret resume_secret_file advertise_url forward_allow forward_timeout_s "
        "drain_timeout_s",
    ),
    _group("Observability", "the log (the metrics are GET /metrics: no flag)", "log_level"),
    _group("Development", "the fake engine's speed (--engine fake)", "fake_step_ms fake_row_ms fake_host_ms"),
)

_GROUP_OF = {name: group for group in GROUPS for name in group.fields}


def group_of(field_name: str) -> FlagGroup:
    """The topic of a ``Settings`` field; a field with none is a programming error, named here."""
    try:
        return _GROUP_OF[field_name]
    except KeyError:
        raise ValueError(
            f"Settings.{field_name} has no topic in serve --help: add it to a group of server/flag_groups.py"
        ) from None
