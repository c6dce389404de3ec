"""Word-timestamp error on speech with known word boundaries (espeak-ng; no model weights).

Every segment of the text set (bench/texts/default.jsonl cut by the server's own segmenter, plus
bench/texts/word_timing.jsonl) is put through our number speller, spoken by espeak-ng at three
speaking rates with its own word and phoneme positions (:mod:`bench.words.espeak`), given a noise
floor (espeak-ng's pauses are digital silence, a model's are not), and aligned by
:func:`server.text.words.align` from the text and the audio alone, as the server would align a
segment from its exact audio span. The error of a boundary is the distance between a word's
start (or end) and espeak-ng's; reported per language as mean, median, p90 and max, for the
method and for the simpler ones it was chosen against.

Usage::

    python -m bench.words [--out bench/results/words/<hw>] [--rates 150,180,210]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.harness.machine import describe_machine, result_stem
from bench.harness.textset import DEFAULT_TEXTS, BenchText, load_texts
from bench.words.espeak import Espeak, RefWord, Utterance
from server.text.normalize import speakable
from server.text.segments import split_segments
from server.text.words import DEFAULT, AlignParams, TimedWord, Word, align, spoken_words

EXTRA_TEXTS = Path(__file__).resolve().parents[1] / "texts" / "word_timing.jsonl"
#: Texts written after the constants were chosen, never used to choose them.
HELD_OUT_TEXTS = Path(__file__).resolve().parents[1] / "texts" / "word_timing_heldout.jsonl"
VOICES = {"en": "en-us", "zh": "cmn-latn-pinyin"}
COMMAND = "python -m bench.words"
SHIPPED = "weights + pauses + snapping (shipped)"

Aligner = Callable[[list[Word], npt.NDArray[np.float32], int], list[TimedWord]]


@dataclass(frozen=True)
class Case:
    """One spoken segment: its language, text, rate, audio, our words and espeak-ng's spans."""

    lang: str
    text: str
    words_per_minute: int
    audio: npt.NDArray[np.float32]
    sample_rate: int
    words: list[Word]
    #: For our word i: espeak-ng's start of it (None: unknown) and its end.
    ref_start: list[int | None]
    ref_end: list[int | None]


def by_characters(words: list[Word], samples: npt.NDArray[np.float32], rate: int) -> list[TimedWord]:
    """The naive baseline: the whole span shared by character count (what segment marks allow)."""
    sizes = np.array([max(len(w.text), 1) for w in words], dtype=np.float64)
    cum = np.concatenate(([0.0], np.cumsum(sizes))) / sizes.sum() * len(samples)
    return [TimedWord(w.text, round(cum[i]), round(cum[i + 1])) for i, w in enumerate(words) if w.text]


def with_params(params: AlignParams) -> Aligner:
    """``align`` with these constants (the weights are recomputed with them by the caller)."""
    return lambda words, samples, rate: align(words, samples, rate, params)


def method_variants() -> dict[str, tuple[AlignParams, Aligner]]:
    """The method as shipped (first), the simpler methods it was chosen against, and ablations."""
    plain = replace(DEFAULT, use_pauses=False, snap_s=(0.0, 0.0))
    variants: dict[str, tuple[AlignParams, Aligner | None]] = {
        SHIPPED: (DEFAULT, with_params(DEFAULT)),
        "characters over the whole span (segment marks only)": (DEFAULT, by_characters),
        "weights over the speech, no pauses, no snapping": (plain, with_params(plain)),
        "weights + pauses, no snapping": (replace(DEFAULT, snap_s=(0.0, 0.0)), None),
        "weights + pauses + snapping 80 ms in English too": (replace(DEFAULT, snap_s=(0.08, 0.08)), None),
        "no consonant weight (syllables only)": (replace(DEFAULT, consonant_weight=0.0), None),
        "no final lengthening": (replace(DEFAULT, final_lengthening=(0.0, 0.0)), None),
        "final lengthening in Chinese too (0.3)": (replace(DEFAULT, final_lengthening=(1.5, 0.3)), None),
        "no neutral-tone particles (的 weighs 1)": (replace(DEFAULT, light_weight=1.0), None),
        "no punctuation prior": (replace(DEFAULT, p_pause=(0.3, 0.3, 0.3)), None),
        "silence 25 dB below the loud level": (replace(DEFAULT, silence_db=25.0), None),
        "silence 35 dB below the loud level": (replace(DEFAULT, silence_db=35.0), None),
        "pauses from 100 ms": (replace(DEFAULT, min_pause_s=0.1), None),
    }
    return {name: (p, aligner or with_params(p)) for name, (p, aligner) in variants.items()}


def word_positions(text: str, words: list[Word]) -> list[int]:
    """Where each word (with text) starts in ``text``, searched in order."""
    positions, at = [], 0
    for word in words:
        if not word.text:
            positions.append(at)
            continue
        found = text.find(word.text, at)
        if found < 0:
            raise ValueError(f"word {word.text!r} not found in {text!r} after {at}")
        positions.append(found)
        at = found + len(word.text)
    return positions


def references(
    positions: list[int], words: list[Word], refs: list[RefWord]
) -> tuple[list[int | None], list[int | None]]:
    """espeak-ng's start and end for each of our words (None where espeak-ng marks no boundary).

    A word espeak-ng has no event for was spoken inside the event before it ("of the"): its
    start and the previous word's end are unknown. Two events inside one of our words count as one.
    """
    starts: list[int | None] = [None] * len(words)
    ends: list[int | None] = [None] * len(words)
    owner: list[int | None] = [None] * len(words)  # which ref each word's speech belongs to
    r = -1
    for i, (at, word) in enumerate(zip(positions, words, strict=True)):
        if not word.text:
            continue
        own = [
            k
            for k, ref in enumerate(refs)
            if ref.first <= at < ref.last or at <= ref.first < at + len(word.text)
        ]
        if own:
            starts[i] = refs[own[0]].start
            r = own[-1]
            owner[i] = r
        elif r >= 0:
            owner[i] = r  # merged into the previous event
    for i in range(len(words)):
        if owner[i] is None:
            continue
        nxt = next((j for j in range(i + 1, len(words)) if words[j].text), None)
        if nxt is None or owner[nxt] != owner[i]:
            ends[i] = refs[owner[i]].end  # type: ignore[index]
        else:
            starts[nxt] = None  # the boundary inside one event is unknown
    return starts, ends


@dataclass(frozen=True)
class Spoken:
    """A segment as espeak-ng said it, before any noise."""

    lang: str
    text: str
    words_per_minute: int
    utterance: Utterance
    ref_start: list[int | None]
    ref_end: list[int | None]


def speak_all(espeak: Espeak, rates: list[int], texts: list[BenchText]) -> list[Spoken]:
    """Every segment of ``texts`` spoken at every rate, with its reference boundaries."""
    spoken: list[Spoken] = []
    for item in texts:
        for segment in split_segments(item.text):
            text = speakable(segment)
            words = spoken_words(segment)
            if not words:
                continue
            positions = word_positions(text, words)
            for wpm in rates:
                said = espeak.speak(text, VOICES[item.lang], wpm)
                starts, ends = references(positions, words, said.words)
                spoken.append(Spoken(item.lang, segment, wpm, said, starts, ends))
    return spoken


def with_noise(spoken: list[Spoken], noise_db: float, seed: int) -> list[Case]:
    """The segments with white noise ``noise_db`` below the speech's RMS (seeded)."""
    rng = np.random.default_rng(seed)
    cases = []
    for s in spoken:
        audio = s.utterance.samples
        loud = float(np.sqrt(np.mean(audio[np.abs(audio) > 1e-4] ** 2)))
        noise = rng.standard_normal(len(audio)).astype(np.float32) * loud * 10 ** (-noise_db / 20)
        words = spoken_words(s.text)
        rate = s.utterance.sample_rate
        cases.append(
            Case(s.lang, s.text, s.words_per_minute, audio + noise, rate, words, s.ref_start, s.ref_end)
        )
    return cases


def reference_check(spoken: list[Spoken]) -> dict[str, float | int]:
    """How exact the reference is: espeak-ng's pauses are silent and its words are not."""
    gap_rms, word_rms = [], []
    for s in spoken:
        audio, words = s.utterance.samples, s.utterance.words
        for before, after in itertools.pairwise(words):
            if after.start - before.end > 0.03 * s.utterance.sample_rate:
                gap_rms.append(float(np.sqrt(np.mean(audio[before.end : after.start] ** 2))))
        word_rms += [float(np.sqrt(np.mean(audio[w.start : w.end] ** 2))) for w in words]
    return {
        "pauses_over_30ms": len(gap_rms),
        "pause_rms_max": max(gap_rms, default=0.0),
        "word_rms_min": min(word_rms),
        "word_rms_median": float(np.median(word_rms)),
    }


def errors_ms(case: Case, timed: list[TimedWord]) -> list[float]:
    """Absolute start and end errors of every word whose boundary espeak-ng marks, in ms."""
    spoken = [i for i, w in enumerate(case.words) if w.text]
    if len(spoken) != len(timed):
        raise AssertionError(f"{len(timed)} timed words for {len(spoken)} words in {case.text!r}")
    out: list[float] = []
    for i, word in zip(spoken, timed, strict=True):
        for ref, got in ((case.ref_start[i], word.start), (case.ref_end[i], word.end)):
            if ref is not None:
                out.append(abs(got - ref) / case.sample_rate * 1000)
    return out


def summary(values: list[float]) -> dict[str, float | int]:
    """Mean, median, p90, max (ms) and the number of boundaries."""
    arr = np.array(values)
    return {
        "boundaries": len(values),
        "mean_ms": round(float(arr.mean()), 1),
        "p50_ms": round(float(np.percentile(arr, 50)), 1),
        "p90_ms": round(float(np.percentile(arr, 90)), 1),
        "max_ms": round(float(arr.max()), 1),
    }


def errors_of(
    params: AlignParams, aligner: Aligner, cases: list[Case]
) -> tuple[dict[str, list[float]], float]:
    """Errors (ms) per language, and align's cost in ms per second of audio."""
    per_lang: dict[str, list[float]] = {}
    cpu = audio_s = 0.0
    for case in cases:
        words = spoken_words(case.text, params)  # weighed with the variant's own constants
        t0 = time.perf_counter()
        timed = aligner(words, case.audio, case.sample_rate)
        cpu += time.perf_counter() - t0
        audio_s += len(case.audio) / case.sample_rate
        per_lang.setdefault(case.lang, []).extend(errors_ms(replace(case, words=words), timed))
    return per_lang, cpu / audio_s * 1000


def evaluate(cases: list[Case]) -> dict[str, dict[str, Any]]:
    """Every variant on every case: error summaries per language and align's cost."""
    results: dict[str, dict[str, Any]] = {}
    for name, (params, aligner) in method_variants().items():
        per_lang, cost = errors_of(params, aligner, cases)
        results[name] = {lang: summary(v) for lang, v in sorted(per_lang.items())}
        results[name]["align_ms_per_audio_s"] = round(cost, 3)
    return results


def by_rate(cases: list[Case]) -> dict[str, dict[str, Any]]:
    """The shipped method per speaking rate."""
    out: dict[str, dict[str, Any]] = {}
    for wpm in sorted({c.words_per_minute for c in cases}):
        per_lang, _ = errors_of(
            DEFAULT, with_params(DEFAULT), [c for c in cases if c.words_per_minute == wpm]
        )
        out[f"{wpm} wpm"] = {lang: summary(v) for lang, v in sorted(per_lang.items())}
    return out


def _table(title: str, rows: dict[str, dict[str, Any]], cost: bool) -> list[str]:
    head = "| " + title + " | language | boundaries | mean | p50 | p90 | max |"
    lines = [head + (" align cost (ms per s of audio) |" if cost else ""), "|---" * (7 + cost) + "|"]
    for name, result in rows.items():
        for lang in ("en", "zh"):
            if lang in result:
                s = result[lang]
                row = f"| {name} | {lang} | {s['boundaries']} | {s['mean_ms']} | {s['p50_ms']} "
                row += f"| {s['p90_ms']} | {s['max_ms']} |"
                lines.append(row + (f" {result['align_ms_per_audio_s']} |" if cost else ""))
    return lines


def write(out: Path, record: dict[str, Any]) -> None:
    """``out``.json with everything, ``out``.md with the tables."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    check = record["reference_check"]
    lines = [
        "# Word timestamps: error against espeak-ng's own word boundaries",
        "",
        f"Command: `{record['command']}` · espeak-ng {record['espeak_ng']} (voices {record['voices']}) · "
        f"{record['cases']} spoken segments ({record['segments']} segments × {record['rates_wpm']} words "
        f"per minute) · noise floor {record['noise_db']} dB below the speech · load average at start "
        f"{record['machine']['loadavg_at_start']}",
        "",
        "Absolute boundary error, each word's start and end against espeak-ng's, in ms (the first row",
        "is the method the server uses, `server.text.words.align` with its defaults):",
        "",
        *_table("method", record["results"], cost=True),
        "",
        "The shipped method per speaking rate:",
        "",
        *_table("rate", record["by_rate"], cost=False),
        "",
        f"The shipped method on texts held out from the choice of its constants "
        f"({record['held_out']['segments']} segments, bench/texts/word_timing_heldout.jsonl):",
        "",
        *_table("held out", {"shipped": record["held_out"]["shipped"]}, cost=False),
        "",
        "The shipped method with other noise floors (dB below the speech's RMS):",
        "",
        *_table("noise", record["by_noise"], cost=False),
        "",
        f"Reference check: {check['pauses_over_30ms']} pauses of espeak-ng over 30 ms, the loudest at RMS "
        f"{check['pause_rms_max']:.5f} before the noise (digital silence); words at RMS "
        f"{check['word_rms_min']:.3f} and more (median {check['word_rms_median']:.3f}).",
        "",
        *record["notes"],
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))


NOTES = [
    "How the reference is made: espeak-ng's C API reports, for each word and each phoneme, the",
    "output sample it starts at (`bench/words/espeak.py`). A word starts at its first phoneme and ends",
    "at the next word's first phoneme, or where a pause phoneme begins. Where espeak-ng speaks two",
    'words as one dictionary entry ("of the") the boundary between them is not scored.',
    "",
    "What this measures and what it does not: espeak-ng is a rule-based synthesizer, so its",
    "timing is more regular than a neural model's, and its Mandarin has no final lengthening.",
    "The constants were chosen on the first set (the ablation rows show what each one is worth);",
    "the held-out texts check that they carry over. The numbers are an estimate for speech of this",
    "kind, not a measurement on ChatTTS's voice, which cannot be made without its weights.",
]


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=result_stem("words"))
    parser.add_argument("--rates", default="150,180,210", help="espeak-ng speaking rates, words per minute")
    parser.add_argument("--noise-db", type=float, default=45.0, help="noise floor below the speech RMS")
    parser.add_argument("--seed", type=int, default=26)
    args = parser.parse_args(argv)
    espeak = Espeak()
    rates = [int(r) for r in args.rates.split(",")]
    spoken = speak_all(espeak, rates, load_texts(DEFAULT_TEXTS) + load_texts(EXTRA_TEXTS))
    cases = with_noise(spoken, args.noise_db, args.seed)
    held_out = with_noise(speak_all(espeak, rates, load_texts(HELD_OUT_TEXTS)), args.noise_db, args.seed)
    held_out_errors, _ = errors_of(DEFAULT, with_params(DEFAULT), held_out)
    by_noise = {}
    for db in (25.0, 35.0, 45.0, 55.0):
        per_lang, _ = errors_of(DEFAULT, with_params(DEFAULT), with_noise(spoken, db, args.seed))
        by_noise[f"{db:g} dB"] = {lang: summary(v) for lang, v in sorted(per_lang.items())}
    record = {
        "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
        "espeak_ng": espeak.version,
        "voices": VOICES,
        "rates_wpm": rates,
        "noise_db": args.noise_db,
        "segments": len(cases) // len(rates),
        "cases": len(cases),
        "machine": describe_machine(),
        "reference_check": reference_check(spoken),
        "results": evaluate(cases),
        "by_rate": by_rate(cases),
        "by_noise": by_noise,
        "held_out": {
            "segments": len(held_out) // len(rates),
            "shipped": {lang: summary(v) for lang, v in sorted(held_out_errors.items())},
        },
        "notes": NOTES,
    }
    write(args.out, record)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
