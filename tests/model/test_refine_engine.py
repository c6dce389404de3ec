"""``refine: true`` in the engine: ChatTTS's refinement pass before each segment's speech.

* The whole path equals ChatTTS 0.2.5's ``infer(skip_refine_text=False)`` on the tiny
  checkpoint (float32, near-greedy): the refined text, the speech prompt built from it (not
  normalized again) and every speech token.
* A refinement runs one block per engine step between the other sequences' blocks: a
  sequence already speaking gets audio in every step while another refines, and the refined
  sequence's tokens do not depend on that (nor on being refined in a batch, nor on a batch
  partner dropped mid-way).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.refine import RefineParams
from server.engine_api import EngineError, SequenceRequest, StepResult, SynthesisParams
from server.text.normalize import speakable
from tests.model.helpers import TEST_DEVICE
from tests.model.test_native_equivalence import NEAR_GREEDY, NativeChat

PROMPT = "[oral_2][laugh_0][break_6]"
REFINE_TOKENS = 24
SPEECH_TOKENS = 40


@pytest.fixture(scope="module")
def native(tiny_model_dir: Path) -> NativeChat:
    return NativeChat(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    """Blocks of 8 tokens, so that a 24-token refinement spans three steps."""
    from server.engine.chattts.engine import ChatTTSEngine

    eng = ChatTTSEngine.load(
        model_dir=tiny_model_dir,
        device=TEST_DEVICE,
        dtype="float32",
        options=EngineOptions(block_schedule=(8,), refine_max_tokens=REFINE_TOKENS, max_batch=4),
    )
    eng.refine_params = RefineParams(temperature=NEAR_GREEDY, max_new_tokens=REFINE_TOKENS)
    yield eng
    eng.close()


def params(**fields: Any) -> SynthesisParams:
    return SynthesisParams(voice="seed:4", seed=1, temperature=NEAR_GREEDY, **fields)


def run(engine: Any, requests: list[SequenceRequest], max_steps: int = 200) -> dict[int, list[StepResult]]:
    """Add the requests, step them together to the end; every step's results per sequence."""
    for request in requests:
        engine.add(request)
    out: dict[int, list[StepResult]] = {r.seq_id: [] for r in requests}
    live = [r.seq_id for r in requests]
    for _ in range(max_steps):
        if not live:
            return out
        for result in engine.step(live):
            out[result.seq_id].append(result)
            if result.finished:
                live.remove(result.seq_id)
    raise AssertionError("sequences did not finish")


class Recorder:
    """Records each sequence's codes (token tap) and the model text of every speech prompt built."""

    def __init__(self, engine: Any) -> None:
        self.codes: dict[int, list[torch.Tensor]] = {}
        self.prompts: list[str] = []
        self._engine = engine
        self._build = engine.prompts.code_prompt

    def __enter__(self) -> Recorder:
        def tap(seq_id: int, codes: torch.Tensor, hiddens: torch.Tensor) -> None:
            self.codes.setdefault(seq_id, []).append(codes)

        def build(model_text: str, p: SynthesisParams) -> Any:
            prompt = self._build(model_text, p)
            self.prompts.append(prompt.text)
            return prompt

        self._engine.token_tap = tap
        self._engine.prompts.code_prompt = build
        return self

    def __exit__(self, *exc: object) -> None:
        self._engine.token_tap = None
        del self._engine.prompts.code_prompt

    def tokens(self, seq_id: int) -> torch.Tensor:
        return torch.cat(self.codes[seq_id])


@pytest.mark.parametrize(
    "text", ["你好，欢迎使用语音服务，今天天气很好。", "Refine this sentence [uv_break] please, 3 times!"]
)
def test_refined_speech_equals_native_infer_with_refinement(
    engine: Any, native: NativeChat, text: str
) -> None:
    from server.engine.chattts.voice import speed_token

    refine = native.chat.RefineTextParams(
        prompt=PROMPT, temperature=NEAR_GREEDY, max_new_token=REFINE_TOKENS, show_tqdm=False
    )
    ref = native.infer(
        speakable(text), "seed:4", speed_token(1.0), max_tokens=SPEECH_TOKENS, min_tokens=1, refine=refine
    )
    request = SequenceRequest(
        seq_id=1, text=text, params=params(refine=True, refine_prompt=PROMPT), max_tokens=SPEECH_TOKENS
    )
    with Recorder(engine) as seen:
        steps = run(engine, [request])[1]
    assert seen.prompts[-1] == ref.prompt  # the refined text, decorated, not normalized again
    assert ref.prompt != engine.prompt_text(text, params())  # refinement changed what the model reads
    codes = seen.tokens(1)
    assert len(ref.codes) >= 8
    assert codes.shape == ref.codes.shape
    assert torch.equal(codes, ref.codes)
    # 24 refinement tokens at 8 a step: the first two steps refine and return no audio.
    assert [r.tokens for r in steps[:2]] == [0, 0] and steps[2].tokens > 0
    assert engine.live_sequences == 0


def test_a_refining_sequence_does_not_stall_the_others_and_is_independent_of_them(engine: Any) -> None:
    speaking = SequenceRequest(seq_id=10, text="一句已经在说的话。", params=params(), max_tokens=40)
    refining = SequenceRequest(
        seq_id=11, text="这句话先要精炼。", params=params(refine=True, refine_prompt=PROMPT), max_tokens=20
    )
    with Recorder(engine) as alone:
        run(engine, [SequenceRequest(seq_id=11, text=refining.text, params=refining.params, max_tokens=20)])
    engine.add(speaking)
    first = engine.step([10])  # already speaking when the refinement arrives
    assert first[0].tokens > 0
    with Recorder(engine) as together:
        engine.add(refining)
        per_step: list[dict[int, int]] = []
        live = [10, 11]
        for _ in range(200):
            if not live:
                break
            results = engine.step(live)
            per_step.append({r.seq_id: r.tokens for r in results})
            live = [r.seq_id for r in results if not r.finished]
    # While 11 refines (its first steps: no tokens), 10 keeps producing audio in every step.
    refining_steps = [s for s in per_step if s.get(11) == 0]
    assert len(refining_steps) >= 2
    assert all(s.get(10, 0) > 0 for s in refining_steps if 10 in s)
    assert torch.equal(together.tokens(11), alone.tokens(11))
    assert engine.live_sequences == 0


def test_a_refinement_batch_survives_a_dropped_partner(engine: Any) -> None:
    texts = {21: "第一句要精炼的话。", 22: "Second one to refine, a little longer than the first."}
    requests = [
        SequenceRequest(seq_id=k, text=t, params=params(refine=True, refine_prompt=PROMPT), max_tokens=16)
        for k, t in texts.items()
    ]
    with Recorder(engine) as alone:
        run(engine, [requests[1]])
    with Recorder(engine) as batched:
        for request in requests:
            engine.add(request)
        engine.step([21, 22])  # both start refining in one batch
        engine.drop(21)  # the first stream is cancelled mid-refinement
        assert engine.live_sequences == 1
        live = [22]
        for _ in range(100):
            [result] = engine.step(live)
            if result.finished:
                break
    assert torch.equal(batched.tokens(22), alone.tokens(22))
    assert 21 not in batched.codes
    assert engine.live_sequences == 0


def test_refinement_off_refuses_refine_requests(tiny_model_dir: Path) -> None:
    from server.engine.chattts.engine import ChatTTSEngine

    eng = ChatTTSEngine.load(
        model_dir=tiny_model_dir,
        device=TEST_DEVICE,
        dtype="float32",
        options=EngineOptions(refine_max_tokens=0),
    )
    try:
        assert not eng.info.refine
        with pytest.raises(EngineError, match="refine-max-tokens 0"):
            eng.add(SequenceRequest(seq_id=1, text="不要精炼。", params=params(refine=True)))
        assert eng.live_sequences == 0
    finally:
        eng.close()


def test_a_failed_refinement_restarts_from_its_prompt(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception mid-refinement fails that step only; the next step starts it again, same result."""
    request = SequenceRequest(seq_id=31, text="失败以后重来。", params=params(refine=True), max_tokens=12)
    with Recorder(engine) as clean:
        run(engine, [request])
    from server.engine.chattts.refine import TextRefineJob

    calls = {"n": 0}
    advance = TextRefineJob.advance

    def flaky(self: TextRefineJob, tokens: int) -> bool:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return advance(self, tokens)

    monkeypatch.setattr(TextRefineJob, "advance", flaky)
    with Recorder(engine) as retried:
        engine.add(request)
        engine.step([31])
        with pytest.raises(RuntimeError, match="injected"):
            engine.step([31])
        for _ in range(100):
            [result] = engine.step([31])
            if result.finished:
                break
    assert torch.equal(retried.tokens(31), clean.tokens(31))
    assert engine.live_sequences == 0
