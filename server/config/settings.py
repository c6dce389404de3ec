"""The server's settings: every field of the frozen ``Settings`` is a ``serve`` flag and a variable.

Every field of :class:`Settings` is a ``serve`` flag (``--max-batch``) and an environment
variable (``CHATTTS_MAX_BATCH``), declared here with its default, help and choices;
:mod:`server.config.reader` reads them (a flag wins over the variable, which wins over the
default). :mod:`server.engine.flags` turns the engine's flags into its options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from server.engine.chattts.options import QUANTIZE_CHOICES, VOCODER_DTYPE_CHOICES

ENV_PREFIX = "CHATTTS_"
#: The server's version (``hello.server``, the Wyoming ``info``).
VERSION = "0.1.0"


#: ``--omp-spin-count`` (why: bench/results/studies/omp-spin-epyc-2core.md); the variables libgomp's
#: waits obey.
DEFAULT_OMP_SPIN_COUNT = 10_000
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
#: ``--profile``'s values, the default first (what each sets: :mod:`server.engine.profiles`).
PROFILE_CHOICES = ("realtime", "eager", "exact")


def _opt(default: Any, help_text: str, *, choices: Sequence[str] | None = None) -> Any:
    return field(default=default, metadata={"help": help_text, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything configurable about one server process (see ``chattts-stream serve --help``)."""

    host: str = _opt("127.0.0.1", "interface to listen on (0.0.0.0 for all)")
    port: int = _opt(8080, "TCP port for WebSocket and HTTP")
    http_port: int = _opt(
        -1,
        "TCP port of the OpenAI-compatible HTTP API (/v1/audio/speech); "
        "-1: --port + 1 (ephemeral when --port is 0), 0: off",
    )
    wyoming_port: int = _opt(
        0, "TCP port of the Wyoming server for Home Assistant (no API keys there); 0: off, -1: any free port"
    )
    wyoming_seed: int = _opt(
        0, "sampling seed of every Wyoming request: the same text and voice give the same audio (-1: random)"
    )
    wyoming_allow_unauthenticated: bool = _opt(
        False,
        "serve Wyoming on a non-loopback --host although API keys are set (Wyoming has no keys: "
        "firewall the port or keep it on a private network)",
    )
    elevenlabs: bool = _opt(
        True, "serve ElevenLabs' text-to-speech API (WebSocket and REST) on the HTTP API's port"
    )
    elevenlabs_seed: int = _opt(
        -1, "sampling seed of ElevenLabs requests that send none (-1: random, as ElevenLabs samples)"
    )
    engine: str = _opt("chattts", "inference engine: ChatTTS or the test engine", choices=("chattts", "fake"))
    model_dir: str = _opt("", "ChatTTS asset folder; empty = fetch the official weights once into the cache")
    dev_model: str = _opt(
        "",
        "serve RANDOM weights of this size (made once in the cache) where the real ones cannot be had",
        choices=("", "tiny", "full"),
    )
    verify_weights: str = _opt(
        "official",
        "official: refuse weights whose sha256 differ from ChatTTS's official map; none: load any folder "
        "in ChatTTS's layout (fine-tuned checkpoints), logged and reported as unverified",
        choices=("official", "none"),
    )
    cache_dir: str = _opt("", "where downloaded weights are kept (default: ~/.cache/chattts-stream)")
    device: str = _opt("auto", "torch device for the model: auto, cpu, cuda, cuda:N")
    profile: str = _opt(
        "realtime",
        "the token step's form in one name (flags given explicitly win; the start-up log names what it "
        "set): realtime: the fastest step (CPU: --compile-step on --quantize w8a8, a compile of minutes "
        "at the first start, kept in the cache dir; CUDA: CUDA graphs); eager: nothing compiled or "
        "quantized, ready in seconds, slower on a CPU; exact: also --dtype float32, token-identical to "
        "ChatTTS's own infer()",
        choices=PROFILE_CHOICES,
    )
    dtype: str = _opt(
        "auto",
        "the GPT's precision; auto: float32 under --profile exact, else bf16 where the CPU/GPU computes "
        "it natively (faster), else float32 on CPU, fp16 on GPU; only float32 is token-identical to "
        "ChatTTS's own infer()",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    threads: int = _opt(0, "CPU threads for the model (0 = torch's default: all cores)")
    engine_cpus: str = _opt(
        "",
        "CPUs the inference thread and torch's threads run on (e.g. 1 or 2-3); the event loop and the "
        "encoder threads get the others; empty: any CPU",
    )
    omp_wait_policy: str = _opt(
        "auto",
        "how torch's idle OpenMP threads wait (set before torch loads); auto: a short spin "
        "(--omp-spin-count) unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set: the token step 1.7x faster "
        "than passive on a CPU of its own; passive: sleep at once, for a CPU shared with other busy "
        "processes (beside a busy loop every spin made steps 1.5-15x slower); active: spin without end",
        choices=("auto", "passive", "active"),
    )
    omp_spin_count: int = _opt(
        DEFAULT_OMP_SPIN_COUNT,
        "with --omp-wait-policy auto: busy-wait iterations before an idle OpenMP thread sleeps "
        "(GOMP_SPINCOUNT: libgomp, the OpenMP of PyTorch's pip wheels; tens of microseconds)",
    )
    block_schedule: str = _opt(
        "8,16,20,20,24,24,28,32",
        "tokens per block for a sequence's 1st, 2nd, ... block (last repeats); a gentle ramp after the "
        "2nd block: a listener starts on 0.4 s of audio and each block must arrive before what it holds "
        "is played (this ramp holds at a step of up to 19 ms a token, 0.89 of real time)",
    )
    quantum_tokens: int = _opt(
        0,
        "token steps the engine runs back to back between two reads of its results; blocks are whole "
        "quanta and a waiting start, append or cancel ends one only between quanta; must divide every "
        "block of --block-schedule; 0: 4 on CUDA (where a read per token costs as much as a step), "
        "1 on the CPU",
    )
    overlap_quanta: str = _opt(
        "auto",
        "launch the engine's next quantum before reading the last one's results, so the host's work "
        "runs while the device steps (a row that ended runs one idle quantum; a waiting start, "
        "append or cancel waits for the quantum in flight); auto: on on CUDA, off on the CPU "
        "(where a launch runs before it returns: nothing to overlap)",
        choices=("auto", "on", "off"),
    )
    prefill_bucket: int = _opt(
        16, "pad prompts up to a multiple of this many tokens: few kernel shapes, flat memory (1: off)"
    )
    segment_max_tokens: int = _opt(
        2048, "audio tokens one text segment may generate (46.9 per second); sizes the KV cache"
    )
    refine_max_tokens: int = _opt(
        384,
        "refine: true runs ChatTTS's text refinement before each segment's speech: at most this many "
        "tokens, one block per engine step (adds to time to first audio); sizes the KV cache; 0: off",
    )
    voices_dir: str = _opt(
        "", "folder of the voices made from recordings (POST /v1/audio/voices); empty: <cache dir>/voices"
    )
    voices_max: int = _opt(100, "voices the voices folder holds at most; uploads over it are refused")
    voices_max_bytes: int = _opt(
        64 * 1024 * 1024, "bytes the voices folder holds at most; uploads over it are refused"
    )
    voice_max_seconds: float = _opt(
        10.0,
        "longest recording a voice is made from (at most 30); its codes (47 a second) are part of every "
        "prompt in that voice and size the KV cache; 0: voice uploads off",
    )
    voice_upload_max_bytes: int = _opt(10 * 1024 * 1024, "largest recording upload (POST /v1/audio/voices)")
    cuda_graphs: str = _opt(
        "on",
        "capture the token step as CUDA graphs at start-up (CUDA only; a failed capture runs it eagerly)",
        choices=("on", "off"),
    )
    compile_step: str = _opt(
        "auto",
        "CPU: compile the token step with torch.compile (inductor): a token step about 1.5x "
        "faster, minutes more at the first start, needs a C++ compiler (a failed compile runs it eagerly); "
        "ahead: built ahead of time and saved in the cache dir, so a restart loads it in seconds "
        "(not frozen: as fast as on for w8a8, slower for the bf16 step); on: compiled lazily and frozen, "
        "traced again at every start; auto: as --profile says (ahead with w8a8 under realtime on a CPU)",
        choices=("auto", "on", "ahead", "off"),
    )
    quantize: str = _opt(
        "auto",
        "int8: the GPT's projections as weight-only int8 (faster single streams on a CPU, other tokens "
        "than without it); w8a8: int8 weights times per-row int8 activations (x86-64 CPU: "
        "the fastest step there at every batch, with --compile-step on the fastest of all; "
        "other tokens again); reported in hello and /metrics; "
        "none: as --dtype loads them; auto: as --profile says (w8a8 under realtime on an x86-64 CPU)",
        choices=("auto", *QUANTIZE_CHOICES),
    )
    vocoder_dtype: str = _opt(
        "auto",
        "the Decoder's and Vocos's precision; auto: bf16 when the GPT runs in bf16 (a decode 2-3.3x faster "
        "on a CPU), else float32; changes samples (about -38 dB), never tokens",
        choices=VOCODER_DTYPE_CHOICES,
    )
    warmup: bool = _opt(True, "run warm-up requests before /ready turns 200")
    engine_process: bool = _opt(
        False,
        "run the engine core and the model in a process of their own, behind a local socket, so the "
        "front ends' Python never holds the engine's GIL; the front end keeps only the engine's text side "
        "(ChatTTS: its tokenizer, normalizer and speaker statistics)",
    )
    frontend_processes: int = _opt(
        1,
        "front-end processes sharing the ports (SO_REUSEPORT) over one engine process, so the front "
        "ends use N cores; 1: one process; 2+: implies --engine-process; "
        "per-client limits then hold per process",
    )
    frontend_priority: str = _opt(
        "auto",
        "with --frontend-processes 2+: the front-end processes' CPU priority against the engine "
        "process's, so that the engine's host work wins a core when it wakes: idle (SCHED_IDLE: "
        "they run on what the engine leaves), lower (nice 10), same; auto: lower where the model "
        "runs on the CPU (its threads want every core), else idle",
        choices=("auto", "idle", "lower", "same"),
    )
    engine_socket: str = _opt(
        "", "internal (set by --frontend-processes for its children): the engine process's Unix socket"
    )
    sibling_ports: str = _opt(
        "",
        "internal (set by --frontend-processes for its children): the loopback ports of the front-end "
        "processes, this one's first; its resume tokens name its own, a resume of a sibling's is forwarded",
    )
    max_text_chars: int = _opt(2000, "longest text accepted in one start message")
    max_buffer_delay_ms: float = _opt(
        800.0, "incremental streams: speak a stalled clause after this long without text"
    )
    max_pending_chars: int = _opt(1000, "incremental streams: text waiting for a sentence end, at most")
    segment_max_chars: int = _opt(120, "longest text segment given to the model at once")
    max_streams: int = _opt(4, "concurrent streams per connection")
    max_connections: int = _opt(
        2000, "concurrent connections per port (WebSocket, HTTP, Wyoming), each within its share of fds"
    )
    max_message_bytes: int = _opt(65536, "largest client message; bigger ones close the connection with 1009")
    send_timeout_s: float = _opt(10.0, "a send that cannot complete in this time aborts the connection")
    max_buffered_s: float = _opt(
        60.0, "unsent audio (seconds) a stream may pile up before its client is aborted"
    )
    drain_timeout_s: float = _opt(30.0, "on SIGTERM, how long running streams may take to finish")
    resume_ttl_s: float = _opt(30.0, "how long a disconnected stream waits to be resumed (0: cancel at once)")
    max_ended_streams_per_client: int = _opt(
        64,
        "ended streams (delivered or cancelled, or finished while disconnected) one client's streams keep "
        "for a resume; past it the one that ended first is freed",
    )
    max_ended_streams: int = _opt(
        4096, "ended streams kept for a resume, all clients together; past it the one that ended first goes"
    )
    # Resume on any replica (docs/operations.md, "Resume on any replica"): signed tokens, forwarding,
    # regeneration.
    resume_secret: str = _opt(
        "",
        "HMAC key the replicas share (16+ characters): tokens then name the replica that owns their "
        "stream, so a resume reaching any replica is forwarded there or regenerated; empty: resume "
        "works on the replica that holds the stream only",
    )
    resume_secret_file: str = _opt("", "file holding that key (a mounted Secret); wins over --resume-secret")
    advertise_url: str = _opt(
        "",
        "ws://IP:PORT where the other replicas reach this one (the pod IP); "
        "empty: ws://--host:--port when --host is an address",
    )
    forward_allow: str = _opt(
        "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,fc00::/7",
        "networks (CIDR, comma-separated) a replica may forward a resume to; a signed owner "
        "address outside them is refused without connecting",
    )
    forward_timeout_s: float = _opt(
        5.0, "a forwarded resume's connect, hello and answer take at most this long (then regenerate)"
    )
    replay_max_s: float = _opt(60.0, "audio (seconds) a stream keeps for resume, oldest evicted first")
    replay_max_bytes: int = _opt(8 * 1024 * 1024, "bytes a stream keeps for resume, oldest evicted first")
    replay_total_bytes: int = _opt(
        256 * 1024 * 1024, "bytes all replay buffers may hold; delivered ones go first"
    )
    cache_bytes: int = _opt(64 * 1024 * 1024, "response cache for seeded requests, in bytes (0: off)")
    rate_limit_per_min: float = _opt(
        0.0, "streams a client may start per minute, per front-end process (0: unlimited)"
    )
    rate_limit_burst: int = _opt(10, "streams a client may start at once before the rate applies")
    max_connections_per_client: int = _opt(
        0,
        "open connections per client, all ports together (0: unlimited); over it: WebSocket close 1013, "
        "HTTP 503 (counted by IP, not with --trust-forwarded-for), Wyoming error; per front-end process",
    )
    api_keys: str = _opt("", "comma-separated API keys; when set, every connection must present one")
    api_keys_file: str = _opt("", "file with one API key per line (added to --api-keys)")
    trust_forwarded_for: bool = _opt(
        False, "take client IPs from X-Forwarded-For (only behind a proxy that sets it)"
    )
    allowed_origins: str = _opt("", "comma-separated Origin values browsers may connect from (empty: any)")
    opus_bitrate: int = _opt(32_000, "Opus bitrate in bit/s (opus and ogg formats)")
    opus_complexity: int = _opt(5, "Opus encoder complexity 0-10 (5: ~0.002 CPU-s per audio-s here)")
    ogg_page_ms: int = _opt(100, "ogg format: audio per Ogg page (a page is flushed at least this often)")
    mp3_bitrate: int = _opt(64, "mp3 format: CBR bitrate in kbit/s (8-160 at 8-24 kHz, 32-320 at 48 kHz)")
    encode_threads: int = _opt(2, "worker threads that encode Opus/Ogg off the event loop")
    max_batch: int = _opt(
        0,
        "most sequences advanced together in one engine step, each with a KV slot; 0: on CUDA as many "
        "slots as the memory free after loading holds (less 6 GiB), 16 on the CPU",
    )
    max_wait_ms: float = _opt(5.0, "when idle, how long to gather a first batch")
    max_queue: int = _opt(256, "sequences waiting for a batch slot before new streams get 'overloaded'")
    segment_lookahead: int = _opt(1, "segments of one stream generated ahead of the one playing")
    lookahead_lead_s: float = _opt(
        1.0,
        "a look-ahead segment is generated only while its stream's audio is this many seconds ahead "
        "of real time (or a heard segment waits for a slot): a second row must not slow the heard one "
        "below real time; 0: always. With every batch place taken, such a look-ahead gives its place to "
        "a waiting heard segment (and is made again later)",
    )
    breaker_threshold: int = _opt(
        5, "consecutive failed engine steps that open the breaker (/ready 503, new streams 'overloaded')"
    )
    breaker_probe_s: float = _opt(2.0, "while the breaker is open, probe the engine this often (seconds)")
    # --- every port bounded in time and connections (docs/operations.md, "Limits") ---
    max_json_depth: int = _opt(
        32, "deepest nesting of a client's JSON (WebSocket message, HTTP body, Wyoming event): bad_request"
    )
    header_timeout_s: float = _opt(
        10.0,
        "a request's head must arrive within this long: HTTP from the connection's start or its previous "
        "response (so also the keep-alive idle time), the WebSocket opening handshake, the rest of a "
        "Wyoming event once begun; else the connection is closed",
    )
    body_timeout_s: float = _opt(60.0, "an HTTP request body must arrive within this long of its head: 408")
    close_timeout_s: float = _opt(
        2.0, "a closing connection waits this long for its client (WebSocket close handshake), then is cut"
    )
    wyoming_idle_timeout_s: float = _opt(
        30.0,
        "Wyoming: a connection that sends no event for this long while no audio goes out to it (idle, "
        "or between synthesize-chunks) gets error 'timeout' and is closed",
    )
    wyoming_text_timeout_s: float = _opt(
        300.0, "Wyoming: synthesize-stop must follow synthesize-start within this long: error 'timeout'"
    )
    fd_reserve: int = _opt(
        128,
        "open files kept for the process; the rest of RLIMIT_NOFILE (raised to its hard limit) is split "
        "evenly among the open ports, each refusing connections over its share",
    )
    # Hostile and careless clients (issue #25): what one client may hold and send.
    memory_budget_bytes: int = _opt(
        512 * 1024 * 1024,
        "bytes buffered for all clients together (replay buffers, unsent audio, audio waiting for "
        "the encoder); past it the streams of the client holding the most are freed, biggest first "
        "(their connections aborted); per front-end process; 0: no budget",
    )
    invalid_messages_per_s: float = _opt(
        20.0,
        "invalid messages (refused as bad_request, unsupported, unknown_stream, ...) one WebSocket "
        "connection (/v1/stream or ElevenLabs) may send per second (that many at once too); past it: "
        "close 1008 (0: unlimited)",
    )
    fake_step_ms: float = _opt(2.0, "fake engine: fixed cost of one step (ms)")
    fake_row_ms: float = _opt(0.5, "fake engine: extra cost per sequence in a step (ms)")
    fake_host_ms: float = _opt(
        0.0, "fake engine: Python work holding the GIL in every step (ms of CPU), as a model's host side"
    )
    log_level: str = _opt("info", "logging level", choices=("debug", "info", "warning", "error"))

    @property
    def server_name(self) -> str:
        """The ``server`` field of ``hello``."""
        return f"chattts-stream/{VERSION} ({self.engine})"
