"""How often the starting policy wins TextWorld quests of each length before any RL (a long-horizon comparison needs
a starting policy that sometimes wins), and which settings move that.

    python benchmarks/horizon_start.py [--lengths 2 5 10] [--games 128] [--setting copy] [--out FILE] [KEY=VALUE ...]

Per length: the SFT warm start `sao train` would build for that setting (the same worlds as the `sao bench
horizon` variants of that length), then the win rate on `--games` held-out games (sampled at temperature 1, as
the bench's evaluations) with a 95% bootstrap interval over games. Settings, each on top of the last named:
  preset      the horizon preset of 2026-12-03: the goal is the walkthrough's last command (exploration), 9
              numbered commands, a turn budget of quest_length + 2, the char-level model, 128 training games
  listed24    every admissible command numbered (max_commands=24: at 5 and 10 commands 12% and 20% of the
              walkthrough steps were beyond the 9 listed, so most games could not be won by number) and a
              turn budget of twice the shortest solution
  wide        listed24 with observations of 240 characters (120 cut the exits of busy rooms) and twice the
              SFT steps
  bpe         listed24 with the BPE tokenizer learned from the demonstrations (model.tokenizer=bpe)
  steps       bpe with the goal listing the walkthrough's commands (env.options.goal=steps)
  copy        the horizon preset now: steps with the commands hidden (the model says each command, reading it
              off the goal), 2048 training games, 1500 SFT steps of 16
  *_deep      bpe, steps or copy with a 4-layer, 128-wide model (bpe_deep and steps_deep: 600 SFT steps of 16)
Writes `--out` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["env.name=textworld", "env.options.rewards=sparse", "env.options.num_train_games=128",
          "env.options.observation_chars=120", "env.options.max_items=4", "env.options.commands=numbered",
          "rollout.max_action_tokens=8", "sft.batch_size=16", "train.seed=0"]
WORLDS = {2: ["env.options.world_size=2", "env.options.nb_objects=3", "sft.steps=300"],
          5: ["env.options.world_size=4", "env.options.nb_objects=6", "sft.steps=300", "sft.batch_size=8"],
          10: ["env.options.world_size=6", "env.options.nb_objects=10", "sft.steps=100", "sft.batch_size=8"]}
CONTEXT = {2: 1280, 5: 2304, 10: 4096}  # the preset's episode and model lengths at quest_length + 2 turns


def setting_overrides(setting: str, q: int) -> list[str]:
    if setting == "preset":
        turns, tokens, extra = q + 2, CONTEXT[q], []
    elif setting in ("listed24", "wide"):
        turns, extra = 2 * q, ["env.options.max_commands=24"]
        tokens = {2: 1280, 5: 3584, 10: 7168}[q]  # the longer budget's episodes (the commands list is longer too)
        if setting == "wide":
            steps = int(next(o for o in WORLDS[q] if o.startswith("sft.steps=")).split("=")[1])
            extra += ["env.options.observation_chars=240", f"sft.steps={2 * steps}"]
            tokens = {2: 1792, 5: 5120, 10: 10240}[q]
    elif setting in ("bpe", "bpe_deep", "steps", "steps_deep"):
        turns, extra = 2 * q, ["env.options.max_commands=24", "model.tokenizer=bpe"]
        tokens = {2: 640, 5: 1536, 10: 3072}[q]  # listed24's episodes in BPE tokens (~3.7x fewer than characters)
        if setting.startswith("steps"):
            extra += ["env.options.goal=steps"]
        if setting.endswith("_deep"):
            extra += ["model.num_layers=4", "model.hidden_size=128", "model.num_heads=4", "model.intermediate_size=384",
                      "sft.steps=600", "sft.batch_size=16"]
    elif setting in ("copy", "copy_deep"):
        # the model says each command itself (no list), reading it off the goal's steps
        turns, tokens = 2 * q, {2: 384, 5: 768, 10: 1536}[q]
        extra = ["model.tokenizer=bpe", "env.options.goal=steps", "env.options.commands=hidden",
                 "rollout.max_action_tokens=16", "env.options.num_train_games=2048", "sft.steps=1500",
                 "sft.batch_size=16"]
        if setting.endswith("_deep"):
            extra += ["model.num_layers=4", "model.hidden_size=128", "model.num_heads=4", "model.intermediate_size=384"]
    else:
        raise SystemExit(f"--setting: unknown {setting!r} (preset, listed24, wide, bpe, bpe_deep, steps, steps_deep, "
                         "copy, copy_deep)")
    return [*COMMON, *WORLDS[q], f"env.options.quest_length={q}", f"rollout.max_turns={turns}",
            f"rollout.max_episode_tokens={tokens}", f"model.max_positions={tokens}", *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2, 5, 10])
    ap.add_argument("--games", type=int, default=128)
    ap.add_argument("--setting", default="copy")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="dotted overrides on top of the setting's (e.g. sft.steps=1500)")
    args = ap.parse_args()

    from sao.api import as_config, evaluate
    from sao.bench.analysis import bootstrap
    from sao.models.quiet import quiet_transformers
    from sao.runtime.model_setup import prepare_base_model

    quiet_transformers()
    rows = []
    for q in args.lengths:
        overrides = [*setting_overrides(args.setting, q), *args.overrides, f"env.options.num_heldout_games={args.games}",
                     f"eval.num_tasks={args.games}"]
        cfg = as_config(None, overrides)
        t0 = time.perf_counter()
        model, _ = prepare_base_model(cfg)
        sft_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = evaluate(model, *overrides, threads=2)
        wins = round(res["accuracy"] * res["n"])
        games = [1.0] * wins + [0.0] * (res["n"] - wins)
        mean, lo, hi = bootstrap([games])
        rows.append({"quest_length": q, "setting": args.setting, "games": res["n"], "wins": wins, "win_rate": mean,
                     "ci95": [lo, hi], "statuses": res["statuses"], "sft_s": round(sft_s, 1),
                     "eval_s": round(time.perf_counter() - t0, 1), "overrides": overrides,
                     "invalid_commands_mean": res.get("invalid_commands")})
        print(f"q{q} {args.setting}: {wins}/{res['n']} won = {mean:.3f} [{lo:.3f}, {hi:.3f}]", flush=True)
    print("\n| length | setting | held-out games | won | win rate [95% interval] |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['quest_length']} | {r['setting']} | {r['games']} | {r['wins']} | {r['win_rate']:.3f} "
              f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] |")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
