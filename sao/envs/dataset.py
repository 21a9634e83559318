"""Task datasets on disk: JSONL, Parquet or a `datasets` folder -> a fixed train/held-out split of `Task`s.

An environment that reads its problems from a file subclasses `DatasetOptions` for its options and
calls `load_task_split(options)`:

    split = load_task_split(options)      # reads the file(s), checks every row, splits
    split.train_stream(seed)              # endless, reshuffled each epoch
    split.eval_tasks(n)                   # n held-out tasks, always the same ones

Which rows are held out, in order of precedence:
  1. `heldout_path`: a second file holds the held-out rows (a named split file);
  2. `split_field`: a column names each row's split (`train_split` / `heldout_split` values);
  3. a `datasets` folder saved from a `DatasetDict`: its splits named `train_split` / `heldout_split`;
  4. otherwise a hash with `data_seed` of each row's prompt (its id when `id_field` is set) holds
     out `heldout_fraction` of the rows.
The hash split depends on the row's content, not its position, so it survives reordering the file,
and duplicated prompts land on the same side (hashing by prompt). `data_seed` is not the run's `train.seed`: runs with
different training seeds share one held-out set.

Every bad input is one `ValueError` starting with `env.options.<field>:` and naming the file or
field (the CLI prints it and exits with code 2). Parquet (pyarrow) and `datasets` folders are
optional imports: a missing library is reported with the extra to install (`pip install sao[tasks]`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from sao.envs.splits import SplitOptions, is_heldout
from sao.types import Task

Rows = list[dict[str, Any]]
EXTRA = "pip install sao[tasks]"


class DatasetOptions(SplitOptions):  # heldout_fraction, data_seed: the hash split
    path: str | None = Field(None, description="tasks file: .jsonl, .parquet, or a folder saved by Dataset.save_to_disk")
    format: Literal["auto", "jsonl", "parquet", "datasets"] = Field(
        "auto", description="file format; auto: by suffix (.jsonl/.json, .parquet) or a folder for datasets")
    prompt_field: str = Field("prompt", min_length=1, description="column holding the problem text shown to the model")
    answer_field: str = Field("answer", min_length=1, description="column holding the reference answer")
    id_field: str | None = Field(None, description="column holding a task id (default: file stem and row number)")
    heldout_path: str | None = Field(None, description="a second file holding the held-out tasks (same format rules)")
    split_field: str | None = Field(None, description="column naming each row's split (see train_split, heldout_split)")
    train_split: str = Field("train", description="split name of training rows (split_field value or DatasetDict key)")
    heldout_split: str = Field("test", description="split name of held-out rows (split_field value or DatasetDict key)")
    limit: int | None = Field(None, ge=1, description="use only the first N rows of each file (quick experiments)")


@dataclass
class TaskSplit:
    """Training and held-out tasks; the held-out list is in a fixed order shuffled by `data_seed`."""

    train: list[Task]
    heldout: list[Task]

    def train_stream(self, seed: int) -> Iterator[Task]:
        """Endless stream over the training tasks, reshuffled every epoch."""
        rng = random.Random(seed)
        order = list(self.train)
        while True:
            rng.shuffle(order)
            yield from order

    def eval_tasks(self, n: int) -> list[Task]:
        """The first n held-out tasks, cycling when there are fewer (callers rely on getting n: the
        parity gate draws a fixed number); set `eval.num_tasks` to at most the held-out size."""
        return [self.heldout[i % len(self.heldout)] for i in range(n)]


def option_error(option: str, message: str) -> ValueError:
    """The error of a bad `env.options.<option>` (the CLI prints it on one line and exits with code 2)."""
    return ValueError(f"env.options.{option}: {message}")


def detect_format(path: Path, fmt: str, option: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "datasets"
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    raise option_error("format", f"cannot tell the format of {str(path)!r} from its suffix; set format to jsonl, parquet "
                                 f"or datasets (for {option})")


def read_jsonl(path: Path, option: str) -> Rows:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise option_error(option, f"{str(path)!r} line {n}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise option_error(option, f"{str(path)!r} line {n}: expected one JSON object per line")
            rows.append(row)
    return rows


def read_parquet(path: Path, option: str) -> Rows:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise option_error("format", f"reading Parquet ({str(path)!r}) needs pyarrow; {EXTRA}") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises its own error types for corrupt or non-Parquet files
        raise option_error(option, f"{str(path)!r} is not a readable Parquet file ({type(exc).__name__})") from None


def read_datasets_dir(path: Path, option: str) -> Rows | dict[str, Rows]:
    """A `Dataset` as rows, or a `DatasetDict` as {split name: rows}."""
    try:
        from datasets import Dataset, load_from_disk
    except ImportError:
        raise option_error("format", f"reading a datasets folder ({str(path)!r}) needs the datasets library; {EXTRA}") from None
    try:
        ds = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise option_error(option, f"{str(path)!r} is not a folder saved by Dataset.save_to_disk ({exc})") from None
    if isinstance(ds, Dataset):
        return ds.to_list()
    return {name: part.to_list() for name, part in ds.items()}


def read_rows(path_text: str, fmt: str, option: str, limit: int | None = None) -> Rows | dict[str, Rows]:
    """Rows of one file or folder (a dict of named splits for a saved DatasetDict)."""
    path = Path(path_text).expanduser()
    if not path.exists():
        raise option_error(option, f"{path_text!r} not found")
    kind = detect_format(path, fmt, option)
    if kind != "datasets" and path.is_dir():
        raise option_error(option, f"{path_text!r} is a folder, not a {kind} file")
    readers = {"jsonl": read_jsonl, "parquet": read_parquet, "datasets": read_datasets_dir}
    rows = readers[kind](path, option)
    if isinstance(rows, dict):
        return {name: part[:limit] for name, part in rows.items()}
    return rows[:limit]


def _field(row: dict[str, Any], name: str, option: str, where: str) -> Any:
    if name not in row:
        fields = ", ".join(sorted(map(str, row))[:12])
        raise option_error(option, f"field {name!r} not in {where} (fields: {fields})")
    value = row[name]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise option_error(option, f"field {name!r} is empty in {where}")
    return value


def rows_to_tasks(rows: Rows, options: DatasetOptions, source: str) -> list[Task]:
    """One `Task` per row; the first row missing a field is reported with the file and row number."""
    stem = Path(source).stem or "task"
    tasks = []
    for i, row in enumerate(rows):
        where = f"{source!r} row {i + 1}"
        prompt = _field(row, options.prompt_field, "prompt_field", where)
        if not isinstance(prompt, (str, int, float)):
            raise option_error("prompt_field", f"field {options.prompt_field!r} in {where} is a {type(prompt).__name__}, "
                                               "not text")
        answer = _field(row, options.answer_field, "answer_field", where)
        task_id = str(_field(row, options.id_field, "id_field", where)) if options.id_field else f"{stem}-{i}"
        tasks.append(Task(id=task_id, prompt=str(prompt), answer=answer, meta={"source": source, "row": i}))
    return tasks


def hash_split(tasks: list[Task], fraction: float, seed: int, by_id: bool = False) -> tuple[list[Task], list[Task]]:
    train, heldout = [], []
    for t in tasks:
        (heldout if is_heldout(t.id if by_id else t.prompt, fraction, seed) else train).append(t)
    return train, heldout


def _column_split(rows: Rows, options: DatasetOptions, source: str) -> tuple[Rows, Rows]:
    field = options.split_field
    seen: set[str] = set()
    parts: dict[str, Rows] = {options.train_split: [], options.heldout_split: []}
    for i, row in enumerate(rows):
        value = str(_field(row, field, "split_field", f"{source!r} row {i + 1}"))
        seen.add(value)
        parts.get(value, []).append(row)  # rows of other splits (e.g. validation) are left out
    for option, name in (("train_split", options.train_split), ("heldout_split", options.heldout_split)):
        if not parts[name]:
            raise option_error(option, f"no rows of {source!r} have {field}={name!r} (values: {', '.join(sorted(seen)[:12])})")
    return parts[options.train_split], parts[options.heldout_split]


def _named_split(parts: dict[str, Rows], options: DatasetOptions, source: str) -> tuple[Rows, Rows]:
    if options.split_field:
        raise option_error("split_field", f"{source!r} has named splits already ({', '.join(parts)}); "
                                          "use train_split and heldout_split")
    for option, name in (("train_split", options.train_split), ("heldout_split", options.heldout_split)):
        if name not in parts:
            raise option_error(option, f"split {name!r} not in {source!r} (splits: {', '.join(parts)})")
    return parts[options.train_split], parts[options.heldout_split]


def _single(rows: Rows | dict[str, Rows], split: str, source: str, option: str) -> Rows:
    """The rows of one file; from a `datasets` folder with named splits, those of `split`."""
    if isinstance(rows, dict):
        if split not in rows:
            raise option_error(option, f"split {split!r} not in {source!r} (splits: {', '.join(rows)})")
        return rows[split]
    return rows


def split_rows(options: DatasetOptions) -> tuple[list[Task], list[Task], str]:
    """(train, held-out, how) following the precedence in the module docstring."""
    source = options.path
    rows = read_rows(source, options.format, "path", options.limit)
    if options.heldout_path:
        held_rows = read_rows(options.heldout_path, options.format, "heldout_path", options.limit)
        train = rows_to_tasks(_single(rows, options.train_split, source, "path"), options, source)
        held_src = options.heldout_path
        held = _single(held_rows, options.heldout_split, held_src, "heldout_path")
        return train, rows_to_tasks(held, options, held_src), "file"
    if isinstance(rows, dict):
        train_rows, held_rows = _named_split(rows, options, source)
        return rows_to_tasks(train_rows, options, source), rows_to_tasks(held_rows, options, source), "named"
    if options.split_field:
        train_rows, held_rows = _column_split(rows, options, source)
        return rows_to_tasks(train_rows, options, source), rows_to_tasks(held_rows, options, source), "column"
    tasks = rows_to_tasks(rows, options, source)
    train, heldout = hash_split(tasks, options.heldout_fraction, options.data_seed, by_id=bool(options.id_field))
    return train, heldout, "hash"


def check_split(train: list[Task], heldout: list[Task], how: str, options: DatasetOptions) -> None:
    """Both sides must be non-empty: training needs tasks and evaluation divides by their number."""
    source, n_rows = options.path, len(train) + len(heldout)
    if not train and how == "hash" and n_rows:
        raise option_error("heldout_fraction", f"no training tasks left among the {n_rows} rows of {source!r}; "
                                               "lower heldout_fraction")
    if not train:
        raise option_error("path" if how in ("hash", "file") else "train_split",
                           f"{source!r} has no rows" if how in ("hash", "file") else
                           f"split {options.train_split!r} of {source!r} is empty")
    if heldout:
        return
    if how == "hash":
        raise option_error("heldout_fraction", f"no held-out tasks among the {n_rows} rows of {source!r}; "
                                               "raise heldout_fraction")
    if how == "file":
        raise option_error("heldout_path", f"{options.heldout_path!r} has no rows")
    raise option_error("heldout_split", f"split {options.heldout_split!r} of {source!r} is empty")


def load_task_split(options: DatasetOptions) -> TaskSplit:
    """Read, check and split the tasks named by `options`; held-out order fixed by `data_seed`."""
    if not options.path:
        raise option_error("path", "required: a .jsonl or .parquet file, or a folder saved by Dataset.save_to_disk")
    train, heldout, how = split_rows(options)
    check_split(train, heldout, how, options)
    heldout = list(heldout)
    random.Random(options.data_seed).shuffle(heldout)  # files are often sorted by difficulty
    return TaskSplit(train, heldout)
