/*
 * Integration test harness: starts the real gpupoold on a private socket in a fresh temp
 * directory, waits until it accepts connections, runs scenarios in real child processes,
 * and stops it (checking that it exits cleanly). The daemon's log is kept in the temp dir
 * and printed when a test fails.
 */
#ifndef GPUPOOL_TEST_HARNESS_H
#define GPUPOOL_TEST_HARNESS_H

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <gpupool/gpupool.h>

typedef struct {
  char dir[256];
  char sock[300];
  char log[300];
  char conf[300];
  pid_t pid;
} th_daemon;

static inline void th_sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

static inline uint64_t th_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static inline void th_dump_log(const th_daemon *d) {
  char buf[4096];
  size_t n;
  FILE *f = fopen(d->log, "r");
  if (!f)
    return;
  fprintf(stderr, "---- gpupoold log (%s) ----\n", d->log);
  while ((n = fread(buf, 1, sizeof buf, f)) > 0)
    fwrite(buf, 1, n, stderr);
  fprintf(stderr, "---- end of log ----\n");
  fclose(f);
}

static inline int th_can_connect(const char *path) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), ok;
  if (strlen(path) >= sizeof a.sun_path) {
    if (fd >= 0)
      close(fd);
    return 0;
  }
  memcpy(a.sun_path, path, strlen(path) + 1);
  ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

/* Write a config file into the daemon's dir (before th_start with use_conf). */
static inline void th_write_conf(th_daemon *d, const char *text) {
  FILE *f = fopen(d->conf, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static inline void th_prepare(th_daemon *d) {
  memset(d, 0, sizeof *d);
  snprintf(d->dir, sizeof d->dir, "/tmp/gpupool-test-XXXXXX");
  assert_non_null(mkdtemp(d->dir));
  snprintf(d->sock, sizeof d->sock, "%s/gpupoold.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/gpupoold.log", d->dir);
  snprintf(d->conf, sizeof d->conf, "%s/gpupoold.conf", d->dir);
}

/* Daemons still running when a failed assertion skips th_stop are killed at exit. */
static pid_t th_live[16];

static inline void th_kill_live(void) {
  for (int i = 0; i < 16; i++)
    if (th_live[i] > 0) {
      kill(th_live[i], SIGKILL);
      waitpid(th_live[i], NULL, 0);
      th_live[i] = 0;
    }
}

static inline void th_track(pid_t pid, int add) {
  static int registered;
  if (!registered) {
    atexit(th_kill_live);
    registered = 1;
  }
  for (int i = 0; i < 16; i++)
    if (add ? th_live[i] == 0 : th_live[i] == pid) {
      th_live[i] = add ? pid : 0;
      return;
    }
}

/* Start gpupoold with the host backend and extra arguments (NULL-terminated). */
static inline void th_start(th_daemon *d, int use_conf, ...) {
  const char *argv[32];
  int argc = 0;
  va_list ap;
  const char *a;

  argv[argc++] = GPUPOOLD_PATH;
  argv[argc++] = "--socket";
  argv[argc++] = d->sock;
  argv[argc++] = "--backend";
  argv[argc++] = "host";
  argv[argc++] = "--log-level";
  argv[argc++] = "debug";
  if (use_conf) {
    argv[argc++] = "--config";
    argv[argc++] = d->conf;
  }
  va_start(ap, use_conf);
  while ((a = va_arg(ap, const char *)) && argc < 31)
    argv[argc++] = a;
  va_end(ap);
  argv[argc] = NULL;
  d->pid = fork();
  assert_true(d->pid >= 0);
  if (d->pid == 0) {
    int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      dup2(fd, 2);
      dup2(fd, 1);
    }
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  th_track(d->pid, 1);
  for (int i = 0; i < 500; i++) {
    int st;
    if (th_can_connect(d->sock))
      return;
    if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
      th_dump_log(d);
      fail_msg("gpupoold exited during start-up (status %d)", st);
    }
    th_sleep_ms(10);
  }
  th_dump_log(d);
  fail_msg("gpupoold did not accept connections within 5 s");
}

/* SIGTERM, wait, require a clean exit; remove the temp dir. */
static inline void th_stop(th_daemon *d) {
  int st = 0;
  if (d->pid > 0) {
    kill(d->pid, SIGTERM);
    waitpid(d->pid, &st, 0);
    th_track(d->pid, 0);
    d->pid = 0;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      th_dump_log(d);
      fail_msg("gpupoold did not exit cleanly on SIGTERM (status 0x%x)", st);
    }
  }
  unlink(d->sock);
  unlink(d->log);
  unlink(d->conf);
  rmdir(d->dir);
}

/* cmocka teardown for tests whose setup left their daemon in *state: th_stop on it. */
static inline int th_teardown(void **state) {
  th_stop(*state);
  return 0;
}

static inline gpupool_client *th_connect(const th_daemon *d, const char *name) {
  gpupool_client *c = NULL;
  int rc = gpupool_connect(d->sock, name, &c);
  if (rc != 0)
    fail_msg("connect: %s: %s", gpupool_err_name(rc), gpupool_last_error());
  return c;
}

static inline void th_stats(const th_daemon *d, gpupool_daemon_stats *ds, gpupool_pool_stats *ps) {
  gpupool_client *c = th_connect(d, "stats");
  gpupool_pool_stats tmp[8];
  int n = 0, rc = gpupool_stats(c, ds, tmp, 8, &n);
  if (rc != 0)
    fail_msg("stats: %s", gpupool_last_error());
  if (ps) {
    assert_true(n >= 1);
    *ps = tmp[0];
  }
  gpupool_disconnect(c);
}

/* Poll until the daemon has no buffers, holds or pending frees and pool 0 uses 0 bytes. */
static inline void th_wait_idle(const th_daemon *d, int timeout_ms) {
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps;
  uint64_t end = th_now_ms() + (uint64_t)timeout_ms;
  do {
    th_stats(d, &ds, &ps);
    if (ds.buffers == 0 && ds.holds == 0 && ds.pending_frees == 0 && ps.used == 0)
      return;
    th_sleep_ms(20);
  } while (th_now_ms() < end);
  th_dump_log(d);
  fail_msg("daemon not idle after %d ms: buffers %llu holds %llu pending %llu used %llu", timeout_ms,
           (unsigned long long)ds.buffers, (unsigned long long)ds.holds, (unsigned long long)ds.pending_frees,
           (unsigned long long)ps.used);
}

/* The daemon's open fd count once connections that just closed have been processed (the
 * daemon closes a connection's fd from a close callback, one loop turn later). Counted
 * while the querying connection itself is open, so it includes that one socket + lease. */
static inline uint64_t th_settled_fds(const th_daemon *d) {
  gpupool_daemon_stats ds;
  uint64_t last = UINT64_MAX;
  int same = 0;
  for (int i = 0; i < 200 && same < 3; i++) {
    th_stats(d, &ds, NULL);
    same = ds.open_fds == last ? same + 1 : 0;
    last = ds.open_fds;
    th_sleep_ms(20);
  }
  return last;
}

/* Wait until the daemon's fd count is back to `expected`; fail with the log otherwise. */
static inline void th_expect_fds(const th_daemon *d, uint64_t expected) {
  gpupool_daemon_stats ds;
  uint64_t end = th_now_ms() + 3000;
  do {
    /* An empty slab the pool keeps for reuse holds its memfd (host backend): give cached
     * slabs back first, so what is counted is what a leak would leave. */
    gpupool_client *c = th_connect(d, "trim");
    assert_int_equal(gpupool_trim(c), 0);
    gpupool_disconnect(c);
    th_stats(d, &ds, NULL);
    if (ds.open_fds == expected)
      return;
    th_sleep_ms(20);
  } while (th_now_ms() < end);
  th_dump_log(d);
  fail_msg("daemon has %llu fds open, expected %llu", (unsigned long long)ds.open_fds,
           (unsigned long long)expected);
}

/* In a child: become uid when running as root (CI does), so that an attack runs as another
 * user; otherwise stay who we are. 0, or -1 when the switch failed. */
static inline int th_become(uid_t uid) {
  if (getuid() != 0)
    return 0;
  if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0)
    return -1;
  return 0;
}

typedef int (*th_child_fn)(const th_daemon *d, int arg);

/* Run fn in a child process; its return value is the exit status. */
static inline pid_t th_spawn(const th_daemon *d, th_child_fn fn, int arg) {
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int rc = fn(d, arg);
    fflush(stdout);
    fflush(stderr);
    _exit(rc);
  }
  return pid;
}

static inline void th_wait_ok(pid_t pid, const char *what) {
  int st;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    fail_msg("%s (pid %d) failed: status 0x%x", what, (int)pid, st);
}

/* Fails the child with a message (children cannot use cmocka's assertions). */
#define CHILD_CHECK(cond, ...)                                                      \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "child %d: %s:%d: ", (int)getpid(), __FILE__, __LINE__);      \
      fprintf(stderr, __VA_ARGS__);                                                 \
      fprintf(stderr, " [last error: %s]\n", gpupool_last_error());                 \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

/* The fill pattern shared by producers and consumers in the tests. */
/* Every bit of seed and j reaches the byte (a splitmix64 finish), so buffers filled with
 * different seeds differ everywhere, whatever the seeds. */
static inline uint8_t th_byte(uint32_t seed, uint64_t j) {
  uint64_t x = (j + 1) ^ ((uint64_t)seed << 32 | seed);
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return (uint8_t)x;
}

static inline void th_fill(void *p, uint32_t seed, uint64_t n) {
  for (uint64_t j = 0; j < n; j++)
    ((uint8_t *)p)[j] = th_byte(seed, j);
}

static inline int th_check(const void *p, uint32_t seed, uint64_t n) {
  for (uint64_t j = 0; j < n; j++)
    if (((const uint8_t *)p)[j] != th_byte(seed, j))
      return 0;
  return 1;
}

#endif
