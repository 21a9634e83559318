"""The harness of `sao.envs.sandbox`: the program that runs *inside* the sandbox.

`sandbox._harness_source()` ships these functions as source to a fresh interpreter (`python -I -S`);
they are never called in the trainer's process. Standard library only, imports inside each function,
and no names but the `_h_*` functions themselves: nothing else exists where they run. The module
docstring of `sandbox.py` describes the containment layers this harness implements (3 and 4, and 1
for the `unshare` fallback).
"""

# After the first untrusted step starts, harness code uses only values captured before it: its own
# builtins (see the prelude in `sandbox._harness_source`), its hidden globals (`__main__` is replaced), and locals.


def _h_main():
    """argv: mechanism, results fd. stdin: the job (JSON), nonce included; closed before any untrusted code."""
    import json
    import os
    import sys

    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    os.close(0)
    job = json.loads(b"".join(chunks))
    del chunks
    if sys.argv[1] == "unshare":
        _h_enter_root(job)  # returns in a child: pid 1 stays behind as root and waits
    _h_confine(job)
    module = type(sys)("__main__")  # the solution's namespace, and `import __main__` for it: hides ours
    sys.modules["__main__"] = module
    fd, nonce = int(sys.argv[2]), job.pop("nonce").encode()
    if job["guard"]:
        sys.addaudithook(_h_guard(fd, nonce, job["network"]))
    box = [nonce, fd, job.pop("steps"), module.__dict__]
    del job, module, fd, nonce  # from here on, only `box` holds them; _h_start_worker empties it
    _h_serve(box)


def _h_enter_root(job):
    """unshare fallback, as pid 1 of the namespaces: build the file tree, chroot into it, fork."""
    import ctypes
    import os
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    rdonly, nosuid, nodev, remount, bind = 1, 2, 4, 32, 4096  # MS_* from <sys/mount.h>

    def mount(src, dst, fstype, flags, data=None):
        args = [None if s is None else s.encode() for s in (src, dst, fstype, data)]
        if libc.mount(args[0], args[1], args[2], flags, args[3]) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {dst}: {os.strerror(err)}")

    def place(src, dst):  # an empty file or directory to mount over
        os.makedirs(dst if os.path.isdir(src) else os.path.dirname(dst), exist_ok=True)
        if not os.path.isdir(src):
            open(dst, "w").close()

    os.umask(0o022)
    root = job["root"]
    mount("tmpfs", root, "tmpfs", nosuid | nodev, "mode=0755,size=1m")
    for src in job["ro"]:  # non-recursive binds: mounts below them stay out
        place(src, root + src)
        mount(src, root + src, None, bind)
        mount(None, root + src, None, bind | remount | rdonly | nosuid | nodev)
    for link, target in job["links"]:
        os.symlink(target, root + link)
    for dev in job["devices"]:
        place(dev, root + dev)
        mount(dev, root + dev, None, bind)
    os.mkdir(root + "/sandbox")
    mount("tmpfs", root + "/sandbox", "tmpfs", nosuid | nodev, f"mode=1777,size={job['disk_mb']}m")
    os.chroot(root)
    child = os.fork()
    if child == 0:
        return
    signal.signal(signal.SIGALRM, lambda *_: os._exit(124))  # outlive a dead parent by a bounded time only
    signal.alarm(int(job["limits"]["wall_s"]) + 5)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    os._exit(128 - code if code < 0 else code)


def _h_confine(job):
    """Both mechanisms: limits, then the run's own uid for good (root here until now)."""
    import ctypes
    import math
    import os
    import resource as r
    import signal
    import sys

    os.chdir("/sandbox")
    os.open("/dev/null", os.O_RDONLY)  # fd 0
    try:
        os.setsid()
    except OSError:
        pass  # bwrap --new-session made us a session leader already
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; over the file-size limit, the run dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # makes _thread.interrupt_main() a no-op
    os.nice(10)  # leave the trainer its CPU
    lim, uid = job["limits"], job["uid"]
    cpu, mb = max(1, math.ceil(lim["cpu_s"])), 1 << 20
    for res, soft, hard in ((r.RLIMIT_CPU, cpu, cpu + 1), (r.RLIMIT_AS, lim["memory_mb"] * mb, lim["memory_mb"] * mb),
                            (r.RLIMIT_FSIZE, lim["max_file_mb"] * mb, lim["max_file_mb"] * mb),
                            (r.RLIMIT_NPROC, lim["max_procs"], lim["max_procs"]), (r.RLIMIT_CORE, 0, 0),
                            (r.RLIMIT_NOFILE, 256, 256)):
        r.setrlimit(res, (soft, hard))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0, after setuid (which resets it): no ptrace of us
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        raise SystemExit("sandbox: could not drop privileges")
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]


def _h_guard(fd, nonce, network):
    """The audit hook. Forbidden events are recorded, then refused; frame access is just refused."""
    import binascii
    import os

    write, b64 = os.write, binascii.b2a_base64
    forbidden = {"os.system": "running a shell command", "os.exec": "exec'ing a program", "os.fork": "forking",
                 "os.forkpty": "forking", "os.posix_spawn": "spawning a process", "os.spawn": "spawning a process",
                 "subprocess.Popen": "starting a subprocess", "sys.settrace": "tracing", "sys.setprofile": "profiling",
                 "sys.addaudithook": "adding audit hooks", "sys._current_frames": "reading other threads' frames",
                 "sys._current_exceptions": "reading other threads' exceptions", "gc.get_objects": "walking the heap",
                 "gc.get_referrers": "walking the heap", "gc.get_referents": "walking the heap"}
    blocked_imports = {"ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_xxsubinterpreters", "_testbuffer"}
    hidden_attrs = {"tb_frame", "gi_frame", "cr_frame", "ag_frame"}
    seen = set()  # one record per kind of violation: a loop of attempts must not flood the file

    def hook(event, args):
        what = forbidden.get(event)
        if what is None:
            if event.startswith("ctypes."):
                what = "ctypes (raw memory access)"
            elif event == "socket.__new__" and args[1] != 1 and not network:  # 1 = AF_UNIX
                what = "opening a network socket"
            elif event == "import" and (type(args[0]) is not str or args[0].split(".")[0] in blocked_imports):
                what = f"importing {args[0]}"
            elif event == "sys._getframe":  # a ValueError: the stdlib's users of _getframe fall back on it
                raise ValueError("sandbox: stack frames are not available")
            elif event == "object.__getattr__" and args[1] in hidden_attrs:
                raise AttributeError(f"sandbox: {args[1]} is not available")
            else:
                return
        if what not in seen:
            seen.add(what)
            write(fd, b" ".join([nonce, b"guard", b"forbidden", b64(what.encode(), newline=False)]) + b"\n")
        raise PermissionError(f"sandbox: {what} is not allowed")

    return hook


def _h_serve(box):
    """Main thread: write each record the worker sends, prefixed by the nonce, then a final one; exit."""
    import collections
    import os

    exit_ = os._exit
    collections.deque(_h_start_worker(box), 0)  # runs in C until the worker is done
    exit_(0)


def _h_start_worker(box):
    """Start the worker, paused, and return the main thread's pipeline of records.

    The pipeline is a C-level iterator chain and the only holder of the nonce, the descriptor and the
    queues on this side: once this returns no Python frame of the main thread holds them, so code
    that runs here later (a finalizer, a signal handler it installs) finds nothing. The worker starts
    running untrusted code only after the first record ("start") is written, i.e. after we return.
    """
    import _queue
    import _thread
    import itertools
    import os

    records, acks = _queue.SimpleQueue(), _queue.SimpleQueue()
    _thread.stack_size(16 << 20)  # deep recursion in solutions (the main thread gets 8 MB)
    _thread.start_new_thread(_h_worker, (box.pop(), box.pop(), records.put, acks.get))
    _thread.stack_size(0)
    lines = itertools.chain([b"run start \n"], iter(records.get, None), [b"run done \n"])
    return map(acks.put, map(os.write, itertools.repeat(box.pop()), map(b" ".join, zip(itertools.repeat(box.pop()), lines))))


def _h_worker(namespace, steps, put, wait):
    """Worker thread: compile every step, then run them, sending one record per step.

    Each record waits for its write (`wait`), so a later `os._exit` cannot lose it. Only locals are
    used once untrusted code has run: it could have patched globals and builtins.
    """
    from binascii import b2a_base64

    exec_, compile_, dict_, zip_, type_, describe = exec, compile, dict, zip, type, _h_describe
    base_exception = BaseException
    codes = []
    for name, source in steps:
        try:
            codes.append(compile_(source, f"<{name}>", "exec", dont_inherit=True, optimize=0))  # keep asserts
        except base_exception as e:
            codes.append(describe(e))
    wait()
    loaded = True
    try:
        for (name, _), code in zip_(steps, codes):
            if not loaded and name.startswith("test"):
                kind, message = "fail", "not run: the solution did not load"
            elif type_(code) is tuple:  # did not compile
                kind, message = code
            else:
                try:
                    exec_(code, namespace if name in ("setup", "solution") else dict_(namespace))
                    kind, message = "ok", ""
                except base_exception as e:
                    kind, message = describe(e)
            if not name.startswith("test"):
                loaded = loaded and kind == "ok"
            put(f"{name} {kind} ".encode() + b2a_base64(message.encode("utf-8", "replace"), newline=False) + b"\n")
            wait()
    finally:
        put(None)


def _h_describe(error):
    """(kind, one message) for an exception; its str() is untrusted code, run here in the worker."""
    kind = "memory" if isinstance(error, MemoryError) else "fail"
    try:
        if isinstance(error, SystemExit):
            text = f"SystemExit({error.code!r}): exiting does not pass a test"
        elif isinstance(error, SyntaxError):
            text = f"{type(error).__name__}: {error.msg} (line {error.lineno})"
        else:
            text = f"{type(error).__name__}: {error}".removesuffix(": ")
        if type(text) is not str:
            text = "<unprintable exception>"
    except BaseException:
        text = f"<unprintable {kind}>"
    return kind, text[:2000]
