/*
 * Replicas of a version on another device, on the host backend: pools configured with
 * `device = N` stand for GPUs (memfd memory, simulated), so the replica logic runs here as it
 * does on GPUs: one copy per (version, device) however many getters ask, bit-exact, handed out
 * only once complete, freed with the version, counted against the version's tenant; copies
 * that fail or whose getter or daemon dies leave nothing half filled behind.
 */
#include <pthread.h>

#include "harness.h"

#define MIB (1024ull * 1024)

static th_daemon D;

/* Three pools standing for GPUs 0, 1 and 2. */
#define SIM_POOLS                                                                                  \
  "[pool gpu0]\nkind = host\ndevice = 0\ncapacity = 64M\nslab_size = 8M\n"                         \
  "[pool gpu1]\nkind = host\ndevice = 1\ncapacity = 64M\nslab_size = 8M\n"                         \
  "[pool gpu2]\nkind = host\ndevice = 2\ncapacity = 64M\nslab_size = 8M\n"

static void start_sim(const char *daemon_lines) {
  char conf[2048];
  snprintf(conf, sizeof conf, "[daemon]\n%s\n" SIM_POOLS, daemon_lines ? daemon_lines : "");
  th_start_conf(&D, conf);
}

static int teardown(void **state) {
  (void)state;
  th_stop(&D);
  unsetenv("GPUPOOL_TEST_COPY_DELAY_MS");
  unsetenv("GPUPOOL_TEST_COPY_FAIL");
  unsetenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS");
  return 0;
}

/* What `gpupoolctl ARGS` prints (the operator's view), NUL-terminated in buf. */
static void ctl(const char *args, char *buf, size_t len) {
  char cmd[1024];
  size_t n = 0;
  FILE *f;
  snprintf(cmd, sizeof cmd, "%s -s %s %s", GPUPOOLCTL_PATH, D.sock, args);
  f = popen(cmd, "r");
  assert_non_null(f);
  while (n + 1 < len && !feof(f)) {
    size_t r = fread(buf + n, 1, len - 1 - n, f);
    if (r == 0)
      break;
    n += r;
  }
  buf[n] = '\0';
  if (pclose(f) != 0)
    fail_msg("%s failed: %s", cmd, buf);
}

static uint64_t stat_line(const char *text, const char *key) {
  char pat[64];
  const char *at;
  snprintf(pat, sizeof pat, "\n%s ", key);
  at = strstr(text, pat);
  if (!at)
    fail_msg("no %s in gpupoolctl stats:\n%s", key, text);
  return strtoull(at + strlen(pat), NULL, 10);
}

/* The daemon's replica counters (gpupoolctl stats). */
typedef struct {
  uint64_t copies, bytes, running, failed;
} counters;

static counters replica_counters(void) {
  static char out[16384];
  counters k;
  ctl("stats", out, sizeof out);
  k.copies = stat_line(out, "replica_copies");
  k.bytes = stat_line(out, "replica_bytes");
  k.running = stat_line(out, "replica_copies_running");
  k.failed = stat_line(out, "replica_copies_failed");
  return k;
}

/* The row of buffer id in gpupoolctl --json buffers: *replica_of and *device. */
static void buffer_row(uint64_t id, uint64_t *replica_of, int *device) {
  static char out[65536];
  char pat[48];
  const char *row, *end, *at;
  ctl("--json buffers", out, sizeof out);
  snprintf(pat, sizeof pat, "{\"id\":%llu,", (unsigned long long)id);
  if (!(row = strstr(out, pat)))
    fail_msg("buffer %llu is not listed: %s", (unsigned long long)id, out);
  end = strchr(row, '}');
  at = strstr(row, "\"device\":");
  assert_true(at && at < end);
  *device = atoi(at + strlen("\"device\":"));
  at = strstr(row, "\"replica_of\":");
  assert_true(at && at < end);
  *replica_of = strtoull(at + strlen("\"replica_of\":"), NULL, 10);
  /* The text table says the same. */
  ctl("buffers", out, sizeof out);
  assert_non_null(strstr(out, "REPLICA OF"));
}

/* Bytes in use in pool gpuN (stats). */
static uint64_t pool_used(int n) {
  gpupool_client *c = th_connect(&D, "stats");
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps[8];
  int np = 0;
  assert_int_equal(gpupool_client_stats(c, &ds, ps, 8, &np), 0);
  gpupool_client_disconnect(c);
  assert_true(n < np);
  return ps[n].used;
}

/* Wait until no pool holds a byte, nothing is pending and no copy runs. */
static void wait_all_idle(void) {
  uint64_t end = th_now_ms() + 5000;
  th_wait_idle(&D, 5000);
  while (th_now_ms() < end) {
    if (pool_used(0) == 0 && pool_used(1) == 0 && pool_used(2) == 0 && replica_counters().running == 0)
      return;
    th_sleep_ms(20);
  }
  th_dump_log(&D);
  fail_msg("pools not back to baseline: used %llu %llu %llu", (unsigned long long)pool_used(0),
           (unsigned long long)pool_used(1), (unsigned long long)pool_used(2));
}

/* Publish size bytes of seed's pattern in gpu0 under name; the producer's client is returned
 * (its hold released: the name holds the buffer). */
static gpupool_client *publish_pattern(const char *name, uint64_t size, uint32_t seed, uint64_t *id) {
  gpupool_client *p = th_connect(&D, "producer");
  gpupool_buffer *b;
  assert_int_equal(gpupool_buffer_alloc(p, "gpu0", size, 0, NULL, &b), 0);
  th_fill(gpupool_buffer_ptr(b), seed, size);
  assert_int_equal(gpupool_buffer_publish(b, name, NULL, NULL, NULL), 0);
  if (id)
    *id = gpupool_buffer_id(b);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  return p;
}

static void test_buffer_replica_bit_exact(void **state) {
  gpupool_client *p, *c;
  gpupool_buffer *g, *g2, *src;
  uint64_t src_id, of = 0, v = 0;
  int dev = -2;
  (void)state;
  start_sim(NULL);
  p = publish_pattern("w", 3 * MIB + 123, 7, &src_id);
  c = th_connect(&D, "consumer");
  /* Without a target device: the version where it lies (today's behaviour). */
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 0, 0, NULL, &src, NULL), 0);
  assert_int_equal(gpupool_buffer_id(src), src_id);
  /* On its own device: the same buffer, no copy. */
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 0, GPUPOOL_ON_DEVICE(0), NULL, &g2, NULL), 0);
  assert_int_equal(gpupool_buffer_id(g2), src_id);
  assert_int_equal(replica_counters().copies, 0);
  assert_int_equal(gpupool_buffer_release(g2, NULL), 0);
  /* On device 1: a replica, bit-exact, read-only, listed as a replica of the source. */
  if (gpupool_buffer_get(c, "w", 0, 5000, GPUPOOL_ON_DEVICE(1), NULL, &g, &v) != 0)
    fail_msg("get on device 1: %s", gpupool_last_error());
  assert_int_equal(v, 1);
  assert_true(gpupool_buffer_id(g) != src_id);
  assert_int_equal(gpupool_buffer_size(g), 3 * MIB + 123);
  assert_true(gpupool_buffer_read_only(g));
  assert_true(th_check(gpupool_buffer_ptr(g), 7, 3 * MIB + 123));
  buffer_row(gpupool_buffer_id(g), &of, &dev);
  assert_int_equal(of, src_id);
  assert_int_equal(dev, 1);
  assert_true(pool_used(1) >= 3 * MIB);
  /* A second get on device 1 finds it ready: no second copy. */
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 0, GPUPOOL_ON_DEVICE(1), NULL, &g2, NULL), 0);
  assert_int_equal(gpupool_buffer_id(g2), gpupool_buffer_id(g));
  {
    counters k = replica_counters();
    assert_int_equal(k.copies, 1);
    assert_int_equal(k.bytes, 3 * MIB + 123);
    assert_int_equal(k.failed, 0);
  }
  assert_int_equal(gpupool_buffer_release(g2, NULL), 0);
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  assert_int_equal(gpupool_buffer_release(src, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "w"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

static void test_bundle_replica_bit_exact(void **state) {
  gpupool_member_spec specs[3] = {{"a", 1 * MIB + 5, NULL}, {"b", 3 * MIB, NULL}, {"c", 4097, NULL}};
  gpupool_client *p, *c;
  gpupool_bundle *b, *g;
  gpupool_member m;
  (void)state;
  start_sim(NULL);
  p = th_connect(&D, "producer");
  c = th_connect(&D, "consumer");
  assert_int_equal(gpupool_bundle_alloc(p, "gpu0", specs, 3, 0, 0, NULL, &b), 0);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(gpupool_bundle_member(b, i, &m), 0);
    th_fill(m.ptr, 100 + (uint32_t)i, m.size);
  }
  assert_int_equal(gpupool_bundle_publish(b, "sd", NULL, NULL), 0);
  if (gpupool_bundle_get(c, "sd", 0, 5000, GPUPOOL_ON_DEVICE(2), NULL, &g) != 0)
    fail_msg("bundle get on device 2: %s", gpupool_last_error());
  assert_int_equal(gpupool_bundle_count(g), 3);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(gpupool_bundle_member(g, i, &m), 0);
    assert_int_equal(m.size, specs[i].size);
    assert_true(th_check(m.ptr, 100 + (uint32_t)i, m.size));
  }
  assert_true(gpupool_bundle_buffer(g, 0) != gpupool_bundle_buffer(b, 0));
  assert_int_equal(gpupool_buffer_device(gpupool_bundle_buffer(g, 0)), -1); /* memfd memory */
  assert_true(pool_used(2) > 0);
  assert_int_equal(replica_counters().copies, 1);
  assert_int_equal(gpupool_bundle_release(g, NULL), 0);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "sd"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- eight getters at once, one copy ---- */

static int getter_child(const th_daemon *d, int seed) {
  gpupool_client *c = NULL;
  gpupool_buffer *g;
  int rc = gpupool_client_connect(d->sock, "getter", GPUPOOL_TIMEOUT_DEFAULT, &c);
  CHILD_CHECK(rc == 0, "connect");
  rc = gpupool_buffer_get(c, "w", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL);
  CHILD_CHECK(rc == 0, "get on device 1: %s", gpupool_err_name(rc));
  CHILD_CHECK(th_check(gpupool_buffer_ptr(g), (uint32_t)seed, 4 * MIB), "replica differs from the version");
  gpupool_buffer_release(g, NULL);
  gpupool_client_disconnect(c);
  return 0;
}

static void test_eight_getters_one_copy(void **state) {
  gpupool_client *p;
  pid_t kids[8];
  counters k;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "100", 1); /* a copy that takes a while: they all ask meanwhile */
  start_sim(NULL);
  p = publish_pattern("w", 4 * MIB, 11, NULL);
  for (int i = 0; i < 8; i++)
    kids[i] = th_spawn(&D, getter_child, 11);
  for (int i = 0; i < 8; i++)
    th_wait_ok(kids[i], "getter");
  k = replica_counters();
  assert_int_equal(k.copies, 1);
  assert_int_equal(k.failed, 0);
  assert_int_equal(k.bytes, 4 * MIB);
  /* The replica stays with the version (no holder now) until the version goes. */
  assert_true(pool_used(1) >= 4 * MIB);
  assert_int_equal(gpupool_name_unpublish(p, "w"), 0);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- more copies than the daemon runs at once ---- */

typedef struct {
  const th_daemon *d;
  int i, rc;
} many_arg;

static void *many_get(void *arg) {
  many_arg *a = arg;
  gpupool_client *c = NULL;
  gpupool_buffer *g;
  char name[16];
  snprintf(name, sizeof name, "m%d", a->i);
  a->rc = gpupool_client_connect(a->d->sock, "many", GPUPOOL_TIMEOUT_DEFAULT, &c);
  if (a->rc == 0 && (a->rc = gpupool_buffer_get(c, name, 0, 30000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL)) == 0) {
    a->rc = th_check(gpupool_buffer_ptr(g), 200 + (uint32_t)a->i, 2 * MIB) ? 0 : -100;
    gpupool_buffer_release(g, NULL);
  }
  if (c)
    gpupool_client_disconnect(c);
  return NULL;
}

static void test_more_copies_than_slots(void **state) {
  enum { N = 20 };
  gpupool_client *p = NULL;
  pthread_t th[N];
  many_arg a[N];
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "5", 1);
  start_sim(NULL);
  for (int i = 0; i < N; i++) {
    char name[16];
    snprintf(name, sizeof name, "m%d", i);
    gpupool_client_disconnect(publish_pattern(name, 2 * MIB, 200 + (uint32_t)i, NULL));
  }
  for (int i = 0; i < N; i++) {
    a[i] = (many_arg){&D, i, 1};
    assert_int_equal(pthread_create(&th[i], NULL, many_get, &a[i]), 0);
  }
  for (int i = 0; i < N; i++) {
    assert_int_equal(pthread_join(th[i], NULL), 0);
    if (a[i].rc != 0)
      fail_msg("getter %d: %d", i, a[i].rc);
  }
  assert_int_equal(replica_counters().copies, N);
  assert_int_equal(replica_counters().running, 0);
  p = th_connect(&D, "producer");
  for (int i = 0; i < N; i++) {
    char name[16];
    snprintf(name, sizeof name, "m%d", i);
    assert_int_equal(gpupool_name_unpublish(p, name), 0);
  }
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- freed with its version ---- */

static void test_replica_freed_with_version(void **state) {
  gpupool_client *p, *c;
  gpupool_buffer *g, *g2;
  (void)state;
  start_sim(NULL);
  p = publish_pattern("w", 2 * MIB, 1, NULL);
  c = th_connect(&D, "consumer");
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 5000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL), 0);
  assert_true(th_check(gpupool_buffer_ptr(g), 1, 2 * MIB));
  /* Version 2 replaces it: the version-1 replica lives on while held... */
  gpupool_client_disconnect(publish_pattern("w", 2 * MIB, 2, NULL));
  assert_int_equal(gpupool_buffer_get(c, "w", 1, 5000, GPUPOOL_ON_DEVICE(1), NULL, &g2, NULL), 0);
  assert_true(gpupool_buffer_id(g2) != gpupool_buffer_id(g));
  assert_true(th_check(gpupool_buffer_ptr(g2), 2, 2 * MIB));
  assert_true(th_check(gpupool_buffer_ptr(g), 1, 2 * MIB));
  assert_int_equal(replica_counters().copies, 2);
  {
    uint64_t both = pool_used(1);
    /* ...and goes with its last holder: version 1 is gone, so is its replica. */
    assert_int_equal(gpupool_buffer_release(g, NULL), 0);
    uint64_t end = th_now_ms() + 3000;
    while (pool_used(1) >= both && th_now_ms() < end)
      th_sleep_ms(10);
    assert_true(pool_used(1) < both);
    assert_true(pool_used(1) >= 2 * MIB); /* version 2's replica stays with version 2 */
  }
  /* A buffer published again (same buffer, new bytes) gets a new replica, not the old one. */
  {
    gpupool_buffer *b, *g3;
    uint64_t copies = replica_counters().copies;
    assert_int_equal(gpupool_buffer_alloc(p, "gpu0", MIB, 0, NULL, &b), 0);
    th_fill(gpupool_buffer_ptr(b), 30, MIB);
    assert_int_equal(gpupool_buffer_publish(b, "again", NULL, NULL, NULL), 0);
    assert_int_equal(gpupool_buffer_get(c, "again", 0, 5000, GPUPOOL_ON_DEVICE(1), NULL, &g3, NULL), 0);
    assert_true(th_check(gpupool_buffer_ptr(g3), 30, MIB));
    assert_int_equal(gpupool_buffer_release(g3, NULL), 0);
    th_fill(gpupool_buffer_ptr(b), 31, MIB);
    assert_int_equal(gpupool_buffer_publish(b, "again", NULL, NULL, NULL), 0);
    assert_int_equal(gpupool_buffer_get(c, "again", 1, 5000, GPUPOOL_ON_DEVICE(1), NULL, &g3, NULL), 0);
    assert_true(th_check(gpupool_buffer_ptr(g3), 31, MIB));
    assert_int_equal(replica_counters().copies, copies + 2);
    assert_int_equal(gpupool_buffer_release(g3, NULL), 0);
    assert_int_equal(gpupool_buffer_release(b, NULL), 0);
    assert_int_equal(gpupool_name_unpublish(p, "again"), 0);
  }
  assert_int_equal(gpupool_buffer_release(g2, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "w"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- a getter killed while it waits ---- */

static int doomed_getter(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *g;
  (void)arg;
  if (gpupool_client_connect(d->sock, "doomed", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0)
    return 1;
  gpupool_buffer_get(c, "w", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL);
  return 2; /* never reached: killed while waiting */
}

static void test_getter_killed_while_waiting(void **state) {
  gpupool_client *p, *c;
  gpupool_buffer *g;
  pid_t kid;
  int st;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "40", 1); /* 8 chunks: about 320 ms */
  start_sim(NULL);
  p = publish_pattern("w", 8 * MIB, 5, NULL);
  kid = th_spawn(&D, doomed_getter, 0);
  /* Kill it once its copy runs. */
  for (uint64_t end = th_now_ms() + 5000; replica_counters().running == 0 && th_now_ms() < end;)
    th_sleep_ms(5);
  assert_int_equal(replica_counters().running, 1);
  /* A getter's own timeout applies while it waits for the copy. */
  c = th_connect(&D, "consumer");
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 30, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL), GPUPOOL_ETIMEDOUT);
  assert_non_null(strstr(gpupool_last_error(), "replica of 'w' on device 1"));
  kill(kid, SIGKILL);
  assert_int_equal(waitpid(kid, &st, 0), kid);
  assert_true(WIFSIGNALED(st));
  /* Another getter still gets the one copy, complete. */
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL), 0);
  assert_true(th_check(gpupool_buffer_ptr(g), 5, 8 * MIB));
  assert_int_equal(replica_counters().copies, 1);
  assert_int_equal(replica_counters().failed, 0);
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "w"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- a copy that fails ---- */

static void *bg_get(void *arg) {
  gpupool_client *c = arg;
  gpupool_buffer *g = NULL;
  intptr_t rc = gpupool_buffer_get(c, "w", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL);
  if (rc == 0)
    gpupool_buffer_release(g, NULL);
  return (void *)rc;
}

static void test_copy_failure_fails_waiters_then_retries(void **state) {
  gpupool_client *p, *c, *c2;
  gpupool_buffer *g;
  pthread_t th;
  void *other;
  int rc;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_FAIL", "1", 1);       /* the first copy fails after its first chunk */
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "200", 1); /* slow enough for a second waiter to join */
  start_sim(NULL);
  p = publish_pattern("w", 3 * MIB, 9, NULL);
  c = th_connect(&D, "consumer");
  c2 = th_connect(&D, "consumer2");
  assert_int_equal(pthread_create(&th, NULL, bg_get, c2), 0);
  for (uint64_t end = th_now_ms() + 5000; replica_counters().running == 0 && th_now_ms() < end;)
    th_sleep_ms(2);
  rc = gpupool_buffer_get(c, "w", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL);
  assert_int_equal(rc, GPUPOOL_EBACKEND);
  assert_non_null(strstr(gpupool_last_error(), "failed"));
  assert_non_null(strstr(gpupool_last_error(), "next get starts a new copy"));
  assert_int_equal(pthread_join(th, &other), 0);
  assert_int_equal((intptr_t)other, GPUPOOL_EBACKEND); /* every waiter of that copy */
  {
    counters k = replica_counters();
    assert_int_equal(k.copies, 1);
    assert_int_equal(k.failed, 1);
    assert_int_equal(k.running, 0);
  }
  /* Nothing of the failed replica is left, and the next get starts again. */
  assert_int_equal(pool_used(1), 0);
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL), 0);
  assert_true(th_check(gpupool_buffer_ptr(g), 9, 3 * MIB));
  assert_int_equal(replica_counters().copies, 2);
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "w"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(c2);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- the daemon killed mid-copy ---- */

static int waiting_getter(const th_daemon *d, int arg) {
  gpupool_client *c = NULL;
  gpupool_buffer *g;
  int rc;
  (void)arg;
  if (gpupool_client_connect(d->sock, "waiting", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0)
    return 1;
  gpupool_client_set_reconnect(c, 0);
  rc = gpupool_buffer_get(c, "w", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL);
  /* The daemon died before the copy ended: the get fails; it never hands over a part. */
  CHILD_CHECK(rc != 0, "a get succeeded although the daemon died mid-copy");
  return 0;
}

static void test_daemon_killed_mid_copy(void **state) {
  gpupool_client *p, *c;
  gpupool_buffer *g;
  pid_t kid;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "100", 1);
  start_sim(NULL);
  p = publish_pattern("w", 8 * MIB, 3, NULL);
  kid = th_spawn(&D, waiting_getter, 0);
  for (uint64_t end = th_now_ms() + 5000; replica_counters().running == 0 && th_now_ms() < end;)
    th_sleep_ms(5);
  assert_int_equal(replica_counters().running, 1);
  kill(D.pid, SIGKILL);
  waitpid(D.pid, NULL, 0);
  th_track(D.pid, 0);
  D.pid = 0;
  th_wait_ok(kid, "getter waiting when the daemon died");
  gpupool_client_disconnect(p);
  /* A fresh daemon knows no replica: the version is published again and copied anew. */
  unsetenv("GPUPOOL_TEST_COPY_DELAY_MS");
  th_start(&D, 1, NULL);
  assert_int_equal(replica_counters().copies, 0);
  p = publish_pattern("w", 8 * MIB, 4, NULL);
  c = th_connect(&D, "consumer");
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL), 0);
  assert_true(th_check(gpupool_buffer_ptr(g), 4, 8 * MIB));
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "w"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- getters waiting for the publish ---- */

static void *late_get(void *arg) {
  gpupool_client *c = arg;
  gpupool_bundle *g = NULL;
  gpupool_member m;
  intptr_t rc = gpupool_bundle_get(c, "late", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g);
  if (rc == 0) {
    gpupool_bundle_member(g, 0, &m);
    rc = th_check(m.ptr, 61, m.size) ? 0 : -100;
    gpupool_bundle_release(g, NULL);
  }
  return (void *)rc;
}

/* Gets parked on a name that is not published yet, on device 1: the publish wakes them, they
 * wait for the replica's copy (started by the first), and come with it. */
static void test_getters_waiting_for_the_publish(void **state) {
  gpupool_client *p, *c[3];
  pthread_t th[3];
  void *r;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "20", 1);
  start_sim(NULL);
  for (int i = 0; i < 3; i++) {
    c[i] = th_connect(&D, "late");
    assert_int_equal(pthread_create(&th[i], NULL, late_get, c[i]), 0);
  }
  th_sleep_ms(100); /* (their gets wait for the name either way: this only makes it likely) */
  p = publish_pattern("late", 3 * MIB, 61, NULL);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(pthread_join(th[i], &r), 0);
    assert_int_equal((intptr_t)r, 0);
    gpupool_client_disconnect(c[i]);
  }
  assert_int_equal(replica_counters().copies, 1);
  assert_int_equal(gpupool_name_unpublish(p, "late"), 0);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- broadcast ---- */

static void test_broadcast_on_publish(void **state) {
  gpupool_member_spec specs[2] = {{"x", 2 * MIB + 1, NULL}, {"y", 700000, NULL}};
  gpupool_client *p, *c;
  gpupool_bundle *b, *g1, *g2;
  gpupool_buffer *sb, *sg;
  gpupool_member m;
  const int devs[2] = {1, 2}, bad[1] = {3};
  counters k;
  (void)state;
  start_sim(NULL);
  p = th_connect(&D, "producer");
  c = th_connect(&D, "consumer");
  assert_int_equal(gpupool_bundle_alloc(p, "gpu0", specs, 2, 0, 0, NULL, &b), 0);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(gpupool_bundle_member(b, i, &m), 0);
    th_fill(m.ptr, 50 + (uint32_t)i, m.size);
  }
  /* A device without a pool is refused before anything is published. */
  assert_int_equal(gpupool_bundle_publish_to(b, "sd", NULL, bad, 1, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "device 3"));
  assert_int_equal(gpupool_bundle_get(c, "sd", 0, 0, 0, NULL, &g1), GPUPOOL_ENOENT);
  /* One job for both devices, started by the publish itself. */
  assert_int_equal(gpupool_bundle_publish_to(b, "sd", NULL, devs, 2, NULL), 0);
  k = replica_counters();
  assert_int_equal(k.copies, 1);
  for (uint64_t end = th_now_ms() + 5000; replica_counters().running && th_now_ms() < end;)
    th_sleep_ms(5);
  assert_true(pool_used(1) > 0 && pool_used(2) > 0);
  assert_int_equal(gpupool_bundle_get(c, "sd", 0, 5000, GPUPOOL_ON_DEVICE(1), NULL, &g1), 0);
  assert_int_equal(gpupool_bundle_get(c, "sd", 0, 5000, GPUPOOL_ON_DEVICE(2), NULL, &g2), 0);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(gpupool_bundle_member(g1, i, &m), 0);
    assert_true(th_check(m.ptr, 50 + (uint32_t)i, m.size));
    assert_int_equal(gpupool_bundle_member(g2, i, &m), 0);
    assert_true(th_check(m.ptr, 50 + (uint32_t)i, m.size));
  }
  k = replica_counters();
  assert_int_equal(k.copies, 1);
  assert_true(k.bytes >= 2 * (2 * MIB + 1 + 700000)); /* the bundle's buffer, to each of the two */
  assert_int_equal(gpupool_bundle_release(g1, NULL), 0);
  assert_int_equal(gpupool_bundle_release(g2, NULL), 0);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  /* A single buffer too. */
  assert_int_equal(gpupool_buffer_alloc(p, "gpu0", MIB, 0, NULL, &sb), 0);
  th_fill(gpupool_buffer_ptr(sb), 77, MIB);
  assert_int_equal(gpupool_buffer_publish_to(sb, "one", NULL, NULL, devs + 1, 1, NULL), 0);
  assert_int_equal(replica_counters().copies, 2);
  assert_int_equal(gpupool_buffer_get(c, "one", 0, 5000, GPUPOOL_ON_DEVICE(2), NULL, &sg, NULL), 0);
  assert_true(th_check(gpupool_buffer_ptr(sg), 77, MIB));
  assert_int_equal(replica_counters().copies, 2);
  assert_int_equal(gpupool_buffer_release(sg, NULL), 0);
  assert_int_equal(gpupool_buffer_release(sb, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "one"), 0);
  assert_int_equal(gpupool_name_unpublish(p, "sd"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- replica buffers made a few per loop turn ---- */

#define NSPREAD 6

/* Publish NSPREAD buffers of 5 MiB in gpu0 (each its own slab, and so each replica), member i
 * filled with seed + i, as one bundle `name`, replicated to the ndev devices at once when ndev
 * > 0; the producer's client is returned, its holds released. */
static gpupool_client *publish_spread(const char *name, uint32_t seed, const int *devs, int ndev) {
  gpupool_client *p = th_connect(&D, "producer");
  gpupool_buffer *b[NSPREAD];
  gpupool_member_ref refs[NSPREAD];
  char names[NSPREAD][8];
  for (int i = 0; i < NSPREAD; i++) {
    assert_int_equal(gpupool_buffer_alloc(p, "gpu0", 5 * MIB, 0, NULL, &b[i]), 0);
    th_fill(gpupool_buffer_ptr(b[i]), seed + (uint32_t)i, 5 * MIB);
    snprintf(names[i], sizeof names[i], "m%d", i);
    refs[i] = (gpupool_member_ref){names[i], b[i], 0, 5 * MIB, NULL};
  }
  assert_int_equal(gpupool_bundle_publish_members(p, name, refs, NSPREAD, NULL, NULL), 0);
  for (int i = 0; i < NSPREAD; i++)
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  if (ndev) {
    /* published again, replicated this time (version 2, same memory) */
    gpupool_bundle *g;
    assert_int_equal(gpupool_bundle_get(p, name, 0, 0, 0, NULL, &g), 0);
    assert_int_equal(gpupool_bundle_publish_to(g, name, NULL, devs, ndev, NULL), 0);
    assert_int_equal(gpupool_bundle_release(g, NULL), 0);
  }
  return p;
}

static void check_spread(gpupool_client *c, const char *name, uint32_t seed, int device) {
  gpupool_bundle *g;
  gpupool_member m;
  assert_int_equal(gpupool_bundle_get(c, name, 0, 20000, GPUPOOL_ON_DEVICE(device), NULL, &g), 0);
  for (int i = 0; i < NSPREAD; i++) {
    assert_int_equal(gpupool_bundle_member(g, i, &m), 0);
    assert_true(th_check(m.ptr, seed + (uint32_t)i, m.size));
  }
  assert_int_equal(gpupool_bundle_release(g, NULL), 0);
}

/* A broadcast whose replica buffers are slow to make (each a slab, as on GPUs) does not stall
 * the daemon: its publish is answered, and other clients' requests after it, while most of
 * the replicas are still to be made; the getters then get them all, bit-exact. */
static void test_broadcast_made_between_requests(void **state) {
  const int devs[2] = {1, 2};
  gpupool_client *p, *c;
  (void)state;
  setenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS", "100", 1);
  start_sim(NULL);
  p = publish_spread("wide", 80, devs, 2);
  /* Another client's stats, answered after the publish: not every replica exists yet. */
  assert_true(pool_used(1) + pool_used(2) < 2 * NSPREAD * 5 * MIB);
  assert_int_equal(replica_counters().running, 1);
  c = th_connect(&D, "consumer");
  check_spread(c, "wide", 80, 1);
  check_spread(c, "wide", 80, 2);
  assert_int_equal(pool_used(1), NSPREAD * 5 * MIB);
  assert_int_equal(pool_used(2), NSPREAD * 5 * MIB);
  assert_int_equal(replica_counters().copies, 1);
  assert_int_equal(gpupool_name_unpublish(p, "wide"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  unsetenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS");
  wait_all_idle();
}

/* No room for every replica of a bundle: the making fails midway, after the get was told to
 * wait. The getter gets the reason, the replicas made so far go, and once there is room the
 * next get makes them all. */
static void test_making_fails_midway(void **state) {
  gpupool_client *p, *c, *f;
  gpupool_buffer *filler;
  gpupool_bundle *g;
  uint64_t before;
  counters k;
  (void)state;
  setenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS", "20", 1);
  start_sim(NULL);
  f = th_connect(&D, "filler");
  assert_int_equal(gpupool_buffer_alloc(f, "gpu1", 40 * MIB, 0, NULL, &filler), 0);
  before = pool_used(1);
  p = publish_spread("tight", 90, NULL, 0);
  c = th_connect(&D, "consumer");
  assert_int_equal(gpupool_bundle_get(c, "tight", 0, 20000, GPUPOOL_ON_DEVICE(1), NULL, &g), GPUPOOL_ENOSPC);
  assert_non_null(strstr(gpupool_last_error(), "no room for a replica"));
  k = replica_counters();
  assert_int_equal(k.copies, 1);
  assert_int_equal(k.failed, 1);
  assert_int_equal(k.running, 0);
  assert_int_equal(pool_used(1), before);
  assert_int_equal(gpupool_buffer_release(filler, NULL), 0);
  gpupool_client_disconnect(f);
  check_spread(c, "tight", 90, 1);
  assert_int_equal(replica_counters().copies, 2);
  assert_int_equal(gpupool_name_unpublish(p, "tight"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  unsetenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS");
  wait_all_idle();
}

/* The daemon told to stop while a broadcast's replicas are still being made: it frees them
 * and exits cleanly (th_stop requires exit status 0; under ASan a leak fails it). */
static void test_stopped_while_making(void **state) {
  const int devs[2] = {1, 2};
  gpupool_client *p;
  (void)state;
  setenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS", "100", 1);
  start_sim(NULL);
  p = publish_spread("gone", 70, devs, 2);
  assert_int_equal(replica_counters().running, 1);
  gpupool_client_disconnect(p);
  th_stop(&D);
}

/* ---- quotas ---- */

static void test_replica_over_quota(void **state) {
  gpupool_client *p, *c;
  gpupool_buffer *g;
  (void)state;
  start_sim("max_bytes_per_uid = 10M");
  p = publish_pattern("w", 6 * MIB, 2, NULL);
  c = th_connect(&D, "consumer");
  /* 6 MiB more would bring the version's tenant to 12 MiB, over its 10. */
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 1000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "replica"));
  assert_non_null(strstr(gpupool_last_error(), "max_bytes_per_uid"));
  assert_int_equal(replica_counters().copies, 0);
  assert_int_equal(pool_used(1), 0);
  /* A device with no pool: said so. */
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 1000, GPUPOOL_ON_DEVICE(5), NULL, &g, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "no pool of device 5"));
  /* Where it lies, it is still got. */
  assert_int_equal(gpupool_buffer_get(c, "w", 0, 1000, 0, NULL, &g, NULL), 0);
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "w"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  wait_all_idle();
}

/* ---- replica memory reused across versions ---- */

#define BIG (12 * MIB + 5) /* over the pools' 8M slab size: each replica a dedicated slab */

/* The inode of the file mapping of this process that holds p: a host slab is a memfd of its
 * own, so two buffers lie in one slab exactly when their mappings share an inode. */
static unsigned long map_inode(const void *p) {
  FILE *f = fopen("/proc/self/maps", "r");
  char line[512];
  unsigned long ino = 0;
  assert_non_null(f);
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi, inode;
    if (sscanf(line, "%lx-%lx %*s %*s %*s %lu", &lo, &hi, &inode) == 3 && (uintptr_t)p >= lo &&
        (uintptr_t)p < hi) {
      ino = inode;
      break;
    }
  }
  fclose(f);
  if (!ino)
    fail_msg("no file mapping of this process holds %p", p);
  return ino;
}

/* Pool gpuN as stats give it. */
static gpupool_pool_stats pool_stat(int n) {
  gpupool_client *c = th_connect(&D, "stats");
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps[8];
  int np = 0;
  assert_int_equal(gpupool_client_stats(c, &ds, ps, 8, &np), 0);
  gpupool_client_disconnect(c);
  assert_true(n < np);
  return ps[n];
}

/* Get `name` newer than `newer` on device 1, check seed's pattern: the buffer. */
static gpupool_buffer *get_on_1(gpupool_client *c, const char *name, uint64_t newer, uint32_t seed, uint64_t size) {
  gpupool_buffer *g;
  if (gpupool_buffer_get(c, name, newer, 5000, GPUPOOL_ON_DEVICE(1), NULL, &g, NULL) != 0)
    fail_msg("get of '%s' on device 1: %s", name, gpupool_last_error());
  assert_int_equal(gpupool_buffer_size(g), size);
  assert_true(th_check(gpupool_buffer_ptr(g), seed, size));
  return g;
}

/* Every slab back to the backend once nobody maps them (operator trim): the pools at their
 * baseline, kept replica slabs included. */
static void trim_to_baseline(void) {
  gpupool_client *c = th_connect(&D, "operator");
  assert_int_equal(gpupool_client_trim(c), 0);
  gpupool_client_disconnect(c);
  for (int i = 0; i < 3; i++) {
    gpupool_pool_stats ps = pool_stat(i);
    if (ps.used || ps.reserved || ps.slabs || ps.buffers)
      fail_msg("pool gpu%d after trim: used %llu, reserved %llu, %llu slabs, %llu buffers", i,
               (unsigned long long)ps.used, (unsigned long long)ps.reserved, (unsigned long long)ps.slabs,
               (unsigned long long)ps.buffers);
  }
}

/* A new version of the same size gets its replica in the slab of the previous version's,
 * freed: no new slab (on CUDA: no allocation, clearing or export), and the getter, which kept
 * the slab mapped, imports nothing. */
static void test_replica_slab_reused_across_versions(void **state) {
  gpupool_client *c;
  gpupool_buffer *g;
  gpupool_pool_stats first;
  unsigned long ino;
  (void)state;
  start_sim(NULL);
  c = th_connect(&D, "consumer");
  gpupool_client_disconnect(publish_pattern("big", BIG, 41, NULL));
  g = get_on_1(c, "big", 0, 41, BIG);
  ino = map_inode(gpupool_buffer_ptr(g));
  first = pool_stat(1);
  assert_int_equal(first.slabs, 1);
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  for (uint32_t v = 2; v <= 4; v++) {
    gpupool_pool_stats now;
    gpupool_client_disconnect(publish_pattern("big", BIG, 40 + v, NULL));
    g = get_on_1(c, "big", v - 1, 40 + v, BIG);
    if (map_inode(gpupool_buffer_ptr(g)) != ino)
      fail_msg("version %u's replica is in another slab than version 1's: a new slab per version", v);
    now = pool_stat(1);
    assert_int_equal(now.slabs, 1);
    assert_int_equal(now.reserved_high, first.reserved_high);
    assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  }
  assert_int_equal(replica_counters().copies, 4);
  assert_int_equal(replica_counters().failed, 0);
  assert_int_equal(gpupool_name_unpublish(c, "big"), 0);
  gpupool_client_disconnect(c);
  wait_all_idle();
  trim_to_baseline();
}

/* A replica's range is reused only once nobody holds the old replica: a holder of version 1's
 * replica keeps reading version 1 while versions 2 and 3 get theirs elsewhere. */
static void test_reused_replica_never_under_a_holder(void **state) {
  gpupool_client *a, *b;
  gpupool_buffer *ga, *gb;
  unsigned long ino_a, ino_b, ino;
  (void)state;
  start_sim(NULL);
  a = th_connect(&D, "holder");
  b = th_connect(&D, "getter");
  gpupool_client_disconnect(publish_pattern("big", BIG, 51, NULL));
  ga = get_on_1(a, "big", 0, 51, BIG);
  ino_a = map_inode(gpupool_buffer_ptr(ga));
  /* Version 2: a still holds version 1's replica, so version 2's goes elsewhere. */
  gpupool_client_disconnect(publish_pattern("big", BIG, 52, NULL));
  gb = get_on_1(b, "big", 1, 52, BIG);
  ino_b = map_inode(gpupool_buffer_ptr(gb));
  assert_true(ino_b != ino_a);
  assert_true(th_check(gpupool_buffer_ptr(ga), 51, BIG));
  assert_int_equal(gpupool_buffer_release(gb, NULL), 0);
  /* Version 3: version 2's slab is free, version 1's still held. */
  gpupool_client_disconnect(publish_pattern("big", BIG, 53, NULL));
  gb = get_on_1(b, "big", 2, 53, BIG);
  assert_true(map_inode(gpupool_buffer_ptr(gb)) == ino_b);
  assert_true(th_check(gpupool_buffer_ptr(ga), 51, BIG));
  assert_int_equal(pool_stat(1).slabs, 2);
  assert_int_equal(gpupool_buffer_release(gb, NULL), 0);
  /* The holder lets go: version 4 takes one of the two, and no third is made. */
  assert_int_equal(gpupool_buffer_release(ga, NULL), 0);
  gpupool_client_disconnect(publish_pattern("big", BIG, 54, NULL));
  gb = get_on_1(b, "big", 3, 54, BIG);
  ino = map_inode(gpupool_buffer_ptr(gb));
  assert_true(ino == ino_a || ino == ino_b);
  assert_int_equal(pool_stat(1).slabs, 2);
  assert_int_equal(gpupool_buffer_release(gb, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(b, "big"), 0);
  gpupool_client_disconnect(a);
  gpupool_client_disconnect(b);
  wait_all_idle();
  trim_to_baseline();
}

/* A bundle broadcast again and again (the same buffers published with new bytes, as a
 * trainer does): one chained copy per publish, and from the second on, every replica in the
 * slab of the one before on its device. */
static void test_broadcast_steady_state_reuses(void **state) {
  gpupool_member_spec specs[2] = {{"a", 9 * MIB + 7, NULL}, {"b", 10 * MIB, NULL}};
  const int devs[2] = {1, 2};
  gpupool_client *p, *c;
  gpupool_bundle *b, *g;
  gpupool_member m;
  unsigned long ino[2][2] = {{0}};
  uint64_t high[3] = {0}, copies;
  (void)state;
  start_sim(NULL);
  p = th_connect(&D, "producer");
  c = th_connect(&D, "consumer");
  assert_int_equal(gpupool_bundle_alloc(p, "gpu0", specs, 2, 0, 0, NULL, &b), 0);
  for (uint32_t v = 1; v <= 3; v++) {
    for (int i = 0; i < 2; i++) {
      assert_int_equal(gpupool_bundle_member(b, i, &m), 0);
      th_fill(m.ptr, 60 * v + (uint32_t)i, m.size);
    }
    copies = replica_counters().copies;
    assert_int_equal(gpupool_bundle_publish_to(b, "dict", NULL, devs, 2, NULL), 0);
    for (int d = 0; d < 2; d++) {
      if (gpupool_bundle_get(c, "dict", v - 1, 5000, GPUPOOL_ON_DEVICE(devs[d]), NULL, &g) != 0)
        fail_msg("version %u on device %d: %s", v, devs[d], gpupool_last_error());
      assert_int_equal(gpupool_bundle_version(g), v);
      for (int i = 0; i < 2; i++) {
        unsigned long at;
        assert_int_equal(gpupool_bundle_member(g, i, &m), 0);
        assert_int_equal(m.size, specs[i].size);
        assert_true(th_check(m.ptr, 60 * v + (uint32_t)i, m.size));
        at = map_inode(m.ptr);
        if (v == 1)
          ino[d][i] = at;
        else if (at != ino[d][i])
          fail_msg("version %u: member %d's replica on device %d is in a new slab", v, i, devs[d]);
      }
      assert_int_equal(gpupool_bundle_release(g, NULL), 0);
    }
    assert_int_equal(replica_counters().copies, copies + 1); /* one chained job per publish */
    for (int d = 1; d <= 2; d++) {
      if (v == 1)
        high[d] = pool_stat(d).reserved_high;
      else
        assert_int_equal(pool_stat(d).reserved_high, high[d]);
    }
  }
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(p, "dict"), 0);
  gpupool_client_disconnect(c);
  gpupool_client_disconnect(p);
  wait_all_idle();
  trim_to_baseline();
}

/* A kept replica slab is memory nobody uses: a placement that needs its room takes it back
 * (here a buffer that fits the pool only without it). */
static void test_kept_replica_slab_gives_way(void **state) {
  gpupool_client *c, *f;
  gpupool_buffer *g, *big;
  (void)state;
  start_sim(NULL);
  c = th_connect(&D, "consumer");
  gpupool_client_disconnect(publish_pattern("big", BIG, 61, NULL));
  g = get_on_1(c, "big", 0, 61, BIG);
  assert_int_equal(gpupool_buffer_release(g, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "big"), 0);
  gpupool_client_disconnect(c);
  wait_all_idle();
  assert_int_equal(pool_stat(1).slabs, 1); /* kept for a next version */
  /* 56 MiB of the pool's 64 fit only once the 14 MiB slab goes. */
  f = th_connect(&D, "filler");
  if (gpupool_buffer_alloc(f, "gpu1", 56 * MIB, 0, NULL, &big) != 0)
    fail_msg("56 MiB in gpu1 next to a kept replica slab: %s", gpupool_last_error());
  assert_int_equal(pool_stat(1).slabs, 1);
  assert_int_equal(gpupool_buffer_release(big, NULL), 0);
  gpupool_client_disconnect(f);
  wait_all_idle();
  trim_to_baseline();
}

int main(void) {
  return TS_RUN_TESTS(NULL, teardown, test_buffer_replica_bit_exact, test_bundle_replica_bit_exact,
                      test_eight_getters_one_copy, test_more_copies_than_slots, test_replica_freed_with_version,
                      test_getter_killed_while_waiting, test_copy_failure_fails_waiters_then_retries,
                      test_daemon_killed_mid_copy, test_getters_waiting_for_the_publish, test_broadcast_on_publish,
                      test_replica_over_quota, test_broadcast_made_between_requests, test_making_fails_midway,
                      test_stopped_while_making, test_replica_slab_reused_across_versions,
                      test_reused_replica_never_under_a_holder, test_broadcast_steady_state_reuses,
                      test_kept_replica_slab_gives_way);
}
