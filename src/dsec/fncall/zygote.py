"""The FnCall zygote: a warm Python interpreter inside one locked-down worker container.

This file runs inside the container, with the image's own ``python3`` (3.10 or later) and the
standard library only; the edge bind-mounts it read-only and starts it as root of the container
with ``crun exec … python3 -I BOOT ZYGOTE UID GID NPROC FSIZE NOFILE PRELOAD LOOP`` (``BOOT``
is ``zygote_boot.py``, which loads this file compiled elsewhere, see there; ``LOOP`` is the
path of the per-call loop in C, ``dsec/native/zygote.c`` built as a shared library, or empty).
It does Python's start-up work (and imports the PRELOAD modules, if any) once, then serves
calls one at a time, forking a fresh child for each::

    edge ──request──▶ zygote ──fork──▶ child: setsid, rlimits, drop to UID, write files, run code
    edge ◀──answer─── zygote ◀──exit── child            (stdout and stderr are memfds)
                      zygote: kill and reap whatever the call left running, wipe /work /tmp …

Clean state: a child is a copy of the zygote, which never runs call code, so no variable of an
earlier call exists in it. The zygote never holds call data in its own heap either, so a child
cannot dig an earlier call's code, input or output out of freed memory: the request body is
spliced from the channel into a memfd that only the child reads, and output and fetched files go
back with sendfile(2) (the C loop copies output of up to 16 KiB into the answer's own write, and
wipes it before the next fork). Only the small request header (limits, names of files to fetch) is parsed
here. The zygote is the subreaper of every process a call starts: once the child is reaped,
any process still there is found with one waitpid, killed with kill(-1) (atomic against fork,
so a fork bomb cannot outrun it) and reaped. The writable mounts are wiped when a stat of their
directory (size, times, owner, mode) shows a change; SysV IPC and POSIX message queues are
switched off in the worker (namespaced sysctls), so no other state survives a call.

Wire protocol (the channel is the zygote's stdin and stdout, moved to fds 3 and 4 at start;
integers big-endian, strings UTF-8 with a ``!H`` length before them):

- request: ``!II`` (header length, body length), header, body. Header: ``!dQIQQQ`` (timeout
  in s, bytes of address space the call may add, RLIMIT_CPU in s, bytes of output kept per
  stream, bytes per fetched file, bytes fetched in all), then ``!H`` count and the relative
  paths of the files to fetch.
  Body (read by the child only): ``!BIIiI`` (language: 0 python, 1 bash; code length; env
  length; stdin length or -1; number of files), the code, the environment variables the call
  adds to the zygote's own (``NAME=VALUE\\0``…), stdin, then per file ``!HI`` (path length,
  data length), path, data.
- answer: ``!cI`` (kind, payload length), payload. Kind ``A``: ``!i?ddQQQQH`` (exit code,
  negative when killed by that signal; timed out; duration in s; CPU in s; stdout and stderr
  bytes sent; stdout and stderr bytes written; number of fetched files), then per file ``!HqH``
  (path length, bytes sent or -1, reason length), path, reason; then the stdout, stderr and file
  bytes themselves. Kind ``E``: the call could not be started, payload is the reason. Kind ``R``
  (once, at start): ``PYTHON_VERSION\\0MISSING_MODULES\\0LOOP\\0HUGE`` (``LOOP``: ``native`` or
  ``python``, which loop serves; ``HUGE``: bytes of code the zygote moved onto huge pages). EOF
  on the channel ends the zygote.

Speed: on a virtual machine every page a process writes after fork costs a fault, and every page it
maps costs at fork and exit, so the zygote keeps its heap small (only small modules; compiled
elsewhere, see ``zygote_boot``), does once what every child would otherwise do for the first time
(it builds the child's ``sys.stdin``/``stdout``/``stderr`` on seekable placeholders, as ``python3
-c`` would for files, and runs a warm-up snippet through compile, exec, print and traceback; that
makes each child much cheaper), keeps the calls' base environment as its own, and keeps its
per-call work to a few system calls. Those run in C (``LOOP``), so the zygote runs no Python
between two forks: a Python loop writes many pages a call (objects, reference counts, frames), each
a copy-on-write fault after the fork before; the C loop a few. The Python loop below
(``Zygote.serve_forever``) does the same where the library cannot be loaded (an image with another
libc than glibc). With the library the zygote also moves the interpreter's code onto transparent
huge pages once warm, so a child maps it with no fault (see ``dsec_zygote_code_to_huge_pages``).
What a call costs is in docs/BENCHMARKS.md, "FnCall".
"""

import os
import sys

CHAN_IN, CHAN_OUT, LOG, DEVNULL = 3, 4, 5, 6
BODY_FD = 3  # in a Python call's child of the C loop: the request body (dsec/native/zygote.c)
INIT_PATH = "/dev/.dsec-init"  # the sandbox init, as dsec.backends.container mounts it
WORKDIR = "/work"
WIPED_DIRS = (WORKDIR, "/tmp", "/dev/shm", "/dev/mqueue")
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
MAX_HEADER = 1 << 20
LANGUAGES = ("python", "bash")
# The edge starts the zygote with LD_BIND_NOW set to this (backend.zygote_argv), unless the
# calls' environment has LD_BIND_NOW of its own: the dynamic linker then binds every symbol at
# start, once. Bound lazily, each call's child bound again the libc functions the zygote had not
# called yet (fork's, _exit …), looking them up through every loaded object: 11 page faults a
# call with the linker's code at the fault. The zygote takes the variable out of its environment
# (the calls') at once; what the linker read at start stays, so a call's own dlopen binds all
# its symbols at once too.
BIND_NOW = "dsec-zygote"


def _setup_fds():
    """Channel on fds 3 and 4, the zygote's own log on 5, /dev/null on 6; fds 0-2 point at an
    empty placeholder, over which each child puts its stdin, stdout and stderr."""
    os.dup2(0, CHAN_IN)
    os.dup2(1, CHAN_OUT)
    os.dup2(2, LOG)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, DEVNULL)
    os.close(null)
    placeholder = os.memfd_create("placeholder", 0)
    for fd in (0, 1, 2):
        os.dup2(placeholder, fd)
    os.close(placeholder)
    sys.stdout = sys.stderr = open(LOG, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                                   buffering=1, closefd=False)


# Only small modules: the zygote's memory is what every fork copies (no json, re, enum …).
# Importing this module does nothing else; ``main`` takes over the process.
import _signal  # noqa: E402
import atexit  # noqa: E402
import builtins  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import resource  # noqa: E402
import select  # noqa: E402
import stat  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
_HEADER = struct.Struct("!dQIQQQ")
_RESULT = struct.Struct("!i?ddQQQQH")
_FETCHED = struct.Struct("!HqH")
_BODY = struct.Struct("!BIIiI")
_FILE = struct.Struct("!HI")
_U16 = struct.Struct("!H")
_PAGE = resource.getpagesize()


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd, n):
    buf = os.read(fd, n)
    if len(buf) == n:
        return buf
    buf = bytearray(buf)
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _splice_all(src, dst, n):
    while n > 0:
        moved = os.splice(src, dst, n)
        if moved == 0:
            raise EOFError
        n -= moved


def _sendfile_all(dst, src, n):
    offset = 0
    while offset < n:
        sent = os.sendfile(dst, src, offset, n - offset)
        if sent == 0:  # the file shrank: keep the frame the length it announced
            _write_all(dst, bytes(n - offset))
            return
        offset += sent


def _answer(kind, payload, fds=()):
    _write_all(CHAN_OUT, struct.pack("!cI", kind, len(payload)) + payload)
    for fd, n in fds:
        if n:
            _sendfile_all(CHAN_OUT, fd, n)


def _parse_header(raw):
    (timeout, memory, cpu, max_output, max_fetch, max_fetch_total) = _HEADER.unpack_from(raw)
    pos = _HEADER.size
    (count,) = _U16.unpack_from(raw, pos)
    pos += 2
    fetch = []
    for _ in range(count):
        (n,) = _U16.unpack_from(raw, pos)
        fetch.append(str(raw[pos + 2:pos + 2 + n], "utf-8"))
        pos += 2 + n
    return {"timeout": timeout, "memory": memory, "cpu": cpu, "max_output": max_output,
            "max_fetch": max_fetch, "max_fetch_total": max_fetch_total, "fetch": fetch}


# -- the child ---------------------------------------------------------------------------------


def _make_stdio():
    """What ``python3 -c`` gives a call whose stdio are files: stdout block-buffered, stderr
    line-buffered with backslashreplace, UTF-8. Built once on the placeholders; never used by
    the zygote itself."""
    stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)  # noqa: SIM115
    return stdin, stdout, stderr


_STDIO = None  # made by main()
_MAIN = None


def _exit_code_of(exc):
    """What the interpreter does with SystemExit at the top level."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def _print_exception(exc):
    """What ``python3 -c`` prints for an uncaught exception (through ``sys.excepthook``, which
    the code may have replaced), without this module's frame."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    try:
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    except BaseException:  # noqa: BLE001
        sys.__excepthook__(type(exc), exc, tb)


def _run_python(code):
    """Run ``code`` as ``python3 -c`` would, in this (forked) interpreter; never returns.
    ``sys.argv``, ``sys.path``, the stdio objects and a fresh ``__main__`` were set up by the
    zygote."""
    try:
        exec(compile(code, "<string>", "exec"), _MAIN.__dict__)  # noqa: S102 - that is the job
        rc = 0
    except SystemExit as exc:
        rc = _exit_code_of(exc)
    except BaseException as exc:  # noqa: BLE001
        _print_exception(exc)
        rc = 1
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            rc = rc or 120
    os._exit(rc)


def _enter_call_state():
    """Make the zygote look, to the children it forks, like a fresh ``python3 -c``: ``sys.argv``,
    ``sys.path``, stdio, a pristine ``__main__``. Its environment is the calls' (the edge starts it
    so); a call's request carries only what it adds.
    Every child gets its own copy, so one call cannot spoil the next."""
    global _MAIN
    sys.argv[:] = ["-c"]
    # python3 -c's sys.path[0], here rather than in each child (a list a child writes is a page
    # fault of its own); the zygote imports nothing after this.
    sys.path.insert(0, "")
    sys.stdin, sys.stdout, sys.stderr = _STDIO
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = _STDIO
    atexit._clear()
    _MAIN = types.ModuleType("__main__")
    _MAIN.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = _MAIN


def _parse_body(raw):
    language, code_len, env_len, stdin_len, nfiles = _BODY.unpack_from(raw)
    pos = _BODY.size
    code = str(raw[pos:pos + code_len], "utf-8")
    pos += code_len
    # every object a child makes costs it page faults: none when there is nothing
    env = _parse_env(bytes(raw[pos:pos + env_len])) if env_len else {}
    pos += env_len
    stdin = None
    if stdin_len >= 0:
        stdin = raw[pos:pos + stdin_len]
        pos += stdin_len
    files = []
    for _ in range(nfiles):
        path_len, data_len = _FILE.unpack_from(raw, pos)
        pos += _FILE.size
        path = str(raw[pos:pos + path_len], "utf-8")
        pos += path_len
        files.append((path, raw[pos:pos + data_len]))
        pos += data_len
    return LANGUAGES[language], code, env, stdin, files


def _parse_env(raw):
    env = {}
    for item in raw.split(b"\0"):
        if item:
            name, _, value = item.decode("utf-8", "surrogateescape").partition("=")
            env[name] = value
    return env


def _write_inputs(files):
    for path, data in files:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)


def _child(uid, gid, body_fd, body_len, out_fd, err_fd, cpu, memory, vsz):
    """The call's own process: never returns."""
    try:
        os.setsid()
        raw = memoryview(os.pread(body_fd, body_len, 0))
        language, code, env, stdin, files = _parse_body(raw)
        if stdin is not None:
            stdin_fd = os.memfd_create("stdin", 0)
            _write_all(stdin_fd, stdin)
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            os.dup2(stdin_fd, 0)
        else:
            os.dup2(DEVNULL, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        _confine_call()
        # Nothing of the zygote's stays open in the call: not the channel, not a memfd.
        os.closerange(3, 1 << 16)
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(fd, b"1000")  # under memory pressure the call dies, not the zygote
        os.close(fd)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        os.setgid(gid)
        os.setuid(uid)
        # setuid made the process non-dumpable, which hides its own /proc entries from it.
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        os.chdir(WORKDIR)
        if files:
            _write_inputs(files)
        del files, stdin, raw
        if language == "python":
            if env:
                os.environ.update(env)
            resource.setrlimit(resource.RLIMIT_AS, (vsz + memory, vsz + memory))
            _run_python(code)
        else:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):
                _signal.signal(sig, _signal.SIG_DFL)
            os.execve("/bin/bash", ["bash", "-c", code], {**os.environ, **env})
    except BaseException as exc:  # noqa: BLE001
        _say_cannot_start(exc)
    os._exit(126)


def _say_cannot_start(exc: BaseException) -> None:
    """Tell the call's stderr why it did not start (its exit code, 126, says that it did not)."""
    try:
        os.write(2, f"fncall: the call could not start: {type(exc).__name__}: {exc}\n".encode())
    except BaseException:  # noqa: BLE001
        pass


def _read_body_code(fd, code_len, env_len):
    """The code and environment of the request body on ``fd`` (they follow its fixed part): read
    with os.pread, not through ctypes, whose call (libffi, ctypes' own objects) costs a child
    page faults of its own."""
    raw = os.pread(fd, code_len + env_len, _BODY.size)
    if len(raw) != code_len + env_len:
        raise EOFError("the request body is cut short")
    return raw


def _native_child(loop):
    """A Python call's process once the C loop has prepared it (as ``_child`` does up to its
    input files): never returns."""
    try:
        code_len, env_len = loop.code_len, loop.env_len
        raw = _read_body_code(BODY_FD, code_len, env_len)
        os.close(BODY_FD)
        code = str(raw[:code_len], "utf-8")
        if env_len:
            os.environ.update(_parse_env(raw[code_len:]))
        limit = loop.vsz + loop.memory
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        _run_python(code)
    except BaseException as exc:  # noqa: BLE001
        _say_cannot_start(exc)
    os._exit(126)


# -- the zygote --------------------------------------------------------------------------------


class Zygote:
    def __init__(self, uid, gid):
        self.uid, self.gid = uid, gid
        self.poller = select.poll()
        self.dirs = []
        for path in WIPED_DIRS:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            self.dirs.append((path, fd))
        self.workdir_fd = self.dirs[0][1]
        self.clean = {}
        self.statm_fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)

    def serve_native(self, serve):
        """Serve with the C loop until EOF (see ``dsec/native/zygote.c``); in a call's child,
        run the call."""
        hooks = {field: ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value
                 for field, name in _FORK_HOOKS}
        loop = _NativeLoop(chan_in=CHAN_IN, chan_out=CHAN_OUT, statm_fd=self.statm_fd, workdir_fd=self.workdir_fd,
                           devnull_fd=DEVNULL, ruleset_fd=_RULESET, ndirs=len(self.dirs), uid=self.uid, gid=self.gid,
                           **hooks)
        for i, (_, fd) in enumerate(self.dirs):
            loop.dir_fds[i] = fd
        while True:
            rc = serve(ctypes.byref(loop))
            if rc == 1:
                _native_child(loop)
            elif rc == 2:  # a call wrote to a wiped directory
                self.cleanup()
            elif rc == 0:
                return
            else:
                raise RuntimeError(loop.error.decode(errors="replace"))

    def serve_forever(self):
        while True:
            try:
                lengths = _read_exact(CHAN_IN, 8)
            except EOFError:
                return
            hlen, blen = struct.unpack("!II", lengths)
            if hlen > MAX_HEADER:
                raise RuntimeError(f"request header of {hlen} bytes")
            hdr = _parse_header(memoryview(_read_exact(CHAN_IN, hlen)))
            self.serve(hdr, blen)
            self.cleanup()

    def serve(self, hdr, blen):
        body_fd = os.memfd_create("body", os.MFD_CLOEXEC)
        try:
            _splice_all(CHAN_IN, body_fd, blen)
        except BaseException:
            os.close(body_fd)
            raise
        out_fd = os.memfd_create("stdout", os.MFD_CLOEXEC)
        err_fd = os.memfd_create("stderr", os.MFD_CLOEXEC)
        vsz = int(os.pread(self.statm_fd, 64, 0).split()[0]) * _PAGE
        start = time.perf_counter()
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in (body_fd, out_fd, err_fd):
                os.close(fd)
            _answer(b"E", f"cannot fork the call: {exc}".encode())
            return
        if pid == 0:
            _child(self.uid, self.gid, body_fd, blen, out_fd, err_fd, hdr["cpu"], hdr["memory"], vsz)
        os.close(body_fd)
        try:
            status, cpu, timed_out = self._wait(pid, hdr["timeout"])
            duration = time.perf_counter() - start
            self.kill_all()
            self._send_result(hdr, status, duration, cpu, timed_out, out_fd, err_fd)
        finally:
            os.close(out_fd)
            os.close(err_fd)

    def _wait(self, pid, timeout):
        pidfd = os.pidfd_open(pid)
        try:
            self.poller.register(pidfd, select.POLLIN)
            timed_out = not self.poller.poll(max(1, int(timeout * 1000 + 0.999)))
            self.poller.unregister(pidfd)
        finally:
            os.close(pidfd)
        if timed_out:
            _kill_others()
        _, status, usage = os.wait4(pid, 0)
        return status, usage.ru_utime + usage.ru_stime, timed_out

    def kill_all(self):
        """Kill and reap every process the call left (all are descendants of this subreaper)."""
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break  # some still run
        except ChildProcessError:
            return  # none left: the common case, one system call
        _kill_others()
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return

    def _send_result(self, hdr, status, duration, cpu, timed_out, out_fd, err_fd):
        out_total = os.fstat(out_fd).st_size
        err_total = os.fstat(err_fd).st_size
        out_sent = min(out_total, hdr["max_output"])
        err_sent = min(err_total, hdr["max_output"])
        fds = [(out_fd, out_sent), (err_fd, err_sent)]
        files = []
        opened = []
        try:
            if hdr["fetch"]:
                files = self._open_fetched(hdr, fds, opened)
            payload = [_RESULT.pack(os.waitstatus_to_exitcode(status), timed_out, duration, cpu,
                                    out_sent, err_sent, out_total, err_total, len(files))]
            for path, size, reason in files:
                p, r = path.encode(), reason.encode()
                payload += [_FETCHED.pack(len(p), size, len(r)), p, r]
            _answer(b"A", b"".join(payload), fds)
        finally:
            for fd in opened:
                os.close(fd)

    def _open_fetched(self, hdr, fds, opened):
        """Open the files to fetch beneath /work only (openat2 RESOLVE_BENEATH: no symlink out
        of it, no /proc magic link) and with the call's own rights; nothing of them is read
        into this process."""
        files = []
        budget = hdr["max_fetch_total"]
        os.setegid(self.gid)
        os.seteuid(self.uid)
        try:
            for path in hdr["fetch"]:
                try:
                    fd = _open_beneath(self.workdir_fd, path)
                except OSError as exc:
                    files.append((path, -1, _OPEN_ERRORS.get(exc.errno) or (exc.strerror or str(exc)).lower()))
                    continue
                opened.append(fd)
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    files.append((path, -1, "not a regular file"))
                elif st.st_size > min(hdr["max_fetch"], budget):
                    files.append((path, -1, f"{st.st_size} bytes is over the fetch limit"))
                else:
                    budget -= st.st_size
                    files.append((path, st.st_size, ""))
                    fds.append((fd, st.st_size))
        finally:
            os.seteuid(0)
            os.setegid(0)
        return files

    def cleanup(self):
        """Wipe what the call left in the writable mounts. Adding or removing an entry changes a
        directory's size (tmpfs counts them) and times, so one fstat per mount tells whether
        there is anything to do; /work, which the call owns, is also reset to its owner, mode,
        times and (no) extended attributes."""
        for path, fd in self.dirs:
            st = os.fstat(fd)
            if _state(st) == self.clean.get(path) and (path != WORKDIR or not os.listxattr(fd)):
                continue
            _empty(path)
            if path == WORKDIR:
                for name in os.listxattr(fd):
                    os.removexattr(fd, name)
                os.fchown(fd, self.uid, self.gid)
                os.fchmod(fd, 0o700)
                os.utime(fd)
            self.clean[path] = _state(os.fstat(fd))


class _NativeLoop(ctypes.Structure):
    """``struct dsec_zygote`` of ``dsec/native/zygote.c``."""

    _fields_ = [("chan_in", ctypes.c_int), ("chan_out", ctypes.c_int), ("statm_fd", ctypes.c_int),
                ("workdir_fd", ctypes.c_int), ("devnull_fd", ctypes.c_int), ("ruleset_fd", ctypes.c_int),
                ("ndirs", ctypes.c_int), ("dir_fds", ctypes.c_int * 8),
                ("uid", ctypes.c_uint), ("gid", ctypes.c_uint), ("before_fork", ctypes.c_void_p),
                ("after_fork_parent", ctypes.c_void_p), ("after_fork_child", ctypes.c_void_p),
                ("code", ctypes.c_void_p), ("env", ctypes.c_void_p), ("code_len", ctypes.c_uint),
                ("env_len", ctypes.c_uint), ("memory", ctypes.c_ulonglong), ("vsz", ctypes.c_ulonglong),
                ("error", ctypes.c_char * 512)]


# What os.fork calls around fork(2): at-fork hooks (os.register_at_fork), the import lock, and
# in the child the interpreter's thread state.
_FORK_HOOKS = (("before_fork", "PyOS_BeforeFork"), ("after_fork_parent", "PyOS_AfterFork_Parent"),
               ("after_fork_child", "PyOS_AfterFork_Child"))


def _load_loop(path):
    """The C loop's entry point, or None (then the Python loop serves, and the log says why).
    Loaded with PyDLL: the GIL stays held, as the fork hooks it calls need."""
    if not path:
        return None
    try:
        serve = ctypes.PyDLL(path).dsec_zygote_serve
        for _, name in _FORK_HOOKS:
            getattr(ctypes.pythonapi, name)
    except (OSError, AttributeError) as exc:
        print(f"fncall zygote: the Python loop serves: cannot load {path}: {exc}")
        return None
    serve.restype = ctypes.c_int
    serve.argtypes = (ctypes.POINTER(_NativeLoop),)
    return serve


def _code_to_huge_pages(path):
    """Move the interpreter's code onto huge pages, where each child gets it without a fault
    (``dsec_zygote_code_to_huge_pages`` in ``dsec/native/zygote.c``): the bytes moved."""
    try:
        move = ctypes.PyDLL(path).dsec_zygote_code_to_huge_pages
    except (OSError, AttributeError):
        return 0
    move.restype = ctypes.c_long
    return max(0, move())


def _state(st):
    return st.st_size, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ctime_ns


def _rmtree(path):
    """Remove a directory tree without following symlinks (whoever made it is dead). Too deep a
    tree raises, which ends the zygote: the edge then replaces the worker."""
    _empty(path)
    os.rmdir(path)


def _empty(path):
    """Remove what a directory holds, as ``_rmtree`` does, and keep the directory."""
    with os.scandir(path) as it:
        entries = list(it)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            _rmtree(entry.path)
        else:
            os.unlink(entry.path)


# -- Landlock: what a call may touch -------------------------------------------------------------

_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_RULESET = -1  # made once by main(); each child enforces it on itself


def _landlock_ruleset():
    """The calls' Landlock ruleset (-1 when the kernel has no Landlock): read and run anything;
    write only beneath /work, /tmp and /dev/shm, to device nodes and to /proc's own files (the
    root is read-only anyway); and, from ABI 6, no signal to and no abstract unix socket of any
    process outside the call, such as this zygote. Built once: a child pays one system call."""
    abi = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)  # 1: ..._VERSION
    if abi < 1:
        return -1
    read = 1 << 0 | 1 << 2 | 1 << 3  # EXECUTE, READ_FILE, READ_DIR
    write = 1 << 1 | (1 << 14 if abi >= 3 else 0)  # WRITE_FILE, TRUNCATE
    ioctl = 1 << 15 if abi >= 5 else 0  # IOCTL_DEV
    every = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | write | ioctl
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    attr = ctypes.create_string_buffer(struct.pack("=QQQ", every, 0, 3 if abi >= 6 else 0)[:size])
    ruleset = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, attr, size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    for path, rights in (("/", read), ("/dev", read | write | ioctl), ("/proc", read | write),
                         (WORKDIR, every), ("/tmp", every), ("/dev/shm", every)):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd))  # landlock_path_beneath_attr
        rc = _libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0)
        os.close(fd)
        if rc < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
    return ruleset


def _confine_call():
    """In a call's child, before anything of the call runs: enforce the ruleset (quietly:
    LOG_SAME_EXEC_OFF where the kernel audits Landlock denials)."""
    if _RULESET >= 0 and _libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, _RULESET, 1) < 0:
        if ctypes.get_errno() != 22 or _libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, _RULESET, 0) < 0:  # EINVAL: ABI < 7
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")


_OPEN_ERRORS = {2: "no such file", 20: "no such file", 40: "a symbolic link", 13: "permission denied",
                18: "outside the working directory"}
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x02, 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _open_beneath(dir_fd, path):
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _kill_others():
    """kill(-1, SIGKILL): every process but the pid namespace's init and this one."""
    try:
        os.kill(-1, _signal.SIGKILL)
    except ProcessLookupError:
        pass


_WARMUP = """
import sys
def f(n):
    return [i * 2 for i in range(n) if i % 3] + [len(",".join(map(str, range(3))))]
class C:
    def __init__(self, x):
        self.x = x
try:
    {"a": 1}["b"]
except KeyError as exc:
    message = f"{exc!r} {C(2).x:>4} {sum(f(10))}"
print(message, 1.5, (1, 2), None, file=out)
"""


def _warm_up():
    """Run once what every call runs, so children find it done (see the module docstring)."""
    import io

    saved, sys.stderr = sys.stderr, io.StringIO()
    try:
        exec(compile(_WARMUP, "<string>", "exec"), {"out": io.StringIO()})  # noqa: S102 - our own snippet
        for bad in ("print(", "1 / 0", "raise SystemExit('x')"):
            try:
                exec(compile(bad, "<string>", "exec"), {})  # noqa: S102
            except SystemExit as exc:
                _exit_code_of(exc)
            except BaseException as exc:  # noqa: BLE001
                _print_exception(exc)
    finally:
        sys.stderr = saved
    body = _BODY.pack(0, 1, 4, 1, 1) + b"x" + b"A=b\0" + b"y" + _FILE.pack(1, 1) + b"zw"
    _parse_body(memoryview(body))
    body_fd = os.memfd_create("warm-up", os.MFD_CLOEXEC)  # what a child of the C loop does
    os.write(body_fd, body)
    raw = _read_body_code(body_fd, 1, 4)
    os.close(body_fd)
    str(raw[:1], "utf-8")
    _parse_env(raw[1:])
    _parse_header(memoryview(_HEADER.pack(1.0, 1, 1, 1, 1, 1) + _U16.pack(1) + _U16.pack(1) + b"f"))
    _warm_stdio()


def _warm_stdio():
    """Write and flush through the children's own stdout and stderr once (onto the empty
    placeholder, which is emptied again after): what the first write and flush of a stream set
    up is then done, and a call's child writes its output with 3 page faults fewer (159 against
    162 a call of ``pass``, perf stat over the zygotes). Both streams are left at offset 0 of an
    empty file, as ``_make_stdio`` made them."""
    for stream in _STDIO[1:]:
        print(0, "x", file=stream)
        stream.flush()
        stream.seek(0)
    os.ftruncate(1, 0)  # fds 0-2 are one placeholder


def _inside_a_sandbox():
    """kill(-1) as root outside a pid namespace would end every process of the host: run only
    where pid 1 is a DSec sandbox init."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return f.read().split(b"\0")[0] == INIT_PATH.encode()
    except OSError:
        return False


def main(argv):
    if not _inside_a_sandbox():
        sys.exit(f"{argv[0]}: not inside a DSec sandbox (pid 1 is not {INIT_PATH}); refusing to run")
    global _STDIO
    uid, gid, nproc, fsize, nofile = (int(a) for a in argv[1:6])
    if os.environ.get("LD_BIND_NOW") == BIND_NOW:
        del os.environ["LD_BIND_NOW"]  # the edge's, for this process alone (see BIND_NOW)
    _setup_fds()
    _STDIO = _make_stdio()
    preload = [m for m in (argv[6].split(",") if len(argv) > 6 else []) if m]
    native_loop = _load_loop(argv[7] if len(argv) > 7 else "")
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.setgroups([])
    os.umask(0o022)
    # The limits that are the same for every call are the zygote's own, and so its children's
    # (the zygote forks one child at a time and writes no regular file).
    for limit, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, nofile),
                         (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, fsize)):
        resource.setrlimit(limit, (value, value))
    missing = []
    for name in preload:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    _warm_up()
    zygote = Zygote(uid, gid)
    zygote.cleanup()
    global _RULESET
    _RULESET = _landlock_ruleset()
    # Objects made so far live as long as the zygote: keep the collector from touching (and so
    # copying) their pages in every child.
    _enter_call_state()
    gc.collect()
    gc.freeze()
    huge = _code_to_huge_pages(argv[7]) if native_loop is not None else 0
    loop = "native" if native_loop is not None else "python"
    _answer(b"R", f"{sys.version.split()[0]}\0{','.join(missing)}\0{loop}\0{huge}".encode())
    try:
        if native_loop is not None:
            zygote.serve_native(native_loop)
        else:
            zygote.serve_forever()
    except BaseException as exc:
        sys.stderr = sys.__stderr__ = open(LOG, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                                           buffering=1, closefd=False)
        sys.__excepthook__(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv)
