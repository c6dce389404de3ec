"""Settings of the ChatTTS engine that are decided once: device, dtype, cache length.

Kept apart from the engine itself (:mod:`server.engine.chattts.engine`) so that the
engine module holds only what runs per request; its options are in
:mod:`server.engine.chattts.options`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from server.engine.chattts.assets import LoadedChat
from server.engine.chattts.decode import SAMPLES_PER_TOKEN
from server.engine.chattts.options import EngineOptions
from server.engine.chattts.prompt import file_identity
from server.engine.chattts.step.kv import kv_dtype
from server.engine.chattts.step.runner import SlotBatch
from server.engine_api import EngineInfo

log = logging.getLogger(__name__)

#: CUDA memory kept free beside the KV slots when they are sized from free memory
#: (``--max-batch 0``): the captured graphs' memory pools (one per batch bucket and length
#: bucket), the batched Decoder + Vocos call, prefill, the step's activations and the allocator's
#: fragmentation. The weights are already loaded, so free memory no longer counts them.
CUDA_KV_RESERVE_BYTES = 6 * 2**30
#: KV slots off CUDA when ``--max-batch`` is 0: on the CPU only what live rows write is resident,
#: and 16 rows are more than one CPU keeps in real time.
CPU_MAX_BATCH = 16
FreeMemory = Callable[[torch.device], tuple[int, int]]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; anything else as given."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX); without it oneDNN emulates it."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The Llama's dtype. ``"auto"``: bf16 where the hardware computes it natively, else fp32 (CPU) or fp16.

    On this project's CPU (AVX512-BF16) bfloat16 ran the engine 1.6x faster at batch 1 and
    1.95x at batch 4 than float32 (``bench/results/studies/dtype-epyc-2core.md``), but its sampled
    tokens leave float32's within 0-11 steps: only float32 is token-identical to ChatTTS's own
    ``infer()`` (docs/operations.md, "The flags that matter"). A CPU without native bf16 gets float32.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; not {dtype!r}")
    return _DTYPES[dtype]


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def kv_length(
    *, longest_prompt: int, prefill_bucket: int, segment_max_tokens: int, max_positions: int
) -> int:
    """Positions per KV slot: the longest prompt's bucket plus the token cap, within the model's range."""
    return min(max_positions, round_up(longest_prompt, prefill_bucket) + segment_max_tokens)


def kv_slot_bytes(config: Any, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of one KV slot: keys and values of every layer, ``max_len`` positions of ``dtype``."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    return 2 * int(config.num_hidden_layers) * kv_heads * max_len * head_dim * dtype.itemsize


def slots_in(free_bytes: int, slot_bytes: int, reserve_bytes: int = CUDA_KV_RESERVE_BYTES) -> int:
    """KV slots of ``slot_bytes`` that fit in ``free_bytes`` once ``reserve_bytes`` are kept (at least 1)."""
    return max(1, (free_bytes - reserve_bytes) // slot_bytes)


def kv_slots(
    max_batch: int | None,
    config: Any,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    free_memory: FreeMemory = torch.cuda.mem_get_info,
) -> int:
    """The engine's KV slots: ``max_batch`` when set, else sized to the device.

    On CUDA (``max_batch`` None, ``--max-batch 0``): as many slots of ``max_len`` positions as the
    memory free now (after the weights were loaded: ``free_memory``, ``torch.cuda.mem_get_info``)
    holds less :data:`CUDA_KV_RESERVE_BYTES`; logged. Elsewhere :data:`CPU_MAX_BATCH`.
    """
    if max_batch is not None:
        return max_batch
    if device.type != "cuda":
        return CPU_MAX_BATCH
    free, total = free_memory(device)
    slot = kv_slot_bytes(config, max_len, kv_dtype(dtype, device))
    slots = slots_in(free, slot)
    log.info(
        "KV slots sized to the device (--max-batch 0): %d of %.1f MiB (%d positions) fit in %.2f GiB free "
        "of %.2f GiB, %.0f GiB kept for graphs, decode and activations",
        slots,
        slot / 2**20,
        max_len,
        free / 2**30,
        total / 2**30,
        CUDA_KV_RESERVE_BYTES / 2**30,
    )
    return slots


def kv_shape(
    options: EngineOptions, config: Any, longest_prompt: int, *, device: torch.device, dtype: torch.dtype
) -> tuple[int, int]:
    """``(positions per slot, slots)`` of the engine's KV cache (:func:`kv_length`, :func:`kv_slots`)."""
    max_len = kv_length(
        longest_prompt=longest_prompt,
        prefill_bucket=options.prefill_bucket,
        segment_max_tokens=options.segment_max_tokens,
        max_positions=int(config.max_position_embeddings),
    )
    return max_len, kv_slots(options.max_batch, config, device=device, dtype=dtype, max_len=max_len)


def memory_left() -> int | None:
    """Bytes this process may still take (Linux): its cgroup's limit, else the machine's, less its RSS."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        limit = os.sysconf("SC_PHYS_PAGES") * page
        for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
            text = Path(path).read_text().strip() if Path(path).is_file() else "max"
            if text != "max":
                limit = min(limit, int(text))
        resident = int(Path("/proc/self/statm").read_text().split()[1]) * page
    except (OSError, ValueError):
        return None
    return limit - resident


def kv_memory_warning(reserved: int, left: int | None) -> str | None:
    """What to say when every KV slot at its longest would not fit in the memory left (``None``: fits)."""
    if left is None or reserved <= left:
        return None
    return (
        f"every KV slot at its longest would take {reserved / 2**30:.1f} GiB, more than the "
        f"{max(left, 0) / 2**30:.1f} GiB this process has left: lower --max-batch or --segment-max-tokens "
        "(on the CPU only the positions live streams hold are resident, so typical use needs far less)"
    )


def engine_info(
    loaded: LoadedChat,
    batch: SlotBatch,
    *,
    device: torch.device,
    dtype: torch.dtype,
    projections: str,
    options: EngineOptions,
) -> EngineInfo:
    """The engine's static facts (``hello``, the ``chattts_engine_info`` metric).

    Args:
        loaded: the weights.
        batch: the KV slots and token step (which runner, and why, when it fell back).
        device: where the Llama runs.
        dtype: the Llama's dtype.
        projections: what its projections run as (:func:`.step.linear.prepare_projections`).
        options: the engine's options (``quantize``, whether refinement and voices from
            recordings are on).
    """
    extra = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "quantize": options.quantize,
        "projections": projections,
        "model_dir": str(loaded.model_dir),
        "random_weights": "true" if loaded.random_weights else "false",
        "weights": loaded.weights,
        **batch.describe(),
        # Who chose the slots: the flag, or (--max-batch 0) the free memory or the CPU's default.
        "kv_slots_from": "--max-batch"
        if options.max_batch is not None
        else ("free memory" if device.type == "cuda" else "the CPU default"),
    }
    dvae = loaded.model_dir / "asset" / "DVAE.safetensors"
    return EngineInfo(
        name="chattts",
        voices=("default",),
        samples_per_token=SAMPLES_PER_TOKEN,
        refine=options.refine_max_tokens > 0,
        # A voice's codes are the DVAE encoder's: voices made with other DVAE weights are not used.
        voice_encoder=file_identity(dvae) if options.voice_max_seconds > 0 else None,
        # PromptLimits' text part, as the engine builds them: what the slots and warm-up were sized for.
        max_text_tokens=max(options.warmup_prompt_chars, options.refine_max_tokens),
        max_batch=batch.layout.slots,
        extra=extra,
    )


def log_engine_info(info: EngineInfo, kv_bytes: int, *, lazy: bool) -> None:
    """The start-up log line of what runs, and warnings: random weights, KV that may not fit.

    Args:
        info: the engine's facts.
        kv_bytes: the KV slots' size at their longest.
        lazy: whether that is a reservation that becomes resident as written (the CPU) or
            memory allocated now.
    """
    extra = info.extra
    log.info(
        "KV cache: %s slots x %s positions = %.1f MiB %s (%s); "
        "token step: %s, projections %s, batch buckets %s",
        extra["kv_slots"],
        extra["kv_max_len"],
        kv_bytes / 2**20,
        "reserved, resident as written" if lazy else "allocated",
        extra["dtype"],
        extra["token_step"],
        extra["projections"],
        extra["batch_buckets"],
    )
    if lazy and (warning := kv_memory_warning(kv_bytes, memory_left())) is not None:
        log.warning("%s", warning)
    if extra["random_weights"] == "true":
        log.warning(
            "SERVING RANDOM WEIGHTS: %s is a dev model (DEV_MODEL.json); the audio is noise, not speech",
            extra["model_dir"],
        )
