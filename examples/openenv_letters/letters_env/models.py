"""The Action and Observation of letters_env (pydantic models, as OpenEnv requires)."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class LetterAction(Action):
    text: str = Field(..., max_length=2000, description="one line of text")


class LetterObservation(Observation):
    prompt: str = Field("", description="the instruction, repeated every round")
    feedback: str = Field("", description="how the last line scored")
