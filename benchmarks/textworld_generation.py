"""TextWorld game generation with one process against several (sao/envs/textworld_games.py), paired and
alternating: wall seconds per game, the ratio, and whether the entries are the same bytes.

    python benchmarks/textworld_generation.py [--length 5] [--games 128] [--workers 2] [--repeats 3] [--out FILE]

The worlds are those of the `sao bench horizon` variant of that quest length; `--games` is split 3:1 into
training and held-out games. Writes `--out` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from sao.envs.textworld_env import TextWorldOptions
from sao.envs.textworld_games import _generate_all

WORLDS = {2: (2, 3), 5: (4, 6), 10: (6, 10)}  # quest length -> (world_size, nb_objects), as the horizon preset


def once(options: TextWorldOptions, workers: int) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        rows = _generate_all(options, Path(tmp), log=lambda message: None, workers=workers)
        return time.perf_counter() - t0, json.dumps(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, choices=sorted(WORLDS), default=5)
    ap.add_argument("--games", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/textworld_generation.json")
    args = ap.parse_args()
    size, objects = WORLDS[args.length]
    options = TextWorldOptions(quest_length=args.length, world_size=size, nb_objects=objects,
                               num_train_games=args.games - args.games // 4, num_heldout_games=args.games // 4)
    one, many, same = [], [], True
    for i in range(args.repeats):
        print(f"repeat {i + 1}/{args.repeats}: 1 process, then {args.workers}", flush=True)
        t1, a = once(options, 1)
        tn, b = once(options, args.workers)
        one.append(t1)
        many.append(tn)
        same = same and a == b
    ratios = [m / o for m, o in zip(many, one)]
    res = {"length": args.length, "games": args.games, "workers": args.workers, "one_process_s": one,
           f"{args.workers}_processes_s": many, "ratio_median": statistics.median(ratios),
           "s_per_game_one": statistics.median(one) / args.games,
           "s_per_game_many": statistics.median(many) / args.games, "same_entry": same}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"| length | games | 1 process s (median) | {args.workers} processes s (median) | ratio (median) | same entry |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.length} | {args.games} | {statistics.median(one):.1f} | {statistics.median(many):.1f} | "
          f"{res['ratio_median']:.2f} | {same} |")


if __name__ == "__main__":
    main()
