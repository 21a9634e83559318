"""`harbor`: train on Harbor tasks (a task is a folder: instruction.md, task.toml, environment/, tests/test.sh).

    env.options.path = tasks/            one Harbor task folder, or a folder of them (a Harbor dataset)
    env.options.agent = loop | command   sao's own loop, or an agent program through the endpoint

The task format is read here (task.toml with the standard library's tomllib; tomli on 3.10): the `harbor` package needs
Python >= 3.12 and runs every task in a container (Docker, Daytona, Modal...); it has no local environment.
sao runs each task in its own sandbox instead (sao/sandbox/shell.py): the workspace is /app, holding the
files of the task's environment/ folder (a Dockerfile is not built: the commands run on this machine's /usr,
read-only); every shell command and the verifier run sandboxed, never on the host unconfined. The
verifier is the task's own: `bash /tests/test.sh` in /app with tests/ at /tests, then its
/logs/verifier/reward.json (a flat object of numbers; its `reward`, or its only value) or reward.txt (one
number) is the episode's reward, as Harbor reads them. A verifier that writes neither ends the episode as
`env_error` (Harbor records the same as a failed trial).

agent=loop: the model runs one shell command per reply in <bash>...</bash>; the command's output (capped)
is the next observation; a reply with <submit> (or none with a command), or `max_commands` commands, ends
the episode and the verifier runs on the workspace as the model left it.
agent=command: `command` runs once per episode in the sandbox, in /app, with network (to reach the
episode's endpoint: OPENAI_BASE_URL, OPENAI_API_KEY; SAO_TASK holds the task as JSON) and the files of
`command_dir` at /agent; then the verifier runs on the workspace it left. The sandbox holds the machine's
base Python without sao's virtual environment: such an agent uses the standard library (urllib) or curl.
"""

from __future__ import annotations

import io
import json
import math
import random
import re
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from sao.envs.agent import AgentEpisode, EndpointOptions
from sao.envs.base import EpisodeContext, StepResult, register_environment
from sao.envs.splits import SplitOptions, is_heldout
from sao.types import Task

SYSTEM = ("You are in a Linux shell; your working directory is /app. Run one shell command per reply, as "
          "<bash>command</bash>; you will see its output. When the task is done, reply <submit>.")
_BASH = re.compile(r"<bash>(.*?)</bash>", re.S)
_BUILD_FILES = {"Dockerfile", "docker-compose.yaml", "docker-compose.yml"}


class HarborOptions(SplitOptions, EndpointOptions):
    path: str = Field(..., min_length=1, description="a Harbor task folder, or a folder of task folders (a dataset)")
    agent: Literal["loop", "command"] = Field("loop", description=(
        "loop: sao's own loop, one <bash>command</bash> per reply; command: `command` runs in the sandbox against "
        "the episode's endpoint"))
    command: str | None = Field(None, description=(
        "agent=command: a shell command run once per episode in the sandbox, in /app, with OPENAI_BASE_URL, "
        "OPENAI_API_KEY and SAO_TASK set and network on"))
    command_dir: str | None = Field(None, description="agent=command: a folder whose files the command finds at /agent")
    max_commands: int = Field(8, ge=1, description="agent=loop: shell commands per episode before the verifier runs")
    command_timeout_s: float = Field(30.0, gt=0, description="agent=loop: one command's time limit")
    output_chars: int = Field(2000, ge=100, description="agent=loop: a command's output shown to the model, at most")
    verifier_timeout_s: float = Field(600.0, gt=0, description=(
        "the verifier's time limit at most (a task's [verifier] timeout_sec, when lower, applies)"))
    memory_mb: int = Field(1024, ge=64, description="memory of one sandboxed run (a command, the agent, the verifier)")
    max_workspace_kb: int = Field(512, ge=16, description="the workspace (/app, compressed) kept between commands")

    @model_validator(mode="after")
    def _command(self) -> HarborOptions:
        if (self.agent == "command") != (self.command is not None):
            raise ValueError("give command exactly when agent=command")
        return self


class HarborError(RuntimeError):
    """The task's own machinery failed (its verifier wrote no reward): the episode is env_error."""


@dataclass
class HarborTask:
    name: str
    folder: Path
    instruction: str
    verifier_timeout_s: float
    agent_timeout_s: float | None
    env: dict[str, str]
    verifier_env: dict[str, str]
    workspace: bytes  # environment/'s files (not its build files), tar.gz
    tests: dict[str, bytes] = field(default_factory=dict)  # /tests/<relative path> -> content


def _not_a_task(folder: Path, why: str) -> ValueError:
    return ValueError(f"env.options.path: {folder} is not a Harbor task: {why}")


def _strip_canary(text: str) -> str:
    lines = text.splitlines()
    while lines and "canary" in lines[0].lower() and lines[0].lstrip().startswith(("<!--", "#")):
        lines.pop(0)
    while lines and not lines[0].strip():
        lines.pop(0)
    return "\n".join(lines).strip()


def _tar(folder: Path, skip: set[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        if folder.is_dir():
            for p in sorted(folder.rglob("*")):
                if p.is_file() and p.relative_to(folder).parts[0] not in skip:
                    t.add(p, arcname=str(p.relative_to(folder)))
    return buf.getvalue()


def _toml():
    try:
        import tomllib
    except ImportError:  # Python 3.10: the harbor extra brings tomli
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("env.name=harbor on Python 3.10 needs tomli: pip install -e '.[harbor]'") from None
    return tomllib


def read_task(folder: Path) -> HarborTask:
    """One task folder, checked as Harbor checks it (task.toml, instruction.md, tests/test.sh; single-step, linux)."""
    tomllib = _toml()
    if not (folder / "task.toml").is_file():
        raise _not_a_task(folder, "no task.toml")
    try:
        config = tomllib.loads((folder / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise _not_a_task(folder, f"task.toml: {exc}") from None
    if not (folder / "instruction.md").is_file():
        raise _not_a_task(folder, "no instruction.md")
    if config.get("steps"):
        raise _not_a_task(folder, "a multi-step task ([[steps]]); sao runs single-step tasks")
    environment, verifier, agent = (config.get(k) or {} for k in ("environment", "verifier", "agent"))
    if not all(isinstance(s, dict) for s in (environment, verifier, agent)):
        raise _not_a_task(folder, "task.toml: [environment], [verifier] and [agent] must be tables")
    if environment.get("os", "linux") != "linux":
        raise _not_a_task(folder, f"environment.os={environment.get('os')!r}; sao runs linux tasks")
    if not (folder / "tests" / "test.sh").is_file():
        raise _not_a_task(folder, "no tests/test.sh (sao runs the verifier from the task's tests/)")
    try:
        verifier_timeout = float(verifier.get("timeout_sec", 600.0))
        agent_timeout = agent.get("timeout_sec")
        agent_timeout = None if agent_timeout is None else float(agent_timeout)
    except (TypeError, ValueError):
        raise _not_a_task(folder, "task.toml: timeout_sec must be a number") from None
    name = (config.get("task") or {}).get("name") or folder.name
    tests = {f"/tests/{p.relative_to(folder / 'tests')}": p.read_bytes()
             for p in sorted((folder / "tests").rglob("*")) if p.is_file()}
    return HarborTask(str(name), folder, _strip_canary((folder / "instruction.md").read_text()), verifier_timeout,
                      agent_timeout, {str(k): str(v) for k, v in (environment.get("env") or {}).items()},
                      {str(k): str(v) for k, v in (verifier.get("env") or {}).items()},
                      _tar(folder / "environment", _BUILD_FILES), tests)


def read_tasks(path: Path) -> list[HarborTask]:
    if not path.is_dir():
        raise ValueError(f"env.options.path: {path} is not a folder")
    if (path / "task.toml").is_file():
        return [read_task(path)]
    tasks = [read_task(d) for d in sorted(path.iterdir()) if d.is_dir() and (d / "task.toml").is_file()]
    if not tasks:
        raise ValueError(f"env.options.path: no Harbor task in {path} (a task is a folder with task.toml, "
                         "instruction.md and tests/test.sh)")
    return tasks


def reward_from(files: dict[str, bytes]) -> tuple[float, dict[str, float]]:
    """Harbor's reading: reward.json (a flat object of finite numbers) first, else reward.txt (one number)."""
    if "/logs/verifier/reward.json" in files:
        try:
            rewards = json.loads(files["/logs/verifier/reward.json"])
        except ValueError:
            raise HarborError("the verifier's reward.json is not JSON") from None
        if not isinstance(rewards, dict) or not rewards or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in rewards.values()):
            raise HarborError("the verifier's reward.json is not a flat object of finite numbers")
        if "reward" not in rewards and len(rewards) != 1:
            raise HarborError(f"the verifier's reward.json has no `reward` among {sorted(rewards)[:5]}")
        value = float(rewards.get("reward", next(iter(rewards.values()))))
        return value, {f"harbor/{k}": float(v) for k, v in rewards.items() if k != "reward"}
    if "/logs/verifier/reward.txt" in files:
        try:
            value = float(files["/logs/verifier/reward.txt"].decode().strip())
        except (ValueError, UnicodeDecodeError):
            raise HarborError("the verifier's reward.txt is not one number") from None
        if not math.isfinite(value):
            raise HarborError(f"the verifier's reward.txt is {value}")
        return value, {}
    raise HarborError("the verifier wrote neither /logs/verifier/reward.json nor reward.txt")


class HarborEnvironment:
    Options = HarborOptions

    def __init__(self, options: HarborOptions, seed: int = 0):
        self.options, self.seed = options, seed
        self.tasks = {t.name: t for t in read_tasks(Path(options.path))}
        if options.command_dir is not None and not Path(options.command_dir).is_dir():
            raise ValueError(f"env.options.command_dir: {options.command_dir} is not a folder")
        self.agent_files = ({f"/agent/{p.relative_to(options.command_dir)}": p.read_bytes()
                             for p in sorted(Path(options.command_dir).rglob("*")) if p.is_file()}
                            if options.command_dir else {})
        tasks = [Task(id=name, prompt=t.instruction, meta={"folder": str(t.folder)}) for name, t in self.tasks.items()]
        self.heldout = [t for t in tasks if is_heldout(t.id, options.heldout_fraction, options.data_seed)]
        self.train = [t for t in tasks if t not in self.heldout]
        if not self.train or not self.heldout:
            print(f"sao: warning: {len(tasks)} Harbor task(s) are too few to hold some out "
                  f"(env.options.heldout_fraction={options.heldout_fraction}); evaluating on the training tasks",
                  file=sys.stderr)
            self.train = self.heldout = tasks

    def train_tasks(self) -> Iterator[Task]:
        rng, order = random.Random(self.seed), list(self.train)
        while True:
            rng.shuffle(order)
            yield from order

    def eval_tasks(self, n: int) -> list[Task]:
        return [self.heldout[i % len(self.heldout)] for i in range(n)]

    def new_episode(self, ctx: EpisodeContext):
        if self.options.agent == "command":
            return AgentEpisode(self.options, self.run_command, None, ctx)
        return HarborEpisode(self)

    async def verify(self, task: HarborTask, workspace: bytes) -> tuple[float, dict[str, float]]:
        from sao.sandbox.shell import run_shell

        o = self.options
        result = await run_shell("bash /tests/test.sh", workspace=workspace, files=task.tests,
                                 collect=("/logs/verifier/reward.json", "/logs/verifier/reward.txt"),
                                 env={**task.env, **task.verifier_env},
                                 timeout_s=min(task.verifier_timeout_s, o.verifier_timeout_s),
                                 limits=self._limits(min(task.verifier_timeout_s, o.verifier_timeout_s)),
                                 max_workspace_kb=o.max_workspace_kb)
        if result.error:
            raise HarborError(f"the verifier's run: {result.error}")
        try:
            return reward_from(result.files)
        except HarborError as exc:
            last = (result.output.strip().splitlines() or [""])[-1][:200]
            raise HarborError(f"{exc} (test.sh exited {result.exit_code}{': ' + last if last else ''})") from None

    def _limits(self, timeout_s: float, network: bool = False):
        from sao.sandbox.protocol import Limits

        return Limits(cpu_s=timeout_s + 5, wall_s=timeout_s + 15, memory_mb=self.options.memory_mb, max_procs=64,
                      max_file_mb=max(16, self.options.max_workspace_kb >> 8), network=network)

    async def run_command(self, row: dict, base_url: str, api_key: str) -> dict:
        """agent=command: the agent program in the sandbox against the endpoint, then the verifier."""
        from sao.sandbox.shell import run_shell

        task, o = self.tasks[row["id"]], self.options
        timeout = min(task.agent_timeout_s or o.timeout_s, o.timeout_s)
        result = await run_shell(o.command, workspace=task.workspace, files=self.agent_files,
                                 env={**task.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
                                      "SAO_TASK": json.dumps(row, default=str)},
                                 timeout_s=timeout, limits=self._limits(timeout, network=True),
                                 max_workspace_kb=o.max_workspace_kb)
        if result.error:
            raise HarborError(f"the agent's run: {result.error}")
        reward, metrics = await self.verify(task, result.workspace)
        return {"reward": reward, **metrics, "harbor/agent_exit": -1 if result.exit_code is None else result.exit_code}


class HarborEpisode:
    """agent=loop: one shell command per reply, in the sandbox, on the task's workspace."""

    def __init__(self, environment: HarborEnvironment):
        self.environment, self.options = environment, environment.options
        self.commands = 0

    def reset(self, task: Task) -> list[dict]:
        self.task = self.environment.tasks[task.id]
        self.workspace = self.task.workspace
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.task.instruction}]

    async def step(self, text: str) -> StepResult:
        from sao.sandbox.shell import run_shell

        o = self.options
        found = _BASH.findall(text)
        if not found or "<submit>" in text or self.commands >= o.max_commands:
            reward, metrics = await self.environment.verify(self.task, self.workspace)
            return StepResult("", reward, True, {"harbor/commands": float(self.commands), **metrics})
        self.commands += 1
        result = await run_shell(found[0], workspace=self.workspace, env=self.task.env, timeout_s=o.command_timeout_s,
                                 limits=self.environment._limits(o.command_timeout_s),
                                 output_kb=max(1, o.output_chars >> 9), max_workspace_kb=o.max_workspace_kb)
        if result.error:  # the command's doing (a limit, a workspace too large): shown, the workspace kept
            return StepResult(f"[error] {result.error}")
        self.workspace = result.workspace
        out = result.output if len(result.output) <= o.output_chars else "..." + result.output[-o.output_chars:]
        code = "timed out" if result.exit_code is None else f"exit {result.exit_code}"
        return StepResult(f"{out}[{code}]")


register_environment("harbor", HarborEnvironment)
