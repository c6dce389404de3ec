"""``--verify-weights none``: serve a checkpoint in ChatTTS's layout that this project did not write.

The folder is built here from ChatTTS 0.2.5's own module classes and its default ``Config``
(the official architecture: 768 hidden, 20 layers), with random values and no ``DEV_MODEL.json``,
the way a fine-tuned checkpoint arrives. ``make-dev-model`` is not used.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from websockets.asyncio.client import connect

from tests.serverproc import free_port, spawn_server, wait_ready

pytestmark = [pytest.mark.loopback, pytest.mark.slow]

#: ChatTTS's 50 tokens after BERT's vocabulary, in the official tokenizer's order.
_CHATTTS_TOKENS = [
    *("[Sasr]", "[Pasr]", "[Easr]", "[Stts]", "[Ptts]", "[Etts]", "[Sbreak]", "[Pbreak]", "[Ebreak]"),
    *("[uv_break]", "[v_break]", "[lbreak]", "[llbreak]", "[undefine]", "[laugh]", "[spk_emb]"),
    *("[empty_spk]", "[music]", "[pure]"),
    *(f"[break_{k}]" for k in range(8)),
    *(f"[laugh_{k}]" for k in range(3)),
    *(f"[oral_{k}]" for k in range(10)),
    *(f"[speed_{k}]" for k in range(10)),
]


def _tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import BertTokenizerFast

    chars = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, "，", "。"])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_tokens([AddedToken(t, normalized=False) for t in _CHATTTS_TOKENS])
    BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(
        str(directory)
    )


def _random_state(module: torch.nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    state = {}
    for name, value in module.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(value.shape)
        else:
            state[name] = torch.randn(value.shape, generator=gen) * 0.02
    return state


def build_chattts_folder(root: Path) -> None:
    """asset/ as ChatTTS 0.2.5 reads it, sized by its own default Config, random values."""
    from ChatTTS.config import Config
    from ChatTTS.model import DVAE, Embed
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaModel
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    config = Config()
    asset = root / "asset"
    (asset / "gpt").mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    llama_config = LlamaConfig(**asdict(config.gpt))  # what ChatTTS's GPT builds from its config
    llama_config.save_pretrained(str(asset / "gpt"))
    with torch.device("meta"):
        llama = LlamaModel(llama_config)
    del llama.embed_tokens  # ChatTTS deletes it after loading: its Embed holds the real ones
    save_file(_random_state(llama, gen), str(asset / "gpt" / "model.safetensors"))
    e = config.embed
    save_file(
        {
            k: v.contiguous()
            for k, v in Embed(e.hidden_size, e.num_audio_tokens, e.num_text_tokens, e.num_vq)
            .state_dict()
            .items()
        },
        str(asset / "Embed.safetensors"),
    )
    modules = {
        "Decoder": DVAE(decoder_config=asdict(config.decoder), dim=config.decoder.idim),
        "DVAE": DVAE(
            decoder_config=asdict(config.dvae.decoder),
            encoder_config=asdict(config.dvae.encoder),
            vq_config=asdict(config.dvae.vq),
            dim=config.dvae.decoder.idim,
        ),
        "Vocos": Vocos(
            feature_extractor=instantiate_class(args=(), init=asdict(config.vocos.feature_extractor)),
            backbone=instantiate_class(args=(), init=asdict(config.vocos.backbone)),
            head=instantiate_class(args=(), init=asdict(config.vocos.head)),
        ),
    }
    for name, module in modules.items():
        save_file(
            {k: v.contiguous() for k, v in module.state_dict().items()}, str(asset / f"{name}.safetensors")
        )
    _tokenizer(asset / "tokenizer")
    assert not (root / "DEV_MODEL.json").exists()


@pytest.fixture(scope="module")
def foreign_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("fine-tuned-chattts")
    build_chattts_folder(root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATTTS_CACHE_DIR": str(tmp)}
    env.pop("CHATTTS_VERIFY_WEIGHTS", None)
    return env


async def test_unverified_folder_is_refused_by_default_with_the_flag_named(
    foreign_model: Path, tmp_path: Path
) -> None:
    proc = await spawn_server(
        *("--model-dir", str(foreign_model), "--port", str(free_port()), "--device", "cpu", "--no-warmup"),
        env=_env(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        _, stderr = await proc.communicate()
    assert proc.returncode == 2
    text = stderr.decode()
    last = text.strip().splitlines()[-1]
    assert last.startswith("chattts-stream: ") and "--verify-weights none" in last
    assert "official sha256" in last and "Traceback" not in text


def _metrics(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body: bytes = response.read()
        return body.decode()


async def test_verify_weights_none_serves_the_folder_and_says_unverified(
    foreign_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    proc = await spawn_server(
        *("--model-dir", str(foreign_model), "--verify-weights", "none", "--port", str(port)),
        *("--device", "cpu", "--no-warmup", "--http-port", "0"),
        env=_env(tmp_path),
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_ready(port, proc, timeout_s=240)  # a full-size model on a shared 2-core machine
        assert 'weights="unverified"' in await asyncio.to_thread(_metrics, port)
        async with asyncio.timeout(180), connect(f"ws://127.0.0.1:{port}/v1/stream") as ws:
            hello = json.loads(await ws.recv())
            assert hello["weights"] == "unverified"
            await ws.send(json.dumps({"type": "start", "id": "s", "text": "Hello [laugh] 你好。", "seed": 1}))
            assert json.loads(await ws.recv())["type"] == "started"
            while not isinstance(message := await ws.recv(), bytes):
                assert json.loads(message)["type"] == "segment"
            assert len(message) > 12  # audio from the foreign weights
            await ws.send(json.dumps({"type": "cancel", "id": "s"}))
            while isinstance(message := await ws.recv(), bytes) or json.loads(message)["type"] != "done":
                pass
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            _, stderr = await proc.communicate()
        assert proc.returncode == 0
        assert stderr.decode().count("UNVERIFIED WEIGHTS") == 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_unverified_weights_of_another_architecture_fail_in_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """ChatTTS 0.2.5 fixes the module sizes in code: a checkpoint of other sizes is refused clearly."""
    from server.engine.chattts.assets import ModelUnavailableError, load_chat

    folder = tmp_path / "no-manifest"
    shutil.copytree(tiny_model_dir / "asset", folder / "asset")
    with pytest.raises(ModelUnavailableError) as caught:
        load_chat(model_dir=folder, device=torch.device("cpu"), verify="none")
    message = str(caught.value)
    assert "\n" not in message and "unverified weights" in message and "architecture" in message
