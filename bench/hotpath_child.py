"""The child process of :mod:`bench.hotpath`: one system, loaded once, its scenarios, one JSON.

``python -m bench.hotpath_child --system engine --code-root DIR --model-dir M --out X.json``

``--code-root`` is put first on ``sys.path`` before anything of ``server`` is imported, so
the same child measures the engine of this tree or of another checkout (the code before a
change). Only API both versions share is used: ``ChatTTSEngine(loaded, device=, dtype=,
min_tokens=)``, ``add``/``step``/``drop``/``warmup``; ``max_batch`` is passed when accepted.

Time shares come from wrapping the functions each version spends its time in, with
exclusive accounting (a wrapped call inside another is subtracted from the outer one).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEXTS = [
    "Hello, and welcome to the speech service.",
    "你好，欢迎使用语音服务。",
    "Your order has shipped and arrives on Friday.",
    "今天天气很好，我们出去走走吧。",
]
SAMPLE_RATE, SAMPLES_PER_TOKEN = 24_000, 512


def job_tokens(k: int, low: int, span: int) -> int:
    """Length of job ``k``: staggered, so rows end (and new ones join) at different steps."""
    return low + (k * 37) % span


class Profile:
    """Wall time per category on the calling thread, exclusive of nested wrapped calls."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._stack: list[list[float]] = []

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = name(*args, **kwargs) if callable(name) else name
            frame = [time.perf_counter(), 0.0]  # start, time spent in nested wrapped calls
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[0]
                self.seconds[label] += spent - frame[1]
                if self._stack:
                    self._stack[-1][1] += spent

        return timed

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def instrument_engine(profile: Profile) -> None:
    """Wrap the Llama, sampling, decode and prefill of whichever engine version is imported."""
    import server.engine.chattts as engine_module

    cls = engine_module.ChatTTSEngine
    cls._prefill = profile.wrap("prefill", cls._prefill)  # type: ignore[method-assign]
    try:  # this tree: static step
        import server.engine.chattts_block as block
        import server.engine.chattts_step as step

        step.TokenStep._feed = profile.wrap("llama", step.TokenStep._feed)  # type: ignore[method-assign]
        step.sample_codes = profile.wrap("sampling", step.sample_codes)
        step.counter_uniforms = profile.wrap("sampling", step.counter_uniforms)
        block.SlotBatch._decode = profile.wrap("decode", block.SlotBatch._decode)  # type: ignore[method-assign]
    except ImportError:  # before: row groups
        from server.engine.chattts_decode import StreamDecoder

        engine_module.sample_codes = profile.wrap("sampling", engine_module.sample_codes)  # type: ignore[attr-defined]
        cls._sampling = profile.wrap("sampling", cls._sampling)  # type: ignore[attr-defined]
        cls._forward_codes = profile.wrap("llama", cls._forward_codes)  # type: ignore[attr-defined]
        StreamDecoder.pull = profile.wrap("decode", StreamDecoder.pull)  # type: ignore[method-assign]


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from server.engine.base import SequenceRequest, SynthesisParams
    from server.engine.chattts import ChatTTSEngine
    from server.engine.chattts_assets import load_chat

    profile = Profile()
    instrument_engine(profile)
    loaded = load_chat(model_dir=args.model_dir, device=torch.device("cpu"))
    options: dict[str, Any] = {"min_tokens": 1 << 20}  # EOS banned: every job runs to its own length
    if "max_batch" in str(inspect.signature(ChatTTSEngine.__init__)) or "options" in str(
        inspect.signature(ChatTTSEngine.__init__)
    ):
        options["max_batch"] = args.max_batch
    began = time.perf_counter()
    engine = ChatTTSEngine(loaded, device=torch.device("cpu"), dtype=torch.bfloat16, **options)
    engine.warmup()
    out: dict[str, Any] = {"load_and_warmup_s": time.perf_counter() - began, "extra": dict(engine.info.extra)}
    seq = iter(range(1 << 30))

    def add(k: int, tokens: int) -> int:
        sid = next(seq)
        params = SynthesisParams(seed=1000 + k)
        engine.add(SequenceRequest(seq_id=sid, text=TEXTS[k % len(TEXTS)], params=params, max_tokens=tokens))
        return sid

    # time to first audio, one stream
    ttfa = []
    for k in range(args.ttfa_repeats):
        began = time.perf_counter()
        sid = add(k, 40)
        while not len(engine.step([sid])[0].audio):
            pass
        ttfa.append(time.perf_counter() - began)
        engine.drop(sid)
    out["ttfa_s"] = ttfa
    # one steady-state block (32 tokens) at batch 1 and 8
    out["profile"] = {}
    for batch in (1, 8):
        ids = [add(k, 400) for k in range(batch)]
        for _ in range(3):  # blocks of 8, 16, 32 tokens: every row is on its 32-token schedule now
            engine.step(ids)
        profile.take()
        began = time.perf_counter()
        tokens = sum(r.tokens for r in engine.step(ids)) // batch
        wall = time.perf_counter() - began
        out["profile"][str(batch)] = {"wall_s": wall, "tokens": tokens, "seconds": profile.take()}
        for sid in ids:
            engine.drop(sid)
    # closed loop
    out["closed"] = {}
    for concurrency in args.concurrency:
        out["closed"][str(concurrency)] = closed_loop(engine, add, concurrency, args, profile)
    engine.close()
    return out


def closed_loop(
    engine: Any, add: Callable[[int, int], int], n: int, args: argparse.Namespace, profile: Profile
) -> dict[str, Any]:
    """``n`` live rows, each finished one replaced by the next job, ``jobs_per_row · n`` jobs in all."""
    jobs = args.jobs_per_row * n
    lengths = [job_tokens(k, args.low, args.span) for k in range(jobs)]
    profile.take()
    cpu0, began = time.process_time(), time.perf_counter()
    live = {add(k, lengths[k]): k for k in range(n)}
    started, samples = n, 0
    while live:
        for result in engine.step(list(live)):
            samples += len(result.audio)
            if result.finished:
                del live[result.seq_id]
                if started < jobs:
                    live[add(started, lengths[started])] = started
                    started += 1
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu0
    audio = samples / SAMPLE_RATE
    return {"wall_s": wall, "cpu_s": cpu, "audio_s": audio, "jobs": jobs, "seconds": profile.take()}


def run_native(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    from ChatTTS.model import processors
    from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

    from server.engine.chattts_assets import load_chat

    profile = Profile()
    loaded = load_chat(model_dir=args.model_dir, device=torch.device("cpu"))
    chat = loaded.chat
    gpt = chat.gpt.gpt

    def llama_or_prefill(*args: Any, **kwargs: Any) -> str:
        return "prefill" if kwargs["inputs_embeds"].shape[1] > 1 else "llama"

    gpt.forward = profile.wrap(llama_or_prefill, gpt.forward)
    for cls in (processors.CustomRepetitionPenaltyLogitsProcessorRepeat, TopPLogitsWarper, TopKLogitsWarper):
        cls.__call__ = profile.wrap("sampling", cls.__call__)
    chat._decode_to_wavs = profile.wrap("decode", chat._decode_to_wavs)
    torch.manual_seed(2)
    speaker = chat.sample_random_speaker()
    tokens = round(sum(job_tokens(k, args.low, args.span) for k in range(64)) / 64)

    def infer(n: int, seed: int) -> int:
        params = chat.InferCodeParams(
            spk_emb=speaker, manual_seed=seed, max_new_token=tokens, min_new_token=tokens, show_tqdm=False
        )
        texts = [TEXTS[k % len(TEXTS)] for k in range(n)]
        total = 0
        options = {"stream": True, "skip_refine_text": True, "split_text": False, "params_infer_code": params}
        for wavs in chat.infer(texts, **options):
            total += int(np.asarray(wavs).reshape(n, -1).shape[1]) * n
        return total

    infer(1, 0)  # warm-up (numba normalizer, allocations)
    out: dict[str, Any] = {"tokens_per_row": tokens, "closed": {}}
    for n in args.concurrency:
        profile.take()
        cpu0, began, samples = time.process_time(), time.perf_counter(), 0
        for r in range(args.jobs_per_row):
            samples += infer(n, 100 + r)
        out["closed"][str(n)] = {
            "wall_s": time.perf_counter() - began,
            "cpu_s": time.process_time() - cpu0,
            "audio_s": samples / SAMPLE_RATE,
            "jobs": n * args.jobs_per_row,
            "seconds": profile.take(),
        }
    return out


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--system", choices=("engine", "native"), required=True)
    parser.add_argument("--code-root", type=Path, required=True, help="checkout whose server/ is measured")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    parser.add_argument("--jobs-per-row", type=int, default=2)
    parser.add_argument("--ttfa-repeats", type=int, default=5)
    parser.add_argument("--low", type=int, default=120, help="shortest job, tokens")
    parser.add_argument("--span", type=int, default=140, help="job lengths spread over this many tokens")
    args = parser.parse_args()
    sys.path.insert(0, str(args.code_root.resolve()))
    import torch

    torch.set_num_threads(args.threads)
    result = run_engine(args) if args.system == "engine" else run_native(args)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
