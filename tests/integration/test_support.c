/*
 * The shared launcher (tests/support/daemon.h) itself: what every harness relies on when a
 * daemon does not come up, comes up, or is restarted, and that failures come back with their
 * cause rather than as a hang.
 */
#include <sys/stat.h>

#include "harness.h"

static const ts_daemon_opts host = {.gpupoold = GPUPOOLD_PATH, .backend = "host", .log_level = "debug",
                                    .use_conf = 1, .ready_ms = 5000, .poll_ms = 10};

static int log_has(const ts_daemon *d, const char *needle) {
  char buf[8192];
  size_t n;
  FILE *f = fopen(d->log, "r");
  if (!f)
    return 0;
  n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  return strstr(buf, needle) != NULL;
}

/* A socket path AF_UNIX cannot hold is refused up front, naming the fix. */
static void test_long_path_refused(void **state) {
  char tmp[200];
  ts_daemon d;
  (void)state;
  snprintf(tmp, sizeof tmp, "/tmp/gpupool-support-%d-%0120d", (int)getpid(), 0);
  assert_int_equal(mkdir(tmp, 0700), 0);
  assert_int_equal(ts_daemon_prepare(&d, tmp, "d"), -1);
  assert_non_null(strstr(d.why, "too long for AF_UNIX"));
  assert_int_equal(rmdir(tmp), 0); /* the dir made for the socket is gone again */
}

/* A daemon that exits during start-up is reported at once with its status, not waited on. */
static void test_exit_during_startup(void **state) {
  ts_daemon d;
  uint64_t t0;
  (void)state;
  assert_int_equal(ts_daemon_prepare(&d, NULL, "gpupool-support-"), 0);
  assert_int_equal(ts_daemon_write_conf(&d, "[pool p]\ncapacity = lots\n"), 0);
  t0 = th_now_ms();
  assert_int_equal(ts_daemon_start(&d, &host), -1);
  assert_true(th_now_ms() - t0 < 4000);
  assert_non_null(strstr(d.why, "exited during start-up"));
  assert_int_equal(d.pid, 0);
  assert_true(log_has(&d, "not a size"));
  ts_daemon_remove(&d);
}

/* Start, serve, SIGTERM: exit status 0; the dir and everything in it are removed. */
static void test_start_stop_remove(void **state) {
  ts_daemon d;
  struct stat st;
  int status;
  (void)state;
  assert_int_equal(ts_daemon_prepare(&d, NULL, "gpupool-support-"), 0);
  assert_int_equal(ts_daemon_write_conf(&d, TH_HOST_POOL("16M", "4M")), 0);
  assert_int_equal(ts_daemon_start(&d, &host), 0);
  assert_true(d.pid > 0);
  assert_true(ts_daemon_alive(&d));
  assert_true(ts_can_connect(d.sock));
  status = ts_daemon_stop(&d, 10000);
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  assert_int_equal(d.pid, 0);
  assert_int_equal(ts_daemon_stop(&d, 10000), -1); /* nothing left to stop */
  ts_daemon_remove(&d);
  assert_int_equal(stat(d.log, &st), -1);
}

/* append_log keeps what the daemon before a restart wrote. */
static void test_restart_appends_log(void **state) {
  ts_daemon d;
  ts_daemon_opts o = host;
  (void)state;
  o.append_log = 1;
  assert_int_equal(ts_daemon_prepare(&d, NULL, "gpupool-support-"), 0);
  assert_int_equal(ts_daemon_write_conf(&d, TH_HOST_POOL("16M", "4M")), 0);
  assert_int_equal(ts_daemon_start(&d, &o), 0);
  assert_int_equal(ts_daemon_stop(&d, 10000), 0);
  assert_int_equal(ts_daemon_write_conf(&d, "[pool p]\ncapacity = lots\n"), 0);
  assert_int_equal(ts_daemon_start(&d, &o), -1);
  assert_true(log_has(&d, "ready on"));   /* the first daemon's line */
  assert_true(log_has(&d, "not a size")); /* the second's */
  ts_daemon_remove(&d);
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_long_path_refused, test_exit_during_startup, test_start_stop_remove,
                      test_restart_appends_log);
}
