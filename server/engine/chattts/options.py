"""The ChatTTS engine's options: one frozen object, each option with its default and its meaning.

:class:`server.engine.chattts.engine.ChatTTSEngine` takes it whole; the server builds it
from its flags in :func:`server.engine.flags.engine_options`. Pure (no torch), so that settings
can be checked without loading anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Model tokens a second of recording's transcript may take when no limit is given.
TRANSCRIPT_TOKENS_PER_SECOND = 20
#: ``quantize``'s values: the GPT's projections as loaded, weight-only int8, or int8 weights and
#: per-row int8 activations (:mod:`server.engine.chattts.step.w8a8`, the CPU only).
QUANTIZE_CHOICES = ("none", "int8", "w8a8")
#: The quantum on CUDA when none is given: a graph replay is a few milliseconds, so a host read
#: and the Python around it per token would weigh as much as the step.
CUDA_QUANTUM = 4
#: ``vocoder_dtype``'s values (:func:`server.engine.chattts.vocode.vocoder_dtype`).
VOCODER_DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How one :class:`~server.engine.chattts.engine.ChatTTSEngine` generates; every field has a default.

    Raises:
        ValueError: from the constructor, naming the option, for a value the engine cannot run with.
    """

    block_schedule: tuple[int, ...] = (8, 16, 20, 20, 24, 24, 28, 32)
    """Tokens between a sequence's 1st, 2nd, ... decodes (the last repeats); each at least 1.

    The ramp is gentle because a listener starts on about 0.4 s of audio (after the 2nd block)
    and each later block must arrive before what is buffered is played: the buffer grows by a
    block's audio minus its generation time, so each block may be only a little longer than the
    one before. ``8,16,20,24,32`` under-ran at the 32-token block once a token took 18 ms (on two
    CPU cores with the compiled w8a8 step); this one holds up to about 19 ms, 0.89 of real time
    (``tests/unit/test_engine_options.py``, ``bench/results/studies/stream-timeline-xeon-2core.md``).
    """

    quantum_tokens: int | None = None
    """Token steps enqueued back to back between two host reads (``--quantum-tokens``). Every block
    is a whole number of quanta: rows join, leave and decode only at quantum boundaries, and a
    waiting command ends a block only there. ``None``: :data:`CUDA_QUANTUM` on CUDA (the
    largest of 4, 2, 1 that divides every block) and 1 on the CPU, where a step is long enough
    that a read per token costs nothing and a command waits one token at most. A value given
    must divide every block of ``block_schedule``, so the decode windows stay as they are."""

    overlap_quanta: bool | None = None
    """Launch quantum n+1 before reading quantum n's summary (``--overlap-quanta``,
    :mod:`server.engine.chattts.step.quanta`): the host's read and decisions run while the device
    steps. A row that ended runs one more quantum frozen, and a waiting command ends the block
    after the quantum in flight. ``None``: on on CUDA, off on the CPU, where a launch runs the
    quantum before it returns, so there is nothing to overlap and only the extra quantum to pay."""

    default_voice: str = "seed:2"
    """What voice ``"default"`` is (``seed:N`` or a speaker string)."""

    context_tokens: int = 16
    """Decode left context, tokens (see :mod:`server.engine.chattts.decode`)."""

    holdback_tokens: int = 4
    """Audio held back at the right edge until more tokens exist, tokens."""

    crossfade_samples: int = 256
    """Crossfade between consecutive decode windows, samples."""

    min_tokens: int = 1
    """EOS is banned before this many tokens (benchmarks force lengths with it); below 1 counts as 1,
    since ChatTTS never returns an empty sequence."""

    repetition_penalty: float = 1.05
    """ChatTTS's penalty over the last 16 codes."""

    prefill_bucket: int = 16
    """Prompts are padded up to a multiple of this many tokens, so the kernels see a few prefill
    shapes instead of one per prompt length (1: no padding)."""

    prefill_tokens: int | None = None
    """Tokens (rows × padded length) one prefill call holds at most: a step's newcomers of one
    prompt bucket are prefilled together in calls of 1, 2, 4, ... rows within it (a longer prompt
    runs alone). It bounds a call's activations and the prefill shapes warm-up runs. ``None``:
    512 on the CPU, 8192 on CUDA (:mod:`server.engine.chattts.step.prefill`)."""

    warmup_prompt_chars: int = 120
    """The longest segment the server sends (``--segment-max-chars``): warm-up prefills every
    bucket up to it, and the KV slots are sized for it."""

    max_batch: int | None = 16
    """KV slots, the most sequences alive at once (``--max-batch``). ``None`` (``--max-batch 0``):
    on CUDA as many as the memory free after loading holds, less a reserve
    (:func:`server.engine.chattts.setup.kv_slots`); 16 elsewhere."""

    segment_max_tokens: int = 2048
    """Token cap of one sequence; with the longest prompt it sets the KV slots' length."""

    cuda_graphs: bool = True
    """Capture the token step as CUDA graphs on a CUDA device (no effect elsewhere)."""

    compile_step: bool = False
    """Compile the token step with ``torch.compile`` (inductor) at warm-up, on the CPU only
    (:mod:`server.engine.chattts.step.compiled`); a failed compile runs it eagerly."""

    compile_ahead: bool = False
    """With ``compile_step``: build the step's graphs ahead of time and save them, unfrozen, so a
    restart loads them (:mod:`server.engine.chattts.step.aot`), instead of compiling lazily, frozen."""

    compile_cache_dir: str | None = None
    """Where the compiled step's artifacts are kept across restarts, one folder per key
    (:mod:`server.engine.chattts.step.compile_cache`); the server passes ``<cache dir>/compiled``.
    ``None``: inductor's own default (``TORCHINDUCTOR_CACHE_DIR``, else a folder in ``/tmp``)."""

    quantize: str = "none"
    """``"int8"``: the GPT's projections as weight-only int8 (half the bytes a bf16 step reads;
    other tokens than without it); ``"w8a8"``: int8 weights times int8 activations, each row on its
    own scale (the CPU only, eager only: the fastest step on a small CPU; other tokens again);
    ``"none"``: as loaded in ``dtype``."""

    vocoder_dtype: str = "auto"
    """The Decoder's and Vocos backbone's precision: ``"auto"``, bfloat16 when the GPT runs in
    bfloat16 (the CPU's default where bf16 is native: a decode 2-3.3x faster), else float32. It
    changes samples, never tokens; a float32 GPT keeps ChatTTS's float32 audio."""

    refine_max_tokens: int = 384
    """The refinement pass's token cap (``--refine-max-tokens``; 0, or below: off); a refined text
    may be this long, so it sizes the KV slots too."""

    voice_max_seconds: float = 10.0
    """The longest recording a voice is made from (``--voice-max-seconds``; 0: off); its codes are
    part of every prompt in that voice, so it sizes the KV slots."""

    voice_transcript_tokens: int | None = None
    """The longest transcript of such a recording, in model tokens (``None``:
    :data:`TRANSCRIPT_TOKENS_PER_SECOND` a second of ``voice_max_seconds``); read it through
    :attr:`transcript_tokens`."""

    def __post_init__(self) -> None:
        blocks = tuple(int(b) for b in self.block_schedule)
        object.__setattr__(self, "block_schedule", blocks)
        if not blocks or min(blocks) < 1:
            raise ValueError(f"block_schedule {blocks!r}: needs at least one block, each at least 1 token")
        if self.quantum_tokens is not None and (
            self.quantum_tokens < 1 or any(block % self.quantum_tokens for block in blocks)
        ):
            raise ValueError(
                f"quantum_tokens {self.quantum_tokens}: must be at least 1 and divide every block of "
                f"block_schedule {','.join(map(str, blocks))}"
            )
        if self.prefill_bucket < 1:
            raise ValueError(f"prefill_bucket {self.prefill_bucket}: must be at least 1 (1: no padding)")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens {self.prefill_tokens}: must be at least 1")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch {self.max_batch}: must be at least 1 (KV slots)")
        if self.segment_max_tokens < 1:
            raise ValueError(f"segment_max_tokens {self.segment_max_tokens}: must be at least 1")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize {self.quantize!r}: must be one of {', '.join(QUANTIZE_CHOICES)}")
        if self.vocoder_dtype not in VOCODER_DTYPE_CHOICES:
            choices = ", ".join(VOCODER_DTYPE_CHOICES)
            raise ValueError(f"vocoder_dtype {self.vocoder_dtype!r}: must be one of {choices}")

    def quantum_for(self, device_type: str) -> int:
        """The quantum on a device of type ``device_type``: ``quantum_tokens``, or its default."""
        if self.quantum_tokens is not None:
            return self.quantum_tokens
        if device_type != "cuda":
            return 1
        return math.gcd(CUDA_QUANTUM, *self.block_schedule)

    def overlap_for(self, device_type: str) -> bool:
        """Whether quanta overlap on a device of type ``device_type``: ``overlap_quanta``, or its default."""
        if self.overlap_quanta is not None:
            return self.overlap_quanta
        return device_type == "cuda"

    @property
    def transcript_tokens(self) -> int:
        """``voice_transcript_tokens``, or its default for ``voice_max_seconds``."""
        if self.voice_transcript_tokens is not None:
            return self.voice_transcript_tokens
        return math.ceil(TRANSCRIPT_TOKENS_PER_SECOND * float(self.voice_max_seconds))
