/*
 * gpupoold started the way systemd starts it, without systemd: the test binds the listening
 * socket and a private NOTIFY_SOCKET in a temp dir, then fork+execs the real gpupoold with
 * the socket at fd 3, LISTEN_FDS and LISTEN_PID (the child's own pid, set between fork and
 * exec, as the service manager does).
 *
 * Cases:
 *  activation   READY=1 with STATUS= arrives; a libgpupool-client client connects through the
 *               passed socket and allocates, writes and releases a buffer; SIGTERM brings
 *               STOPPING=1 and exit status 0; the socket file (systemd's) is left in place.
 *  two-fds      LISTEN_FDS=2: the daemon refuses to start, exits non-zero and says why.
 *  watchdog     WATCHDOG_USEC=200000 for the child's pid: at least two WATCHDOG=1 per second.
 *  foreign-pid  LISTEN_PID names another process: fd 3 is ignored and the daemon binds its
 *               own --socket, which it removes again on exit.
 *
 * Usage: test_activation PATH_TO_GPUPOOLD [CASE]. Exit 0 when every case passes.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpupool/gpupool.h"

static const char *gpupoold;
static char root[64];
static int failures;

#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
      fprintf(stderr, __VA_ARGS__);                                          \
      fputc('\n', stderr);                                                   \
      failures++;                                                            \
      goto out;                                                              \
    }                                                                        \
  } while (0)

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void path_in(char *buf, size_t len, const char *dir, const char *name) {
  snprintf(buf, len, "%s/%s", dir, name);
}

static int bind_unix(int type, const char *path, int do_listen) {
  struct sockaddr_un a;
  int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  memset(&a, 0, sizeof(a));
  a.sun_family = AF_UNIX;
  snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
  if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || (do_listen && listen(fd, 16) != 0)) {
    perror(path);
    close(fd);
    return -1;
  }
  return fd;
}

typedef struct {
  const int *fds;      /* placed at 3, 4, ... */
  int nfds;
  int listen_pid_self; /* LISTEN_PID = the child's pid, else 1 (another process) */
  const char *notify;
  int watchdog_usec;   /* 0 = none */
  const char *socket_opt;
  const char *stderr_path;
} spawn_opts;

static pid_t spawn(const spawn_opts *o) {
  pid_t pid = fork();
  if (pid != 0)
    return pid;
  /* Child: from here on only async-signal-safe work matters in principle; the process is
   * single-threaded so plain libc calls are fine. */
  {
    int high[8], err;
    char num[32];
    for (int i = 0; i < o->nfds; i++)
      high[i] = fcntl(o->fds[i], F_DUPFD, 64); /* out of the way of 3.. */
    for (int i = 0; i < o->nfds; i++) {
      if (dup2(high[i], 3 + i) != 3 + i)
        _exit(120);
      close(high[i]);
    }
    if (o->nfds > 0) {
      snprintf(num, sizeof(num), "%d", o->nfds);
      setenv("LISTEN_FDS", num, 1);
      snprintf(num, sizeof(num), "%d", o->listen_pid_self ? (int)getpid() : 1);
      setenv("LISTEN_PID", num, 1);
    }
    setenv("NOTIFY_SOCKET", o->notify, 1);
    if (o->watchdog_usec > 0) {
      snprintf(num, sizeof(num), "%d", o->watchdog_usec);
      setenv("WATCHDOG_USEC", num, 1);
      snprintf(num, sizeof(num), "%d", (int)getpid());
      setenv("WATCHDOG_PID", num, 1);
    } else {
      unsetenv("WATCHDOG_USEC");
      unsetenv("WATCHDOG_PID");
    }
    unsetenv("GPUPOOL_SOCKET");
    err = open(o->stderr_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (err >= 0) {
      dup2(err, 2);
      close(err);
    }
    execl(gpupoold, gpupoold, "--backend", "host", "--socket", o->socket_opt, "--pool",
          "name=default,kind=host,capacity=64M,slab=4M", (char *)NULL);
    _exit(127);
  }
}

/* Read notify datagrams until one contains `want` or timeout_ms passes. All messages are
 * echoed for the log. Returns 1 when found. */
static int wait_notify(int fd, const char *want, int timeout_ms, char *got, size_t gotlen) {
  int64_t end = now_ms() + timeout_ms;
  for (;;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int left = (int)(end - now_ms());
    char buf[1024];
    ssize_t n;
    if (left <= 0)
      return 0;
    if (poll(&p, 1, left) <= 0)
      continue;
    n = recv(fd, buf, sizeof(buf) - 1, 0);
    if (n < 0)
      continue;
    buf[n] = '\0';
    if (strcmp(buf, "WATCHDOG=1") != 0)
      printf("  notify: %s\n", buf);
    if (strstr(buf, want) != NULL) {
      if (got)
        snprintf(got, gotlen, "%s", buf);
      return 1;
    }
  }
}

static int count_notify(int fd, const char *want, int window_ms) {
  int64_t end = now_ms() + window_ms;
  int n = 0;
  for (;;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int left = (int)(end - now_ms());
    char buf[256];
    ssize_t r;
    if (left <= 0)
      return n;
    if (poll(&p, 1, left) <= 0)
      continue;
    r = recv(fd, buf, sizeof(buf) - 1, 0);
    if (r < 0)
      continue;
    buf[r] = '\0';
    if (strcmp(buf, want) == 0)
      n++;
  }
}

/* Exit status of pid within timeout_ms (-1 and SIGKILL on timeout). */
static int wait_exit(pid_t pid, int timeout_ms) {
  int64_t end = now_ms() + timeout_ms;
  int st;
  while (now_ms() < end) {
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    usleep(10000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  return -1;
}

static void dump_file(const char *path) {
  char buf[512];
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return;
  while (fgets(buf, sizeof(buf), f))
    fprintf(stderr, "  gpupoold: %s", buf);
  fclose(f);
}

static int file_contains(const char *path, const char *want) {
  char buf[8192];
  size_t n;
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 0;
  n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  return strstr(buf, want) != NULL;
}

static int make_dir(const char *name, char *dir, size_t len) {
  path_in(dir, len, root, name);
  return mkdir(dir, 0700);
}

static void case_activation(void) {
  char dir[128], sock[160], notify[160], errlog[160], got[1024];
  int lfd = -1, nfd = -1, rc;
  pid_t pid = -1;
  gpupool_client *c = NULL;
  gpupool_buffer *b = NULL;
  struct stat sb;
  spawn_opts o;

  printf("case activation\n");
  CHECK(make_dir("activation", dir, sizeof(dir)) == 0, "mkdir %s", dir);
  path_in(sock, sizeof(sock), dir, "gp.sock");
  path_in(notify, sizeof(notify), dir, "notify.sock");
  path_in(errlog, sizeof(errlog), dir, "stderr.log");
  lfd = bind_unix(SOCK_STREAM, sock, 1);
  nfd = bind_unix(SOCK_DGRAM, notify, 0);
  CHECK(lfd >= 0 && nfd >= 0, "sockets");
  memset(&o, 0, sizeof(o));
  o.fds = &lfd;
  o.nfds = 1;
  o.listen_pid_self = 1;
  o.notify = notify;
  o.socket_opt = sock;
  o.stderr_path = errlog;
  pid = spawn(&o);
  CHECK(pid > 0, "fork");
  close(lfd); /* the daemon holds the only copy now, as with systemd's it would not */
  lfd = -1;

  CHECK(wait_notify(nfd, "READY=1", 15000, got, sizeof(got)), "no READY=1 within 15 s");
  CHECK(strstr(got, "STATUS=") != NULL, "READY=1 came without STATUS=: '%s'", got);

  rc = gpupool_connect(sock, "svc-activation", &c);
  CHECK(rc == 0, "gpupool_connect: %s", gpupool_last_error());
  rc = gpupool_alloc(c, NULL, 1 << 20, 0, NULL, &b);
  CHECK(rc == 0, "gpupool_alloc: %s", gpupool_last_error());
  CHECK(gpupool_buffer_size(b) >= (1 << 20), "size %zu", gpupool_buffer_size(b));
  memset(gpupool_buffer_ptr(b), 0xa5, 1 << 20);
  rc = gpupool_release(b, NULL);
  b = NULL;
  CHECK(rc == 0, "gpupool_release: %s", gpupool_last_error());
  gpupool_disconnect(c);
  c = NULL;

  CHECK(kill(pid, SIGTERM) == 0, "kill");
  CHECK(wait_notify(nfd, "STOPPING=1", 10000, NULL, 0), "no STOPPING=1 within 10 s");
  rc = wait_exit(pid, 10000);
  pid = -1;
  CHECK(rc == 0, "gpupoold exited with %d after SIGTERM", rc);
  /* The socket belongs to the service manager: the daemon must not remove it. */
  CHECK(stat(sock, &sb) == 0 && S_ISSOCK(sb.st_mode), "%s was removed by the daemon", sock);
  printf("ok activation\n");
out:
  if (b != NULL)
    gpupool_release(b, NULL);
  if (c != NULL)
    gpupool_disconnect(c);
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    dump_file(errlog);
  }
  if (lfd >= 0)
    close(lfd);
  if (nfd >= 0)
    close(nfd);
}

static void case_two_fds(void) {
  char dir[128], s1[160], s2[160], notify[160], errlog[160];
  int fds[2] = {-1, -1}, nfd = -1, rc;
  pid_t pid;
  spawn_opts o;

  printf("case two-fds\n");
  CHECK(make_dir("two-fds", dir, sizeof(dir)) == 0, "mkdir %s", dir);
  path_in(s1, sizeof(s1), dir, "a.sock");
  path_in(s2, sizeof(s2), dir, "b.sock");
  path_in(notify, sizeof(notify), dir, "notify.sock");
  path_in(errlog, sizeof(errlog), dir, "stderr.log");
  fds[0] = bind_unix(SOCK_STREAM, s1, 1);
  fds[1] = bind_unix(SOCK_STREAM, s2, 1);
  nfd = bind_unix(SOCK_DGRAM, notify, 0);
  CHECK(fds[0] >= 0 && fds[1] >= 0 && nfd >= 0, "sockets");
  memset(&o, 0, sizeof(o));
  o.fds = fds;
  o.nfds = 2;
  o.listen_pid_self = 1;
  o.notify = notify;
  o.socket_opt = s1;
  o.stderr_path = errlog;
  pid = spawn(&o);
  CHECK(pid > 0, "fork");
  rc = wait_exit(pid, 15000);
  CHECK(rc > 0, "gpupoold with LISTEN_FDS=2 exited with %d (want a failure status)", rc);
  CHECK(file_contains(errlog, "LISTEN_FDS=2"), "its message does not name LISTEN_FDS=2");
  CHECK(file_contains(errlog, "ListenStream="), "its message does not say how to fix the unit");
  /* It must not have announced readiness. */
  {
    char got[512];
    int ready = 0;
    while (wait_notify(nfd, "=", 200, got, sizeof(got)))
      if (strstr(got, "READY=1"))
        ready = 1;
    CHECK(!ready, "READY=1 sent by a daemon that refused its sockets");
  }
  printf("ok two-fds\n");
out:
  if (failures)
    dump_file(errlog);
  for (int i = 0; i < 2; i++)
    if (fds[i] >= 0)
      close(fds[i]);
  if (nfd >= 0)
    close(nfd);
}

static void case_watchdog(void) {
  char dir[128], sock[160], notify[160], errlog[160];
  int lfd = -1, nfd = -1, n, rc;
  pid_t pid = -1;
  spawn_opts o;

  printf("case watchdog\n");
  CHECK(make_dir("watchdog", dir, sizeof(dir)) == 0, "mkdir %s", dir);
  path_in(sock, sizeof(sock), dir, "gp.sock");
  path_in(notify, sizeof(notify), dir, "notify.sock");
  path_in(errlog, sizeof(errlog), dir, "stderr.log");
  lfd = bind_unix(SOCK_STREAM, sock, 1);
  nfd = bind_unix(SOCK_DGRAM, notify, 0);
  CHECK(lfd >= 0 && nfd >= 0, "sockets");
  memset(&o, 0, sizeof(o));
  o.fds = &lfd;
  o.nfds = 1;
  o.listen_pid_self = 1;
  o.notify = notify;
  o.watchdog_usec = 200000;
  o.socket_opt = sock;
  o.stderr_path = errlog;
  pid = spawn(&o);
  CHECK(pid > 0, "fork");
  CHECK(wait_notify(nfd, "READY=1", 15000, NULL, 0), "no READY=1 within 15 s");
  n = count_notify(nfd, "WATCHDOG=1", 1000);
  printf("  %d WATCHDOG=1 in 1 s\n", n);
  CHECK(n >= 2, "only %d WATCHDOG=1 in a second with WATCHDOG_USEC=200000", n);
  kill(pid, SIGTERM);
  rc = wait_exit(pid, 10000);
  pid = -1;
  CHECK(rc == 0, "exit status %d", rc);
  printf("ok watchdog\n");
out:
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    dump_file(errlog);
  }
  if (lfd >= 0)
    close(lfd);
  if (nfd >= 0)
    close(nfd);
}

static void case_foreign_pid(void) {
  char dir[128], decoy[160], own[160], notify[160], errlog[160];
  int lfd = -1, nfd = -1, rc;
  pid_t pid = -1;
  gpupool_client *c = NULL;
  spawn_opts o;

  printf("case foreign-pid\n");
  CHECK(make_dir("foreign-pid", dir, sizeof(dir)) == 0, "mkdir %s", dir);
  path_in(decoy, sizeof(decoy), dir, "decoy.sock");
  path_in(own, sizeof(own), dir, "own.sock");
  path_in(notify, sizeof(notify), dir, "notify.sock");
  path_in(errlog, sizeof(errlog), dir, "stderr.log");
  lfd = bind_unix(SOCK_STREAM, decoy, 1);
  nfd = bind_unix(SOCK_DGRAM, notify, 0);
  CHECK(lfd >= 0 && nfd >= 0, "sockets");
  memset(&o, 0, sizeof(o));
  o.fds = &lfd;
  o.nfds = 1;
  o.listen_pid_self = 0;
  o.notify = notify;
  o.socket_opt = own;
  o.stderr_path = errlog;
  pid = spawn(&o);
  CHECK(pid > 0, "fork");
  CHECK(wait_notify(nfd, "READY=1", 15000, NULL, 0), "no READY=1 within 15 s");
  rc = gpupool_connect(own, "svc-foreign", &c);
  CHECK(rc == 0, "connect to the daemon's own socket: %s", gpupool_last_error());
  gpupool_disconnect(c);
  c = NULL;
  kill(pid, SIGTERM);
  rc = wait_exit(pid, 10000);
  pid = -1;
  CHECK(rc == 0, "exit status %d", rc);
  CHECK(access(own, F_OK) != 0, "the daemon left its own socket %s behind", own);
  printf("ok foreign-pid\n");
out:
  if (c != NULL)
    gpupool_disconnect(c);
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    dump_file(errlog);
  }
  if (lfd >= 0)
    close(lfd);
  if (nfd >= 0)
    close(nfd);
}

int main(int argc, char **argv) {
  const char *only = argc > 2 ? argv[2] : NULL;
  char cmd[128];

  if (argc < 2) {
    fprintf(stderr, "usage: test_activation PATH_TO_GPUPOOLD [activation|two-fds|watchdog|"
                    "foreign-pid]\n");
    return 2;
  }
  gpupoold = argv[1];
  signal(SIGPIPE, SIG_IGN);
  snprintf(root, sizeof(root), "/tmp/gpupool-svc-XXXXXX");
  if (mkdtemp(root) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  if (!only || !strcmp(only, "activation"))
    case_activation();
  if (!only || !strcmp(only, "two-fds"))
    case_two_fds();
  if (!only || !strcmp(only, "watchdog"))
    case_watchdog();
  if (!only || !strcmp(only, "foreign-pid"))
    case_foreign_pid();
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
  if (failures == 0 && system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", root);
  if (failures)
    fprintf(stderr, "%d failure(s); files kept in %s\n", failures, root);
  return failures ? 1 : 0;
}
