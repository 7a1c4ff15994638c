/*
 * GPUPOOL_TRACE: the client library and gpupoold, given the same file, each append one line
 * per step or request ("PID START_US WHAT DURATIONus DETAIL" on CLOCK_MONOTONIC), so that one
 * handoff can be followed across the three processes (bench/trace_breakdown.py does). Checks
 * that the lines are there, well formed, from the right processes, and that their clocks line
 * up: the daemon started on the Publish after the producer began publishing and before its
 * wait for the reply (the line with the same request number) ended, and the
 * consumer's read of the reply ended after the daemon started handling that Publish.
 */
#include "harness.h"

static th_daemon D;
static char trace_path[320];

typedef struct {
  int pid;
  double start_us, dur_us;
  unsigned long long detail;
  char what[32];
} line_t;

static int consumer(const th_daemon *d, int arg) {
  gpupool_client *c;
  gpupool_buffer *b;
  (void)arg;
  if (gpupool_client_connect(d->sock, "trace-consumer", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0 ||
      gpupool_buffer_get(c, "traced", 0, 10000, GPUPOOL_READ_ONLY, NULL, &b, NULL) != 0)
    return 1;
  if (!th_check(gpupool_buffer_ptr(b), 7, 4096))
    return 2;
  gpupool_buffer_release(b, NULL);
  gpupool_client_disconnect(c);
  return 0;
}

static int load(line_t *out, int max) {
  FILE *f = fopen(trace_path, "r");
  char buf[256];
  int n = 0;
  assert_non_null(f);
  while (fgets(buf, sizeof buf, f)) {
    line_t l;
    if (sscanf(buf, "%d %lf %31s %lfus %llu", &l.pid, &l.start_us, l.what, &l.dur_us, &l.detail) != 5)
      fail_msg("malformed trace line: %s", buf);
    if (n < max)
      out[n++] = l;
  }
  fclose(f);
  return n;
}

static void test_trace_lines_up(void **state) {
  static line_t lines[4096];
  gpupool_client *c;
  gpupool_buffer *b;
  pid_t cons;
  int n, publish = -1, pub_rpc = -1, rec = -1, cons_read = -1;
  (void)state;

  c = th_connect(&D, "trace-producer");
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 4096, 5000, NULL, &b), 0);
  th_fill(gpupool_buffer_ptr(b), 7, 4096);
  cons = th_spawn(&D, consumer, 0);
  th_sleep_ms(100); /* the consumer's get waits for the publish */
  assert_int_equal(gpupool_buffer_publish(b, "traced", NULL, NULL, NULL), 0);
  th_wait_ok(cons, "consumer");
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);

  n = load(lines, 4096);
  for (int i = 0; i < n; i++) {
    if (lines[i].pid == (int)D.pid && !strcmp(lines[i].what, "daemon-req16"))
      publish = i;
    if (lines[i].pid == (int)cons && !strcmp(lines[i].what, "read") && lines[i].dur_us > 50000)
      cons_read = i; /* the read that waited for the publish */
  }
  if (publish < 0 || cons_read < 0)
    fail_msg("no daemon Publish line (daemon pid %d) or no waiting consumer read (pid %d) among %d lines",
             (int)D.pid, (int)cons, n);
  /* The producer's side of that Publish: its event record (before the request went out) and
   * its wait for the reply (the rpc line with the request's sequence number, as the daemon's
   * line has): the daemon started on it after the first began and before the second ended. */
  for (int i = 0; i < n; i++) {
    if (lines[i].pid != (int)getpid())
      continue;
    if (!strcmp(lines[i].what, "record_ready") && lines[i].start_us <= lines[publish].start_us)
      rec = i;
    if (!strcmp(lines[i].what, "rpc") && lines[i].detail == lines[publish].detail)
      pub_rpc = i;
  }
  if (rec < 0 || pub_rpc < 0)
    fail_msg("the producer's trace has no record_ready before the daemon's Publish or no rpc line for request %llu",
             lines[publish].detail);
  assert_true(lines[publish].start_us <= lines[pub_rpc].start_us + lines[pub_rpc].dur_us);
  assert_true(lines[cons_read].start_us + lines[cons_read].dur_us >= lines[publish].start_us);
  assert_true(lines[cons_read].start_us <= lines[publish].start_us);
}

int main(void) {
  int rc;
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_trace_lines_up)};
  th_prepare(&D);
  snprintf(trace_path, sizeof trace_path, "%s/trace.txt", D.dir);
  /* Before any library call: the library reads it once per process. */
  setenv("GPUPOOL_TRACE", trace_path, 1);
  th_start(&D, 0, NULL);
  rc = cmocka_run_group_tests(tests, NULL, NULL);
  unlink(trace_path);
  th_stop(&D);
  return rc;
}
