/*
 * The listen backlog under a flood: another user (uid 65534) opens connections that never
 * send Hello, as fast as the kernel takes them, so the daemon's accept queue is full whenever
 * that user can make it so. The default queue is deeper than one process's fds; a client whose
 * connect finds the queue full retries within its timeout, and says so if it gives up.
 */
#include <sys/resource.h>
#include <sys/stat.h>

#include "harness.h"

#define ATTACKERS 2
#define HELD 1000 /* about what a default RLIMIT_NOFILE of 1024 lets one process hold */

static th_daemon D;

static void start_with(const char *extra) {
  char lines[512];
  snprintf(lines, sizeof lines, "max_clients_per_uid = 64\n%s", extra);
  th_start_shared(&D, lines, TH_HOST_POOL("16M", "4M"));
}

/* Opens connections without blocking and never says Hello: when it holds HELD, closes the
 * oldest hundred and goes on, so the daemon keeps having new ones to accept and refuse. Runs
 * until its parent closes the pipe (stop_fd readable). Exits 0; prints how often it found the
 * backlog full. */
static int flood(const th_daemon *d, int stop_fd) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  struct rlimit rl = {1024, 1024};
  static int held[HELD];
  int n = 0;
  uint64_t full = 0, made = 0;

  CHILD_CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0, "setrlimit");
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  memcpy(a.sun_path, d->sock, strlen(d->sock) + 1);
  for (;;) {
    char c;
    int fd;
    if (read(stop_fd, &c, 1) >= 0 || errno != EAGAIN)
      break;
    for (int k = 0; k < 64; k++) {
      if (n == HELD) {
        for (int i = 0; i < 100; i++)
          close(held[i]);
        memmove(held, held + 100, (HELD - 100) * sizeof held[0]);
        n -= 100;
      }
      fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      CHILD_CHECK(fd >= 0, "socket: %s", strerror(errno));
      if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
        held[n++] = fd;
        made++;
      } else {
        CHILD_CHECK(errno == EAGAIN, "connect: %s", strerror(errno));
        full++;
        close(fd);
      }
    }
  }
  fprintf(stderr, "flood %d: %llu connections made, backlog full %llu times\n", (int)getpid(),
          (unsigned long long)made, (unsigned long long)full);
  return 0;
}

/* Root connects `tries` times with a generous 10 s timeout while the flood
 * runs; every connect and a Stats must succeed. */
static void connect_under_flood(int tries) {
  pid_t att[ATTACKERS];
  int stop[2];
  assert_int_equal(pipe2(stop, O_NONBLOCK | O_CLOEXEC), 0);
  for (int i = 0; i < ATTACKERS; i++) {
    att[i] = fork();
    assert_true(att[i] >= 0);
    if (att[i] == 0) {
      close(stop[1]);
      _exit(flood(&D, stop[0]));
    }
  }
  close(stop[0]);
  th_sleep_ms(500); /* the flood is under way */
  for (int i = 0; i < tries; i++) {
    gpupool_client *c = NULL;
    gpupool_daemon_stats ds;
    int rc = gpupool_client_connect(D.sock, "root", 10000, &c);
    if (rc != 0) {
      close(stop[1]);
      for (int j = 0; j < ATTACKERS; j++)
        waitpid(att[j], NULL, 0);
      fail_msg("root's connect %d of %d failed under the flood: %s: %s", i + 1, tries, gpupool_err_name(rc),
               gpupool_last_error());
    }
    assert_int_equal(gpupool_client_stats(c, &ds, NULL, 0, NULL), 0);
    gpupool_client_disconnect(c);
  }
  close(stop[1]);
  for (int i = 0; i < ATTACKERS; i++)
    th_wait_ok(att[i], "flood");
}

/* Opens n connections that never say Hello without blocking, as uid 65534; exits 0 when the
 * kernel queued every one (and holds them until its parent closes the pipe), 1 otherwise. */
static int hold_queued(const th_daemon *d, int n) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  struct rlimit rl = {n + 64, n + 64};
  CHILD_CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0, "setrlimit");
  CHILD_CHECK(th_become(NOBODY) == 0, "setuid");
  memcpy(a.sun_path, d->sock, strlen(d->sock) + 1);
  for (int i = 0; i < n; i++) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    CHILD_CHECK(fd >= 0, "socket: %s", strerror(errno));
    CHILD_CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0, "connection %d of %d not queued: %s", i + 1, n,
                strerror(errno));
  }
  return 0;
}

/* In a child: root connects with a 10 s timeout and asks for Stats. */
static int root_connects(const th_daemon *d, int unused) {
  gpupool_client *c = NULL;
  gpupool_daemon_stats ds;
  (void)unused;
  CHILD_CHECK(gpupool_client_connect(d->sock, "root", 10000, &c) == 0, "connect");
  CHILD_CHECK(gpupool_client_stats(c, &ds, NULL, 0, NULL) == 0, "stats");
  gpupool_client_disconnect(c);
  return 0;
}

/* The default backlog is deep: with the daemon not accepting for a moment (stopped), a burst
 * of 1000 connections from one user is queued whole, and root still gets in once it runs. */
static void test_default_backlog_is_deep(void **state) {
  pid_t att, root;
  (void)state;
  start_with("");
  assert_int_equal(kill(D.pid, SIGSTOP), 0);
  att = th_spawn(&D, hold_queued, HELD);
  th_wait_ok(att, "1000 queued connections from uid 65534");
  root = th_spawn(&D, root_connects, 0);
  th_sleep_ms(200);
  assert_int_equal(kill(D.pid, SIGCONT), 0);
  th_wait_ok(root, "root's connect after the burst");
  th_stop(&D);
}

/* A backlog of 2 that is full while the daemon is stopped: a client with a short timeout
 * gives up saying why, and one with a longer timeout gets in once the daemon runs again. */
static void test_full_backlog(void **state) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  gpupool_client *c = NULL;
  int held[16], n = 0, rc;
  pid_t root;
  (void)state;
  start_with("listen_backlog = 2\n");
  memcpy(a.sun_path, D.sock, strlen(D.sock) + 1);
  assert_int_equal(kill(D.pid, SIGSTOP), 0);
  while (n < 16) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
      assert_int_equal(errno, EAGAIN);
      close(fd);
      break;
    }
    held[n++] = fd;
  }
  assert_true(n < 16); /* the queue is full */
  rc = gpupool_client_connect(D.sock, "root", 500, &c);
  assert_int_equal(rc, GPUPOOL_ETIMEDOUT);
  if (!strstr(gpupool_last_error(), "queue of waiting connections full") || !strstr(gpupool_last_error(), "tries"))
    fail_msg("the error does not say the queue stayed full: %s", gpupool_last_error());
  root = th_spawn(&D, root_connects, 0);
  th_sleep_ms(300);
  assert_int_equal(kill(D.pid, SIGCONT), 0);
  th_wait_ok(root, "root's connect once the daemon runs");
  while (n > 0)
    close(held[--n]);
  th_stop(&D);
}

/* Root's connects while another user keeps the queue as full as it can. */
static void test_flood(void **state) {
  (void)state;
  start_with("");
  connect_under_flood(20);
  th_stop(&D);
}

static int listen_delay(void *arg) {
  (void)arg;
  return setenv("GPUPOOL_TEST_LISTEN_DELAY_MS", "400", 1);
}

/* A script that waits for the socket to exist ([ -S PATH ]) and connects at once must not be
 * refused: the path appears only once the daemon listens on it (a loaded machine once
 * preempted the daemon between bind and listen, and tools/demo.sh's first client got
 * ECONNREFUSED). */
static void test_socket_appears_listening(void **state) {
  ts_daemon d;
  const char *argv[] = {GPUPOOLD_PATH, "--socket", d.sock, "--backend", "host", "--log-level", "debug", NULL};
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  struct stat st;
  int fd, rc = -1, e = 0, status;
  (void)state;
  assert_int_equal(ts_daemon_prepare(&d, NULL, "listening"), 0);
  d.pid = ts_exec(argv, d.log, 0, listen_delay, NULL);
  assert_true(d.pid > 0);
  for (int i = 0; i < 10000 && !(stat(d.sock, &st) == 0 && S_ISSOCK(st.st_mode)); i++)
    usleep(500);
  assert_true(stat(d.sock, &st) == 0 && S_ISSOCK(st.st_mode));
  memcpy(a.sun_path, d.sock, strlen(d.sock) + 1);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(fd >= 0);
  rc = connect(fd, (struct sockaddr *)&a, sizeof a);
  e = errno;
  close(fd);
  if (rc != 0)
    ts_daemon_dump_log(&d);
  assert_int_equal(ts_daemon_stop(&d, 5000) >= 0, 1);
  ts_daemon_remove(&d);
  (void)status;
  if (rc != 0)
    fail_msg("connect right after the socket appeared: %s (the path exists before the daemon listens)", strerror(e));
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_default_backlog_is_deep, test_full_backlog, test_flood,
                      test_socket_appears_listening);
}
