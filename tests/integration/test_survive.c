/*
 * Names, versions and memory survive a crash of the daemon: gpupoold --supervise keeps its fd
 * store (the slabs' memfds, the leases, the state) and starts it again after a kill -9. After
 * the restart every name is there at its version with its bytes, what live clients still map
 * stays valid and is not handed out again, versions go on from where they were, and once
 * everything is released the store holds no more than it did at the start.
 *
 * GPUPOOL_TEST_SURVIVE_NAMES (default 200) sets how many names test_crash_keeps_names
 * publishes (1000 and 10000 run here in seconds too); it prints how long the new daemon took
 * from its start to the first get it served.
 */
#include <dirent.h>
#include <sys/stat.h>

#include "harness.h"

static th_daemon D;
#define POOL "name=default,kind=host,capacity=512M,slab=4M,keep=0"

static int setup(void **state) {
  *state = &D;
  th_prepare(&D);
  /* Crashes here come one after the other on purpose: restart each at once. */
  setenv("GPUPOOL_SUPERVISE_MAX_DELAY_MS", "50", 1);
  /* Writes at most every 20 ms, deltas compacted after 200 ms with nothing to write: the store
   * settles within settled_store's wait. */
  setenv("GPUPOOL_TEST_STATE_EVERY_MS", "20", 0);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (D.pid)
    th_stop(&D);
  return 0;
}

static int count_fds(pid_t pid) {
  char path[64];
  int n = 0;
  DIR *d;
  struct dirent *e;
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  if (!(d = opendir(path)))
    return -1;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n;
}

/* Wait for a daemon other than `old` to run under the supervisor and accept connections. */
static pid_t wait_restarted(pid_t old) {
  uint64_t end = th_now_ms() + 10000;
  while (th_now_ms() < end) {
    pid_t c = ts_child_of(D.pid);
    if (c && c != old && th_can_connect(D.sock))
      return c;
    th_sleep_ms(5);
  }
  th_dump_log(&D);
  fail_msg("the supervisor did not start the daemon again within 10 s");
  return 0;
}

static pid_t start_supervised(void) {
  pid_t c;
  uint64_t end = th_now_ms() + 5000;
  /* Room for GPUPOOL_TEST_SURVIVE_NAMES=10000 names. */
  th_write_conf(&D, "[daemon]\nmax_names = 20000\nmax_names_per_uid = 20000\n");
  th_start(&D, 1, "--supervise", "--pool", POOL, NULL);
  while (!(c = ts_child_of(D.pid)) && th_now_ms() < end)
    th_sleep_ms(5);
  assert_true(c > 0);
  return c;
}

static pid_t crash(pid_t daemon) {
  assert_int_equal(kill(daemon, SIGKILL), 0);
  return wait_restarted(daemon);
}

/* The supervisor's fds once they stop changing (its store settles after the daemon's writes). */
static int settled_store(void) {
  const char *e = getenv("GPUPOOL_TEST_STATE_EVERY_MS");
  /* Unchanged for longer than the daemon waits, with nothing to write, before it compacts. */
  int last = -1, same = 0, need = ((e && *e ? atoi(e) : 100) * 10 + 100) / 20;
  for (int i = 0; i < 1000 && same < need; i++) {
    int n = count_fds(D.pid);
    same = n == last ? same + 1 : 0;
    last = n;
    th_sleep_ms(20);
  }
  return last;
}

static uint64_t name_size(int i) { return 1000 + (uint64_t)(i * 131) % 20000; }
static uint32_t name_seed(int i, uint64_t version) { return (uint32_t)i * 7 + (uint32_t)version * 100003u; }

/* Name n<i> is at want_version and holds the bytes seed made. */
static void check_name_seed(gpupool_client *c, int i, uint64_t want_version, uint32_t seed) {
  char name[32];
  gpupool_buffer *g;
  uint64_t v = 0;
  snprintf(name, sizeof name, "n%d", i);
  if (gpupool_buffer_get(c, name, 0, 0, GPUPOOL_READ_ONLY, NULL, &g, &v) != 0) {
    th_dump_log(&D);
    fail_msg("get %s: %s", name, gpupool_last_error());
  }
  assert_int_equal(v, want_version);
  assert_true(gpupool_buffer_size(g) >= name_size(i));
  assert_true(th_check(gpupool_buffer_ptr(g), seed, name_size(i)));
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
}

static void check_name(gpupool_client *c, int i, uint64_t want_version) {
  check_name_seed(c, i, want_version, name_seed(i, want_version));
}

static void publish(gpupool_client *p, int i, uint64_t want_version) {
  char name[32];
  gpupool_buffer *b;
  uint64_t v = 0;
  snprintf(name, sizeof name, "n%d", i);
  if (gpupool_buffer_alloc(p, NULL, name_size(i), 0, NULL, &b) != 0)
    fail_msg("alloc for %s: %s", name, gpupool_last_error());
  th_fill(gpupool_buffer_ptr(b), name_seed(i, want_version), name_size(i));
  if (gpupool_buffer_publish(b, name, NULL, NULL, &v) != 0)
    fail_msg("publish %s: %s", name, gpupool_last_error());
  assert_int_equal(v, want_version);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
}

#define NB 3
static void publish_bundle(gpupool_client *p, int j, uint32_t seed, uint64_t *version) {
  gpupool_member_spec specs[NB];
  char names[NB][16], name[32];
  gpupool_bundle *b;
  for (int k = 0; k < NB; k++) {
    snprintf(names[k], sizeof names[k], "m%d", k);
    specs[k] = (gpupool_member_spec){.name = names[k], .size = 4096 + (uint64_t)k * 1000 + (uint64_t)j, .meta = NULL};
  }
  assert_int_equal(gpupool_bundle_alloc(p, NULL, specs, NB, 0, 0, NULL, &b), 0);
  for (int k = 0; k < NB; k++) {
    gpupool_member m;
    assert_int_equal(gpupool_bundle_member(b, k, &m), 0);
    th_fill(m.ptr, seed + (uint32_t)k, m.size);
  }
  snprintf(name, sizeof name, "b%d", j);
  assert_int_equal(gpupool_bundle_publish(b, name, NULL, version), 0);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
}

static void check_bundle(gpupool_client *c, int j, uint32_t seed, uint64_t version) {
  char name[32];
  gpupool_bundle *b;
  snprintf(name, sizeof name, "b%d", j);
  assert_int_equal(gpupool_bundle_get(c, name, 0, 0, GPUPOOL_READ_ONLY, NULL, &b), 0);
  assert_int_equal(gpupool_bundle_version(b), version);
  assert_int_equal(gpupool_bundle_count(b), NB);
  for (int k = 0; k < NB; k++) {
    gpupool_member m;
    assert_int_equal(gpupool_bundle_member(b, k, &m), 0);
    assert_int_equal(m.size, 4096 + (uint64_t)k * 1000 + (uint64_t)j);
    assert_true(th_check(m.ptr, seed + (uint32_t)k, m.size));
  }
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
}

static int env_int(const char *name, int def) {
  const char *e = getenv(name);
  return e && *e ? atoi(e) : def;
}

/* kill -9 while clients hold and map memory: names, versions and bundles come back
 * bit-exact, holders' mappings stay valid, nothing they map is handed out again, versions go on,
 * and after everything is released the store is back where it started. */
static void test_crash_keeps_names(void **state) {
  int n = env_int("GPUPOOL_TEST_SURVIVE_NAMES", 200), nb = n / 50 + 1, base;
  uint64_t base_fds;
  pid_t daemon = start_supervised();
  gpupool_client *p, *q, *r;
  gpupool_buffer *g, *h, *fill[64];
  uint64_t *ver = calloc((size_t)n, sizeof *ver), t0, t1, bver = 0;
  char lost[4][GPUPOOL_NAME_MAX + 1];
  int nlost = 0;
  (void)state;
  assert_non_null(ver);

  r = th_connect(&D, "baseline");
  gpupool_client_disconnect(r);
  base = settled_store();
  base_fds = th_settled_fds(&D);

  p = th_connect(&D, "producer");
  q = th_connect(&D, "holder");
  t0 = th_now_ms();
  for (int i = 0; i < n; i++) {
    ver[i] = 1;
    publish(p, i, 1);
    if (i % 10 == 0)
      publish(p, i, ++ver[i]);
  }
  for (int j = 0; j < nb; j++)
    publish_bundle(p, j, 5000u + (uint32_t)j * 10u, &bver);
  assert_int_equal(bver, 1);
  /* A reader holds a version; the producer holds memory no name refers to. */
  assert_int_equal(gpupool_buffer_get(q, "n1", 0, 0, 0, NULL, &g, NULL), 0);
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 300000, 0, NULL, &h), 0);
  th_fill(gpupool_buffer_ptr(h), 77, 300000);
  /* Holds are written at most every 100 ms (names before every reply): let that write happen,
   * so they are given back. (One made in the last moments before a crash is reported lost,
   * and its memory is still never handed out under it: test_crash_cycles crashes at once.) */
  th_sleep_ms(250);

  print_message("published %d names (%d twice) and %d bundles in %llu ms\n", n, (n + 9) / 10, nb,
                (unsigned long long)(th_now_ms() - t0));
  t0 = th_now_ms();
  daemon = crash(daemon);
  t1 = th_now_ms();
  r = th_connect(&D, "reader");
  check_name(r, n - 1, ver[n - 1]);
  print_message("restart with %d names: %llu ms from kill -9 to the new daemon accepting (restart delay "
                "included), %llu ms more to the first get served\n", n, (unsigned long long)(t1 - t0),
                (unsigned long long)(th_now_ms() - t1));
  {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "grep -o 'restored state .* in [0-9.]* ms: [0-9]* name(s)' %s | tail -n 1", D.log);
    if (system(cmd) != 0)
      fail_msg("the daemon's log does not say what it restored");
  }
  for (int i = 0; i < n; i++)
    check_name(r, i, ver[i]);
  for (int j = 0; j < nb; j++)
    check_bundle(r, j, 5000u + (uint32_t)j * 10u, 1);
  /* What the live clients map is intact, and stays so while others allocate around it. */
  assert_true(th_check(gpupool_buffer_ptr(g), name_seed(1, 1), name_size(1)));
  assert_true(th_check(gpupool_buffer_ptr(h), 77, 300000));
  for (int k = 0; k < 64; k++) {
    assert_int_equal(gpupool_buffer_alloc(r, NULL, 4000 + (uint64_t)k * 997, 0, NULL, &fill[k]), 0);
    th_fill(gpupool_buffer_ptr(fill[k]), 99, 4000 + (uint64_t)k * 997);
  }
  assert_true(th_check(gpupool_buffer_ptr(h), 77, 300000));
  assert_true(th_check(gpupool_buffer_ptr(g), name_seed(1, 1), name_size(1)));
  for (int k = 0; k < 64; k++)
    assert_int_equal(gpupool_buffer_release(fill[k], NULL), 0);

  /* Holds come back on reconnection (the daemon gave each connection a secret to claim them):
   * the reader's hold on n1 and the producer's unnamed buffer are theirs again, usable. */
  check_name(q, 2, ver[2]); /* (their first requests since the crash: they reconnect) */
  check_name(p, 3, ver[3]);
  assert_false(gpupool_buffer_lost(g));
  if (gpupool_buffer_publish(h, "h-after", NULL, NULL, NULL) != 0) {
    th_dump_log(&D);
    fail_msg("publish of a buffer held again: %s", gpupool_last_error());
  }
  assert_false(gpupool_buffer_lost(h));
  {
    gpupool_buffer *hh;
    assert_int_equal(gpupool_buffer_get(r, "h-after", 0, 0, GPUPOOL_READ_ONLY, NULL, &hh, NULL), 0);
    assert_true(th_check(gpupool_buffer_ptr(hh), 77, 300000));
    assert_int_equal(gpupool_buffer_release(hh, NULL), 0);
    assert_int_equal(gpupool_name_unpublish(r, "h-after"), 0);
  }
  /* Versions go forward: the next publish of a name is the one after what it had. */
  publish(p, 0, ver[0] + 1);
  ver[0]++;
  publish_bundle(p, 0, 5000u, &bver);
  assert_int_equal(bver, 2);
  check_name(r, 0, ver[0]);
  /* Nothing the producer published was lost: the new daemon has it all. */
  assert_int_equal(gpupool_client_lost_names(p, lost, 4, &nlost), 0);
  assert_int_equal(nlost, 0);

  /* Everything released: the daemon and the store go back to where they were. */
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  assert_int_equal(gpupool_buffer_release(h, NULL), 0);
  gpupool_client_disconnect(q);
  gpupool_client_disconnect(p);
  for (int i = 0; i < n; i++) {
    char name[32];
    snprintf(name, sizeof name, "n%d", i);
    assert_int_equal(gpupool_name_unpublish(r, name), 0);
  }
  for (int j = 0; j < nb; j++) {
    char name[32];
    snprintf(name, sizeof name, "b%d", j);
    assert_int_equal(gpupool_name_unpublish(r, name), 0);
  }
  gpupool_client_disconnect(r);
  th_wait_idle(&D, 5000);
  /* The new daemon holds as many fds as the first did before anything was published. */
  th_expect_fds(&D, base_fds);
  if (settled_store() != base) {
    th_dump_log(&D);
    fail_msg("the supervisor holds %d fds, %d at the start: the store kept what was released", count_fds(D.pid),
             base);
  }
  free(ver);
  th_stop(&D);
}

static uint64_t pool_used(gpupool_client *c) {
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps[4];
  int n = 0;
  assert_int_equal(gpupool_client_stats(c, &ds, ps, 4, &n), 0);
  assert_true(n >= 1);
  return ps[0].used;
}

/* Holds taken back after a crash are released for real, whether the holder reconnected before
 * letting go (its holds are back, not lost) or let go first, while it had not yet noticed the
 * crash (its releases stay local; the new daemon gives the holds back at the next request,
 * and the library must release them then): in both cases the pool is empty once the names are
 * gone, with both holders still connected. One hold is on a version a later publish replaced. */
static void test_holds_released_after_restart(void **state) {
  gpupool_client *p, *q, *q2, *r;
  gpupool_buffer *g[4], *g2[4];
  uint64_t used = 1;
  pid_t daemon = start_supervised();
  (void)state;
  p = th_connect(&D, "producer");
  q = th_connect(&D, "holder");
  q2 = th_connect(&D, "holder-2");
  for (int i = 0; i < 4; i++)
    publish(p, i, 1);
  publish(p, 0, 2);
  for (int i = 0; i < 4; i++) {
    char name[32];
    snprintf(name, sizeof name, "n%d", i);
    assert_int_equal(gpupool_buffer_get(q, name, 0, 0, GPUPOOL_READ_ONLY, NULL, &g[i], NULL), 0);
    assert_int_equal(gpupool_buffer_get(q2, name, 0, 0, 0, NULL, &g2[i], NULL), 0);
  }
  th_sleep_ms(250); /* the holds reach the store */
  daemon = crash(daemon);
  r = th_connect(&D, "reader");
  check_name(r, 1, 1);
  (void)pool_used(q); /* q's first request since the crash: it reconnects and takes its holds back */
  for (int i = 0; i < 4; i++)
    assert_false(gpupool_buffer_lost(g[i]));
  /* q2 lets go before it has talked to the new daemon. */
  for (int i = 0; i < 4; i++)
    assert_int_equal(gpupool_buffer_release(g2[i], NULL), 0);
  publish(p, 0, 3);
  for (int i = 0; i < 4; i++) {
    char name[32];
    if (gpupool_buffer_release(g[i], NULL) != 0)
      fail_msg("release of hold %d taken back after the restart: %s", i, gpupool_last_error());
    snprintf(name, sizeof name, "n%d", i);
    assert_int_equal(gpupool_name_unpublish(p, name), 0);
  }
  (void)pool_used(q2); /* q2 reconnects: the holds the daemon gives back are released */
  for (int i = 0; i < 250 && (used = pool_used(r)) != 0; i++)
    th_sleep_ms(20);
  if (used != 0) {
    th_dump_log(&D);
    fail_msg("%llu bytes still in use after both holders released every hold (they are still connected)",
             (unsigned long long)used);
  }
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(q2);
  gpupool_client_disconnect(q);
  gpupool_client_disconnect(p);
  (void)daemon;
  th_stop(&D);
}

/* Kept shares are tokens in flight (a tensor pickled into a queue): they open after a crash
 * of the daemon as before it, read-only ones read-only, each once; one opened before the crash
 * does not open again; those made after the restart (written as deltas) survive the next crash;
 * one whose share_keep_ms passes is gone, whether it passed while no daemon ran or after. */
static void test_kept_shares_survive(void **state) {
  gpupool_client *p, *q, *r;
  gpupool_buffer *a, *b, *ro, *got, *late;
  gpupool_token ta, tb, tc, td, te;
  uint64_t used = 1;
  pid_t c;
  uint64_t end = th_now_ms() + 5000;
  (void)state;
  th_write_conf(&D, "[daemon]\nshare_keep_ms = 4000\n");
  th_start(&D, 1, "--supervise", "--pool", POOL, NULL);
  while (!(c = ts_child_of(D.pid)) && th_now_ms() < end)
    th_sleep_ms(5);
  assert_true(c > 0);
  p = th_connect(&D, "producer");
  q = th_connect(&D, "reader");
  /* A: shared kept, then released by its maker: only the kept share holds it. */
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 50000, 0, NULL, &a), 0);
  th_fill(gpupool_buffer_ptr(a), 11, 50000);
  assert_int_equal(gpupool_buffer_share_kept(a, NULL, &ta), 0);
  /* B: published; the reader's read-only hold shared kept. */
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 30000, 0, NULL, &b), 0);
  th_fill(gpupool_buffer_ptr(b), 22, 30000);
  assert_int_equal(gpupool_buffer_publish(b, "kb", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_get(q, "kb", 0, 0, GPUPOOL_READ_ONLY, NULL, &ro, NULL), 0);
  assert_int_equal(gpupool_buffer_share_kept(ro, NULL, &tb), 0);
  /* C: opened before the crash. */
  assert_int_equal(gpupool_buffer_share_kept(a, NULL, &tc), 0);
  assert_int_equal(gpupool_buffer_open(q, &tc, 0, NULL, &got), 0);
  assert_int_equal(gpupool_buffer_release(got, NULL), 0);
  /* E: short-lived relative to the downtime below. */
  assert_int_equal(gpupool_buffer_share_kept(b, NULL, &te), 0);
  assert_int_equal(gpupool_buffer_release(a, NULL), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  assert_int_equal(gpupool_buffer_release(ro, NULL), 0);
  gpupool_client_disconnect(q);
  th_sleep_ms(250); /* written */
  c = crash(c);

  r = th_connect(&D, "opener");
  if (gpupool_buffer_open(r, &ta, 0, NULL, &got) != 0) {
    th_dump_log(&D);
    fail_msg("a kept share made before the crash does not open after it: %s", gpupool_last_error());
  }
  assert_false(gpupool_buffer_read_only(got));
  assert_true(th_check(gpupool_buffer_ptr(got), 11, 50000));
  assert_int_equal(gpupool_buffer_release(got, NULL), 0);
  assert_int_not_equal(gpupool_buffer_open(r, &ta, 0, NULL, &got), 0); /* once */
  assert_int_not_equal(gpupool_buffer_open(r, &tc, 0, NULL, &got), 0); /* opened before */
  assert_int_equal(gpupool_buffer_open(r, &tb, 0, NULL, &got), 0);
  assert_true(gpupool_buffer_read_only(got));
  assert_true(th_check(gpupool_buffer_ptr(got), 22, 30000));
  assert_int_equal(gpupool_buffer_release(got, NULL), 0);
  {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "grep -q 'lease(s) of earlier clients, 3 kept share(s)' %s", D.log);
    if (system(cmd) != 0) {
      th_dump_log(&D);
      fail_msg("the log does not say that 3 kept shares were restored");
    }
  }

  /* D: made after the restart (a delta on the state the restart wrote), then a second crash. */
  assert_int_equal(gpupool_buffer_get(p, "kb", 0, 0, 0, NULL, &late, NULL), 0);
  assert_int_equal(gpupool_buffer_share_kept(late, NULL, &td), 0);
  assert_int_equal(gpupool_buffer_release(late, NULL), 0);
  th_sleep_ms(250);
  c = crash(c);
  assert_int_equal(gpupool_buffer_open(r, &td, 0, NULL, &got), 0);
  assert_true(th_check(gpupool_buffer_ptr(got), 22, 30000));
  assert_int_equal(gpupool_buffer_release(got, NULL), 0);
  /* E expires 4 s after it was made, restored or not. */
  th_sleep_ms(4200);
  assert_int_not_equal(gpupool_buffer_open(r, &te, 0, NULL, &got), 0);

  assert_int_equal(gpupool_name_unpublish(p, "kb"), 0);
  for (int i = 0; i < 250; i++) {
    used = pool_used(r);
    if (used == 0)
      break;
    th_sleep_ms(20);
  }
  assert_int_equal(used, 0);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(p);
  th_stop(&D);
}

/* A state of format 2 (before kept shares), with deltas after it, is read by this daemon: a
 * daemon writing format 2 (GPUPOOL_TEST_STATE_FORMAT=2, as the previous release did) publishes,
 * holds and shares, crashes, and the next one restores every name from the older format. */
static pid_t start_env(const char *const *env);
static void log_has(const char *pattern);

static void test_older_format_read(void **state) {
  static const char *const env[] = {"GPUPOOL_TEST_STATE_FORMAT", "2", NULL};
  gpupool_client *p, *r;
  gpupool_buffer *h;
  gpupool_token t;
  pid_t c = start_env(env);
  (void)state;
  p = th_connect(&D, "producer");
  publish(p, 0, 1);
  th_sleep_ms(400); /* a whole state, compacted */
  publish(p, 1, 1); /* and deltas after it */
  publish(p, 0, 2);
  assert_int_equal(gpupool_buffer_alloc(p, NULL, 5000, 0, NULL, &h), 0);
  assert_int_equal(gpupool_buffer_share_kept(h, NULL, &t), 0); /* (format 2 cannot keep it) */
  th_sleep_ms(50);
  c = crash(c);
  log_has("restored state [0-9]+ \\(format 2\\) and [1-9][0-9]* delta\\(s\\) after it in [0-9.]+ ms: 2 name\\(s\\)");
  r = th_connect(&D, "reader");
  check_name(r, 0, 2);
  check_name(r, 1, 1);
  assert_int_equal(gpupool_buffer_release(h, NULL), 0);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(p);
  (void)c;
  th_stop(&D);
}

/* Crash after crash, each with a new version: nothing leaks in the store or the daemon. */
static void test_crash_cycles(void **state) {
  int cycles = env_int("GPUPOOL_TEST_SURVIVE_CYCLES", 15), base = 0;
  pid_t daemon = start_supervised();
  gpupool_client *p;
  (void)state;
  p = th_connect(&D, "producer");
  publish(p, 0, 1);
  for (int k = 0; k < cycles; k++) {
    daemon = crash(daemon);
    check_name(p, 0, (uint64_t)k + 1);
    publish(p, 0, (uint64_t)k + 2);
    if (k == 1)
      base = settled_store();
    else if (k > 1 && settled_store() != base) {
      th_dump_log(&D);
      fail_msg("cycle %d: the supervisor holds %d fds, %d after the second", k, count_fds(D.pid), base);
    }
  }
  check_name(p, 0, (uint64_t)cycles + 1);
  assert_int_equal(gpupool_name_unpublish(p, "n0"), 0);
  gpupool_client_disconnect(p);
  th_wait_idle(&D, 5000);
  th_stop(&D);
}

static char flag_path[400];
static int crash_env(void *arg) {
  char v[512];
  int step = *(int *)arg;
  snprintf(v, sizeof v, "%d:%s", step, flag_path);
  /* Steps 1-4 are those of a whole state: every write is one (no deltas). */
  if (step <= 4 && setenv("GPUPOOL_TEST_STATE_DELTAS", "0", 1) != 0)
    return -1;
  return setenv("GPUPOOL_TEST_STATE_CRASH", v, 1);
}

/* A crash at each step of a state write: the next daemon finds the version before the write
 * or the one after it, whole, never a mix. */
static void test_crash_inside_state_write(void **state) {
  (void)state;
  for (int step = 1; step <= 4; step++) {
    const char *extra[] = {"--supervise", "--pool", POOL, NULL};
    ts_daemon_opts o = {.gpupoold = GPUPOOLD_PATH, .backend = "host", .log_level = "debug", .extra = extra,
                        .ready_ms = 5000, .poll_ms = 10, .hook = crash_env, .hook_arg = &step};
    gpupool_client *p, *r;
    gpupool_buffer *b;
    pid_t daemon;
    uint64_t end;
    int fd;
    if (step > 1)
      th_prepare(&D); /* (th_stop removed the last one's dir) */
    snprintf(flag_path, sizeof flag_path, "%s/crash-now", D.dir);
    th_start_opts(&D, &o);
    end = th_now_ms() + 5000;
    while (!(daemon = ts_child_of(D.pid)) && th_now_ms() < end)
      th_sleep_ms(5);
    p = th_connect(&D, "producer");
    publish(p, 0, 1);
    assert_int_equal(gpupool_buffer_alloc(p, NULL, name_size(0), 0, NULL, &b), 0);
    th_fill(gpupool_buffer_ptr(b), name_seed(0, 2), name_size(0));
    th_sleep_ms(50); /* idle: no write is due */
    fd = open(flag_path, O_CREAT | O_WRONLY | O_EXCL, 0600);
    assert_true(fd >= 0);
    close(fd);
    /* The write this publish causes (before its reply) dies at `step`. */
    (void)gpupool_buffer_publish(b, "n0", NULL, NULL, NULL);
    (void)gpupool_buffer_release(b, NULL);
    daemon = wait_restarted(daemon);
    r = th_connect(&D, "reader");
    /* Steps 1-3 die before the new state is in the store: version 1; step 4 after: version 2. */
    check_name(r, 0, step == 4 ? 2 : 1);
    gpupool_client_disconnect(r);
    gpupool_client_disconnect(p);
    {
      char cmd[600];
      snprintf(cmd, sizeof cmd, "grep -q 'killing the daemon at step %d of state write' %s", step, D.log);
      assert_int_equal(system(cmd), 0);
    }
    th_stop(&D);
  }
}

/* What does not check out is discarded piece by piece: a pool taken out of the configuration
 * before the restart loses its slabs and the names in them, with the reason in the log and the
 * survival line; the other pool's names are all there, and the client is told exactly which
 * of its names were lost. */
static void test_discard_piece_by_piece(void **state) {
  gpupool_client *p;
  gpupool_buffer *b;
  pid_t daemon;
  uint64_t end;
  char lost[8][GPUPOOL_NAME_MAX + 1], cmd[600];
  int nlost = 0;
  (void)state;
  th_write_conf(&D, "[pool a]\nkind = host\ncapacity = 64M\nslab_size = 4M\n"
                    "[pool b]\nkind = host\ncapacity = 64M\nslab_size = 4M\n");
  th_start(&D, 1, "--supervise", NULL);
  end = th_now_ms() + 5000;
  while (!(daemon = ts_child_of(D.pid)) && th_now_ms() < end)
    th_sleep_ms(5);
  p = th_connect(&D, "producer");
  for (int i = 0; i < 4; i++) {
    char name[32];
    snprintf(name, sizeof name, "n%d", i);
    assert_int_equal(gpupool_buffer_alloc(p, i < 2 ? "a" : "b", name_size(i), 0, NULL, &b), 0);
    th_fill(gpupool_buffer_ptr(b), name_seed(i, 1), name_size(i));
    assert_int_equal(gpupool_buffer_publish(b, name, NULL, NULL, NULL), 0);
    assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  }
  /* The operator drops pool b, then the daemon crashes: the next one reads the new file. */
  th_write_conf(&D, "[pool a]\nkind = host\ncapacity = 64M\nslab_size = 4M\n");
  daemon = crash(daemon);
  check_name(p, 0, 1);
  check_name(p, 1, 1);
  assert_int_equal(gpupool_buffer_get(p, "n2", 0, 0, 0, NULL, &b, NULL), GPUPOOL_ENOENT);
  assert_int_equal(gpupool_client_lost_names(p, lost, 8, &nlost), 0);
  assert_int_equal(nlost, 2);
  assert_true((!strcmp(lost[0], "n2") && !strcmp(lost[1], "n3")) || (!strcmp(lost[0], "n3") && !strcmp(lost[1], "n2")));
  snprintf(cmd, sizeof cmd, "grep -q \"restore: slab [0-9]*: pool 'b' is no longer configured\" %s", D.log);
  assert_int_equal(system(cmd), 0);
  snprintf(cmd, sizeof cmd, "grep -q 'restored state .* 2 name(s), .* discarded: 2 name(s), 1 slab(s)' %s", D.log);
  assert_int_equal(system(cmd), 0);
  gpupool_client_disconnect(p);
  th_stop(&D);
}

static int newer_env(void *arg) {
  (void)arg;
  return setenv("GPUPOOL_TEST_STATE_FORMAT", "99", 1);
}

/* A state from a newer daemon is refused, not discarded: the daemon says which formats and
 * what to do, and exits 2 (the supervisor, like systemd's RestartPreventExitStatus=2, stops). */
static void test_newer_state_refused(void **state) {
  const char *extra[] = {"--supervise", "--pool", POOL, NULL};
  ts_daemon_opts o = {.gpupoold = GPUPOOLD_PATH, .backend = "host", .log_level = "debug", .extra = extra,
                      .ready_ms = 5000, .poll_ms = 10, .hook = newer_env, .append_log = 1};
  gpupool_client *p;
  pid_t daemon;
  int status = 0;
  uint64_t end;
  char cmd[600];
  (void)state;
  th_start_opts(&D, &o);
  end = th_now_ms() + 5000;
  while (!(daemon = ts_child_of(D.pid)) && th_now_ms() < end)
    th_sleep_ms(5);
  p = th_connect(&D, "producer");
  publish(p, 0, 1);
  gpupool_client_disconnect(p);
  assert_int_equal(kill(daemon, SIGKILL), 0);
  assert_int_equal(ts_wait_pid(D.pid, 10000, 1, &status), 0);
  th_track(D.pid, 0);
  D.pid = 0;
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 2);
  snprintf(cmd, sizeof cmd, "grep -q 'in format 99, written by a newer gpupoold; this one .* reads formats up to 3' %s",
           D.log);
  assert_int_equal(system(cmd), 0);
}

/* ---- deltas ------------------------------------------------------------------------------ */

static int set_env_pairs(void *arg) {
  for (const char *const *e = arg; e && e[0]; e += 2)
    if (setenv(e[0], e[1], 1) != 0)
      return -1;
  return 0;
}

/* The daemon under its supervisor with env (NAME, VALUE, ..., NULL) set; its pid. */
static pid_t start_env(const char *const *env) {
  const char *extra[] = {"--supervise", "--pool", POOL, NULL};
  ts_daemon_opts o = {.gpupoold = GPUPOOLD_PATH, .backend = "host", .log_level = "debug", .extra = extra,
                      .ready_ms = 5000, .poll_ms = 10, .hook = set_env_pairs, .hook_arg = (void *)env,
                      .use_conf = 1};
  uint64_t end;
  pid_t c;
  th_write_conf(&D, "[daemon]\nmax_names = 20000\nmax_names_per_uid = 20000\n");
  th_start_opts(&D, &o);
  end = th_now_ms() + 5000;
  while (!(c = ts_child_of(D.pid)) && th_now_ms() < end)
    th_sleep_ms(5);
  assert_true(c > 0);
  return c;
}

static void log_has(const char *pattern) {
  char cmd[800];
  snprintf(cmd, sizeof cmd, "grep -q -E '%s' %s", pattern, D.log);
  if (system(cmd) != 0) {
    th_dump_log(&D);
    fail_msg("the daemon's log has no line matching: %s", pattern);
  }
}

/* n buffers for names n0.. allocated and filled, then time for their holds to be written: what
 * is published from here on (the same buffers) goes into deltas of its own. */
static void alloc_then_settle(gpupool_client *p, gpupool_buffer **b, int n) {
  for (int i = 0; i < n; i++) {
    assert_int_equal(gpupool_buffer_alloc(p, NULL, name_size(i), 0, NULL, &b[i]), 0);
    th_fill(gpupool_buffer_ptr(b[i]), name_seed(i, 1), name_size(i));
  }
  th_sleep_ms(300);
}

static void publish_held(gpupool_buffer *b, int i, uint64_t want_version) {
  char name[32];
  uint64_t v = 0;
  snprintf(name, sizeof name, "n%d", i);
  if (gpupool_buffer_publish(b, name, NULL, NULL, &v) != 0)
    fail_msg("publish %s: %s", name, gpupool_last_error());
  assert_int_equal(v, want_version);
}

/* Publishes and unpublishes written only as deltas come back after kill -9, bit-exact: every
 * name at its version with its bytes, the one taken out gone, nothing lost to the client.
 * GPUPOOL_TEST_SURVIVE_DELTAS (default 16) sets how many names; the restore's line is printed. */
static void test_deltas_replayed(void **state) {
  const char *env[] = {"GPUPOOL_TEST_STATE_EVERY_MS", "60000", NULL}; /* (no compaction when idle) */
  int N = env_int("GPUPOOL_TEST_SURVIVE_DELTAS", 16);
  gpupool_buffer **b = calloc((size_t)N, sizeof *b);
  gpupool_client *p, *r;
  char lost[4][GPUPOOL_NAME_MAX + 1];
  int nlost = -1;
  pid_t daemon = start_env(env);
  char last[32], cmd[600];
  (void)state;
  assert_non_null(b);
  assert_true(N >= 2);
  p = th_connect(&D, "producer");
  publish(p, 100000, 1);
  alloc_then_settle(p, b, N);
  for (int i = 0; i < N; i++)
    publish_held(b[i], i, 1);
  for (int i = 0; i < N; i += 4)
    publish_held(b[i], i, 2); /* (a new version of the same bytes) */
  snprintf(last, sizeof last, "n%d", N - 1);
  assert_int_equal(gpupool_name_unpublish(p, last), 0);
  daemon = crash(daemon);
  log_has("restored state [0-9]+ \\(format 3\\) and [1-9][0-9]* delta\\(s\\) after it");
  snprintf(cmd, sizeof cmd, "grep -o 'restored state .* in [0-9.]* ms: [0-9]* name(s)' %s | tail -n 1", D.log);
  if (system(cmd) != 0)
    fail_msg("the daemon's log does not say what it restored");
  r = th_connect(&D, "reader");
  check_name(r, 100000, 1);
  for (int i = 0; i < N - 1; i++)
    check_name_seed(r, i, i % 4 == 0 ? 2 : 1, name_seed(i, 1));
  {
    gpupool_buffer *g;
    assert_int_equal(gpupool_buffer_get(r, last, 0, 0, 0, NULL, &g, NULL), GPUPOOL_ENOENT);
  }
  /* Versions go on from there (the producer's first request since the crash reconnects it),
   * and its holds, written in deltas too, are its own again. */
  check_name_seed(p, 1, 1, name_seed(1, 1));
  for (int i = 0; i < N; i++)
    assert_false(gpupool_buffer_lost(b[i]));
  publish_held(b[0], 0, 3);
  assert_int_equal(gpupool_client_lost_names(p, lost, 4, &nlost), 0);
  assert_int_equal(nlost, 0);
  for (int i = 0; i < N; i++)
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  free(b);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(p);
  th_stop(&D);
}

/* A crash at each step of a delta's write (5: half written, 6: written, 7: sealed, 8: in the
 * store) and inside a compaction (9: the new whole state in the store, the previous one's
 * deltas taken out, the previous state not yet): the next daemon has the version before the
 * change or the one after, never a mix. */
static void test_crash_inside_delta_write(void **state) {
  (void)state;
  for (int step = 5; step <= 9; step++) {
    char v[512];
    const char *env[] = {"GPUPOOL_TEST_STATE_CRASH", v, NULL};
    gpupool_client *p, *r;
    gpupool_buffer *b;
    pid_t daemon;
    int fd;
    if (step > 5)
      th_prepare(&D);
    snprintf(flag_path, sizeof flag_path, "%s/crash-now", D.dir);
    snprintf(v, sizeof v, "%d:%s", step, flag_path);
    daemon = start_env(env);
    p = th_connect(&D, "producer");
    publish(p, 0, 1);
    assert_int_equal(gpupool_buffer_alloc(p, NULL, name_size(0), 0, NULL, &b), 0);
    th_fill(gpupool_buffer_ptr(b), name_seed(0, 2), name_size(0));
    th_sleep_ms(300); /* this hold written, and compacted: the publish is the next delta */
    fd = open(flag_path, O_CREAT | O_WRONLY | O_EXCL, 0600);
    assert_true(fd >= 0);
    close(fd);
    /* 5-8: the delta this publish writes dies at `step`; 9: the whole state written once
     * nothing more changes (200 ms later) replaces the deltas and dies on the way. */
    (void)gpupool_buffer_publish(b, "n0", NULL, NULL, NULL);
    (void)gpupool_buffer_release(b, NULL);
    daemon = wait_restarted(daemon);
    r = th_connect(&D, "reader");
    check_name(r, 0, step >= 8 ? 2 : 1);
    {
      char pat[80];
      snprintf(pat, sizeof pat, "killing the daemon at step %d of state write", step);
      log_has(pat);
    }
    /* Whatever the crash left, the next whole state takes its place. */
    publish(p, 0, step >= 8 ? 3 : 2);
    gpupool_client_disconnect(r);
    gpupool_client_disconnect(p);
    th_stop(&D);
  }
}

/* A damaged delta, and one missing from the store: the deltas before it are replayed, it and
 * those after it are discarded (their names are lost, the client is told which), and the log
 * says which delta and why. */
static void test_delta_damaged_or_missing(void **state) {
  (void)state;
  for (int drop = 0; drop <= 1; drop++) {
    char v[512], lost[8][GPUPOOL_NAME_MAX + 1];
    const char *env[] = {"GPUPOOL_TEST_STATE_DELTA", v, "GPUPOOL_TEST_STATE_EVERY_MS", "60000", NULL};
    enum { N = 4 };
    gpupool_buffer *b[N], *g;
    gpupool_client *p, *r;
    pid_t daemon;
    int fd, nlost = 0;
    if (drop)
      th_prepare(&D);
    snprintf(flag_path, sizeof flag_path, "%s/damage-now", D.dir);
    snprintf(v, sizeof v, "%s:2:%s", drop ? "drop" : "damage", flag_path);
    daemon = start_env(env);
    p = th_connect(&D, "producer");
    alloc_then_settle(p, b, N);
    fd = open(flag_path, O_CREAT | O_WRONLY | O_EXCL, 0600);
    assert_true(fd >= 0);
    close(fd);
    for (int i = 0; i < N; i++)
      publish_held(b[i], i, 1); /* a delta each; the second damaged or left out */
    daemon = crash(daemon);
    if (drop)
      log_has("delta [0-9]+\\.[0-9]+ of the state is missing: the 2 later one\\(s\\) are discarded with the "
              "changes they hold, the [0-9]+ before it are kept");
    else
      log_has("delta [0-9]+\\.[0-9]+ of the state: its checksum does not match .*; the changes it and any later delta "
              "hold are discarded, the [0-9]+ before it are kept");
    log_has("restored state [0-9]+ \\(format 3\\) and [1-9][0-9]* delta\\(s\\) after it");
    r = th_connect(&D, "reader");
    check_name(r, 0, 1);
    for (int i = 1; i < N; i++) {
      char name[32];
      snprintf(name, sizeof name, "n%d", i);
      assert_int_equal(gpupool_buffer_get(r, name, 0, 0, 0, NULL, &g, NULL), GPUPOOL_ENOENT);
    }
    check_name(p, 0, 1); /* (the producer reconnects) */
    assert_int_equal(gpupool_client_lost_names(p, lost, 8, &nlost), 0);
    assert_int_equal(nlost, N - 1);
    for (int i = 0; i < N; i++)
      assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
    gpupool_client_disconnect(r);
    gpupool_client_disconnect(p);
    th_stop(&D);
  }
}

/* A range freed and handed out again with no whole state written in between: the delta of
 * the new name follows the one that says the old buffer is gone, so the restore does not
 * find two buffers on one range and keeps the new name. */
static void test_delta_range_reused(void **state) {
  const char *env[] = {"GPUPOOL_TEST_STATE_EVERY_MS", "60000", NULL}; /* (only deltas from here on) */
  gpupool_buffer *b;
  gpupool_client *p, *r;
  pid_t daemon = start_env(env);
  (void)state;
  p = th_connect(&D, "producer");
  publish(p, 0, 1);
  assert_int_equal(gpupool_name_unpublish(p, "n0"), 0); /* its buffer is freed */
  assert_int_equal(gpupool_buffer_alloc(p, NULL, name_size(0), 0, NULL, &b), 0); /* (the same range) */
  th_fill(gpupool_buffer_ptr(b), name_seed(1, 1), name_size(0));
  publish_held(b, 1, 1);
  daemon = crash(daemon);
  log_has("restored state [0-9]+ \\(format 3\\) and 3 delta\\(s\\) after it .* discarded: 0 name\\(s\\), 0 "
          "slab\\(s\\), 0 buffer\\(s\\)");
  r = th_connect(&D, "reader");
  {
    gpupool_buffer *g;
    uint64_t v = 0;
    if (gpupool_buffer_get(r, "n1", 0, 0, GPUPOOL_READ_ONLY, NULL, &g, &v) != 0) {
      th_dump_log(&D);
      fail_msg("get n1: %s", gpupool_last_error());
    }
    assert_int_equal(v, 1);
    assert_true(th_check(gpupool_buffer_ptr(g), name_seed(1, 1), name_size(0)));
    assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  }
  assert_int_equal(gpupool_buffer_get(r, "n0", 0, 0, 0, NULL, &b, NULL), GPUPOOL_ENOENT);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(p);
  th_stop(&D);
}

/* A connection that closes while its process still holds the lease (and maps its buffer):
 * the delta says what that lease pins, so the next daemon restores it with its pins (the log
 * names it with the process's pid) rather than as a lease no state names. */
static void test_delta_closed_connection_pins(void **state) {
  const char *env[] = {"GPUPOOL_TEST_STATE_EVERY_MS", "60000", NULL}; /* (deltas only) */
  gpupool_client *p;
  pid_t daemon = start_env(env), child;
  int ready[2], go[2];
  char c = 0, pat[128];
  (void)state;
  p = th_connect(&D, "producer");
  publish(p, 0, 1); /* a whole state, then deltas */
  assert_int_equal(pipe(ready), 0);
  assert_int_equal(pipe(go), 0);
  child = fork();
  assert_true(child >= 0);
  if (child == 0) {
    gpupool_client *h;
    gpupool_buffer *b;
    alarm(60); /* (never outlives a test that failed before telling it to go) */
    if (gpupool_client_connect(D.sock, "holder", GPUPOOL_TIMEOUT_DEFAULT, &h) != 0 ||
        gpupool_buffer_alloc(h, NULL, 50000, 0, NULL, &b) != 0)
      _exit(1);
    th_fill(gpupool_buffer_ptr(b), 4242, 50000);
    th_close_sockets(); /* the connection closes; the lease and the mapping stay */
    if (write(ready[1], "r", 1) != 1 || read(go[0], &c, 1) != 1)
      _exit(1);
    _exit(th_check(gpupool_buffer_ptr(b), 4242, 50000) ? 0 : 3);
  }
  assert_int_equal(read(ready[0], &c, 1), 1);
  th_sleep_ms(100); /* the daemon has seen the connection close */
  publish(p, 1, 1); /* its delta carries the closed connection's record too */
  daemon = crash(daemon);
  snprintf(pat, sizeof pat, "restore: lease [0-9]+ of pid %d ", (int)child);
  log_has(pat);
  check_name(p, 1, 1);
  assert_int_equal(write(go[1], "g", 1), 1);
  {
    int status = 0;
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
  }
  close(ready[0]);
  close(ready[1]);
  close(go[0]);
  close(go[1]);
  gpupool_client_disconnect(p);
  th_stop(&D);
}

/* A bundle whose members span several buffers has its layout attached to each of them: a
 * delta writes that layout once, not once per buffer that carries it (1,000 members of 64
 * KiB over 4 MiB slabs; the delta with their allocation and the publish stays near one
 * layout's size). */
static void test_delta_writes_a_layout_once(void **state) {
  const char *env[] = {"GPUPOOL_TEST_STATE_EVERY_MS", "60000", NULL}; /* (the alloc waits for the publish) */
  enum { M = 1000 };
  gpupool_member_spec *specs = calloc(M, sizeof *specs);
  char (*names)[16] = calloc(M, sizeof *names), cmd[800];
  gpupool_client *p;
  gpupool_bundle *b;
  uint64_t version = 0;
  long most = -1;
  FILE *f;
  (void)state;
  assert_non_null(specs);
  assert_non_null(names);
  start_env(env);
  p = th_connect(&D, "producer");
  publish(p, 1, 1); /* a first whole state: what follows is deltas */
  th_sleep_ms(200);
  for (int k = 0; k < M; k++) {
    snprintf(names[k], sizeof names[k], "layer%d", k);
    specs[k] = (gpupool_member_spec){.name = names[k], .size = 64 << 10, .meta = NULL};
  }
  assert_int_equal(gpupool_bundle_alloc(p, NULL, specs, M, 0, 0, NULL, &b), 0);
  assert_int_equal(gpupool_bundle_publish(b, "big", NULL, &version), 0);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  th_sleep_ms(300); /* (the daemon's log lines reach the file within 100 ms) */
  snprintf(cmd, sizeof cmd, "grep -o 'delta [0-9]* written: [0-9]* bytes' %s | awk '{ if ($4 > m) m = $4 } END { print m + 0 }'",
           D.log);
  assert_non_null(f = popen(cmd, "r"));
  assert_int_equal(fscanf(f, "%ld", &most), 1);
  pclose(f);
  /* One layout of these 1,000 members is about 35 KiB (the delta with it: 36,394 bytes);
   * written with each buffer that carried it, the delta was 108,230. */
  if (most <= 0 || most > 64 * 1024) {
    th_dump_log(&D);
    fail_msg("the largest delta was %ld bytes for one bundle of %d members (one layout: about 35 KiB)", most, M);
  }
  gpupool_client_disconnect(p);
  free(specs);
  free(names);
  th_stop(&D);
}

/* Past its bound (3 here) the deltas are compacted into a whole state; after a crash every
 * name is there, and once everything is released the store is back to where it started. */
static void test_deltas_compacted(void **state) {
  const char *env[] = {"GPUPOOL_TEST_STATE_DELTAS", "3", NULL};
  enum { N = 12 };
  gpupool_buffer *b[N];
  gpupool_client *p, *r;
  uint64_t base_fds;
  int base;
  pid_t daemon = start_env(env);
  (void)state;
  r = th_connect(&D, "baseline");
  gpupool_client_disconnect(r);
  base = settled_store();
  base_fds = th_settled_fds(&D);
  p = th_connect(&D, "producer");
  alloc_then_settle(p, b, N);
  for (int i = 0; i < N; i++)
    publish_held(b[i], i, 1);
  log_has("state [0-9]+ written: .* \\(compacted: the deltas before it are dropped\\)");
  daemon = crash(daemon);
  r = th_connect(&D, "reader");
  for (int i = 0; i < N; i++)
    check_name(r, i, 1);
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof name, "n%d", i);
    assert_int_equal(gpupool_name_unpublish(r, name), 0);
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  }
  gpupool_client_disconnect(p);
  gpupool_client_disconnect(r);
  th_wait_idle(&D, 5000);
  th_expect_fds(&D, base_fds);
  if (settled_store() != base) {
    th_dump_log(&D);
    fail_msg("the supervisor holds %d fds, %d at the start: deltas or states were left in the store",
             count_fds(D.pid), base);
  }
  th_stop(&D);
}

int main(void) {
  return TS_RUN_TESTS(setup, teardown, test_crash_keeps_names, test_holds_released_after_restart, test_kept_shares_survive,
                      test_older_format_read, test_crash_cycles, test_crash_inside_state_write,
                      test_discard_piece_by_piece, test_newer_state_refused, test_deltas_replayed,
                      test_crash_inside_delta_write, test_delta_damaged_or_missing, test_delta_range_reused,
                      test_delta_closed_connection_pins, test_deltas_compacted,
                      test_delta_writes_a_layout_once);
}
