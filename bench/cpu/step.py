"""The token step on the CPU against what the hardware allows (issue #23), in one process.

``python -m bench.cpu.step --model-dir DIR --out X.json`` (run by :mod:`bench.cpu`)

Rows, each at batch 1, 4 and 8, interleaved round by round (a shared machine slows every
row of a round alike; the fastest round of each row is reported, since interference only
ever adds time, and every round is kept with the load average after it):

* ``floor``: one bf16 matrix product reading as many weights as the GPT has (190 M for
  ChatTTS), plain and oneDNN-packed, the faster one: what reading the weights once costs;
* ``floor-int8``: one w8a8 product reading as many int8 weights, FBGEMM's int8 × int8 and this
  project's VNNI kernel (where each runs), the faster one: the floor of the w8a8 step, which
  reads half the bytes of a bf16 one;
* ``products-<form>``: the GPT's 140 projections one by one, each form the step can use
  (``dense``: ``F.linear`` on bf16, what the step ran before issue #23; ``onednn-bf16``:
  prepacked; ``int8``: weight-only int8; ``w8a8``: int8 weights times per-row int8
  activations, FBGEMM);
* ``transformers``: transformers' own ``LlamaModel`` (same config and weights, dense bf16,
  its own ``DynamicCache`` holding ``length - 1`` positions, SDPA): one token;
* ``step-<form>``: the engine's whole token step (heads, sampling, code embedding, the
  Llama with our attention and KV slots, every row's slot holding ``length - 1`` random
  positions as transformers' cache does) with the projections in that form, split into
  projections, attention, KV writes, the rest of the Llama (norms, rotary, residuals, MLP
  activation) and the rest of the step (heads, sampling, bookkeeping);
* with ``--compile``: ``transformers-compiled`` (``torch.compile``, default mode) and its
  compile time;
* with ``--compiled-step FORMS`` (``bf16``, ``int8``, ``w8a8``, ``w8a8-ahead``): ``step-compiled``,
  ``step-compiled-int8`` and ``step-compiled-w8a8``, the engine's own ``--compile-step on``
  runner (with that ``--quantize`` for the last two), and ``step-compiled-w8a8-ahead``, the
  default's ``--compile-step ahead`` (graphs built ahead of time, unfrozen; ``w8a8-fbgemm-ahead``: the same
  with FBGEMM's products where the VNNI kernel would run), each on a fresh load of the model
  after the other rows (:mod:`bench.cpu.compiled`), compiled at these batches and this length,
  timed over the same number of rounds with the int8 floor timed beside it in every round
  (``<row>:floor-int8``), with its compile time.

Plus ``torch.profiler``'s top operators of one step of each ``step-<form>`` at every batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.cpu.compiled import compiled_step
from bench.cpu.floors import floor, int8_floor
from bench.cpu.rig import fill_slots, median_ms, record
from bench.harness.engine_bench import timed
from server.engine.chattts.step.linear import PROJECTIONS, Int8Linear, PackedLinear, w8a8_layer

FORMS = ("dense", "onednn-bf16", "int8", "w8a8")
SPLIT = ("projections", "attention", "kv_write", "llama_rest", "step_rest")


class Forms:
    """The 140 projections in every form, swapped into the engine's Llama on demand."""

    def __init__(self, layers: list[nn.Module], float_weights: list[list[torch.Tensor]]) -> None:
        self.layers = layers
        dense = [[_dense(w) for w in ws] for ws in float_weights]
        self.modules: dict[str, list[list[nn.Module]]] = {
            "dense": dense,
            "onednn-bf16": [[PackedLinear(m.weight) for m in ms] for ms in dense],
            "int8": [[Int8Linear(w).to(dtype=torch.bfloat16) for w in ws] for ws in float_weights],
            "w8a8": [w8a8_layer(ws) for ws in float_weights],
        }

    def use(self, form: str) -> None:
        """Put the ``form`` modules into every layer."""
        for layer, modules in zip(self.layers, self.modules[form], strict=True):
            for (owner, name), module in zip(PROJECTIONS, modules, strict=True):
                setattr(getattr(layer, owner), name, module)

    def products(self, form: str, batch: int) -> Callable[[], None]:
        """The 140 products one by one on ``(batch, in)`` inputs."""
        modules = [m for ms in self.modules[form] for m in ms]
        inputs = {n: torch.randn(batch, n, dtype=torch.bfloat16) for n in {_in_features(m) for m in modules}}
        pairs = [(m, inputs[_in_features(m)]) for m in modules]

        def run() -> None:
            for module, x in pairs:
                module(x)

        return run


def _dense(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
    return linear


def _in_features(module: nn.Module) -> int:
    return int(getattr(module, "in_features"))  # noqa: B009 (all three forms have it)


class Split:
    """Wall time of the step's parts, through hooks and wrappers (the CPU runs ops synchronously)."""

    def __init__(self, engine: Any) -> None:
        from server.engine.chattts.step import kv, token_step

        self.seconds: Counter[str] = Counter()
        self.step = engine._batch.token_step
        self._token_step, self._kv = token_step, kv
        self._hooks: list[Any] = []

    @contextmanager
    def active(self, layers: list[nn.Module]) -> Iterator[None]:
        """Time the parts while inside."""
        began: list[float] = []
        for layer in layers:
            for owner, name in PROJECTIONS:
                module = getattr(getattr(layer, owner), name)
                self._hooks.append(
                    module.register_forward_pre_hook(lambda *_: began.append(time.perf_counter()))
                )
                self._hooks.append(module.register_forward_hook(lambda *_: self._add("projections", began)))
        saved = (self.step.attend, self._kv.StepCache.update, type(self.step)._feed)
        self.step.attend = timed(self.seconds, "attention", saved[0])
        self._kv.StepCache.update = timed(self.seconds, "kv_write", saved[1])  # type: ignore[method-assign]
        type(self.step)._feed = timed(self.seconds, "llama", saved[2])  # type: ignore[method-assign]
        try:
            yield
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self.step.attend = saved[0]
            self._kv.StepCache.update = saved[1]  # type: ignore[method-assign]
            type(self.step)._feed = saved[2]  # type: ignore[method-assign]

    def _add(self, name: str, began: list[float]) -> None:
        self.seconds[name] += time.perf_counter() - began.pop()

    def measure(self, layers: list[nn.Module], batch: int, length: int, steps: int) -> dict[str, float]:
        """Milliseconds per step of each part over ``steps`` steps."""
        self.seconds.clear()
        with self.active(layers):
            began = time.perf_counter()
            for _ in range(steps):
                self.step(batch, length)
            total = time.perf_counter() - began
        s = {k: 1000 * v / steps for k, v in self.seconds.items()}
        llama = s.get("llama", 0.0)
        parts = {k: s.get(k, 0.0) for k in ("projections", "attention", "kv_write")}
        return {
            **parts,
            "llama_rest": llama - sum(parts.values()),
            "step_rest": 1000 * total / steps - llama,
            "total": 1000 * total / steps,
        }


def top_ops(fn: Callable[[], None], rows: int = 12) -> list[dict[str, Any]]:
    """``torch.profiler``'s operators of one call by self CPU time: name, calls, ms."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1000, 3)}
        for e in events[:rows]
    ]


class Transformers:
    """transformers' own ``LlamaModel`` with the engine's dense bf16 weights: one token over a cache."""

    def __init__(self, config: Any, dense: list[list[nn.Module]], norms: dict[str, torch.Tensor]) -> None:
        from transformers import LlamaModel

        self.model = LlamaModel(config).to(torch.bfloat16).eval()
        self.model.load_state_dict({k: v.to(torch.bfloat16) for k, v in norms.items()}, strict=False)
        for layer, modules in zip(self.model.layers, dense, strict=True):
            for (owner, name), module in zip(PROJECTIONS, modules, strict=True):
                setattr(getattr(layer, owner), name, module)

    def token(self, batch: int, length: int, model: Any = None) -> Callable[[], None]:
        """One token step at ``batch`` rows over ``length - 1`` cached positions."""
        from transformers.cache_utils import DynamicCache

        run_model, hidden = model or self.model, int(self.model.config.hidden_size)
        cache = DynamicCache()
        prompt = torch.randn(batch, length - 1, hidden, dtype=torch.bfloat16)
        run_model(inputs_embeds=prompt, past_key_values=cache)
        x = torch.randn(batch, 1, hidden, dtype=torch.bfloat16)

        def run() -> None:
            run_model(inputs_embeds=x, past_key_values=cache, use_cache=True)
            cache.crop(length - 1)

        return run


def main() -> int:
    """Load the engine, build every form, run the rounds, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--length", type=int, default=256, help="attention length (a bucket of the engine's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=8, help="calls per timed run")
    p.add_argument("--compile", action="store_true", help="also torch.compile transformers' LlamaModel")
    p.add_argument(
        "--compiled-step",
        default="",
        help="comma-separated: bf16, int8, w8a8 (--compile-step on), w8a8-ahead (--compile-step ahead), "
        "w8a8-fbgemm-ahead (FBGEMM's products)",
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from server.engine.chattts.assets import load_chat
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.options import EngineOptions

    batches = [int(b) for b in args.batches.split(",")]
    loaded = load_chat(model_dir=args.model_dir, device=torch.device("cpu"))
    llama = loaded.chat.gpt.gpt
    float_weights = [
        [getattr(getattr(layer, o), n).weight.detach().clone() for o, n in PROJECTIONS]
        for layer in llama.layers
    ]
    norms = {k: v.detach().clone() for k, v in llama.state_dict().items() if "norm" in k}
    config = llama.config
    options = EngineOptions(max_batch=max(batches))
    engine = ChatTTSEngine(loaded, device=torch.device("cpu"), dtype=torch.bfloat16, options=options)
    layers = list(engine._llama.layers)
    forms = Forms(layers, float_weights)
    del float_weights
    weights = sum(int(m.weight.numel()) for ms in forms.modules["dense"] for m in ms)
    transformers = Transformers(config, forms.modules["dense"], norms)
    length = min(args.length, engine.max_len)
    step, split = engine._batch.token_step, Split(engine)
    rows: dict[str, dict[str, list[float]]] = {}  # name@batch → wall and CPU ms of every round
    splits: dict[str, dict[str, dict[str, float]]] = {}
    loads: list[float] = []
    compiled: dict[str, Any] = {}
    int8 = int8_floor(weights, int(config.hidden_size))  # packed once: every round reads the same weights
    with torch.inference_mode():
        fill_slots(engine, max(batches), length)
        if args.compile:
            began = time.perf_counter()
            model = torch.compile(transformers.model)
            compiled["model"] = model
            for batch in batches:
                transformers.token(batch, length, model)()
            compiled["compile_s"] = time.perf_counter() - began
        for r in range(args.rounds):
            for batch in batches:
                cases: dict[str, Callable[[], Any]] = {}
                fl = floor(weights, batch, int(config.hidden_size))
                cases["floor-plain"], cases["floor-packed"] = fl["plain"], fl["packed"]
                for kernel, for_batch in int8.items():
                    cases[f"floor-int8-{kernel}"] = for_batch(batch)
                for form in FORMS:
                    cases[f"products-{form}"] = forms.products(form, batch)
                cases["transformers"] = transformers.token(batch, length)
                if "model" in compiled:
                    cases["transformers-compiled"] = transformers.token(batch, length, compiled["model"])
                order = list(cases) if r % 2 == 0 else list(reversed(cases))
                for name in order:
                    record(rows, f"{name}@{batch}", *median_ms(cases[name], args.iterations))
                for form in FORMS if r % 2 == 0 else FORMS[::-1]:
                    forms.use(form)
                    key = f"step-{form}@{batch}"
                    record(rows, key, *median_ms(lambda b=batch: step(b, length), args.iterations))
                    measured = split.measure(layers, batch, length, args.iterations)
                    if key not in splits or measured["total"] < splits[key]["total"]:
                        splits[key] = measured
                loads.append(os.getloadavg()[0])
                print(f"[cpu_step] round {r} batch {batch}: load {loads[-1]:.1f}", flush=True)
        profiles = {}
        for form in FORMS:
            forms.use(form)
            for batch in batches:
                profiles[f"step-{form}@{batch}"] = top_ops(lambda b=batch: step(b, length))
    engine_extra = dict(engine.info.extra)
    step_compile_s: dict[str, float] = {}
    for quantize in [q for q in args.compiled_step.split(",") if q]:
        name, timing = compiled_step(
            args.model_dir, quantize, batches, length, args.rounds, args.iterations, floors=int8
        )
        step_compile_s[name] = timing.pop("compile_s")
        rows.update(timing)
    result = {
        "weights": weights,
        "length": length,
        "slot_positions": length - 1,  # random keys and values in every measured row's slot (fill_slots)
        "batches": batches,
        "threads": args.threads,
        "rows": {
            k: {**v, "best_ms": min(v["ms"]), "best_cpu_ms": min(v["cpu_ms"]) if v.get("cpu_ms") else None}
            for k, v in rows.items()
        },
        "splits": splits,
        "profiles": profiles,
        "loadavg_after_rounds": loads,
        "compile_s": compiled.get("compile_s"),
        "compiled_step_compile_s": step_compile_s,
        "engine": engine_extra,
        "transformers_attention": getattr(config, "_attn_implementation", None),
    }
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
