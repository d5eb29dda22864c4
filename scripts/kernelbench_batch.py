"""Cut KernelBench into batches for `kernelpilot suite`, in an order nobody chose (a script, not a test).

The problems of the levels given are shuffled with a fixed seed, so every batch is an unbiased sample and the
batches together cover every problem once. Batch K's files are copied into OUT/levelN/ (KernelBench's own names),
ready for `kernelpilot suite OUT`. `--list` prints the batches instead. Never copy the output into the repository:
KernelBench's files stay in an ignored folder.

    python3 scripts/kernelbench_batch.py KB/KernelBench --levels 1 2 --size 16 --batch 0 --out /tmp/kb-batch0
    python3 scripts/kernelbench_batch.py KB/KernelBench --levels 1 2 --size 16 --list
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path

# The order of a shuffle is part of a published figure: keep this seed so later batches continue the same sample.
SEED = 20261128


def all_problems(root: Path, levels: list[int]) -> list[Path]:
    found = []
    for level in levels:
        folder = root / f"level{level}"
        if not folder.is_dir():
            raise SystemExit(f"{folder} is not a folder: pass KernelBench's root (the folder holding level1, level2...).")
        found += sorted(path for path in folder.glob("*.py") if not path.name.startswith("_"))
    return found


def batches(problems: list[Path], size: int, seed: int) -> list[list[Path]]:
    order = list(problems)
    random.Random(seed).shuffle(order)
    return [order[start:start + size] for start in range(0, len(order), size)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="KernelBench's problem root (holds level1, level2, ...)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--size", type=int, default=16, help="problems per batch")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--batch", type=int, nargs="+", default=[], help="the batches to copy")
    parser.add_argument("--out", type=Path, help="folder to copy the batches' problems into (must not exist)")
    parser.add_argument("--list", action="store_true", help="print every batch's problems")
    args = parser.parse_args(argv)

    cut = batches(all_problems(args.root, args.levels), args.size, args.seed)
    if args.list:
        for index, batch in enumerate(cut):
            print(f"batch {index}: " + " ".join(f"{path.parent.name}/{path.name}" for path in batch))
        return 0
    if not args.batch or args.out is None:
        parser.error("give --batch K and --out FOLDER, or --list")
    if args.out.exists():
        parser.error(f"{args.out} exists: give a new folder, so that no earlier problem is mixed in")
    wrong = [k for k in args.batch if not 0 <= k < len(cut)]
    if wrong:
        parser.error(f"there are {len(cut)} batches (0..{len(cut) - 1}); no batch {wrong[0]}")
    for k in args.batch:
        for path in cut[k]:
            target = args.out / path.parent.name / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    print(f"{sum(len(cut[k]) for k in args.batch)} problems of batch(es) {args.batch} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
