"""KV row groups and per-row sampling of the ChatTTS engine (no model weights needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ChatTTS")

from server.engine.chattts_batch import (  # noqa: E402
    GrowLayer,
    RowGroup,
    RowSampling,
    concat_groups,
    sample_codes,
)
from server.engine.chattts_voice import parse_seed, speed_token  # noqa: E402


def group(ids: list[int], length: int, pads: list[int], seed: int) -> RowGroup:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(2):
        k = torch.randn(len(ids), 2, length + 4, 8, generator=g)
        v = torch.randn(len(ids), 2, length + 4, 8, generator=g)
        for row, pad in enumerate(pads):
            k[row, :, :pad] = 0
            v[row, :, :pad] = 0
        layers.append(GrowLayer(k, v, length))
    return RowGroup(
        ids=ids,
        layers=layers,
        pads=torch.tensor(pads),
        hidden=torch.randn(len(ids), 16, generator=g),
        history=torch.randint(0, 10, (len(ids), 4, 16), generator=g),
    )


def real_kv(g: RowGroup, seq_id: int) -> tuple[object, ...]:
    row = g.ids.index(seq_id)
    pad = int(g.pads[row])
    return tuple(layer.keys[row, :, pad:].clone() for layer in g.layers)


def test_concat_then_select_keeps_each_rows_cache() -> None:
    a = group([1, 2], 5, [0, 2], seed=0)
    b = group([3], 9, [0], seed=1)
    before = {s: real_kv(g, s) for g in (a, b) for s in g.ids}
    merged = concat_groups([a, b])
    assert merged.ids == [1, 2, 3]
    assert merged.length == 9
    assert merged.pads.tolist() == [4, 6, 0]
    for s, kv in before.items():
        assert all(torch.equal(x, y) for x, y in zip(kv, real_kv(merged, s), strict=True))
    mask = merged.attention_mask(1)
    assert mask is not None and mask.shape == (3, 10)
    assert mask[0].tolist() == [0] * 4 + [1] * 6
    assert merged.positions(1).squeeze(1).tolist() == [5, 3, 9]
    picked = merged.select([2, 1])
    assert picked.pads.tolist() == [2, 0]  # common padding trimmed
    assert picked.length == 5
    for s in (1, 2):
        assert all(torch.equal(x, y) for x, y in zip(before[s], real_kv(picked, s), strict=True))
    assert torch.equal(picked.hidden[0], a.hidden[1])


def test_grow_layer_appends_past_capacity_and_truncates() -> None:
    layer = GrowLayer(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3), 0)
    for i in range(5):
        k, _ = layer.update(torch.full((1, 1, 1, 3), float(i)), torch.full((1, 1, 1, 3), float(i)))
    assert k.shape[2] == 5 and k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    layer.truncate(3)
    assert layer.get_seq_length() == 3


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
