"""A single-turn verifiers environment: write a reply with many letters "a".

The reward is graded (the share of "a" in the reply), so even a random policy gets rewards that differ,
and a policy can learn it in a few hundred steps.
"""

import verifiers.v1 as vf

WORDS = ["apple", "banana", "cat", "dog", "egg", "fig", "grape", "hat", "ink", "jam", "kiwi", "lamp", "map", "nut",
         "oak", "pan", "quilt", "rat", "sand", "tap", "urn", "van", "wax", "yak", "zap", "ant", "bat", "cap"]


class LettersData(vf.TaskData):
    word: str


class LettersTask(vf.Task[LettersData]):
    @vf.stop
    async def one_reply(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def share_of_a(self, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        return reply.count("a") / max(len(reply), 1)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class LettersConfig(vf.TasksetConfig):
    repeat: int = 2  # each word this many times (distinct prompts)


class LettersTaskset(vf.Taskset[LettersTask, LettersConfig]):
    def load(self):
        return [LettersTask(LettersData(prompt=f"Say something about {w} #{k}, with many letters a.", word=w,
                                        system_prompt="Be brief."), self.config.task)
                for k in range(self.config.repeat) for w in WORDS]


__all__ = ["LettersTaskset"]
