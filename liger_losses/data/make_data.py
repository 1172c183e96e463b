"""Generate the small bundled datasets the demo and the TRL-integration tests train on.

``preference_demo.jsonl``: one JSON object a line, ``{"prompt": str, "chosen": str, "rejected": str}``,
character-level toy tasks a 2-layer model can learn in a few dozen steps on a CPU:

* ``"3+4="`` -> chosen ``"7"`` (the sum), rejected ``"34"`` (the operands glued: a classic wrong
  answer) or, one time in three, a sum off by one to three;
* ``"cdef>"`` -> chosen ``"gh"`` (the next two letters), rejected an echo of the prompt's letters;
* ``"abc|"`` -> chosen ``"cba"`` (the reversal), rejected the word copied or another permutation.

Rejected answers are mostly "echo the prompt" mistakes, a pattern a 2-layer model picks up in a few
dozen DPO steps, so the demo's reward accuracy rises visibly.

The SFT tests use the same file as prompt/completion pairs (prompt, chosen).
Run ``python -m liger_losses.data.make_data`` to regenerate; the output is deterministic (seeded).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

LETTERS = string.ascii_lowercase


def _addition(rng: random.Random) -> dict:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    right = a + b
    if rng.random() < 2 / 3:
        wrong = f"{a}{b}"
    else:
        off = right + rng.choice([-3, -2, -1, 1, 2, 3])
        wrong = str(off if off >= 0 else right + rng.randint(1, 3))
    if wrong == str(right):
        wrong = str(right + 1)
    return {"prompt": f"{a}+{b}=", "chosen": str(right), "rejected": wrong}


def _next_letters(rng: random.Random) -> dict:
    start = rng.randint(0, len(LETTERS) - 6)
    prompt = LETTERS[start : start + 4] + ">"
    chosen = LETTERS[start + 4 : start + 6]
    i = rng.randint(0, 2)
    rejected = prompt[i : i + 2]  # an echo of two prompt letters
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _reverse(rng: random.Random) -> dict:
    word = "".join(rng.sample(LETTERS[:8], 3))
    chosen = word[::-1]
    rejected = word  # copied, not reversed
    if rng.random() < 1 / 3:
        while True:
            rejected = "".join(rng.sample(word, 3))
            if rejected != chosen:
                break
    return {"prompt": word + "|", "chosen": chosen, "rejected": rejected}


def make_preference_examples(n: int = 480, seed: int = 0) -> list[dict]:
    """``n`` preference examples, the three tasks interleaved, deterministic for a given seed."""
    rng = random.Random(seed)
    makers = (_addition, _next_letters, _reverse)
    return [makers[i % len(makers)](rng) for i in range(n)]


def write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def main() -> None:
    here = Path(__file__).resolve().parent
    write_jsonl(make_preference_examples(), here / "preference_demo.jsonl")
    print(f"wrote {here / 'preference_demo.jsonl'}")


if __name__ == "__main__":
    main()
