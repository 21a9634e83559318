"""letters_env: a small OpenEnv environment laid out like a third-party package (models, server, app).

Nothing here imports sao; sao trains on it with `env.name=openenv` (examples/openenv_letters/README.md).
"""

from letters_env.models import LetterAction, LetterObservation

__all__ = ["LetterAction", "LetterObservation"]
