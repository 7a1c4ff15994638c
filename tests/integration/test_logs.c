/*
 * What clients can make the daemon log: file publishes, connects and disconnects, refusals.
 * However many of those one client or many clients cause, the daemon's log (at info level)
 * grows by a number of lines bounded by the time that passes, not by the number of events, and
 * says how many lines it left out, also when nothing follows the flood.
 */
#include "harness.h"

/* The daemon's limits (common/log.h): per client 10 lines per 10 s, all clients together 200
 * per 10 s; each limit adds at most one "N more ... were not logged" line per interval. */
#define PER_CLIENT 10
#define ALL_CLIENTS 200
#define INTERVAL_S 10

static th_daemon D;
static char file[400];

static void start(void) {
  FILE *f;
  th_prepare(&D);
  th_write_conf(&D, "[pool default]\nkind = host\ncapacity = 16M\nslab_size = 4M\n");
  th_start(&D, 1, "--log-level", "info", NULL);
  snprintf(file, sizeof file, "%s/data.bin", D.dir);
  f = fopen(file, "w");
  assert_non_null(f);
  assert_int_equal(fputs("some bytes to publish\n", f) >= 0, 1);
  fclose(f);
}

static void stop(void) {
  unlink(file);
  th_stop(&D);
}

static long log_lines(void) {
  FILE *f = fopen(D.log, "r");
  long n = 0;
  int ch;
  assert_non_null(f);
  while ((ch = fgetc(f)) != EOF)
    n += ch == '\n';
  fclose(f);
  return n;
}

static int log_has(const char *needle) {
  FILE *f = fopen(D.log, "r");
  char line[2048];
  int found = 0;
  assert_non_null(f);
  while (!found && fgets(line, sizeof line, f))
    found = strstr(line, needle) != NULL;
  fclose(f);
  return found;
}

/* Waits (up to 3 intervals) for a line holding needle. */
static void expect_log(const char *needle) {
  for (int i = 0; i < 300 && !log_has(needle); i++)
    th_sleep_ms(100);
  if (!log_has(needle)) {
    th_dump_log(&D);
    fail_msg("the log never said '%s'", needle);
  }
}

/* Lines that `per_interval` lines (and a report) per interval allow over elapsed ms. */
static long bound(long per_interval, uint64_t elapsed_ms) {
  return ((long)(elapsed_ms / 1000 / INTERVAL_S) + 2) * (per_interval + 2);
}

static void check_growth(long before, uint64_t t0, long per_interval, const char *what) {
  long grew = log_lines() - before;
  long most = bound(per_interval, th_now_ms() - t0);
  if (grew > most) {
    fail_msg("%s grew the log by %ld lines in %.1f s; at most %ld expected", what, grew,
             (double)(th_now_ms() - t0) / 1000, most);
  }
  printf("%s: the log grew by %ld lines (bound %ld)\n", what, grew, most);
}

/* 20,000 file publish + unpublish cycles by one client. */
static void test_one_client_publishes(void **state) {
  gpupool_client *c;
  long before;
  uint64_t t0;
  (void)state;
  start();
  c = th_connect(&D, "publisher");
  before = log_lines();
  t0 = th_now_ms();
  for (int i = 0; i < 20000; i++) {
    if (gpupool_file_publish(c, "f", file, 0, 0, NULL) != 0 || gpupool_name_unpublish(c, "f") != 0)
      fail_msg("cycle %d: %s", i, gpupool_last_error());
  }
  check_growth(before, t0, PER_CLIENT, "20000 file publishes by one client");
  gpupool_client_disconnect(c);
  expect_log("more lines were not logged");
  stop();
}

/* 100 clients at once, 100 publish cycles each, then 2,000 connect/disconnect cycles: each
 * stays under its own limit for a while, so it is the daemon-wide limit that holds. */
static void test_many_clients(void **state) {
  enum { N = 100 };
  gpupool_client *cs[N];
  char name[32];
  long before;
  uint64_t t0;
  (void)state;
  start();
  before = log_lines();
  t0 = th_now_ms();
  for (int i = 0; i < N; i++)
    cs[i] = th_connect(&D, "many");
  for (int r = 0; r < 100; r++)
    for (int i = 0; i < N; i++) {
      snprintf(name, sizeof name, "f%d", i);
      if (gpupool_file_publish(cs[i], name, file, 0, 0, NULL) != 0 || gpupool_name_unpublish(cs[i], name) != 0)
        fail_msg("client %d cycle %d: %s", i, r, gpupool_last_error());
    }
  for (int i = 0; i < N; i++)
    gpupool_client_disconnect(cs[i]);
  for (int i = 0; i < 2000; i++)
    gpupool_client_disconnect(th_connect(&D, "cycle"));
  check_growth(before, t0, ALL_CLIENTS, "100 clients' 10000 publishes and 2000 connects");
  expect_log("more lines caused by clients were not logged");
  stop();
}

/* A client that goes quiet after a burst, still connected: its count is told all the same. */
static void test_count_told_without_further_event(void **state) {
  gpupool_client *c;
  char name[32];
  (void)state;
  start();
  c = th_connect(&D, "burst");
  for (int i = 0; i < 3 * PER_CLIENT; i++) {
    snprintf(name, sizeof name, "b%d", i);
    if (gpupool_file_publish(c, name, file, 0, 0, NULL) != 0)
      fail_msg("publish %d: %s", i, gpupool_last_error());
  }
  expect_log("more lines were not logged");
  gpupool_client_disconnect(c);
  stop();
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_one_client_publishes, test_many_clients, test_count_told_without_further_event);
}
