"""RSS of the ChatTTS engine in-process under batches of varied shapes (issue #9 soak finding).

The soak's RSS rises after its warm-up and then levels off. This probe removes the server,
sockets and scheduler: it steps ``ChatTTSEngine`` directly over random batch sizes, text
lengths and token limits (new tensor shapes), and prints RSS every 50 batches. A per-shape
cache (oneDNN primitives, allocator pools) levels off; a leak keeps growing.

    python -m bench.studies.rss_shapes --model-dir DIR --batches 400 [--prefill-bucket 1]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import psutil

from server.engine.chattts.engine import ChatTTSEngine
from server.engine.chattts.options import EngineOptions
from server.engine_api import SequenceRequest, SynthesisParams

WORDS = ["你好", "世界", "hello", "world", "speech", "语音", "合成", "测试", "streaming", "server"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--prefill-bucket", type=int, default=16, help="the engine's prefill_bucket (1: off)")
    args = parser.parse_args()
    engine = ChatTTSEngine.load(
        model_dir=args.model_dir,
        device="cpu",
        dtype="auto",
        num_threads=args.threads,
        options=EngineOptions(prefill_bucket=args.prefill_bucket),
    )
    engine.warmup()
    rng = random.Random(0)
    process = psutil.Process()
    seq_id = 0
    started = time.monotonic()
    for batch in range(args.batches):
        ids = []
        for _ in range(rng.randint(1, 8)):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
            request = SequenceRequest(
                seq_id=seq_id, text=text, params=SynthesisParams(seed=seq_id), max_tokens=rng.randint(8, 120)
            )
            engine.add(request)
            ids.append(seq_id)
            seq_id += 1
        while ids:
            ids = [r.seq_id for r in engine.step(ids) if not r.finished]
        if batch % args.every == 0:
            print(
                f"batch {batch:4d}  sequences {seq_id:5d}  rss {process.memory_info().rss / 2**20:7.1f} MiB",
                flush=True,
            )
    print(
        f"end: rss {process.memory_info().rss / 2**20:.1f} MiB after {seq_id} sequences,"
        f" {time.monotonic() - started:.0f} s"
    )
    engine.close()


if __name__ == "__main__":
    main()
