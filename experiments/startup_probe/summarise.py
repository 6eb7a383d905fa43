"""Summarise `sitecustomize.py`'s probe files (see there): per process, per thread, the seconds spent under each
dicache function (the innermost dicache frame of each sample, and the innermost frame of all), second by second
and in total; and which hash-detail lines differ between the processes' cache keys.

    python experiments/startup_probe/summarise.py PROBE_DIR [--bucket 1.0] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re


def innermost(stack: list[str], prefix: str) -> str:
    for name in reversed(stack):
        if name.startswith(prefix):
            return name
    return "-"


def summarise(path: pathlib.Path, bucket: float, top: int) -> None:
    record = json.loads(path.read_text())
    stacks, period = record["stacks"], record["period_s"]
    print(f"\n## {path.name}: {' '.join(record['argv'])[:160]}")
    by_thread: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
    for t, thread, index in record["samples"]:
        by_thread[thread].append((t, index))
    for thread, samples in sorted(by_thread.items(), key=lambda item: -len(item[1])):
        busy = len(samples) * period
        if busy < 0.5:
            continue
        print(f"\n### thread {thread}: {busy:.1f} s busy, {samples[0][0]:.1f}-{samples[-1][0]:.1f} s")
        totals = collections.Counter()
        leaves = collections.Counter()
        for _, index in samples:
            totals[innermost(stacks[index], "dicache/")] += period
            leaves[stacks[index][-1]] += period
        print("innermost dicache frame (s):", ", ".join(f"{n} {s:.1f}" for n, s in totals.most_common(top)))
        print("innermost frame (s):", ", ".join(f"{n} {s:.1f}" for n, s in leaves.most_common(top)))
        timeline = collections.defaultdict(collections.Counter)
        for t, index in samples:
            timeline[int(t // bucket)][innermost(stacks[index], "dicache/")] += period
        for b in sorted(timeline):
            (name, s), *_ = timeline[b].most_common(1)
            print(f"  {b * bucket:6.1f} s  {sum(timeline[b].values()):4.2f} busy  {name} {s:.2f}")


def key_blocks(text: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """A hash log's blocks: (kind, {detail name: (hash, value)}), in the order they were logged."""
    blocks: list[tuple[str, dict[str, tuple[str, str]]]] = []
    detail = None
    for line in text.splitlines():
        if "hash details for key" in line:
            blocks.append((line.split(" hash details")[0], {}))
            detail = None
        elif blocks and (match := re.match(r"\[(\w+)\] ([^:]+): ?(.*)", line)):
            detail = match.group(2)
            blocks[-1][1][detail] = (match.group(1), match.group(3))
        elif blocks and detail is not None:
            digest, value = blocks[-1][1][detail]
            blocks[-1][1][detail] = (digest, value + "\n" + line)
    return blocks


def hash_diff(folder: pathlib.Path) -> None:
    """For each pair of processes, the detail names whose hashes differ between their n-th key of each kind."""
    logs = {log.name: key_blocks(log.read_text()) for log in sorted(folder.glob("hash-*.log"))}
    names = list(logs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            print(f"\n## cache keys: {a} against {b}")
            for kind in sorted({k for k, _ in logs[a]} | {k for k, _ in logs[b]}):
                left = [d for k, d in logs[a] if k == kind]
                right = [d for k, d in logs[b] if k == kind]
                for n, (x, y) in enumerate(zip(left, right)):
                    differ = sorted(
                        name for name in x.keys() | y.keys() if x.get(name, ("",))[0] != y.get(name, ("",))[0]
                    )
                    print(f"  {kind} #{n}: {len(differ)} details differ: {differ}")
                    for name in differ[:6]:
                        print(f"    {name}: {x.get(name, ('', ''))[1][:400]!r}")
                        print(f"    {' ' * len(name)}  {y.get(name, ('', ''))[1][:400]!r}")
                if len(left) != len(right):
                    print(f"  {kind}: {len(left)} keys against {len(right)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--bucket", type=float, default=1.0)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in sorted(args.folder.glob("probe-*.json")):
        summarise(path, args.bucket, args.top)
    hash_diff(args.folder)


if __name__ == "__main__":
    main()
