"""References for the static engine path: plain transformers generation, host reads, a recording runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from server.engine.chattts.step.sampling import (
    PENALTY_WINDOW,
    RowSampling,
    counter_uniforms,
    sample_codes,
    stream_key,
)
from server.engine_api import SequenceRequest


def plain_generation(engine: Any, request: SequenceRequest) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence alone through ``LlamaModel.forward`` with transformers' own ``DynamicCache``.

    What the engine computed before static slots (and what ChatTTS's ``GPT.generate`` runs):
    the whole prompt unpadded, then one token per call with the cache growing by concatenation.
    It samples with the engine's sampling chain and the same counter-based draws, so any
    difference in tokens comes from the KV slots, masks, buckets or the step itself.

    Returns:
        ``(codes (k, num_vq), hiddens (k, hidden))`` of the accepted tokens, on the CPU.
    """
    chat, llama, step = engine._chat, engine._llama, engine._batch.token_step
    params = request.params
    ids, _, text_mask = chat.tokenizer.encode(
        [engine.prompt_text(request.text, params)], engine.num_vq, device=engine.device
    )
    speaker = engine.voices.resolve(params.voice)
    assert params.seed is not None
    dev = engine.device
    k0, k1 = (torch.tensor([k], device=dev) for k in stream_key(params.seed + request.seed_offset))
    streams = torch.arange(engine.num_vq, device=dev)
    max_tokens = min(request.max_tokens, engine.segment_max_tokens, engine.max_len - int(ids.shape[1]))
    history = torch.full((1, engine.num_vq, PENALTY_WINDOW), engine.eos + 1, device=dev)
    sampling = RowSampling(
        temperature=torch.tensor([params.temperature], device=dev),
        top_p=torch.tensor([params.top_p], device=dev),
        top_k=torch.tensor([params.top_k], device=dev),
        suppress_eos=torch.tensor([False], device=dev),
    )
    codes_out, hiddens_out = [], []
    with torch.inference_mode():
        emb = chat.embed(ids, text_mask)
        chat.speaker.apply(emb, speaker, ids, chat.tokenizer.spk_emb_ids, engine.device)
        out = llama(inputs_embeds=emb.to(engine.dtype), use_cache=True)
        for i in range(max_tokens):
            hidden = out.last_hidden_state[:, -1].float()
            logits = torch.einsum("bh,qvh->bqv", hidden, step.head_w)
            early = torch.tensor([i < engine.min_tokens], device=dev)
            ban = RowSampling(sampling.temperature, sampling.top_p, sampling.top_k, early)
            u = counter_uniforms(k0, k1, torch.tensor([i], device=dev), streams)
            codes = sample_codes(
                logits, history, ban, u, eos=engine.eos, repetition_penalty=step.repetition_penalty
            )
            if bool(codes.eq(engine.eos).any()):
                break
            codes_out.append(codes[0])
            hiddens_out.append(hidden[0])
            history = torch.cat([history[:, :, 1:], codes.unsqueeze(2)], dim=2)
            if i + 1 == max_tokens:
                break
            emb = step.code_w[streams, codes].sum(dim=1)
            out = llama(
                inputs_embeds=emb.unsqueeze(1).to(engine.dtype),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    # On the host, like the engine's token taps, whatever the device.
    return torch.stack(codes_out).cpu(), torch.stack(hiddens_out).cpu()


_READS = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__array__",
    "nonzero",
}


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``.to("cpu")`` spelled out; ``.to(x.device)`` (on the CPU here) keeps a tensor on its device."""
    return "cpu" in (*args[1:], kwargs.get("device"))


class HostReads(TorchFunctionMode):
    """Counts calls that bring a tensor's value to the host (each one a sync on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.calls: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS or (name == "to" and _to_cpu(args, kwargs)):
            self.count += 1
            self.calls.append(name)
        return func(*args, **kwargs)


class RecordingRunner:
    """A stand-in for the CUDA graph runner that checks, eagerly, what graph replay relies on.

    ``prepare`` "captures" each shape (runs it once); ``run`` refuses shapes never prepared
    and checks that the step read nothing back to the host, replaced none of the state's
    tensors (a graph keeps the addresses it captured) and rebound no attribute of the step
    (Python side effects do not happen on replay).
    """

    kind = "recording"

    def __init__(self, step: Any) -> None:
        self.step = step
        self.prepared: set[tuple[int, int]] = set()
        self.runs: list[tuple[int, int]] = []
        self.reads_inside = 0
        self._ptrs = self._addresses()
        self._attrs = {k: id(v) for k, v in vars(step).items()}

    def _addresses(self) -> dict[str, int]:
        tensors = self.step.state.tensors()
        tensors |= {f"k{i}": t for i, t in enumerate(self.step.kv.keys)}
        tensors |= {f"v{i}": t for i, t in enumerate(self.step.kv.values)}
        return {name: t.data_ptr() for name, t in tensors.items()}

    def _checked(self, batch: int, length: int) -> None:
        with HostReads() as reads:
            self.step(batch, length)
        self.reads_inside += reads.count
        assert reads.count == 0, f"the step read values back to the host: {reads.calls}"
        assert self._addresses() == self._ptrs, "the step replaced a state or KV tensor"
        assert {k: id(v) for k, v in vars(self.step).items()} == self._attrs, "the step rebound an attribute"

    def prepare(self, shapes: Any) -> None:
        for batch, length in shapes:
            self._checked(batch, length)
            self.prepared.add((batch, length))

    def run(self, batch: int, length: int) -> None:
        assert (batch, length) in self.prepared, f"shape {(batch, length)} was never captured"
        self._checked(batch, length)
        self.runs.append((batch, length))
