"""Tasks with a verifiable reward: prompts, and a score for each completion.

`basic_arithmetic` and every other reasoning-gym dataset (`reasoning_gym.create_dataset`): the
answer is read from the completion's first line, whole (`answer = "first_line"`) or its last
number (`"last_number"`: "2 + 5 = 7" answers 7, as small models write sums), and scored by the
dataset's own `score_answer` (1 for the exact answer). `even_tokens`: the share of completion
tokens with even ids, a signal any model can learn in a few steps, for smoke tests of the loop
(no reasoning in it).

Prompt i of a task is the same for every run with the same seed: a run's data position is
all it needs to resume.
"""

import re
from dataclasses import dataclass
from typing import Protocol

ANSWER_FORMATS = ("first_line", "last_number")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Prompt:
    text: str  # what the model sees (after the chat template, when the tokenizer has one)
    answer: str | None  # the reference answer, or None where the reward needs none
    entry: dict  # the task's own record of it
    # Whether `text` came from the chat template, which writes the special tokens it wants
    # (Llama-3's its BOS): then tokenized without the tokenizer's own, as TRL and vLLM's chat
    # API do, else a second BOS.
    templated: bool = False

    def token_ids(self, tokenizer) -> list[int]:
        """The prompt's tokens, as the engine and the trainer both take them."""
        return tokenizer(self.text, add_special_tokens=not self.templated)["input_ids"]


class Task(Protocol):
    def prompt(self, index: int) -> Prompt: ...

    def reward(self, completion_text: str, completion_ids: list[int], prompt: Prompt) -> float: ...


class ReasoningGymTask:
    """A reasoning-gym dataset; index i below `eval_offset` is training data, the rest held out
    (another seed's draws)."""

    def __init__(self, name: str, tokenizer, *, seed: int, options: dict | None = None,
                 answer: str = "first_line"):
        import reasoning_gym

        if answer not in ANSWER_FORMATS:
            raise ValueError(f"answer = {answer!r}: one of {ANSWER_FORMATS}")
        self.name, self.tokenizer, self.seed, self.answer = name, tokenizer, seed, answer
        size = 100_000
        self._make = lambda s: reasoning_gym.create_dataset(name, seed=s, size=size,
                                                            **(options or {}))
        # reasoning-gym draws item i of seed s from Random(s + i): seeds spaced wider than two
        # datasets give every run seed its own training and held-out prompts.
        base = seed * (2 * size + 3)
        self._train, self._eval = self._make(base), self._make(base + size + 1)

    def prompt(self, index: int, *, held_out: bool = False) -> Prompt:
        data = self._eval if held_out else self._train
        entry = data[index % len(data)]
        question = entry["question"] + "\nGive only the final answer."
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        if templated:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False,
                add_generation_prompt=True)
        else:
            text = question + "\nAnswer: "
        return Prompt(text, entry["answer"], entry, templated)

    def reward(self, completion_text: str, completion_ids: list[int], prompt: Prompt) -> float:
        lines = completion_text.strip().splitlines()
        answer = lines[0].strip() if lines else ""
        if self.answer == "last_number":
            numbers = _NUMBER.findall(answer)
            answer = numbers[-1] if numbers else ""
        return float(self._train.score_answer(answer, prompt.entry))


class EvenTokensTask:
    """Smoke-test task: fixed word prompts, reward = the share of even token ids."""

    def __init__(self, tokenizer, *, seed: int, options: dict | None = None):
        self.tokenizer, self.seed = tokenizer, seed

    def prompt(self, index: int, *, held_out: bool = False) -> Prompt:
        words = " ".join(f"w{3 + (7 * index + 3 * j + (500 if held_out else 0)) % 400}"
                         for j in range(4))
        return Prompt(words, None, {"index": index})

    def reward(self, completion_text: str, completion_ids: list[int], prompt: Prompt) -> float:
        if not completion_ids:
            return 0.0
        return sum(1 for t in completion_ids if t % 2 == 0) / len(completion_ids)


def make_task(name: str, tokenizer, *, seed: int, options: dict | None = None,
              answer: str = "first_line") -> Task:
    if name == "even_tokens":
        return EvenTokensTask(tokenizer, seed=seed, options=options)
    return ReasoningGymTask(name, tokenizer, seed=seed, options=options, answer=answer)
