/*
 * Integration test harness: starts the real gpupoold on a private socket in a fresh temp
 * directory, waits until it accepts connections, runs scenarios in real child processes,
 * and stops it (checking that it exits cleanly). The daemon's log is kept in the temp dir
 * and printed when a test fails. The launcher itself is tests/support/daemon.h; this file
 * is its cmocka face (failures become fail_msg) plus what only cmocka tests use.
 */
#ifndef GPUPOOL_TEST_HARNESS_H
#define GPUPOOL_TEST_HARNESS_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <gpupool/gpupool.h>

#include "daemon.h"
#include "run_tests.h" /* TS_RUN_TESTS, a test file's main */

/* The daemon of a test: tests/support/daemon.h's, so the same fields (dir, sock, log, conf,
 * pid) and the same launcher as the GPU harness, the service tests and the benchmarks. */
typedef ts_daemon th_daemon;

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

static inline void th_dump_log(const th_daemon *d) { ts_daemon_dump_log(d); }

static inline int th_can_connect(const char *path) { return ts_can_connect(path); }

/* Write a config file into the daemon's dir (before th_start with use_conf). */
static inline void th_write_conf(th_daemon *d, const char *text) {
  if (ts_daemon_write_conf(d, text) != 0)
    fail_msg("%s", d->why);
}

static inline void th_prepare(th_daemon *d) {
  if (ts_daemon_prepare(d, NULL, "gpupool-test-") != 0)
    fail_msg("%s", d->why);
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

/* Start gpupoold as o says (tests/support/daemon.h); it is killed at exit if th_stop is
 * never reached. */
static inline void th_start_opts(th_daemon *d, const ts_daemon_opts *o) {
  if (ts_daemon_start(d, o) != 0)
    fail_msg("%s", d->why);
  th_track(d->pid, 1);
}

/* Start gpupoold with the host backend and extra arguments (NULL-terminated). */
static inline void th_start(th_daemon *d, int use_conf, ...) {
  const char *extra[24];
  int n = 0;
  va_list ap;
  const char *a;
  ts_daemon_opts o = {.gpupoold = GPUPOOLD_PATH, .backend = "host", .log_level = "debug",
                      .use_conf = use_conf, .extra = extra, .ready_ms = 5000, .poll_ms = 10};
  va_start(ap, use_conf);
  while ((a = va_arg(ap, const char *)) && n < 23)
    extra[n++] = a;
  va_end(ap);
  extra[n] = NULL;
  th_start_opts(d, &o);
}

/* th_prepare for a daemon that every uid can reach: its dir 0711 (searchable, not listable),
 * for the tests whose children run as another user (th_become). */
static inline void th_prepare_shared(th_daemon *d) {
  th_prepare(d);
  assert_int_equal(chmod(d->dir, 0711), 0);
}

/* One host pool "default" of capacity and slab_size (config text). */
#define TH_HOST_POOL(capacity, slab_size) \
  "[pool default]\nkind = host\ncapacity = " capacity "\nslab_size = " slab_size "\n"

/* Start a daemon every uid can reach (th_prepare_shared, socket_mode 0666) with the further
 * [daemon] lines daemon_lines (may be NULL) and then the config sections `sections`. */
static inline void th_start_shared(th_daemon *d, const char *daemon_lines, const char *sections) {
  char conf[4096];
  th_prepare_shared(d);
  snprintf(conf, sizeof conf, "[daemon]\nsocket_mode = 0666\n%s\n%s", daemon_lines ? daemon_lines : "",
           sections);
  th_write_conf(d, conf);
  th_start(d, 1, NULL);
}

/* SIGTERM, wait, require a clean exit; remove the temp dir. */
static inline void th_stop(th_daemon *d) {
  if (d->pid > 0) {
    pid_t pid = d->pid;
    int st = ts_daemon_stop(d, -1);
    th_track(pid, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      th_dump_log(d);
      fail_msg("gpupoold did not exit cleanly on SIGTERM (status 0x%x)", st);
    }
  }
  ts_daemon_remove(d);
}

/* A fresh temp dir, the config text conf, and the daemon started on it. */
static inline void th_start_conf(th_daemon *d, const char *conf) {
  th_prepare(d);
  th_write_conf(d, conf);
  th_start(d, 1, NULL);
}

/* cmocka teardown for tests whose setup left their daemon in *state: th_stop on it. */
static inline int th_teardown(void **state) {
  th_stop(*state);
  return 0;
}

static inline gpupool_client *th_connect(const th_daemon *d, const char *name) {
  gpupool_client *c = NULL;
  int rc = gpupool_client_connect(d->sock, name, GPUPOOL_TIMEOUT_DEFAULT, &c);
  if (rc != 0)
    fail_msg("connect: %s: %s", gpupool_err_name(rc), gpupool_last_error());
  return c;
}

static inline void th_stats(const th_daemon *d, gpupool_daemon_stats *ds, gpupool_pool_stats *ps) {
  gpupool_client *c = th_connect(d, "stats");
  gpupool_pool_stats tmp[8];
  int n = 0, rc = gpupool_client_stats(c, ds, tmp, 8, &n);
  if (rc != 0)
    fail_msg("stats: %s", gpupool_last_error());
  if (ps) {
    assert_true(n >= 1);
    *ps = tmp[0];
  }
  gpupool_client_disconnect(c);
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
    assert_int_equal(gpupool_client_trim(c), 0);
    gpupool_client_disconnect(c);
    th_stats(d, &ds, NULL);
    if (ds.open_fds == expected)
      return;
    th_sleep_ms(20);
  } while (th_now_ms() < end);
  th_dump_log(d);
  fail_msg("daemon has %llu fds open, expected %llu", (unsigned long long)ds.open_fds,
           (unsigned long long)expected);
}

/* The other user of the tests that switch users (the same as TS_NOBODY; spelled out so that a
 * test's own identical definition stays legal). */
#define NOBODY 65534

/* In a child: become uid when running as root (CI does), so that an attack runs as another
 * user; otherwise stay who we are. 0, or -1 when the switch failed. */
static inline int th_become(uid_t uid) { return ts_become(uid); }

/* 1 when running as root; otherwise says the test is skipped, and why it needs root. */
static inline int th_need_root(const char *for_what) {
  if (getuid() == 0)
    return 1;
  printf("skipped: needs root %s\n", for_what);
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

/* Closes every socket of this process (its gpupool connection among them), keeping every
 * other fd (a lease) and every mapping: a process that hangs up but still uses memory. */
static inline void th_close_sockets(void) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  if (!d)
    return;
  while ((e = readdir(d))) {
    char path[64], link[64];
    ssize_t n;
    int fd = atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dirfd(d))
      continue;
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    n = readlink(path, link, sizeof link - 1);
    if (n > 0) {
      link[n] = '\0';
      if (!strncmp(link, "socket:", 7))
        close(fd);
    }
  }
  closedir(d);
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

/* Write a file of size bytes of seed's fill (th_byte at each offset) at p, mode `mode` (set
 * again after the write, whatever the umask). */
static inline void th_write_file(const char *p, uint64_t size, mode_t mode, uint32_t seed) {
  uint8_t buf[65536];
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  assert_true(fd >= 0);
  for (uint64_t o = 0; o < size;) {
    size_t n = size - o < sizeof buf ? (size_t)(size - o) : sizeof buf;
    for (size_t j = 0; j < n; j++)
      buf[j] = th_byte(seed, o + j);
    assert_int_equal(write(fd, buf, n), (ssize_t)n);
    o += n;
  }
  assert_int_equal(fchmod(fd, mode), 0);
  close(fd);
}

#endif
