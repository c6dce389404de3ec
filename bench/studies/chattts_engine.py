"""Benchmark ChatTTSEngine against ChatTTS's own infer(stream=True) on the same weights.

Usage:
    python -m bench.studies.chattts_engine --make-model /tmp/chattts-full  # once: full-size random weights
    python -m bench.studies.chattts_engine --model-dir /tmp/chattts-full --threads 2 \
        --out bench/results/studies/chattts-engine-<hw>.json
    python -m bench.studies.chattts_engine --rss --threads 2   # RSS over 200 requests (tiny model)

Measures (full-size model):
* time to first audio at batch 1: native ``Chat.infer(stream=True)`` vs ours (fp32 and bf16);
* incremental decode time for 2000 vs 200 tokens (linearity), full-size Decoder+Vocos;
* in-batch determinism: one request alone vs with two neighbours (fp32, bf16).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.engine.chattts.assets import load_chat
from server.engine.chattts.decode import StreamDecoder
from server.engine.chattts.devmodel import make_dev_model
from server.engine.chattts.engine import ChatTTSEngine
from server.engine.chattts.options import EngineOptions
from server.engine_api import SequenceRequest, SynthesisParams

TEXT = "Streaming speech should start quickly and never click between chunks."
SEED = 11


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores_visible": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def native_ttfa(chat: Any, spk: str, tokens: int) -> dict[str, float]:
    """ChatTTS's own streaming, defaults except what random weights and fairness need."""
    params = chat.InferCodeParams(
        spk_emb=spk,
        manual_seed=SEED,
        min_new_token=tokens,  # random weights: force the length
        max_new_token=tokens,
        show_tqdm=False,
    )
    started = time.perf_counter()
    first = None
    total = 0
    for chunk in chat.infer(
        TEXT,
        stream=True,
        skip_refine_text=True,  # refinement is a separate text rewrite (384 random tokens here)
        split_text=False,  # True runs an extra generation per call (CHATTTS-FACTS)
        do_text_normalization=False,  # our server normalizes in text.py, outside the engine
        do_homophone_replacement=False,
        params_infer_code=params,
    ):
        if first is None and chunk.size > 0:
            first = time.perf_counter() - started
        total += chunk.shape[-1]
    return {
        "ttfa_s": float(first or float("nan")),
        "total_s": time.perf_counter() - started,
        "samples": total,
    }


def ours_ttfa(engine: ChatTTSEngine, tokens: int, seq_id: int) -> dict[str, float]:
    request = SequenceRequest(seq_id=seq_id, text=TEXT, params=SynthesisParams(seed=SEED), max_tokens=tokens)
    started = time.perf_counter()
    engine.add(request)
    first = None
    total = 0
    finished = False
    while not finished:
        (res,) = engine.step([seq_id])
        if first is None and len(res.audio):
            first = time.perf_counter() - started
        total += len(res.audio)
        finished = res.finished
    return {
        "ttfa_s": float(first or float("nan")),
        "total_s": time.perf_counter() - started,
        "samples": total,
    }


def decode_time(decode: Any, n_tokens: int, hidden: int, schedule: tuple[int, ...]) -> float:
    hiddens = torch.randn(n_tokens, hidden, generator=torch.Generator().manual_seed(0))
    stream = StreamDecoder(decode)
    done, i = 0, 0
    started = time.perf_counter()
    with torch.inference_mode():
        while done < n_tokens:
            k = min(schedule[min(i, len(schedule) - 1)], n_tokens - done)
            stream.push(hiddens[done : done + k])
            done += k
            i += 1
            stream.pull(final=done == n_tokens)
    return time.perf_counter() - started


def in_batch(engine: ChatTTSEngine, base_id: int) -> dict[str, float]:
    def run(reqs: list[SequenceRequest]) -> dict[int, np.ndarray]:
        for r in reqs:
            engine.add(r)
        out: dict[int, list[np.ndarray]] = {r.seq_id: [] for r in reqs}
        live = [r.seq_id for r in reqs]
        while live:
            for res in engine.step(live):
                out[res.seq_id].append(res.audio)
                if res.finished:
                    live.remove(res.seq_id)
        return {k: np.concatenate(v) for k, v in out.items()}

    target = SequenceRequest(seq_id=base_id, text=TEXT, params=SynthesisParams(seed=SEED), max_tokens=64)
    alone = run([target])[base_id]
    others = [
        SequenceRequest(seq_id=base_id + 1, text=TEXT * 2, params=SynthesisParams(seed=1), max_tokens=96),
        SequenceRequest(seq_id=base_id + 2, text="short", params=SynthesisParams(seed=2), max_tokens=40),
    ]
    together = run([others[0], target, others[1]])[base_id]
    n = min(len(alone), len(together))
    return {
        "same_length": float(len(alone) == len(together)),
        "max_abs_diff": float(np.abs(alone[:n] - together[:n]).max()),
        "peak": float(np.abs(alone).max()),
    }


def bench_full(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_chat(model_dir=args.model_dir, device=torch.device("cpu"))
    chat = loaded.chat
    result: dict[str, Any] = {"machine": machine(), "model": "full-size random weights (make_dev_model full)"}
    forced = EngineOptions(min_tokens=args.tokens)
    engine32 = ChatTTSEngine(loaded, device=torch.device("cpu"), dtype=torch.float32, options=forced)
    spk = engine32.voices.speaker_string("seed:2")
    engine32.warmup()
    native_ttfa(chat, spk, 30)  # warm-up run, not recorded
    native, ours32 = [], []
    for i in range(args.repeats):  # interleaved, so load changes on the machine hit both alike
        native.append(native_ttfa(chat, spk, args.tokens))
        ours32.append(ours_ttfa(engine32, args.tokens, 1000 + i))
    result["native_fp32"] = native
    result["ours_fp32"] = ours32
    result["in_batch_fp32"] = in_batch(engine32, 2000)
    result["decode"] = {
        # min of 3: the least disturbed run (this CPU is shared; interference only adds time)
        f"{n}_tokens_s": min(
            decode_time(engine32._decode_fn, n, engine32.hidden_size, engine32.block_schedule)
            for _ in range(3)
        )
        for n in (200, 2000)
    }
    d = result["decode"]
    d["ratio_2000_over_10x200"] = d["2000_tokens_s"] / (10 * d["200_tokens_s"])
    engine16 = ChatTTSEngine(loaded, device=torch.device("cpu"), dtype=torch.bfloat16, options=forced)
    engine16.warmup()
    result["ours_bf16"] = [ours_ttfa(engine16, args.tokens, 3000 + i) for i in range(args.repeats)]
    result["in_batch_bf16"] = in_batch(engine16, 4000)
    nat = statistics.median(r["ttfa_s"] for r in native)
    result["summary"] = {
        "native_ttfa_s": nat,
        "ours_fp32_ttfa_s": statistics.median(r["ttfa_s"] for r in ours32),
        "ours_bf16_ttfa_s": statistics.median(r["ttfa_s"] for r in result["ours_bf16"]),
    }
    s = result["summary"]
    s["native_ttfa_min_s"] = min(r["ttfa_s"] for r in native)
    s["ours_fp32_ttfa_min_s"] = min(r["ttfa_s"] for r in ours32)
    s["ours_bf16_ttfa_min_s"] = min(r["ttfa_s"] for r in result["ours_bf16"])
    s["ratio_fp32"] = s["ours_fp32_ttfa_s"] / nat
    s["ratio_bf16"] = s["ours_bf16_ttfa_s"] / nat
    s["decode_linearity"] = d["ratio_2000_over_10x200"]
    s["pass_ttfa"] = s["ratio_fp32"] <= 0.25 and s["ratio_bf16"] <= 0.25
    s["pass_decode_linearity"] = d["ratio_2000_over_10x200"] <= 1.3
    return result


def bench_rss(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        make_dev_model("tiny", Path(tmp))
        engine = ChatTTSEngine.load(model_dir=tmp, device="cpu", dtype="auto")
        engine.warmup()
        # a few requests first: allocator pools and caches settle
        for i in range(10):
            ours_ttfa(engine, 48, 10_000 + i)
        gc.collect()
        before = rss_mb()
        samples = []
        for i in range(args.requests):
            ours_ttfa(engine, 48, 20_000 + i)
            if i % 20 == 19:
                samples.append(rss_mb())
        gc.collect()
        after = rss_mb()
        engine.close()
    return {
        "machine": machine(),
        "requests": args.requests,
        "rss_before_mb": before,
        "rss_after_mb": after,
        "rss_every_20_mb": samples,
        "growth_pct": 100 * (after - before) / before,
        "pass": (after - before) / before < 0.05,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-model", type=Path, help="write a full-size dev model here and exit")
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96, help="forced length of each TTFA request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rss", action="store_true")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.make_model:
        make_dev_model("full", args.make_model)
        return
    result = bench_rss(args) if args.rss else bench_full(args)
    result["command"] = "python -m bench.studies.chattts_engine " + " ".join(sys.argv[1:])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
