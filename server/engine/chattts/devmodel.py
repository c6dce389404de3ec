"""Random-weight ChatTTS models in ChatTTS's exact asset layout (tests, CI, demos).

The real weights live on the Hugging Face hub and cannot be fetched on
offline machines, so tests and benchmarks run on models this module writes:
same file names, same module classes, same state-dict keys as the official
``2Noise/ChatTTS`` assets, with random values. A ``DEV_MODEL.json`` manifest
marks the folder as random weights and records the config overrides and the
sha256 of every file (ChatTTS's ``check_all_assets`` insists on hashes).

Imports torch, ChatTTS and transformers: only ``server/engine/chattts*.py``
may do that.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pybase16384 as b14
import torch
from ChatTTS.config import config as cfg
from ChatTTS.model import DVAE, Embed
from safetensors.torch import save_file
from transformers import BertTokenizerFast, LlamaConfig, LlamaModel
from vocos import Vocos
from vocos.pretrained import instantiate_class

from server.engine.weights.files import ASSET_FILES, DEV_MANIFEST, DEV_MANIFEST_KIND, sha256_of

#: ChatTTS's 50 tokens after BERT's vocabulary, in the official tokenizer's order (ids 21128 on):
#: the order matters, because ``infer`` drops refined tokens from ``[break_0]`` on.
CHATTTS_TOKENS: tuple[str, ...] = (
    *("[Sasr]", "[Pasr]", "[Easr]", "[Stts]", "[Ptts]", "[Etts]", "[Sbreak]", "[Pbreak]", "[Ebreak]"),
    *("[uv_break]", "[v_break]", "[lbreak]", "[llbreak]", "[undefine]", "[laugh]", "[spk_emb]"),
    *("[empty_spk]", "[music]", "[pure]"),
    *(f"[break_{k}]" for k in range(8)),
    *(f"[laugh_{k}]" for k in range(3)),
    *(f"[oral_{k}]" for k in range(10)),
    *(f"[speed_{k}]" for k in range(10)),
)
_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_CJK_PUNCT = "，。！？、；：“”‘’《》（）【】…—～·「」"


def _tiny_config() -> dict[str, Any]:
    """Config overrides of the tiny model, as plain dicts of ChatTTS's config dataclasses."""
    hidden = 64
    return {
        "gpt": {
            "hidden_size": hidden,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "max_position_embeddings": 4096,
        },
        "embed": {"hidden_size": hidden},
        # ChatTTS views GPT hidden states as 2 frames of hidden/2 channels each.
        "decoder": {"idim": hidden // 2, "odim": hidden // 2, "hidden": 64, "n_layer": 2, "bn_dim": 32},
        "dvae": {
            "encoder": {"idim": 32, "odim": 64, "hidden": 32, "n_layer": 2, "bn_dim": 16},
            "decoder": {"idim": 32, "odim": 32, "hidden": 32, "n_layer": 2, "bn_dim": 16},
            "vq": {"dim": 64, "levels": [5, 5, 5, 5], "G": 2, "R": 2},
        },
        "vocos": {"backbone": {"dim": 64, "intermediate_dim": 128, "num_layers": 2}, "head": {"dim": 64}},
    }


def build_config(overrides: dict[str, Any] | None) -> cfg.Config:
    """A fresh ChatTTS ``Config`` with ``overrides`` applied (never mutates shared defaults).

    ChatTTS's config dataclasses use shared class-level instances as defaults,
    so every overridden part is replaced by a new object.
    """
    config = cfg.Config()
    if not overrides:
        return config
    if "gpt" in overrides:
        config.gpt = cfg.GPT(**overrides["gpt"])
    if "embed" in overrides:
        config.embed = cfg.Embed(**overrides["embed"])
    if "decoder" in overrides:
        config.decoder = cfg.Decoder(**overrides["decoder"])
    if "dvae" in overrides:
        d = overrides["dvae"]
        vq = dict(d["vq"])
        vq["levels"] = tuple(vq["levels"])
        config.dvae = cfg.DVAE(
            encoder=cfg.Decoder(**d["encoder"]), decoder=cfg.Decoder(**d["decoder"]), vq=cfg.VQ(**vq)
        )
    if "vocos" in overrides:
        v = overrides["vocos"]
        config.vocos = cfg.Vocos(
            feature_extractor=cfg.FeatureExtractor(),
            backbone=cfg.Backbone(init_args=cfg.BackboneInitArgs(**v["backbone"])),
            head=cfg.FourierHead(init_args=cfg.FourierHeadInitArgs(**v["head"])),
        )
    if "spk_stat" in overrides:
        config.spk_stat = overrides["spk_stat"]
    return config


def build_tokenizer(directory: Path) -> int:
    """Write a BERT-style char-level tokenizer in ``directory``; returns its length.

    Covers printable ASCII (with ``##`` continuations so words split into
    characters), CJK punctuation, the CJK Unified Ideographs block
    U+4E00–U+9FA5 and ChatTTS's control tokens; anything else becomes
    ``[UNK]``. The real ChatTTS vocabulary is not available offline.
    """
    from tokenizers import (  # type: ignore[import-untyped]
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    chars = [chr(c) for c in range(0x21, 0x7F)]
    vocab_list = [*_BERT_SPECIALS, *chars, *(f"##{c}" for c in chars)]
    vocab_list += list(_CJK_PUNCT) + [chr(c) for c in range(0x4E00, 0x9FA6)]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _BERT_SPECIALS])
    # Not normalized: the lowercasing normalizer must not hide "[Stts]" from the matcher.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHATTTS_TOKENS])
    fast = BertTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        do_lower_case=True,
    )
    fast.save_pretrained(str(directory), legacy_format=False)
    for extra in ("vocab.txt", "added_tokens.json"):
        (directory / extra).unlink(missing_ok=True)
    return len(fast)


def _scale_layer_scales(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Give ConvNeXt layer scales trained-like magnitudes (init is 1e-6 ≈ identity blocks).

    With the init value every block is nearly the identity, which would make
    the convolutional receptive field look tiny and seam tests meaningless.
    """
    for name, param in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("weight", "gamma") and param.dim() == 1 and float(param.detach().abs().max()) <= 1e-5:
            param.data.copy_(0.05 + 0.25 * torch.rand(param.shape, generator=gen))


def _save(module: torch.nn.Module, path: Path) -> None:
    state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
    save_file(state, str(path))


def make_dev_model(size: Literal["tiny", "full"], directory: Path, seed: int = 0) -> None:
    """Write a random-weight ChatTTS model in ChatTTS's asset layout.

    Args:
        size: ``"tiny"`` (2 layers, hidden 64; loads in well under a second) or
            ``"full"`` (the real architecture sizes, ~1 GB on disk).
        directory: target folder; ``directory/asset/...`` and
            ``directory/DEV_MODEL.json`` are written (created if missing).
        seed: seeds every random weight, so the same call writes the same files.

    Raises:
        ValueError: for an unknown ``size``.
    """
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', not {size!r}")
    directory = Path(directory)
    asset = directory / "asset"
    (asset / "gpt").mkdir(parents=True, exist_ok=True)
    (asset / "tokenizer").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    overrides: dict[str, Any] = _tiny_config() if size == "tiny" else {}
    if size == "tiny":
        hidden = overrides["gpt"]["hidden_size"]
        rng = np.random.default_rng(seed)
        std = rng.uniform(0.5, 1.5, hidden).astype(np.float16)
        mean = rng.normal(0.0, 0.5, hidden).astype(np.float16)
        overrides["spk_stat"] = b14.encode_to_string(np.concatenate([std, mean]).tobytes())
    config = build_config(overrides)

    n_tokens = build_tokenizer(asset / "tokenizer")
    if n_tokens > config.gpt.num_text_tokens:
        raise AssertionError(f"tokenizer has {n_tokens} tokens > {config.gpt.num_text_tokens}")

    with torch.no_grad():
        g = asdict(config.gpt)
        llama_cfg = LlamaConfig(  # type: ignore[no-untyped-call]
            hidden_size=g["hidden_size"],
            intermediate_size=g["intermediate_size"],
            num_attention_heads=g["num_attention_heads"],
            num_key_value_heads=g["num_attention_heads"],
            num_hidden_layers=g["num_hidden_layers"],
            max_position_embeddings=g["max_position_embeddings"],
            vocab_size=8,  # embed_tokens is deleted by ChatTTS; ChatTTS's Embed holds the real ones
        )
        llama = LlamaModel(llama_cfg)
        llama_cfg.save_pretrained(str(asset / "gpt"))
        state = {k: v.contiguous() for k, v in llama.state_dict().items() if not k.startswith("embed_tokens")}
        save_file(state, str(asset / "gpt" / "model.safetensors"))
        del llama, state

        e = config.embed
        embed = Embed(e.hidden_size, e.num_audio_tokens, e.num_text_tokens, e.num_vq)
        _save(embed, asset / "Embed.safetensors")
        del embed

        coef = b14.encode_to_string(
            (0.5 + torch.rand(100, generator=gen)).numpy().astype(np.float32).tobytes()
        )
        decoder = DVAE(decoder_config=asdict(config.decoder), dim=config.decoder.idim, coef=coef)
        _scale_layer_scales(decoder, gen)
        _save(decoder, asset / "Decoder.safetensors")
        dvae = DVAE(
            decoder_config=asdict(config.dvae.decoder),
            encoder_config=asdict(config.dvae.encoder),
            vq_config=asdict(config.dvae.vq),
            dim=config.dvae.decoder.idim,
            coef=coef,
        )
        _scale_layer_scales(dvae, gen)
        _save(dvae, asset / "DVAE.safetensors")

        v = config.vocos
        vocos = Vocos(
            feature_extractor=instantiate_class(args=(), init=asdict(v.feature_extractor)),
            backbone=instantiate_class(args=(), init=asdict(v.backbone)),
            head=instantiate_class(args=(), init=asdict(v.head)),
        )
        _scale_layer_scales(vocos, gen)
        _save(vocos, asset / "Vocos.safetensors")

    manifest = {
        "kind": DEV_MANIFEST_KIND,
        "random_weights": True,
        "size": size,
        "seed": seed,
        "config": overrides,
        "sha256": {key: sha256_of(directory / rel) for rel, key in ASSET_FILES},
    }
    (directory / DEV_MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
