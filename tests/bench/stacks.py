"""Summarise py-spy's raw (collapsed) stacks: where the worker's samples go, by function.

``python tests/bench/stacks.py PROFILE.txt [--top 30] [--grep epd_flask]``: the functions
with the most samples on their own (self) and anywhere on the stack (total, counted once per
stack), as a share of all samples. py-spy drops idle samples, so shares are of busy time.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter


def load(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            frames, _, count = line.rpartition(" ")
            stacks.append((frames.split(";"), int(count)))
    return stacks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--grep", default="")
    args = p.parse_args(argv)
    stacks = load(args.path)
    total = sum(n for _, n in stacks)
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    for frames, n in stacks:
        own[frames[-1] if frames else "?"] += n
        for name in set(frames):
            anywhere[name] += n
    print(f"{total} busy samples")
    for title, counter in (("self", own), ("total", anywhere)):
        print(f"\n-- {title} --")
        shown = 0
        for name, n in counter.most_common():
            if args.grep and args.grep not in name:
                continue
            print(f"{100 * n / total:6.1f}%  {name}")
            shown += 1
            if shown >= args.top:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
