"""The child process of :mod:`bench.studies.hotpath`: one system, loaded once, answering measurement commands.

``python -m bench.baselines.system --system engine --code-root DIR --model-dir M`` prints
``{"ready": ...}``, then reads one JSON command per line on stdin (``{"run": "ttfa"}``,
``{"run": "profile", "batch": 8}``, ``{"run": "closed", "n": 8, "seconds": 30}``,
``{"run": "quit"}``) and answers each with one JSON line, so the parent can alternate
systems scenario by scenario while each keeps its model loaded.

``--code-root`` is put first on ``sys.path`` before anything of ``server`` is imported, so
the same child measures the engine of this tree or of another checkout (the code before a
change). Only API both versions share is used: ``ChatTTSEngine(loaded, device=, dtype=)``
with ``min_tokens`` (and ``max_batch`` where accepted), ``add``/``step``/``drop``/``warmup``.
The options go in one ``EngineOptions`` where the tree has
``server/engine/chattts/options.py``, as keyword arguments where it does not.

Time shares come from wrapping the functions each version spends its time in, with
exclusive accounting (a wrapped call inside another is subtracted from the outer one).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
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
SAMPLE_RATE = 24_000


def job_tokens(k: int, low: int, span: int) -> int:
    """Length of job ``k``: staggered, so rows end (and new ones join) at different steps."""
    return low + (k * 37) % span


class Profile:
    """Wall time per category on the calling thread, exclusive of nested wrapped calls."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._stack: list[list[float]] = []
        # On a GPU the work is asynchronous: ``sync`` (the device's synchronize) makes each
        # wrapped call's time its own instead of the next host read's.
        self.sync: Callable[[], None] = lambda: None

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = name(*args, **kwargs) if callable(name) else name
            frame = [time.perf_counter(), 0.0]  # start, time spent in nested wrapped calls
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
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
    import server.engine.chattts.engine as engine_module

    cls = engine_module.ChatTTSEngine
    if hasattr(cls, "_prefill"):  # before a step's newcomers were prefilled together
        cls._prefill = profile.wrap("prefill", cls._prefill)  # type: ignore[method-assign]
    try:  # this tree: static step
        import server.engine.chattts.step.runner as block

        if not hasattr(cls, "_prefill"):
            block.SlotBatch.prefill = profile.wrap("prefill", block.SlotBatch.prefill)  # type: ignore[method-assign]
        import server.engine.chattts.step.token_step as step

        step.TokenStep._feed = profile.wrap("llama", step.TokenStep._feed)  # type: ignore[method-assign]
        step.sample_codes = profile.wrap("sampling", step.sample_codes)
        step.counter_uniforms = profile.wrap("sampling", step.counter_uniforms)
        if hasattr(block.SlotBatch, "_decode"):  # before the block loop had its own module
            block.SlotBatch._decode = profile.wrap("decode", block.SlotBatch._decode)
        else:
            from server.engine.chattts.step.block import BlockLoop

            BlockLoop.decode = profile.wrap("decode", BlockLoop.decode)  # type: ignore[method-assign]
    except ImportError:  # before: row groups
        from server.engine.chattts.decode import StreamDecoder

        engine_module.sample_codes = profile.wrap("sampling", engine_module.sample_codes)  # type: ignore[attr-defined]
        cls._sampling = profile.wrap("sampling", cls._sampling)  # type: ignore[attr-defined]
        cls._forward_codes = profile.wrap("llama", cls._forward_codes)  # type: ignore[attr-defined]
        StreamDecoder.pull = profile.wrap("decode", StreamDecoder.pull)  # type: ignore[method-assign]


class EngineSystem:
    """One engine version, loaded once; each command runs one measurement on it."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from server.engine.chattts.assets import load_chat
        from server.engine.chattts.engine import ChatTTSEngine

        self.args, self.profile = args, Profile()
        device = torch.device(args.device)
        instrument_engine(self.profile)
        loaded = load_chat(model_dir=args.model_dir, device=device)
        options: dict[str, Any] = {"min_tokens": 1 << 20}  # EOS banned: every job runs to its own length
        if getattr(args, "block_schedule", None):  # bench.gpu.engine compares schedules
            options["block_schedule"] = tuple(int(x) for x in args.block_schedule.split(","))
        if "options" in str(inspect.signature(ChatTTSEngine.__init__)):  # KV slots
            options["max_batch"] = args.max_batch
        began = time.perf_counter()
        try:  # this tree: one options object
            from server.engine.chattts.options import EngineOptions
        except ImportError:  # before: keyword options
            self.engine = ChatTTSEngine(loaded, device=device, dtype=torch.bfloat16, **options)
        else:
            self.engine = ChatTTSEngine(
                loaded, device=device, dtype=torch.bfloat16, options=EngineOptions(**options)
            )
        self.engine.warmup()
        self.ready = {"load_and_warmup_s": time.perf_counter() - began, "extra": dict(self.engine.info.extra)}
        self._seq = iter(range(1 << 30))
        self._loop: dict[str, Any] | None = None  # the closed loop kept running between slices

    def add(self, k: int, tokens: int) -> int:
        from server.engine_api import SequenceRequest, SynthesisParams

        sid = next(self._seq)
        params = SynthesisParams(seed=1000 + k)
        self.engine.add(
            SequenceRequest(seq_id=sid, text=TEXTS[k % len(TEXTS)], params=params, max_tokens=tokens)
        )
        return sid

    def ttfa(self, command: dict[str, Any]) -> dict[str, Any]:
        """Time to first audio of one stream alone (prefill + first block + its decode)."""
        began = time.perf_counter()
        sid = self.add(command.get("k", 0), 40)
        while not len(self.engine.step([sid])[0].audio):
            pass
        ttfa = time.perf_counter() - began
        self.engine.drop(sid)
        return {"ttfa_s": ttfa}

    def end_loop(self) -> None:
        """Drop the rows of the closed loop kept running between slices (their slots free again)."""
        if self._loop is not None:
            for sid in self._loop["live"]:
                self.engine.drop(sid)
            self._loop = None

    def steady_rows(self, batch: int) -> list[int]:
        """``batch`` long rows past their schedule's ramp, on its last (longest) block: steady state."""
        ids = [self.add(k, 400) for k in range(batch)]
        for _ in range(self.ramp_blocks()):
            self.engine.step(ids)
        return ids

    def ramp_blocks(self) -> int:
        """Blocks before a row reaches its schedule's last block size (3 for a tree without the layout)."""
        layout = getattr(getattr(self.engine, "_batch", None), "layout", None)
        schedule = getattr(layout, "block_schedule", None)
        return len(schedule) - 1 if schedule else 3

    def profile_block(self, command: dict[str, Any]) -> dict[str, Any]:
        """One steady-state block (every row on its schedule's last block size) at ``batch`` rows.

        Three blocks are measured and the fastest is kept: work from other processes on a
        shared machine only ever adds time.
        """
        batch = command["batch"]
        ids = self.steady_rows(batch)
        best: dict[str, Any] = {}
        for _ in range(3):
            self.profile.take()
            began = time.perf_counter()
            tokens = sum(r.tokens for r in self.engine.step(ids)) // batch
            wall = time.perf_counter() - began
            if not best or wall / tokens < best["wall_s"] / best["tokens"]:
                best = {"wall_s": wall, "tokens": tokens, "seconds": self.profile.take()}
        for sid in ids:
            self.engine.drop(sid)
        return best

    def closed(self, command: dict[str, Any]) -> dict[str, Any]:
        """A slice of ``seconds`` of a closed loop of ``n`` rows, each ended row replaced by the next job.

        ``continue``: resume the loop the previous slice left (same ``n``), so slices of the two
        engines can alternate every few seconds in steady state; otherwise start from job 0
        (the same jobs for every system).
        """
        n, seconds, a = command["n"], command["seconds"], self.args
        loop = self._loop if command.get("continue") and self._loop and self._loop["n"] == n else None
        if loop is None:
            self.end_loop()
            live = {self.add(k, job_tokens(k, a.low, a.span)): k for k in range(n)}
            loop = self._loop = {"n": n, "live": live, "started": n}
        live = loop["live"]
        self.profile.take()
        cpu0, began, samples, jobs = time.process_time(), time.perf_counter(), 0, loop["started"]
        blocks = token_steps = 0
        while time.perf_counter() - began < seconds:
            results = self.engine.step(list(live))
            blocks += 1
            token_steps += max((r.tokens for r in results), default=0)
            for result in results:
                samples += len(result.audio)
                if result.finished:
                    del live[result.seq_id]
                    k = loop["started"]
                    live[self.add(k, job_tokens(k, a.low, a.span))] = k
                    loop["started"] += 1
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu0
        audio = samples / SAMPLE_RATE
        jobs = loop["started"] - jobs
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "audio_s": audio,
            "jobs_started": jobs,
            # token steps per engine step: what a server's /metrics calls tokens per block
            "blocks": blocks,
            "token_steps": token_steps,
            "seconds": self.profile.take(),
        }


class NativeSystem:
    """ChatTTS's own ``Chat.infer(stream=True)``, float32, stock settings, all rows one length."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from ChatTTS.model import processors
        from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

        from server.engine.chattts.assets import load_chat

        self.profile = Profile()
        began = time.perf_counter()
        self.chat = chat = load_chat(model_dir=args.model_dir, device=torch.device("cpu")).chat
        gpt = chat.gpt.gpt

        def llama_or_prefill(*args: Any, **kwargs: Any) -> str:
            return "prefill" if kwargs["inputs_embeds"].shape[1] > 1 else "llama"

        gpt.forward = self.profile.wrap(llama_or_prefill, gpt.forward)
        for cls in (
            processors.CustomRepetitionPenaltyLogitsProcessorRepeat,
            TopPLogitsWarper,
            TopKLogitsWarper,
        ):
            cls.__call__ = self.profile.wrap("sampling", cls.__call__)
        chat._decode_to_wavs = self.profile.wrap("decode", chat._decode_to_wavs)
        torch.manual_seed(2)
        self.speaker = chat.sample_random_speaker()
        self.tokens = round(sum(job_tokens(k, args.low, args.span) for k in range(64)) / 64)
        self._infer(1, 0, 30)  # warm-up (numba normalizer, allocations)
        self.ready = {"load_and_warmup_s": time.perf_counter() - began, "tokens_per_row": self.tokens}

    def _infer(self, n: int, seed: int, tokens: int) -> int:
        import numpy as np

        params = self.chat.InferCodeParams(
            spk_emb=self.speaker,
            manual_seed=seed,
            max_new_token=tokens,
            min_new_token=tokens,
            show_tqdm=False,
        )
        texts = [TEXTS[k % len(TEXTS)] for k in range(n)]
        options = {"stream": True, "skip_refine_text": True, "split_text": False, "params_infer_code": params}
        return sum(int(np.asarray(w).reshape(n, -1).shape[1]) * n for w in self.chat.infer(texts, **options))

    def closed(self, command: dict[str, Any]) -> dict[str, Any]:
        """One ``infer`` call with ``n`` rows of the mean job length (its batch is static)."""
        self.profile.take()
        cpu0, began = time.process_time(), time.perf_counter()
        samples = self._infer(command["n"], 100, self.tokens)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu0
        audio = samples / SAMPLE_RATE
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "audio_s": audio,
            "jobs": command["n"],
            "seconds": self.profile.take(),
        }


def main() -> int:
    """Load the system, say ``ready``, then answer one JSON command per stdin line with one JSON line."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--system", choices=("engine", "native"), required=True)
    parser.add_argument("--code-root", type=Path, required=True, help="checkout whose server/ is measured")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="torch device of the engine")
    parser.add_argument("--low", type=int, default=120, help="shortest job, tokens")
    parser.add_argument("--span", type=int, default=140, help="job lengths spread over this many tokens")
    args = parser.parse_args()
    sys.path.insert(0, str(args.code_root.resolve()))
    import torch

    torch.set_num_threads(args.threads)
    system: Any = EngineSystem(args) if args.system == "engine" else NativeSystem(args)
    print(json.dumps({"ready": system.ready}), flush=True)
    handlers = {"ttfa": "ttfa", "profile": "profile_block", "closed": "closed"}
    for line in sys.stdin:
        command = json.loads(line)
        if command["run"] == "quit":
            break
        result = getattr(system, handlers[command["run"]])(command)
        print(json.dumps({"result": result, "loadavg": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
