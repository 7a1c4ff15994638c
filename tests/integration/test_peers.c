/*
 * Peers: two and three real gpupoolds on 127.0.0.1 (UCX over TCP on lo), each with its own
 * socket, fetching names from each other. Buffers and bundles arrive bit-exact with the
 * peer's version numbers and newer_than works across; a wrong secret is refused and logged
 * on both sides; a tenant that does not export is not reachable; a source killed mid-fetch
 * and a getter killed mid-fetch leave nothing behind on either side, the getter is told why,
 * and the next fetch works; 200 local getters of one version cause one transfer; a daemon
 * re-serves what it fetched (A -> B -> C). Counts come from AdminPeers (gpupoolctl peers).
 * Skipped (77) when gpupoold was built without UCX.
 */
#include <arpa/inet.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/inotify.h>

#include "harness.h"

#define SECRET "0123456789abcdef-shared-peer-secret"

typedef struct {
  th_daemon d;
  int port;
  char secret[400];
} node;

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

static void write_secret(node *n, const char *secret) {
  FILE *f;
  snprintf(n->secret, sizeof n->secret, "%s/secret", n->d.dir);
  f = fopen(n->secret, "w");
  assert_non_null(f);
  fputs(secret, f);
  fclose(f);
  assert_int_equal(chmod(n->secret, 0600), 0);
}

/* What node_start writes for the next daemon: its pool's capacity, and more [daemon] lines. */
static const char *next_capacity = "3G", *next_daemon_lines = "";

/* Prepare node n (its dir, port and secret); start it later with node_start. */
static void node_prepare(node *n, const char *secret) {
  th_prepare(&n->d);
  n->port = free_port();
  write_secret(n, secret);
}

/* Start n with [peer NAME] sections for the nodes named (name, node, ...) and tenant t
 * (this uid) exporting to `exports` (NULL: no export_peers line). */
static void node_start(node *n, const char *exports, ...) {
  char conf[4096];
  int off;
  va_list ap;
  const char *name;
  off = snprintf(conf, sizeof conf,
                 "[daemon]\npeer_listen = 127.0.0.1:%d\npeer_secret_file = %s\npeer_fetch_timeout_ms = 20000\n"
                 "metrics_textfile = %s/metrics.prom\nmetrics_interval_ms = 100\n%s"
                 "[pool default]\nkind = host\ncapacity = %s\nslab_size = 64M\n"
                 "[tenant t]\nuids = %u\n%s%s%s",
                 n->port, n->secret, n->d.dir, next_daemon_lines, next_capacity, (unsigned)getuid(), exports ? "export_peers = " : "", exports ? exports : "",
                 exports ? "\n" : "");
  va_start(ap, exports);
  while ((name = va_arg(ap, const char *))) {
    node *o = va_arg(ap, node *);
    off += snprintf(conf + off, sizeof conf - (size_t)off, "[peer %s]\naddress = 127.0.0.1:%d\n", name, o->port);
  }
  va_end(ap);
  th_write_conf(&n->d, conf);
  th_start(&n->d, 1, NULL);
  next_capacity = "3G";
  next_daemon_lines = "";
}

static void node_stop(node *n) { th_stop(&n->d); }

/* Fill p with a pattern of seed. */
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

/* Publish len bytes of pattern seed under name on n's daemon: the version made. */
static uint64_t publish(node *n, const char *name, size_t len, uint32_t seed) {
  gpupool_client *c = th_connect(&n->d, "producer");
  gpupool_buffer *b = NULL;
  uint64_t v = 0;
  int64_t shape[1] = {(int64_t)len / 4};
  gpupool_tensor_meta m = {.dtype_code = 2, .dtype_bits = 32, .dtype_lanes = 1, .ndim = 1};
  m.shape[0] = shape[0];
  assert_int_equal(gpupool_buffer_alloc(c, NULL, len, 0, NULL, &b), 0);
  fill(gpupool_buffer_ptr(b), len, seed);
  assert_int_equal(gpupool_buffer_publish(b, name, &m, NULL, &v), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  return v;
}

/* One peer's row of n's AdminPeers. */
typedef struct {
  char state[32], last_error[512];
  uint64_t in_flight, fetches, failures, bytes, served, serving_now;
} peer_row;

/* The number after "key": in text (0 when absent). */
static uint64_t jnum(const char *text, const char *key) {
  char k[64];
  const char *p;
  snprintf(k, sizeof k, "\"%s\":", key);
  p = strstr(text, k);
  return p ? strtoull(p + strlen(k), NULL, 10) : 0;
}

static void jstr_(const char *text, const char *key, char *out, size_t len) {
  char k[64];
  const char *p, *e;
  snprintf(k, sizeof k, "\"%s\":\"", key);
  out[0] = '\0';
  if (!(p = strstr(text, k)))
    return;
  p += strlen(k);
  e = strchr(p, '"');
  snprintf(out, len, "%.*s", (int)(e ? e - p : 0), p);
}

/* n's row for peer, as `gpupoolctl --json peers` shows it. */
static int peer_info(node *n, const char *peer, peer_row *out) {
  char cmd[1024], *text = NULL, *at, want[64];
  size_t cap = 0, len = 0;
  FILE *p;
  snprintf(cmd, sizeof cmd, "%s --socket %s --json peers", GPUPOOLCTL_PATH, n->d.sock);
  p = popen(cmd, "r");
  assert_non_null(p);
  for (;;) {
    if (len + 4096 > cap) {
      cap = len + 65536;
      text = realloc(text, cap);
      assert_non_null(text);
    }
    size_t got = fread(text + len, 1, cap - len - 1, p);
    if (!got)
      break;
    len += got;
  }
  text[len] = '\0';
  pclose(p);
  snprintf(want, sizeof want, "{\"name\":\"%s\"", peer);
  if (!(at = strstr(text, want))) {
    fprintf(stderr, "gpupoolctl peers: %s\n", text);
    free(text);
    return 0;
  }
  {
    char *end = strchr(at, '}');
    if (end)
      *end = '\0';
  }
  jstr_(at, "state", out->state, sizeof out->state);
  jstr_(at, "last_error", out->last_error, sizeof out->last_error);
  out->in_flight = jnum(at, "fetches_in_flight");
  out->fetches = jnum(at, "fetches");
  out->failures = jnum(at, "failures");
  out->bytes = jnum(at, "bytes_fetched");
  out->served = jnum(at, "versions_served");
  out->serving_now = jnum(at, "serving_now");
  free(text);
  return 1;
}

static peer_row row(node *n, const char *peer) {
  peer_row r;
  memset(&r, 0, sizeof r);
  if (!peer_info(n, peer, &r)) {
    th_dump_log(&n->d);
    fail_msg("no peer %s in AdminPeers", peer);
  }
  return r;
}

/* Buffers live on n's daemon and the bytes its pool uses. */
static void usage(node *n, uint64_t *buffers, uint64_t *used) {
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps;
  th_stats(&n->d, &ds, &ps);
  *buffers = ds.buffers;
  *used = ps.used;
}

/* Wait (bounded) until n has no buffer and nothing used: memory back at its baseline. */
static void expect_baseline(node *n, const char *what) {
  uint64_t b = 1, u = 1, end = th_now_ms() + 10000;
  while (th_now_ms() < end) {
    usage(n, &b, &u);
    if (!b && !u)
      return;
    th_sleep_ms(20);
  }
  th_dump_log(&n->d);
  fail_msg("%s: %" PRIu64 " buffers, %" PRIu64 " bytes still in use", what, b, u);
}

static int log_has(const node *n, const char *needle) {
  FILE *f = fopen(n->d.log, "r");
  char line[4096];
  int found = 0;
  if (!f)
    return 0;
  while (!found && fgets(line, sizeof line, f))
    found = strstr(line, needle) != NULL;
  fclose(f);
  return found;
}

/* The line appears in n's log within a few seconds (the daemon writes it on its own time). */
static int log_gets(const node *n, const char *needle) {
  uint64_t end = th_now_ms() + 5000;
  while (!log_has(n, needle) && th_now_ms() < end)
    th_sleep_ms(20);
  return log_has(n, needle);
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

/* ---- two daemons: A serves, B fetches ------------------------------------------------------ */

static node A, B, C;

static void pair_start(const char *b_secret, const char *a_exports) {
  node_prepare(&A, SECRET);
  node_prepare(&B, b_secret);
  node_start(&A, a_exports, "B", &B, NULL);
  node_start(&B, "*", "A", &A, NULL);
}

static void pair_stop(void) {
  node_stop(&B);
  node_stop(&A);
}

static void test_buffer_and_versions(void **state) {
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  gpupool_tensor_meta m;
  uint64_t v = 0;
  const size_t len = (3u << 20) + 12;
  (void)state;
  pair_start(SECRET, "B");
  assert_int_equal(publish(&A, "weights", len, 1), 1);
  c = th_connect(&B.d, "consumer");
  /* Not waiting (timeout 0) still fetches: the peer has it now. */
  assert_int_equal(gpupool_buffer_get(c, "A:weights", 0, 0, 0, NULL, &b, &v), 0);
  assert_int_equal(v, 1);
  assert_int_equal(gpupool_buffer_size(b), len);
  assert_true(same(gpupool_buffer_ptr(b), len, 1));
  assert_int_equal(gpupool_buffer_tensor(b, &m), 0);
  assert_int_equal(m.shape[0], (int64_t)len / 4);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  /* The peer's version numbers: v3 there is v3 here. */
  assert_int_equal(publish(&A, "weights", len, 2), 2);
  assert_int_equal(publish(&A, "weights", len, 3), 3);
  assert_int_equal(gpupool_buffer_get(c, "A:weights", 1, 10000, 0, NULL, &b, &v), 0);
  assert_int_equal(v, 3);
  assert_true(same(gpupool_buffer_ptr(b), len, 3));
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  /* Nothing newer there: a get that does not wait says so. */
  assert_int_equal(gpupool_buffer_get(c, "A:weights", 3, 0, 0, NULL, &b, &v), GPUPOOL_ENOENT);
  /* A get waiting past v3 is answered when v4 is published there. */
  {
    pid_t p = fork();
    if (p == 0) {
      th_sleep_ms(300);
      publish(&A, "weights", len, 4);
      _exit(0);
    }
    assert_int_equal(gpupool_buffer_get(c, "A:weights", 3, 20000, 0, NULL, &b, &v), 0);
    assert_int_equal(v, 4);
    assert_true(same(gpupool_buffer_ptr(b), len, 4));
    assert_int_equal(gpupool_buffer_release(b, NULL), 0);
    assert_int_equal(ts_wait_pid(p, 10000, 1, NULL), 0);
  }
  assert_int_equal(row(&B, "A").fetches, 3);
  assert_int_equal(row(&A, "B").served, 3);
  /* An unknown name: ENOENT, not an error of the peer. */
  assert_int_equal(gpupool_buffer_get(c, "A:nothing", 0, 0, 0, NULL, &b, &v), GPUPOOL_ENOENT);
  /* Back at baseline on both sides once the names go. */
  assert_int_equal(gpupool_name_unpublish(c, "A:weights"), 0);
  gpupool_client_disconnect(c);
  expect_baseline(&B, "fetching side after unpublish");
  assert_int_equal(row(&A, "B").serving_now, 0);
  c = th_connect(&A.d, "cleanup");
  assert_int_equal(gpupool_name_unpublish(c, "weights"), 0);
  gpupool_client_disconnect(c);
  expect_baseline(&A, "serving side after unpublish");
  pair_stop();
}

static void test_bundle(void **state) {
  enum { N = 1000 };
  gpupool_member_spec *specs = calloc(N, sizeof *specs);
  char (*names)[32] = calloc(N, 32);
  gpupool_client *c;
  gpupool_bundle *b = NULL, *g = NULL;
  uint64_t v = 0;
  (void)state;
  assert_non_null(specs);
  assert_non_null(names);
  pair_start(SECRET, "B");
  c = th_connect(&A.d, "producer");
  for (int i = 0; i < N; i++) {
    snprintf(names[i], 32, "layer.%d.weight", i);
    specs[i].name = names[i];
    specs[i].size = 4096 + (uint64_t)i * 8;
  }
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, N, 0, 0, NULL, &b), 0);
  for (int i = 0; i < N; i++) {
    gpupool_member m;
    assert_int_equal(gpupool_bundle_member(b, i, &m), 0);
    fill(m.ptr, m.size, 100 + (uint32_t)i);
  }
  assert_int_equal(gpupool_bundle_publish(b, "model", NULL, &v), 0);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  c = th_connect(&B.d, "consumer");
  assert_int_equal(gpupool_bundle_get(c, "A:model", 0, 10000, 0, NULL, &g), 0);
  assert_int_equal(gpupool_bundle_count(g), N);
  assert_int_equal(gpupool_bundle_version(g), 1);
  for (int i = 0; i < N; i++) {
    gpupool_member m;
    assert_int_equal(gpupool_bundle_member(g, i, &m), 0);
    assert_string_equal(m.name, names[i]);
    assert_int_equal(m.size, specs[i].size);
    if (!same(m.ptr, m.size, 100 + (uint32_t)i))
      fail_msg("member %d differs", i);
  }
  assert_int_equal(gpupool_bundle_release(g, NULL), 0);
  gpupool_client_disconnect(c);
  free(specs);
  free(names);
  pair_stop();
}

static void test_wrong_secret(void **state) {
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  (void)state;
  pair_start("another-secret-of-sixteen-bytes", "B");
  publish(&A, "weights", 4096, 1);
  c = th_connect(&B.d, "consumer");
  assert_int_equal(gpupool_buffer_get(c, "A:weights", 0, 5000, 0, NULL, &b, NULL), GPUPOOL_EPEER);
  if (!strstr(gpupool_last_error(), "wrong secret"))
    fail_msg("the getter was told: %s", gpupool_last_error());
  gpupool_client_disconnect(c);
  assert_true(log_gets(&B, "peer authentication failed: wrong secret (check secret_file on both daemons)"));
  assert_true(log_gets(&A, "peer authentication failed: wrong secret (check secret_file on both daemons)"));
  expect_baseline(&B, "after a refused fetch");
  pair_stop();
}

static void test_not_exported(void **state) {
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  (void)state;
  pair_start(SECRET, NULL);
  publish(&A, "weights", 4096, 1);
  c = th_connect(&B.d, "consumer");
  assert_int_equal(gpupool_buffer_get(c, "A:weights", 0, 0, 0, NULL, &b, NULL), GPUPOOL_ENOENT);
  /* The same answer as for a name that does not exist. */
  assert_int_equal(gpupool_buffer_get(c, "A:absent", 0, 0, 0, NULL, &b, NULL), GPUPOOL_ENOENT);
  gpupool_client_disconnect(c);
  assert_int_equal(row(&A, "B").served, 0);
  pair_stop();
}

#define ANY_FAILURE 1

/* Start a getter of A:big on B in a child that expects the result `expect` (ANY_FAILURE: any
 * error); wait until A is serving it (the transfer runs). */
static pid_t start_big_fetch(int expect) {
  pid_t p = fork();
  uint64_t end;
  if (p == 0) {
    gpupool_client *c = NULL;
    gpupool_buffer *b = NULL;
    int rc;
    if (gpupool_client_connect(B.d.sock, "getter", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0)
      _exit(10);
    rc = gpupool_buffer_get(c, "A:big", 0, 30000, 0, NULL, &b, NULL);
    if (expect == ANY_FAILURE ? rc == 0 : rc != expect) {
      fprintf(stderr, "getter: %d (%s), want %d\n", rc, gpupool_last_error(), expect);
      _exit(11);
    }
    if (rc == GPUPOOL_EPEER && !strstr(gpupool_last_error(), "closed the connection")) {
      fprintf(stderr, "getter: message '%s' does not say the peer went away\n", gpupool_last_error());
      _exit(12);
    }
    _exit(0);
  }
  end = th_now_ms() + 20000;
  while (th_now_ms() < end && row(&A, "B").serving_now == 0)
    th_sleep_ms(2);
  if (row(&A, "B").serving_now == 0)
    fail_msg("A never started serving A:big");
  return p;
}

static void test_source_killed(void **state) {
  const size_t len = 1u << 30;
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  int st = 0;
  pid_t p;
  (void)state;
  pair_start(SECRET, "B");
  publish(&A, "big", len, 7);
  p = start_big_fetch(GPUPOOL_EPEER);
  kill(A.d.pid, SIGKILL);
  assert_int_equal(ts_wait_pid(A.d.pid, 10000, 1, NULL), 0);
  A.d.pid = 0;
  assert_int_equal(ts_wait_pid(p, 30000, 1, &st), 0);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
  expect_baseline(&B, "fetching side after the source died");
  assert_true(row(&B, "A").failures >= 1);
  /* The source comes back: the next get works. */
  ts_daemon_remove(&A.d);
  node_prepare(&A, SECRET);
  {
    int port = A.port;
    (void)port;
  }
  node_stop(&B);
  node_prepare(&B, SECRET);
  node_start(&A, "B", "B", &B, NULL);
  node_start(&B, "*", "A", &A, NULL);
  publish(&A, "big", 8u << 20, 8);
  c = th_connect(&B.d, "retry");
  assert_int_equal(gpupool_buffer_get(c, "A:big", 0, 10000, 0, NULL, &b, NULL), 0);
  assert_true(same(gpupool_buffer_ptr(b), 8u << 20, 8));
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  pair_stop();
}

static void test_getter_killed(void **state) {
  const size_t len = 1u << 30;
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  pid_t p;
  uint64_t end;
  (void)state;
  pair_start(SECRET, "B");
  publish(&A, "big", len, 9);
  p = start_big_fetch(0);
  kill(p, SIGKILL);
  assert_int_equal(ts_wait_pid(p, 10000, 1, NULL), 0);
  /* The transfer ends, nobody wants it: the copy goes, and A lets its version go. */
  end = th_now_ms() + 30000;
  while (th_now_ms() < end && (row(&B, "A").in_flight || row(&A, "B").serving_now))
    th_sleep_ms(20);
  assert_int_equal(row(&A, "B").serving_now, 0);
  expect_baseline(&B, "fetching side after its getter died");
  /* A retry works. */
  c = th_connect(&B.d, "retry");
  assert_int_equal(gpupool_buffer_get(c, "A:big", 0, 30000, 0, NULL, &b, NULL), 0);
  assert_true(same(gpupool_buffer_ptr(b), len, 9));
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "A:big"), 0);
  gpupool_client_disconnect(c);
  expect_baseline(&B, "fetching side after the retry's name went");
  pair_stop();
}

/* The fetching daemon itself stops mid-transfer: it exits cleanly, and the source lets its
 * version go. */
static void test_fetcher_stops(void **state) {
  const size_t len = 1u << 30;
  uint64_t end;
  pid_t p;
  int st = 0;
  (void)state;
  pair_start(SECRET, "B");
  publish(&A, "big", len, 12);
  p = start_big_fetch(ANY_FAILURE);
  node_stop(&B); /* requires a clean exit */
  assert_int_equal(ts_wait_pid(p, 30000, 1, &st), 0);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  end = th_now_ms() + 20000;
  while (th_now_ms() < end && row(&A, "B").serving_now)
    th_sleep_ms(20);
  assert_int_equal(row(&A, "B").serving_now, 0);
  node_stop(&A);
}

/* The fetching daemon is killed mid-transfer: the source goes on serving (it is the one that
 * sends, and nothing of its UCX answers for the dead peer), lets its version go, and serves
 * the next fetch. */
static void test_fetcher_killed(void **state) {
  const size_t len = 1u << 30;
  uint64_t end;
  pid_t p;
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  (void)state;
  pair_start(SECRET, "B");
  publish(&A, "big", len, 13);
  p = start_big_fetch(ANY_FAILURE);
  kill(B.d.pid, SIGKILL);
  assert_int_equal(ts_wait_pid(B.d.pid, 10000, 1, NULL), 0);
  B.d.pid = 0;
  assert_int_equal(ts_wait_pid(p, 30000, 1, NULL), 0);
  end = th_now_ms() + 20000;
  while (th_now_ms() < end && row(&A, "B").serving_now)
    th_sleep_ms(20);
  assert_int_equal(row(&A, "B").serving_now, 0);
  ts_daemon_remove(&B.d);
  node_prepare(&B, SECRET);
  node_stop(&A);
  node_prepare(&A, SECRET);
  node_start(&A, "B", "B", &B, NULL);
  node_start(&B, "*", "A", &A, NULL);
  publish(&A, "big", 4u << 20, 14);
  c = th_connect(&B.d, "retry");
  assert_int_equal(gpupool_buffer_get(c, "A:big", 0, 10000, 0, NULL, &b, NULL), 0);
  assert_true(same(gpupool_buffer_ptr(b), 4u << 20, 14));
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  pair_stop();
}

/* ---- 200 getters, one transfer ---------------------------------------------------------- */

enum { GETTERS = 200 };
static int getter_rc[GETTERS];

static void *getter(void *arg) {
  intptr_t i = (intptr_t)arg;
  gpupool_client *c = NULL;
  gpupool_buffer *b = NULL;
  uint64_t v = 0;
  if (gpupool_client_connect(B.d.sock, "getter", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0) {
    getter_rc[i] = -1000;
    return NULL;
  }
  getter_rc[i] = gpupool_buffer_get(c, "A:shared", 0, 30000, GPUPOOL_READ_ONLY, NULL, &b, &v);
  if (getter_rc[i] == 0) {
    if (v != 1 || !same(gpupool_buffer_ptr(b), 16u << 20, 11))
      getter_rc[i] = -2000;
    gpupool_buffer_release(b, NULL);
  }
  gpupool_client_disconnect(c);
  return NULL;
}

static void test_many_getters_one_transfer(void **state) {
  pthread_t t[GETTERS];
  (void)state;
  pair_start(SECRET, "B");
  publish(&A, "shared", 16u << 20, 11);
  for (intptr_t i = 0; i < GETTERS; i++)
    assert_int_equal(pthread_create(&t[i], NULL, getter, (void *)i), 0);
  for (int i = 0; i < GETTERS; i++)
    pthread_join(t[i], NULL);
  for (int i = 0; i < GETTERS; i++)
    if (getter_rc[i] != 0)
      fail_msg("getter %d: %d", i, getter_rc[i]);
  assert_int_equal(row(&B, "A").fetches, 1);
  assert_int_equal(row(&A, "B").served, 1);
  assert_int_equal(row(&B, "A").bytes, 16u << 20);
  /* The same counts in the metrics, per peer. */
  {
    node m = B;
    snprintf(m.d.log, sizeof m.d.log, "%.250s/metrics.prom", B.d.dir);
    assert_true(log_gets(&m, "gpupool_peer_fetches_total{peer=\"A\"} 1"));
    assert_true(log_gets(&m, "gpupool_peer_fetched_bytes_total{peer=\"A\"} 16777216"));
    assert_true(log_gets(&m, "gpupool_peer_up{peer=\"A\"} 1"));
  }
  pair_stop();
}

/* ---- a tree: C fetches from B what B fetched from A ---------------------------------------- */

static void test_reserve(void **state) {
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  uint64_t v = 0;
  (void)state;
  node_prepare(&A, SECRET);
  node_prepare(&B, SECRET);
  node_prepare(&C, SECRET);
  node_start(&A, "B", "B", &B, NULL);
  node_start(&B, "C", "A", &A, "C", &C, NULL);
  node_start(&C, NULL, "B", &B, NULL);
  publish(&A, "weights", 5u << 20, 21);
  publish(&A, "weights", 5u << 20, 22);
  /* C asks B for B's A:weights, which B has not fetched yet: B fetches it once for C. */
  c = th_connect(&C.d, "leaf");
  assert_int_equal(gpupool_buffer_get(c, "B:A:weights", 0, 20000, 0, NULL, &b, &v), 0);
  assert_int_equal(v, 2);
  assert_true(same(gpupool_buffer_ptr(b), 5u << 20, 22));
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  /* B's own consumers get its copy without another transfer from A. */
  c = th_connect(&B.d, "middle");
  assert_int_equal(gpupool_buffer_get(c, "A:weights", 0, 0, 0, NULL, &b, &v), 0);
  assert_int_equal(v, 2);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  assert_int_equal(row(&A, "B").served, 1);
  assert_int_equal(row(&B, "A").fetches, 1);
  assert_int_equal(row(&B, "C").served, 1);
  assert_int_equal(row(&C, "B").fetches, 1);
  node_stop(&C);
  node_stop(&B);
  node_stop(&A);
}

/* A TCP connection to A's peer_listen, or -1. */
static int tcp_to(const node *n) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  struct timeval tv = {15, 0};
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons((uint16_t)n->port);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/* 1 when the daemon ends the connection (EOF or reset) within the receive timeout. */
static int closed_by_daemon(int fd) {
  char buf[4096];
  ssize_t r;
  while ((r = read(fd, buf, sizeof buf)) > 0)
    ;
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* What arrives on peer_listen before authentication is capped and checked: a huge length, a
 * frame that does not decode, a client request instead of a Hello, and silence each end that
 * connection only; the daemon goes on serving its peers. */
static void test_hostile_peer_connections(void **state) {
  static const uint8_t huge[4] = {0x00, 0x00, 0x00, 0x40};           /* 1 GiB */
  static const uint8_t garbage[8] = {0x04, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff};
  static const uint8_t stats[6] = {0x02, 0x00, 0x00, 0x00, 0x9a, 0x01}; /* field 19 of a Request */
  const struct {
    const uint8_t *bytes;
    size_t len;
  } sends[] = {{huge, sizeof huge}, {garbage, sizeof garbage}, {stats, sizeof stats}, {NULL, 0}};
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  (void)state;
  pair_start(SECRET, "B");
  publish(&A, "weights", 4096, 5);
  for (size_t i = 0; i < sizeof sends / sizeof sends[0]; i++) {
    int fd = tcp_to(&A);
    assert_true(fd >= 0);
    if (sends[i].len)
      assert_int_equal(write(fd, sends[i].bytes, sends[i].len), (ssize_t)sends[i].len);
    if (!closed_by_daemon(fd))
      fail_msg("case %zu: the daemon kept the connection", i);
    close(fd);
  }
  c = th_connect(&B.d, "consumer");
  assert_int_equal(gpupool_buffer_get(c, "A:weights", 0, 10000, 0, NULL, &b, NULL), 0);
  assert_true(same(gpupool_buffer_ptr(b), 4096, 5));
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
  pair_stop();
}

/* A peer that is not running: the getter is told where it was looked for. */
static void test_unreachable(void **state) {
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  (void)state;
  node_prepare(&A, SECRET);
  node_prepare(&B, SECRET);
  node_start(&B, "*", "A", &A, NULL);
  c = th_connect(&B.d, "consumer");
  assert_int_equal(gpupool_buffer_get(c, "A:weights", 0, 5000, 0, NULL, &b, NULL), GPUPOOL_EPEER);
  if (!strstr(gpupool_last_error(), "unreachable at 127.0.0.1:") ||
      !strstr(gpupool_last_error(), "is gpupoold running there with peer_listen?"))
    fail_msg("the getter was told: %s", gpupool_last_error());
  gpupool_client_disconnect(c);
  assert_string_equal(row(&B, "A").state, "down");
  node_stop(&B);
  ts_daemon_remove(&A.d);
}

/* The local copy is allocated in the getter's tenant's pool: when it does not fit, the
 * getter is told so, and nothing is left on either side. */
static void test_copy_does_not_fit(void **state) {
  gpupool_client *c;
  gpupool_buffer *b = NULL;
  (void)state;
  node_prepare(&A, SECRET);
  node_prepare(&B, SECRET);
  node_start(&A, "B", "B", &B, NULL);
  next_capacity = "128M";
  node_start(&B, "*", "A", &A, NULL);
  publish(&A, "big", 200u << 20, 3);
  c = th_connect(&B.d, "consumer");
  assert_int_not_equal(gpupool_buffer_get(c, "A:big", 0, 10000, 0, NULL, &b, NULL), 0);
  if (!strstr(gpupool_last_error(), "fetch of A:big v1") || !strstr(gpupool_last_error(), "failed"))
    fail_msg("the getter was told: %s", gpupool_last_error());
  gpupool_client_disconnect(c);
  expect_baseline(&B, "fetching side after a copy that did not fit");
  assert_int_equal(row(&A, "B").serving_now, 0);
  pair_stop();
}

/* One peer may have peer_max_fetches gets in flight at a daemon: the next is refused at
 * once with ELIMIT (those waiting there keep their place). */
enum { OVER = 5 };
static int over_rc[OVER];
static char over_msg[OVER][512];

static void *absent_getter(void *arg) {
  intptr_t i = (intptr_t)arg;
  gpupool_client *c = NULL;
  gpupool_buffer *b = NULL;
  char name[32];
  snprintf(name, sizeof name, "A:absent%d", (int)i);
  if (gpupool_client_connect(B.d.sock, "getter", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0) {
    over_rc[i] = -1000;
    return NULL;
  }
  over_rc[i] = gpupool_buffer_get(c, name, 0, 3000, 0, NULL, &b, NULL);
  snprintf(over_msg[i], sizeof over_msg[i], "%s", gpupool_last_error());
  gpupool_client_disconnect(c);
  return NULL;
}

static void test_fetches_per_peer_capped(void **state) {
  pthread_t t[OVER];
  int limited = 0;
  (void)state;
  node_prepare(&A, SECRET);
  node_prepare(&B, SECRET);
  next_daemon_lines = "peer_max_fetches = 4\n";
  node_start(&A, "B", "B", &B, NULL);
  node_start(&B, "*", "A", &A, NULL);
  for (intptr_t i = 0; i < OVER; i++)
    assert_int_equal(pthread_create(&t[i], NULL, absent_getter, (void *)i), 0);
  for (int i = 0; i < OVER; i++)
    pthread_join(t[i], NULL);
  for (int i = 0; i < OVER; i++) {
    if (over_rc[i] == GPUPOOL_ELIMIT) {
      limited++;
      if (!strstr(over_msg[i], "peer_max_fetches"))
        fail_msg("getter %d was told: %s", i, over_msg[i]);
    } else if (over_rc[i] != GPUPOOL_ETIMEDOUT && over_rc[i] != GPUPOOL_ENOENT) {
      fail_msg("getter %d: %d (%s)", i, over_rc[i], over_msg[i]);
    }
  }
  assert_int_equal(limited, 1);
  pair_stop();
}

/* A secret file others can read stops the daemon at start, naming the file and the fix; and
 * before its socket exists: a daemon about to refuse its configuration is never seen
 * accepting a connection (a health check, a client, this test's own start under load once
 * connected in that window). The socket's directory is watched for its creation. */
static void test_secret_mode(void **state) {
  char conf[1024], ev[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
  const char *name;
  ssize_t n;
  int in;
  ts_daemon_opts o = {.gpupoold = GPUPOOLD_PATH, .backend = "host", .log_level = "info", .use_conf = 1,
                      .ready_ms = 3000, .poll_ms = 10};
  (void)state;
  node_prepare(&A, SECRET);
  assert_int_equal(chmod(A.secret, 0644), 0);
  snprintf(conf, sizeof conf, "[daemon]\npeer_listen = 127.0.0.1:%d\npeer_secret_file = %s\n[peer B]\n"
           "address = 127.0.0.1:1\n", A.port, A.secret);
  th_write_conf(&A.d, conf);
  in = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  assert_true(in >= 0);
  /* The daemon binds a temporary name (SOCK.PID.new) and renames it to SOCK. */
  assert_true(inotify_add_watch(in, A.d.dir, IN_CREATE | IN_MOVED_TO) >= 0);
  assert_int_not_equal(ts_daemon_start(&A.d, &o), 0);
  assert_true(log_has(&A, "chmod 600"));
  name = strrchr(A.d.sock, '/') + 1;
  while ((n = read(in, ev, sizeof ev)) > 0)
    for (char *p = ev; p < ev + n; p += sizeof(struct inotify_event) + ((struct inotify_event *)p)->len) {
      struct inotify_event *e = (struct inotify_event *)p;
      if (e->len && strncmp(e->name, name, strlen(name)) == 0)
        fail_msg("the daemon made its socket %s before it refused its peer secret", A.d.sock);
    }
  close(in);
  A.d.pid = 0;
  ts_daemon_remove(&A.d);
}

int main(void) {
  if (skip_without_ucx())
    return 77;
  /* UCX over TCP on lo, as between namespaces over veth. */
  setenv("UCX_TLS", "tcp", 1);
  setenv("UCX_NET_DEVICES", "lo", 1);
  signal(SIGPIPE, SIG_IGN);
  return TS_RUN_TESTS(NULL, NULL, test_secret_mode, test_buffer_and_versions, test_bundle, test_wrong_secret,
                      test_not_exported, test_hostile_peer_connections, test_unreachable, test_many_getters_one_transfer, test_getter_killed, test_source_killed, test_fetcher_stops, test_fetcher_killed, test_copy_does_not_fit, test_fetches_per_peer_capped,
                      test_reserve);
}
