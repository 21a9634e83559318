"""Launch `sao train` on the example `word` environment registered by a short name.

    python -m examples.word_env.train_word train.steps=50 [more key=value overrides]

The registration runs at import time on purpose: the `local` backend's rollout process (forked from
a fork server, sao/runtime/local.py) re-imports this module (as `__mp_main__`, skipping the `__main__` block) and must see it too.
"""

import sys

from examples.word_env.word_env import WordEnvironment
from sao.cli import main
from sao.envs import register_environment

register_environment("word", WordEnvironment)

if __name__ == "__main__":
    raise SystemExit(main(["train", "env.name=word", *sys.argv[1:]]))
