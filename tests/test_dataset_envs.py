"""Task datasets (JSONL, Parquet, `datasets` folders), the fixed split, and the `math` environment."""

import importlib.util
import json
import random
import sys

import pytest

from sao.envs import make_environment
from sao.envs.dataset import DatasetOptions, is_heldout, load_task_split
from sao.envs.math_env import MathEnvironment, answers_match, extract_answer
from sao.types import Task

MATH = "sao.envs.math_env:MathEnvironment"
HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
HAS_RG = importlib.util.find_spec("reasoning_gym") is not None

ROWS = [{"uid": f"q{i}", "question": f"What is {i} + {i}?", "solution": str(2 * i), "part": "test" if i % 4 == 0
         else "train"} for i in range(200)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _split(**options):
    return load_task_split(DatasetOptions(**{"prompt_field": "question", "answer_field": "solution", **options}))


def test_jsonl_loads_tasks_with_configured_fields(tmp_path):
    split = _split(path=_jsonl(tmp_path / "tasks.jsonl", ROWS), id_field="uid")
    tasks = split.train + split.heldout
    assert len(tasks) == 200 and {t.id for t in tasks} == {r["uid"] for r in ROWS}
    by_id = {t.id: t for t in tasks}
    assert (by_id["q7"].prompt, by_id["q7"].answer) == ("What is 7 + 7?", "14")
    default_ids = _split(path=_jsonl(tmp_path / "tasks.jsonl", ROWS))
    assert {t.id for t in default_ids.train} <= {f"tasks-{i}" for i in range(200)}


@pytest.mark.parametrize("options, pattern", [
    ({"prompt_field": "problem"}, r"^env\.options\.prompt_field: field 'problem' not in '.*tasks\.jsonl' row 1 \("),
    ({"answer_field": "answer"}, r"^env\.options\.answer_field: field 'answer' not in .*row 1 \(fields: part, "),
    ({"id_field": "nope"}, r"^env\.options\.id_field: field 'nope' not in"),
    ({"split_field": "part", "heldout_split": "dev"}, r"^env\.options\.heldout_split: no rows of .* part='dev' "),
    ({"format": "parquet"}, r"^env\.options\.(path: '.*tasks\.jsonl' is not a readable Parquet|format: .*pip install)"),
])
def test_field_errors_name_the_option_and_file(tmp_path, options, pattern):
    path = _jsonl(tmp_path / "tasks.jsonl", ROWS)
    with pytest.raises(ValueError, match=pattern):
        _split(path=path, **options)


def test_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "solution": "2"}\n{"question": oops}\n')
    ok = _jsonl(tmp_path / "ok.jsonl", ROWS)
    cases = [
        ({"path": str(bad)}, r"^env\.options\.path: '.*bad\.jsonl' line 2: invalid JSON"),
        ({"path": str(tmp_path / "missing.jsonl")}, r"^env\.options\.path: '.*missing\.jsonl' not found$"),
        ({"path": ok, "heldout_path": "nope.jsonl"}, r"^env\.options\.heldout_path: 'nope\.jsonl' not found"),
        ({"path": str(tmp_path)}, r"^env\.options\.(path|format): .*(Dataset\.save_to_disk|pip install sao\[tasks\])"),
        ({}, r"^env\.options\.path: required"),
    ]
    (tmp_path / "data.csv").write_text("a,b\n")
    cases.append(({"path": str(tmp_path / "data.csv")}, r"^env\.options\.format: cannot tell the format of"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(ROWS[0]) + "\n")
    cases.append(({"path": str(empty)}, r"^env\.options\.heldout_fraction: no held-out tasks among the 1 rows"))
    for options, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as info:
            _split(**options)
        assert "\n" not in str(info.value)


def test_hash_split_is_fixed_disjoint_and_near_the_fraction(tmp_path):
    path = _jsonl(tmp_path / "tasks.jsonl", ROWS + ROWS[:50])  # 50 duplicated rows
    a, b = _split(path=path, heldout_fraction=0.25), _split(path=path, heldout_fraction=0.25)
    assert [t.prompt for t in a.heldout] == [t.prompt for t in b.heldout]  # fixed by data_seed
    assert not {t.prompt for t in a.train} & {t.prompt for t in a.heldout}  # duplicates stay on one side
    assert 0.15 < len({t.prompt for t in a.heldout}) / 200 < 0.35
    c = _split(path=path, heldout_fraction=0.25, data_seed=1)
    assert {t.prompt for t in c.heldout} != {t.prompt for t in a.heldout}
    reordered = _split(path=_jsonl(tmp_path / "rev.jsonl", ROWS[::-1]), heldout_fraction=0.25)
    assert {t.prompt for t in reordered.heldout} == {t.prompt for t in a.heldout}  # by content, not position
    assert is_heldout("x", 0.999, 0) and not is_heldout("x", 1e-9, 0)
    # the environment: eval tasks are the held-out ones whatever the run seed; training never sees them
    env0 = make_environment(MATH, {"path": path, "prompt_field": "question", "answer_field": "solution"}, seed=0)
    env5 = make_environment(MATH, {"path": path, "prompt_field": "question", "answer_field": "solution"}, seed=5)
    held = env0.eval_tasks(10)
    assert [t.id for t in held] == [t.id for t in env5.eval_tasks(10)]
    stream = env0.train_tasks()
    assert not {next(stream).prompt for _ in range(600)} & {t.prompt for t in env0.split.heldout}
    assert len(env0.eval_tasks(1000)) == 1000  # cycles when asked for more than the held-out set


def test_split_column_and_split_file(tmp_path):
    path = _jsonl(tmp_path / "tasks.jsonl", ROWS)
    col = _split(path=path, split_field="part")
    assert len(col.heldout) == 50 and len(col.train) == 150
    assert all(int(t.answer) % 8 == 0 for t in col.heldout)
    held_path = _jsonl(tmp_path / "held.jsonl", ROWS[:20])
    files = _split(path=_jsonl(tmp_path / "train.jsonl", ROWS[20:]), heldout_path=held_path)
    assert len(files.train) == 180 and {t.id for t in files.heldout} == {f"held-{i}" for i in range(20)}
    limited = _split(path=path, split_field="part", limit=40)
    assert len(limited.train) + len(limited.heldout) == 40


@pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow not installed (pip install sao[tasks])")
def test_parquet_matches_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "tasks.parquet")
    from_parquet = _split(path=str(tmp_path / "tasks.parquet"), id_field="uid")
    from_jsonl = _split(path=_jsonl(tmp_path / "tasks.jsonl", ROWS), id_field="uid")
    assert [(t.id, t.prompt, t.answer) for t in from_parquet.heldout] == \
        [(t.id, t.prompt, t.answer) for t in from_jsonl.heldout]
    with pytest.raises(ValueError, match=r"^env\.options\.answer_field: field 'answer' not in '.*tasks\.parquet' row 1"):
        _split(path=str(tmp_path / "tasks.parquet"), answer_field="answer")


@pytest.mark.skipif(not HAS_DATASETS, reason="datasets not installed (pip install sao[tasks])")
def test_datasets_folder_and_named_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "flat"))
    flat = _split(path=str(tmp_path / "flat"), split_field="part")
    assert (len(flat.train), len(flat.heldout)) == (150, 50)
    DatasetDict({"train": Dataset.from_list(ROWS[:150]), "validation": Dataset.from_list(ROWS[150:])}).save_to_disk(
        str(tmp_path / "dict"))
    named = _split(path=str(tmp_path / "dict"), heldout_split="validation")
    assert (len(named.train), len(named.heldout)) == (150, 50)
    with pytest.raises(ValueError, match=r"^env\.options\.heldout_split: split 'test' not in .*\(splits: train, valid"):
        _split(path=str(tmp_path / "dict"))
    # a held-out file saved as a DatasetDict: its heldout_split is read, not its train split
    DatasetDict({"test": Dataset.from_list(ROWS[150:])}).save_to_disk(str(tmp_path / "held"))
    files = _split(path=str(tmp_path / "dict"), heldout_path=str(tmp_path / "held"))
    assert (len(files.train), len(files.heldout)) == (150, 50)


def test_missing_optional_libraries_name_the_extra(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    (tmp_path / "dir").mkdir()
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    for path in ("t.parquet", "dir"):
        with pytest.raises(ValueError, match=r"^env\.options\.format: .* needs .*; pip install sao\[tasks\]$"):
            _split(path=str(tmp_path / path))
    with pytest.raises(ValueError, match=r"^env\.options\.source: .*reasoning-gym.*pip install sao\[tasks\]$"):
        make_environment(MATH, {"source": "reasoning_gym", "dataset": "chain_sum"}, seed=0)


def test_answer_extraction():
    assert extract_answer(r"so x = \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_answer(r"\boxed{1} then <answer> 2 </answer>") == "2"  # the last one counts
    assert extract_answer(r"<answer>2</answer> so \boxed{3}") == "3"
    assert extract_answer(r"\boxed{\sqrt{2} unbalanced") is None
    assert extract_answer("the answer is 4") is None


@pytest.mark.parametrize("pred, gold, ok", [
    ("1/2", "0.5", True), (r"\frac{1}{2}", "0.5", True), ("0.5", r"\frac{1}{2}", True), ("1/2", 0.5, True),
    ("1+x", "x+1", True), ("1,000", "1000", True), ("14", 14, True),
    ("0.6", "0.5", False), ("2", "-2", False), ("", "3", False), ("cab", "abc", False), ("Blue  whale", "blue whale", True),
])
def test_math_verify_equivalence(pred, gold, ok):
    assert answers_match(pred, gold) is ok


def test_math_episode_rewards_single_and_multi_turn(tmp_path):
    path = _jsonl(tmp_path / "tasks.jsonl", ROWS)
    opts = {"path": path, "prompt_field": "question", "answer_field": "solution"}
    env = make_environment(MATH, opts, seed=0)
    assert isinstance(env, MathEnvironment)
    task = Task("half", "What is 1/2 as a decimal?", "0.5")
    for reply, reward in [(r"It is \boxed{1/2}", 1.0), (r"\boxed{\frac{1}{2}}", 1.0), ("<answer>0.5</answer>", 1.0),
                          (r"\boxed{0.6}", 0.0), ("0.5", 0.0)]:  # no final-answer markup: no reward
        ep = env.new_episode(None)
        ep.reset(task)
        r = ep.step(reply)
        assert r.done and r.reward == reward, reply
    multi = make_environment(MATH, {**opts, "max_attempts": 3, "system_prompt": "Box the answer."}, seed=0)
    ep = multi.new_episode(None)
    assert ep.reset(task)[0] == {"role": "system", "content": "Box the answer."}
    first, second, third = ep.step("thinking..."), ep.step(r"\boxed{2}"), ep.step(r"\boxed{.5}")
    assert not first.done and "No final answer" in first.observation
    assert not second.done and second.observation.startswith("Incorrect")
    assert third.done and third.reward == 1.0 and third.info == {"correct": 1.0, "answered": 1.0, "attempts": 3}
    demo = env.demo(task, random.Random(0))
    assert demo[-1] == {"role": "assistant", "content": "<answer>0.5</answer>"}
    with pytest.raises(ValueError, match=r"^env\.options\.dataset: only used with source=reasoning_gym"):
        make_environment(MATH, {**opts, "dataset": "chain_sum"}, seed=0)


@pytest.mark.skipif(not HAS_RG, reason="reasoning-gym not installed (pip install sao[tasks])")
def test_reasoning_gym_source_uses_its_own_scorer():
    opts = {"source": "reasoning_gym", "dataset": "chain_sum", "size": 200, "dataset_config": {"max_terms": 3}}
    env = make_environment(MATH, opts, seed=0)
    held = env.eval_tasks(5)
    assert [t.id for t in held] == [t.id for t in make_environment(MATH, opts, seed=9).eval_tasks(5)]
    stream = env.train_tasks()
    assert not {next(stream).id for _ in range(400)} & {t.id for t in env.split.heldout}
    ep = env.new_episode(None)
    ep.reset(held[0])
    assert ep.step(f"<answer>{held[0].answer}</answer>").reward == 1.0
    ep.reset(held[0])
    assert ep.step(f"<answer>{int(held[0].answer) + 1}</answer>").reward == 0.0
    for bad, pattern in [({"dataset": "nope"}, r"^env\.options\.dataset: unknown reasoning-gym dataset 'nope'"),
                         ({"dataset_config": {"colour": 1}}, r"^env\.options\.dataset_config: .*colour"),
                         ({"dataset": None}, r"^env\.options\.dataset: required")]:
        with pytest.raises(ValueError, match=pattern):
            make_environment(MATH, {**opts, **bad}, seed=0)


def test_cli_reports_a_bad_field_with_exit_code_2(tmp_path, sao_cli):
    path = _jsonl(tmp_path / "tasks.jsonl", ROWS)
    proc = sao_cli("train", f"env.name={MATH}", f"env.options.path={path}", "env.options.prompt_field=problem",
                   "output.root=runs", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"sao: error: env.options.prompt_field: field 'problem' not in {path!r} row 1 "
        "(fields: part, question, solution, uid)"]
    assert not (tmp_path / "runs").exists()


def test_distinct_tasks_dedupes_and_repeats_a_small_pool_evenly():
    from itertools import cycle

    from sao.envs.splits import distinct_tasks
    from sao.types import Task

    pool = [Task(id=f"t{i}", prompt=p) for i, p in enumerate("abcab")]
    got = distinct_tasks(iter(cycle(pool)), 3)
    assert [t.prompt for t in got] == ["a", "b", "c"]
    got = distinct_tasks(iter(cycle(pool)), 7, patience=50)  # only 3 exist: each twice or three times
    assert [t.prompt for t in got] == list("abcabca") and len({t.id for t in got}) == 3
