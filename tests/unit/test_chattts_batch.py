"""Counter-based random streams and per-row sampling of the ChatTTS engine (no model weights needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ChatTTS")

from server.engine.chattts.step.sampling import (  # noqa: E402
    RowSampling,
    counter_uniforms,
    sample_codes,
    stream_key,
)
from server.engine.chattts.voice import parse_seed, speed_token  # noqa: E402


def test_counter_uniforms_depend_only_on_key_and_token_index() -> None:
    """A row's draws are a function of (its key, its token index): batch company cannot change them."""
    keys = [stream_key(s) for s in (7, 8, 7)]
    k0 = torch.tensor([k[0] for k in keys])
    k1 = torch.tensor([k[1] for k in keys])
    streams = torch.arange(4)
    together = counter_uniforms(k0, k1, torch.tensor([3, 3, 5]), streams)
    alone = counter_uniforms(k0[:1], k1[:1], torch.tensor([3]), streams)
    assert torch.equal(together[0], alone[0])
    assert not torch.equal(together[0], together[1])  # another seed, another stream
    later = counter_uniforms(k0[2:], k1[2:], torch.tensor([5]), streams)
    assert torch.equal(together[2], later[0])  # same seed, token 5
    assert not torch.equal(together[0], together[2])  # same seed, another token


def test_counter_uniforms_look_uniform() -> None:
    k0, k1 = (torch.tensor([x]) for x in stream_key(123))
    u = torch.cat([counter_uniforms(k0, k1, torch.tensor([i]), torch.arange(4))[0] for i in range(4000)])
    assert u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(counts.min()) > 1400 and float(counts.max()) < 1800  # 1600 expected per bin
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.05


def test_stream_key_is_splitmix64() -> None:
    # splitmix64's first output for state 0 (Vigna's reference implementation): 0xE220A8397B1DCDAF
    k0, k1 = stream_key(0)
    assert (k1 << 32) | k0 == 0xE220A8397B1DCDAF


def test_sampling_matches_chattts_processors() -> None:
    """Same distribution as ChatTTS's temperature → repetition penalty → top-p → top-k chain."""
    from ChatTTS.model import gen_logits

    g = torch.Generator().manual_seed(0)
    b, q, v = 3, 4, 626
    logits = torch.randn(b, q, v, generator=g) * 3
    history = torch.randint(0, v - 1, (b, q, 16), generator=g)
    temperature, top_p, top_k = 0.3, 0.7, 20
    sampling = RowSampling(
        temperature=torch.full((b,), temperature),
        top_p=torch.full((b,), top_p),
        top_k=torch.full((b,), top_k, dtype=torch.long),
        suppress_eos=torch.tensor([True, False, False]),
    )
    uniforms = torch.rand(b, q, generator=g)
    ours = sample_codes(logits, history, sampling, uniforms, eos=v - 1, repetition_penalty=1.05)

    warpers, processors = gen_logits(num_code=v - 1, top_P=top_p, top_K=top_k, repetition_penalty=1.05)
    x = logits.reshape(b * q, v) / temperature
    ids = history.reshape(b * q, 16)
    for proc in (*processors, *warpers):
        x = proc(ids, x)
    x[0:q, v - 1] = float("-inf")
    cdf = x.softmax(-1).cumsum(-1)
    ref = (cdf <= uniforms.reshape(b * q, 1) * cdf[:, -1:]).sum(-1).view(b, q)
    assert torch.equal(ours, ref)


def test_rows_draw_independently_of_neighbours() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 626, generator=g)
    history = torch.full((2, 4, 16), 626)
    sampling = RowSampling(
        temperature=torch.tensor([0.3, 1.0]),
        top_p=torch.tensor([0.7, 0.9]),
        top_k=torch.tensor([20, 50]),
        suppress_eos=torch.tensor([False, False]),
    )
    u = torch.rand(2, 4, generator=g)
    both = sample_codes(logits, history, sampling, u, eos=625, repetition_penalty=1.05)
    first_only = RowSampling(
        temperature=sampling.temperature[:1],
        top_p=sampling.top_p[:1],
        top_k=sampling.top_k[:1],
        suppress_eos=sampling.suppress_eos[:1],
    )
    alone = sample_codes(logits[:1], history[:1], first_only, u[:1], eos=625, repetition_penalty=1.05)
    assert torch.equal(both[:1], alone)


@pytest.mark.parametrize(
    ("speed", "token"),
    [(1.0, "[speed_5]"), (0.5, "[speed_0]"), (2.0, "[speed_9]"), (1.15, "[speed_6]"), (0.0, "[speed_5]")],
)
def test_speed_token(speed: float, token: str) -> None:
    assert speed_token(speed) == token


def test_parse_seed() -> None:
    assert parse_seed("seed:12") == 12
    assert parse_seed("seed:-1") == -1
    assert parse_seed("seed:") is None
    assert parse_seed("default") is None
