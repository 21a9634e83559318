"""The program that runs *inside* the sandbox (the untrusted side of `sao/sandbox/namespace.py`).

`namespace._harness_source()` ships these `_h_*` functions as source to a fresh interpreter
(`python -I -S`); they never run in the trainer's process. Standard library only, imports inside
each function. Nothing here is secret and nothing here decides a verdict: the harness only runs
steps and writes one JSON line per step to the results pipe; the host judges (sao/sandbox/judge.py).
Code under test can rewrite all of this; that can only cost it its own credit.
"""


def _h_main():
    """argv: mechanism, mode ("root" | "user"), results fd. stdin: the job (JSON)."""
    import json
    import os
    import sys

    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    os.close(0)
    job = json.loads(b"".join(chunks))
    mechanism, mode, fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mechanism == "unshare":
        _h_enter_root(job)  # returns in a child: pid 1 stays behind and waits
    _h_confine(job, mode)
    module = type(sys)("__main__")  # the code's namespace, and `import __main__` for it
    sys.modules["__main__"] = module
    if job["guard"]:
        sys.addaudithook(_h_guard(fd, job["network"]))
    _h_run(job["steps"], module.__dict__, fd)


def _h_enter_root(job):
    """unshare mechanism, as pid 1 of the namespaces: build the file tree, chroot into it, fork."""
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
        flags = os.statvfs(src).f_flag & (nosuid | nodev | 1024 | 2048)  # keep the source's locked flags (+noexec)
        mount(None, root + src, None, bind | remount | rdonly | nosuid | nodev | flags)
    for link, target in job["links"]:
        os.symlink(target, root + link)
    for dev in job["devices"]:
        place(dev, root + dev)
        mount(dev, root + dev, None, bind)
    os.mkdir(root + "/sandbox")
    mount("tmpfs", root + "/sandbox", "tmpfs", nosuid | nodev, f"mode=1777,size={job['disk_mb']}m")
    mount(None, root, None, remount | rdonly | nosuid | nodev)  # only /sandbox stays writable
    os.chroot(root)
    child = os.fork()
    if child == 0:
        return
    signal.signal(signal.SIGALRM, lambda *_: os._exit(124))  # outlive a dead parent by a bounded time only
    signal.alarm(int(job["limits"]["wall_s"]) + 5)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    os._exit(128 - code if code < 0 else code)


def _h_confine(job, mode):
    """Limits; then no privilege: the run's own uid (root mode) or no capabilities (user namespace);
    then no new privileges and the seccomp filter."""
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
    lim, mb = job["limits"], 1 << 20
    cpu = max(1, math.ceil(lim["cpu_s"]))
    files = 256 if job["cgroup"] else 64  # without a cgroup, each descriptor may pin kernel memory no limit counts
    for res, soft, hard in ((r.RLIMIT_CPU, cpu, cpu + 1), (r.RLIMIT_AS, lim["memory_mb"] * mb, lim["memory_mb"] * mb),
                            (r.RLIMIT_FSIZE, lim["max_file_mb"] * mb, lim["max_file_mb"] * mb),
                            (r.RLIMIT_NPROC, lim["max_procs"], lim["max_procs"]), (r.RLIMIT_CORE, 0, 0),
                            (r.RLIMIT_NOFILE, files, files), (r.RLIMIT_MSGQUEUE, 0, 0), (r.RLIMIT_MEMLOCK, 0, 0)):
        r.setrlimit(res, (soft, hard))
    libc = ctypes.CDLL(None, use_errno=True)
    if mode == "root":
        uid = job["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # clears every capability
        if os.getresuid() != (uid, uid, uid) or os.getgroups():
            raise SystemExit("sandbox: could not drop privileges")
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0 (setuid reset it): no ptrace of us
    else:  # root of our own user namespace (or bwrap's user): give up every capability for good
        libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
        libc.prctl(28, 0x2F, 0, 0, 0)  # PR_SET_SECUREBITS: NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, all locked
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails harmlessly past the last cap)
        header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
        libc.capset(header, data)
    header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)(1, 1, 1, 1, 1, 1)
    if libc.capget(header, data) != 0 or any(data[i] for i in (0, 1, 3, 4)):  # effective, permitted (2 words)
        raise SystemExit("sandbox: could not drop capabilities")
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise SystemExit("sandbox: could not set no_new_privs")
    _h_seccomp(libc, ctypes, not job["cgroup"] and not job["network"], not job["network"])
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]


def _h_seccomp(libc, ctypes, no_unix_sockets, no_inet):
    """A seccomp filter: no memfd, SysV shared memory, new namespaces, mounts, ptrace or pidfds.

    Memory in memfd or SysV segments is not counted by RLIMIT_AS, and a new user namespace could
    mount a tmpfs with no size cap; refusing them (EPERM) keeps every byte of the run in counted
    memory or in the capped /sandbox tmpfs. clone3 gets ENOSYS: its flags cannot be inspected, and
    glibc then falls back to clone, whose namespace flags are checked. `no_unix_sockets` (no cgroup
    counts kernel memory for this run): socketpair and AF_UNIX sockets are refused too, since their
    buffers count in neither RLIMIT_AS nor the resident memory the host watches (asyncio's
    event loop needs a socketpair, so it does not run there). `no_inet` (no network): socket() of any
    family but AF_UNIX is refused, in the kernel: loopback TCP connections in the run's own network
    namespace held kernel buffers (~1 GB from three processes at memory_mb=256) that neither a cgroup v1
    memory limit nor an rlimit counts, and the in-process guard that refused them is within the code's reach.
    """
    import os

    arch = os.uname().machine
    table = {  # arch: (AUDIT_ARCH, clone, clone3, socket, socketpair, denied syscalls); 424/434/438: pidfd_*
        "x86_64": (0xC000003E, 56, 435, 41, 53, (319, 447, 29, 272, 308, 165, 166, 155, 161, 430, 431, 432, 433, 428,
                                                 429, 442, 323, 425, 321, 298, 101, 248, 249, 250, 310, 311, 424, 434,
                                                 438)),
        "aarch64": (0xC00000B7, 220, 435, 198, 199, (279, 447, 194, 97, 268, 40, 39, 41, 51, 430, 431, 432, 433, 428,
                                                     429, 442, 282, 425, 280, 241, 117, 217, 218, 219, 270, 271, 424,
                                                     434, 438)),
    }
    if arch not in table:
        raise SystemExit(f"sandbox: no seccomp filter for {arch}")
    audit_arch, clone, clone3, sock, sockpair, denied = table[arch]
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050001, 0x00050026, 0x80000000
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if arch == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # the x32 ABI
    for nr in denied + ((sockpair,) if no_unix_sockets else ()):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    if no_unix_sockets:  # no socket() at all (no_unix_sockets holds only without network)
        prog += [(jeq, 0, 1, sock), (ret, 0, 0, eperm)]
    elif no_inet:  # socket(family, ...): AF_UNIX (1) only
        prog += [(jeq, 0, 4, sock), (ld, 0, 0, 16), (jeq, 0, 1, 1), (ret, 0, 0, allow), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, clone3), (ret, 0, 0, enosys), (jeq, 0, 3, clone), (ld, 0, 0, 16),
             (jset, 0, 1, 0x7E020080), (ret, 0, 0, eperm), (ret, 0, 0, allow)]  # CLONE_NEW* flags

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
    if libc.prctl(22, 2, ctypes.byref(Program(len(prog), filters)), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        raise SystemExit(f"sandbox: seccomp filter refused: {os.strerror(ctypes.get_errno())}")


def _h_guard(fd, network):
    """An audit hook that turns actions the tests never need into a clear `forbidden` status.

    A convenience, not a wall: the OS layers contain whatever gets past it, and its records are
    only the code's own word (a forged one can only make its run fail)."""
    import json
    import os

    write, dumps = os.write, json.dumps
    forbidden = {"os.system": "running a shell command", "os.exec": "exec'ing a program", "os.fork": "forking",
                 "os.forkpty": "forking", "os.posix_spawn": "spawning a process", "os.spawn": "spawning a process",
                 "subprocess.Popen": "starting a subprocess"}
    blocked_imports = {"ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_xxsubinterpreters", "_testbuffer",
                       "_posixsubprocess"}  # its fork_exec raises no audit event
    seen = set()  # one record per kind of violation: a loop of attempts must not flood the pipe

    def hook(event, args):
        what = forbidden.get(event)
        if what is None:
            if event.startswith("ctypes."):
                what = "ctypes (raw memory access)"
            elif event == "socket.__new__" and args[1] != 1 and not network:  # 1 = AF_UNIX
                what = "opening a network socket"
            elif event == "import" and (type(args[0]) is not str or blocked_imports.intersection(args[0].split("."))):
                what = f"importing {args[0]}"  # every part: `pkg._ctypes` loads _ctypes all the same
            else:
                return
        if what not in seen:
            seen.add(what)
            write(fd, (dumps(["guard", "forbidden", what]) + "\n").encode())
        raise PermissionError(f"sandbox: {what} is not allowed")

    # _posixsubprocess.fork_exec raises no audit event: replace it before the hook is on, so that a
    # re-import (after deleting it from sys.modules) is an import event, which the hook refuses.
    import _posixsubprocess
    _posixsubprocess.fork_exec = lambda *args, **kwargs: hook("subprocess.Popen", ())
    return hook


def _h_run(steps, namespace, fd):
    """Run the steps in a thread with a large stack (deep recursion), then exit. One JSON record per step:
    [name, kind, text]; kind "ok" | "value" (text: repr) | "fail" | "memory"."""
    import _thread
    import json
    import os

    write, dumps, exit_ = os.write, json.dumps, os._exit
    lock = _thread.allocate_lock()
    lock.acquire()

    def worker():
        try:
            _h_steps(steps, namespace, lambda *rec: write(fd, (dumps(rec) + "\n").encode()))
        finally:
            lock.release()

    _thread.stack_size(16 << 20)
    _thread.start_new_thread(worker, ())
    while True:
        try:
            lock.acquire()
            break
        except BaseException:  # e.g. _thread.interrupt_main(): keep waiting for the worker
            continue
    write(fd, b'["run", "done", ""]\n')
    exit_(0)


def _h_steps(steps, namespace, send):
    exec_, eval_, compile_, dict_, repr_, describe = exec, eval, compile, dict, repr, _h_describe
    base_exception = BaseException
    codes = []
    for name, kind, source in steps:
        try:
            codes.append(compile_(source, f"<{name}>", "eval" if kind == "value" else "exec", dont_inherit=True,
                                  optimize=0))  # keep asserts
        except base_exception as e:
            codes.append(describe(e))
    loaded = True
    for (name, kind, _), code in zip(steps, codes):
        if not loaded and name.startswith("test"):
            result = ("fail", "not run: the solution did not load")
        elif type(code) is tuple:  # did not compile
            result = code
        else:
            try:
                if kind == "value":
                    text = repr_(eval_(code, dict_(namespace)))
                    result = ("value", text[:65537] if type(text) is str else "<repr is not a str>")
                else:
                    exec_(code, namespace if name in ("setup", "solution") else dict_(namespace))
                    result = ("ok", "")
            except base_exception as e:
                result = describe(e)
        if not name.startswith("test"):
            loaded = loaded and result[0] == "ok"
        send(name, *result)


def _h_describe(error):
    """(kind, one message) for an exception; its str() is the code's own, and may say anything."""
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
