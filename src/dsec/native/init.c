/* dsec-init: pid 1 of a DSec container sandbox.
 *
 * It reaps every process of the sandbox (as catatonit -P would) and, when the host handed it a
 * channel, starts the sandbox's commands. The channel is one end of a SOCK_SEQPACKET socketpair
 * that the host passes as the init's stdin (crun run --detach hands its stdio to the init); it
 * is moved off fd 0 at once and has no name in any filesystem or
 * network namespace, nothing else in the sandbox holds it, and the init is not dumpable, so no
 * process of the sandbox can reach it through /proc/1/fd or ptrace (which the seccomp profile
 * denies anyway). Commands are forked from here: they inherit the sandbox's namespaces, cgroup,
 * capabilities, no_new_privs and seccomp filter, as with `crun exec`, for ~1/10 of its cost.
 *
 * Messages are NUL-separated text fields, one message per packet.
 *   host -> init
 *     x ID UID GID CWD ARGC ARG... ENV...   start a command in a session of its own, with the
 *                                           three fds of the packet (SCM_RIGHTS) as stdin,
 *                                           stdout, stderr
 *     k ID                                  SIGKILL all the command started (it and all below
 *                                           its keeper, see keeper())
 *   init -> host
 *     s ID PID                              started (PID in the sandbox's pid namespace)
 *     e ID ERRNO WHAT                       could not start it (WHAT: chdir, exec, ...)
 *     w ID STATUS                           ended, with its wait status
 * When the host end closes (the server restarted) the init keeps reaping; the server then
 * falls back to `crun exec`.
 *
 * `dsec-init --ctty PROG ARG...` (run as a command, not as pid 1) makes its stdin, a terminal the
 * host opened (a PTY's), the controlling terminal of a session of its own and execs PROG: so
 * Ctrl-C typed there reaches the foreground job, and job control works.
 * `dsec-init --connect PORT` (a command too) connects to 127.0.0.1:PORT and relays its stdin to
 * the connection and the connection to its stdout, as `nc` does (images without one: a
 * WebSocket through a port, dsec.apiserver.websocket); exit 1 if it cannot connect.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#define MAX_MSG (256 * 1024)
#define MAX_FIELDS 8192

struct job {
    unsigned long id;
    pid_t keeper; /* the command's keeper: a subreaper that forks it and reports its end */
};

static struct job *jobs;
static size_t njobs, capjobs;
static int channel = -1;

static void reply(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void reply(const char *fmt, ...) {
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    for (int i = 0; i < n; i++)
        if (buf[i] == ' ')
            buf[i] = '\0';
    for (int tries = 0; channel >= 0 && tries < 100; tries++) {
        if (send(channel, buf, (size_t)n, MSG_NOSIGNAL) >= 0)
            return;
        if (errno == EINTR)
            continue;
        if (errno != ENOBUFS && errno != ENOMEM) {
            close(channel); /* the host is gone: keep reaping */
            channel = -1;
            return;
        }
        usleep(10000); /* out of memory for a moment (the sandbox's cgroup is at its limit) */
    }
}

/* The parent of `pid`, from /proc/PID/stat (") S PPID"); -1 if it is gone. */
static pid_t parent_of(pid_t pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    int ppid;
    if (!p || sscanf(p + 1, " %*c %d", &ppid) != 1)
        return -1;
    return ppid;
}

/* SIGKILL every process below `keeper` (not the keeper: it reports the command's end), again
 * until none is left, since they may fork meanwhile. A process that left its session or was
 * orphaned by a double fork is still below the keeper, a subreaper. */
static void kill_below(pid_t keeper) {
    enum { MAX_PIDS = 65536 };
    static pid_t pids[MAX_PIDS], parents[MAX_PIDS];
    for (int round = 0; round < 20; round++) {
        size_t n = 0;
        DIR *d = opendir("/proc");
        if (!d)
            return;
        struct dirent *e;
        while ((e = readdir(d)) && n < MAX_PIDS) {
            pid_t pid = (pid_t)atoi(e->d_name);
            if (pid > 1 && pid != keeper) {
                pids[n] = pid;
                parents[n++] = parent_of(pid);
            }
        }
        closedir(d);
        int killed = 0;
        for (size_t i = 0; i < n; i++) {
            /* Walk up from each process; a chain is short, and a pid seen twice ends it. */
            pid_t up = parents[i];
            for (int depth = 0; up > 1 && up != keeper && depth < 4096; depth++) {
                size_t j = 0;
                while (j < n && pids[j] != up)
                    j++;
                up = j < n ? parents[j] : -1;
            }
            if (up == keeper && kill(pids[i], SIGKILL) == 0)
                killed++;
        }
        if (!killed)
            return;
    }
}

static const char *home_of(uid_t uid) {
    static char home[512];
    FILE *f = fopen("/etc/passwd", "re");
    if (!f)
        return "/";
    char line[1024];
    const char *found = "/";
    while (fgets(line, sizeof line, f)) {
        char *fields[7];
        int n = 0;
        for (char *s = line, *tok; n < 7 && (tok = strsep(&s, ":\n")); )
            fields[n++] = tok;
        if (n >= 6 && (uid_t)strtoul(fields[2], NULL, 10) == uid && fields[5][0]) {
            snprintf(home, sizeof home, "%s", fields[5]);
            found = home;
            break;
        }
    }
    fclose(f);
    return found;
}

/* The signals the init was started with ignored (bit s-1 for signal s): an ignored disposition
 * outlives exec, and the init sets no disposition of its own, so these are the only ones a
 * command must have set back to the default. Read once at the start (one file read) rather than
 * a sigaction for every signal in every command (62 system calls a command, each through the
 * seccomp filter); all of them when it cannot be read. */
static uint64_t ignored_at_start = ~(uint64_t)0;

static void note_ignored(void) {
    FILE *f = fopen("/proc/self/status", "re");
    if (!f)
        return;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        char *end;
        if (strncmp(line, "SigIgn:", 7) == 0) {
            uint64_t mask = strtoull(line + 7, &end, 16);
            if (end != line + 7)
                ignored_at_start = mask;
            break;
        }
    }
    fclose(f);
}

/* In the child: never returns. Failures go back through `errpipe` as "ERRNO WHAT". */
static void child(char **f, int nf, int fds[3], int errpipe, sigset_t *oldmask) {
    uid_t uid = (uid_t)strtoul(f[2], NULL, 10);
    gid_t gid = (gid_t)strtoul(f[3], NULL, 10);
    const char *cwd = f[4];
    int argc = atoi(f[5]);
    char **argv = f + 6;
    char **env = f + 6 + argc;
    int nenv = nf - 6 - argc;
    const char *what = "setsid";
    char home[600];

    for (int s = 1; s < NSIG; s++)
        if (ignored_at_start >> (s - 1) & 1)
            signal(s, SIG_DFL);
    sigprocmask(SIG_SETMASK, oldmask, NULL);
    /* The command, not the init or its keeper, is what the OOM killer takes in the sandbox: the
     * init has crun's 500, the command 1000 (raising needs no privilege). Even when the kernel
     * kills twice for one overrun (a first victim's pages not yet uncharged), the second is one
     * of the command's processes, and the sandbox lives on. */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) {
        if (write(oom, "1000", 4) < 0) {
            /* best effort: the command then ranks as the init does */
        }
        close(oom);
    }
    if (setsid() < 0)
        goto fail;
    what = "setgroups";
    if (setgroups(0, NULL) < 0)
        goto fail;
    what = "setgid";
    if (setgid(gid) < 0)
        goto fail;
    what = "setuid";
    if (setuid(uid) < 0)
        goto fail;
    what = "chdir";
    if (chdir(cwd) < 0)
        goto fail;
    what = "dup2";
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], i) < 0)
            goto fail;
    /* argv and env are NUL-terminated in place; make both NULL-terminated arrays. */
    char **envp = calloc((size_t)nenv + 2, sizeof *envp);
    what = "calloc";
    if (!envp)
        goto fail;
    int has_home = 0;
    for (int i = 0; i < nenv; i++) {
        envp[i] = env[i];
        has_home |= strncmp(env[i], "HOME=", 5) == 0;
    }
    if (!has_home) {
        snprintf(home, sizeof home, "HOME=%s", home_of(uid));
        envp[nenv] = home;
    }
    argv[argc] = NULL;  /* overwrites env[0]'s pointer slot only after envp was built */
    environ = envp;
    what = "exec";
    execvp(argv[0], argv);
fail:;
    char msg[64];
    int n = snprintf(msg, sizeof msg, "%d %s", errno, what);
    if (write(errpipe, msg, (size_t)n) < 0) {
        /* nothing more to tell */
    }
    _exit(127);
}

/* The keeper: a child of the init that is the subreaper of one command. It starts the command,
 * reports that it started (or why not) and its wait status, and stays while anything the command
 * left behind runs, so that `k ID` finds all of it below the keeper. */
static void keeper(unsigned long id, char **f, int nf, int fds[3], sigset_t *oldmask) {
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    int errpipe[2];
    if (pipe2(errpipe, O_CLOEXEC) < 0) {
        reply("e %lu %d pipe", id, errno);
        _exit(0);
    }
    /* vfork: the command shares the keeper's memory until it execs (the keeper waits), so the
     * kernel copies no page tables for it and takes no copy-on-write faults before its exec,
     * nor tears a copied address space down at it: here 380-420 us of CPU a command started
     * against 470-580 with fork.
     * The child changes only what is its own (its credentials, fds, cwd, signal dispositions
     * and mask) or what the keeper no longer reads (the request's fields, environ, the heap). */
    pid_t pid = vfork();
    if (pid == 0) {
        close(errpipe[0]);
        child(f, nf, fds, errpipe[1], oldmask);
    }
    close(errpipe[1]);
    for (int i = 0; i < 3; i++)
        close(fds[i]);
    if (pid < 0) {
        reply("e %lu %d fork", id, errno);
        _exit(0);
    }
    char buf[64] = {0};
    ssize_t n;
    while ((n = read(errpipe[0], buf, sizeof buf - 1)) < 0 && errno == EINTR)
        ;
    close(errpipe[0]);
    if (n > 0) { /* it failed before exec (and exits 127) */
        int err = 0;
        char what[32] = "exec";
        sscanf(buf, "%d %31s", &err, what);
        reply("e %lu %d %s", id, err, what);
    } else {
        reply("s %lu %d", id, pid);
    }
    int status;
    pid_t done;
    while ((done = waitpid(-1, &status, 0)) > 0 || errno == EINTR)
        if (done == pid && n <= 0)
            reply("w %lu %d", id, status);
    _exit(0);
}

static void start(char *msg, size_t len, int fds[3], sigset_t *oldmask) {
    char *f[MAX_FIELDS + 1];
    int nf = 0;
    for (size_t i = 0; i < len && nf < MAX_FIELDS; ) {
        f[nf++] = msg + i;
        i += strlen(msg + i) + 1;
    }
    if (nf < 7 || atoi(f[5]) < 1 || 6 + atoi(f[5]) > nf) {
        reply("e %s %d request", nf > 1 ? f[1] : "0", EINVAL);
        return;
    }
    unsigned long id = strtoul(f[1], NULL, 10);
    pid_t pid = fork();
    if (pid == 0)
        keeper(id, f, nf, fds, oldmask);
    if (pid < 0) {
        reply("e %lu %d fork", id, errno);
        return;
    }
    if (njobs == capjobs) {
        capjobs = capjobs ? 2 * capjobs : 16;
        jobs = realloc(jobs, capjobs * sizeof *jobs);
        if (!jobs)
            abort();
    }
    jobs[njobs++] = (struct job){id, pid};
}

static void kill_job(unsigned long id) {
    for (size_t i = 0; i < njobs; i++)
        if (jobs[i].id == id)
            kill_below(jobs[i].keeper);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (size_t i = 0; i < njobs; i++) {
            if (jobs[i].keeper == pid) {
                /* A keeper ends with 0 once it has told all; one that was killed (by the
                 * command it kept: same user) has not: the job ends here. The host ignores a
                 * second end. */
                if (!WIFEXITED(status))
                    reply("w %lu %d", jobs[i].id, status);
                jobs[i] = jobs[--njobs];
                break;
            }
        }
    }
}

static void serve(char *buf, sigset_t *oldmask) {
    char cbuf[CMSG_SPACE(3 * sizeof(int))];
    struct iovec iov = {buf, MAX_MSG - 1};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t n = recvmsg(channel, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        close(channel);
        channel = -1;
        return;
    }
    buf[n] = '\0';
    int fds[3] = {-1, -1, -1}, nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            memcpy(fds, CMSG_DATA(c), (size_t)(nfds < 3 ? nfds : 3) * sizeof(int));
        }
    }
    if (buf[0] == 'x' && nfds == 3 && !(mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
        start(buf, (size_t)n, fds, oldmask);
    else if (buf[0] == 'k' && n > 2)
        kill_job(strtoul(buf + 2, NULL, 10));
    else
        reply("e %s %d request", n > 2 && buf[0] == 'x' ? buf + 2 : "0", EINVAL);
    for (int i = 0; i < 3; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

static int ctty_exec(char **argv) {
    if (getsid(0) != getpid() && setsid() < 0) {
        /* A process group leader cannot lead a new session: the command goes on in a child. */
        pid_t pid = fork();
        if (pid < 0) {
            perror("dsec-init: fork");
            return 126;
        }
        if (pid > 0) {
            int status;
            while (waitpid(pid, &status, 0) < 0)
                if (errno != EINTR)
                    return 126;
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        setsid();
    }
    if (ioctl(0, TIOCSCTTY, 0) < 0) {
        perror("dsec-init: cannot make stdin the controlling terminal");
        return 126;
    }
    execvp(argv[0], argv);
    fprintf(stderr, "dsec-init: %s: %s\n", argv[0], strerror(errno));
    return 127;
}

static int connect_relay(const char *port_text) {
    char *end;
    long port = strtol(port_text, &end, 10);
    if (*end || port < 1 || port > 65535) {
        fprintf(stderr, "dsec-init: --connect wants a port, not %s\n", port_text);
        return 2;
    }
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (s < 0 || connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        fprintf(stderr, "dsec-init: cannot connect to 127.0.0.1:%ld: %s\n", port, strerror(errno));
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    char buf[65536];
    int in_open = 1;
    for (;;) {
        struct pollfd p[2] = {{s, POLLIN, 0}, {0, POLLIN, 0}};
        if (poll(p, in_open ? 2 : 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        if (p[0].revents) {
            ssize_t n = read(s, buf, sizeof buf);
            if (n <= 0)
                return 0;  /* the other end closed */
            for (ssize_t done = 0; done < n; ) {
                ssize_t w = write(1, buf + done, (size_t)(n - done));
                if (w < 0 && errno == EINTR)
                    continue;
                if (w < 0)
                    return 1;
                done += w;
            }
        }
        if (in_open && p[1].revents) {
            ssize_t n = read(0, buf, sizeof buf);
            if (n <= 0) {
                shutdown(s, SHUT_WR);
                in_open = 0;
                continue;
            }
            for (ssize_t done = 0; done < n; ) {
                ssize_t w = write(s, buf + done, (size_t)(n - done));
                if (w < 0 && errno == EINTR)
                    continue;
                if (w < 0)
                    return 1;
                done += w;
            }
        }
    }
}

/* Close every fd from 3 up but `a` and `b`. close_range(2) takes three calls; a close(2) of
 * each fd below 1024 took 1021 (each a trip into the kernel through the seccomp filter: a
 * millisecond or more of the sandbox's start on a paravirtualized guest). The loop is for
 * kernels before 5.9. */
static void close_others(int a, int b) {
    int lo = a < b ? a : b, hi = a < b ? b : a;
    unsigned int from = 3;
    int keep[2] = {lo, hi};
    for (int i = 0; i < 2; i++) {
        if (keep[i] < (int)from)
            continue;
        if (keep[i] > (int)from && syscall(SYS_close_range, from, (unsigned int)keep[i] - 1, 0) < 0)
            goto loop;
        from = (unsigned int)keep[i] + 1;
    }
    if (syscall(SYS_close_range, from, ~0U, 0) == 0)
        return;
loop:
    for (int fd = 3; fd < 1024; fd++)
        if (fd != a && fd != b)
            close(fd);
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--ctty") == 0)
        return ctty_exec(argv + 2);
    if (argc == 3 && strcmp(argv[1], "--connect") == 0)
        return connect_relay(argv[2]);
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &old);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) {
        perror("dsec-init: signalfd");
        return 1;
    }
    /* Not dumpable: nothing in the sandbox may open /proc/1/fd or attach to us. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    note_ignored();
    int type;
    socklen_t tl = sizeof type;
    if (getsockopt(0, SOL_SOCKET, SO_TYPE, &type, &tl) == 0 && type == SOCK_SEQPACKET) {
        channel = fcntl(0, F_DUPFD_CLOEXEC, 3);
        int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (null >= 0) {
            dup2(null, 0);
            close(null);
        } else {
            close(0);
        }
    }
    /* Anything else inherited is not for the sandbox. */
    close_others(channel, sfd);
    char *buf = malloc(MAX_MSG);
    if (!buf)
        return 1;
    for (;;) {
        struct pollfd p[2] = {{sfd, POLLIN, 0}, {channel, POLLIN, 0}};
        if (poll(p, channel >= 0 ? 2 : 1, -1) < 0 && errno != EINTR)
            continue;
        if (p[0].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0)
                ;
            reap();
        }
        if (channel >= 0 && p[1].revents)
            serve(buf, &old);
    }
}
