"""A scripted policy for letters_env's demonstrations (`env.options.demo=letters_policy:reply`).

Plain Python, no sao import: sao runs it in process to make SFT examples that teach the built-in tiny
model the reply format (a short line, then end of turn); RL then learns which letter to repeat.
"""

import random
import re


def reply(observation: str, rng: random.Random) -> str:
    """Half the time the right letter, else a random one; 1-6 characters."""
    asked = re.search(r"letter '(\w)'", observation)
    letter = asked.group(1) if asked and rng.random() < 0.5 else rng.choice("aeiost")
    return letter * rng.randint(1, 6)
