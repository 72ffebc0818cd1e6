"""Background processes in a sandbox, the same for every kind: kept inside the sandbox itself.

A process started with ``start`` runs in a session of its own, under a small shell supervisor
that waits for it and records its exit code; its stdin is a FIFO, its stdout and stderr are
files. All of it lives under ``/tmp/.dsec-proc/`` in the sandbox (a directory a process, named
``p.XXXXXX``, and a link named by its pid), so it needs nothing from the node:

- a process outlives the request that started it and the client that asked for it;
- an edge restart leaves it running, its output still written and its exit still recorded, and
  ``list`` finds it as before (nothing of it is on the node);
- it dies with the sandbox (it is one of the sandbox's processes).

Its output is kept whole in the sandbox's own disk (under the sandbox's disk limit); a
background process never blocks on its output for want of a reader. ``follow`` streams it from
given offsets as it grows (a loop in the sandbox that looks every 10 ms while output flows and
up to 300 ms apart while it does not), and ends with the process's exit code.

Each operation is one command run through the backend's ``exec`` as the sandbox's root (the
caller's user for ``start``); the scripts use only POSIX sh and the usual tools (mkfifo,
mktemp, setsid, tail, head, wc, kill, sleep: busybox has them all). The scripts exit with
``_NO_SUCH`` / ``_ENDED`` / ``_STDIN_CLOSED`` for the errors they find; ``check`` turns those
into the error tree.
"""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator
from contextlib import aclosing

from libdsec import InvalidRequest, ProcessNotFound, SandboxStateError
from libdsec.protocol import ExecEvent, ExecResult, ProcessInfo

BASE = "/tmp/.dsec-proc"
_NO_SUCH, _ENDED, _STDIN_CLOSED, _SETUP = 91, 92, 93, 90

# The supervisor: holds the FIFO open for writing (so the process sees end of file only when
# its stdin is closed on purpose), runs the process in a session of its own, which hands back
# its pid, and records its exit code (atomically: written, then renamed). Nothing here is
# started with `&` but the holder: a shell starts those with SIGINT ignored, for good (the
# supervisor itself is detached by `setsid setsid`: the second one forks, being a group leader).
# The holder is reaped before the exit is recorded, and after a kill (an idle session, a signal)
# the process's group gets up to a second to be gone (its members die with it; a listing
# right after the exit sees none of them).
_SUPERVISOR = r'''
t=$1
(exec 3<>"$t/in"; exec sleep 2147483647) </dev/null >/dev/null 2>&1 &
echo $! > "$t/holder"
setsid sh -c 'echo $$ > "$0/pid"; echo $$ > "$0/ready"; export DSEC_PROC_DIR="$0"; exec sh -c "$1"' "$t" "$2" < "$t/in" > "$t/out" 2> "$t/err"
rc=$?
h=$(cat "$t/holder"); kill $h 2>/dev/null; wait $h 2>/dev/null
if [ $rc -gt 128 ]; then
  p=$(cat "$t/pid" 2>/dev/null); i=0
  while [ -n "$p" ] && kill -0 -$p 2>/dev/null && [ $i -lt 100 ]; do sleep 0.01; i=$((i + 1)); done
fi
echo $rc > "$t/exit.tmp" && mv "$t/exit.tmp" "$t/exit"
'''

_START = r'''
b=%(base)s
mkdir -p "$b" 2>/dev/null && chmod 1777 "$b" 2>/dev/null
t=$(mktemp -d "$b/p.XXXXXX") || exit %(setup)d
mkfifo "$t/in" "$t/ready" || exit %(setup)d
printf '%%s' %(command)s > "$t/cmd"
: > "$t/out"; : > "$t/err"
setsid setsid sh -c %(supervisor)s dsec "$t" %(command)s </dev/null >/dev/null 2>&1
read p < "$t/ready"
ln -s "${t##*/}" "$b/$p" 2>/dev/null || { rm -f "$b/$p"; ln -s "${t##*/}" "$b/$p"; }
echo "$p"
'''

# Find the process's directory or exit _NO_SUCH.
_FIND = r'''
l=%(base)s/%(pid)d
[ -L "$l" ] || exit %(no_such)d
t=%(base)s/$(readlink "$l")
'''

_SIGNAL = _FIND + r'''
[ -e "$t/exit" ] && { echo "$(cat "$t/exit")"; exit %(ended)d; }
kill -%(signal)d -%(pid)d 2>/dev/null || kill -%(signal)d -- -%(pid)d 2>/dev/null || kill -%(signal)d %(pid)d
'''

_STDIN = _FIND + r'''
[ -e "$t/exit" ] && { echo "$(cat "$t/exit")"; exit %(ended)d; }
[ -e "$t/stdin-closed" ] && exit %(stdin_closed)d
%(write)s
%(close)s
'''

_CLOSE = r'''touch "$t/stdin-closed"; kill $(cat "$t/holder") 2>/dev/null; true'''

_WAIT = _FIND + r'''
while [ ! -e "$t/exit" ]; do sleep 0.05; done
'''

# One line a process: PID EXIT(- while it runs) OUTBYTES ERRBYTES COMMAND… A process whose
# supervisor is gone without an exit code (killed from inside) reads as ended, code -1.
_LIST = r'''
b=%(base)s
for l in "$b"/*; do
  [ -L "$l" ] || continue
  p=${l##*/}
  t=$b/$(readlink "$l")
  x=-
  if [ -e "$t/exit" ]; then x=$(cat "$t/exit")
  elif ! kill -0 "$p" 2>/dev/null && [ ! -e "$t/exit" ]; then x=-1; fi
  printf '%%s %%s %%s %%s ' "$p" "$x" $(wc -c < "$t/out") $(wc -c < "$t/err")
  head -c 200 "$t/cmd" | tr '\n\t\r' '   '
  echo
done
'''

_FOLLOW_LOOP = r'''
o=%(out)d; e=%(err)d; k=0
while :; do
  last=; [ -e "$t/exit" ] && last=1
  n=$(wc -c < "$t/out"); m=$(wc -c < "$t/err"); moved=
  if [ $n -gt $o ]; then tail -c +$((o + 1)) "$t/out" | head -c $((n - o)); o=$n; moved=1; fi
  if [ $m -gt $e ]; then tail -c +$((e + 1)) "$t/err" | head -c $((m - e)) >&2; e=$m; moved=1; fi
  if [ -n "$last" ]; then exit $(cat "$t/exit"); fi
  if [ -n "$moved" ]; then k=0; elif [ $k -lt 5 ]; then k=$((k + 1)); fi
  case $k in 0) sleep 0.01;; 1) sleep 0.02;; 2) sleep 0.05;; 3) sleep 0.1;; 4) sleep 0.2;; *) sleep 0.3;; esac
done
'''
_FOLLOW = _FIND + _FOLLOW_LOOP


def _fill(template: str, **kw) -> str:
    return template % {"base": BASE, "no_such": _NO_SUCH, "ended": _ENDED, "stdin_closed": _STDIN_CLOSED,
                       "setup": _SETUP, **kw}


def start_script(command: str) -> str:
    return _fill(_START, command=shlex.quote(command), supervisor=shlex.quote(_SUPERVISOR))


def signal_script(pid: int, signal: int) -> str:
    return _fill(_SIGNAL, pid=pid, signal=signal)


def stdin_script(pid: int, write: bool, close: bool) -> str:
    return _fill(_STDIN, pid=pid, write='cat > "$t/in"' if write else "", close=_CLOSE if close else "")


def wait_script(pid: int) -> str:
    return _fill(_WAIT, pid=pid) + 'exit $(cat "$t/exit")\n'


def list_script() -> str:
    return _fill(_LIST)


def start_follow_script(command: str) -> str:
    """``start_script`` and ``follow_script`` from the start in one command: the pid on the first
    line of stdout, then the process's output as it writes it, and its exit code as this one's.
    Ending this command (its reader went away) ends only the following, never the process."""
    start = _fill(_START, command=shlex.quote(command), supervisor=shlex.quote(_SUPERVISOR))
    return start + _fill(_FOLLOW_LOOP, out=0, err=0)


def find_script(pid: int) -> str:
    """Exits ``_NO_SUCH`` unless ``pid`` is a process started here (a look at one link: the
    listing of every process is far dearer once a sandbox has run many)."""
    return _fill(_FIND, pid=pid)


def follow_script(pid: int, stdout_offset: int, stderr_offset: int) -> str:
    return _fill(_FOLLOW, pid=pid, out=stdout_offset, err=stderr_offset)


def check(result: ExecResult, pid: int, what: str) -> ExecResult:
    """The error a management script reported, raised; else its result."""
    if result.exit_code == _NO_SUCH:
        raise ProcessNotFound(f"cannot {what}: no background process {pid} in this sandbox (start_shell lists "
                              f"those it started; list_processes shows them)")
    if result.exit_code == _ENDED:
        raise SandboxStateError(f"cannot {what}: process {pid} has exited (exit code {result.stdout.strip()})")
    if result.exit_code == _STDIN_CLOSED:
        raise SandboxStateError(f"cannot {what}: the stdin of process {pid} is closed")
    return result


def started_pid(result: ExecResult) -> int:
    text = result.stdout.strip()
    if result.exit_code != 0 or not text.isdigit():
        detail = (result.stderr.strip() or result.stdout.strip())[-300:]
        raise InvalidRequest(f"cannot start the background process (exit code {result.exit_code}): "
                             f"{detail or 'the sandbox has no /tmp it can write, or no mkfifo/setsid'}")
    return int(text)


async def pid_first(events: AsyncIterator[ExecEvent]) -> AsyncIterator[ExecEvent]:
    """The events of a command whose first line of output is its pid (``echo $$; …``, as
    ``start_follow_script`` and E2B's streamed commands are) as a process stream's: ``started``
    with that line as its data (the command's own ``started`` dropped), then the rest of its
    output and its ``exit``. Whether the line is a pid is the caller's to check."""
    line: str | None = ""
    async with aclosing(events):
        async for event in events:
            if line is not None and event.event == "started":
                continue
            if line is not None and event.event == "stdout":
                line += event.data
                if "\n" not in line:
                    continue
                first, rest = line.split("\n", 1)
                line = None
                yield ExecEvent(event="started", data=first.strip())
                if rest:
                    yield ExecEvent(event="stdout", data=rest)
                continue
            yield event


def parse_list(text: str) -> list[ProcessInfo]:
    found = []
    for line in text.splitlines():
        fields = line.split(" ", 4)
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        pid, code, out, err = fields[:4]
        try:
            exit_code = None if code == "-" else int(code)
            found.append(ProcessInfo(pid=int(pid), command=(fields[4] if len(fields) > 4 else "").rstrip(),
                                     running=exit_code is None, exit_code=exit_code,
                                     stdout_bytes=int(out), stderr_bytes=int(err)))
        except ValueError:
            continue  # a half-written entry (a process starting or ending right now)
    return sorted(found, key=lambda p: p.pid)


# -- sessions: a shell whose state persists, as a background process ----------------------------

_SESSION_DEAD = 94

# The session's process: an idle watchdog (kills the session once no command came for
# IDLE seconds: a client that vanished leaves nothing behind for long), then an interactive
# shell reading commands from the FIFO (interactive: a syntax error or a Ctrl-C does not end it;
# SIGINT ends the command in the foreground and the shell reads on). No prompts.
_SESSION = r'''
d=$DSEC_PROC_DIR
(while sleep %(tick)d; do
  [ -e "$d/exit" ] && exit
  if [ -e "$d/last" ]; then
    now=$(date +%%s); then=$(date -r "$d/last" +%%s) || continue
    [ $((now - then)) -gt %(idle)d ] && { touch "$d/idled"; kill -9 -$$ || kill -9 -- -$$; exit; }
  fi
done) </dev/null >/dev/null 2>&1 &
echo $! > "$d/watchdog"
touch "$d/last"
mkfifo "$d/done" && exec 4<>"$d/done"
exec env PS1= PS2= PS4= ENV= %(shell)s
'''

# One command in the session: the command goes to a file (copied by this script's shell, from
# its stdin: no process started for it), the session's shell is told to source it (``.``: in
# the shell itself, so cd and export persist) with its output to the files o and e (made anew
# each command) and its exit code to rc.NONCE, written as "CODE END" (a line of its own: a syntax
# error abandons the rest of its line in an interactive shell); once that is there the
# output is handed on (streamed as it grows, with ``stream``). Builtins only, but the sleeps.
# Whole (not streamed), the end is not looked for but waited for: the shell also writes
# "CODE END NONCE" to the FIFO ``done``, which it holds open on fd 4 (never to a command: the
# source closes it for the command), and this script blocks reading it — no sleep, no fork for
# a command with no output. (A session from before that FIFO is looked at as before.)
_SESSION_RUN = r'''
t=%(base)s/%(pid)d
[ -L "$t" ] || exit %(no_such)d
[ -e "$t/exit" ] && exit %(dead)d
: > "$t/last"
while IFS= read -r line; do printf '%%s\n' "$line"; done > "$t/c.%(nonce)s"
%(submit)s
k=0; o=0; e=0
while :; do
  rc=; x=; [ -e "$t/rc.%(nonce)s" ] && read rc x < "$t/rc.%(nonce)s"
  dead=; [ -e "$t/exit" ] && dead=1
  if [ "$x" = END ]; then
    %(tail)s
    rm -f "$t/rc.%(nonce)s" "$t/c.%(nonce)s"; exit $rc
  fi
  [ -n "$dead" ] && exit %(dead)d
  moved=
  %(follow)s
  # Every ~2 ms (a sleep's fork and its 1 ms) for the first 100 looks, then slower and slower.
  if [ -n "$moved" ]; then k=0; elif [ $k -lt 300 ]; then k=$((k + 1)); fi
  if [ $k -lt 100 ]; then sleep 0.001; elif [ $k -lt 200 ]; then sleep 0.01; elif [ $k -lt 300 ]; then sleep 0.05
  else sleep 0.2; fi
done
'''

_SESSION_WHOLE = '''[ -s "$t/o" ] && cat "$t/o"; [ -s "$t/e" ] && cat "$t/e" >&2'''

_SESSION_FOLLOW = r'''n=$(wc -c < "$t/o" 2>/dev/null || echo 0); m=$(wc -c < "$t/e" 2>/dev/null || echo 0)
  if [ $n -gt $o ]; then tail -c +$((o + 1)) "$t/o" | head -c $((n - o)); o=$n; moved=1; fi
  if [ $m -gt $e ]; then tail -c +$((e + 1)) "$t/e" | head -c $((m - e)) >&2; e=$m; moved=1; fi'''

_SESSION_REST = r'''[ -s "$t/o" ] && tail -c +$((o + 1)) "$t/o"; [ -s "$t/e" ] && tail -c +$((e + 1)) "$t/e" >&2'''

# After a timeout: Ctrl-C (SIGINT to the session's process group: the shell reads on); if the
# command ignores it, its processes are killed (all of the session's but the shell and its
# watchdog). Exit 0 once the command's exit code is there (it is removed), 3 if it took the
# killing, 1 if never.
_INTERRUPT = _FIND + r'''
[ -e "$t/exit" ] && exit %(dead)d
kill -INT -%(pid)d 2>/dev/null || kill -INT -- -%(pid)d 2>/dev/null
for round in 1 2; do
  i=0
  while [ ! -e "$t/rc.%(nonce)s" ] && [ $i -lt 30 ]; do sleep 0.05; i=$((i + 1)); done
  [ -e "$t/rc.%(nonce)s" ] && { sleep 0.05; rm -f "$t/rc.%(nonce)s" "$t/c.%(nonce)s"; [ $round = 1 ] && exit 0; exit 3; }
  [ -e "$t/exit" ] && exit %(dead)d
  w=$(cat "$t/watchdog" 2>/dev/null)
  for s in /proc/[0-9]*/stat; do
    read -r line < "$s" 2>/dev/null || continue
    p=${s#/proc/}; p=${p%%/stat}
    set -- ${line##*) }
    [ "$4" = %(pid)d ] && [ "$p" != %(pid)d ] && [ "$p" != "$w" ] && [ "$2" != "$w" ] && kill -9 "$p" 2>/dev/null
  done
done
exit 1
'''


# The session's shell: POSIX sh, or bash (no rc files: what to source is the caller's to say;
# job control off, so what it runs stays in the session's process group for Ctrl-C).
_SHELLS = {"sh": "sh -i", "bash": "bash --norc --noprofile +m -i"}


def session_command(idle_timeout_s: float, shell: str = "sh") -> str:
    idle = max(1, int(idle_timeout_s))
    return _fill(_SESSION, idle=idle, tick=max(1, min(10, idle // 4)), shell=_SHELLS[shell])


def session_input(command: str) -> str:
    """The run script's stdin: the command, one line or many, ending in a newline."""
    return command if command.endswith("\n") else command + "\n"


_SUBMIT = r'''printf '. %%s </dev/null >%%s 2>%%s\necho "$? END" > %%s\n' "$t/c.%(nonce)s" "$t/o" "$t/e" "$t/rc.%(nonce)s" > "$t/in"'''

# The whole command's end, waited for on the session's FIFO (its shell holds the writing end:
# when it dies the read sees end of file); lines of earlier commands whose waiter went away are
# skipped. Then the files: rc.NONCE is written just before the FIFO's line.
_SUBMIT_WAIT = r'''if [ -p "$t/done" ]; then
  printf '. %%s </dev/null >%%s 2>%%s 4>&-\n__dsec_rc=$?; echo "$__dsec_rc END" > %%s; echo "$__dsec_rc END %(nonce)s" >&4\n' "$t/c.%(nonce)s" "$t/o" "$t/e" "$t/rc.%(nonce)s" > "$t/in"
  while IFS=' ' read -r rc x n; do [ "$n" = %(nonce)s ] && break; done < "$t/done"
  if [ "$n" = %(nonce)s ]; then
    %(tail)s
    rm -f "$t/rc.%(nonce)s" "$t/c.%(nonce)s"; exit $rc
  fi
else
  ''' + _SUBMIT + r'''
fi'''


def session_run_script(pid: int, nonce: str, stream: bool = False) -> str:
    """Run one command (``session_input`` as stdin); ``stream``: hand its output on as it grows."""
    if stream:
        parts = {"follow": _SESSION_FOLLOW, "tail": _SESSION_REST}
        submit = _SUBMIT % {"nonce": nonce}
    else:
        parts = {"follow": ":", "tail": _SESSION_WHOLE}
        submit = _SUBMIT_WAIT % {"nonce": nonce, "tail": _SESSION_WHOLE}
    return _fill(_SESSION_RUN, pid=pid, nonce=nonce, dead=_SESSION_DEAD, submit=submit, **parts)


def interrupt_script(pid: int, nonce: str) -> str:
    return _fill(_INTERRUPT, pid=pid, nonce=nonce, dead=_SESSION_DEAD)
