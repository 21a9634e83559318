"""Host-side limits of a run (layer 3 in sao/sandbox/namespace.py): per-run cgroups and the memory watch.

Both look at the sandbox from outside, so nothing the code does inside can switch them off.
"""

from __future__ import annotations

import functools
import os
import secrets
import time

from sao.sandbox.protocol import Limits


def tree_rss_kib(pid: int) -> int:
    """VmRSS (anonymous + file + shmem) of `pid` and all its descendants, in KiB."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmRSS:"):
                        total += int(line.split()[1])
                        break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", "rb") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue  # it exited meanwhile
    return total


@functools.cache
def cgroup_parents() -> tuple[str, tuple[str, ...]] | None:
    """Where this process may create per-run cgroups with memory and pids control, else None:
    ("v2", (dir,)) or ("v1", (memory dir, pids dir)). Root; or, on cgroup v2, a user whose own cgroup
    is a delegated subtree it may write (systemd `Delegate=yes`, a container runtime's delegation)."""
    if os.geteuid() != 0 and not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return None  # v1 hierarchies are root's
    try:
        lines = [line.split(":", 2) for line in open("/proc/self/cgroup").read().splitlines()]
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # unified hierarchy
            parent = os.path.join("/sys/fs/cgroup", next(p for h, c, p in lines if h == "0").lstrip("/"))
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if not {"memory", "pids"} <= set(f.read().split()):
                    return None
            layout = ("v2", (parent,))
        else:
            layout = ("v1", tuple(os.path.join("/sys/fs/cgroup", ctrl, next(p for h, c, p in lines
                                                                             if ctrl in c.split(",")).lstrip("/"))
                                  for ctrl in ("memory", "pids")))
        for parent in layout[1]:
            probe_dir = os.path.join(parent, f"sao-sandbox-probe-{os.getpid()}")
            os.mkdir(probe_dir)
            os.rmdir(probe_dir)
        return layout
    except (OSError, StopIteration, ValueError):
        return None


def cgroup_for(limits: Limits) -> tuple[str, ...]:
    """This run's cgroups, limits written (empty when cgroups are not ours to use)."""
    layout = cgroup_parents()
    if layout is None:
        return ()
    version, parents = layout
    name, memory = f"sao-sandbox-{secrets.token_hex(6)}", limits.memory_mb << 20
    dirs = tuple(os.path.join(p, name) for p in parents)
    files = {"v2": [(dirs[0], "memory.max", memory), (dirs[0], "memory.swap.max", 0),
                    (dirs[0], "pids.max", limits.max_procs + 2)],
             "v1": [(dirs[0], "memory.limit_in_bytes", memory), (dirs[0], "memory.memsw.limit_in_bytes", memory),
                    (dirs[1], "pids.max", limits.max_procs + 2)]}[version]
    try:
        for d in dirs:
            os.mkdir(d)
        for d, file, value in files:
            if os.path.exists(os.path.join(d, file)):  # memsw/swap files exist only with swap accounting
                with open(os.path.join(d, file), "w") as f:
                    f.write(str(value))
        return dirs
    except OSError:
        remove_cgroups(dirs)
        return ()


def cgroup_oom(dirs: tuple[str, ...]) -> bool:
    """Whether the kernel killed a process of the run for its memory limit."""
    for d in dirs:
        for file in ("memory.events", "memory.oom_control"):  # v2, v1
            try:
                with open(os.path.join(d, file)) as f:
                    if any(line.split()[:1] == ["oom_kill"] and int(line.split()[1]) > 0 for line in f):
                        return True
            except (OSError, ValueError, IndexError):
                continue
    return False


def remove_cgroups(dirs: tuple[str, ...]) -> None:
    for d in dirs:
        for _ in range(100):  # the kernel empties a cgroup asynchronously after its processes die
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
