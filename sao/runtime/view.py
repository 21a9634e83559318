"""`sao view RUN [--serve]`: a run's trajectories token by token and its curves, in one HTML page.

    sao view runs/NAME                 writes runs/NAME/view.html and prints its path
    sao view BENCH_OUT                 a `sao bench` output folder (results.json): its runs side by side
    sao view runs/NAME --serve         serves the page on 127.0.0.1 and refreshes it while the run goes on

The page is self-contained (its script, styles and data inline; no network). What it shows:
- every dumped trajectory (trajectories/step_N.jsonl), filterable by status, reward, lag, run (the
  bench variant) and step, sortable; each one's prompt, actions and observations, every action token
  coloured by a chosen field with its exact values on hover. The per-token fields are what the trainer
  computed (traces/step_N.jsonl, sao/trainer/trace.py): advantage, V before/after the critic's update,
  return, ratio, DIS mask (masked tokens struck through), log-probs, version; a trajectory without a
  trace shows its versions and the rollout log-probs.
- the run's curves (sao/runtime/curves.py, the same definition `sao report` draws), with the critic
  warm-up shaded, resumes and weight publishes marked, smoothing on or off, zoom by step range.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from sao.config import ConfigError
from sao.runtime.curves import curve_data, read_metrics

PAGE = Path(__file__).with_name("view_page.html")
MAX_TRAJECTORIES = 400  # per run, the newest: a page stays a few MB however long the run


def _tokenizer(run: Path):
    """The run's tokenizer (its newest checkpoint's, else its model's), for trajectories without a trace;
    None when neither is there (their tokens then show as ids)."""
    from sao.models.tokenizer import load_tokenizer
    from sao.runtime import checkpoint

    candidates = []
    ckpt = checkpoint.latest(run)
    if ckpt is not None:
        candidates.append(ckpt / "actor")
    try:
        import yaml

        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
        candidates.append(Path(str((cfg.get("model") or {}).get("path") or "")))
    except (OSError, yaml.YAMLError):
        pass
    for folder in candidates:
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            try:
                return load_tokenizer(folder)
            except (OSError, ValueError):
                continue
    return None


def _jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a dump being written (trajectories are written in place)
            break
    return out


def _versions_before(rows: list[dict]) -> dict[int, int]:
    """step -> the policy version its batch trained (the version logged after the step before)."""
    out, last = {}, 0
    for r in rows:
        if "train/actor_version" in r:
            out[r["step"]] = last
            last = int(r["train/actor_version"])
    return out


def trajectories(run: Path, rows: list[dict], limit: int = MAX_TRAJECTORIES) -> list[dict]:
    """The newest `limit` dumped trajectories of a run, each with its tokens' text and per-token fields."""
    files = sorted((run / "trajectories").glob("step_*.jsonl"))
    before = _versions_before(rows)
    picked: list[tuple[int, dict]] = []
    for path in reversed(files):
        step = int(path.stem.split("_")[1])
        picked.extend((step, t) for t in _jsonl(path))
        if len(picked) >= limit:
            break
    picked = sorted(picked[:limit], key=lambda p: p[0])
    traces: dict[tuple[int, str], dict] = {}
    for step in {s for s, _ in picked}:
        path = run / "traces" / f"step_{step:06d}.jsonl"
        if path.is_file():
            traces.update(((step, r["trajectory_id"]), r) for r in _jsonl(path))
    tokenizer = None
    out = []
    for step, t in picked:
        rec = traces.get((step, t["id"]))
        mask = t["action_mask"]
        if rec is not None:
            text = rec["text"]
        else:
            if tokenizer is None:
                tokenizer = _tokenizer(run) or False
            text = [tokenizer.decode([i]) for i in t["token_ids"]] if tokenizer else [f"#{i}" for i in t["token_ids"]]
        fields = {"version": [v if m else None for v, m in zip(t["token_versions"], mask)],
                  "behavior_logprob": [v if m else None for v, m in zip(t["behavior_logprobs"], mask)]}
        extra = {}
        if rec is not None:
            fields.update({k: v for k, v in rec.items() if isinstance(v, list) and k not in
                           ("token_ids", "text", "action_mask")})
            extra = {k: rec[k] for k in ("actor", "lambda", "whiten", "group", "group_adv", "algo") if k in rec}
        versions = [v for v, m in zip(t["token_versions"], mask) if m]
        lag = before[step] - min(versions) if versions and step in before else None
        out.append({"step": step, "id": t["id"], "task": t["task_id"], "status": t["status"],
                    "reason": t.get("status_reason", ""), "reward": t["reward"], "turns": t["turns"],
                    "lag": rec["lag"] if rec is not None else lag, "traced": rec is not None,
                    "text": text, "mask": mask, "fields": fields, "metrics": t.get("metrics") or {}, **extra})
    return out


def run_data(run: Path, name: str, limit: int = MAX_TRAJECTORIES) -> dict:
    rows = read_metrics(run)
    try:
        import yaml

        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, ValueError):
        cfg = {}
    return {"name": name, "path": str(run), "algo": (cfg.get("algo") or {}).get("name", "?"),
            "env": (cfg.get("env") or {}).get("name", "?"), "curves": curve_data(rows),
            "trajectories": trajectories(run, rows, limit), "steps": rows[-1]["step"] if rows else 0}


def runs_of(path: Path) -> list[tuple[str, Path]]:
    """(name, run directory) of a run folder, or of each run a `sao bench` output folder names."""
    if (path / "metrics.jsonl").is_file():
        return [(path.resolve().name, path)]
    results = path / "results.json"
    if results.is_file():
        try:
            runs = json.loads(results.read_text()).get("runs", [])
        except (json.JSONDecodeError, AttributeError):
            raise ConfigError(f"{str(results)!r}: not a `sao bench` results file") from None
        found = [(f"{r['variant']}-s{r['seed']}", Path(r["run_dir"])) for r in runs
                 if isinstance(r, dict) and "run_dir" in r and (Path(r["run_dir"]) / "metrics.jsonl").is_file()]
        if not found:
            raise ConfigError(f"{str(results)!r}: none of its runs' folders is here (results.json names them)")
        return found
    raise ConfigError(f"{str(path)!r}: not a run directory (no metrics.jsonl) or a `sao bench` output (no results.json)")


def collect(path: Path, limit: int = MAX_TRAJECTORIES) -> dict:
    """The page's data: every run with its curves and trajectories."""
    return {"title": path.resolve().name, "generated_at": time.time(),
            "runs": [run_data(run, name, limit) for name, run in runs_of(path)]}


def render(data: dict, live: bool = False) -> str:
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # no </script> inside the script
    page = PAGE.read_text()
    return page.replace("/*SAO_DATA*/null", blob).replace("/*SAO_LIVE*/false", "true" if live else "false")


def write_page(path: Path, limit: int = MAX_TRAJECTORIES) -> Path:
    if not path.exists():
        raise ConfigError(f"{str(path)!r}: no such run directory")
    data = collect(path, limit)
    out = path / "view.html"
    tmp = out.with_suffix(".partial")
    tmp.write_text(render(data))
    tmp.rename(out)
    return out


def serve(path: Path, port: int, limit: int = MAX_TRAJECTORIES, ready=None) -> None:
    """Serve the page on 127.0.0.1:`port` (0: any free port); it fetches data.json every few seconds,
    collected afresh from the run folder. `ready(url)` is called once the server listens."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    collect(path, limit)  # bad input fails here, before the server starts

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            route = self.path.split("?")[0]
            if route in ("/", "/index.html"):
                body, kind = render(collect(path, limit), live=True).encode(), "text/html; charset=utf-8"
            elif route == "/data.json":
                body, kind = json.dumps(collect(path, limit)).encode(), "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet: the terminal shows the URL, not every poll
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    (ready or (lambda u: print(f"serving {u} (Ctrl-C stops)", flush=True)))(url)
    try:
        server.serve_forever()
    finally:
        server.server_close()
