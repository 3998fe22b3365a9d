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


class _Tokenizer:
    """Adds a BOS (id 1) in front unless told not to, as Llama-3's post-processor does."""

    def __call__(self, text, add_special_tokens=True):
        ids = [len(word) + 10 for word in text.split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_a_templated_prompt_gets_no_second_bos():
    from types import SimpleNamespace

    from epilora_rl.tasks import Prompt

    chat = SimpleNamespace(chat_template="...", apply_chat_template=lambda messages, **kw:
                           "<bos> user: " + messages[0]["content"])
    task = make_task("basic_arithmetic", chat, seed=0, options=OPTIONS)
    assert task.prompt(0).templated and task.prompt(0).text.startswith("<bos> user: ")
    assert not _task().prompt(0).templated  # no chat template: the tokenizer's own BOS

    templated = Prompt("<bos> user: two plus two", "4", {}, templated=True)
    plain = Prompt("two plus two", "4", {})
    assert templated.token_ids(_Tokenizer()) == [15, 15, 13, 14, 13]  # the template's BOS only
    assert plain.token_ids(_Tokenizer())[0] == 1


def test_no_two_samples_of_a_call_share_a_seed():
    # vLLM seeds a prompt's k-th sample `seed + k`: prompt i must start at seed + i * n.
    from types import SimpleNamespace

    from epilora_rl.engine import generate
    from epilora_rl.tasks import Prompt

    seen = []

    class Llm:
        def generate(self, prompts, params, lora_request=None, use_tqdm=False):
            seen.extend(params)
            return [SimpleNamespace(outputs=[]) for _ in prompts]

    prompts = [Prompt(f"prompt {i}", None, {}) for i in range(3)]
    generate(Llm(), _Tokenizer(), prompts, None, n=4, max_tokens=2, temperature=1.0, seed=100)
    starts = [p.seed for p in seen]
    assert starts == [100, 104, 108]
    streams = [start + k for start in starts for k in range(4)]
    assert len(set(streams)) == len(streams)
