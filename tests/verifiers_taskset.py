"""A verifiers taskset of one task, whose prompt and answer come from `vf-eval`'s command
line (`--env.taskset.prompt`, `--env.taskset.answer`): the data half of an environment,
which is all a verifiers user writes. `vf-eval verifiers_taskset ...` imports it by name
(on PYTHONPATH) in verifiers' own environment (requirements/verifiers.txt); see
test_verifiers in tests/test_harnesses_python.py."""

import verifiers.v1 as vf


class PromptConfig(vf.TasksetConfig):
    prompt: str = ""
    answer: str = ""


class AnswerData(vf.TaskData):
    answer: str = ""


class AnswerTask(vf.Task[AnswerData]):
    @vf.reward
    async def correct(self, task: AnswerData, trace) -> float:
        return float(task.answer in trace.last_reply)


class PromptTaskset(vf.Taskset[AnswerTask, PromptConfig]):
    def load(self):
        yield AnswerTask(AnswerData(prompt=self.config.prompt, answer=self.config.answer))


__all__ = ["PromptTaskset"]
