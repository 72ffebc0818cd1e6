/* dsec-jail: confine a command, then exec it. Built static by dsec.isolation.jail.
 *
 *   dsec-jail [--caps N,N,…] [--seccomp FILE] [--rw|--ro|--hide PATH]… [--scope] [--join PID]
 *             [--cwd DIR] [--user UID:GID] [--strict] [--ctty] -- COMMAND [ARG…]
 *   dsec-jail [--ro PATH]… --init
 *
 * --init makes a sandbox's pid namespace (and a mount namespace with that namespace's /proc,
 * where each --ro PATH is a read-only bind mount): its pid 1 reaps, forever; the pid it has
 * outside is printed. In this order, in the process
 * that becomes COMMAND:
 *   --join     enter the pid and mount namespaces of that init: the command sees, and can
 *              signal, only the processes of the sandbox's commands (not whoever started it).
 *              The jail stays outside and exits with the command's status.
 *   --ctty     a session of its own whose controlling terminal is stdin (a PTY's: Ctrl-C typed
 *              there reaches the command's foreground job, inside the sandbox's namespace).
 *   --cwd      change to DIR (in the joined mount namespace); exit status 1 when it cannot.
 *   Landlock   filesystem rules (any --rw/--ro/--hide): a path that no option names gets full
 *              access, a named path gets its mode for itself and everything beneath it (named
 *              paths beneath it excepted). Landlock only allows, so the directories above a
 *              named path are walked: each of their entries gets a rule of its own, the
 *              directories themselves may only be listed; nothing new can be made in them.
 *              --scope (Landlock ABI 6): no signal to, and no abstract unix socket of, a
 *              process outside the command's own domain. Best effort by the kernel's ABI,
 *              unless --strict (then missing Landlock fails the jail).
 *   no_new_privs
 *   --caps     the capability bounding set reduced to these numbers; effective, permitted
 *              and inheritable to match; ambient cleared.
 *   --seccomp  a BPF program (an array of struct sock_filter) loaded with seccomp(2).
 *   --user     no supplementary groups, then setgid(GID) and setuid(UID) (a uid other than 0
 *              leaves the command no capabilities, as for any root process that drops to it).
 *   every fd above 2 is closed, then COMMAND is exec'd (PATH is searched) with the jail's own
 *   environment.
 *
 * Exit status: the command's (128 + N when signal N ended it), 127/126 when it cannot be run,
 * 125 when the jail itself fails (with a message on stderr).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/landlock.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define FAIL_CODE 125
#define MAX_PATHS 64

/* Constants newer than some build hosts' headers. */
#ifndef LANDLOCK_ACCESS_FS_REFER
#define LANDLOCK_ACCESS_FS_REFER (1ULL << 13)
#endif
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14)
#endif
#ifndef LANDLOCK_ACCESS_FS_IOCTL_DEV
#define LANDLOCK_ACCESS_FS_IOCTL_DEV (1ULL << 15)
#endif
#define SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)
#define SCOPE_SIGNAL (1ULL << 1)
#define RESTRICT_SELF_LOG_NEW_EXEC_ON (1U << 1)

/* struct landlock_ruleset_attr as of ABI 6 (the kernel takes a shorter one from older ABIs). */
struct ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

enum mode { FULL, READ_ONLY, HIDDEN };

static struct {
    const char *path;
    enum mode mode;
} named[MAX_PATHS];
static int n_named;
static int strict;

static void die(const char *fmt, ...)
{
    va_list ap;
    fputs("dsec-jail: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    _exit(FAIL_CODE);
}

/* -- Landlock ---------------------------------------------------------------------------- */

static uint64_t fs_rights;    /* every filesystem right the running kernel knows */
static uint64_t file_rights;  /* those that apply to a non-directory */

static uint64_t rights_of(enum mode m)
{
    if (m == FULL)
        return fs_rights;
    if (m == READ_ONLY)
        return LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR;
    return 0;
}

/* The mode a named path has, or -1. */
static int mode_of(const char *path)
{
    for (int i = 0; i < n_named; i++)
        if (strcmp(named[i].path, path) == 0)
            return named[i].mode;
    return -1;
}

/* True when a named path lies strictly beneath `dir`. */
static int holds_named(const char *dir)
{
    size_t n = strlen(dir);
    for (int i = 0; i < n_named; i++) {
        const char *p = named[i].path;
        if (n == 1 ? p[1] != '\0' : strncmp(p, dir, n) == 0 && p[n] == '/')
            return 1;
    }
    return 0;
}

static void add_rule(int ruleset, const char *path, uint64_t rights)
{
    int fd = open(path, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return;  /* gone since it was listed */
        die("cannot open %s for a Landlock rule: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) < 0)
        die("cannot stat %s: %s", path, strerror(errno));
    if (S_ISLNK(st.st_mode)) {  /* a symlink's target has a rule (or not) of its own */
        close(fd);
        return;
    }
    if (!S_ISDIR(st.st_mode))
        rights &= file_rights;
    struct landlock_path_beneath_attr attr = {.allowed_access = rights, .parent_fd = fd};
    if (rights && syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &attr, 0) < 0)
        die("cannot add a Landlock rule for %s: %s", path, strerror(errno));
    close(fd);
}

/* Give each entry of `dir` (a directory above a named path) its rule; `inherited` is the mode
 * of the nearest named path above, for entries no option names. */
static void walk(int ruleset, const char *dir, enum mode inherited)
{
    DIR *d = opendir(dir);
    if (!d)
        die("cannot list %s: %s", dir, strerror(errno));
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char path[4096];
        if (snprintf(path, sizeof path, "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name) >= (int)sizeof path)
            die("path too long under %s", dir);
        int m = mode_of(path);
        enum mode mode = m >= 0 ? (enum mode)m : inherited;
        struct stat st;
        int is_dir = e->d_type == DT_DIR || (e->d_type == DT_UNKNOWN && lstat(path, &st) == 0 && S_ISDIR(st.st_mode));
        if (is_dir && holds_named(path))
            walk(ruleset, path, mode);
        else if (mode != HIDDEN)
            add_rule(ruleset, path, rights_of(mode));
    }
    closedir(d);
}

static int landlock_abi(void)
{
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    return abi < 0 ? 0 : (int)abi;
}

/* Build the ruleset (before anything else is dropped: it opens paths); -1 when there is none. */
static int landlock_ruleset(int scope)
{
    if (!n_named && !scope)
        return -1;
    int abi = landlock_abi();
    if (abi < 1) {
        if (strict)
            die("Landlock is not available (%s)", strerror(errno));
        return -1;
    }
    fs_rights = (LANDLOCK_ACCESS_FS_MAKE_SYM << 1) - 1;  /* ABI 1: bits 0-12 */
    file_rights = LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_READ_FILE;
    if (abi >= 2)
        fs_rights |= LANDLOCK_ACCESS_FS_REFER;
    if (abi >= 3) {
        fs_rights |= LANDLOCK_ACCESS_FS_TRUNCATE;
        file_rights |= LANDLOCK_ACCESS_FS_TRUNCATE;
    }
    if (abi >= 5) {
        fs_rights |= LANDLOCK_ACCESS_FS_IOCTL_DEV;
        file_rights |= LANDLOCK_ACCESS_FS_IOCTL_DEV;
    }
    if (scope && abi < 6 && strict)
        die("Landlock ABI %d has no scopes (6 needed)", abi);
    struct ruleset_attr attr = {
        .handled_access_fs = n_named ? fs_rights : 0,
        .scoped = scope && abi >= 6 ? SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL : 0,
    };
    if (!attr.handled_access_fs && !attr.scoped)
        return -1;
    size_t size = abi >= 6 ? sizeof attr : abi >= 4 ? 2 * sizeof(uint64_t) : sizeof(uint64_t);
    int ruleset = syscall(SYS_landlock_create_ruleset, &attr, size, 0);
    if (ruleset < 0)
        die("cannot create a Landlock ruleset: %s", strerror(errno));
    if (n_named) {
        add_rule(ruleset, "/", LANDLOCK_ACCESS_FS_READ_DIR);  /* `ls /` */
        walk(ruleset, "/", FULL);
    }
    return ruleset;
}

static void landlock_restrict(int ruleset)
{
    if (ruleset < 0)
        return;
    /* ABI 7: also log denials after exec (the command is what runs then) as audit records. */
    unsigned flags = landlock_abi() >= 7 ? RESTRICT_SELF_LOG_NEW_EXEC_ON : 0;
    if (syscall(SYS_landlock_restrict_self, ruleset, flags) < 0)
        die("cannot enforce the Landlock ruleset: %s", strerror(errno));
    close(ruleset);
}

/* -- capabilities and seccomp ------------------------------------------------------------ */

static void keep_caps(const char *list)
{
    uint64_t keep = 0;
    for (const char *p = list; *p;) {
        char *end;
        long n = strtol(p, &end, 10);
        if (end == p || n < 0 || n > 63 || (*end && *end != ','))
            die("--caps wants capability numbers separated by commas, not %s", list);
        keep |= 1ULL << n;
        p = *end ? end + 1 : end;
    }
    for (int cap = 0; cap <= 63; cap++) {
        if (keep & (1ULL << cap))
            continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)  /* EINVAL: no such cap */
            die("cannot drop capability %d from the bounding set: %s", cap, strerror(errno));
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        die("cannot clear the ambient capabilities: %s", strerror(errno));
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &hdr, data) < 0)
        die("capget: %s", strerror(errno));
    for (int i = 0; i < 2; i++) {
        uint32_t mask = (uint32_t)(keep >> (32 * i));
        data[i].effective &= mask;
        data[i].permitted &= mask;
        data[i].inheritable &= mask;
    }
    if (syscall(SYS_capset, &hdr, data) < 0)
        die("capset: %s", strerror(errno));
}

static struct sock_filter seccomp_prog[BPF_MAXINSNS + 1];
static struct sock_fprog seccomp_fprog;

/* Read the program early: Landlock may hide the file by the time it is loaded. */
static void read_seccomp(const char *file)
{
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("cannot open the seccomp program %s: %s", file, strerror(errno));
    ssize_t n = read(fd, seccomp_prog, sizeof seccomp_prog);
    if (n < 0)
        die("cannot read %s: %s", file, strerror(errno));
    close(fd);
    if (n == 0 || n % sizeof seccomp_prog[0] || n > (ssize_t)(BPF_MAXINSNS * sizeof seccomp_prog[0]))
        die("%s is not a seccomp BPF program (%zd bytes)", file, n);
    seccomp_fprog.len = n / sizeof seccomp_prog[0];
    seccomp_fprog.filter = seccomp_prog;
}

static void load_seccomp(void)
{
    if (seccomp_fprog.len && syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &seccomp_fprog) < 0)
        die("cannot load the seccomp program: %s", strerror(errno));
}

/* -- the sandbox's pid namespace ---------------------------------------------------------- */

/* --init: make a pid and mount namespace (with its own /proc, and each --ro path a read-only
 * bind mount: Landlock before ABI 3 cannot stop truncate(2)) whose pid 1 reaps whatever ends in
 * it, forever; print that process's pid (as the caller sees it) and exit. */
static void start_init(void)
{
    for (int i = 0; i < n_named; i++)
        if (named[i].mode != READ_ONLY)
            die("--init takes only --ro paths, not %s", named[i].path);
    if (unshare(CLONE_NEWPID | CLONE_NEWNS) < 0)
        die("cannot make a pid and mount namespace: %s", strerror(errno));
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &chld, NULL) < 0)
        die("sigprocmask: %s", strerror(errno));
    /* The pid is printed once the mounts are made: no command joins a namespace without them. */
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) < 0)
        die("pipe: %s", strerror(errno));
    pid_t init = fork();
    if (init < 0)
        die("fork: %s", strerror(errno));
    if (init > 0) {
        char ok;
        close(ready[1]);
        if (read(ready[0], &ok, 1) != 1)
            die("the sandbox's init could not set its mounts up");
        printf("%d\n", init);
        _exit(fflush(stdout) == 0 ? 0 : FAIL_CODE);
    }
    close(ready[0]);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        die("cannot make the mounts private: %s", strerror(errno));
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        die("cannot mount /proc: %s", strerror(errno));
    for (int i = 0; i < n_named; i++) {
        const char *path = named[i].path;
        if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) < 0 ||
            mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) < 0)
            die("cannot make %s read-only: %s", path, strerror(errno));
    }
    if (write(ready[1], "1", 1) != 1)
        _exit(FAIL_CODE);
    close(ready[1]);
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0 || dup2(null, 2) < 0 || chdir("/") < 0)
        _exit(FAIL_CODE);
    syscall(SYS_close_range, 3, ~0U, 0);
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
        sigwaitinfo(&chld, NULL);
    }
}

static int exit_code(int status)
{
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* --join PID: enter the pid and mount namespaces of PID (an --init) and fork; returns in the
 * child, which goes on to become the command; the parent exits with the command's status.
 * What the command leaves running is reaped by that init. */
static void join(const char *pid)
{
    const char *kinds[] = {"mnt", "pid"};
    int fds[2];
    for (int i = 0; i < 2; i++) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%s/ns/%s", pid, kinds[i]);
        if ((fds[i] = open(path, O_RDONLY | O_CLOEXEC)) < 0)
            die("cannot open %s: %s", path, strerror(errno));
    }
    for (int i = 0; i < 2; i++) {
        if (setns(fds[i], 0) < 0)
            die("cannot enter the %s namespace of %s: %s", kinds[i], pid, strerror(errno));
        close(fds[i]);
    }
    pid_t child = fork();
    if (child < 0)
        die("fork: %s", strerror(errno));
    if (child == 0)
        return;
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR)
            die("waitpid: %s", strerror(errno));
    _exit(exit_code(status));
}

/* --user UID:GID, last before the exec (a command's own uid and gid; the sandbox's confinement
 * is in place by then). */
static void become(const char *user)
{
    char *end;
    unsigned long uid = strtoul(user, &end, 10), gid;
    if (end == user || *end != ':' || (gid = strtoul(end + 1, &end, 10), *end) || uid > 0xfffffffeUL || gid > 0xfffffffeUL)
        die("--user wants UID:GID, not %s", user);
    if (setgroups(0, NULL) < 0 && errno != EPERM)
        die("setgroups: %s", strerror(errno));
    if (setgid((gid_t)gid) < 0)
        die("setgid %lu: %s", gid, strerror(errno));
    if (setuid((uid_t)uid) < 0)
        die("setuid %lu: %s", uid, strerror(errno));
}

/* -- main -------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    const char *caps = NULL, *seccomp = NULL;
    const char *join_pid = NULL, *cwd = NULL, *user = NULL;
    int scope = 0, init = 0, ctty = 0, i;
    for (i = 1; i < argc && strcmp(argv[i], "--") != 0; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--scope") == 0) {
            scope = 1;
        } else if (strcmp(opt, "--init") == 0) {
            init = 1;
        } else if (strcmp(opt, "--ctty") == 0) {
            ctty = 1;
        } else if (i + 1 < argc && strcmp(opt, "--join") == 0) {
            join_pid = argv[++i];
        } else if (i + 1 < argc && strcmp(opt, "--cwd") == 0) {
            cwd = argv[++i];
        } else if (i + 1 < argc && strcmp(opt, "--user") == 0) {
            user = argv[++i];
        } else if (strcmp(opt, "--strict") == 0) {
            strict = 1;
        } else if (i + 1 < argc && strcmp(opt, "--caps") == 0) {
            caps = argv[++i];
        } else if (i + 1 < argc && strcmp(opt, "--seccomp") == 0) {
            seccomp = argv[++i];
        } else if (i + 1 < argc && (!strcmp(opt, "--rw") || !strcmp(opt, "--ro") || !strcmp(opt, "--hide"))) {
            const char *path = argv[++i];
            if (path[0] != '/' || path[strlen(path) - 1] == '/')
                die("%s wants an absolute path other than / and without a trailing slash, not %s", opt, path);
            if (n_named == MAX_PATHS)
                die("more than %d paths", MAX_PATHS);
            named[n_named].path = path;
            named[n_named++].mode = opt[2] == 'r' ? (opt[3] == 'w' ? FULL : READ_ONLY) : HIDDEN;
        } else {
            die("unknown or incomplete option %s (usage: dsec-jail [--caps N,…] [--seccomp FILE] "
                "[--rw|--ro|--hide PATH]… [--scope] [--join PID] [--cwd DIR] [--user UID:GID] [--strict] [--ctty] -- COMMAND [ARG…], "
                "or dsec-jail [--ro PATH]… --init)", opt);
        }
    }
    if (init)
        start_init();
    if (i + 1 >= argc)
        die("no command given after --");
    char **command = argv + i + 1;

    if (seccomp)
        read_seccomp(seccomp);
    if (join_pid)
        join(join_pid);
    if (ctty && (setsid() < 0 || ioctl(0, TIOCSCTTY, 0) < 0))
        die("cannot make stdin the controlling terminal: %s", strerror(errno));
    if (cwd && chdir(cwd) < 0) {
        fprintf(stderr, "dsec-jail: cannot change to %s: %s\n", cwd, strerror(errno));
        _exit(1);  /* as `cd DIR || exit 1` did */
    }
    int ruleset = landlock_ruleset(scope);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("cannot set no_new_privs: %s", strerror(errno));
    if (caps)
        keep_caps(caps);
    landlock_restrict(ruleset);
    load_seccomp();
    if (user)
        become(user);
    if (syscall(SYS_close_range, 3, ~0U, 0) < 0)
        die("close_range: %s", strerror(errno));
    execvp(command[0], command);
    fprintf(stderr, "dsec-jail: cannot run %s: %s\n", command[0], strerror(errno));
    return errno == ENOENT ? 127 : 126;  /* as a shell says it */
}
