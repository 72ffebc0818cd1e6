/* dsec-zygote.so: the FnCall zygote's per-call loop, in C (see dsec/fncall/zygote.py).
 *
 * The zygote loads this with ctypes.PyDLL (so the GIL stays held) and calls dsec_zygote_serve,
 * which reads requests from the channel, forks a child for each, waits for it and answers, and
 * returns only when Python has something to do:
 *    0  EOF on the channel: the zygote ends
 *    1  in a Python call's child, ready to run the code (z->code, z->env): the child has done
 *       all else here (session, stdio, Landlock, limits, uid, working directory, input files;
 *       see prepare_call); a bash call's child execs bash from here and never returns
 *    2  a call wrote to one of the wiped directories: the zygote wipes them and calls again
 *   -1  a broken request or a failed system call: z->error says which; the zygote ends
 * Why C: after each fork every page the parent writes costs it a copy-on-write fault (about
 * 2 us on a virtual machine); a Python loop writes ~100 pages a call (objects, refcounts,
 * frames), this loop a handful (its stack and buffers).
 *
 * The wire protocol, the answer and every check are those of zygote.py (Zygote.serve, _child
 * and what they call), which remain the loop where this library cannot be loaded (another libc).
 * Only libc symbols every glibc has had since 2.17 are used; newer system calls go through
 * syscall(2). It links to no Python symbol: the fork hooks come as function pointers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#define MAX_DIRS 8
#define MAX_HEADER (1 << 20)
#define MAX_FETCH 4096
#define HEADER_FIXED 44 /* !dQIQQQ */
#define RESULT_FIXED 43 /* !i?ddQQQQH */
#define REASON_MAX 96
#define INLINE_MAX (16 << 10) /* stdout and stderr up to this go in the answer's own write */
/* the frame, the result, per fetched file its !HqH and reason (paths: at most the header) */
#define ANSWER_MAX (5 + RESULT_FIXED + MAX_HEADER + MAX_FETCH * (12 + REASON_MAX) + INLINE_MAX)

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 1U
#endif
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_BENEATH 0x08
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif
#define BODY_FIXED 17 /* !BIIiI */
#define WORKDIR "/work"
#define BODY_FD 3 /* a Python call's body in its child: zygote.py's BODY_FD */

struct dsec_zygote { /* zygote.py's _NativeLoop mirrors this */
    /* set by the zygote */
    int chan_in, chan_out, statm_fd, workdir_fd, devnull_fd, ruleset_fd;
    int ndirs, dir_fds[MAX_DIRS];
    unsigned int uid, gid;
    void (*before_fork)(void);
    void (*after_fork_parent)(void);
    void (*after_fork_child)(void);
    /* the call, for the child (return 1): the lengths of its code and added environment
     * (NAME=VALUE\0...), which follow the body's fixed part on BODY_FD (code and env are NULL;
     * a bash call's child has them in a private mapping); RLIMIT_AS, vsz + memory, is left for
     * Python to set */
    const char *code, *env;
    unsigned int code_len, env_len;
    unsigned long long memory, vsz;
    /* why -1 */
    char error[512];
};

struct fetched {
    const char *path;
    uint16_t path_len;
    int fd;
    int64_t size; /* -1: not sent, reason says why */
    char reason[REASON_MAX];
};

/* A call's header and answer (with its output, when small); wiped after the call (forget()). */
static unsigned char header[MAX_HEADER];
static unsigned char answer[ANSWER_MAX];
static size_t answer_len;
static struct fetched fetched[MAX_FETCH];

struct call {
    double timeout;
    uint64_t memory, max_output, max_fetch, max_fetch_total;
    uint32_t cpu;
    unsigned nfetch;
};

static int fail(struct dsec_zygote *z, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(struct dsec_zygote *z, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(z->error, sizeof z->error, fmt, ap);
    va_end(ap);
    return -1;
}

static uint64_t get64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | p[i];
    return v;
}

static uint32_t get32(const unsigned char *p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }
static uint16_t get16(const unsigned char *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static unsigned char *put64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8) p[i] = v & 0xff;
    return p + 8;
}

static unsigned char *put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24, p[1] = v >> 16, p[2] = v >> 8, p[3] = v;
    return p + 4;
}

static unsigned char *put16(unsigned char *p, uint16_t v) {
    p[0] = v >> 8, p[1] = v;
    return p + 2;
}

static unsigned char *put_double(unsigned char *p, double d) {
    uint64_t v;
    memcpy(&v, &d, 8);
    return put64(p, v);
}

/* The hexadecimal or decimal number at *p, which is moved past it. Not strtoul: with _GNU_SOURCE,
 * glibc 2.38 and later bind that to __isoc23_strtoul, which an image's older glibc lacks. */
static unsigned long parse_number(const char **p, int base) {
    unsigned long v = 0;
    for (;; (*p)++) {
        int c = **p, d = c >= '0' && c <= '9' ? c - '0' : base == 16 && c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return v;
        v = v * (unsigned long)base + (unsigned long)d;
    }
}

/* 1: all read; 0: EOF before the first byte (at_start only); -1: error or EOF midway. */
static int read_exact(int fd, unsigned char *buf, size_t n, int at_start) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) {
            errno = 0;
            return got == 0 && at_start ? 0 : -1;
        }
        got += (size_t)r;
    }
    return 1;
}

static int write_all(int fd, const unsigned char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -1;
        buf += w, n -= (size_t)w;
    }
    return 0;
}

static int splice_all(int src, int dst, size_t n) {
    while (n > 0) {
        ssize_t moved = splice(src, NULL, dst, NULL, n, 0);
        if (moved < 0 && errno == EINTR) continue;
        if (moved <= 0) {
            if (moved == 0) errno = 0;
            return -1;
        }
        n -= (size_t)moved;
    }
    return 0;
}

/* n bytes of src from its start into buf; zeros past its end (the file shrank). */
static int pread_all(int src, unsigned char *buf, uint64_t n) {
    uint64_t got = 0;
    while (got < n) {
        ssize_t r = pread(src, buf + got, n - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        got += (uint64_t)r;
    }
    memset(buf + got, 0, n - got);
    return 0;
}

static int sendfile_all(int dst, int src, uint64_t n) {
    static const unsigned char zeros[4096];
    off_t offset = 0;
    while ((uint64_t)offset < n) {
        ssize_t sent = sendfile(dst, src, &offset, n - (uint64_t)offset);
        if (sent < 0 && errno == EINTR) continue;
        if (sent < 0) return -1;
        if (sent == 0) { /* the file shrank: keep the frame the length it announced */
            while ((uint64_t)offset < n) {
                size_t chunk = n - (uint64_t)offset < sizeof zeros ? n - (uint64_t)offset : sizeof zeros;
                if (write_all(dst, zeros, chunk) < 0) return -1;
                offset += (off_t)chunk;
            }
        }
    }
    return 0;
}

/* fstat through syscall(2): glibc's fstat symbol is only as old as 2.33. */
static int fstat_fd(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int answer_error(struct dsec_zygote *z, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int answer_error(struct dsec_zygote *z, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf((char *)answer + 5, 1024, fmt, ap);
    va_end(ap);
    if (n > 1023) n = 1023;
    answer[0] = 'E';
    put32(answer + 1, (uint32_t)n);
    answer_len = 5 + (size_t)n;
    return write_all(z->chan_out, answer, 5 + (size_t)n) < 0 ? fail(z, "cannot answer: %s", strerror(errno)) : 0;
}

static int parse_header(struct dsec_zygote *z, size_t n, struct call *c) {
    if (n < HEADER_FIXED + 2) return fail(z, "request header of %zu bytes is too short", n);
    uint64_t timeout_bits = get64(header);
    memcpy(&c->timeout, &timeout_bits, 8);
    c->memory = get64(header + 8);
    c->cpu = get32(header + 16);
    c->max_output = get64(header + 20);
    c->max_fetch = get64(header + 28);
    c->max_fetch_total = get64(header + 36);
    c->nfetch = get16(header + HEADER_FIXED);
    if (c->nfetch > MAX_FETCH) return fail(z, "request to fetch %u files", c->nfetch);
    size_t pos = HEADER_FIXED + 2;
    for (unsigned i = 0; i < c->nfetch; i++) {
        if (pos + 2 > n) return fail(z, "request header cut short");
        uint16_t len = get16(header + pos);
        if (pos + 2 + len > n) return fail(z, "request header cut short");
        fetched[i].path_len = len;
        fetched[i].path = (const char *)header + pos + 2;
        pos += 2 + (size_t)len;
    }
    if (!(c->timeout == c->timeout)) return fail(z, "request with a timeout that is not a number");
    return 0;
}

/* The call's exit: kill and reap every process it left (all are descendants of this subreaper). */
static void kill_all(void) {
    for (;;) {
        pid_t pid = waitpid(-1, NULL, WNOHANG);
        if (pid < 0 && errno == EINTR) continue;
        if (pid < 0) return; /* ECHILD: none left, the common case */
        if (pid == 0) break;  /* some still run */
    }
    kill(-1, SIGKILL);
    for (;;) {
        pid_t pid = waitpid(-1, NULL, 0);
        if (pid < 0 && errno != EINTR) return;
    }
}

static int wait_call(pid_t pid, double timeout, int *status, double *cpu, int *timed_out) {
    double ms = timeout * 1000 + 0.999;
    long long wait_ms = ms < 1 ? 1 : ms > 2e9 ? 2000000000 : (long long)ms;
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) return -1;
    struct pollfd pfd = {.fd = pidfd, .events = POLLIN};
    double deadline = now() + (double)wait_ms / 1000;
    int ready;
    for (;;) {
        ready = poll(&pfd, 1, (int)wait_ms);
        if (ready >= 0 || errno != EINTR) break;
        double left = (deadline - now()) * 1000;
        wait_ms = left < 0 ? 0 : (long long)left;
    }
    int saved = errno;
    close(pidfd);
    if (ready < 0) {
        errno = saved;
        return -1;
    }
    *timed_out = ready == 0;
    if (*timed_out) kill(-1, SIGKILL); /* every process but the pid namespace's init and this one */
    struct rusage usage;
    while (wait4(pid, status, 0, &usage) < 0) {
        if (errno != EINTR) return -1;
    }
    *cpu = (double)usage.ru_utime.tv_sec + (double)usage.ru_utime.tv_usec / 1e6 + (double)usage.ru_stime.tv_sec +
           (double)usage.ru_stime.tv_usec / 1e6;
    return 0;
}

static const char *open_error(int err) {
    switch (err) {
    case ENOENT:
    case ENOTDIR:
        return "no such file";
    case ELOOP:
        return "a symbolic link";
    case EACCES:
        return "permission denied";
    case EXDEV:
        return "outside the working directory";
    default:
        return NULL;
    }
}

/* Open the files to fetch beneath /work only (openat2 RESOLVE_BENEATH: no symlink out of it, no
 * /proc magic link) and with the call's own rights; nothing of them is read into this process. */
static int open_fetched(struct dsec_zygote *z, const struct call *c) {
    struct {
        uint64_t flags, mode, resolve;
    } how = {O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS};
    static char path[65536 + 1];
    uint64_t budget = c->max_fetch_total;
    for (unsigned i = 0; i < c->nfetch; i++) fetched[i].fd = -1, fetched[i].size = -1, fetched[i].reason[0] = 0;
    if (setegid(z->gid) < 0 || seteuid(z->uid) < 0) return fail(z, "cannot take the call's uid: %s", strerror(errno));
    for (unsigned i = 0; i < c->nfetch; i++) {
        struct fetched *f = &fetched[i];
        memcpy(path, f->path, f->path_len);
        path[f->path_len] = 0;
        int fd = (int)syscall(SYS_openat2, z->workdir_fd, path, &how, sizeof how);
        memset(path, 0, f->path_len);
        if (fd < 0) {
            int err = errno;
            const char *why = open_error(err);
            snprintf(f->reason, sizeof f->reason, "%s", why ? why : strerror(err));
            if (!why)
                for (char *p = f->reason; *p; p++)
                    if (*p >= 'A' && *p <= 'Z') *p += 'a' - 'A';
            continue;
        }
        f->fd = fd;
        struct stat st;
        if (fstat_fd(fd, &st) < 0) {
            snprintf(f->reason, sizeof f->reason, "%s", strerror(errno));
        } else if (!S_ISREG(st.st_mode)) {
            snprintf(f->reason, sizeof f->reason, "not a regular file");
        } else if ((uint64_t)st.st_size > (c->max_fetch < budget ? c->max_fetch : budget)) {
            snprintf(f->reason, sizeof f->reason, "%lld bytes is over the fetch limit", (long long)st.st_size);
        } else {
            budget -= (uint64_t)st.st_size;
            f->size = st.st_size;
        }
    }
    if (seteuid(0) < 0 || setegid(0) < 0) return fail(z, "cannot take back root: %s", strerror(errno));
    return 0;
}

static int send_result(struct dsec_zygote *z, const struct call *c, int status, double duration, double cpu,
                       int timed_out, int out_fd, int err_fd) {
    struct stat st;
    if (fstat_fd(out_fd, &st) < 0) return fail(z, "fstat stdout: %s", strerror(errno));
    uint64_t out_total = (uint64_t)st.st_size;
    if (fstat_fd(err_fd, &st) < 0) return fail(z, "fstat stderr: %s", strerror(errno));
    uint64_t err_total = (uint64_t)st.st_size;
    uint64_t out_sent = out_total < c->max_output ? out_total : c->max_output;
    uint64_t err_sent = err_total < c->max_output ? err_total : c->max_output;
    int rc = 0;
    if (c->nfetch && open_fetched(z, c) < 0) rc = -1;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? -WTERMSIG(status) : -1;
    unsigned char *p = answer + 5;
    if (rc == 0) {
        p = put32(p, (uint32_t)code);
        *p++ = timed_out ? 1 : 0;
        p = put_double(p, duration);
        p = put_double(p, cpu);
        p = put64(p, out_sent);
        p = put64(p, err_sent);
        p = put64(p, out_total);
        p = put64(p, err_total);
        p = put16(p, (uint16_t)c->nfetch);
        for (unsigned i = 0; i < c->nfetch; i++) {
            const struct fetched *f = &fetched[i];
            size_t reason_len = f->size < 0 ? strlen(f->reason) : 0;
            p = put16(p, f->path_len);
            p = put64(p, (uint64_t)f->size);
            p = put16(p, (uint16_t)reason_len);
            memcpy(p, f->path, f->path_len);
            p += f->path_len;
            memcpy(p, f->reason, reason_len);
            p += reason_len;
        }
        answer[0] = 'A';
        put32(answer + 1, (uint32_t)(p - answer - 5));
        /* Small output goes in the same write as the result: one wake-up of the edge's reader,
         * not three. It is wiped from the buffer before the next fork, like the rest. */
        int inline_output = out_sent + err_sent <= INLINE_MAX;
        if (inline_output) {
            if (pread_all(out_fd, p, out_sent) < 0 || pread_all(err_fd, p + out_sent, err_sent) < 0)
                rc = fail(z, "cannot read the call's output: %s", strerror(errno));
            p += out_sent + err_sent;
        }
        answer_len = (size_t)(p - answer);
        if (rc == 0 && (write_all(z->chan_out, answer, answer_len) < 0 ||
                        (!inline_output && (sendfile_all(z->chan_out, out_fd, out_sent) < 0 ||
                                            sendfile_all(z->chan_out, err_fd, err_sent) < 0))))
            rc = fail(z, "cannot answer: %s", strerror(errno));
        for (unsigned i = 0; rc == 0 && i < c->nfetch; i++)
            if (fetched[i].size > 0 && sendfile_all(z->chan_out, fetched[i].fd, (uint64_t)fetched[i].size) < 0)
                rc = fail(z, "cannot answer: %s", strerror(errno));
    }
    for (unsigned i = 0; i < c->nfetch; i++)
        if (fetched[i].fd >= 0) close(fetched[i].fd), fetched[i].fd = -1;
    return rc;
}

struct dir_state {
    off_t size;
    mode_t mode;
    uid_t uid;
    gid_t gid;
    struct timespec mtime, ctime;
};

static int dir_state(int fd, struct dir_state *s) {
    struct stat st;
    if (fstat_fd(fd, &st) < 0) return -1;
    *s = (struct dir_state){st.st_size, st.st_mode, st.st_uid, st.st_gid, st.st_mtim, st.st_ctim};
    return 0;
}

static int same_state(const struct dir_state *a, const struct dir_state *b) {
    return a->size == b->size && a->mode == b->mode && a->uid == b->uid && a->gid == b->gid &&
           a->mtime.tv_sec == b->mtime.tv_sec && a->mtime.tv_nsec == b->mtime.tv_nsec &&
           a->ctime.tv_sec == b->ctime.tv_sec && a->ctime.tv_nsec == b->ctime.tv_nsec;
}

/* -- the interpreter's code on huge pages ---------------------------------------------------
 *
 * fork(2) copies no page-table entry of a file mapping that holds no anonymous page, such as
 * the interpreter's code: each call's child faulted it in again (≈35 faults a call in
 * python3.11's code and read-only data, 16 pages each with fault-around, every page then
 * unmapped again at exit). An anonymous mapping on a transparent huge page goes to the child as
 * one page-directory entry instead: no fault, no page-table entry to copy at fork or to unmap at
 * exit. So, once warm, the zygote copies each 2 MiB-aligned stretch of an object's read-only
 * mappings (ELF headers, code, read-only data, RELRO) into a huge page and moves it over the
 * original: the same bytes at the same addresses, now one mapping, executable if any of it was.
 * A stretch the kernel gives no huge page for is left as it was: as 512 small anonymous pages
 * it would cost about what it saves (≈0.13 us a page-table entry at fork and exit, here, against
 * ≈3 us a fault that maps 16). mremap(2) swaps the pages in one step, so code running from the
 * stretch (this process's interpreter) sees no gap. Measured: 34 faults fewer a call (202.5 to
 * 168.5), the workers' CPU 1.045 to 0.939 ms a call.
 */

#define HUGE_PAGE (2UL << 20)

struct mapping {
    unsigned long start, end, inode;
    char perms[4];
};

static const char *skip_field(const char *p) {
    while (*p && *p != ' ') p++;
    while (*p == ' ') p++;
    return p;
}

/* A line of /proc/self/maps; 1 for a mapping of a file (a path, not [heap] or [vdso]). */
static int parse_mapping(const char *line, struct mapping *m) {
    const char *p = line;
    m->start = parse_number(&p, 16);
    if (*p++ != '-') return 0;
    m->end = parse_number(&p, 16);
    if (*p++ != ' ' || strlen(p) < 4) return 0;
    memcpy(m->perms, p, 4);
    p = skip_field(skip_field(skip_field(p))); /* perms, offset, device */
    m->inode = parse_number(&p, 10);
    while (*p == ' ') p++;
    return m->inode != 0 && *p == '/';
}

/* Readable, not writable, private (a guard gap, ---p, is not readable). */
static int read_only(const struct mapping *m) { return m->perms[0] == 'r' && m->perms[1] == '-' && m->perms[3] == 'p'; }

/* The kB of AnonHugePages of the mapping that starts at addr (/proc/self/smaps), or -1. */
static long anon_huge_kb(unsigned long addr) {
    static char buf[1 << 16];
    char head[32];
    int head_len = snprintf(head, sizeof head, "%lx-", addr);
    int fd = open("/proc/self/smaps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    long found = -1;
    int in_entry = 0;
    size_t used = 0;
    while (found < 0) {
        ssize_t got = read(fd, buf + used, sizeof buf - 1 - used);
        if (got <= 0) break;
        used += (size_t)got;
        buf[used] = 0;
        char *line = buf, *nl;
        while (found < 0 && (nl = strchr(line, '\n'))) {
            *nl = 0;
            if (strncmp(line, head, (size_t)head_len) == 0) {
                in_entry = 1;
            } else if (in_entry && strncmp(line, "AnonHugePages:", 14) == 0) {
                const char *p = line + 14;
                while (*p == ' ') p++;
                found = (long)parse_number(&p, 10);
            }
            line = nl + 1;
        }
        used = (size_t)(buf + used - line);
        memmove(buf, line, used);
        if (used == sizeof buf - 1) used = 0; /* a line longer than the buffer: not one we want */
    }
    close(fd);
    return found;
}

/* Move a huge-page copy of [addr, addr + HUGE_PAGE) over it: 1 done, 0 left as it was. */
static int to_huge_page(unsigned long addr, int prot) {
    char *raw = mmap(NULL, 2 * HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return 0;
    char *copy = (char *)(((unsigned long)raw + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1));
    if (copy > raw) munmap(raw, (size_t)(copy - raw));
    munmap(copy + HUGE_PAGE, (size_t)(raw + HUGE_PAGE - copy));
    if (madvise(copy, HUGE_PAGE, MADV_HUGEPAGE) < 0) goto undo;
    memcpy(copy, (const void *)addr, HUGE_PAGE);
    if (anon_huge_kb((unsigned long)copy) * 1024 != (long)HUGE_PAGE) goto undo;
    if (mprotect(copy, HUGE_PAGE, prot) < 0) goto undo;
    if (mremap(copy, HUGE_PAGE, HUGE_PAGE, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)addr) == MAP_FAILED) goto undo;
    return 1;
undo:
    munmap(copy, HUGE_PAGE);
    return 0;
}

/* Put the loaded objects' read-only stretches on huge pages (see above); the bytes now there,
 * or -1 when /proc/self/maps cannot be read whole. Called once, by the warm zygote, before
 * dsec_zygote_serve. */
long dsec_zygote_code_to_huge_pages(void) {
    static char maps[1 << 16];
    static struct mapping m[1024];
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t used = 0;
    ssize_t got = 0;
    while (used < sizeof maps - 1 && (got = read(fd, maps + used, sizeof maps - 1 - used)) > 0) used += (size_t)got;
    close(fd);
    if (got < 0 || used == sizeof maps - 1) return -1;
    maps[used] = 0;
    int n = 0;
    for (char *line = maps, *nl; n < (int)(sizeof m / sizeof *m) && (nl = strchr(line, '\n')); line = nl + 1) {
        *nl = 0;
        n += parse_mapping(line, &m[n]);
    }
    long moved = 0;
    for (int i = 0, j; i < n; i = j + 1) {
        j = i;
        if (!read_only(&m[i])) continue;
        while (j + 1 < n && m[j + 1].inode == m[i].inode && m[j + 1].start == m[j].end && read_only(&m[j + 1])) j++;
        unsigned long from = (m[i].start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), to = m[j].end & ~(HUGE_PAGE - 1);
        for (unsigned long addr = from; addr + HUGE_PAGE <= to; addr += HUGE_PAGE) {
            int exec = 0;
            for (int k = i; k <= j; k++) exec |= m[k].perms[2] == 'x' && m[k].start < addr + HUGE_PAGE && m[k].end > addr;
            moved += to_huge_page(addr, PROT_READ | (exec ? PROT_EXEC : 0)) ? (long)HUGE_PAGE : 0;
        }
    }
    return moved;
}

/* -- the call's child ---------------------------------------------------------------------- */

_Noreturn static void cannot_start(const char *what, const char *detail, int err) {
    char msg[1024];
    int n = snprintf(msg, sizeof msg, "fncall: the call could not start: %s%s%s: [Errno %d] %s\n", what,
                     detail ? " " : "", detail ? detail : "", err, strerror(err));
    if (n > 0) write_all(2, (const unsigned char *)msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    _exit(126);
}

static void check(int rc, const char *what) {
    if (rc < 0) cannot_start(what, NULL, errno);
}

static void set_limit(int resource, rlim_t soft, rlim_t hard, const char *what) {
    struct rlimit limit = {soft, hard};
    check(setrlimit(resource, &limit), what);
}

static void write_input(const char *path, const unsigned char *data, uint32_t len) {
    static char dir[65536 + 1];
    size_t n = strlen(path);
    memcpy(dir, path, n + 1);
    for (char *slash = strchr(dir, '/'); slash; slash = strchr(slash + 1, '/')) { /* os.makedirs */
        *slash = 0;
        if (mkdir(dir, 0777) < 0 && errno != EEXIST) cannot_start("cannot create", dir, errno);
        *slash = '/';
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) cannot_start("cannot create", path, errno);
    if (write_all(fd, data, len) < 0) cannot_start("cannot write", path, errno);
    close(fd);
}

/* What the call's process does before its code runs, in this order: a session of its own; stdin
 * (a memfd with the call's input, or /dev/null), stdout and stderr; the Landlock ruleset;
 * nothing of the zygote's left open; first to die under memory pressure; RLIMIT_CPU; the call's
 * uid and gid (dumpable again, or its own /proc entries are hidden from it); /work; the input
 * files. Any failure ends the child with 126 and a line on its stderr. */
static void prepare_call(struct dsec_zygote *z, const struct call *c, int body_fd, uint32_t body_len, int out_fd,
                         int err_fd, int *language) {
    check(setsid(), "setsid");
    if (body_len < BODY_FIXED) cannot_start("a short request body", NULL, EINVAL);
    const unsigned char *body = mmap(NULL, body_len, PROT_READ, MAP_PRIVATE, body_fd, 0);
    if (body == MAP_FAILED) cannot_start("mmap", NULL, errno);
    *language = body[0];
    uint32_t code_len = get32(body + 1), env_len = get32(body + 5), stdin_len = get32(body + 9);
    uint32_t nfiles = get32(body + 13);
    uint64_t pos = BODY_FIXED + (uint64_t)code_len + env_len;
    int has_stdin = stdin_len != 0xffffffffu;
    if (pos + (has_stdin ? stdin_len : 0) > body_len) cannot_start("a broken request body", NULL, EINVAL);
    if (has_stdin) {
        int stdin_fd = (int)syscall(SYS_memfd_create, "stdin", 0);
        if (stdin_fd < 0) cannot_start("memfd_create", NULL, errno);
        if (write_all(stdin_fd, body + pos, stdin_len) < 0) cannot_start("stdin", NULL, errno);
        check((int)lseek(stdin_fd, 0, SEEK_SET), "lseek");
        check(dup2(stdin_fd, 0), "dup2");
        pos += stdin_len;
    } else {
        check(dup2(z->devnull_fd, 0), "dup2");
    }
    check(dup2(out_fd, 1), "dup2");
    check(dup2(err_fd, 2), "dup2");
    if (z->ruleset_fd >= 0 && syscall(SYS_landlock_restrict_self, z->ruleset_fd, 1) < 0) { /* 1: LOG_SAME_EXEC_OFF */
        if (errno != EINVAL || syscall(SYS_landlock_restrict_self, z->ruleset_fd, 0) < 0) /* EINVAL: ABI < 7 */
            cannot_start("landlock_restrict_self", NULL, errno);
    }
    /* Nothing of the zygote's stays open in the call: not the channel, not a memfd. A Python
     * call's own body stays, as BODY_FD, for the child to read its code from (see below). */
    int python = *language == 0;
    if (python) check(dup2(body_fd, BODY_FD), "dup2");
    check((int)syscall(SYS_close_range, python ? BODY_FD + 1 : BODY_FD, ~0U, 0), "close_range");
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom < 0 || write(oom, "1000", 4) != 4) cannot_start("oom_score_adj", NULL, errno);
    close(oom);
    set_limit(RLIMIT_CPU, c->cpu, (rlim_t)c->cpu + 1, "RLIMIT_CPU");
    check(setgid(z->gid), "setgid");
    check(setuid(z->uid), "setuid");
    check(prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl");
    check(chdir(WORKDIR), "chdir");
    for (uint32_t i = 0; i < nfiles; i++) {
        if (pos + 6 > body_len) cannot_start("a broken request body", NULL, EINVAL);
        uint16_t path_len = get16(body + pos);
        uint32_t data_len = get32(body + pos + 2);
        pos += 6;
        if (pos + path_len + (uint64_t)data_len > body_len) cannot_start("a broken request body", NULL, EINVAL);
        static char path[65536 + 1];
        memcpy(path, body + pos, path_len);
        path[path_len] = 0;
        if (strlen(path) != path_len) cannot_start("a file name with NUL", NULL, EINVAL);
        write_input(path, body + pos + path_len, data_len);
        pos += path_len + (uint64_t)data_len;
    }
    /* A Python call reads its code and environment from BODY_FD with os.pread (no ctypes call in
     * the child: 4 page faults fewer a call); the child closes it before the code runs. */
    if (python) {
        munmap((void *)body, body_len);
        z->code = z->env = NULL, z->code_len = code_len, z->env_len = env_len;
        return;
    }
    /* Keep the code and environment only (the body may be large, and counts against RLIMIT_AS). */
    size_t keep = code_len + (size_t)env_len;
    char *kept = mmap(NULL, keep + 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (kept == MAP_FAILED) cannot_start("mmap", NULL, errno);
    memcpy(kept, body + BODY_FIXED, keep);
    munmap((void *)body, body_len);
    z->code = kept, z->code_len = code_len;
    z->env = kept + code_len, z->env_len = env_len;
}

/* bash -c CODE, with the zygote's environment plus the call's additions. */
_Noreturn static void exec_bash(struct dsec_zygote *z) {
    extern char **environ;
    size_t n = 0, added = 0;
    while (environ[n]) n++;
    for (unsigned i = 0; i < z->env_len; i++) added += z->env[i] == 0;
    char **envp =
        mmap(NULL, (n + added + 1) * sizeof *envp, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *code = mmap(NULL, z->code_len + 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (envp == MAP_FAILED || code == MAP_FAILED) cannot_start("mmap", NULL, errno);
    if (memchr(z->code, 0, z->code_len)) cannot_start("bash code with a NUL byte", NULL, EINVAL);
    memcpy(code, z->code, z->code_len);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) envp[m++] = environ[i];
    for (const char *item = z->env; item < z->env + z->env_len; item += strlen(item) + 1) {
        if (!*item) continue;
        const char *eq = strchr(item, '=');
        size_t name_len = eq ? (size_t)(eq - item) : strlen(item);
        size_t j = 0;
        for (; j < n; j++) /* an addition replaces the zygote's own variable of that name */
            if (strncmp(envp[j], item, name_len) == 0 && envp[j][name_len] == '=') break;
        if (j < n)
            envp[j] = (char *)item;
        else
            envp[m++] = (char *)item;
    }
    envp[m] = NULL;
    set_limit(RLIMIT_AS, z->memory, z->memory, "RLIMIT_AS");
    signal(SIGPIPE, SIG_DFL);
    signal(SIGXFSZ, SIG_DFL);
    char *argv[] = {"bash", "-c", code, NULL};
    execve("/bin/bash", argv, envp);
    cannot_start("execve", "/bin/bash", errno);
}

/* One call; 1 in the child, 0 done, -1 failed. */
static int serve_one(struct dsec_zygote *z, const struct call *c, uint32_t body_len) {
    int body_fd = (int)syscall(SYS_memfd_create, "body", MFD_CLOEXEC);
    if (body_fd < 0) return fail(z, "memfd_create: %s", strerror(errno));
    if (splice_all(z->chan_in, body_fd, body_len) < 0) {
        int err = errno;
        close(body_fd);
        return fail(z, "cannot read the request body: %s", err ? strerror(err) : "end of file");
    }
    int out_fd = (int)syscall(SYS_memfd_create, "stdout", MFD_CLOEXEC);
    int err_fd = out_fd < 0 ? -1 : (int)syscall(SYS_memfd_create, "stderr", MFD_CLOEXEC);
    char statm[64];
    ssize_t got = err_fd < 0 ? -1 : pread(z->statm_fd, statm, sizeof statm - 1, 0);
    if (got <= 0) {
        int err = errno;
        close(body_fd);
        if (out_fd >= 0) close(out_fd);
        if (err_fd >= 0) close(err_fd);
        return fail(z, "cannot prepare the call: %s", strerror(err));
    }
    statm[got] = 0;
    const char *digits = statm;
    unsigned long long pages = parse_number(&digits, 10);
    double start = now();
    z->before_fork();
    pid_t pid = fork();
    int fork_errno = errno;
    if (pid == 0) {
        z->after_fork_child();
        int language;
        z->memory = c->memory, z->vsz = pages * (unsigned long long)sysconf(_SC_PAGESIZE);
        prepare_call(z, c, body_fd, body_len, out_fd, err_fd, &language);
        if (language == 1) exec_bash(z);
        if (language != 0) cannot_start("a request for another language", NULL, EINVAL);
        return 1;
    }
    z->after_fork_parent();
    close(body_fd);
    if (pid < 0) {
        close(out_fd), close(err_fd);
        return answer_error(z, "cannot fork the call: [Errno %d] %s", fork_errno, strerror(fork_errno));
    }
    int status = 0, timed_out = 0, rc;
    double cpu = 0;
    if (wait_call(pid, c->timeout, &status, &cpu, &timed_out) < 0) {
        rc = fail(z, "cannot wait for the call: %s", strerror(errno));
    } else {
        double duration = now() - start;
        kill_all();
        rc = send_result(z, c, status, duration, cpu, timed_out, out_fd, err_fd);
    }
    close(out_fd), close(err_fd);
    return rc;
}

/* The next call's child gets a copy of this process: leave it nothing of this call (names of
 * fetched files, sizes). Only pages this call wrote are touched. */
static void forget(size_t header_len, unsigned nfetch) {
    memset(header, 0, header_len);
    memset(answer, 0, answer_len);
    memset(fetched, 0, nfetch * sizeof *fetched);
    answer_len = 0;
}

int dsec_zygote_serve(struct dsec_zygote *z) {
    struct dir_state clean[MAX_DIRS];
    if (z->ndirs < 0 || z->ndirs > MAX_DIRS) return fail(z, "%d directories to watch", z->ndirs);
    for (int i = 0; i < z->ndirs; i++)
        if (dir_state(z->dir_fds[i], &clean[i]) < 0) return fail(z, "fstat: %s", strerror(errno));
    for (;;) {
        unsigned char lengths[8];
        int r = read_exact(z->chan_in, lengths, 8, 1);
        if (r == 0) return 0;
        if (r < 0) return fail(z, "cannot read a request: %s", errno ? strerror(errno) : "end of file");
        uint32_t hlen = get32(lengths), blen = get32(lengths + 4);
        if (hlen > MAX_HEADER) return fail(z, "request header of %u bytes", hlen);
        if (read_exact(z->chan_in, header, hlen, 0) < 0)
            return fail(z, "cannot read a request: %s", errno ? strerror(errno) : "end of file");
        struct call c = {0};
        if (parse_header(z, hlen, &c) < 0) return -1;
        r = serve_one(z, &c, blen);
        if (r == 1) return r;
        forget(hlen, c.nfetch);
        if (r != 0) return r;
        /* Anything written to the wiped directories changes a directory's size (tmpfs counts
         * entries) or times; /work's extended attributes are checked too. */
        for (int i = 0; i < z->ndirs; i++) {
            struct dir_state s;
            if (dir_state(z->dir_fds[i], &s) < 0) return fail(z, "fstat: %s", strerror(errno));
            if (!same_state(&s, &clean[i])) return 2;
        }
        ssize_t xattrs = flistxattr(z->workdir_fd, NULL, 0);
        if (xattrs != 0) return 2;
    }
}
