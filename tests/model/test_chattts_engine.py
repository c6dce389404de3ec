"""ChatTTSEngine on the tiny random-weight model: lengths, pausing, determinism, robustness."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from server.engine.chattts.decode import samples_for_tokens
from server.engine.chattts.options import EngineOptions
from server.engine_api import Engine, EngineError, SequenceRequest, SynthesisParams
from tests.model.helpers import TEST_DEVICE, run_to_end

SENTENCES = ["Hello there, this is the first sentence.", "And a second one!", "第三句话，你好。"]


def req(seq_id: int, text: str, *, seed: int | None = 7, max_tokens: int = 48, **kw: Any) -> SequenceRequest:
    return SequenceRequest(
        seq_id=seq_id,
        text=text,
        params=SynthesisParams(seed=seed, **kw),
        max_tokens=max_tokens,
        seed_offset=seq_id,
    )


def test_is_an_engine(tiny_engine: Any) -> None:
    assert isinstance(tiny_engine, Engine)
    assert tiny_engine.info.name == "chattts"
    assert tiny_engine.info.extra["random_weights"] == "true"
    assert tiny_engine.info.extra["vocoder_dtype"] == "float32"  # a float32 GPT keeps float32 audio
    assert tiny_engine.info.samples_per_token == 512


def test_three_sentences_audio_length_matches_tokens(tiny_engine: Any) -> None:
    """N generated tokens → 2N mel frames → centred ISTFT → exactly 512·N − 256 samples."""
    out = run_to_end(tiny_engine, [req(100 + i, s, max_tokens=40) for i, s in enumerate(SENTENCES)])
    for c in out.values():
        assert 1 <= c.tokens <= 40
        assert len(c.samples) == samples_for_tokens(c.tokens) == 512 * c.tokens - 256
        assert np.isfinite(c.samples).all()
    assert tiny_engine.live_sequences == 0
    assert tiny_engine.free_slots == tiny_engine.slots


def test_first_block_is_small_and_yields_audio(tiny_engine: Any) -> None:
    tiny_engine.add(req(200, "Short first block.", max_tokens=100))
    try:
        [res] = tiny_engine.step([200])
        assert res.tokens == tiny_engine.block_schedule[0] or res.finished
        assert len(res.audio) > 0
    finally:
        tiny_engine.drop(200)
    assert tiny_engine.live_sequences == 0


def test_same_seed_alone_twice_is_identical(tiny_engine: Any) -> None:
    a = run_to_end(tiny_engine, [req(300, SENTENCES[0], max_tokens=60)])[300]
    b = run_to_end(tiny_engine, [req(300, SENTENCES[0], max_tokens=60)])[300]
    assert a.tokens == b.tokens
    assert np.array_equal(a.samples, b.samples)


def test_same_seed_in_a_batch_matches_alone_in_fp32(tiny_engine: Any) -> None:
    """Other rows change matmul shapes and add KV padding: fp32 results stay within 1e-4.

    Each row samples from its own generator by CDF inversion, so neighbours
    cannot change its random draws; only float rounding of the batched
    forward differs (measured max abs difference ~1e-6 on this model), which
    is far below a sampling decision boundary for these short sequences.
    """
    alone = run_to_end(tiny_engine, [req(400, SENTENCES[1], max_tokens=60)])[400]
    crowd = [
        req(401, SENTENCES[0] * 3, seed=1, max_tokens=90),
        req(400, SENTENCES[1], max_tokens=60),
        req(402, SENTENCES[2], seed=None, max_tokens=30),
    ]
    together = run_to_end(tiny_engine, crowd)[400]
    assert together.tokens == alone.tokens
    assert np.abs(together.samples - alone.samples).max() < 1e-4


def test_paused_rows_resume(tiny_engine: Any) -> None:
    """Rows not named in a step stay paused; they resume where they were."""
    reference = run_to_end(tiny_engine, [req(500, SENTENCES[0], max_tokens=64, seed=3)])[500]
    tiny_engine.add(req(500, SENTENCES[0], max_tokens=64, seed=3))
    tiny_engine.add(req(501, SENTENCES[2], max_tokens=64, seed=4))
    first = tiny_engine.step([500, 501])
    assert {r.seq_id for r in first} == {500, 501}
    audio = [next(r.audio for r in first if r.seq_id == 500)]
    tokens = next(r.tokens for r in first if r.seq_id == 500)
    for _ in range(2):  # 500 paused while 501 runs
        (r501,) = tiny_engine.step([501])
        assert r501.seq_id == 501
        if r501.finished:
            break
    tiny_engine.drop(501)
    finished = False
    while not finished:
        (r,) = tiny_engine.step([500])
        audio.append(r.audio)
        tokens += r.tokens
        finished = r.finished
    assert tokens == reference.tokens
    np.testing.assert_allclose(np.concatenate(audio), reference.samples, atol=1e-4)
    assert tiny_engine.live_sequences == 0


def test_drop_mid_stream_frees_state(tiny_engine: Any) -> None:
    tiny_engine.add(req(600, SENTENCES[0], max_tokens=200))
    tiny_engine.add(req(601, SENTENCES[1], max_tokens=200))
    finished = {r.seq_id: r.finished for r in tiny_engine.step([600, 601])}
    assert not finished[600], "the dropped sequence must still be running"
    # A random model may end the other one in its first block; the engine frees it then.
    others = 0 if finished[601] else 1
    tiny_engine.drop(600)
    tiny_engine.drop(600)  # unknown now: no-op
    assert tiny_engine.live_sequences == others
    assert tiny_engine.free_slots == tiny_engine.slots - others
    tiny_engine.drop(601)
    assert tiny_engine.free_slots == tiny_engine.slots


@pytest.mark.parametrize(
    "text",
    [
        "",
        "😀🎉 ☃ \u0000\u200b ñandú Ωμέγα",
        "[uv_break] laugh [laugh] then [lbreak] [Stts][spk_emb]",
        "a" * 300,
    ],
)
def test_unknown_characters_and_controls_do_not_crash(tiny_engine: Any, text: str) -> None:
    c = run_to_end(tiny_engine, [req(700, text, max_tokens=10)])[700]
    assert len(c.samples) == samples_for_tokens(c.tokens)


def test_validating_a_voice_leaves_the_engine_threads_cache_alone(tiny_engine: Any) -> None:
    """Admission validates voices on the event loop; only the engine thread may touch the cache."""
    bank = tiny_engine.voices
    spk = bank._speaker._encode(bank.seeded(90_001))  # a speaker string nobody resolved yet
    before = list(bank._cache)
    for voice in ("default", "seed:90002", spk, "nobody", "seed:x"):
        tiny_engine.validate_voice(voice)
    assert list(bank._cache) == before
    assert tiny_engine.validate_voice(spk) and tiny_engine.validate_voice("seed:90002")


def test_an_overlong_speaker_string_is_refused_without_decoding(tiny_engine: Any, monkeypatch: Any) -> None:
    """A small message must not inflate into a large buffer: strings past the bound are not decoded."""
    import lzma

    import pybase16384 as b14
    from ChatTTS.model.speaker import Speaker

    bank = tiny_engine.voices
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
    bomb = b14.encode_to_string(lzma.compress(bytes(16 << 20), format=lzma.FORMAT_RAW, filters=filters))
    assert len(bomb) > bank.max_string_chars
    calls: list[str] = []
    real_decode = bank._speaker._decode
    monkeypatch.setattr(bank._speaker, "_decode", lambda s: calls.append(s) or real_decode(s))
    assert not tiny_engine.validate_voice(bomb)
    assert bank.resolve(bomb) is None
    assert calls == []
    # Real speaker strings, at the tiny size and at ChatTTS's (768 values), fit well inside the bound.
    assert len(bank._speaker._encode(bank.seeded(5))) <= bank.max_string_chars
    full = Speaker._encode(torch.randn(768, generator=torch.Generator().manual_seed(0)))
    assert len(full) <= 2 * 768 + 64 and tiny_engine.validate_voice(bank._speaker._encode(bank.seeded(6)))


def test_voices_and_speed(tiny_engine: Any) -> None:
    assert tiny_engine.validate_voice("default")
    assert tiny_engine.validate_voice("seed:42")
    assert tiny_engine.validate_voice("seed:-3")
    assert not tiny_engine.validate_voice("seed:x")
    assert not tiny_engine.validate_voice("nobody")
    spk = tiny_engine.voices.speaker_string("seed:42")
    assert spk is not None and tiny_engine.validate_voice(spk)
    assert torch.equal(tiny_engine.voices.resolve(spk), tiny_engine.voices.resolve("seed:42"))
    fast = tiny_engine.prompt_text("hi", SynthesisParams(speed=2.0))
    assert fast == "[Stts][spk_emb][speed_9]hi[Ptts]"
    with pytest.raises(EngineError):
        tiny_engine.add(req(800, "x", voice="nobody"))
    different = run_to_end(tiny_engine, [req(801, "Voice test.", voice="seed:1", max_tokens=16)])[801]
    same_as_spk = run_to_end(tiny_engine, [req(801, "Voice test.", voice=spk, max_tokens=16)])[801]
    seeded = run_to_end(tiny_engine, [req(801, "Voice test.", voice="seed:42", max_tokens=16)])[801]
    assert np.array_equal(same_as_spk.samples, seeded.samples)
    assert not np.array_equal(different.samples, seeded.samples)


def test_engine_stream_matches_one_shot_decode(tiny_engine: Any) -> None:
    """End to end on the engine path: the streamed audio vs a one-shot decode of the same states."""
    pushed: list[torch.Tensor] = []

    def tap(seq_id: int, codes: torch.Tensor, hiddens: torch.Tensor) -> None:
        pushed.append(hiddens)

    tiny_engine.token_tap = tap
    try:
        c = run_to_end(tiny_engine, [req(900, SENTENCES[0], max_tokens=120)])[900]
    finally:
        tiny_engine.token_tap = None
    ref = tiny_engine.decode_tokens(torch.cat(pushed))
    assert len(ref) == len(c.samples)
    err = c.samples - ref
    snr = 10 * np.log10(np.sum(ref**2) / max(np.sum(err**2), 1e-30))
    assert snr > 40.0


def test_min_tokens_forces_length(tiny_model_dir: Any) -> None:
    from server.engine.chattts.engine import ChatTTSEngine

    engine = ChatTTSEngine.load(
        model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="bfloat16", options=EngineOptions(min_tokens=50)
    )
    try:
        c = run_to_end(engine, [req(1, "forced", max_tokens=50)])[1]
        assert c.tokens == 50
        assert len(c.samples) == 512 * 50 - 256
        assert engine.dtype == torch.bfloat16
        # A bf16 GPT decodes in bf16 too (--vocoder-dtype auto), and says so.
        assert engine.info.extra["vocoder_dtype"] == "bfloat16"
        assert np.isfinite(c.samples).all() and np.abs(c.samples).max() > 0
    finally:
        engine.close()


def _prefill_lengths(engine: Any) -> tuple[list[int], Any]:
    """Record the sequence length of every multi-token Llama forward (the prefills), once per row."""
    seen: list[int] = []

    def hook(module: Any, args: Any) -> None:
        rows, length = args[0].shape[:2]
        if length > 1:
            seen.extend([int(length)] * int(rows))

    return seen, engine._llama.layers[0].register_forward_pre_hook(hook)


def test_prefill_is_bucketed_and_warmup_meets_every_bucket(tiny_model_dir: Any) -> None:
    """Prompts of many lengths reach the model at a few padded lengths, all of them seen in warm-up.

    They start in one step, so they are prefilled together: none holds more than the token
    budget (512) but a lone row, and where warm-up meets every shape (CUDA, whose graphs and
    cuBLAS choices are per shape) every (rows, length) call of the burst is one warm-up ran.
    The CPU's warm-up prefills its smallest shape only (``EagerPrefill``: the others cost a
    minute of a full-size start and have nothing to capture).

    One kernel shape per prompt length made the CPU process grow without end in the soak
    (bench/results/studies/rss-shapes-epyc-2core.md); this pins the mechanism that keeps it flat.
    """
    from server.engine.chattts.engine import ChatTTSEngine

    engine = ChatTTSEngine.load(
        model_dir=tiny_model_dir,
        device=TEST_DEVICE,
        dtype="float32",
        options=EngineOptions(prefill_bucket=16, warmup_prompt_chars=60, max_batch=32),
    )
    seen, handle = _prefill_lengths(engine)
    warms_every_shape = getattr(engine._batch.prefiller.runner, "every_shape", True)
    calls: list[tuple[int, int]] = []
    shapes = engine._llama.layers[0].register_forward_pre_hook(lambda _m, a: calls.append(a[0].shape[:2]))
    try:
        engine.warmup()
        warmed = set(seen)
        warmed_calls = {(int(b), int(n)) for b, n in calls}
        seen.clear()
        calls.clear()
        prompts = ["字" * n for n in range(1, 61, 3)] + ["word " * n for n in range(1, 12)]
        run_to_end(engine, [req(i, text, max_tokens=2) for i, text in enumerate(prompts)])
        served = set(seen)
        served_calls = {(int(b), int(n)) for b, n in calls if n > 1}
    finally:
        handle.remove()
        shapes.remove()
        engine.close()
    assert len(seen) == len(prompts)
    assert all(length % 16 == 0 for length in served)
    assert len(served) <= 6, served
    assert max(b for b, _ in served_calls) > 1, "the burst was not prefilled together"
    assert all(b * n <= 512 or b == 1 for b, n in served_calls), served_calls
    if warms_every_shape:
        assert served <= warmed, f"serving met prefill shapes warm-up never ran: {served - warmed}"
        assert served_calls <= warmed_calls, f"calls warm-up never ran: {served_calls - warmed_calls}"


def test_padded_prefill_matches_unpadded_in_fp32(tiny_engine: Any, tiny_model_dir: Any) -> None:
    """Right padding is invisible to causal attention: the audio equals an unpadded prefill's."""
    from server.engine.chattts.engine import ChatTTSEngine

    assert tiny_engine.prefill_bucket > 1
    exact = ChatTTSEngine.load(
        model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32", options=EngineOptions(prefill_bucket=1)
    )
    seen, handle = _prefill_lengths(exact)
    try:
        unpadded = run_to_end(exact, [req(1, SENTENCES[2], max_tokens=40)])[1]
    finally:
        handle.remove()
        exact.close()
    padded_seen, padded_handle = _prefill_lengths(tiny_engine)
    try:
        padded = run_to_end(tiny_engine, [req(1, SENTENCES[2], max_tokens=40)])[1]
    finally:
        padded_handle.remove()
    assert padded_seen[0] > seen[0], "the test prompt must actually be padded"
    assert padded.tokens == unpadded.tokens
    assert np.abs(padded.samples - unpadded.samples).max() < 1e-4


def test_an_interrupted_block_changes_neither_tokens_nor_audio(tiny_model_dir: Any) -> None:
    """The core ends a block early when a command waits (``interrupt``): the sequence is the same."""
    from server.engine.chattts.engine import ChatTTSEngine

    options = EngineOptions(min_tokens=50)
    engine = ChatTTSEngine.load(
        model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32", options=options
    )

    def speak(interrupt: Any) -> tuple[torch.Tensor, np.ndarray, int]:
        codes: list[torch.Tensor] = []
        engine.token_tap = lambda _seq, c, _hiddens: codes.append(c)
        engine.interrupt = interrupt
        engine.add(req(900, "The same words, cut into other blocks.", max_tokens=60))
        audio, steps = [], 0
        while True:
            (result,) = engine.step([900])
            audio.append(result.audio)
            steps += 1
            if result.finished:
                return torch.cat(codes), np.concatenate(audio), steps

    try:
        whole = speak(None)
        asked = itertools.count()
        cut = speak(lambda: next(asked) % 3 == 2)  # ends blocks after their 3rd token
    finally:
        engine.close()
    assert len(whole[0]) >= 50 and cut[2] > whole[2] + 3  # many more, shorter blocks
    assert torch.equal(whole[0], cut[0])
    assert np.array_equal(whole[1], cut[1])  # decodes stay at each row's schedule's targets
