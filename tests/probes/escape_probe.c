/* The escape suite's probe: tries, by raw system calls, the kernel doors that public
 * container escapes start from, and prints one line per check:
 *
 *     <check> reached <errno name | ok>     the kernel went past its door
 *     <check> refused <errno name>          the call stopped at it (a seccomp
 *                                           refusal, a missing capability, or a
 *                                           kernel that has no such call)
 *
 * Which errno means "stopped at the door" is the test's to decide (ESCAPE_DOORS in
 * tests/escape_bench_kit.py); this program only reports what the kernel answered.
 * Run on the host as root, every check reaches: that calibration proves each check
 * can fail. Every call is made with arguments that do nothing lasting even where it
 * reaches (a bad magic number, a missing path, a keyring of this process only).
 *
 * Built static by the tests (gcc -static), so it runs in any image: busybox, no libc,
 * gVisor. Usage: escape_probe CHECK... | escape_probe all | escape_probe raw NR...
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <linux/bpf.h>
#include <linux/perf_event.h>
#include <linux/io_uring.h>
#include <linux/sched.h>

static void report(const char *check, long rc, int err) {
    if (rc >= 0) {
        printf("%s reached ok\n", check);
    } else {
        const char *name = strerrorname_np(err);
        int door = err == EPERM || err == EACCES || err == ENOSYS || err == EAFNOSUPPORT ||
                   err == EPROTONOSUPPORT || err == ESOCKTNOSUPPORT;
        printf("%s %s %s\n", check, door ? "refused" : "reached", name ? name : "?");
    }
    fflush(stdout);
}

/* the errno is read after the call (C leaves the order of arguments unspecified) */
#define CALL(check, expr) do { long rc_ = (expr); int err_ = errno; \
                               report((check), rc_, err_); } while (0)

/* a call whose result is a descriptor to close */
#define fd_result(check, expr) do { long rc_ = (expr); int err_ = errno; \
                                    fd_result_((check), rc_, err_); } while (0)
static void fd_result_(const char *check, long rc, int err) {
    if (rc >= 0)
        close((int)rc);
    report(check, rc, err);
}

/* the call made in a child (namespaces change the caller): its errno comes back as the
 * exit status (0: the call succeeded) */
static void in_child(const char *check, long (*call)(void)) {
    pid_t pid = fork();
    if (pid == 0) {
        long rc = call();
        _exit(rc < 0 ? (errno & 0x7f) : 0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : EINTR;
    report(check, code == 0 ? 0 : -1, code);
}

static long do_unshare_user(void) { return unshare(CLONE_NEWUSER); }
static long do_unshare_mount(void) { return unshare(CLONE_NEWNS); }
static long do_unshare_net(void) { return unshare(CLONE_NEWNET); }
static long do_clone_newuser(void) {
    long pid = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0)
        _exit(0);
    if (pid > 0)
        waitpid((pid_t)pid, NULL, 0);
    return pid;
}
static long do_clone3(void) {
    struct clone_args args;
    memset(&args, 0, sizeof(args));
    args.exit_signal = SIGCHLD;
    long pid = syscall(SYS_clone3, &args, sizeof(args));
    if (pid == 0)
        _exit(0);
    if (pid > 0)
        waitpid((pid_t)pid, NULL, 0);
    return pid;
}
static long do_setns(void) {
    /* its own UTS namespace, or (no such file: gVisor) a bad descriptor, which the
     * kernel answers EBADF past the door */
    int fd = open("/proc/self/ns/uts", O_RDONLY);
    return syscall(SYS_setns, fd, CLONE_NEWUTS);
}

static void sock(const char *check, int family, int type, int protocol) {
    fd_result(check, socket(family, type, protocol));
}

static void shocker(void) {
    /* the 'shocker' escape: a file opened by its handle, past every path and mount. A
     * handle of "/" where the filesystem makes one, else one made up as the escape
     * does (an ext4 inode number and generation): only the door's answer matters */
    struct { struct file_handle fh; unsigned char bytes[128]; } h;
    int mount_id;
    h.fh.handle_bytes = sizeof(h.bytes);
    if (syscall(SYS_name_to_handle_at, AT_FDCWD, "/", &h.fh, &mount_id, 0) < 0) {
        uint32_t made_up[2] = {2, 0};
        h.fh.handle_bytes = sizeof(made_up);
        h.fh.handle_type = 1;  /* FILEID_INO32_GEN */
        memcpy(h.fh.f_handle, made_up, sizeof(made_up));
    }
    int root = open("/", O_RDONLY | O_DIRECTORY);
    fd_result("open_by_handle_at", syscall(SYS_open_by_handle_at, root, &h.fh, O_RDONLY));
    close(root);
}

/* find_sockets ROOT: every unix socket under ROOT (not /proc, /sys, /dev) that accepts
 * a connection: an engine's or a daemon's control socket would be one */
static int connectable(const char *path) {
    struct sockaddr_un a;
    memset(&a, 0, sizeof(a));
    a.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(a.sun_path))
        return 0;
    strcpy(a.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    int ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

static void walk_sockets(const char *dir, int depth, int *seen, int *open_) {
    if (depth > 12)
        return;
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char path[4096];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        snprintf(path, sizeof(path), "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name);
        if (!strcmp(path, "/proc") || !strcmp(path, "/sys") || !strcmp(path, "/dev"))
            continue;
        struct stat st;
        if (lstat(path, &st) < 0)
            continue;
        if (S_ISSOCK(st.st_mode)) {
            (*seen)++;
            if (connectable(path) && (*open_)++ < 3)
                printf("# connectable %s\n", path);
        } else if (S_ISDIR(st.st_mode)) {
            walk_sockets(path, depth + 1, seen, open_);
        }
    }
    closedir(d);
}

/* proc_cmdline MARKER: whether any process this one can see has MARKER in its
 * command line (a host process, if the pid namespace were the host's) */
static void proc_scan(const char *check, const char *marker, int roots) {
    DIR *d = opendir("/proc");
    int seen = 0, found = 0;
    struct dirent *e;
    char path[512];
    while (d && (e = readdir(d))) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9' || atoi(e->d_name) == getpid())
            continue;  /* its own command line names the marker */
        seen++;
        if (roots) {  /* proc_root PATH: PATH through each process's root */
            struct stat st;
            snprintf(path, sizeof(path), "/proc/%s/root%s", e->d_name, marker);
            if (stat(path, &st) == 0 && found++ < 3)
                printf("# through %s\n", path);
            continue;
        }
        snprintf(path, sizeof(path), "/proc/%s/cmdline", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        char buf[4096];
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        for (size_t i = 0; i < n; i++)
            if (!buf[i])
                buf[i] = ' ';
        buf[n] = 0;
        if (strstr(buf, marker))
            found++;
    }
    if (d)
        closedir(d);
    /* seen == 0 would prove nothing: the scan must have seen processes (the daemon's) */
    if (seen == 0)
        printf("%s refused no-processes-seen\n", check);
    else
        printf("%s %s %d-of-%d\n", check, found ? "reached" : "refused", found, seen);
}

static void run(const char *c) {
    if (!strcmp(c, "io_uring_setup")) {
        struct io_uring_params p;
        memset(&p, 0, sizeof(p));
        fd_result(c, syscall(__NR_io_uring_setup, 1, &p));
    } else if (!strcmp(c, "io_uring_enter")) {
        CALL(c, syscall(__NR_io_uring_enter, -1, 0, 0, 0, NULL, 0));
    } else if (!strcmp(c, "io_uring_register")) {
        CALL(c, syscall(__NR_io_uring_register, -1, 0, NULL, 0));
    } else if (!strcmp(c, "bpf")) {
        union bpf_attr a;
        memset(&a, 0, sizeof(a));
        a.map_type = BPF_MAP_TYPE_ARRAY;
        a.key_size = 4;
        a.value_size = 4;
        a.max_entries = 1;
        fd_result(c, syscall(SYS_bpf, BPF_MAP_CREATE, &a, sizeof(a)));
    } else if (!strcmp(c, "perf_event_open")) {
        struct perf_event_attr a;
        memset(&a, 0, sizeof(a));
        a.type = PERF_TYPE_SOFTWARE;
        a.size = sizeof(a);
        a.config = PERF_COUNT_SW_CPU_CLOCK;
        a.disabled = 1;
        fd_result(c, syscall(SYS_perf_event_open, &a, 0, -1, -1, 0));
    } else if (!strcmp(c, "userfaultfd")) {
        fd_result(c, syscall(SYS_userfaultfd, O_CLOEXEC));
    } else if (!strcmp(c, "kexec_load")) {   /* bad flags: EINVAL past the door */
        CALL(c, syscall(SYS_kexec_load, 0, 0, NULL, 0xDEAD0000UL));
    } else if (!strcmp(c, "kexec_file_load")) {
        CALL(c, syscall(SYS_kexec_file_load, -1, -1, 0, "", 0));
    } else if (!strcmp(c, "init_module")) {  /* no image: EFAULT or ENOEXEC past it */
        CALL(c, syscall(SYS_init_module, NULL, 0, ""));
    } else if (!strcmp(c, "finit_module")) {
        CALL(c, syscall(SYS_finit_module, -1, "", 0));
    } else if (!strcmp(c, "delete_module")) {
        CALL(c, syscall(SYS_delete_module, "sandman_probe_none", O_NONBLOCK));
    } else if (!strcmp(c, "open_by_handle_at")) {
        shocker();
    } else if (!strcmp(c, "keyctl")) {   /* the session keyring's id */
        CALL(c, syscall(SYS_keyctl, 0, -3, 0));
    } else if (!strcmp(c, "add_key")) {  /* into this process's own keyring */
        CALL(c, syscall(SYS_add_key, "user", "sandman-probe", "x", 1, -2));
    } else if (!strcmp(c, "mount")) {
        CALL(c, syscall(SYS_mount, "none", "/nonexistent-sandman-probe", "tmpfs", 0, NULL));
    } else if (!strcmp(c, "fsopen")) {
        fd_result(c, syscall(SYS_fsopen, "tmpfs", 0));
    } else if (!strcmp(c, "open_tree")) {
        fd_result(c, syscall(SYS_open_tree, AT_FDCWD, "/", 01000000 /* CLOEXEC */));
    } else if (!strcmp(c, "pivot_root")) {
        CALL(c, syscall(SYS_pivot_root, "/nonexistent-sandman-probe", "/nonexistent"));
    } else if (!strcmp(c, "unshare_user")) {
        in_child(c, do_unshare_user);
    } else if (!strcmp(c, "unshare_mount")) {
        in_child(c, do_unshare_mount);
    } else if (!strcmp(c, "unshare_net")) {
        in_child(c, do_unshare_net);
    } else if (!strcmp(c, "clone_newuser")) {
        in_child(c, do_clone_newuser);
    } else if (!strcmp(c, "clone3")) {
        in_child(c, do_clone3);
    } else if (!strcmp(c, "setns")) {
        in_child(c, do_setns);
    } else if (!strcmp(c, "swapon")) {
        CALL(c, syscall(SYS_swapon, "/nonexistent-sandman-probe", 0));
    } else if (!strcmp(c, "reboot")) {   /* a wrong second magic: EINVAL past the door */
        CALL(c, syscall(SYS_reboot, 0xfee1dead, 0, 0, NULL));
    } else if (!strcmp(c, "acct")) {
        CALL(c, syscall(SYS_acct, "/nonexistent-sandman-probe"));
    } else if (!strcmp(c, "syslog")) {   /* the size of the kernel's log buffer */
        CALL(c, syscall(SYS_syslog, 10, NULL, 0));
    } else if (!strcmp(c, "iopl")) {
        CALL(c, syscall(SYS_iopl, 0));
    } else if (!strcmp(c, "clock_settime")) {  /* the monotonic clock cannot be set */
        struct timespec ts = {0, 0};
        CALL(c, syscall(SYS_clock_settime, CLOCK_MONOTONIC, &ts));
    } else if (!strcmp(c, "personality_aslr")) {  /* ADDR_NO_RANDOMIZE, then back */
        long old = syscall(SYS_personality, 0xffffffff);
        long rc = syscall(SYS_personality, 0x0040000);
        int err = errno;
        if (rc >= 0)
            syscall(SYS_personality, old);
        report(c, rc, err);
    } else if (!strcmp(c, "pidfd_getfd")) {
        int pidfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
        fd_result(c, pidfd < 0 ? pidfd : syscall(SYS_pidfd_getfd, pidfd, 0, 0));
        if (pidfd >= 0)
            close(pidfd);
    } else if (!strcmp(c, "kcmp")) {
        CALL(c, syscall(SYS_kcmp, getpid(), getpid(), 0 /* KCMP_FILE */, 0, 0));
    } else if (!strcmp(c, "fanotify_init")) {
        fd_result(c, syscall(SYS_fanotify_init, 0, O_RDONLY));
    } else if (!strcmp(c, "mbind")) {
        CALL(c, syscall(SYS_mbind, NULL, 0, 0, NULL, 0, 0));
    } else if (!strcmp(c, "vmsplice")) {
        int p[2];
        char byte = 'x';
        struct { void *base; size_t len; } iov = {&byte, 1};
        if (pipe(p) < 0) {
            report(c, -1, errno);
            return;
        }
        CALL(c, syscall(SYS_vmsplice, p[1], &iov, 1, 0));
        close(p[0]);
        close(p[1]);
    } else if (!strcmp(c, "af_packet")) {
        sock(c, AF_PACKET, SOCK_RAW, 0x0300 /* htons(ETH_P_ALL) */);
    } else if (!strcmp(c, "af_packet_dgram")) {
        sock(c, AF_PACKET, SOCK_DGRAM, 0x0300);
    } else if (!strcmp(c, "raw_ip")) {
        sock(c, AF_INET, SOCK_RAW, 6 /* IPPROTO_TCP */);
    } else if (!strcmp(c, "raw_ip6")) {
        sock(c, AF_INET6, SOCK_RAW, 6);
    } else if (!strcmp(c, "af_xdp")) {
        sock(c, 44 /* AF_XDP */, SOCK_RAW, 0);
    } else if (!strcmp(c, "af_vsock")) {
        sock(c, 40 /* AF_VSOCK */, SOCK_STREAM, 0);
    } else if (!strcmp(c, "netlink_netfilter")) {
        sock(c, AF_NETLINK, SOCK_RAW, 12);
    } else if (!strcmp(c, "netlink_xfrm")) {
        sock(c, AF_NETLINK, SOCK_RAW, 6);
    } else if (!strcmp(c, "mptcp")) {
        sock(c, AF_INET, SOCK_STREAM, 262);
    } else if (!strcmp(c, "tcp")) {            /* what must keep working */
        sock(c, AF_INET, SOCK_STREAM, 0);
    } else if (!strcmp(c, "netlink_route")) {
        sock(c, AF_NETLINK, SOCK_RAW, 0);
    } else if (!strcmp(c, "unix")) {
        sock(c, AF_UNIX, SOCK_STREAM, 0);
    } else if (!strncmp(c, "find_sockets=", 13)) {
        int seen = 0, open_ = 0;
        walk_sockets(c + 13, 0, &seen, &open_);
        printf("find_sockets %s %d-of-%d\n", open_ ? "reached" : "refused", open_, seen);
    } else if (!strncmp(c, "proc_cmdline=", 13)) {
        proc_scan("proc_cmdline", c + 13, 0);
    } else if (!strncmp(c, "proc_root=", 10)) {
        proc_scan("proc_root", c + 10, 1);
    } else if (!strncmp(c, "connect=", 8)) {  /* connect=IP:PORT, TCP, 2 s at most */
        char host[64];
        snprintf(host, sizeof(host), "%s", c + 8);
        char *colon = strrchr(host, ':');
        struct sockaddr_in a;
        memset(&a, 0, sizeof(a));
        a.sin_family = AF_INET;
        if (!colon || inet_pton(AF_INET, (*colon = 0, host), &a.sin_addr) != 1) {
            printf("connect bad-address\n");
            return;
        }
        a.sin_port = htons((unsigned short)atoi(colon + 1));
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        long rc = connect(fd, (struct sockaddr *)&a, sizeof(a));
        int err = errno;
        if (rc < 0 && err == EINPROGRESS) {
            struct pollfd p = {fd, POLLOUT, 0};
            socklen_t len = sizeof(err);
            if (poll(&p, 1, 2000) == 1 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0)
                rc = 0;
            else if (err == EINPROGRESS)
                err = ETIMEDOUT;
        }
        close(fd);
        report("connect", rc, err);
    } else if (!strncmp(c, "write=", 6)) {  /* open a file for writing, changing nothing */
        fd_result("write", open(c + 6, O_WRONLY | O_APPEND | O_NONBLOCK));
    } else {
        printf("%s unknown-check\n", c);
    }
}

static const char *ALL[] = {
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
    "userfaultfd", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "open_by_handle_at", "keyctl", "add_key", "mount", "fsopen",
    "open_tree", "pivot_root", "unshare_user", "unshare_mount", "unshare_net",
    "clone_newuser", "clone3", "setns", "swapon", "reboot", "acct", "syslog", "iopl",
    "clock_settime", "personality_aslr", "pidfd_getfd", "kcmp", "fanotify_init", "mbind",
    "vmsplice", "af_packet", "af_packet_dgram", "raw_ip", "raw_ip6", "af_xdp", "af_vsock",
    "netlink_netfilter", "netlink_xfrm", "mptcp", "tcp", "netlink_route", "unix", NULL};

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "raw")) {
        /* raw NR...: each number called with arguments of -1 (no valid pointer, fd or
         * flag): only the errno matters */
        for (int i = 2; i < argc; i++) {
            long nr = strtol(argv[i], NULL, 10);
            long rc = syscall(nr, -1L, -1L, -1L, -1L, -1L, -1L);
            int err = errno;
            printf("%ld %s\n", nr, rc >= 0 ? "ok" : strerrorname_np(err));
        }
        return 0;
    }
    if (argc == 2 && !strcmp(argv[1], "all")) {
        for (const char **c = ALL; *c; c++)
            run(*c);
        return 0;
    }
    for (int i = 1; i < argc; i++)
        run(argv[i]);
    return 0;
}
