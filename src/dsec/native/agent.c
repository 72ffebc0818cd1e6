/* dsec-agent: the DSec guest agent. Serves the host over the virtio-serial port named
 * "dsec.agent", as one process: a poll() loop over the port, the pipes of the running commands
 * and a signalfd for their exits. Built static by dsec.native, shipped in the VM's initramfs
 * and copied to /dev/.dsec/agent by the guest's init (backends/vm/guest/init.sh).
 *
 * Frames. Host to guest: one header line "ID OP ARG…" then the payloads the header announces,
 * by byte length. Guest to host: "ID ok LEN" + LEN bytes, "ID err CODE LEN" + LEN bytes of
 * message, or "ID done RC OUTLEN OUTTOTAL ERRLEN ERRTOTAL" + stdout + stderr.
 *   ping                                  -> ok LEN + "run": the operations this agent has
 *                                            beyond those of the shell agent before it (whose
 *                                            answer was ok 0, and which ran "exec CAP WDLEN
 *                                            SCRIPTLEN STDINLEN" scripts: a VM restored from an
 *                                            old snapshot still runs it)
 *   run CAP WDLEN CMDLEN STDINLEN ENVLEN UID GID
 *                                         payloads: workdir, command (for /bin/sh -c), stdin
 *                                         (STDINLEN -1: none), environment (NUL-separated
 *                                         NAME=VALUE) -> done … when the command ends (answers
 *                                         may come in any order: commands run side by side)
 *   srun CAP WDLEN CMDLEN STDINLEN ENVLEN UID GID
 *                                         as run, but the output streams as it comes: frames
 *                                         "ID sout LEN" / "ID serr LEN" + LEN bytes, then
 *                                         "ID done RC 0 OUTTOTAL 0 ERRTOTAL" (the host keeps
 *                                         what it keeps). At most WINDOW bytes go unacknowledged:
 *                                         past that the job's pipes are not read (its command
 *                                         blocks on its next write) until the host acks
 *   ack JOBID N                           (no answer) the host consumed N more bytes of JOBID
 *   pty COLS ROWS WDLEN CMDLEN ENVLEN UID GID
 *                                         payloads: workdir, command, environment. The command
 *                                         on a terminal of the guest's (a new pty, COLS x ROWS,
 *                                         its controlling terminal: dsec-jail --ctty): "ID part
 *                                         0" once it runs (or err), then its output streams as
 *                                         srun's does, as "sout" frames, then
 *                                         "done RC …". A PTY belongs to the host connection
 *                                         that opened it: when the host goes away (an edge
 *                                         restart) its commands are killed.
 *   ptyin JOBID LEN                       payload: bytes typed at the pty -> ok 0 (they are
 *                                         queued, up to PTY_QUEUE, and written as the terminal
 *                                         takes them), or err invalid
 *   srun with STDINLEN -2                 the command's stdin is a pipe the host feeds: "ID part
 *                                         0" once it runs, then ptyin to it (queued as a pty's
 *                                         input is, "err invalid" past PTY_QUEUE: the host waits
 *                                         and sends again), ptyeof to close it once written;
 *                                         the job dies with the host's connection, as a pty's
 *   ptyeof JOBID                          -> ok 0: the job's stdin is closed once its queued
 *                                         input is written
 *   ptysz JOBID COLS ROWS                 -> ok 0: the terminal's size (the command gets SIGWINCH)
 *   kill JOBID                            -> ok 0; the job's command and all it started die
 *   read PATHLEN MAX                      -> ok LEN + the file, or err enoent|invalid
 *   write PATHLEN DATALEN MODE UID GID    -> ok 0 or err invalid
 *   mkdir PATHLEN UID GID                 -> ok 0 or err invalid
 *   shutdown                              -> ok 0, then the VM powers off
 *   clock SEC NSEC                        -> ok 0: the guest's wall clock set to the host's (a
 *                                            guest restored from memory saved earlier wakes with
 *                                            the clock it had then), or err invalid
 *   ident HOSTLEN SEEDLEN                 payloads: a host name, random bytes -> ok 0: the
 *                                         guest becomes someone new (a fork's child, restored
 *                                         from its parent's memory): its host name set, the
 *                                         bytes mixed into the kernel's entropy pool and the
 *                                         random number generator reseeded from it at once
 *                                         (RNDRESEEDCRNG), so no two children share a random
 *                                         stream; or err invalid
 *   changed                               -> ok LEN + the NUL-separated paths (relative to the
 *                                            root) of the files the writable layer holds under
 *                                            bin, sbin, etc, usr and lib*, and of root's and each
 *                                            home's own entries and their .local trees: where
 *                                            the host looks for tampering (dsec.images.carry);
 *                                            directories and whiteouts left out, at most
 *                                            CHANGED_MAX bytes of names (err invalid if none)
 *   pack TOKEN                            -> "ID part LEN" + LEN bytes, repeated: a tar of the
 *                                            root's writable layer (/dev/.dsec/rw/upper), taken
 *                                            with the commands' cgroups frozen; then ok LEN + the
 *                                            NUL-separated paths of a probe file named TOKEN that
 *                                            stays visible (the host finds opaque dirs from them;
 *                                            the probe is guest/pack.sh, run by busybox)
 * Only this loop writes to the port, a whole frame at a time, so frames never interleave (a
 * pack runs in a child process of its own and hands its frames over a pipe, whole).
 *
 * Each command runs in a cgroup of its own (so a kill takes everything it started), with its
 * output read from pipes, kept up to CAP bytes a stream and the rest counted. The answer goes
 * once the command has exited and both pipes are at end of file; a background process that
 * keeps them open is not waited for more than half a second after that (the pipes are closed).
 *
 * Each command runs confined by dsec-jail (the sandbox capability set, no_new_privs, the sandbox
 * seccomp profile, Landlock) in the sandbox's pid namespace, as the uid and gid asked, in the
 * workdir asked, with only the environment given; the jail execs /bin/sh -c COMMAND itself, so
 * a command costs two execs (the jail's and the shell's). It runs without the channel's fd (every
 * fd of the agent is close-on-exec, and the jail closes all above 2): it sees the processes of
 * the sandbox's commands but cannot see or signal this agent, and cannot open the port, this
 * directory or any device but the usual few; /proc and /sys are read-only to it. Its stdin is a
 * memfd holding what the host sent (or /dev/null).
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <termios.h>
#include <string.h>
#include <linux/random.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/reboot.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define D "/dev/.dsec"
#define CG "/sys/fs/cgroup/dsec"
#define BUSYBOX D "/busybox"
#define MAX_JOBS 256
#define MAX_PACKS 4
#define IDLEN 32
#define LINE_MAX_LEN 4096
#define PART_BYTES (1 << 20)
#define LINGER_MS 500      /* how long pipes held open by a background process are waited for */
#define UNCONNECTED_MS 20  /* the host is not connected: look again this often */
#define WINDOW (256 << 10) /* bytes of a streamed job's output sent and not acked yet, at most */
#define PTY_QUEUE (1 << 20) /* bytes typed at a pty and not taken by it yet, at most */
#define CHANGED_MAX (1 << 20) /* bytes of names a "changed" answer holds, at most */

struct buf {
    char *data;
    size_t len, cap;
};

struct stream {
    int fd;           /* -1 once at end of file (or closed) */
    struct buf kept;  /* the first `limit` bytes */
    uint64_t total;
};

struct job {
    int used;
    char id[IDLEN];
    char cgroup[64];
    pid_t pid;       /* the jail; 0 once reaped */
    int rc;
    size_t limit;
    struct stream out, err;
    int64_t deadline; /* ms: set when the jail exits */
    int stream;        /* srun: output goes to the host as it comes */
    uint64_t unacked;  /* streamed bytes the host has not acked */
    int tty;           /* pty: the master, for input and the size (out.fd reads it); else -1 */
    struct buf typed;  /* pty (or a fed stdin): input not written yet */
    int eof;           /* a fed stdin: close it once `typed` is written */
};

struct pack {
    int used;
    pid_t pid;
    int fd;         /* frames from the pack process; -1 at end of file */
    struct buf in;  /* bytes of frames not forwarded yet */
};

static struct job jobs[MAX_JOBS];
static struct pack packs[MAX_PACKS];
static int port = -1;
static char **jail_argv;  /* the jail's fixed arguments, room left for a command's own */
static int jail_argc;
static unsigned long job_seq;
/* A job's cgroup, made ahead (while the agent is idle, after an answer was sent) so that a
 * command's start does not wait for it: in a VM restored from a snapshot, the kernel's code for
 * it is not translated yet (TCG) and the first command is the one timed. */
static char spare[64];

/* -- small helpers ----------------------------------------------------------------------- */

static void console(const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int fd = open("/dev/ttyS0", O_WRONLY | O_NOCTTY | O_CLOEXEC);
    if (fd >= 0) {
        dprintf(fd, "dsec-agent: %s\n", msg);
        close(fd);
    }
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static int buf_add(struct buf *b, const void *data, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n)
            cap *= 2;
        char *p = realloc(b->data, cap);
        if (!p)
            return -1;
        b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->len, data, n);
    b->len += n;
    return 0;
}

static void buf_free(struct buf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

static int write_all(int fd, const void *data, size_t n)
{
    const char *p = data;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = write_all(fd, text, strlen(text));
    close(fd);
    return rc;
}

/* Whole file into `b` (up to `max` bytes; more is an error). */
static int read_fd(int fd, struct buf *b, uint64_t max)
{
    char chunk[65536];
    for (;;) {
        ssize_t r = read(fd, chunk, sizeof chunk);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            return 0;
        if (b->len + (size_t)r > max || buf_add(b, chunk, (size_t)r) < 0)
            return -1;
    }
}

/* -- frames to the host ------------------------------------------------------------------ */

/* One frame: the header line and its payloads, written whole before anything else is. */
static void send_frame(const char *header, const void *p1, size_t n1, const void *p2, size_t n2)
{
    struct iovec iov[3];
    size_t hlen = strlen(header);
    iov[0] = (struct iovec){(void *)header, hlen};
    iov[1] = (struct iovec){(void *)p1, n1};
    iov[2] = (struct iovec){(void *)p2, n2};
    size_t total = hlen + n1 + n2, done = 0;
    while (done < total) {
        /* Skip what is written, then write the rest (short writes are normal on a port). */
        struct iovec rest[3];
        int k = 0;
        size_t skip = done;
        for (int i = 0; i < 3; i++) {
            if (skip >= iov[i].iov_len) {
                skip -= iov[i].iov_len;
                continue;
            }
            rest[k++] = (struct iovec){(char *)iov[i].iov_base + skip, iov[i].iov_len - skip};
            skip = 0;
        }
        ssize_t w = writev(port, rest, k);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return;  /* the port went away: the host will not read this answer anyway */
        }
        done += (size_t)w;
    }
}

static void send_ok(const char *id, const void *data, size_t n)
{
    char header[IDLEN + 64];
    snprintf(header, sizeof header, "%s ok %zu\n", id, n);
    send_frame(header, data, n, NULL, 0);
}

static void send_err(const char *id, const char *code, const char *fmt, ...)
{
    char msg[8192], header[IDLEN + 64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(header, sizeof header, "%s err %s %zu\n", id, code, strlen(msg));
    send_frame(header, msg, strlen(msg), NULL, 0);
}

/* -- requests from the host -------------------------------------------------------------- */

static char inbuf[65536];
static size_t in_start, in_end;
static int connected = 1;

/* The host went away: the PTYs it opened are killed (nobody can read or type at them again). */
static void host_gone(void)
{
    connected = 0;
    for (int i = 0; i < MAX_JOBS; i++)
        if (jobs[i].used && jobs[i].tty >= 0 && jobs[i].pid) {
            char path[96];
            snprintf(path, sizeof path, "%s/cgroup.kill", jobs[i].cgroup);
            write_file(path, "1");
            jobs[i].stream = 0;
            jobs[i].unacked = 0;
        }
}

/* Write what was typed at a pty, as far as the terminal takes it now. */
static void type_out(struct job *j)
{
    while (j->typed.len > 0) {
        ssize_t w = write(j->tty, j->typed.data, j->typed.len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            if (errno != EAGAIN)
                j->typed.len = 0;  /* the terminal is gone (its command ended) */
            return;
        }
        memmove(j->typed.data, j->typed.data + w, j->typed.len - (size_t)w);
        j->typed.len -= (size_t)w;
    }
    if (j->eof && j->tty >= 0) {  /* a fed stdin, all written: its end */
        close(j->tty);
        j->tty = -1;
    }
}

/* Exactly n bytes from the port into `out` (NULL: read and drop them). -1 when the host went
 * away in the middle (the request is dropped). */
static int take(char *out, size_t n)
{
    while (n > 0) {
        if (in_start == in_end) {
            ssize_t r = read(port, inbuf, sizeof inbuf);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                host_gone();
                in_start = in_end = 0;
                return -1;
            }
            in_start = 0;
            in_end = (size_t)r;
        }
        size_t k = in_end - in_start < n ? in_end - in_start : n;
        if (out) {
            memcpy(out, inbuf + in_start, k);
            out += k;
        }
        in_start += k;
        n -= k;
    }
    return 0;
}

/* A payload of `len` bytes as a NUL-terminated string in fresh memory (*out NULL when there
 * was no memory for it: its bytes are dropped). -1 when the host went away. */
static int take_payload(long long len, char **out)
{
    *out = NULL;
    if (len < 0)
        return 0;
    char *p = malloc((size_t)len + 1);
    if (take(p, (size_t)len) < 0) {
        free(p);
        return -1;
    }
    if (p)
        p[len] = '\0';
    *out = p;
    return 0;
}

/* Ids and tokens end up in paths and frames: letters, digits, '-' and '_' only. */
static int plain_word(const char *s, size_t max)
{
    size_t n = strlen(s);
    if (n == 0 || n >= max)
        return 0;
    for (; *s; s++)
        if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
              *s == '-' || *s == '_' || *s == '.'))
            return 0;
    return 1;
}

static int number(const char *s, long long *out)
{
    char *end;
    if (!s || !*s)
        return -1;
    errno = 0;
    *out = strtoll(s, &end, 10);
    return (*end || errno) ? -1 : 0;
}

/* -- commands ---------------------------------------------------------------------------- */

static void reset_child_signals(void)
{
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    /* The guest's init starts the agent in the background of a shell, which ignores these for
     * it; commands get them as a command would (Ctrl-C, as a session's interrupt sends, works). */
    signal(SIGINT, SIG_DFL);
    signal(SIGQUIT, SIG_DFL);
}

/* The next job's cgroup: a name of the agent's own (the host's ids start again at 1 in a clone
 * of a snapshot, where a cgroup of an earlier job may linger). */
static int make_spare(void)
{
    while (!spare[0]) {
        char path[64];
        snprintf(path, sizeof path, CG "/job%lu", ++job_seq);
        if (mkdir(path, 0755) == 0)
            snprintf(spare, sizeof spare, "%s", path);
        else if (errno != EEXIST)
            return -1;
    }
    return 0;
}

static struct job *job_by_id(const char *id)
{
    for (int i = 0; i < MAX_JOBS; i++)
        if (jobs[i].used && strcmp(jobs[i].id, id) == 0)
            return &jobs[i];
    return NULL;
}

static void start_job(const char *id, long long cap, const char *wd, const char *command, const char *stdin_data,
                      long long stdin_len, char *env, size_t env_len, const char *user, int stream,
                      const struct winsize *pty)
{
    struct job *j = NULL;
    for (int i = 0; i < MAX_JOBS && !j; i++)
        if (!jobs[i].used)
            j = &jobs[i];
    if (!j) {
        send_err(id, "invalid", "too many commands running at once (%d)", MAX_JOBS);
        return;
    }
    char cgroup[64];
    if (!spare[0] && make_spare() < 0) {
        send_err(id, "invalid", "cannot make a cgroup for the command: %s", strerror(errno));
        return;
    }
    snprintf(cgroup, sizeof cgroup, "%s", spare);
    spare[0] = '\0';
    int in = -1, out[2] = {-1, -1}, err[2] = {-1, -1}, master = -1;
    char slave[128] = "";
    if (pty) {
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        const char *name = master >= 0 && grantpt(master) == 0 && unlockpt(master) == 0 ? ptsname(master) : NULL;
        if (!name || ioctl(master, TIOCSWINSZ, pty) < 0) {
            send_err(id, "invalid", "cannot open a terminal for the command: %s", strerror(errno));
            goto fail;
        }
        snprintf(slave, sizeof slave, "%s", name);
        in = open("/dev/null", O_RDONLY | O_CLOEXEC);
        out[0] = fcntl(master, F_DUPFD_CLOEXEC, 0);  /* the output's reader; `master` writes */
        if (in < 0 || out[0] < 0) {
            send_err(id, "invalid", "cannot set up the command's terminal: %s", strerror(errno));
            goto fail;
        }
    } else if (stdin_len == -2) {  /* fed by the host (ptyin), the write end held as a pty's master */
        int fed[2];
        if (pipe2(fed, O_CLOEXEC) == 0) {
            in = fed[0];
            master = fed[1];
        }
    } else if (stdin_len >= 0) {
        in = memfd_create("stdin", MFD_CLOEXEC);
        if (in >= 0 && (write_all(in, stdin_data, (size_t)stdin_len) < 0 || lseek(in, 0, SEEK_SET) < 0)) {
            close(in);
            in = -1;
        }
    } else {
        in = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    if (!pty && (in < 0 || pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0)) {
        send_err(id, "invalid", "cannot set up the command's input and output: %s", strerror(errno));
        goto fail;
    }
    char procs[96];
    snprintf(procs, sizeof procs, "%s/cgroup.procs", cgroup);
    /* The environment: the payload's NUL-separated entries, pointed at in place. */
    size_t n_env = 0;
    for (size_t k = 0; k < env_len; k++)
        n_env += env[k] == '\0';
    char **envp = calloc(n_env + 2, sizeof *envp);
    if (!envp) {
        send_err(id, "invalid", "cannot start the command: out of memory");
        goto fail;
    }
    n_env = 0;
    for (size_t k = 0; k < env_len; k += strlen(env + k) + 1)
        if (env[k])
            envp[n_env++] = env + k;
    int argc = jail_argc;
    jail_argv[argc++] = "--cwd";
    jail_argv[argc++] = (char *)wd;
    jail_argv[argc++] = "--user";
    jail_argv[argc++] = (char *)user;
    if (pty)
        jail_argv[argc++] = "--ctty";
    jail_argv[argc++] = "--";
    jail_argv[argc++] = "/bin/sh";
    jail_argv[argc++] = "-c";
    jail_argv[argc++] = (char *)command;
    jail_argv[argc] = NULL;
    pid_t pid = fork();
    if (pid != 0)
        free(envp);
    if (pid < 0) {
        send_err(id, "invalid", "cannot start the command: %s", strerror(errno));
        goto fail;
    }
    if (pid == 0) {
        reset_child_signals();
        char self[32];
        snprintf(self, sizeof self, "%d", getpid());
        if (write_file(procs, self) < 0)
            _exit(125);
        if (pty) {
            /* A session without a terminal here; the jail's child, in the sandbox's pid
             * namespace, takes the terminal as its own (--ctty). */
            int t = setsid() < 0 ? -1 : open(slave, O_RDWR | O_NOCTTY);
            if (t < 0 || dup2(t, 0) < 0 || dup2(t, 1) < 0 || dup2(t, 2) < 0)
                _exit(125);
        } else if (dup2(in, 0) < 0 || dup2(out[1], 1) < 0 || dup2(err[1], 2) < 0)
            _exit(125);
        execve(jail_argv[0], jail_argv, envp);
        _exit(127);
    }
    {
        /* In its cgroup before anything else is served (the child puts itself there too): a
         * kill that comes right after the start finds it. */
        char pid_text[32];
        snprintf(pid_text, sizeof pid_text, "%d", pid);
        write_file(procs, pid_text);
    }
    close(in);
    if (out[1] >= 0)
        close(out[1]);
    if (err[1] >= 0)
        close(err[1]);
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    if (err[0] >= 0)
        fcntl(err[0], F_SETFL, O_NONBLOCK);
    memset(j, 0, sizeof *j);
    j->used = 1;
    snprintf(j->id, sizeof j->id, "%s", id);
    snprintf(j->cgroup, sizeof j->cgroup, "%s", cgroup);
    j->pid = pid;
    j->limit = (size_t)cap;
    j->stream = stream;
    j->out.fd = out[0];
    j->err.fd = err[0];
    j->tty = master;
    if (master >= 0) {
        fcntl(master, F_SETFL, O_NONBLOCK);
        char header[IDLEN + 16];
        snprintf(header, sizeof header, "%s part 0\n", id);  /* it runs */
        send_frame(header, NULL, 0, NULL, 0);
    }
    return;
fail:
    if (master >= 0)
        close(master);
    for (int k = 0; k < 2; k++) {
        if (out[k] >= 0)
            close(out[k]);
        if (err[k] >= 0)
            close(err[k]);
    }
    if (in >= 0)
        close(in);
    rmdir(cgroup);
}

/* start_job, once its payloads came whole and its workdir is there. */
static void start_checked(const char *id, long long cap, const char *wd, const char *command, const char *stdin_data,
                          long long stdin_len, char *env, size_t env_len, const char *user, int stream,
                          const struct winsize *pty)
{
    struct stat st;
    if (!wd || !command || !env)
        send_err(id, "invalid", "cannot start the command: out of memory");
    else if (job_by_id(id))
        send_err(id, "invalid", "a command with id %s is running", id);
    else if (stat(wd, &st) < 0 || !S_ISDIR(st.st_mode))
        send_err(id, "notdir", "workdir %s is not a directory in the sandbox", wd);
    else
        start_job(id, cap, wd, command, stdin_data, stdin_len, env, env_len, user, stream, pty);
}

/* Read what is there (one chunk: a command that writes without end must not starve the loop);
 * a streamed job's chunks go to the host at once. */
static void drain(struct job *j, struct stream *s, int once)
{
    size_t limit = j->limit;
    char chunk[65536];
    while (s->fd >= 0) {
        ssize_t r = read(s->fd, chunk, sizeof chunk);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EAGAIN)
            return;
        if (r <= 0) {
            close(s->fd);
            s->fd = -1;
            return;
        }
        s->total += (uint64_t)r;
        if (j->stream) {
            char header[IDLEN + 64];
            snprintf(header, sizeof header, "%s %s %zd\n", j->id, s == &j->out ? "sout" : "serr", r);
            send_frame(header, chunk, (size_t)r, NULL, 0);
            j->unacked += (uint64_t)r;
            if (j->pid == 0)
                j->deadline = now_ms() + LINGER_MS;  /* still flowing after the command ended */
            if (once || j->unacked >= WINDOW)
                return;
            continue;
        }
        if (s->kept.len < limit) {
            size_t k = limit - s->kept.len < (size_t)r ? limit - s->kept.len : (size_t)r;
            buf_add(&s->kept, chunk, k);  /* out of memory: less is kept, the total still counts */
        }
        if (once)
            return;
    }
}

/* Cgroups of jobs that ended while processes they started lived on: removed once empty. */
static void sweep_cgroups(void)
{
    DIR *dir = opendir(CG);
    if (!dir)
        return;
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (strncmp(e->d_name, "job", 3) != 0)
            continue;
        char path[300];
        snprintf(path, sizeof path, CG "/%s", e->d_name);
        int live = strcmp(path, spare) == 0;
        for (int i = 0; i < MAX_JOBS && !live; i++)
            live = jobs[i].used && strcmp(jobs[i].cgroup, path) == 0;
        if (!live)
            rmdir(path);
    }
    closedir(dir);
}

static void finish_job(struct job *j)
{
    if (!j->stream) {
        drain(j, &j->out, 0);
        drain(j, &j->err, 0);
    }
    struct stream *streams[2] = {&j->out, &j->err};
    for (int k = 0; k < 2; k++)
        if (streams[k]->fd >= 0) {
            close(streams[k]->fd);  /* a background process holds it open: it gets EPIPE from now on */
            streams[k]->fd = -1;
        }
    char header[IDLEN + 128];
    snprintf(header, sizeof header, "%s done %d %zu %llu %zu %llu\n", j->id, j->rc, j->out.kept.len,
             (unsigned long long)j->out.total, j->err.kept.len, (unsigned long long)j->err.total);
    send_frame(header, j->out.kept.data, j->out.kept.len, j->err.kept.data, j->err.kept.len);
    buf_free(&j->out.kept);
    buf_free(&j->err.kept);
    if (j->tty >= 0)
        close(j->tty);
    j->tty = -1;
    buf_free(&j->typed);
    j->used = 0;
    rmdir(j->cgroup);
    sweep_cgroups();
    make_spare();
}

/* -- files ------------------------------------------------------------------------------- */

static void do_read(const char *id, const char *path, const char *max_text)
{
    long long max;
    struct stat st;
    if (number(max_text, &max) < 0) {
        send_err(id, "invalid", "malformed read request");
        return;
    }
    if (stat(path, &st) < 0) {
        send_err(id, "enoent", "no such file in sandbox: %s", path);
        return;
    }
    if (S_ISDIR(st.st_mode)) {
        send_err(id, "invalid", "cannot read %s: is a directory", path);
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        send_err(id, "invalid", "cannot read %s: not a regular file", path);
        return;
    }
    if (st.st_size > max) {
        send_err(id, "invalid", "cannot read %s: %lld bytes is over the %s-byte limit", path, (long long)st.st_size, max_text);
        return;
    }
    /* Opened without blocking and checked again: a command may have put a FIFO there since. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    struct buf data = {0};
    if (fd < 0 || fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))
        send_err(id, "invalid", "cannot read %s: permission denied", path);
    else if (read_fd(fd, &data, (uint64_t)max) < 0)
        send_err(id, "invalid", "cannot read %s: it changed while read, or grew over the %s-byte limit", path, max_text);
    else
        send_ok(id, data.data, data.len);
    if (fd >= 0)
        close(fd);
    buf_free(&data);
}

/* The missing directories of `dir`, made and owned by uid:gid. */
static int makedirs(const char *dir, uid_t uid, gid_t gid)
{
    struct stat st;
    if (stat(dir, &st) == 0)
        return S_ISDIR(st.st_mode) ? 0 : -1;
    if (errno != ENOENT)
        return -1;
    char *copy = strdup(dir);
    if (!copy)
        return -1;
    int rc = makedirs(dirname(copy), uid, gid);
    free(copy);
    if (rc < 0)
        return -1;
    if (mkdir(dir, 0777) == 0 && chown(dir, uid, gid) < 0)
        console("cannot chown %s: %s", dir, strerror(errno));  /* as before: the directory is there */
    return stat(dir, &st) == 0 && S_ISDIR(st.st_mode) ? 0 : -1;
}

static void do_write(const char *id, const char *path, const char *data, size_t len, const char *mode_text,
                     const char *uid_text, const char *gid_text)
{
    long long uid, gid;
    char *end;
    unsigned long mode = strtoul(mode_text ? mode_text : "", &end, 8);
    if (!mode_text || !*mode_text || *end || number(uid_text, &uid) < 0 || number(gid_text, &gid) < 0) {
        send_err(id, "invalid", "malformed write request");
        return;
    }
    char *copy = strdup(path);
    const char *dir = copy ? dirname(copy) : "/";
    struct stat st;
    int existed = stat(path, &st) == 0;
    int fd = -1;
    if (!data) {
        send_err(id, "invalid", "cannot write %s: out of memory", path);
    } else if (makedirs(dir, (uid_t)uid, (gid_t)gid) < 0) {
        send_err(id, "invalid", "cannot write %s: cannot create directory %s", path, dir);
    } else if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        send_err(id, "invalid", "cannot write %s: Is a directory", path);
    } else if ((fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0666)) < 0 ||
               fcntl(fd, F_SETFL, 0) < 0 || write_all(fd, data, len) < 0) {
        send_err(id, "invalid", "cannot write %s: cannot open the file", path);
    } else {
        if (existed || fchown(fd, (uid_t)uid, (gid_t)gid) == 0)
            fchmod(fd, (mode_t)mode);
        send_ok(id, NULL, 0);
    }
    if (fd >= 0)
        close(fd);
    free(copy);
}

/* -- changed: where the host looks for tampering ---------------------------------------- */

/* Append the files under the directory `fd` (named `rel`, relative to the upper) to `out`, every
 * level (`deep`) or its own entries only; links are listed, never followed. Closes `fd`. */
static void list_files(int fd, const char *rel, int deep, struct buf *out)
{
    DIR *dir = fdopendir(fd);
    if (!dir) {
        close(fd);
        return;
    }
    struct dirent *e;
    while ((e = readdir(dir)) && out->len < CHANGED_MAX) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char path[4096];
        if (snprintf(path, sizeof path, "%s/%s", rel, e->d_name) >= (int)sizeof path)
            continue;
        struct stat st;
        if (fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue;
        if (S_ISDIR(st.st_mode)) {
            int sub = deep ? openat(dirfd(dir), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
            if (sub >= 0)
                list_files(sub, path, 1, out);
        } else if (!(S_ISCHR(st.st_mode) && st.st_rdev == 0)) {  /* a 0/0 device is a whiteout */
            buf_add(out, path, strlen(path) + 1);
        }
    }
    closedir(dir);
}

static void do_changed(const char *id)
{
    int up = open(D "/rw/upper", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *top = up >= 0 ? fdopendir(dup(up)) : NULL;
    if (!top) {
        send_err(id, "invalid", "this VM has no writable layer at %s", D "/rw/upper");
        if (up >= 0)
            close(up);
        return;
    }
    struct buf out = {0};
    struct dirent *e;
    while ((e = readdir(top))) {
        const char *n = e->d_name;
        int system = strcmp(n, "bin") == 0 || strcmp(n, "sbin") == 0 || strcmp(n, "etc") == 0 ||
                     strcmp(n, "usr") == 0 || strncmp(n, "lib", 3) == 0;
        int fd = system || strcmp(n, "root") == 0 || strcmp(n, "home") == 0
                     ? openat(up, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
        struct stat st;
        if (fd < 0 && system && fstatat(up, n, &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(st.st_mode) &&
            !(S_ISCHR(st.st_mode) && st.st_rdev == 0))
            buf_add(&out, n, strlen(n) + 1);  /* /bin itself replaced by a file or a link */
        if (fd < 0)
            continue;
        if (system) {
            list_files(fd, n, 1, &out);
            continue;
        }
        /* root, and each home: its own entries (start-up files), and its .local (Python's hooks). */
        char homes[64][300];
        int n_homes = 0;
        if (strcmp(n, "root") == 0) {
            snprintf(homes[n_homes++], sizeof homes[0], "root");
            close(fd);
        } else {
            DIR *h = fdopendir(fd);
            struct dirent *he;
            while (h && (he = readdir(h)) && n_homes < 64)
                if (strcmp(he->d_name, ".") != 0 && strcmp(he->d_name, "..") != 0)
                    snprintf(homes[n_homes++], sizeof homes[0], "home/%.250s", he->d_name);
            if (h)
                closedir(h);
        }
        for (int i = 0; i < n_homes; i++) {
            int hf = openat(up, homes[i], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (hf < 0)
                continue;
            int local = openat(hf, ".local", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            list_files(hf, homes[i], 0, &out);
            if (local >= 0) {
                char rel[320];
                snprintf(rel, sizeof rel, "%.300s/.local", homes[i]);
                list_files(local, rel, 1, &out);
            }
        }
    }
    closedir(top);
    close(up);
    send_ok(id, out.data, out.len);
    buf_free(&out);
}

/* -- pack -------------------------------------------------------------------------------- */

/* Run argv (in `cwd`, stdout to `out` unless -1) and wait: its exit status, or -1. */
static int run(char *const argv[], const char *cwd, int out)
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        reset_child_signals();
        if ((cwd && chdir(cwd) < 0) || (out >= 0 && dup2(out, 1) < 0))
            _exit(125);
        int null = open("/dev/null", O_RDWR);
        if (null >= 0)
            dup2(null, 0);
        execv(argv[0], argv);
        _exit(127);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void pack_frame(int out, const char *header, const void *data, size_t n)
{
    if (write_all(out, header, strlen(header)) < 0 || write_all(out, data, n) < 0)
        _exit(1);
}

static void pack_err(int out, const char *id, const char *msg)
{
    char header[IDLEN + 64];
    snprintf(header, sizeof header, "%s err invalid %zu\n", id, strlen(msg));
    pack_frame(out, header, msg, strlen(msg));
}

/* The pack process: freeze the commands' cgroups, find the visible probes (guest/pack.sh), tar
 * the upper, thaw; frames go to `out` (the agent forwards them). */
static void pack_main(const char *id, const char *token, int out)
{
    const char *up = D "/rw/upper";
    char work[128], visible[160], msg[256];
    snprintf(work, sizeof work, D "/pack.%s", id);
    snprintf(visible, sizeof visible, "%s/visible", work);
    struct stat st;
    if (stat(up, &st) < 0 || !S_ISDIR(st.st_mode)) {
        snprintf(msg, sizeof msg, "this VM has no writable layer at %s", up);
        pack_err(out, id, msg);
        return;
    }
    mkdir(work, 0700);
    char frozen[MAX_JOBS * 2][64];  /* names under CG */
    int n_frozen = 0;
    DIR *dir = opendir(CG);
    struct dirent *e;
    while (dir && (e = readdir(dir)) && n_frozen < MAX_JOBS * 2) {
        if (e->d_name[0] == '.' || e->d_type != DT_DIR)
            continue;
        char path[320];
        snprintf(path, sizeof path, CG "/%.200s/cgroup.freeze", e->d_name);
        if (strlen(e->d_name) < sizeof frozen[0] && write_file(path, "1") == 0)
            snprintf(frozen[n_frozen++], sizeof frozen[0], "%s", e->d_name);
    }
    if (dir)
        closedir(dir);
    for (int i = 0; i < n_frozen; i++) {
        char path[320];
        snprintf(path, sizeof path, CG "/%s/cgroup.events", frozen[i]);
        for (int tries = 0; tries < 200; tries++) {
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            char events[256] = "";
            if (fd < 0)
                break;
            ssize_t r = read(fd, events, sizeof events - 1);
            close(fd);
            if (r > 0 && strstr(events, "frozen 1"))
                break;
            sleep_ms(10);
        }
    }
    char *probe[] = {BUSYBOX, "sh", D "/pack.sh", (char *)up, work, (char *)token, NULL};
    if (run(probe, "/", -1) != 0) {
        snprintf(msg, sizeof msg, "cannot look for opaque directories in %s", up);
        pack_err(out, id, msg);
    } else {
        int tar_out[2];
        if (pipe2(tar_out, O_CLOEXEC) < 0)
            _exit(1);
        pid_t tar = fork();
        if (tar == 0) {
            reset_child_signals();
            if (chdir(up) < 0 || dup2(tar_out[1], 1) < 0)
                _exit(125);
            execl(BUSYBOX, "tar", "-c", ".", (char *)NULL);
            _exit(127);
        }
        close(tar_out[1]);
        char *chunk = malloc(PART_BYTES);
        if (!chunk)
            _exit(1);
        for (;;) {
            size_t n = 0;
            while (n < PART_BYTES) {
                ssize_t r = read(tar_out[0], chunk + n, PART_BYTES - n);
                if (r < 0 && errno == EINTR)
                    continue;
                if (r <= 0)
                    break;
                n += (size_t)r;
            }
            if (n > 0) {
                char header[IDLEN + 64];
                snprintf(header, sizeof header, "%s part %zu\n", id, n);
                pack_frame(out, header, chunk, n);
            }
            if (n < PART_BYTES)
                break;
        }
        close(tar_out[0]);
        if (tar > 0)
            while (waitpid(tar, NULL, 0) < 0 && errno == EINTR)
                ;
        struct buf paths = {0};
        int fd = open(visible, O_RDONLY | O_CLOEXEC);
        if (fd >= 0)
            read_fd(fd, &paths, UINT64_MAX);
        if (fd >= 0)
            close(fd);
        char header[IDLEN + 64];
        snprintf(header, sizeof header, "%s ok %zu\n", id, paths.len);
        pack_frame(out, header, paths.data, paths.len);
    }
    for (int i = 0; i < n_frozen; i++) {
        char path[320];
        snprintf(path, sizeof path, CG "/%s/cgroup.freeze", frozen[i]);
        write_file(path, "0");
    }
    char *rm[] = {BUSYBOX, "rm", "-rf", work, NULL};
    run(rm, "/", -1);
}

static void start_pack(const char *id, const char *token)
{
    struct pack *p = NULL;
    for (int i = 0; i < MAX_PACKS && !p; i++)
        if (!packs[i].used)
            p = &packs[i];
    if (!p || !plain_word(token ? token : "", 128)) {
        send_err(id, "invalid", p ? "malformed pack request" : "too many packs at once");
        return;
    }
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) < 0) {
        send_err(id, "invalid", "cannot pack: %s", strerror(errno));
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(port);
        close(fds[0]);
        for (int i = 0; i < MAX_JOBS; i++)
            if (jobs[i].used) {
                if (jobs[i].out.fd >= 0)
                    close(jobs[i].out.fd);
                if (jobs[i].err.fd >= 0)
                    close(jobs[i].err.fd);
            }
        reset_child_signals();
        pack_main(id, token, fds[1]);
        _exit(0);
    }
    close(fds[1]);
    if (pid < 0) {
        close(fds[0]);
        send_err(id, "invalid", "cannot pack: %s", strerror(errno));
        return;
    }
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    memset(p, 0, sizeof *p);
    p->used = 1;
    p->pid = pid;
    p->fd = fds[0];
}

/* Forward the whole frames the pack process has written so far. */
static void relay_pack(struct pack *p)
{
    char chunk[65536];
    while (p->fd >= 0) {
        ssize_t r = read(p->fd, chunk, sizeof chunk);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            break;  /* EAGAIN: nothing more for now */
        if (r == 0) {
            close(p->fd);
            p->fd = -1;
            break;
        }
        if (buf_add(&p->in, chunk, (size_t)r) < 0)
            break;
        if (p->in.len >= PART_BYTES)
            break;  /* forward what is whole before reading more */
    }
    size_t at = 0;
    for (;;) {
        char *nl = memchr(p->in.data + at, '\n', p->in.len - at);
        if (!nl)
            break;
        /* "ID part|ok LEN" or "ID err CODE LEN": the payload's length is the last field. */
        char *last = nl;
        while (last > p->in.data + at && last[-1] != ' ')
            last--;
        size_t hlen = (size_t)(nl - (p->in.data + at)) + 1;
        size_t plen = strtoul(last, NULL, 10);
        if (p->in.len - at < hlen + plen)
            break;
        char header[256];
        snprintf(header, sizeof header, "%.*s", (int)hlen, p->in.data + at);
        send_frame(header, p->in.data + at + hlen, plen, NULL, 0);
        at += hlen + plen;
    }
    memmove(p->in.data, p->in.data + at, p->in.len - at);
    p->in.len -= at;
    if (p->fd < 0 && p->pid == 0) {
        buf_free(&p->in);
        p->used = 0;
    }
}

/* A new host name, and fresh bytes in the entropy pool with the generator reseeded from it
 * now (a write to /dev/urandom alone is only drawn on at the next scheduled reseed, a minute
 * away: until then children restored from one memory image would draw the same numbers). */
static void do_ident(const char *id, const char *name, size_t name_len, const char *seed, size_t seed_len)
{
    if (sethostname(name, name_len) < 0) {
        send_err(id, "invalid", "cannot set the host name: %s", strerror(errno));
        return;
    }
    int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
        send_err(id, "invalid", "cannot open /dev/urandom: %s", strerror(errno));
        return;
    }
    struct { struct rand_pool_info info; char bytes[512]; } entropy;
    entropy.info.entropy_count = (int)(seed_len * 8);
    entropy.info.buf_size = (int)seed_len;
    memcpy(entropy.info.buf, seed, seed_len);
    int failed = ioctl(fd, RNDADDENTROPY, &entropy) < 0 || ioctl(fd, RNDRESEEDCRNG) < 0;
    int saved = errno;
    close(fd);
    if (failed)
        send_err(id, "invalid", "cannot reseed the random number generator: %s", strerror(saved));
    else
        send_ok(id, NULL, 0);
}

/* -- the loop ---------------------------------------------------------------------------- */

static void handle_request(char *line)
{
    char *f[10] = {0};
    int n = 0;
    for (char *tok = strtok(line, " \t\r"); tok && n < 10; tok = strtok(NULL, " \t\r"))
        f[n++] = tok;
    if (n == 0)
        return;
    const char *id = f[0], *op = f[1] ? f[1] : "";
    if (!plain_word(id, IDLEN))
        return;  /* noise: what is left of a frame from before the host reconnected */
    long long a, b, c, d;
    if (strcmp(op, "ping") == 0) {
        send_ok(id, "run srun pty sin ident clock", 28);
    } else if (strcmp(op, "ack") == 0) {  /* JOBID N */
        struct job *j = f[2] ? job_by_id(f[2]) : NULL;
        if (j && number(f[3], &a) == 0 && a > 0)
            j->unacked = (uint64_t)a >= j->unacked ? 0 : j->unacked - (uint64_t)a;
    } else if (strcmp(op, "run") == 0 || strcmp(op, "srun") == 0) {  /* CAP WDLEN CMDLEN STDINLEN ENVLEN UID GID */
        long long e, uid, gid;
        if (number(f[2], &a) < 0 || number(f[3], &b) < 0 || number(f[4], &c) < 0 || number(f[5], &d) < 0 ||
            number(f[6], &e) < 0 || number(f[7], &uid) < 0 || number(f[8], &gid) < 0 ||
            a < 0 || b < 0 || c < 0 || d < -2 || (d == -2 && op[0] != 's') || e < 0 || uid < 0 || gid < 0) {
            send_err(id, "invalid", "malformed run request");
            return;
        }
        char *wd = NULL, *command = NULL, *in = NULL, *env = NULL, user[48];
        snprintf(user, sizeof user, "%lld:%lld", uid, gid);
        if (take_payload(b, &wd) == 0 && take_payload(c, &command) == 0 && take_payload(d < 0 ? -1 : d, &in) == 0 &&
            take_payload(e, &env) == 0) {
            if (d >= 0 && !in)
                send_err(id, "invalid", "cannot start the command: out of memory");
            else
                start_checked(id, a, wd, command, in, d, env, (size_t)e, user, op[0] == 's', NULL);
        }
        free(wd);
        free(command);
        free(in);
        free(env);
    } else if (strcmp(op, "pty") == 0) {  /* COLS ROWS WDLEN CMDLEN ENVLEN UID GID */
        long long e, uid, gid;
        if (number(f[2], &a) < 0 || number(f[3], &b) < 0 || number(f[4], &c) < 0 || number(f[5], &d) < 0 ||
            number(f[6], &e) < 0 || number(f[7], &uid) < 0 || number(f[8], &gid) < 0 ||
            a < 1 || a > 65535 || b < 1 || b > 65535 || c < 0 || d < 0 || e < 0 || uid < 0 || gid < 0) {
            send_err(id, "invalid", "malformed pty request");
            return;
        }
        char *wd = NULL, *command = NULL, *env = NULL, user[48];
        snprintf(user, sizeof user, "%lld:%lld", uid, gid);
        if (take_payload(c, &wd) == 0 && take_payload(d, &command) == 0 && take_payload(e, &env) == 0) {
            struct winsize ws = {(unsigned short)b, (unsigned short)a, 0, 0};
            start_checked(id, 0, wd, command, NULL, -1, env, (size_t)e, user, 1, &ws);
        }
        free(wd);
        free(command);
        free(env);
    } else if (strcmp(op, "ptyin") == 0) {  /* JOBID LEN */
        char *data;
        if (!f[2] || number(f[3], &a) < 0 || a < 0) {
            send_err(id, "invalid", "malformed ptyin request");
            return;
        }
        if (take_payload(a, &data) < 0)
            return;
        struct job *j = job_by_id(f[2]);
        if (!data)
            send_err(id, "invalid", "cannot take the input: out of memory");
        else if (!j || j->tty < 0 || !j->pid)
            send_err(id, "invalid", "no running pty %s", f[2]);
        else if (j->typed.len + (size_t)a > PTY_QUEUE)
            send_err(id, "invalid", "the terminal's input is full: its program has not read the last %zu bytes",
                     j->typed.len);
        else if (buf_add(&j->typed, data, (size_t)a) < 0)
            send_err(id, "invalid", "cannot take the input: out of memory");
        else {
            type_out(j);
            send_ok(id, NULL, 0);
        }
        free(data);
    } else if (strcmp(op, "ptyeof") == 0) {  /* JOBID */
        struct job *j = f[2] ? job_by_id(f[2]) : NULL;
        if (!j || j->tty < 0 || !j->pid)
            send_err(id, "invalid", "no running job %s with a fed stdin", f[2] ? f[2] : "");
        else {
            j->eof = 1;
            type_out(j);
            send_ok(id, NULL, 0);
        }
    } else if (strcmp(op, "ptysz") == 0) {  /* JOBID COLS ROWS */
        struct job *j = f[2] ? job_by_id(f[2]) : NULL;
        if (number(f[3], &a) < 0 || number(f[4], &b) < 0 || a < 1 || a > 65535 || b < 1 || b > 65535)
            send_err(id, "invalid", "malformed ptysz request");
        else if (!j || j->tty < 0 || !j->pid)
            send_err(id, "invalid", "no running pty %s", f[2] ? f[2] : "");
        else {
            struct winsize ws = {(unsigned short)b, (unsigned short)a, 0, 0};
            if (ioctl(j->tty, TIOCSWINSZ, &ws) < 0)
                send_err(id, "invalid", "cannot resize the terminal: %s", strerror(errno));
            else
                send_ok(id, NULL, 0);
        }
    } else if (strcmp(op, "kill") == 0) {
        struct job *j = f[2] ? job_by_id(f[2]) : NULL;
        if (j) {
            char path[96];
            snprintf(path, sizeof path, "%s/cgroup.kill", j->cgroup);
            write_file(path, "1");
            j->stream = 0;  /* the host waits for the end, not for more output: kept, not streamed */
            j->unacked = 0;
        }
        send_ok(id, NULL, 0);
    } else if (strcmp(op, "read") == 0) {  /* PATHLEN MAX */
        char *path;
        if (number(f[2], &a) < 0 || a < 0) {
            send_err(id, "invalid", "malformed read request");
            return;
        }
        if (take_payload(a, &path) < 0)
            return;
        if (path)
            do_read(id, path, f[3]);
        else
            send_err(id, "invalid", "cannot read: out of memory");
        free(path);
    } else if (strcmp(op, "write") == 0) {  /* PATHLEN DATALEN MODE UID GID */
        char *path, *data;
        if (number(f[2], &a) < 0 || number(f[3], &b) < 0 || a < 0 || b < 0) {
            send_err(id, "invalid", "malformed write request");
            return;
        }
        if (take_payload(a, &path) < 0)
            return;
        if (take_payload(b, &data) < 0) {
            free(path);
            return;
        }
        if (path)
            do_write(id, path, data, (size_t)b, f[4], f[5], f[6]);
        else
            send_err(id, "invalid", "cannot write: out of memory");
        free(path);
        free(data);
    } else if (strcmp(op, "mkdir") == 0) {  /* PATHLEN UID GID */
        char *path;
        if (number(f[2], &a) < 0 || a < 0 || number(f[3], &b) < 0 || number(f[4], &c) < 0) {
            send_err(id, "invalid", "malformed mkdir request");
            return;
        }
        if (take_payload(a, &path) < 0)
            return;
        if (path && makedirs(path, (uid_t)b, (gid_t)c) == 0)
            send_ok(id, NULL, 0);
        else
            send_err(id, "invalid", "cannot create directory %s", path ? path : "");
        free(path);
    } else if (strcmp(op, "pack") == 0) {  /* TOKEN */
        start_pack(id, f[2]);
    } else if (strcmp(op, "changed") == 0) {
        do_changed(id);
    } else if (strcmp(op, "ident") == 0) {  /* HOSTLEN SEEDLEN */
        char *name, *seed;
        if (number(f[2], &a) < 0 || number(f[3], &b) < 0 || a < 1 || a > 64 || b < 0 || b > 512) {
            send_err(id, "invalid", "malformed ident request");
            return;
        }
        if (take_payload(a, &name) < 0)
            return;
        if (take_payload(b, &seed) < 0) {
            free(name);
            return;
        }
        if (name && seed)
            do_ident(id, name, (size_t)a, seed, (size_t)b);
        else
            send_err(id, "invalid", "cannot take a new identity: out of memory");
        free(name);
        free(seed);
    } else if (strcmp(op, "clock") == 0) {  /* SEC NSEC */
        struct timespec now;
        if (number(f[2], &a) < 0 || number(f[3], &b) < 0 || a < 0 || b < 0 || b > 999999999) {
            send_err(id, "invalid", "malformed clock request");
            return;
        }
        now.tv_sec = (time_t)a;
        now.tv_nsec = (long)b;
        if (clock_settime(CLOCK_REALTIME, &now) < 0)
            send_err(id, "invalid", "cannot set the clock: %s", strerror(errno));
        else
            send_ok(id, NULL, 0);
    } else if (strcmp(op, "shutdown") == 0) {
        send_ok(id, NULL, 0);
        sync();
        reboot(RB_POWER_OFF);
    } else {
        send_err(id, "invalid", "unknown operation %s", op);
    }
}

/* Serve the header lines buffered so far (their payloads are read as each request needs). */
static void serve_port(void)
{
    if (in_start == in_end || !memchr(inbuf + in_start, '\n', in_end - in_start)) {
        if (in_start > 0) {
            memmove(inbuf, inbuf + in_start, in_end - in_start);
            in_end -= in_start;
            in_start = 0;
        }
        if (in_end == sizeof inbuf)
            in_end = 0;  /* a "line" this long is noise */
        ssize_t r = read(port, inbuf + in_end, sizeof inbuf - in_end);
        if (r < 0)
            return;
        if (r == 0) {  /* the host is not connected (yet, or any more: a restored VM waits here) */
            host_gone();
            in_start = in_end = 0;
            return;
        }
        in_end += (size_t)r;
    }
    char *nl;
    while (connected && (nl = memchr(inbuf + in_start, '\n', in_end - in_start))) {
        char line[LINE_MAX_LEN];
        size_t len = (size_t)(nl - (inbuf + in_start));
        int fits = len < sizeof line;
        if (fits) {
            memcpy(line, inbuf + in_start, len);
            line[len] = '\0';
        }
        in_start += len + 1;
        if (fits)
            handle_request(line);
    }
}

static void reap(void)
{
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        for (int i = 0; i < MAX_JOBS; i++)
            if (jobs[i].used && jobs[i].pid == pid) {
                jobs[i].pid = 0;
                jobs[i].rc = rc;
                jobs[i].deadline = now_ms() + LINGER_MS;
            }
        for (int i = 0; i < MAX_PACKS; i++)
            if (packs[i].used && packs[i].pid == pid)
                packs[i].pid = 0;
    }
}

/* The sandbox's protected paths, from the kernel command line's dsec.protect=HEX (the hex of
 * the paths, NUL-separated: the host's run arg protected_paths): each that exists is made a
 * read-only bind mount in the commands' mount namespace (`--ro` of dsec-jail --init), which
 * root in a command cannot undo (no CAP_SYS_ADMIN; seccomp refuses mount and umount). One that
 * does not exist is left out, and the host, which checks each before it answers the create,
 * refuses the sandbox. Up to MAX_PROTECTED paths; returns how many went into `out`. */
#define MAX_PROTECTED 64
static int protected_paths(char *out[MAX_PROTECTED])
{
    static char cmdline[4096], paths[2048];
    int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    ssize_t r = fd >= 0 ? read(fd, cmdline, sizeof cmdline - 1) : -1;
    if (fd >= 0)
        close(fd);
    if (r <= 0)
        return 0;
    cmdline[r] = '\0';
    char *hex = strstr(cmdline, "dsec.protect=");
    if (!hex)
        return 0;
    hex += strlen("dsec.protect=");
    size_t n = 0;
    for (; isxdigit((unsigned char)hex[0]) && isxdigit((unsigned char)hex[1]) && n < sizeof paths - 1; hex += 2) {
        char pair[3] = {hex[0], hex[1], 0};
        paths[n++] = (char)strtoul(pair, NULL, 16);
    }
    paths[n] = '\0';
    int count = 0;
    struct stat st;
    for (size_t at = 0; at < n && count < MAX_PROTECTED; at += strlen(paths + at) + 1)
        if (paths[at] == '/' && stat(paths + at, &st) == 0)
            out[count++] = paths + at;
        else if (paths[at])
            console("protected path %s does not exist: not protected", paths + at);
    return count;
}

/* The sandbox's pid namespace (dsec-jail --init, with this directory and the protected paths
 * read-only in its mount namespace) and the jail's arguments for every command. */
static int setup_jail(void)
{
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) < 0)
        return -1;
    char *protect[MAX_PROTECTED];
    int n_protect = protected_paths(protect);
    pid_t pid = fork();
    if (pid == 0) {
        char *argv[4 + 2 * MAX_PROTECTED];
        int n = 0;
        argv[n++] = D "/jail";
        argv[n++] = "--ro";
        argv[n++] = D;
        for (int i = 0; i < n_protect; i++) {
            argv[n++] = "--ro";
            argv[n++] = protect[i];
        }
        argv[n++] = "--init";
        argv[n] = NULL;
        dup2(fds[1], 1);
        execv(D "/jail", argv);
        _exit(127);
    }
    close(fds[1]);
    char text[32] = "";
    ssize_t r = pid > 0 ? read(fds[0], text, sizeof text - 1) : -1;
    close(fds[0]);
    int status = 1;
    if (pid > 0)
        waitpid(pid, &status, 0);
    long init = r > 0 ? strtol(text, NULL, 10) : 0;
    if (status != 0 || init <= 0)
        return -1;

    char caps[512] = "";
    int fd = open(D "/caps", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, caps, sizeof caps - 1) < 0)
        return -1;
    close(fd);
    caps[strcspn(caps, "\n")] = '\0';
    static char init_text[32];
    snprintf(init_text, sizeof init_text, "%ld", init);
    static const char *devs[] = {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm"};
    static char dev_paths[9][32];
    jail_argv = calloc(64, sizeof *jail_argv);
    if (!jail_argv)
        return -1;
    int n = 0;
    const char *fixed[] = {D "/jail", "--join", init_text, "--caps", strdup(caps), "--seccomp", D "/seccomp.bpf",
                           "--ro", "/proc", "--ro", "/sys", "--hide", "/dev"};
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
        jail_argv[n++] = (char *)fixed[i];
    for (int i = 0; i < 9; i++) {
        snprintf(dev_paths[i], sizeof dev_paths[i], "/dev/%s", devs[i]);
        jail_argv[n++] = "--rw";
        jail_argv[n++] = dev_paths[i];
    }
    /* Busybox stays readable to commands, as when their scripts ran through it. */
    jail_argv[n++] = "--ro";
    jail_argv[n++] = BUSYBOX;
    jail_argc = n;
    return 0;
}

/* The guest's loopback, up: a port inside the sandbox is reached on 127.0.0.1 (dsec.edge.ports),
 * and programs expect it. */
static void loopback_up(void)
{
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    if (fd < 0 || ioctl(fd, SIOCGIFFLAGS, &ifr) < 0 || ((ifr.ifr_flags |= IFF_UP), ioctl(fd, SIOCSIFFLAGS, &ifr) < 0))
        console("cannot bring lo up: %s", strerror(errno));
    if (fd >= 0)
        close(fd);
}

static int open_port(void)
{
    DIR *dir = opendir("/sys/class/virtio-ports");
    struct dirent *e;
    int fd = -1;
    while (dir && fd < 0 && (e = readdir(dir))) {
        char path[300], name[64] = "";
        snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
        int nfd = open(path, O_RDONLY | O_CLOEXEC);
        if (nfd < 0)
            continue;
        ssize_t r = read(nfd, name, sizeof name - 1);
        close(nfd);
        if (r > 0 && strcmp(name, "dsec.agent\n") == 0) {
            snprintf(path, sizeof path, "/dev/%s", e->d_name);
            fd = open(path, O_RDWR | O_NOCTTY | O_CLOEXEC);
        }
    }
    if (dir)
        closedir(dir);
    return fd;
}

int main(void)
{
    setenv("PATH", D "/bin", 1);
    umask(022);
    if (chdir("/") < 0)
        return 1;
    signal(SIGPIPE, SIG_IGN);
    mkdir(D "/j", 0700);
    mkdir(CG, 0755);
    /* The guest kernel's log is the sandbox's own: commands may read it (dmesg) without CAP_SYSLOG. */
    write_file("/proc/sys/kernel/dmesg_restrict", "0");
    loopback_up();
    if (setup_jail() < 0) {
        console("no pid namespace for commands");
        return 1;
    }
    port = open_port();
    if (port < 0) {
        console("no dsec.agent port");
        return 1;
    }
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd < 0) {
        console("no signalfd: %s", strerror(errno));
        return 1;
    }
    reap();  /* children that ended before the signalfd */
    make_spare();

    struct pollfd fds[2 + 3 * MAX_JOBS + MAX_PACKS];
    void *owner[2 + 3 * MAX_JOBS + MAX_PACKS];
    for (;;) {
        int n = 0, timeout = -1;
        int64_t now = now_ms();
        fds[n++] = (struct pollfd){sfd, POLLIN, 0};
        if (connected)
            fds[n++] = (struct pollfd){port, POLLIN, 0};
        else
            timeout = UNCONNECTED_MS;
        for (int i = 0; i < MAX_JOBS; i++) {
            struct job *j = &jobs[i];
            if (!j->used)
                continue;
            int held = j->stream && j->unacked >= WINDOW;  /* the host is behind: read no more */
            if (j->pid == 0 && held)
                j->deadline = now + LINGER_MS;
            if (j->pid == 0) {
                if ((j->out.fd < 0 && j->err.fd < 0) || now >= j->deadline) {
                    finish_job(j);
                    continue;
                }
                int left = (int)(j->deadline - now);
                if (timeout < 0 || left < timeout)
                    timeout = left;
            }
            if (j->tty >= 0 && j->typed.len > 0 && j->pid) {
                owner[n] = &j->typed;
                fds[n++] = (struct pollfd){j->tty, POLLOUT, 0};
            }
            struct stream *ss[2] = {&j->out, &j->err};
            for (int k = 0; k < 2 && !held; k++)
                if (ss[k]->fd >= 0) {
                    owner[n] = ss[k];
                    fds[n++] = (struct pollfd){ss[k]->fd, POLLIN, 0};
                }
        }
        for (int i = 0; i < MAX_PACKS; i++) {
            if (packs[i].used && packs[i].fd < 0 && packs[i].pid == 0)
                relay_pack(&packs[i]);
            if (packs[i].used && packs[i].fd >= 0) {
                owner[n] = &packs[i];
                fds[n++] = (struct pollfd){packs[i].fd, POLLIN, 0};
            }
        }
        if (poll(fds, (nfds_t)n, timeout) < 0) {
            if (errno != EINTR)
                sleep_ms(UNCONNECTED_MS);
            continue;
        }
        if (!connected) {
            connected = 1;  /* look again: read() tells */
        }
        for (int i = 0; i < n; i++) {
            if (!fds[i].revents)
                continue;
            if (fds[i].fd == sfd) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) > 0)
                    ;
                reap();
            } else if (fds[i].fd == port) {
                serve_port();
            } else {
                int is_pack = 0;
                for (int k = 0; k < MAX_PACKS; k++)
                    if (owner[i] == &packs[k]) {
                        relay_pack(&packs[k]);
                        is_pack = 1;
                    }
                if (!is_pack) {
                    struct stream *s = owner[i];
                    for (int k = 0; k < MAX_JOBS; k++) {
                        if (jobs[k].used && owner[i] == (void *)&jobs[k].typed)
                            type_out(&jobs[k]);
                        else if (jobs[k].used && (s == &jobs[k].out || s == &jobs[k].err))
                            drain(&jobs[k], s, 1);
                    }
                }
            }
        }
    }
}
