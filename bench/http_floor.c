/* The floor of a native server of /run_code: what HTTP and a spawn per request cost here.
 *
 * WORKERS processes (forked once) each accept a connection, read one HTTP/1.1 request,
 * take the JSON body's "code" string, write it to the worker's main.py, run
 * `python3 main.py` with posix_spawn (stdout and stderr through pipes, read with
 * poll), and answer in SandboxFusion's shape. No sandbox, no auth, nothing else: no
 * server that runs a program per request and answers over HTTP does less on this
 * machine. bench/fusion.py compiles it with gcc and starts it.
 *
 *     http_floor PORT DIR      (prints "ready" once listening; serves until killed; its
 *                               workers die with it and keep their files in DIR)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define WORKERS 64
#define MAX_REQUEST (1 << 20)
#define MAX_OUTPUT (1 << 16)

extern char **environ;

static char request[MAX_REQUEST + 1], code[MAX_REQUEST], out[MAX_OUTPUT], err[MAX_OUTPUT];
static char answer[8 * MAX_OUTPUT + 1024];

/* the JSON string value of "key" in body, unescaped into dst (ASCII escapes and \uXXXX
 * below 0x80, which is all the bench sends); its length, or -1 */
static long json_string(const char *body, const char *key, char *dst) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\"", key);
    const char *p = strstr(body, pattern);
    if (!p) return -1;
    p = strchr(p + strlen(pattern), '"');
    if (!p) return -1;
    long n = 0;
    for (p++; *p && *p != '"'; p++) {
        if (*p != '\\') { dst[n++] = *p; continue; }
        switch (*++p) {
        case 'n': dst[n++] = '\n'; break;
        case 't': dst[n++] = '\t'; break;
        case 'r': dst[n++] = '\r'; break;
        case 'b': dst[n++] = '\b'; break;
        case 'f': dst[n++] = '\f'; break;
        case 'u': { unsigned v; sscanf(p + 1, "%4x", &v); dst[n++] = (char)v; p += 4; break; }
        default: dst[n++] = *p;
        }
    }
    return *p == '"' ? n : -1;
}

static char *json_escape(char *dst, const char *src, long n) {
    *dst++ = '"';
    for (long i = 0; i < n; i++) {
        unsigned char c = (unsigned char)src[i];
        if (c == '"' || c == '\\') { *dst++ = '\\'; *dst++ = (char)c; }
        else if (c == '\n') { *dst++ = '\\'; *dst++ = 'n'; }
        else if (c < 0x20) dst += sprintf(dst, "\\u%04x", c);
        else *dst++ = (char)c;
    }
    *dst++ = '"';
    return dst;
}

/* python3 main.py in dir; its exit status, stdout and stderr */
static int run(const char *dir, long *out_n, long *err_n) {
    int o[2], e[2];
    if (pipe(o) || pipe(e)) return -1;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addchdir_np(&fa, dir);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, o[1], 1);
    posix_spawn_file_actions_adddup2(&fa, e[1], 2);
    posix_spawn_file_actions_addclose(&fa, o[0]);
    posix_spawn_file_actions_addclose(&fa, e[0]);
    char *argv[] = {"/usr/bin/python3", "main.py", NULL};
    pid_t pid;
    int failed = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(o[1]);
    close(e[1]);
    *out_n = *err_n = 0;
    struct pollfd fds[2] = {{o[0], POLLIN, 0}, {e[0], POLLIN, 0}};
    int open_fds = 2;
    while (!failed && open_fds) {
        poll(fds, 2, -1);
        for (int i = 0; i < 2; i++) {
            if (fds[i].fd < 0 || !fds[i].revents) continue;
            char *buf = i ? err : out;
            long *n = i ? err_n : out_n;
            ssize_t got = read(fds[i].fd, buf + *n, MAX_OUTPUT - *n);
            if (got <= 0) { close(fds[i].fd); fds[i].fd = -1; open_fds--; }
            else *n += got;
        }
    }
    int status = -1;
    if (!failed) waitpid(pid, &status, 0);
    return failed ? -1 : WEXITSTATUS(status);
}

static void serve(int listener, const char *dir) {
    char path[4200];
    snprintf(path, sizeof path, "%s/main.py", dir);
    for (;;) {
        int c = accept(listener, NULL, NULL);
        if (c < 0) continue;
        long n = 0, body_at = -1, length = 0;
        while (n < MAX_REQUEST) {
            ssize_t got = read(c, request + n, MAX_REQUEST - n);
            if (got <= 0) break;
            n += got;
            request[n] = 0;
            if (body_at < 0) {
                char *end = strstr(request, "\r\n\r\n");
                if (!end) continue;
                body_at = end + 4 - request;
                char *cl = strcasestr(request, "content-length:");
                length = cl ? atol(cl + 15) : 0;
            }
            if (n - body_at >= length) break;
        }
        long code_n = body_at < 0 ? -1 : json_string(request + body_at, "code", code);
        if (code_n >= 0) {
            FILE *f = fopen(path, "w");
            fwrite(code, 1, code_n, f);
            fclose(f);
            long out_n, err_n;
            int status = run(dir, &out_n, &err_n);
            char *p = answer + 200;  /* the head goes before the body */
            char *body = p;
            p += sprintf(p, "{\"status\": \"%s\", \"message\": \"\", \"compile_result\": null, "
                         "\"run_result\": {\"status\": \"Finished\", \"execution_time\": 0.0, "
                         "\"return_code\": %d, \"stdout\": ", status ? "Failed" : "Success",
                         status);
            p = json_escape(p, out, out_n);
            p += sprintf(p, ", \"stderr\": ");
            p = json_escape(p, err, err_n);
            p += sprintf(p, "}, \"files\": {}}");
            char head[200];
            int head_n = snprintf(head, sizeof head, "HTTP/1.1 200 OK\r\nContent-Type: "
                                  "application/json\r\nContent-Length: %ld\r\n"
                                  "Connection: close\r\n\r\n", (long)(p - body));
            memcpy(body - head_n, head, head_n);
            for (char *w = body - head_n; w < p;) {
                ssize_t put = write(c, w, p - w);
                if (put <= 0) break;
                w += put;
            }
        } else {
            static const char bad[] = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n"
                                      "Connection: close\r\n\r\n";
            if (write(c, bad, sizeof bad - 1) < 0) perror("write");
        }
        close(c);
    }
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: http_floor PORT DIR\n"); return 2; }
    int listener = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in at = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listener, (struct sockaddr *)&at, sizeof at) || listen(listener, 1024)) {
        perror("http_floor: listen");
        return 1;
    }
    for (int i = 0; i < WORKERS; i++) {
        if (fork() == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() == 1) _exit(0);  /* the server died before the line above */
            char dir[4096];
            snprintf(dir, sizeof dir, "%s/%d", argv[2], i);
            mkdir(dir, 0700);
            serve(listener, dir);
        }
    }
    printf("ready\n");
    fflush(stdout);
    while (wait(NULL) > 0) {}
    return 0;
}
