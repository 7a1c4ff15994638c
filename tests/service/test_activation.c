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
 *  status       STATUS= follows the live figures: a client and a published name show up.
 *  status-fit  a STATUS= longer than 255 bytes (a failed reload with a long reason, two
 *               degraded exporters): every part whole where it fits, none cut mid-word.
 *  config-error an invalid config file: the daemon stays up on the passed socket, answers a
 *               client's Hello with GPUPOOL_ECONFIG and the reason (exiting would leave the
 *               connection queued and systemd would restart it into its start limit);
 *               after the file is fixed, SIGHUP makes it serve; broken again, a SIGHUP
 *               changes nothing and STATUS= says why.
 *  config-error-attack  the same mode under attack: a client trickling its first frame and
 *               20 that send nothing delay no other client's answer, nor SIGHUP (with the
 *               file fixed) or SIGTERM.
 *
 * Usage: test_activation PATH_TO_GPUPOOLD [CASE]. Exit 0 when every case passes.
 */
#include <errno.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
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

#include "daemon.h"
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
  if (strlen(path) >= sizeof(a.sun_path)) {
    fprintf(stderr, "%s: longer than a socket path may be\n", path);
    close(fd);
    return -1;
  }
  memcpy(a.sun_path, path, strlen(path) + 1);
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
  const char *conf;    /* --config FILE, or NULL */
} spawn_opts;

/* In the child, before exec: the fds at 3, 4, ... and the environment a service manager sets.
 * Only the child runs this; it is single-threaded, so plain libc calls are fine. */
static int as_service(void *arg) {
  const spawn_opts *o = arg;
  int high[8];
  char num[32];
  for (int i = 0; i < o->nfds; i++)
    high[i] = fcntl(o->fds[i], F_DUPFD, 64); /* out of the way of 3.. */
  for (int i = 0; i < o->nfds; i++) {
    if (dup2(high[i], 3 + i) != 3 + i)
      return -1;
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
  return 0;
}

static pid_t spawn(const spawn_opts *o) {
  const char *argv[] = {gpupoold, "--backend", "host", "--socket", o->socket_opt, "--pool",
                        "name=default,kind=host,capacity=64M,slab=4M", o->conf ? "--config" : NULL,
                        o->conf, NULL};
  return ts_exec(argv, o->stderr_path, TS_EXEC_STDERR_ONLY, as_service, (void *)o);
}

/* The next notify datagram before `end` (a now_ms() time), as a string in buf. Returns 1,
 * or 0 once end has passed. */
static int next_notify(int fd, int64_t end, char *buf, size_t len) {
  for (;;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int left = (int)(end - now_ms());
    ssize_t n;
    if (left <= 0)
      return 0;
    if (poll(&p, 1, left) <= 0)
      continue;
    n = recv(fd, buf, len - 1, 0);
    if (n < 0)
      continue;
    buf[n] = '\0';
    return 1;
  }
}

/* Read notify datagrams until one contains `want` or timeout_ms passes. All messages are
 * echoed for the log. Returns 1 when found. */
static int wait_notify(int fd, const char *want, int timeout_ms, char *got, size_t gotlen) {
  int64_t end = now_ms() + timeout_ms;
  char buf[1024];
  while (next_notify(fd, end, buf, sizeof(buf))) {
    if (strcmp(buf, "WATCHDOG=1") != 0)
      printf("  notify: %s\n", buf);
    if (strstr(buf, want) != NULL) {
      if (got)
        snprintf(got, gotlen, "%s", buf);
      return 1;
    }
  }
  return 0;
}

static int count_notify(int fd, const char *want, int window_ms) {
  int64_t end = now_ms() + window_ms;
  char buf[256];
  int n = 0;
  while (next_notify(fd, end, buf, sizeof(buf)))
    if (strcmp(buf, want) == 0)
      n++;
  return n;
}

/* Exit status of pid within timeout_ms (-1 and SIGKILL on timeout). */
static int wait_exit(pid_t pid, int timeout_ms) {
  int st;
  if (ts_wait_pid(pid, timeout_ms, 1, &st) != 0)
    return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void dump_file(const char *path) { ts_print_file(stderr, path, "gpupoold stderr"); }

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

/* What each case sets up in a directory of its own: the listening sockets handed to the
 * daemon as LISTEN_FDS, the socket named by its --socket, a notify socket, its stderr log,
 * and the options spawn() starts it with. */
typedef struct {
  char dir[128], listen[2][160], own[160], notify[160], errlog[160];
  int fds[2];
  int nfd;
  pid_t pid;
  spawn_opts o;
} svc_case;

/* Directory NAME under root with listen_names[0..n) bound and listening (n at most 2) and
 * the notify socket bound; the daemon's --socket is own_name there. Returns 0, or -1 with
 * the cause on stderr; k is fit for case_end() either way. */
static int case_begin(svc_case *k, const char *name, const char *const *listen_names, int n,
                      const char *own_name) {
  memset(k, 0, sizeof(*k));
  k->fds[0] = k->fds[1] = k->nfd = k->pid = -1;
  path_in(k->dir, sizeof(k->dir), root, name);
  path_in(k->own, sizeof(k->own), k->dir, own_name);
  path_in(k->notify, sizeof(k->notify), k->dir, "notify.sock");
  path_in(k->errlog, sizeof(k->errlog), k->dir, "stderr.log");
  if (mkdir(k->dir, 0700) != 0) {
    perror(k->dir);
    return -1;
  }
  for (int i = 0; i < n; i++) {
    path_in(k->listen[i], sizeof(k->listen[i]), k->dir, listen_names[i]);
    if ((k->fds[i] = bind_unix(SOCK_STREAM, k->listen[i], 1)) < 0)
      return -1;
  }
  if ((k->nfd = bind_unix(SOCK_DGRAM, k->notify, 0)) < 0)
    return -1;
  k->o.fds = k->fds;
  k->o.nfds = n;
  k->o.listen_pid_self = 1;
  k->o.notify = k->notify;
  k->o.socket_opt = k->own;
  k->o.stderr_path = k->errlog;
  return 0;
}

/* What a case still holds when it ends: its buffer (may be NULL), then its client (may be NULL). */
static void drop_client(gpupool_buffer *b, gpupool_client *c) {
  if (b != NULL)
    gpupool_buffer_release(b, NULL);
  if (c != NULL)
    gpupool_client_disconnect(c);
}

/* A daemon still running is killed and its stderr shown; every socket is closed. */
static void case_end(svc_case *k) {
  if (k->pid > 0) {
    kill(k->pid, SIGKILL);
    waitpid(k->pid, NULL, 0);
    dump_file(k->errlog);
  }
  for (int i = 0; i < 2; i++)
    if (k->fds[i] >= 0)
      close(k->fds[i]);
  if (k->nfd >= 0)
    close(k->nfd);
}

/* Starts the case's daemon and waits up to 15 s for its READY=1 (that message in got when
 * got is not NULL). Returns 0, or -1 with the cause on stderr. */
static int case_start_ready(svc_case *k, char *got, size_t gotlen) {
  k->pid = spawn(&k->o);
  if (k->pid <= 0) {
    perror("fork");
    return -1;
  }
  if (!wait_notify(k->nfd, "READY=1", 15000, got, gotlen)) {
    fprintf(stderr, "no READY=1 within 15 s\n");
    return -1;
  }
  return 0;
}

/* SIGTERM to the case's daemon; its exit status (wait_exit), and it is no longer running. */
static int case_stop(svc_case *k, int timeout_ms) {
  int rc;
  kill(k->pid, SIGTERM);
  rc = wait_exit(k->pid, timeout_ms);
  k->pid = -1;
  return rc;
}

static void case_activation(void) {
  static const char *const listen[] = {"gp.sock"};
  char got[1024];
  int rc;
  gpupool_client *c = NULL;
  gpupool_buffer *b = NULL;
  struct stat sb;
  svc_case k;

  printf("case activation\n");
  CHECK(case_begin(&k, "activation", listen, 1, "gp.sock") == 0, "set-up in %s", k.dir);
  CHECK(case_start_ready(&k, got, sizeof(got)) == 0, "gpupoold started and ready");
  close(k.fds[0]); /* the daemon holds the only copy now, as with systemd's it would not */
  k.fds[0] = -1;
  CHECK(strstr(got, "STATUS=") != NULL, "READY=1 came without STATUS=: '%s'", got);

  rc = gpupool_client_connect(k.own, "svc-activation", GPUPOOL_TIMEOUT_DEFAULT, &c);
  CHECK(rc == 0, "gpupool_client_connect: %s", gpupool_last_error());
  rc = gpupool_buffer_alloc(c, NULL, 1 << 20, 0, NULL, &b);
  CHECK(rc == 0, "gpupool_buffer_alloc: %s", gpupool_last_error());
  CHECK(gpupool_buffer_size(b) >= (1 << 20), "size %zu", gpupool_buffer_size(b));
  memset(gpupool_buffer_ptr(b), 0xa5, 1 << 20);
  rc = gpupool_buffer_release(b, NULL);
  b = NULL;
  CHECK(rc == 0, "gpupool_buffer_release: %s", gpupool_last_error());
  gpupool_client_disconnect(c);
  c = NULL;

  CHECK(kill(k.pid, SIGTERM) == 0, "kill");
  CHECK(wait_notify(k.nfd, "STOPPING=1", 10000, NULL, 0), "no STOPPING=1 within 10 s");
  rc = wait_exit(k.pid, 10000);
  k.pid = -1;
  CHECK(rc == 0, "gpupoold exited with %d after SIGTERM", rc);
  /* The socket belongs to the service manager: the daemon must not remove it. */
  CHECK(stat(k.own, &sb) == 0 && S_ISSOCK(sb.st_mode), "%s was removed by the daemon", k.own);
  printf("ok activation\n");
out:
  drop_client(b, c);
  case_end(&k);
}

static void case_two_fds(void) {
  static const char *const listen[] = {"a.sock", "b.sock"};
  int rc;
  svc_case k;

  printf("case two-fds\n");
  CHECK(case_begin(&k, "two-fds", listen, 2, "a.sock") == 0, "set-up in %s", k.dir);
  k.pid = spawn(&k.o);
  CHECK(k.pid > 0, "fork");
  rc = wait_exit(k.pid, 15000);
  k.pid = -1;
  CHECK(rc > 0, "gpupoold with LISTEN_FDS=2 exited with %d (want a failure status)", rc);
  CHECK(file_contains(k.errlog, "LISTEN_FDS=2"), "its message does not name LISTEN_FDS=2");
  CHECK(file_contains(k.errlog, "ListenStream="), "its message does not say how to fix the unit");
  /* It must not have announced readiness. */
  {
    char got[512];
    int ready = 0;
    while (wait_notify(k.nfd, "=", 200, got, sizeof(got)))
      if (strstr(got, "READY=1"))
        ready = 1;
    CHECK(!ready, "READY=1 sent by a daemon that refused its sockets");
  }
  printf("ok two-fds\n");
out:
  if (failures)
    dump_file(k.errlog);
  case_end(&k);
}

static void case_watchdog(void) {
  static const char *const listen[] = {"gp.sock"};
  int n, rc;
  svc_case k;

  printf("case watchdog\n");
  CHECK(case_begin(&k, "watchdog", listen, 1, "gp.sock") == 0, "set-up in %s", k.dir);
  k.o.watchdog_usec = 200000;
  CHECK(case_start_ready(&k, NULL, 0) == 0, "gpupoold started and ready");
  n = count_notify(k.nfd, "WATCHDOG=1", 1000);
  printf("  %d WATCHDOG=1 in 1 s\n", n);
  CHECK(n >= 2, "only %d WATCHDOG=1 in a second with WATCHDOG_USEC=200000", n);
  rc = case_stop(&k, 10000);
  CHECK(rc == 0, "exit status %d", rc);
  printf("ok watchdog\n");
out:
  case_end(&k);
}

static void case_foreign_pid(void) {
  static const char *const listen[] = {"decoy.sock"};
  int rc;
  gpupool_client *c = NULL;
  svc_case k;

  printf("case foreign-pid\n");
  CHECK(case_begin(&k, "foreign-pid", listen, 1, "own.sock") == 0, "set-up in %s", k.dir);
  k.o.listen_pid_self = 0;
  CHECK(case_start_ready(&k, NULL, 0) == 0, "gpupoold started and ready");
  rc = gpupool_client_connect(k.own, "svc-foreign", GPUPOOL_TIMEOUT_DEFAULT, &c);
  CHECK(rc == 0, "connect to the daemon's own socket: %s", gpupool_last_error());
  gpupool_client_disconnect(c);
  c = NULL;
  rc = case_stop(&k, 10000);
  CHECK(rc == 0, "exit status %d", rc);
  CHECK(access(k.own, F_OK) != 0, "the daemon left its own socket %s behind", k.own);
  printf("ok foreign-pid\n");
out:
  if (c != NULL)
    gpupool_client_disconnect(c);
  case_end(&k);
}

static int write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f == NULL)
    return -1;
  fputs(text, f);
  return fclose(f);
}

/* STATUS= follows the clients and names, and says which metrics exporter is degraded. */
static void case_status(void) {
  static const char *const listen[] = {"gp.sock"};
  char got[1024], conf[200], text[600];
  int rc;
  gpupool_client *c = NULL;
  gpupool_buffer *b = NULL;
  svc_case k;

  printf("case status\n");
  CHECK(case_begin(&k, "status", listen, 1, "gp.sock") == 0, "set-up in %s", k.dir);
  /* A textfile exporter whose directory does not exist: degraded, the rest serves. */
  path_in(conf, sizeof(conf), k.dir, "gpupoold.conf");
  snprintf(text, sizeof text, "[daemon]\nmetrics_textfile = %s/missing/gpupool.prom\n", k.dir);
  CHECK(write_file(conf, text) == 0, "writing %s", conf);
  k.o.conf = conf;
  CHECK(case_start_ready(&k, got, sizeof(got)) == 0, "gpupoold started and ready");
  CHECK(strstr(got, "0 client(s)") && strstr(got, "0 name(s)"), "READY=1 status: '%s'", got);
  CHECK(strstr(got, "degraded: metrics textfile") != NULL, "STATUS= does not name the degraded exporter: '%s'", got);
  rc = gpupool_client_connect(k.own, "svc-status", GPUPOOL_TIMEOUT_DEFAULT, &c);
  CHECK(rc == 0, "gpupool_client_connect: %s", gpupool_last_error());
  rc = gpupool_buffer_alloc(c, NULL, 1 << 20, 0, NULL, &b);
  CHECK(rc == 0, "gpupool_buffer_alloc: %s", gpupool_last_error());
  rc = gpupool_buffer_publish(b, "status-name", NULL, NULL, NULL);
  CHECK(rc == 0, "gpupool_buffer_publish: %s", gpupool_last_error());
  CHECK(wait_notify(k.nfd, "1 name(s)", 10000, got, sizeof(got)), "STATUS= never showed the name");
  CHECK(strstr(got, "1 client(s)") != NULL, "STATUS= without the client: '%s'", got);
  rc = case_stop(&k, 10000);
  CHECK(rc == 0, "exit status %d", rc);
  printf("ok status\n");
out:
  drop_client(b, c);
  case_end(&k);
}

/* A TCP port on 127.0.0.1 that this process listens on (so a daemon cannot), or -1. */
static int taken_port(int *fd_out) {
  struct sockaddr_in a;
  socklen_t alen = sizeof(a);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  *fd_out = -1;
  if (fd < 0)
    return -1;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 1) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &alen) != 0) {
    close(fd);
    return -1;
  }
  *fd_out = fd;
  return ntohs(a.sin_port);
}

/* Whether the part of a STATUS= text from part_start to next (NULL: the end) ends between
 * words: as the daemon wrote it, or with the " ..." of a cut. */
static int ends_between_words(const char *status, const char *part_start, const char *next) {
  const char *p = strstr(status, part_start), *end;
  if (p == NULL)
    return 0;
  end = next ? strstr(p, next) : p + strlen(p);
  if (end == NULL)
    return 0;
  /* Either the part ends as the daemon wrote it, or with the mark of a cut. */
  return end - p >= 4 && (!strncmp(end - 4, " ...", 4) || end[-1] != ' ');
}

/* STATUS= over 255 bytes: a failed reload with a long reason and two degraded exporters.
 * Every part is there, the reason and the exporters' reasons whole (they fit the limit),
 * nothing cut inside a word. */
static void case_status_fit(void) {
  static const char *const listen[] = {"gp.sock"};
  char conf[200], text[1200], got[2048], long_dir[300], why[600];
  const char *st;
  int rc, port, pfd = -1;
  svc_case k;

  printf("case status-fit\n");
  CHECK(case_begin(&k, "status-fit", listen, 1, "gp.sock") == 0, "set-up in %s", k.dir);
  CHECK((port = taken_port(&pfd)) > 0, "a TCP port to take: %s", strerror(errno));
  /* A textfile directory that does not exist, under a long path. */
  snprintf(long_dir, sizeof long_dir, "%s/a-directory-that-the-operator-has-not-created-yet/and-below-it/"
           "one-more-level-to-make-the-reason-long", k.dir);
  path_in(conf, sizeof(conf), k.dir, "gpupoold.conf");
  snprintf(text, sizeof text, "[daemon]\nmetrics_textfile = %s/gpupool.prom\nmetrics_listen = 127.0.0.1:%d\n",
           long_dir, port);
  CHECK(write_file(conf, text) == 0, "writing %s", conf);
  k.o.conf = conf;
  CHECK(case_start_ready(&k, got, sizeof(got)) == 0, "gpupoold started and ready");
  /* A reload that fails with a long reason (the key's value is quoted in it). */
  snprintf(text, sizeof text, "[daemon]\nmetrics_textfile = %s/gpupool.prom\nmetrics_listen = 127.0.0.1:%d\n"
           "max_clients = %s\n", long_dir, port,
           "a-value-long-enough-to-push-the-status-line-of-this-daemon-past-two-hundred-and-fifty-five-bytes");
  CHECK(write_file(conf, text) == 0, "writing %s", conf);
  CHECK(kill(k.pid, SIGHUP) == 0, "kill");
  CHECK(wait_notify(k.nfd, "STATUS=Reload failed", 15000, got, sizeof(got)), "no failed reload in STATUS=");
  st = strstr(got, "STATUS=") + strlen("STATUS=");
  printf("  STATUS= of %zu bytes\n", strlen(st));
  CHECK(strlen(st) > 255, "the test's status is not long enough to test the fit: %zu bytes", strlen(st));
  CHECK(strstr(st, "; Serving 1 pool(s) on the host backend: 0 client(s), 0 of 64 MiB used, 0 name(s)") != NULL,
        "the serving part is not whole: '%s'", st);
  /* The reason as the log has it, whole. */
  snprintf(why, sizeof why, "%s:4:", conf);
  CHECK(strstr(st, why) != NULL, "the reason's file:line is missing: '%s'", st);
  CHECK(strstr(st, "two-hundred-and-fifty-five-bytes") != NULL, "the reason is cut: '%s'", st);
  CHECK(ends_between_words(st, "Reload failed", "; Serving"), "the reload part ends mid-word: '%s'", st);
  CHECK(strstr(st, "degraded: metrics textfile") != NULL && strstr(st, "metrics tcp") != NULL,
        "a degraded exporter is missing: '%s'", st);
  CHECK(strstr(st, "one-more-level-to-make-the-reason-long") != NULL, "the textfile reason is cut: '%s'", st);
  CHECK(strstr(st, "IPAddressAllow=") != NULL, "the tcp reason is cut: '%s'", st);
  CHECK(ends_between_words(st, "degraded: ", NULL), "the degraded part ends mid-word: '%s'", st);
  rc = case_stop(&k, 10000);
  CHECK(rc == 0, "exit status %d", rc);
  printf("ok status-fit\n");
out:
  if (pfd >= 0)
    close(pfd);
  if (failures)
    dump_file(k.errlog);
  case_end(&k);
}

static void case_config_error(void) {
  static const char *const listen[] = {"gp.sock"};
  char conf[200], got[1024];
  int rc;
  gpupool_client *c = NULL;
  gpupool_buffer *b = NULL;
  svc_case k;

  printf("case config-error\n");
  CHECK(case_begin(&k, "config-error", listen, 1, "gp.sock") == 0, "set-up in %s", k.dir);
  path_in(conf, sizeof(conf), k.dir, "gpupoold.conf");
  CHECK(write_file(conf, "[daemon]\nmax_clients = many\n") == 0, "writing %s", conf);
  k.o.conf = conf;
  k.pid = spawn(&k.o);
  CHECK(k.pid > 0, "fork");
  CHECK(wait_notify(k.nfd, "STATUS=Configuration error", 15000, got, sizeof(got)), "no configuration error status");
  CHECK(strstr(got, "'many'") != NULL, "the status does not say what is wrong: '%s'", got);
  CHECK(wait_notify(k.nfd, "READY=1", 15000, NULL, 0), "no READY=1 from the daemon holding the socket");
  /* Twice: the daemon is still there for the second client. */
  for (int i = 0; i < 2; i++) {
    rc = gpupool_client_connect(k.own, "svc-config-error", GPUPOOL_TIMEOUT_DEFAULT, &c);
    CHECK(rc == GPUPOOL_ECONFIG, "connect #%d: %s (%s), want ECONFIG", i, gpupool_err_name(rc), gpupool_last_error());
    CHECK(strstr(gpupool_last_error(), "'many'") && strstr(gpupool_last_error(), "--check-config"),
          "the client is not told what is wrong and how to check: %s", gpupool_last_error());
    c = NULL;
  }
  /* Fixed, then reloaded: it serves. */
  CHECK(write_file(conf, "[daemon]\nmax_clients = 64\n") == 0, "writing %s", conf);
  CHECK(kill(k.pid, SIGHUP) == 0, "kill");
  CHECK(wait_notify(k.nfd, "STATUS=Serving", 15000, got, sizeof(got)), "not serving after the fix and SIGHUP");
  rc = gpupool_client_connect(k.own, "svc-config-fixed", GPUPOOL_TIMEOUT_DEFAULT, &c);
  CHECK(rc == 0, "gpupool_client_connect after the fix: %s", gpupool_last_error());
  rc = gpupool_buffer_alloc(c, NULL, 1 << 20, 0, NULL, &b);
  CHECK(rc == 0, "gpupool_buffer_alloc: %s", gpupool_last_error());
  rc = gpupool_buffer_release(b, NULL);
  b = NULL;
  CHECK(rc == 0, "gpupool_buffer_release: %s", gpupool_last_error());
  /* Broken again while serving: a reload changes nothing, says why in STATUS=, and the
   * connected client stays served. */
  CHECK(write_file(conf, "[daemon]\nmax_clients = several\n") == 0, "writing %s", conf);
  CHECK(kill(k.pid, SIGHUP) == 0, "kill");
  CHECK(wait_notify(k.nfd, "STATUS=Reload failed", 15000, got, sizeof(got)), "no failed reload in STATUS=");
  CHECK(strstr(got, "'several'") && strstr(got, "Serving"), "the status after a failed reload: '%s'", got);
  rc = gpupool_buffer_alloc(c, NULL, 1 << 20, 0, NULL, &b);
  CHECK(rc == 0, "gpupool_buffer_alloc after the failed reload: %s", gpupool_last_error());
  rc = gpupool_buffer_release(b, NULL);
  b = NULL;
  CHECK(rc == 0, "gpupool_buffer_release: %s", gpupool_last_error());
  gpupool_client_disconnect(c);
  c = NULL;
  rc = case_stop(&k, 10000);
  CHECK(rc == 0, "exit status %d", rc);
  printf("ok config-error\n");
out:
  drop_client(b, c);
  if (failures)
    dump_file(k.errlog);
  case_end(&k);
}

/* A client that connects to path; -1 with the cause on stderr. */
static int connect_unix(const char *path) {
  struct sockaddr_un a;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  memset(&a, 0, sizeof(a));
  a.sun_family = AF_UNIX;
  snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
  if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
    perror(path);
    close(fd);
    return -1;
  }
  return fd;
}

#define ATTACK_SILENT 20

/* What the attack of the config-error-attack case holds: a child that trickles a frame
 * header announcing 512 KiB and then a byte every 0.5 s (for up to 30 s, until the daemon
 * drops it), and connections that send nothing. */
typedef struct {
  pid_t trickler;
  int silent[ATTACK_SILENT];
} attack;

static int attack_start(attack *a, const char *path) {
  static const uint8_t hdr[4] = {0x00, 0x00, 0x08, 0x00}; /* 512 KiB, little-endian */
  int fd;
  a->trickler = -1;
  for (int i = 0; i < ATTACK_SILENT; i++)
    a->silent[i] = -1;
  if ((fd = connect_unix(path)) < 0)
    return -1;
  a->trickler = fork();
  if (a->trickler < 0) {
    close(fd);
    return -1;
  }
  if (a->trickler == 0) {
    struct timespec half = {0, 500 * 1000 * 1000};
    if (send(fd, hdr, sizeof hdr, MSG_NOSIGNAL) != (ssize_t)sizeof hdr)
      _exit(1);
    for (int i = 0; i < 60; i++) {
      nanosleep(&half, NULL);
      if (send(fd, "x", 1, MSG_NOSIGNAL) != 1)
        _exit(0);
    }
    _exit(0);
  }
  close(fd);
  /* The trickle has begun before the silent ones and the honest client come. */
  usleep(200 * 1000);
  for (int i = 0; i < ATTACK_SILENT; i++)
    if ((a->silent[i] = connect_unix(path)) < 0)
      return -1;
  return 0;
}

static void attack_end(attack *a) {
  if (a->trickler > 0) {
    kill(a->trickler, SIGKILL);
    waitpid(a->trickler, NULL, 0);
    a->trickler = -1;
  }
  for (int i = 0; i < ATTACK_SILENT; i++)
    if (a->silent[i] >= 0) {
      close(a->silent[i]);
      a->silent[i] = -1;
    }
}

/* Config-error mode under attack: a client that trickles its first frame and 20 that send
 * nothing must not keep another client from its answer, nor SIGHUP and SIGTERM from taking
 * effect. Each bound below is many times what the work takes (milliseconds), below the
 * 5 s a connection has for its first frame, and far below how long the attack lasts (it
 * held the daemon for about 20 s when the mode read each first frame on the loop with a
 * receive timeout). */
static void case_config_error_attack(void) {
  static const char *const listen[] = {"gp.sock"};
  char conf[200], got[1024];
  int rc;
  int64_t t0;
  gpupool_client *c = NULL;
  attack a = {.trickler = -1, .silent = {-1}};
  svc_case k;

  printf("case config-error-attack\n");
  for (int i = 0; i < ATTACK_SILENT; i++)
    a.silent[i] = -1;
  CHECK(case_begin(&k, "config-error-attack", listen, 1, "gp.sock") == 0, "set-up in %s", k.dir);
  path_in(conf, sizeof(conf), k.dir, "gpupoold.conf");
  CHECK(write_file(conf, "[daemon]\nmax_frame = banana\n") == 0, "writing %s", conf);
  k.o.conf = conf;
  k.pid = spawn(&k.o);
  CHECK(k.pid > 0, "fork");
  CHECK(wait_notify(k.nfd, "READY=1", 15000, NULL, 0), "no READY=1 from the daemon in config-error mode");

  CHECK(attack_start(&a, k.own) == 0, "starting the attack");
  t0 = now_ms();
  rc = gpupool_client_connect(k.own, "svc-under-attack", 2500, &c);
  printf("  Hello answered after %lld ms: %s\n", (long long)(now_ms() - t0), gpupool_err_name(rc));
  CHECK(rc == GPUPOOL_ECONFIG, "connect during the attack: %s (%s), want ECONFIG within 2.5 s",
        gpupool_err_name(rc), gpupool_last_error());
  CHECK(strstr(gpupool_last_error(), "banana") != NULL, "the answer lacks the reason: %s", gpupool_last_error());
  c = NULL;

  /* SIGHUP with the file fixed, the attack still on: it serves. */
  CHECK(write_file(conf, "[daemon]\nmax_frame = 1M\n") == 0, "writing %s", conf);
  t0 = now_ms();
  CHECK(kill(k.pid, SIGHUP) == 0, "kill");
  CHECK(wait_notify(k.nfd, "STATUS=Serving", 3000, got, sizeof(got)), "not serving within 3 s of SIGHUP during the attack");
  printf("  serving %lld ms after SIGHUP\n", (long long)(now_ms() - t0));
  rc = gpupool_client_connect(k.own, "svc-fixed", 5000, &c);
  CHECK(rc == 0, "connect after the fix: %s", gpupool_last_error());
  gpupool_client_disconnect(c);
  c = NULL;
  attack_end(&a);
  rc = case_stop(&k, 10000);
  CHECK(rc == 0, "exit status %d", rc);
  case_end(&k);

  /* Broken again, attacked again: SIGTERM ends it at once. */
  CHECK(case_begin(&k, "config-error-attack-term", listen, 1, "gp.sock") == 0, "set-up in %s", k.dir);
  path_in(conf, sizeof(conf), k.dir, "gpupoold.conf");
  CHECK(write_file(conf, "[daemon]\nmax_frame = banana\n") == 0, "writing %s", conf);
  k.o.conf = conf;
  k.pid = spawn(&k.o);
  CHECK(k.pid > 0, "fork");
  CHECK(wait_notify(k.nfd, "READY=1", 15000, NULL, 0), "no READY=1 from the daemon in config-error mode");
  CHECK(attack_start(&a, k.own) == 0, "starting the attack");
  usleep(300 * 1000);
  t0 = now_ms();
  rc = case_stop(&k, 3000);
  printf("  SIGTERM took %lld ms\n", (long long)(now_ms() - t0));
  CHECK(rc == 0, "exit status %d within 3 s of SIGTERM during the attack (-1: still running)", rc);
  printf("ok config-error-attack\n");
out:
  attack_end(&a);
  if (c != NULL)
    gpupool_client_disconnect(c);
  if (failures)
    dump_file(k.errlog);
  case_end(&k);
}

int main(int argc, char **argv) {
  const char *only = argc > 2 ? argv[2] : NULL;
  char cmd[128];

  if (argc < 2) {
    fprintf(stderr, "usage: test_activation PATH_TO_GPUPOOLD [activation|two-fds|watchdog|"
                    "foreign-pid|status|status-fit|config-error|config-error-attack]\n");
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
  if (!only || !strcmp(only, "status"))
    case_status();
  if (!only || !strcmp(only, "status-fit"))
    case_status_fit();
  if (!only || !strcmp(only, "config-error"))
    case_config_error();
  if (!only || !strcmp(only, "config-error-attack"))
    case_config_error_attack();
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
  if (failures == 0 && system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", root);
  if (failures)
    fprintf(stderr, "%d failure(s); files kept in %s\n", failures, root);
  return failures ? 1 : 0;
}
