"""The engine speaks exactly as ChatTTS 0.2.5's own ``Chat.infer`` on the same weights (float32).

Real weights never reach these machines, so fidelity is proven by equivalence: ChatTTS's
``infer(skip_refine_text=True, split_text=False, params_infer_code=...)`` and our engine run on
the same tiny random checkpoint, with the same speaker and near-greedy sampling (a temperature so
low that both samplers pick the top code, whatever their random draws), and must agree on

* the prompt text the tokenizer receives (our text pipeline + ChatTTS's prompt decoration),
* every speech token (all four code streams) and where the sequence ends,
* the GPT hidden states of those tokens (within 1e-5) and their one-shot audio (within 1e-4).

A second test holds our sampling distribution bitwise equal to ChatTTS's logits processors and
warpers (temperature, repetition penalty, top-p, top-k, EOS ban) on random inputs.

The engine side uses only its public API: ``prompt_text``, ``add``, ``step``, ``decode_tokens``
and ``token_tap`` (called with each sequence's accepted codes and hidden states per step), so a
rewritten engine passes these tests unchanged as long as it keeps that API. ChatTTS is observed
through spies on its own methods (pinned at 0.2.5).

ChatTTS's default ``min_new_token=0`` with ``ensure_non_empty`` regenerates a sequence whose first
token is EOS; that is distributionally the same as banning EOS at step 0, which is what the
engine does (``min_tokens=1``), so native runs here use ``min_new_token=1``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from server.engine.chattts.options import EngineOptions
from server.engine_api import SequenceRequest, SynthesisParams, VoiceSample
from server.text.normalize import speakable

#: Low enough that every step's top code has probability ~1 in both samplers: the random model's
#: top two logits sometimes differ by only ~1e-5, which 1e-4 would leave a coin toss.
NEAR_GREEDY = 1e-12
MAX_TOKENS = 48


@dataclass
class NativeRun:
    prompt: str
    codes: torch.Tensor
    hiddens: torch.Tensor
    wav: np.ndarray


class NativeChat:
    """ChatTTS's own ``Chat`` on a model folder, with spies that record what ``infer`` did."""

    def __init__(self, model_dir: Path) -> None:
        from server.engine.chattts.assets import load_chat

        self.chat = load_chat(model_dir=model_dir, device=torch.device("cpu")).chat
        self._seen: dict[str, Any] = {}
        chat = self.chat
        generate, decode, encode = chat.gpt.generate, chat._decode_to_wavs, chat.tokenizer.encode

        def spy_generate(*args: Any, **kwargs: Any) -> Iterator[Any]:
            for result in generate(*args, **kwargs):
                self._seen["ids"] = [i.clone() for i in result.ids]
                self._seen["hiddens"] = [h.clone() for h in result.hiddens]
                yield result

        def spy_decode(*args: Any, **kwargs: Any) -> np.ndarray:
            wavs: np.ndarray = decode(*args, **kwargs)
            self._seen["wav"] = wavs.copy()
            return wavs

        def spy_encode(text: list[str], *args: Any, **kwargs: Any) -> Any:
            self._seen["prompt"] = list(text)
            return encode(text, *args, **kwargs)

        chat.gpt.generate = spy_generate
        chat._decode_to_wavs = spy_decode
        chat.tokenizer.encode = spy_encode

    def speaker(self, voice: str) -> str:
        """The ChatTTS speaker string ``voice`` names (``seed:N`` = manual_seed(N) then sample)."""
        if voice.startswith("seed:"):
            torch.manual_seed(int(voice.removeprefix("seed:")))
            spk: str = self.chat.sample_random_speaker()
            return spk
        return voice

    def infer(
        self,
        text: str,
        voice: str | None,
        speed_prompt: str,
        *,
        min_tokens: int = 1,
        max_tokens: int = MAX_TOKENS,
        spk_smp: str | None = None,
        txt_smp: str | None = None,
        refine: Any = None,
    ) -> NativeRun:
        """``infer`` with a speaker (``voice``), a recording's codes and transcript, or both.

        ``refine``: ChatTTS's ``RefineTextParams``, to run its refinement pass first.
        """
        chat = self.chat
        params = chat.InferCodeParams(
            prompt=speed_prompt,
            spk_emb=None if voice is None else self.speaker(voice),
            spk_smp=spk_smp,
            txt_smp=txt_smp,
            temperature=NEAR_GREEDY,
            top_P=0.7,
            top_K=20,
            repetition_penalty=1.05,
            max_new_token=max_tokens,
            min_new_token=min_tokens,
            show_tqdm=False,
        )
        self._seen.clear()
        chat.infer(
            [text],
            skip_refine_text=refine is None,
            split_text=False,
            params_refine_text=refine or chat.RefineTextParams(),
            params_infer_code=params,
        )
        [prompt] = self._seen["prompt"]
        return NativeRun(
            prompt=prompt,
            codes=self._seen["ids"][0].long(),
            hiddens=self._seen["hiddens"][0],
            wav=self._seen["wav"][0],
        )


@pytest.fixture(scope="module")
def native(tiny_model_dir: Path) -> NativeChat:
    return NativeChat(tiny_model_dir)


def ours(
    engine: Any, text: str, params: SynthesisParams, max_tokens: int = MAX_TOKENS
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Run one sequence through the engine's public API; its codes, hidden states, samples."""
    codes: list[torch.Tensor] = []
    hiddens: list[torch.Tensor] = []

    def tap(seq_id: int, c: torch.Tensor, h: torch.Tensor) -> None:
        assert seq_id == 1
        codes.append(c)
        hiddens.append(h)

    engine.token_tap = tap
    samples = 0
    try:
        engine.add(SequenceRequest(seq_id=1, text=text, params=params, max_tokens=max_tokens))
        for _ in range(max_tokens + 1):
            [result] = engine.step([1])
            samples += len(result.audio)
            if result.finished:
                break
        else:
            raise AssertionError("the sequence did not finish")
    finally:
        engine.token_tap = None
        engine.drop(1)
    return torch.cat(codes), torch.cat(hiddens), samples


def _speaker_string(native: NativeChat) -> str:
    torch.manual_seed(1234)
    spk: str = native.chat.sample_random_speaker()
    return spk


CASES = {
    "chinese": ("你好，欢迎使用实时语音服务！今天是2026年11月29日，气温-3.5度。", "seed:3", 1.0),
    "english": ('Hello there! "Quotes", (brackets) & 42 apples: doesn\'t it cost $12.50?', "seed:11", 1.0),
    "mixed": ("会议在下午3点开始：meeting room B，别迟到；OK?", "speaker-string", 1.0),
    "tags": ("Hello [uv_break]world[laugh], 你好[lbreak]再见[break_3]。", "seed:5", 2.0),
}


def _compare(
    engine: Any,
    native: NativeChat,
    text: str,
    voice: str,
    speed: float,
    *,
    min_tokens: int,
    max_tokens: int,
    reference: VoiceSample | None = None,
) -> None:
    """Engine vs native on ``text``; with ``reference``, in that recording's voice (spk_smp, txt_smp)."""
    from server.engine.chattts.reference import ReferenceVoice
    from server.engine.chattts.voice import speed_token

    if voice == "speaker-string":
        voice = _speaker_string(native)
    params = SynthesisParams(
        voice=voice, speed=speed, seed=1, temperature=NEAR_GREEDY, top_p=0.7, top_k=20, reference=reference
    )
    spk_smp = txt_smp = None
    if reference is not None:  # infer takes the codes packed and the transcript as the model reads it
        spk_smp = ReferenceVoice(torch.from_numpy(reference.codes.astype(np.int64)), "").spk_smp
        txt_smp = engine.text.model_text(reference.transcript)
    ref = native.infer(
        speakable(text),
        None if reference is not None else voice,
        speed_token(speed),
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        spk_smp=spk_smp,
        txt_smp=txt_smp,
    )

    assert engine.prompt_text(text, params) == ref.prompt
    codes, hiddens, samples = ours(engine, text, params, max_tokens)
    assert len(ref.codes) >= 8, "too short to compare anything"
    assert codes.shape == ref.codes.shape, (
        f"ours ended after {len(codes)} tokens, native after {len(ref.codes)}"
    )
    mismatch = (codes != ref.codes).any(dim=1).nonzero().flatten().tolist()
    assert not mismatch, f"tokens differ from step {mismatch[0]} on"
    # fp32 rounding is ~1e-7 here; a speaker written without ChatTTS's L2 normalization moves
    # the hidden states by ~1e-4 without changing a near-greedy token, so this bound is tight.
    assert float((hiddens - ref.hiddens).abs().max()) <= 1e-5
    wav = engine.decode_tokens(hiddens)
    assert wav.shape == ref.wav.shape
    assert samples == len(ref.wav)
    assert float(np.abs(wav - ref.wav).max()) <= 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_engine_equals_native_infer(tiny_engine: Any, native: NativeChat, case: str) -> None:
    text, voice, speed = CASES[case]
    _compare(tiny_engine, native, text, voice, speed, min_tokens=1, max_tokens=MAX_TOKENS)


def test_long_sequence_equals_native_infer(tiny_model_dir: Path, native: NativeChat) -> None:
    """EOS banned for 96 tokens on both sides: the repetition penalty's window fills many times."""
    from server.engine.chattts.engine import ChatTTSEngine

    engine = ChatTTSEngine.load(
        model_dir=tiny_model_dir, device="cpu", dtype="float32", options=EngineOptions(min_tokens=96)
    )
    try:
        _compare(
            engine,
            native,
            "一段很长的句子，用来比较。A long one too.",
            "seed:8",
            1.0,
            min_tokens=96,
            max_tokens=120,
        )
    finally:
        engine.close()


def _native_probabilities(
    logits: torch.Tensor,
    generated: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    ban_eos: bool,
    eos: int,
    repetition_penalty: float,
) -> torch.Tensor:
    """What ChatTTS's ``GPT.generate`` turns one row's logits into (``_infer_code``'s chain)."""
    from ChatTTS.model import gen_logits

    warpers, processors = gen_logits(
        num_code=eos, top_P=top_p, top_K=top_k, repetition_penalty=repetition_penalty
    )
    x = logits.clone()
    x /= torch.full((x.shape[0], 1), temperature)
    for process in (*processors, *warpers):
        x = process(generated, x)
    if ban_eos:
        x[:, eos] = -torch.inf
    return torch.nn.functional.softmax(x, dim=-1)


@pytest.mark.parametrize("repetition_penalty", [1.05, 1.3, 1.0])
def test_sampling_distribution_equals_chattts_processors(repetition_penalty: float) -> None:
    from server.engine.chattts.step.sampling import PENALTY_WINDOW, RowSampling, code_probabilities

    gen = torch.Generator().manual_seed(int(repetition_penalty * 100))
    rows, num_vq, vocab = 12, 4, 626
    eos = vocab - 1
    scale = torch.rand(rows, 1, 1, generator=gen) * 8 + 0.5
    logits = torch.randn(rows, num_vq, vocab, generator=gen) * scale
    # EOS among the top codes in a third of the rows, so where the ban sits in the chain matters.
    top = logits.amax(dim=-1)
    logits[::3, :, eos] = top[::3] + torch.rand(num_vq, generator=gen) - 0.5
    temperature = [float(t) for t in torch.rand(rows, generator=gen) * 1.5 + 0.05]
    top_p = [float(p) for p in torch.rand(rows, generator=gen) * 0.95 + 0.05]
    top_k = [int(k) for k in torch.randint(1, 60, (rows,), generator=gen)]
    ban = [bool(b) for b in torch.rand(rows, generator=gen) < 0.5]
    lengths = [int(n) for n in torch.randint(0, 40, (rows,), generator=gen)]
    # Some codes repeat often, so the penalty has something to do.
    generated = [torch.randint(0, 24, (num_vq, n), generator=gen) * 25 % vocab for n in lengths]
    history = torch.full((rows, num_vq, PENALTY_WINDOW), vocab, dtype=torch.long)
    for b, g in enumerate(generated):
        recent = g[:, -PENALTY_WINDOW:] if g.shape[1] else g
        history[b, :, PENALTY_WINDOW - recent.shape[1] :] = recent

    sampling = RowSampling(
        temperature=torch.tensor(temperature),
        top_p=torch.tensor(top_p),
        top_k=torch.tensor(top_k, dtype=torch.long),
        suppress_eos=torch.tensor(ban),
    )
    probs = code_probabilities(logits, history, sampling, eos=eos, repetition_penalty=repetition_penalty)
    probs = probs.view(rows, num_vq, vocab)
    for b in range(rows):
        expected = _native_probabilities(
            logits[b],
            generated[b],
            temperature=temperature[b],
            top_p=top_p[b],
            top_k=top_k[b],
            ban_eos=ban[b],
            eos=eos,
            repetition_penalty=repetition_penalty,
        )
        assert torch.equal(probs[b], expected), (
            f"row {b}: max difference {(probs[b] - expected).abs().max():.3g}"
        )
