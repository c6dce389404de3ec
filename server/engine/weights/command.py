"""``chattts-stream weights``: ``download``, ``verify DIR`` and ``where``.

Results go to stdout, progress to stderr. Every command exits 0 when the weights are usable and 1
when they are not (named on the last line), so scripts can chain them
(``chattts-stream weights where || chattts-stream weights download``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from server.config import Settings, add_settings_arguments
from server.engine.weights.files import (
    Expected,
    WeightsError,
    chattts_sha256_map,
    check_file,
    expected_files,
    read_manifest,
    read_sha256_map,
)
from server.engine.weights.locate import Location, hub_cache, locate

#: The serve flags that decide where the weights are (``where`` and ``download`` take them too).
LOCATION_FLAGS = ("model_dir", "dev_model", "cache_dir")


def add_weights_command(commands: Any, env: Mapping[str, str]) -> None:
    """Add ``weights`` and its three subcommands to the ``chattts-stream`` subparsers ``commands``."""
    weights = commands.add_parser(
        "weights",
        help="download, verify or locate the ChatTTS weights",
        description="Fetch the official ChatTTS weights (2Noise/ChatTTS on the Hugging Face hub, or the "
        "mirror HF_ENDPOINT names), check a folder of them against ChatTTS's own sha256 map, or show "
        "where `serve` looks for them. docs/weights.md has the files and the offline recipe.",
    )
    actions = weights.add_subparsers(dest="weights_command", required=True)
    hashes_help = (
        "check against this hash map (ChatTTS's sha256_map.json format) instead of the installed "
        "ChatTTS's own"
    )

    download = actions.add_parser(
        "download",
        help="fetch the nine files ChatTTS loads and check their sha256",
        description="Fetch the files ChatTTS loads with huggingface_hub (HF_ENDPOINT: a mirror; HF_TOKEN; "
        "progress; an interrupted file resumes) and check each against ChatTTS's sha256 map. A file "
        "that differs is deleted and named, and the command fails.",
    )
    download.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="a folder to fetch into (DIR/asset/...; serve it with --model-dir DIR, or copy it to an "
        "offline machine); default: the hub cache `serve` reads (see `weights where`)",
    )
    download.add_argument("--revision", default="main", help="branch, tag or commit of 2Noise/ChatTTS")
    download.add_argument(
        "--retries", type=int, default=5, help="how often an interrupted transfer is resumed before giving up"
    )
    download.add_argument("--sha256-map", type=Path, default=None, help=hashes_help)
    add_settings_arguments(download, env, only=("cache_dir",))

    verify = actions.add_parser(
        "verify",
        help="check a folder: every file present, sizes, sha256",
        description="Check that DIR holds every file ChatTTS loads with the right size and sha256 (a "
        "dev model's folder: against its DEV_MODEL.json). Names each missing or differing file.",
    )
    verify.add_argument("directory", type=Path, help="the folder that contains asset/")
    verify.add_argument("--sha256-map", type=Path, default=None, help=hashes_help)

    where = actions.add_parser(
        "where",
        help="print where `serve` looks for the weights and whether they are there",
        description="Print the folder `serve` with these flags (or CHATTTS_* variables) loads the weights "
        "from, and whether every file is there with its size (`weights verify` checks the hashes).",
    )
    add_settings_arguments(where, env, only=LOCATION_FLAGS)
    where.add_argument("--sha256-map", type=Path, default=None, help=hashes_help)


def run_weights(args: argparse.Namespace) -> int:
    """Run the parsed ``weights`` subcommand; returns the exit status."""
    try:
        if args.weights_command == "download":
            return _download(args)
        if args.weights_command == "verify":
            return _verify(args.directory, args.sha256_map)
        return _where(_settings(args), args.sha256_map)
    except WeightsError as exc:
        print(f"chattts-stream weights: {exc}", file=sys.stderr)
        return 1


def _settings(args: argparse.Namespace) -> Settings:
    """Settings with the location flags parsed here (their variables already applied); the rest default."""
    return Settings(**{name: getattr(args, name) for name in LOCATION_FLAGS if hasattr(args, name)})


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def expected_for(folder: Path, sha256_map: Path | None) -> tuple[tuple[Expected, ...], str]:
    """What ``folder`` must hold, and whose hashes those are.

    ``--sha256-map`` first; else a dev model's ``DEV_MODEL.json`` (random weights carry their own
    hashes, as the server checks them); else the installed ChatTTS's own map.
    """
    if sha256_map is not None:
        return expected_files(read_sha256_map(sha256_map)), f"the sha256 map {sha256_map}"
    manifest = read_manifest(folder)
    if manifest is not None:
        return expected_files(manifest["sha256"]), "its DEV_MODEL.json (RANDOM weights: noise, not speech)"
    return expected_files(chattts_sha256_map()), "ChatTTS's sha256 map"


def _verify(folder: Path, sha256_map: Path | None) -> int:
    if not (folder / "asset").is_dir():
        print(
            f"{folder}: no asset/ folder here: pass the folder that contains asset/ "
            "(`chattts-stream weights where` prints the one `serve` uses)"
        )
        return 1
    expected, whose = expected_for(folder, sha256_map)
    _progress(f"checking {folder} against {whose}")
    bad = 0
    for file in expected:
        problem = check_file(folder, file)
        if problem is None:
            print(f"ok       {file.path}")
        else:
            bad += 1
            label = "MISSING" if problem.what.startswith("missing") else "BAD"
            print(f"{label:<8} {file.path}: {problem.what}")
    if bad:
        print(f"{folder}: {bad} of {len(expected)} files missing or different from {whose}")
        return 1
    print(f"{folder}: all {len(expected)} files match {whose}")
    return 0


def _where(settings: Settings, sha256_map: Path | None) -> int:
    location = locate(settings)
    print(f"serve looks in: {location.describe()}")
    folder = location.folder
    if location.source == "dev-model":
        made = folder is not None and read_manifest(folder) is not None
        print(f"folder: {folder}")
        print("state: present" if made else "state: not written yet (the first `serve` writes it)")
        return 0
    fetch = f"`chattts-stream weights download{_download_flags(location, settings)}`"
    if folder is None:
        print(f"state: missing ({fetch} fetches them there)")
        return 1
    print(f"folder: {folder}")
    if not folder.is_dir():
        print(f"state: missing (no such folder; {fetch} fetches them there)")
        return 1
    return _presence(folder, fetch, sha256_map)


def _download_flags(location: Location, settings: Settings) -> str:
    """The flags of the ``weights download`` that fills ``location``."""
    if location.source == "model-dir":
        return f" --dir {location.folder}"
    return f" --cache-dir {settings.cache_dir}" if settings.cache_dir else ""


def _presence(folder: Path, fetch: str, sha256_map: Path | None) -> int:
    """Every file there with its size: quick (``verify`` hashes them)."""
    expected, _ = expected_for(folder, sha256_map)
    problems = [p for p in (check_file(folder, f, hashes=False) for f in expected) if p is not None]
    if not problems:
        print(f"state: present ({len(expected)} files; `chattts-stream weights verify {folder}` hashes them)")
        return 0
    for problem in problems:
        print(f"  {problem.path}: {problem.what}")
    print(f"state: incomplete ({len(problems)} of {len(expected)} files): {fetch} fetches them")
    return 1


def _download(args: argparse.Namespace) -> int:
    from server.engine.weights.hub import REPO_ID, DownloadError, download, hub_endpoint

    if args.retries < 0:
        raise WeightsError(f"--retries {args.retries}: must be 0 or more")
    settings = _settings(args)
    if args.sha256_map is not None:
        expected, whose = (
            expected_files(read_sha256_map(args.sha256_map)),
            f"the sha256 map {args.sha256_map}",
        )
    else:
        expected, whose = expected_files(chattts_sha256_map()), "ChatTTS's sha256 map"
    target = args.dir if args.dir is not None else hub_cache(settings)
    what = "the folder" if args.dir is not None else "the hub cache"
    _progress(f"fetching {REPO_ID}@{args.revision} from {hub_endpoint()} into {what} {target}")
    try:
        folder = download(
            expected,
            local_dir=args.dir,
            cache_dir=None if args.dir is not None else target,
            revision=args.revision,
            retries=args.retries,
            say=_progress,
        )
    except DownloadError as exc:
        print(f"chattts-stream weights: {exc}", file=sys.stderr)
        return 1
    print(f"{folder}: all {len(expected)} files match {whose}")
    if args.dir is not None:
        print(f"serve them: chattts-stream serve --model-dir {folder}")
    elif locate(settings).folder == folder:
        flags = f" --cache-dir {settings.cache_dir}" if settings.cache_dir else ""
        print(f"`chattts-stream serve{flags}` loads them from there")
    else:  # another revision than the one `serve` reads (main)
        print(f"serve them: chattts-stream serve --model-dir {folder}")
    return 0
