"""The compiled CPU step's artifacts in the cache dir: keyed, sealed, refused when stale or foreign.

* the key changes with every fact the generated code depends on (torch, CPU flags, the GPT's
  weights, the step's form, transformers and the step package's own code), so another machine,
  torch, model or an edited step looks in another folder;
* a folder that is not sealed, sealed for other facts (copied from elsewhere) or whose files
  changed is emptied with one log line and compiled afresh, never used;
* ``chattts-stream compile`` builds the folder a later engine with the same flags loads from
  (every graph loaded from its saved file, nothing traced, the folder unchanged by the load),
  and a corrupted artifact there is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from server.engine.chattts.step import w8a8_vnni
from server.engine.chattts.step.compile_cache import (
    MANIFEST,
    CompileCache,
    compile_key,
    cpu_flags,
    machine_facts,
    model_digest,
    step_code_digest,
    step_facts,
)
from server.engine.chattts.step.w8a8 import quantized_engine_available, w8a8_kernel
from tests.model.helpers import TEST_DEVICE

REPO = Path(__file__).resolve().parents[2]
FACTS = {
    "torch": "2.13.0+cpu",
    "python": "3.11.9",
    "cpu_capability": "AVX512",
    "cpu_flags": "avx2 avx512_bf16 avx512f fma",
    "model": "sha256:00",
    "dtype": "bfloat16",
    "quantize": "w8a8",
    "shapes": "1x256 1x3120",
    "compiled": "frozen",
    "transformers": "4.57.1",
    "step_code": "sha256:00",
}


@pytest.mark.parametrize(
    ("fact", "other"),
    [
        ("torch", "2.14.0+cpu"),
        ("cpu_capability", "AVX2"),
        ("cpu_flags", "avx2 fma"),  # the same capability, one instruction set fewer (no AVX-512)
        ("model", "sha256:01"),
        ("dtype", "float32"),
        ("quantize", "none"),
        ("shapes", "1x256 1x2048"),
        ("compiled", "ahead"),
        ("transformers", "4.58.0"),
        ("step_code", "sha256:01"),
    ],
)
def test_every_fact_is_part_of_the_key(tmp_path: Path, fact: str, other: str) -> None:
    cache = CompileCache(tmp_path)
    assert cache.folder({**FACTS, fact: other}) != cache.folder(FACTS)
    assert compile_key(dict(reversed(FACTS.items()))) == compile_key(FACTS)  # order does not count


def test_the_machine_facts_name_this_torch_and_cpu() -> None:
    facts = machine_facts()
    assert facts["torch"] == torch.__version__
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["cpu_flags"] == cpu_flags() and "python" in facts
    cpuinfo = "processor: 0\nflags\t\t: fpu sse4_2 avx2 avx512f avx512_vnni amx_tile fma lm\n"
    assert cpu_flags(cpuinfo) == "amx_tile avx2 avx512_vnni avx512f fma sse4_2"


def test_the_model_digest_follows_the_gpt_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir / "asset" / "gpt", copy / "asset" / "gpt")
    assert model_digest(copy) == model_digest(tiny_model_dir)
    with (copy / "asset" / "gpt" / "model.safetensors").open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert model_digest(copy) != model_digest(tiny_model_dir)
    facts = step_facts(model_dir=copy, dtype=torch.bfloat16, quantize="w8a8")
    assert (
        facts["model"] == model_digest(copy) and facts["dtype"] == "bfloat16" and facts["quantize"] == "w8a8"
    )


@pytest.mark.parametrize("edit", ["changed", "added", "removed", "csrc"])
def test_the_step_code_digest_follows_every_source_of_the_step(tmp_path: Path, edit: str) -> None:
    """An edited step is another key: the engine's facts carry the digest, which any edit changes."""
    package = Path(step_facts.__code__.co_filename).parent
    copy = tmp_path / "step"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert step_code_digest(copy) == step_code_digest(package)
    if edit == "changed":
        source = copy / "token_step.py"
        source.write_text(source.read_text().replace("accept = stepping &", "accept = stepping  &"))
    elif edit == "added":
        (copy / "newstep.py").write_text("X = 1\n")
    elif edit == "removed":
        (copy / "sampling.py").unlink()
    else:
        (copy / "csrc" / "decode_attention.cpp").write_text("// another attention\n")
    edited = step_code_digest(copy)
    assert edited != step_code_digest(package)
    (copy / "notes.txt").write_text("not code")  # neither a module nor the C++ source: no new key
    assert step_code_digest(copy) == edited


def test_the_engine_facts_name_the_step_code_and_transformers(tiny_model_dir: Path) -> None:
    import transformers

    facts = step_facts(model_dir=tiny_model_dir, dtype=torch.bfloat16, quantize="w8a8")
    assert facts["step_code"] == step_code_digest() and facts["step_code"].startswith("sha256:")
    assert facts["transformers"] == transformers.__version__
    assert facts["w8a8_kernel"] == w8a8_kernel()  # each kernel's graph calls its own operator
    with mock.patch.object(w8a8_vnni, "available", lambda: False):  # a CPU where the kernel did not build
        fbgemm = step_facts(model_dir=tiny_model_dir, dtype=torch.bfloat16, quantize="w8a8")
    assert fbgemm["w8a8_kernel"] == "fbgemm"
    assert "w8a8_kernel" not in step_facts(model_dir=tiny_model_dir, dtype=torch.bfloat16, quantize="none")


def _sealed(cache: CompileCache, facts: dict[str, str], *, at: Path | None = None) -> Path:
    """A folder with one artifact, sealed for ``facts`` (at ``at``: where another key's folder is)."""
    folder = at or cache.folder(facts)
    (folder / "inductor").mkdir(parents=True)
    (folder / "inductor" / "graph.so").write_bytes(b"compiled code")
    cache.seal(folder, facts)
    return folder


def _open(cache: CompileCache, facts: dict[str, str], caplog: pytest.LogCaptureFixture) -> tuple[bool, int]:
    """Open the key's folder: (whether the artifact was still there, refusals logged)."""
    caplog.clear()
    logs = caplog.at_level(logging.WARNING, "server.engine.chattts.step.compile_cache")
    with logs, cache.open(facts) as folder:
        kept = (folder / "inductor" / "graph.so").exists()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    return kept, sum("refused" in r.getMessage() for r in caplog.records)


def test_a_sealed_folder_is_used_as_it_is(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = CompileCache(tmp_path)
    folder = _sealed(cache, FACTS)
    (folder / "inductor" / "locks").mkdir()
    (folder / "inductor" / "locks" / "c5md.lock").write_text("")  # inductor's, made as it runs
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    assert _open(cache, FACTS, caplog) == (True, 0)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before  # put back after the block


def test_a_folder_sealed_for_other_facts_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A folder copied from another machine under this key's name: its manifest tells."""
    cache = CompileCache(tmp_path)
    _sealed(cache, {**FACTS, "cpu_flags": "avx2 fma"}, at=cache.folder(FACTS))
    assert _open(cache, FACTS, caplog) == (False, 1)
    assert "another torch, CPU, model" in caplog.records[0].getMessage()


@pytest.mark.parametrize("damage", ["changed", "truncated", "removed", "added", "manifest", "unsealed"])
def test_a_damaged_folder_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    cache = CompileCache(tmp_path)
    folder = _sealed(cache, FACTS)
    artifact = folder / "inductor" / "graph.so"
    if damage == "changed":
        artifact.write_bytes(b"compiled cod3")
    elif damage == "truncated":
        artifact.write_bytes(b"compiled")
    elif damage == "removed":
        (folder / "inductor" / "other.so").write_bytes(b"x")
        cache.seal(folder, FACTS)
        (folder / "inductor" / "other.so").unlink()
    elif damage == "added":  # a compile killed after the seal, half written
        (folder / "inductor" / "half.so").write_bytes(b"x")
    elif damage == "manifest":
        (folder / MANIFEST).write_text("{not json")
    else:
        (folder / MANIFEST).unlink()
    assert _open(cache, FACTS, caplog) == (False, 1)
    assert not any(folder.iterdir())  # emptied: nothing of it is loaded


def _compile_command(model_dir: Path, cache_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CHATTTS_", "TORCH_EXTENSIONS", "TORCHIND"))
    }
    args = [
        "--engine",
        "chattts",
        "--model-dir",
        str(model_dir),
        "--device",
        "cpu",
        "--cache-dir",
        str(cache_dir),
    ]
    return subprocess.run(
        [sys.executable, "-m", "server", "compile", *args, *flags],
        cwd=REPO,
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=840,
    )


@pytest.mark.parametrize("flags", [("--compile-step", "off"), ("--profile", "eager"), ("--profile", "exact")])
def test_compile_without_the_compiled_step_says_so(
    tiny_model_dir: Path, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    run = _compile_command(tiny_model_dir, tmp_path, *flags)
    assert run.returncode == 2 and "--profile realtime" in run.stdout and "--compile-step on" in run.stdout
    assert not (tmp_path / "compiled").exists()


@pytest.mark.skipif(
    TEST_DEVICE != "cpu" or not quantized_engine_available(), reason="w8a8: FBGEMM, x86-64 CPU"
)
@pytest.mark.timeout(1800)  # two compiles (cold, then warm) of two graphs on a loaded 2-core machine
@pytest.mark.parametrize("compile_step", ["on", "ahead"])
def test_compile_builds_what_a_restart_loads_and_a_corrupted_artifact_is_refused(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, compile_step: str
) -> None:
    """A restart is a new process: ``compile`` twice, the second finding every graph's code in the folder.

    ``on``: inductor's FX-graph cache hits every graph; ``ahead``: every graph is loaded from its
    saved file (``step/aot.py``). w8a8, the CPU's real-time step: with ``--quantize none``
    freezing packs the bf16 projections into oneDNN tensors, which inductor's FX-graph cache
    cannot pickle, so it bypasses them (0 of 0).
    """
    flags = ("--compile-step", compile_step, "--quantize", "w8a8", "--dtype", "bfloat16", "--max-batch", "1")
    cold = _compile_command(tiny_model_dir, tmp_path, *flags)
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert f"into {tmp_path / 'compiled'}" in cold.stdout
    (folder,) = [p for p in (tmp_path / "compiled").iterdir() if p.is_dir() and p.name != "torch_extensions"]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["facts"]["model"] == model_digest(tiny_model_dir)
    assert manifest["facts"]["torch"] == torch.__version__ and manifest["facts"]["shapes"]
    assert manifest["facts"]["compiled"] == ("ahead" if compile_step == "ahead" else "frozen")
    if compile_step == "ahead":
        assert "aot/batch1.pt" in manifest["files"]  # the graph, saved ahead of time (step/aot.py)
    assert any(name.startswith("inductor/") for name in manifest["files"])
    assert list((tmp_path / "compiled" / "torch_extensions").rglob("*.so"))  # the C++ attention, built there
    graphs = re.search(r"in [\d.]+ s: 0 of (\d+) graphs' code from " + re.escape(str(folder)), cold.stderr)
    # One graph: dynamo specializes batch 1, and no step attends over a whole slot (its spare position)
    assert graphs is not None and int(graphs.group(1)) == 1, cold.stderr[-3000:]

    warm = _compile_command(tiny_model_dir, tmp_path, *flags)
    assert warm.returncode == 0, warm.stderr[-3000:]
    n = graphs.group(1)
    assert f"s: {n} of {n} graphs' code from {folder}" in warm.stderr, warm.stderr[-3000:]
    assert "refused" not in warm.stderr
    assert CompileCache.check(folder, manifest["facts"]) is None  # loading wrote nothing into it

    # A truncated copy of one artifact: refused (never loaded) and emptied, with one log line.
    manifest = json.loads((folder / MANIFEST).read_text())
    artifact = next(
        folder / name for name in sorted(manifest["files"]) if name.startswith(("aot/", "inductor/"))
    )
    artifact.write_bytes(artifact.read_bytes()[:-1])
    assert (
        CompileCache.check(folder, manifest["facts"])
        == f"its files differ from those sealed: {artifact.relative_to(folder)}"
    )
    logs = caplog.at_level(logging.WARNING, "server.engine.chattts.step.compile_cache")
    with logs, CompileCache(tmp_path / "compiled").open(manifest["facts"]) as opened:
        assert opened == folder and not any(folder.iterdir())
    assert sum("refused" in r.getMessage() for r in caplog.records) == 1
