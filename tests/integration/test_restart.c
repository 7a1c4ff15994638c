/*
 * Daemon restarts under live clients: mapped buffers stay readable, the next request
 * reconnects with backoff, and the client is told which holds and names were lost instead
 * of failing silently later.
 */
#include "harness.h"

static th_daemon D;

static int setup(void **state) {
  *state = &D;
  th_prepare(&D);
  th_start(&D, 0, "--pool", "name=default,kind=host,capacity=64M,slab=4M", NULL);
  return 0;
}

/* Kill the daemon (SIGKILL: no goodbye), then start a fresh one on the same socket. */
static void crash_and_restart(int restart) {
  kill(D.pid, SIGKILL);
  waitpid(D.pid, NULL, 0);
  th_track(D.pid, 0);
  D.pid = 0;
  if (restart)
    th_start(&D, 0, "--pool", "name=default,kind=host,capacity=64M,slab=4M", NULL);
}

static void test_restart_reports_lost(void **state) {
  gpupool_client *p = th_connect(&D, "producer"), *q = th_connect(&D, "consumer"), *r = th_connect(&D, "no-retry");
  gpupool_buffer *b, *g, *x;
  gpupool_token tok;
  char names[4][GPUPOOL_NAME_MAX + 1];
  int n = 0;
  (void)state;

  assert_int_equal(gpupool_client_set_reconnect(r, 0), 0);
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 100000, 0, NULL, &b), 0);
  th_fill(gpupool_buffer_ptr(b), 9, 100000);
  assert_int_equal(gpupool_buffer_publish(b, "keep", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_publish(b, "gone-before", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "gone-before"), 0);
  assert_int_equal(gpupool_buffer_get(q, "keep", 0, 0, 0, NULL, &g, NULL), 0);

  crash_and_restart(1);

  /* Mappings outlive the daemon. */
  assert_true(th_check(gpupool_buffer_ptr(b), 9, 100000));
  assert_true(th_check(gpupool_buffer_ptr(g), 9, 100000));
  /* The next request reconnects. */
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 5000, 0, NULL, &x), 0);
  assert_int_equal(gpupool_client_reconnect_count(p), 1);
  assert_true(gpupool_buffer_lost(b));
  assert_false(gpupool_buffer_lost(x));
  assert_int_equal(gpupool_client_lost_names(p, names, 4, &n), 0);
  assert_int_equal(n, 1);
  assert_string_equal(names[0], "keep");
  assert_int_equal(gpupool_client_lost_names(p, names, 4, &n), 0);
  assert_int_equal(n, 0); /* reported once */
  assert_int_equal(gpupool_buffer_share(b, NULL, &tok), GPUPOOL_ELOST);
  assert_non_null(strstr(gpupool_last_error(), "gone away"));
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  assert_int_equal(gpupool_buffer_release(x, NULL), 0);
  /* The consumer reconnects too; the old name is not there any more. */
  assert_int_equal(gpupool_buffer_get(q, "keep", 0, 0, 0, NULL, &x, NULL), GPUPOOL_ENOENT);
  assert_true(gpupool_buffer_lost(g));
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  /* Reconnection switched off: the request fails and says so. */
  assert_int_equal(gpupool_buffer_alloc(r, NULL, 10, 0, NULL, &x), GPUPOOL_ECLOSED);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(p);
  gpupool_client_disconnect(q);
  th_wait_idle(&D, 2000);
}

static void test_daemon_does_not_come_back(void **state) {
  gpupool_client *c = th_connect(&D, "patient");
  gpupool_buffer *x;
  uint64_t t0;
  (void)state;
  assert_int_equal(gpupool_client_set_reconnect(c, 300), 0);
  crash_and_restart(0);
  t0 = th_now_ms();
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 10, 0, NULL, &x), GPUPOOL_ECONNECT);
  assert_true(th_now_ms() - t0 >= 250);
  assert_non_null(strstr(gpupool_last_error(), "did not come back within 300 ms"));
  /* It comes back later: the client recovers on its next request. */
  th_start(&D, 0, "--pool", "name=default,kind=host,capacity=64M,slab=4M", NULL);
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 10, 0, NULL, &x), 0);
  assert_int_equal(gpupool_buffer_release(x, NULL), 0);
  gpupool_client_disconnect(c);
}

int main(void) {
  return TS_RUN_TESTS(setup, th_teardown, test_restart_reports_lost, test_daemon_does_not_come_back);
}
