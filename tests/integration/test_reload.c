/*
 * Reloading the configuration (SIGHUP, what `systemctl reload gpupoold` sends) under live
 * clients: holds, names and a waiting get survive it, a changed limit applies to the next
 * requests, keys that need a restart are reported and left alone, and a file that no longer
 * parses changes nothing and says why.
 */
#include "harness.h"

static th_daemon D;

#define POOL "[pool default]\nkind = host\ncapacity = 64M\nslab_size = 4M\n"

static int setup(void **state) {
  th_start_conf(&D, "[daemon]\nlisten_backlog = 64\n" POOL);
  *state = &D;
  return 0;
}

/* Times `what` occurs in the daemon's log. */
static int log_count(const char *what) {
  char buf[1 << 16];
  int n = 0;
  FILE *f = fopen(D.log, "r");
  if (!f)
    return 0;
  while (fgets(buf, sizeof buf, f))
    for (const char *p = buf; (p = strstr(p, what)); p += strlen(what))
      n++;
  fclose(f);
  return n;
}

/* The last log line holding `what` (into line). */
static void log_line(const char *what, char *line, size_t len) {
  char buf[4096];
  FILE *f = fopen(D.log, "r");
  line[0] = '\0';
  assert_non_null(f);
  while (fgets(buf, sizeof buf, f))
    if (strstr(buf, what))
      snprintf(line, len, "%s", buf);
  fclose(f);
}

/* SIGHUP, then wait until the log says the reload was done (or refused). */
static void reload_and_wait(const char *done) {
  int before = log_count(done);
  assert_int_equal(kill(D.pid, SIGHUP), 0);
  for (int i = 0; i < 1000 && log_count(done) == before; i++) {
    if (!ts_daemon_alive(&D)) {
      th_dump_log(&D);
      fail_msg("gpupoold exited on SIGHUP instead of reloading");
    }
    th_sleep_ms(10);
  }
  if (log_count(done) == before) {
    th_dump_log(&D);
    fail_msg("no '%s' in the log after SIGHUP", done);
  }
  assert_true(ts_daemon_alive(&D));
}

/* A new connection allocates up to `allowed` buffers; the next one is refused (allowed < 0:
 * no limit seen within 4). */
static void check_alloc_limit(int allowed) {
  gpupool_client *c = th_connect(&D, "limited");
  gpupool_buffer *b[5];
  int n = 0, rc = 0;
  while (n < 5 && (rc = gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b[n])) == 0)
    n++;
  if (allowed < 0) {
    assert_int_equal(n, 5);
  } else {
    assert_int_equal(n, allowed);
    assert_int_equal(rc, GPUPOOL_ELIMIT);
    assert_non_null(strstr(gpupool_last_error(), "max_allocs_per_client"));
  }
  gpupool_client_disconnect(c);
}

/* A child that waits for "later" to be published and checks what it holds. */
static pid_t start_waiter(void) {
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    gpupool_client *c;
    gpupool_buffer *g;
    if (gpupool_client_connect(D.sock, "waiter", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0)
      _exit(3);
    if (gpupool_buffer_get(c, "later", 0, -1, 0, NULL, &g, NULL) != 0)
      _exit(4);
    _exit(th_check(gpupool_buffer_ptr(g), 5, 4096) && gpupool_client_reconnect_count(c) == 0 ? 0 : 5);
  }
  return pid;
}

static void test_reload_keeps_clients(void **state) {
  gpupool_client *p = th_connect(&D, "producer"), *q = th_connect(&D, "consumer");
  gpupool_buffer *b, *later, *g, *g2;
  char line[4096];
  int st;
  pid_t waiter;
  (void)state;

  assert_int_equal(gpupool_buffer_alloc(p, NULL, 100000, 0, NULL, &b), 0);
  th_fill(gpupool_buffer_ptr(b), 9, 100000);
  assert_int_equal(gpupool_buffer_publish(b, "kept", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_get(q, "kept", 0, 0, 0, NULL, &g, NULL), 0);
  waiter = start_waiter();
  check_alloc_limit(-1);
  /* The waiter is connected (producer, consumer, waiter and the stats client itself). */
  for (int i = 0; i < 1000; i++) {
    gpupool_daemon_stats ds;
    th_stats(&D, &ds, NULL);
    if (ds.clients >= 4)
      break;
    th_sleep_ms(10);
  }

  /* A live limit, a key that needs a restart, and the pool as it was. */
  th_write_conf(&D, "[daemon]\nlisten_backlog = 128\nmax_allocs_per_client = 2\n" POOL);
  reload_and_wait("reloaded ");
  log_line("reloaded ", line, sizeof line);
  assert_non_null(strstr(line, "changed: max_allocs_per_client"));
  assert_non_null(strstr(line, "not changed until a restart: listen_backlog"));
  assert_null(strstr(line, "pools"));
  check_alloc_limit(2);

  /* Nothing was lost: the holds, the name, the waiting get. */
  assert_true(th_check(gpupool_buffer_ptr(g), 9, 100000));
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  assert_int_equal(gpupool_buffer_get(q, "kept", 0, 0, 0, NULL, &g2, NULL), 0);
  assert_true(th_check(gpupool_buffer_ptr(g2), 9, 100000));
  assert_false(gpupool_buffer_lost(b));
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 4096, 0, NULL, &later), 0);
  th_fill(gpupool_buffer_ptr(later), 5, 4096);
  assert_int_equal(gpupool_buffer_publish(later, "later", NULL, NULL, NULL), 0);
  assert_int_equal(ts_wait_pid(waiter, 30000, 1, &st), 0);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
  assert_int_equal(gpupool_client_reconnect_count(p), 0);
  assert_int_equal(gpupool_client_reconnect_count(q), 0);

  /* A file that no longer parses: nothing changes, and the log says why. */
  th_write_conf(&D, "[daemon]\nmax_allocs_per_client = lots\n" POOL);
  reload_and_wait("configuration not changed");
  log_line("configuration not changed", line, sizeof line);
  assert_non_null(strstr(line, "'lots' is not a number"));
  assert_non_null(strstr(line, "--check-config"));
  check_alloc_limit(2);
  assert_int_equal(gpupool_buffer_release(g2, NULL), 0);
  assert_int_equal(gpupool_buffer_get(q, "kept", 0, 0, 0, NULL, &g2, NULL), 0);

  /* Fixed again: the limit goes back to none. */
  th_write_conf(&D, "[daemon]\nlisten_backlog = 128\n" POOL);
  reload_and_wait("reloaded ");
  check_alloc_limit(-1);

  assert_int_equal(gpupool_buffer_release(g2, NULL), 0);
  assert_int_equal(gpupool_buffer_release(later, NULL), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(q);
  gpupool_client_disconnect(p);
}

/* A reload that brings a [tenant] or [group] covering no user says so in the log, with the
 * section's line, and still applies. */
static void test_reload_warns_empty_sets(void **state) {
  char line[4096];
  (void)state;
  th_write_conf(&D, "[daemon]\nlisten_backlog = 64\n" POOL "[group empty]\nexport_peers = *\n[group full]\nuids = 7\n");
  reload_and_wait("reloaded ");
  log_line("reloaded ", line, sizeof line);
  assert_non_null(strstr(line, "changed: groups"));
  log_line("has no uids", line, sizeof line);
  if (!strstr(line, "gpupoold.conf:7: [group empty] has no uids = or gids = line: it covers no user") ||
      log_count("[group full] has no") != 0) {
    th_dump_log(&D);
    fail_msg("no warning about [group empty] covering no user in the log: '%s'", line);
  }
}

int main(void) {
  return TS_RUN_TESTS(setup, th_teardown, test_reload_keeps_clients, test_reload_warns_empty_sets);
}
