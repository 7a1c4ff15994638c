/*
 * Peers and device memory: two real gpupoolds on 127.0.0.1 (UCX over TCP on lo) whose pools
 * stand for GPUs (host backend, `device = N`: memfd memory the daemon treats as device memory,
 * as the replicas tests do), so a fetch goes device -> pinned host chunk -> network -> pinned
 * host chunk -> device, through the backend's copy jobs, in a bounded ring of chunks per
 * transfer. Buffers (several rings' worth) and bundles arrive bit-exact, also from a host
 * pool into a device pool and back; gpupoolctl peers says how device memory moves, counts the
 * staged bytes and shows the staging memory back to nothing in use once a transfer ends; a
 * transfer holds at most its ring. A source killed mid-staging, a fetching daemon killed or
 * stopped mid-staging, and a getter killed mid-staging, leave no staging chunk, buffer or hold behind on the other side, and
 * the next fetch works; two daemons serving each other more transfers than they have staging
 * chunks all finish; a copy that fails on the serving side fails that fetch alone, with its
 * reason, and the connection stays. Copies are slowed down (GPUPOOL_TEST_COPY_DELAY_MS) where a test must
 * kill something while they run. Skipped (77) when gpupoold was built without UCX.
 */
#include <arpa/inet.h>
#include <inttypes.h>
#include <netinet/in.h>

#include "harness.h"

#define SECRET "0123456789abcdef-shared-peer-secret"
/* What a transfer may hold of staging memory at most (STAGE_RING x STAGE_SLOT, built as 4 x 8
 * MiB), and the size of one slot. */
#define RING_MAX (32ull << 20)
#define SLOT (8ull << 20)

typedef struct {
  th_daemon d;
  int port;
  char secret[400];
} node;

static node A, B;

static int free_port(void) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM, 0), port;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_true(fd >= 0);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  port = ntohs(a.sin_port);
  close(fd);
  return port;
}

static void node_prepare(node *n) {
  FILE *f;
  th_prepare(&n->d);
  n->port = free_port();
  snprintf(n->secret, sizeof n->secret, "%s/secret", n->d.dir);
  f = fopen(n->secret, "w");
  assert_non_null(f);
  fputs(SECRET, f);
  fclose(f);
  assert_int_equal(chmod(n->secret, 0600), 0);
}

/* Pools that stand for GPU 0 and 1, and a host pool; `first` names the pool a fetched copy
 * goes to (the first pool in the file). */
#define GPU0 "[pool gpu0]\nkind = host\ndevice = 0\ncapacity = 2G\nslab_size = 64M\n"
#define GPU1 "[pool gpu1]\nkind = host\ndevice = 1\ncapacity = 2G\nslab_size = 64M\n"
#define HOSTP "[pool mem]\nkind = host\ncapacity = 2G\nslab_size = 64M\n"

static char *peers_json(const node *n);

/* More lines for the [peer] section of the next node_start (then reset). */
static const char *next_peer_lines = "";

/* Start n with `pools`, peering with o (named peer_name there). */
static void node_start(node *n, const char *pools, const char *peer_name, const node *o) {
  char conf[4096];
  snprintf(conf, sizeof conf,
           "[daemon]\npeer_listen = 127.0.0.1:%d\npeer_secret_file = %s\npeer_fetch_timeout_ms = 20000\n%s"
           "[tenant t]\nuids = %u\nexport_peers = *\n[peer %s]\naddress = 127.0.0.1:%d\n%s",
           n->port, n->secret, pools, (unsigned)getuid(), peer_name, o->port, next_peer_lines);
  next_peer_lines = "";
  th_write_conf(&n->d, conf);
  th_start(&n->d, 1, NULL);
  /* The client socket accepts before the peer listener is bound (the daemon listens first,
   * then starts its peers): an answered request means the start is over. */
  free(peers_json(n));
}

/* A serves with pools_a, B fetches into pools_b. */
static void pair_start(const char *pools_a, const char *pools_b) {
  node_prepare(&A);
  node_prepare(&B);
  node_start(&A, pools_a, "B", &B);
  node_start(&B, pools_b, "A", &A);
}

static void pair_stop(void) {
  if (B.d.pid)
    th_stop(&B.d);
  if (A.d.pid)
    th_stop(&A.d);
}

static void fill(uint8_t *p, size_t len, uint32_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < len; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    memcpy(p + i, &x, len - i < 8 ? len - i : 8);
  }
}

static int same(const uint8_t *p, size_t len, uint32_t seed) {
  uint8_t *want = malloc(len);
  int eq;
  assert_non_null(want);
  fill(want, len, seed);
  eq = !memcmp(p, want, len);
  free(want);
  return eq;
}

/* Publish len bytes of pattern seed under name in pool (NULL: the first) on n. */
static void publish(node *n, const char *pool, const char *name, size_t len, uint32_t seed) {
  gpupool_client *c = th_connect(&n->d, "producer");
  gpupool_buffer *b = NULL;
  if (gpupool_buffer_alloc(c, pool, len, 0, NULL, &b) != 0)
    fail_msg("alloc of %zu bytes in %s: %s", len, pool ? pool : "the first pool", gpupool_last_error());
  fill(gpupool_buffer_ptr(b), len, seed);
  assert_int_equal(gpupool_buffer_publish(b, name, NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

/* `gpupoolctl --json peers` of n (malloc'd). */
static char *peers_json(const node *n) {
  char cmd[1024], *text = NULL;
  size_t cap = 0, len = 0;
  FILE *p;
  snprintf(cmd, sizeof cmd, "%s --socket %s --json peers", GPUPOOLCTL_PATH, n->d.sock);
  p = popen(cmd, "r");
  assert_non_null(p);
  for (;;) {
    size_t got;
    if (len + 4096 > cap) {
      cap = len + 65536;
      text = realloc(text, cap);
      assert_non_null(text);
    }
    if (!(got = fread(text + len, 1, cap - len - 1, p)))
      break;
    len += got;
  }
  text[len] = '\0';
  pclose(p);
  return text;
}

static uint64_t jnum(const char *text, const char *key) {
  char k[64];
  const char *p;
  snprintf(k, sizeof k, "\"%s\":", key);
  p = strstr(text, k);
  return p ? strtoull(p + strlen(k), NULL, 10) : UINT64_MAX;
}

/* A number of n's AdminPeers: the daemon's (top level, before the peers) or its one peer's. */
static uint64_t peers_num(const node *n, const char *key) {
  char *t = peers_json(n), *peers = strstr(t, "\"peers\":");
  uint64_t v;
  if (!strncmp(key, "staging_", 8) && peers)
    *peers = '\0';
  v = jnum(t, key);
  if (v == UINT64_MAX) {
    fprintf(stderr, "gpupoolctl peers: %s\n", t);
    free(t);
    fail_msg("no %s in gpupoolctl peers", key);
  }
  free(t);
  return v;
}

/* Wait (bounded) until n's staging chunks are all back and n holds nothing for peers. */
static void expect_staging_free(const node *n, const char *what) {
  uint64_t end = th_now_ms() + 15000, use = 1, serving = 1;
  while (th_now_ms() < end) {
    use = peers_num(n, "staging_in_use");
    serving = peers_num(n, "serving_now");
    if (!use && !serving)
      return;
    th_sleep_ms(20);
  }
  th_dump_log(&n->d);
  fail_msg("%s: %" PRIu64 " bytes of staging still in use, %" PRIu64 " versions still served", what, use, serving);
}

/* Wait (bounded) until n has no buffer, hold or used byte left. */
static void expect_baseline(const node *n, const char *what) {
  uint64_t end = th_now_ms() + 15000;
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps;
  do {
    th_stats(&n->d, &ds, &ps);
    if (!ds.buffers && !ds.holds && !ps.used)
      return;
    th_sleep_ms(20);
  } while (th_now_ms() < end);
  th_dump_log(&n->d);
  fail_msg("%s: %" PRIu64 " buffers, %" PRIu64 " holds, %" PRIu64 " bytes still in use", what, (uint64_t)ds.buffers,
           (uint64_t)ds.holds, (uint64_t)ps.used);
}

/* Lines of n's log that contain needle. */
static int log_count(const node *n, const char *needle) {
  FILE *f = fopen(n->d.log, "r");
  char line[4096];
  int count = 0;
  if (!f)
    return 0;
  while (fgets(line, sizeof line, f))
    count += strstr(line, needle) != NULL;
  fclose(f);
  return count;
}

static int log_has(const node *n, const char *needle) { return log_count(n, needle) > 0; }

static void get_check(node *n, const char *name, size_t len, uint32_t seed) {
  gpupool_client *c = th_connect(&n->d, "consumer");
  gpupool_buffer *b = NULL;
  if (gpupool_buffer_get(c, name, 0, 20000, 0, NULL, &b, NULL) != 0) {
    th_dump_log(&A.d);
    th_dump_log(&B.d);
    fail_msg("get %s: %s", name, gpupool_last_error());
  }
  assert_int_equal(gpupool_buffer_size(b), len);
  if (!same(gpupool_buffer_ptr(b), len, seed))
    fail_msg("%s differs", name);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, name), 0);
  gpupool_client_disconnect(c);
}

static int skip_without_ucx(void) {
  char cmd[512], out[256] = "";
  FILE *p;
  snprintf(cmd, sizeof cmd, "%s --version", GPUPOOLD_PATH);
  p = popen(cmd, "r");
  if (p) {
    while (fgets(out, sizeof out, p))
      if (!strncmp(out, "peers: ", 7))
        break;
    pclose(p);
  }
  if (strncmp(out, "peers: ucx", 10) != 0) {
    fprintf(stderr, "skipped: gpupoold %s", out[0] ? out : "says nothing about peers\n");
    return 1;
  }
  return 0;
}

/* Device to device: a buffer of several rings' worth (the ring is reused, the serving side
 * waits for credit), a small one, and a bundle of many small members, bit-exact. */
static void test_device_to_device(void **state) {
  enum { N = 300 };
  const size_t big = (size_t)(5 * RING_MAX / 2) + 12, small = 4100;
  gpupool_member_spec specs[N];
  char names[N][32];
  gpupool_client *c;
  gpupool_bundle *b = NULL, *g = NULL;
  char *t;
  (void)state;
  pair_start(GPU0, GPU1 GPU0);
  t = peers_json(&B);
  if (!strstr(t, "\"device_memory\":\"staged through pinned host memory")) {
    fprintf(stderr, "gpupoolctl peers: %s\n", t);
    free(t);
    fail_msg("B does not say that device memory is staged");
  }
  free(t);
  assert_true(log_has(&A, "peers: device memory: staged through pinned host memory"));
  publish(&A, NULL, "big", big, 1);
  publish(&A, NULL, "small", small, 2);
  get_check(&B, "A:big", big, 1);
  get_check(&B, "A:small", small, 2);
  /* Both sides staged every byte, and no transfer held more than its ring. */
  assert_int_equal(peers_num(&A, "bytes_staged"), big + small);
  assert_int_equal(peers_num(&B, "bytes_staged"), big + small);
  assert_true(peers_num(&A, "staging_made") <= RING_MAX);
  assert_true(peers_num(&B, "staging_made") <= RING_MAX);
  expect_staging_free(&A, "serving side");
  expect_staging_free(&B, "fetching side");

  c = th_connect(&A.d, "producer");
  memset(specs, 0, sizeof specs);
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "layer.%d.weight", i);
    specs[i].name = names[i];
    specs[i].size = 1000 + (uint64_t)i * 977;
  }
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, N, 0, 0, NULL, &b), 0);
  for (int i = 0; i < N; i++) {
    gpupool_member m;
    assert_int_equal(gpupool_bundle_member(b, i, &m), 0);
    fill(m.ptr, m.size, 100 + (uint32_t)i);
  }
  assert_int_equal(gpupool_bundle_publish(b, "model", NULL, NULL), 0);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  c = th_connect(&B.d, "consumer");
  assert_int_equal(gpupool_bundle_get(c, "A:model", 0, 20000, 0, NULL, &g), 0);
  assert_int_equal(gpupool_bundle_count(g), N);
  for (int i = 0; i < N; i++) {
    gpupool_member m;
    assert_int_equal(gpupool_bundle_member(g, i, &m), 0);
    assert_string_equal(m.name, names[i]);
    assert_int_equal(m.size, specs[i].size);
    if (!same(m.ptr, m.size, 100 + (uint32_t)i))
      fail_msg("member %d differs", i);
  }
  assert_int_equal(gpupool_bundle_release(g, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "A:model"), 0);
  gpupool_client_disconnect(c);
  expect_staging_free(&A, "serving side after the bundle");
  expect_staging_free(&B, "fetching side after the bundle");
  expect_baseline(&B, "fetching side after its names went");
  pair_stop();
}

/* Host memory into device memory (the host source sends within the fetching side's credit)
 * and device memory into host memory (no window: the fetching side maps its copy). */
static void test_host_and_device(void **state) {
  const size_t len = (size_t)(3 * SLOT) + 4096 + 20;
  (void)state;
  pair_start(HOSTP GPU0, GPU0);
  publish(&A, "mem", "from-host", len, 3);
  publish(&A, "gpu0", "from-device", len, 4);
  get_check(&B, "A:from-host", len, 3);
  get_check(&B, "A:from-device", len, 4);
  /* A staged only what lay in its device pool; B staged both into its device pool. */
  assert_int_equal(peers_num(&A, "bytes_staged"), len);
  assert_int_equal(peers_num(&B, "bytes_staged"), 2 * len);
  expect_staging_free(&A, "serving side");
  expect_staging_free(&B, "fetching side");
  pair_stop();

  pair_start(GPU0, HOSTP);
  publish(&A, NULL, "from-device", len, 5);
  get_check(&B, "A:from-device", len, 5);
  assert_int_equal(peers_num(&A, "bytes_staged"), len);
  assert_int_equal(peers_num(&B, "bytes_staged"), 0);
  expect_staging_free(&A, "serving side");
  pair_stop();
}

#define BIG ((size_t)256 << 20)

/* Start a getter of A:big on B in a child expecting failure (fail = 1) or success; wait
 * until both sides stage it. */
static pid_t start_big_fetch(int fail) {
  pid_t p = fork();
  uint64_t end;
  if (p == 0) {
    gpupool_client *c = NULL;
    gpupool_buffer *b = NULL;
    int rc;
    if (gpupool_client_connect(B.d.sock, "getter", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0)
      _exit(10);
    rc = gpupool_buffer_get(c, "A:big", 0, 30000, 0, NULL, &b, NULL);
    if (fail ? rc == 0 : rc != 0) {
      fprintf(stderr, "getter: %d (%s)\n", rc, gpupool_last_error());
      _exit(11);
    }
    _exit(0);
  }
  end = th_now_ms() + 20000;
  while (th_now_ms() < end && (!peers_num(&A, "staging_in_use") || !peers_num(&B, "staging_in_use")))
    th_sleep_ms(5);
  if (!peers_num(&A, "staging_in_use") || !peers_num(&B, "staging_in_use"))
    fail_msg("the transfer never staged on both sides");
  return p;
}

/* The source dies mid-staging: the fetching side keeps no staging chunk, buffer or hold, and
 * a fetch from the restarted source works. */
static void test_source_killed(void **state) {
  int st = 0;
  pid_t p;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "20", 1);
  pair_start(GPU0, GPU0);
  unsetenv("GPUPOOL_TEST_COPY_DELAY_MS");
  publish(&A, NULL, "big", BIG, 7);
  p = start_big_fetch(1);
  kill(A.d.pid, SIGKILL);
  assert_int_equal(ts_wait_pid(A.d.pid, 10000, 1, NULL), 0);
  A.d.pid = 0;
  assert_int_equal(ts_wait_pid(p, 30000, 1, &st), 0);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  expect_staging_free(&B, "fetching side after the source died");
  expect_baseline(&B, "fetching side after the source died");
  /* The source comes back (a new daemon on A's port): the next fetch works. */
  ts_daemon_remove(&A.d);
  {
    int port = A.port;
    node_prepare(&A);
    A.port = port;
  }
  node_start(&A, GPU0, "B", &B);
  publish(&A, NULL, "big", (size_t)40 << 20, 8);
  get_check(&B, "A:big", (size_t)40 << 20, 8);
  expect_staging_free(&B, "fetching side after the retry");
  expect_baseline(&B, "fetching side after the retry");
  pair_stop();
}

/* The fetching daemon dies mid-staging: the source ends the serve, gives back its chunks
 * (those UCX still sends from once their sends end) and serves the next fetcher. */
static void test_fetcher_killed(void **state) {
  pid_t p;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "20", 1);
  pair_start(GPU0, GPU0);
  unsetenv("GPUPOOL_TEST_COPY_DELAY_MS");
  publish(&A, NULL, "big", BIG, 9);
  p = start_big_fetch(1);
  kill(B.d.pid, SIGKILL);
  assert_int_equal(ts_wait_pid(B.d.pid, 10000, 1, NULL), 0);
  B.d.pid = 0;
  assert_int_equal(ts_wait_pid(p, 30000, 1, NULL), 0);
  expect_staging_free(&A, "serving side after the fetcher died");
  ts_daemon_remove(&B.d);
  {
    int port = B.port;
    node_prepare(&B);
    B.port = port;
  }
  node_start(&B, GPU0, "A", &A);
  get_check(&B, "A:big", BIG, 9);
  expect_staging_free(&A, "serving side after the retry");
  expect_staging_free(&B, "fetching side after the retry");
  pair_stop();
}

/* The getter dies mid-staging: the fetch runs to its end and, nobody waiting any more, is
 * dropped; both sides let go of everything, and the next get fetches again. */
static void test_getter_killed(void **state) {
  pid_t p;
  uint64_t end;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "5", 1);
  pair_start(GPU0, GPU0);
  unsetenv("GPUPOOL_TEST_COPY_DELAY_MS");
  publish(&A, NULL, "big", BIG, 11);
  p = start_big_fetch(0);
  kill(p, SIGKILL);
  assert_int_equal(ts_wait_pid(p, 10000, 1, NULL), 0);
  end = th_now_ms() + 30000;
  while (th_now_ms() < end && (peers_num(&B, "fetches_in_flight") || peers_num(&A, "serving_now")))
    th_sleep_ms(20);
  expect_staging_free(&A, "serving side after the getter died");
  expect_staging_free(&B, "fetching side after the getter died");
  expect_baseline(&B, "fetching side after the getter died");
  get_check(&B, "A:big", BIG, 11);
  expect_baseline(&B, "fetching side after the retry");
  pair_stop();
}

/* The fetching daemon stops mid-staging: it exits cleanly (its copies stopped, its chunks
 * given back before the backend goes), and the source lets everything go. */
static void test_fetcher_stops(void **state) {
  int st = 0;
  pid_t p;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "20", 1);
  pair_start(GPU0, GPU0);
  unsetenv("GPUPOOL_TEST_COPY_DELAY_MS");
  publish(&A, NULL, "big", BIG, 10);
  p = start_big_fetch(1);
  th_stop(&B.d); /* requires a clean exit */
  assert_int_equal(ts_wait_pid(p, 30000, 1, &st), 0);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  expect_staging_free(&A, "serving side after the fetcher stopped");
  th_stop(&A.d);
}

/* Two daemons serving each other more staged transfers at once than they have staging slots
 * for. A serve takes its slots as soon as its version is there, a fetch when the reply comes:
 * if serves could take every slot, each side's fetches would wait for slots held by serves
 * that wait for those very fetches' credit, and all would time out. Here each daemon has 8
 * slots and three fetches of the other's name under three local names (PEER:NAME,
 * PEER:TENANT/NAME and a prefix) wait at the source; both sides then publish at once, and
 * one publish serves all three at once (9 slots wanted), with slots slow to make (the
 * publish's serves hold the loop while the other side's replies arrive). */
static const char *const VIA[3] = {"%s:%s", "%s:t/%s", "r/%s"};

static void test_both_ways_many(void **state) {
  const size_t len = (size_t)3 * SLOT;
  pid_t kids[6], pa, pb;
  int sa = 0, sb = 0;
  (void)state;
  setenv("GPUPOOL_TEST_STAGE_SLOTS", "8", 1);
  setenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS", "300", 1);
  node_prepare(&A);
  node_prepare(&B);
  next_peer_lines = "prefix = r/\n";
  node_start(&A, GPU0, "B", &B);
  next_peer_lines = "prefix = r/\n";
  node_start(&B, GPU0, "A", &A);
  unsetenv("GPUPOOL_TEST_STAGE_SLOTS");
  unsetenv("GPUPOOL_TEST_SLAB_ALLOC_DELAY_MS");
  for (int k = 0; k < 6; k++) {
    pid_t p = fork();
    if (p == 0) {
      int from_a = k % 2;
      gpupool_client *c = NULL;
      gpupool_buffer *b = NULL;
      char name[64];
      snprintf(name, sizeof name, VIA[k / 2], from_a ? "A" : "B", from_a ? "x" : "y");
      if (k / 2 == 2)
        snprintf(name, sizeof name, VIA[2], from_a ? "x" : "y");
      if (gpupool_client_connect(from_a ? B.d.sock : A.d.sock, "getter", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0)
        _exit(10);
      if (gpupool_buffer_get(c, name, 0, 40000, 0, NULL, &b, NULL) != 0) {
        fprintf(stderr, "get %s: %s\n", name, gpupool_last_error());
        _exit(11);
      }
      if (gpupool_buffer_size(b) != len || !same(gpupool_buffer_ptr(b), len, from_a ? 21 : 22)) {
        fprintf(stderr, "%s differs\n", name);
        _exit(12);
      }
      _exit(0);
    }
    assert_true(p > 0);
    kids[k] = p;
  }
  th_sleep_ms(1500); /* every get waits at its source */
  pa = fork();
  if (pa == 0) {
    publish(&A, NULL, "x", len, 21);
    _exit(0);
  }
  pb = fork();
  if (pb == 0) {
    publish(&B, NULL, "y", len, 22);
    _exit(0);
  }
  assert_int_equal(ts_wait_pid(pa, 30000, 1, &sa), 0);
  assert_int_equal(ts_wait_pid(pb, 30000, 1, &sb), 0);
  assert_true(WIFEXITED(sa) && WEXITSTATUS(sa) == 0 && WIFEXITED(sb) && WEXITSTATUS(sb) == 0);
  for (int k = 0; k < 6; k++) {
    int st = 0;
    assert_int_equal(ts_wait_pid(kids[k], 60000, 1, &st), 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      th_dump_log(&A.d);
      th_dump_log(&B.d);
      fail_msg("getter %d failed (status %d)", k, st);
    }
  }
  expect_staging_free(&A, "A after fetching and serving at once");
  expect_staging_free(&B, "B after fetching and serving at once");
  pair_stop();
}

/* A get of name on n must fail (within timeout_ms) and its message say both want_a and want_b;
 * `what` names the failure the test caused. */
static void get_fails_with(node *n, const char *name, int timeout_ms, const char *want_a, const char *want_b,
                           const char *what) {
  gpupool_client *c = th_connect(&n->d, "getter");
  gpupool_buffer *b = NULL;
  const char *err;
  if (gpupool_buffer_get(c, name, 0, timeout_ms, 0, NULL, &b, NULL) == 0)
    fail_msg("the get of %s succeeded although %s", name, what);
  err = gpupool_last_error();
  if (!strstr(err, want_a) || !strstr(err, want_b)) {
    th_dump_log(&A.d);
    th_dump_log(&B.d);
    fail_msg("the getter of %s was not told that %s: %s", name, what, err);
  }
  gpupool_client_disconnect(c);
}

/* A device copy on the serving side fails mid-transfer (GPUPOOL_TEST_COPY_FAIL on A): that
 * fetch alone fails, and its getter is told the serving side's reason; the connection between
 * the daemons stays up (B connected to A once in all), both sides let go of everything, and
 * the next fetch of the same name, on the same connection, works. */
static void test_source_copy_fails(void **state) {
  (void)state;
  node_prepare(&A);
  node_prepare(&B);
  setenv("GPUPOOL_TEST_COPY_FAIL", "1", 1); /* A's first copy job fails after 1 MiB */
  node_start(&A, GPU0, "B", &B);
  unsetenv("GPUPOOL_TEST_COPY_FAIL");
  node_start(&B, GPU0, "A", &A);
  publish(&A, NULL, "big", (size_t)40 << 20, 21);
  get_fails_with(&B, "A:big", 20000, "failed on purpose", "retry", "A's copy out of device memory failed");
  expect_staging_free(&A, "serving side after its copy failed");
  expect_staging_free(&B, "fetching side after the peer's copy failed");
  expect_baseline(&B, "fetching side after the peer's copy failed");
  get_check(&B, "A:big", (size_t)40 << 20, 21);
  if (log_count(&B, "peers: connected to A") != 1) {
    th_dump_log(&B.d);
    fail_msg("the connection to A was closed and made again: one failed copy took down the link");
  }
  expect_staging_free(&A, "serving side after the retry");
  pair_stop();
}

/* A daemon of an older peer revision (GPUPOOL_TEST_PEER_REVISION=1: before staged device
 * memory, the credit window and PeerFailed) and this one refuse each other at connect, each
 * naming both revisions, instead of failing fetches later (every other test here fetches
 * between daemons of the same revision). */
static void test_peer_revision_mismatch(void **state) {
  (void)state;
  node_prepare(&A);
  node_prepare(&B);
  node_start(&A, GPU0, "B", &B);
  setenv("GPUPOOL_TEST_PEER_REVISION", "1", 1);
  node_start(&B, GPU0, "A", &A);
  unsetenv("GPUPOOL_TEST_PEER_REVISION");
  publish(&A, NULL, "w", (size_t)1 << 20, 31);
  get_fails_with(&B, "A:w", 10000, "peer revision 1", "same gpupool version",
                 "B (peer revision 1) fetched from A (revision 3)");
  {
    /* A writes its log line after its refusal went out: B's getter may hear first. */
    uint64_t end = th_now_ms() + 5000;
    while (!log_has(&A, "peer revision 1, this daemon speaks 3") && th_now_ms() < end)
      th_sleep_ms(10);
    if (!log_has(&A, "peer revision 1, this daemon speaks 3"))
      fail_msg("the serving daemon did not log why it refused the older peer");
  }
  expect_baseline(&B, "the fetching side after the refusal");
  expect_staging_free(&A, "the serving side after the refusal");
  pair_stop();
}

int main(void) {
  if (skip_without_ucx())
    return 77;
  setenv("UCX_TLS", "tcp", 1);
  setenv("UCX_NET_DEVICES", "lo", 1);
  signal(SIGPIPE, SIG_IGN);
  return TS_RUN_TESTS(NULL, NULL, test_device_to_device, test_host_and_device, test_source_killed,
                      test_getter_killed, test_fetcher_killed, test_fetcher_stops, test_both_ways_many,
                      test_source_copy_fails, test_peer_revision_mismatch);
}
