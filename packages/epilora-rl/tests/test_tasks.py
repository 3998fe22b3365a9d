"""Tasks: reasoning-gym's prompts by index, and the reward read from a completion."""

import pytest

from epilora_rl.tasks import make_task

OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
           "operators": ["+"], "allow_parentheses": False, "allow_negation": False}


def _task(answer="first_line", seed=0):
    return make_task("basic_arithmetic", None, seed=seed, options=OPTIONS, answer=answer)


def test_prompts_follow_the_index_and_held_out_ones_differ():
    a, b = _task(), _task()
    assert [a.prompt(i).text for i in range(8)] == [b.prompt(i).text for i in range(8)]
    train = {a.prompt(i).text for i in range(16)}
    held_out = {a.prompt(i, held_out=True).text for i in range(16)}
    assert len(train) > 8 and train != held_out
    # Another run seed draws other items (reasoning-gym seeds item i with seed + i: no shift).
    other = _task(seed=1)
    entries = [a.prompt(i).entry["metadata"]["source_index"] for i in range(4)]
    assert entries == [0, 1, 2, 3]
    draws = {(a.prompt(i).text, a.prompt(i + 1).text) for i in range(32)}
    assert not draws & {(other.prompt(i).text, other.prompt(i + 1).text) for i in range(32)}


@pytest.mark.parametrize("answer, text, reward", [
    ("first_line", "{c}\nbecause", 1.0),
    ("first_line", "{a} + {b} = {c}", None),  # the whole line is not the number
    ("last_number", "{a} + {b} = {c}", 1.0),
    ("last_number", "{a} + {b} = {c}.\nThen 3", 1.0),
    ("last_number", "{a} + {b} = {wrong}", None),
    ("last_number", "no number here", None),
    ("last_number", "", None),
])
def test_reward_reads_the_answer_where_the_format_says(answer, text, reward):
    task = _task(answer)
    prompt = task.prompt(3)
    a, b = (int(t) for t in prompt.entry["metadata"]["expression"].split(" + "))
    assert prompt.answer == str(a + b)
    completion = text.format(a=a, b=b, c=a + b, wrong=a + b + 1)
    got = task.reward(completion, [], prompt)
    if reward is None:
        assert got < 1.0
    else:
        assert got == reward


def test_an_unknown_answer_format_is_refused():
    with pytest.raises(ValueError, match="answer = 'middle'"):
        _task("middle")
