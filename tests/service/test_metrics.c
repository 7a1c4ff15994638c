/*
 * Unit tests of daemon/service/metrics.c, in process: the exposition text (HELP/TYPE before every
 * family, counters by type and result (every request kind by its name), cumulative histogram buckets, escaped pool names,
 * gauges from a StatsReply), and the two exporters on a real libuv loop (the textfile written
 * atomically, the socket answering HTTP/1.0 200 with the same families, connections capped
 * per uid, refusal of unusable paths, clean removal on stop with no handle left open).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <strings.h>
#include <time.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "config.h"
#include "errors.h"
#include "metrics.h"

static char tmpdir[64];

static int setup(void **state) {
  (void)state;
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/gpupool-metrics-XXXXXX");
  return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
  char cmd[128];
  (void)state;
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

static void must_contain(const char *text, const char *want) {
  if (strstr(text, want) == NULL)
    fail_msg("metrics text lacks '%s':\n%s", want, text);
}

/* Structural checks of the text format: every sample's family was declared by a TYPE line
 * before it (histograms through _bucket/_sum/_count), every family is declared once, with
 * HELP right before TYPE, and sample lines are "name[{labels}] value". */
static void check_format(const char *text) {
  char fam[128][96];
  char type[128][16];
  int nfam = 0;
  const char *line = text;

  while (*line) {
    const char *nl = strchr(line, '\n');
    char l[1024];
    size_t len;
    assert_non_null(nl); /* the text ends with a newline */
    len = (size_t)(nl - line);
    assert_true(len < sizeof(l));
    memcpy(l, line, len);
    l[len] = '\0';
    if (strncmp(l, "# HELP ", 7) == 0) {
      char name[96];
      const char *next = nl + 1;
      assert_int_equal(sscanf(l + 7, "%95s", name), 1);
      char want[128];
      snprintf(want, sizeof(want), "# TYPE %s ", name);
      assert_int_equal(strncmp(next, want, strlen(want)), 0);
    } else if (strncmp(l, "# TYPE ", 7) == 0) {
      assert_true(nfam < 128);
      assert_int_equal(sscanf(l + 7, "%95s %15s", fam[nfam], type[nfam]), 2);
      for (int i = 0; i < nfam; i++)
        if (strcmp(fam[i], fam[nfam]) == 0)
          fail_msg("family %s declared twice", fam[i]);
      if (strncmp(fam[nfam], "gpupool_", 8) != 0 && strncmp(fam[nfam], "process_", 8) != 0)
        fail_msg("family %s is neither gpupool_* nor a standard process_* one", fam[nfam]);
      nfam++;
    } else {
      char name[96];
      size_t n = strcspn(l, "{ ");
      int found = 0;
      const char *value;
      assert_true(n > 0 && n < sizeof(name));
      memcpy(name, l, n);
      name[n] = '\0';
      for (int i = 0; i < nfam && !found; i++) {
        size_t fl = strlen(fam[i]);
        if (strcmp(name, fam[i]) == 0)
          found = 1;
        else if (strcmp(type[i], "histogram") == 0 && strncmp(name, fam[i], fl) == 0 &&
                 (!strcmp(name + fl, "_bucket") || !strcmp(name + fl, "_sum") ||
                  !strcmp(name + fl, "_count")))
          found = 1;
      }
      if (!found)
        fail_msg("sample '%s' comes before (or without) its TYPE line", l);
      if (l[n] == '{') {
        const char *close = strstr(l, "} ");
        assert_non_null(close);
        value = close + 2;
      } else {
        value = l + n + 1;
      }
      char *end = NULL;
      (void)strtod(value, &end);
      if (end == value || *end != '\0')
        fail_msg("sample '%s' has no numeric value", l);
    }
    line = nl + 1;
  }
}

static uint64_t sample(const char *text, const char *series) {
  char want[256];
  const char *p;
  snprintf(want, sizeof(want), "\n%s ", series);
  p = strstr(text, want);
  if (p == NULL)
    fail_msg("no sample %s in:\n%s", series, text);
  return strtoull(p + strlen(want), NULL, 10);
}

static void test_counters_and_histogram(void **state) {
  gpd_metrics *m;
  char *t;
  (void)state;
  assert_int_equal(gpd_metrics_new(&m), 0);
  gpd_metrics_request(m, GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE, 0, 5000);         /* 5 us */
  gpd_metrics_request(m, GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE, GPUPOOL_ENOSPC, 2000000); /* 2 ms */
  gpd_metrics_request(m, GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE, 0, 3000000000ull); /* 3 s */
  gpd_metrics_request(m, GPUPOOL__WIRE__REQUEST__BODY_TRIM, 0, 10000); /* exactly 10 us */
  gpd_metrics_request(m, 0, GPUPOOL_EPROTO, 1000);
  gpd_metrics_request(m, GPUPOOL__WIRE__REQUEST__BODY_GET, -999, 1000);
  t = gpd_metrics_render(m, NULL);
  assert_non_null(t);
  check_format(t);
  must_contain(t, "# HELP gpupool_requests_total ");
  must_contain(t, "# TYPE gpupool_requests_total counter\n");
  must_contain(t, "# TYPE gpupool_request_duration_seconds histogram\n");
  assert_int_equal(sample(t, "gpupool_requests_total{type=\"allocate\",result=\"ok\"}"), 2);
  assert_int_equal(sample(t, "gpupool_requests_total{type=\"allocate\",result=\"ENOSPC\"}"), 1);
  assert_int_equal(sample(t, "gpupool_requests_total{type=\"unknown\",result=\"EPROTO\"}"), 1);
  assert_int_equal(sample(t, "gpupool_requests_total{type=\"get\",result=\"other\"}"), 1);
  assert_int_equal(sample(t, "gpupool_requests_total{type=\"trim\",result=\"ok\"}"), 1);
  /* Buckets are cumulative; the 3 s request is only in +Inf. */
  assert_int_equal(
      sample(t, "gpupool_request_duration_seconds_bucket{type=\"allocate\",le=\"1e-05\"}"), 1);
  assert_int_equal(
      sample(t, "gpupool_request_duration_seconds_bucket{type=\"allocate\",le=\"0.001\"}"), 1);
  assert_int_equal(
      sample(t, "gpupool_request_duration_seconds_bucket{type=\"allocate\",le=\"0.0025\"}"), 2);
  assert_int_equal(
      sample(t, "gpupool_request_duration_seconds_bucket{type=\"allocate\",le=\"1\"}"), 2);
  assert_int_equal(
      sample(t, "gpupool_request_duration_seconds_bucket{type=\"allocate\",le=\"+Inf\"}"), 3);
  assert_int_equal(sample(t, "gpupool_request_duration_seconds_count{type=\"allocate\"}"), 3);
  must_contain(t, "gpupool_request_duration_seconds_sum{type=\"allocate\"} 3.002005000\n");
  /* A bound is inclusive ("le"). */
  assert_int_equal(
      sample(t, "gpupool_request_duration_seconds_bucket{type=\"trim\",le=\"1e-05\"}"), 1);
  /* Types never seen have no series. */
  assert_null(strstr(t, "type=\"share\""));
  free(t);
  gpd_metrics_close(m);
}

/* Every case of Request's body oneof (walked in the proto's descriptor, not in the request
 * table) is counted under its field's name: a kind the metrics miss would go to "unknown". */
static void test_every_kind_named(void **state) {
  const ProtobufCMessageDescriptor *d = &gpupool__wire__request__descriptor;
  gpd_metrics *m;
  char *t, want[160];
  int ncases = 0;
  (void)state;
  assert_int_equal(gpd_metrics_new(&m), 0);
  for (unsigned i = 0; i < d->n_fields; i++)
    if (d->fields[i].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
      gpd_metrics_request(m, (int)d->fields[i].id, 0, 1000);
      ncases++;
    }
  assert_true(ncases > 0);
  t = gpd_metrics_render(m, NULL);
  assert_non_null(t);
  check_format(t);
  for (unsigned i = 0; i < d->n_fields; i++)
    if (d->fields[i].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
      snprintf(want, sizeof want, "gpupool_requests_total{type=\"%s\",result=\"ok\"}", d->fields[i].name);
      assert_int_equal(sample(t, want), 1);
    }
  assert_null(strstr(t, "type=\"unknown\""));
  free(t);
  gpd_metrics_close(m);
}

static Gpupool__Wire__PoolInfo *new_pool(uint32_t id, const char *name, uint64_t cap) {
  Gpupool__Wire__PoolInfo *p = malloc(sizeof(*p));
  assert_non_null(p);
  gpupool__wire__pool_info__init(p);
  p->id = id;
  p->name = (char *)name;
  p->backend = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST;
  p->location = GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST;
  p->device = -1;
  p->numa_node = -1;
  p->capacity = cap;
  p->slab_size = 4 << 20;
  p->used = 3 << 20;
  p->reserved = 4 << 20;
  p->used_high = 5 << 20;
  p->reserved_high = 8 << 20;
  p->backend_used = 11;
  p->backend_reserved = 12;
  p->buffers = 3;
  p->slabs = 1;
  return p;
}

static int fake_calls;

/* Same ownership as the server's stats source: pools malloc'd by fill, freed by release. */
static int fake_stats(void *arg, Gpupool__Wire__StatsReply *st) {
  (void)arg;
  fake_calls++;
  gpupool__wire__stats_reply__init(st);
  st->pools = calloc(2, sizeof(*st->pools));
  assert_non_null(st->pools);
  st->pools[0] = new_pool(0, "default", 64ull << 20);
  st->pools[1] = new_pool(1, "we\"ird\\na\nme", 32ull << 20);
  st->n_pools = 2;
  st->clients = 4;
  st->buffers = 6;
  st->holds = 7;
  st->names = 2;
  st->uptime_s = 42;
  st->daemon_version = (char *)"9.8.7";
  st->backend = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST;
  st->open_fds = 17;
  st->pending_frees = 1;
  st->waiting_leases = 3;
  st->replica_copies = 5;
  st->replica_bytes = 123456;
  st->replica_copies_running = 2;
  st->replica_copies_failed = 1;
  st->opens_waited = 9;
  st->opens_waiting = 3;
  return 0;
}

static void fake_release(void *arg, Gpupool__Wire__StatsReply *st) {
  (void)arg;
  for (size_t i = 0; i < st->n_pools; i++)
    free(st->pools[i]);
  free(st->pools);
  st->pools = NULL;
  st->n_pools = 0;
}

static const gpd_stats_source fake_source = {fake_stats, fake_release, NULL};

static void check_stats_text(const char *t) {
  check_format(t);
  assert_int_equal(sample(t, "gpupool_pool_capacity_bytes{pool=\"default\"}"), 64ull << 20);
  assert_int_equal(sample(t, "gpupool_pool_capacity_bytes{pool=\"we\\\"ird\\\\na\\nme\"}"),
                   32ull << 20);
  assert_int_equal(sample(t, "gpupool_pool_used_bytes{pool=\"default\"}"), 3 << 20);
  assert_int_equal(sample(t, "gpupool_pool_reserved_bytes{pool=\"default\"}"), 4 << 20);
  assert_int_equal(sample(t, "gpupool_pool_used_high_bytes{pool=\"default\"}"), 5 << 20);
  assert_int_equal(sample(t, "gpupool_pool_reserved_high_bytes{pool=\"default\"}"), 8 << 20);
  assert_int_equal(sample(t, "gpupool_pool_backend_used_bytes{pool=\"default\"}"), 11);
  assert_int_equal(sample(t, "gpupool_pool_backend_reserved_bytes{pool=\"default\"}"), 12);
  assert_int_equal(sample(t, "gpupool_pool_buffers{pool=\"default\"}"), 3);
  assert_int_equal(sample(t, "gpupool_pool_slabs{pool=\"default\"}"), 1);
  assert_int_equal(sample(t, "gpupool_clients"), 4);
  assert_int_equal(sample(t, "gpupool_buffers"), 6);
  assert_int_equal(sample(t, "gpupool_holds"), 7);
  assert_int_equal(sample(t, "gpupool_names"), 2);
  assert_int_equal(sample(t, "gpupool_open_fds"), 17);
  assert_int_equal(sample(t, "gpupool_pending_frees"), 1);
  assert_int_equal(sample(t, "gpupool_waiting_leases"), 3);
  assert_int_equal(sample(t, "gpupool_uptime_seconds"), 42);
  assert_int_equal(sample(t, "gpupool_replica_copies_total"), 5);
  assert_int_equal(sample(t, "gpupool_replica_bytes_copied_total"), 123456);
  assert_int_equal(sample(t, "gpupool_replica_copies_in_flight"), 2);
  assert_int_equal(sample(t, "gpupool_replica_copies_failed_total"), 1);
  assert_int_equal(sample(t, "gpupool_opens_waited_total"), 9);
  assert_int_equal(sample(t, "gpupool_opens_waiting"), 3);
  must_contain(t, "# TYPE gpupool_replica_copies_total counter\n");
  must_contain(t, "# TYPE gpupool_replica_copies_in_flight gauge\n");
  must_contain(t, "gpupool_build_info{version=\"9.8.7\",backend=\"host\"} 1\n");
  must_contain(t, "gpupool_pool_info{pool=\"default\",id=\"0\",backend=\"host\",location=\"host\","
                  "device=\"-1\",numa_node=\"-1\"} 1\n");
  must_contain(t, "# TYPE gpupool_pool_capacity_bytes gauge\n");
}

static void test_render_stats(void **state) {
  Gpupool__Wire__StatsReply st;
  char *t;
  (void)state;
  gpd_metrics *m;
  assert_int_equal(gpd_metrics_new(&m), 0);
  assert_int_equal(fake_stats(NULL, &st), 0);
  t = gpd_metrics_render(m, &st);
  fake_release(NULL, &st);
  assert_non_null(t);
  check_stats_text(t);
  free(t);
  gpd_metrics_close(m);
}

static char *read_file(const char *path) {
  FILE *f = fopen(path, "re");
  char *buf;
  long n;
  if (f == NULL)
    return NULL;
  fseek(f, 0, SEEK_END);
  n = ftell(f);
  fseek(f, 0, SEEK_SET);
  buf = calloc(1, (size_t)n + 1);
  assert_non_null(buf);
  assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  return buf;
}

static void config_paths(gpd_config *cfg, const char *textfile, const char *sock) {
  memset(cfg, 0, sizeof(*cfg));
  cfg->socket_mode = 0640;
  cfg->metrics_interval_ms = 50;
  if (textfile)
    snprintf(cfg->metrics_textfile, sizeof(cfg->metrics_textfile), "%s/%s", tmpdir, textfile);
  if (sock)
    snprintf(cfg->metrics_socket, sizeof(cfg->metrics_socket), "%s/%s", tmpdir, sock);
}

static void tick(uv_timer_t *t) { (void)t; }

/* a names the Unix socket at path. */
static void unix_addr(struct sockaddr_un *a, const char *path) {
  memset(a, 0, sizeof(*a));
  a->sun_family = AF_UNIX;
  snprintf(a->sun_path, sizeof(a->sun_path), "%s", path);
}

/* The child plays a scraper: it sends req, reads the answer to EOF and saves it. */
static pid_t request_in_child_at(const char *sock, int tcp_port, const char *out, const char *req);
static pid_t request_in_child(const char *sock, const char *out, const char *req) {
  return request_in_child_at(sock, 0, out, req);
}

/* The same on 127.0.0.1:tcp_port when sock is NULL. */
static pid_t request_in_child_at(const char *sock, int tcp_port, const char *out, const char *req) {
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    struct sockaddr_un a;
    struct sockaddr_in in = {.sin_family = AF_INET, .sin_port = htons((uint16_t)tcp_port)};
    char buf[4096];
    FILE *f = fopen(out, "we");
    int fd = socket(sock ? AF_UNIX : AF_INET, SOCK_STREAM, 0);
    ssize_t n;
    int rc;
    unix_addr(&a, sock ? sock : "");
    in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    rc = sock ? connect(fd, (struct sockaddr *)&a, sizeof(a)) : connect(fd, (struct sockaddr *)&in, sizeof in);
    if (f == NULL || fd < 0 || rc != 0)
      _exit(2);
    if (write(fd, req, strlen(req)) != (ssize_t)strlen(req))
      _exit(3);
    while ((n = read(fd, buf, sizeof(buf))) > 0)
      fwrite(buf, 1, (size_t)n, f);
    _exit(n == 0 && fclose(f) == 0 ? 0 : 4);
  }
  return pid;
}

static pid_t scrape_in_child(const char *sock, const char *out) {
  return request_in_child(sock, out, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n");
}

/* Runs loop until child exits; asserts it exited 0. */
static void wait_child(uv_loop_t *loop, pid_t child) {
  int status = -1;
  for (int spins = 0; spins < 1000; spins++) {
    uv_run(loop, UV_RUN_ONCE);
    if (waitpid(child, &status, WNOHANG) == child)
      break;
  }
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
}

/* The value of header `name` in the HTTP answer t (NULL when absent); static storage. */
static const char *header(const char *t, const char *name) {
  static char v[128];
  const char *end = strstr(t, "\r\n\r\n");
  size_t nl = strlen(name);
  assert_non_null(end);
  for (const char *l = strstr(t, "\r\n"); l != NULL && l < end; l = strstr(l + 2, "\r\n")) {
    if (strncasecmp(l + 2, name, nl) == 0 && l[2 + nl] == ':') {
      const char *p = l + 3 + nl, *e;
      while (*p == ' ')
        p++;
      e = strstr(p, "\r\n");
      snprintf(v, sizeof v, "%.*s", (int)(e - p), p);
      return v;
    }
  }
  return NULL;
}

/* Checks t is "HTTP/1.0 <status>" with a Content-Length that matches its body (or, for a HEAD,
 * no body at all), and returns the body. */
static const char *http_body(const char *t, const char *status, int head_only) {
  char want[64];
  const char *cl = NULL, *body;
  snprintf(want, sizeof want, "HTTP/1.0 %s\r\n", status);
  if (strncmp(t, want, strlen(want)) != 0)
    fail_msg("answer is not '%s': '%.200s'", status, t);
  body = strstr(t, "\r\n\r\n");
  assert_non_null(body);
  body += 4;
  cl = header(t, "Content-Length");
  if (cl == NULL)
    fail_msg("answer has no Content-Length: '%.200s'", t);
  if (head_only) {
    assert_int_equal(strlen(body), 0);
    assert_true(strtoul(cl, NULL, 10) > 0);
  } else {
    assert_int_equal(strtoul(cl, NULL, 10), strlen(body));
  }
  return body;
}

static void test_exporters(void **state) {
  uv_loop_t loop;
  uv_timer_t keep;
  gpd_metrics *m;
  gpd_config cfg;
  char prom[sizeof(cfg.metrics_textfile)], out[sizeof(prom) + 16];
  struct stat sb;
  char *t;
  pid_t child;
  int status = -1, spins;
  (void)state;

  assert_int_equal(uv_loop_init(&loop), 0);
  /* The exporters' handles do not keep a loop alive on their own (the daemon's socket does);
   * this timer stands in for it. */
  assert_int_equal(uv_timer_init(&loop, &keep), 0);
  assert_int_equal(uv_timer_start(&keep, tick, 10, 10), 0);

  config_paths(&cfg, "gpupool.prom", "metrics.sock");
  fake_calls = 0;
  assert_int_equal(gpd_metrics_new(&m), 0);
  assert_int_equal(gpd_metrics_start(m, &loop, &cfg, &fake_source), 0);
  assert_int_equal(stat(cfg.metrics_socket, &sb), 0);
  assert_true(S_ISSOCK(sb.st_mode));
  assert_int_equal(sb.st_mode & 0777, 0640);

  /* The first write happens on the loop's first turn. */
  uv_run(&loop, UV_RUN_NOWAIT);
  snprintf(prom, sizeof(prom), "%s", cfg.metrics_textfile);
  t = read_file(prom);
  assert_non_null(t);
  check_stats_text(t);
  assert_int_equal(stat(prom, &sb), 0);
  assert_int_equal(sb.st_mode & 0777, 0644); /* readable by a collector, whatever the umask */
  free(t);
  snprintf(out, sizeof(out), "%s.tmp", prom);
  assert_int_equal(access(out, F_OK), -1); /* renamed away, never left behind */

  /* Rewritten every interval. */
  {
    int before = fake_calls;
    for (spins = 0; spins < 100 && fake_calls < before + 2; spins++)
      uv_run(&loop, UV_RUN_ONCE);
    assert_true(fake_calls >= before + 2);
  }

  /* The socket answers a scraper with the same families. */
  snprintf(out, sizeof(out), "%s/scrape.out", tmpdir);
  child = scrape_in_child(cfg.metrics_socket, out);
  for (spins = 0; spins < 1000; spins++) {
    uv_run(&loop, UV_RUN_ONCE);
    if (waitpid(child, &status, WNOHANG) == child)
      break;
  }
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
  t = read_file(out);
  assert_non_null(t);
  check_stats_text(http_body(t, "200 OK", 0));
  assert_non_null(strstr(header(t, "Content-Type"), "text/plain; version=0.0.4"));
  free(t);

  gpd_metrics_close(m);
  uv_timer_stop(&keep);
  uv_close((uv_handle_t *)&keep, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(access(cfg.metrics_socket, F_OK), -1);
  assert_int_equal(access(prom, F_OK), -1);
  /* Every handle was closed. */
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* One uid holding connections to the metrics socket: it gets at most
 * GPUPOOL__METRICS_MAX_CONNS_PER_UID of them (the rest are closed unanswered), and root still
 * gets an answer while they are held. Needs root, to connect from another uid. */
#define OTHER_UID 65534
#define OTHER_CONNS 16 /* the total cap: without a per-uid cap, this uid would take them all */

/* In the child, as OTHER_UID: opens OTHER_CONNS idle connections, says so on `ready` once the
 * refused ones are closed, and exits with the number that were answered. */
static void hog_connections(const char *sock, int ready) {
  struct sockaddr_un a;
  struct pollfd pf[OTHER_CONNS];
  int got_data[OTHER_CONNS] = {0}, done[OTHER_CONNS] = {0};
  int ndone = 0, refused = 0, answered = 0, told = 0;
  char buf[4096];

  if (setgid(OTHER_UID) != 0 || setuid(OTHER_UID) != 0)
    _exit(100);
  unix_addr(&a, sock);
  for (int i = 0; i < OTHER_CONNS; i++) {
    pf[i].fd = socket(AF_UNIX, SOCK_STREAM, 0);
    pf[i].events = POLLIN;
    if (pf[i].fd < 0 || connect(pf[i].fd, (struct sockaddr *)&a, sizeof(a)) != 0)
      _exit(101);
  }
  for (int spins = 0; spins < 500 && ndone < OTHER_CONNS; spins++) {
    if (poll(pf, OTHER_CONNS, 10) < 0)
      _exit(102);
    for (int i = 0; i < OTHER_CONNS; i++) {
      ssize_t n;
      if (done[i] || !(pf[i].revents & (POLLIN | POLLHUP)))
        continue;
      n = read(pf[i].fd, buf, sizeof(buf));
      if (n > 0) {
        got_data[i] = 1;
        continue;
      }
      done[i] = 1;
      pf[i].fd = -pf[i].fd - 1; /* poll ignores it from now on */
      ndone++;
      if (got_data[i])
        answered++;
      else
        refused++;
    }
    /* Every connection past the cap has been closed: the daemon holds only what it kept. */
    if (!told && (refused >= OTHER_CONNS - GPUPOOL__METRICS_MAX_CONNS_PER_UID || ndone == OTHER_CONNS)) {
      if (write(ready, "x", 1) != 1)
        _exit(103);
      told = 1;
    }
  }
  _exit(ndone == OTHER_CONNS ? answered : 104);
}

static void test_conns_per_uid(void **state) {
  uv_loop_t loop;
  uv_timer_t keep;
  gpd_metrics *m;
  gpd_config cfg;
  char out[sizeof(cfg.metrics_socket) + 16];
  char *t;
  int ready[2], status = -1, rstatus = -1, spins;
  pid_t hog, root;
  (void)state;

  if (geteuid() != 0)
    skip(); /* connecting as another uid needs root */
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(uv_timer_init(&loop, &keep), 0);
  assert_int_equal(uv_timer_start(&keep, tick, 10, 10), 0);
  config_paths(&cfg, NULL, "peruid.sock");
  cfg.socket_mode = 0666;
  assert_int_equal(chmod(tmpdir, 0755), 0); /* the other uid must reach the socket */
  assert_int_equal(gpd_metrics_new(&m), 0);
  assert_int_equal(gpd_metrics_start(m, &loop, &cfg, &fake_source), 0);

  assert_int_equal(pipe(ready), 0);
  hog = fork();
  assert_true(hog >= 0);
  if (hog == 0) {
    close(ready[0]);
    hog_connections(cfg.metrics_socket, ready[1]);
  }
  close(ready[1]);
  for (spins = 0; spins < 1000; spins++) {
    struct pollfd p = {.fd = ready[0], .events = POLLIN};
    uv_run(&loop, UV_RUN_ONCE);
    if (poll(&p, 1, 0) == 1)
      break;
  }
  assert_true(spins < 1000);
  close(ready[0]);

  /* While the other uid holds what it may, root's scrape is answered. */
  snprintf(out, sizeof(out), "%s/root.out", tmpdir);
  root = scrape_in_child(cfg.metrics_socket, out);
  for (spins = 0; spins < 1000 && (rstatus == -1 || status == -1); spins++) {
    uv_run(&loop, UV_RUN_ONCE);
    if (rstatus == -1 && waitpid(root, &rstatus, WNOHANG) != root)
      rstatus = -1;
    if (status == -1 && waitpid(hog, &status, WNOHANG) != hog)
      status = -1;
  }
  assert_true(WIFEXITED(rstatus));
  assert_int_equal(WEXITSTATUS(rstatus), 0);
  t = read_file(out);
  assert_non_null(t);
  {
    if (strncmp(t, "HTTP/1.0 200 OK\r\n", 17) != 0)
      fail_msg("root's scrape was not answered while uid %d held connections: '%s'", OTHER_UID, t);
    check_stats_text(http_body(t, "200 OK", 0));
  }
  free(t);
  /* The other uid got exactly the cap answered; the rest were closed unanswered. */
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), GPUPOOL__METRICS_MAX_CONNS_PER_UID);

  gpd_metrics_close(m);
  uv_timer_stop(&keep);
  uv_close((uv_handle_t *)&keep, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_refuses_bad_paths(void **state) {
  uv_loop_t loop;
  gpd_metrics *m;
  gpd_config cfg;
  char path[160], why[512];
  FILE *f;
  int rc;
  (void)state;

  assert_int_equal(uv_loop_init(&loop), 0);
  /* A textfile in a directory that does not exist: degraded at start, with the path. */
  config_paths(&cfg, "missing/dir/gpupool.prom", NULL);
  assert_int_equal(gpd_metrics_new(&m), 0);
  rc = gpd_metrics_start(m, &loop, &cfg, &fake_source);
  assert_int_equal(rc, 0);
  assert_int_equal(gpd_metrics_degraded(m, why, sizeof why), 1);
  assert_non_null(strstr(why, "missing/dir/gpupool.prom.tmp"));
  gpd_metrics_close(m);
  uv_run(&loop, UV_RUN_DEFAULT);

  /* A socket path taken by a regular file: refused, the file left alone. */
  config_paths(&cfg, NULL, "notasocket");
  f = fopen(cfg.metrics_socket, "we");
  assert_non_null(f);
  fclose(f);
  assert_int_equal(gpd_metrics_new(&m), 0);
  rc = gpd_metrics_start(m, &loop, &cfg, &fake_source);
  assert_int_equal(rc, 0);
  assert_int_equal(gpd_metrics_degraded(m, why, sizeof why), 1);
  assert_non_null(strstr(why, "not a socket"));
  gpd_metrics_close(m);
  assert_int_equal(access(cfg.metrics_socket, F_OK), 0);
  uv_run(&loop, UV_RUN_DEFAULT);

  /* A stale socket file (nobody listening) is replaced. */
  {
    struct sockaddr_un a;
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    config_paths(&cfg, NULL, "stale.sock");
    unix_addr(&a, cfg.metrics_socket);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    close(fd);
    snprintf(path, sizeof(path), "%s", cfg.metrics_socket);
    assert_int_equal(gpd_metrics_new(&m), 0);
    assert_int_equal(gpd_metrics_start(m, &loop, &cfg, &fake_source), 0);
    /* A second start while it serves is refused. */
    assert_int_equal(gpd_metrics_start(m, &loop, &cfg, &fake_source), GPUPOOL_EINVAL);
    gpd_metrics_close(m);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_int_equal(access(path, F_OK), -1);
  }

  /* A socket another process listens on is not taken over. */
  {
    struct sockaddr_un a;
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    config_paths(&cfg, NULL, "live.sock");
    unix_addr(&a, cfg.metrics_socket);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(fd, 4), 0);
    assert_int_equal(gpd_metrics_new(&m), 0);
    rc = gpd_metrics_start(m, &loop, &cfg, &fake_source);
    assert_int_equal(rc, 0);
    assert_int_equal(gpd_metrics_degraded(m, why, sizeof why), 1);
    assert_non_null(strstr(why, "another running process"));
    gpd_metrics_close(m);
    assert_int_equal(access(cfg.metrics_socket, F_OK), 0);
    close(fd);
    uv_run(&loop, UV_RUN_DEFAULT);
  }
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* Sends req to the exporter (the Unix socket, or 127.0.0.1:tcp_port when sock is NULL) from a
 * child and returns its whole answer (malloc'd). */
static char *ask(uv_loop_t *loop, const char *sock, int tcp_port, const char *req) {
  char out[128];
  snprintf(out, sizeof out, "%s/ask.out", tmpdir);
  wait_child(loop, request_in_child_at(sock, tcp_port, out, req));
  return read_file(out);
}

/* A free TCP port on 127.0.0.1 (bound and released; fd >= 0 keeps it taken, listening). */
static int tcp_port(int *keep) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  if (keep != NULL) {
    assert_int_equal(listen(fd, 4), 0);
    *keep = fd;
  } else {
    close(fd);
  }
  return ntohs(a.sin_port);
}

static void config_tcp(gpd_config *cfg, int port) {
  struct sockaddr_in *in = (struct sockaddr_in *)&cfg->metrics_addr;
  snprintf(cfg->metrics_listen, sizeof cfg->metrics_listen, "127.0.0.1:%d", port);
  memset(&cfg->metrics_addr, 0, sizeof cfg->metrics_addr);
  assert_int_equal(uv_ip4_addr("127.0.0.1", port, in), 0);
}

static void loop_done(uv_loop_t *loop, uv_timer_t *keep, gpd_metrics *m) {
  gpd_metrics_close(m);
  uv_timer_stop(keep);
  uv_close((uv_handle_t *)keep, NULL);
  uv_run(loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(loop), 0);
}

static void loop_begin(uv_loop_t *loop, uv_timer_t *keep) {
  assert_int_equal(uv_loop_init(loop), 0);
  assert_int_equal(uv_timer_init(loop, keep), 0);
  assert_int_equal(uv_timer_start(keep, tick, 10, 10), 0);
}

/* A textfile directory that does not exist degrades the textfile exporter only: the socket
 * serves, the degraded state names the path, and the textfile appears once the directory does. */
static void test_textfile_missing_dir(void **state) {
  uv_loop_t loop;
  uv_timer_t keep;
  gpd_metrics *m;
  gpd_config cfg;
  char dir[128], why[512], *t;
  int spins;
  (void)state;

  loop_begin(&loop, &keep);
  config_paths(&cfg, "later/gpupool.prom", "metrics.sock");
  assert_int_equal(gpd_metrics_new(&m), 0);
  assert_int_equal(gpd_metrics_start(m, &loop, &cfg, &fake_source), 0);
  assert_int_equal(gpd_metrics_degraded(m, why, sizeof why), 1);
  assert_non_null(strstr(why, "metrics textfile: "));
  assert_non_null(strstr(why, "later/gpupool.prom.tmp"));

  t = ask(&loop, cfg.metrics_socket, 0, "GET /metrics HTTP/1.1\r\n\r\n");
  check_stats_text(http_body(t, "200 OK", 0));
  free(t);

  /* Retried on its timer: the directory made later is written to. */
  snprintf(dir, sizeof dir, "%s/later", tmpdir);
  assert_int_equal(mkdir(dir, 0755), 0);
  for (spins = 0; spins < 1000 && access(cfg.metrics_textfile, F_OK) != 0; spins++)
    uv_run(&loop, UV_RUN_ONCE);
  t = read_file(cfg.metrics_textfile);
  assert_non_null(t);
  check_stats_text(t);
  free(t);
  assert_int_equal(gpd_metrics_degraded(m, why, sizeof why), 0);
  assert_string_equal(why, "");
  loop_done(&loop, &keep, m);
}

/* A TCP port already taken degrades the TCP exporter only: the socket file stays and serves. */
static void test_tcp_taken(void **state) {
  uv_loop_t loop;
  uv_timer_t keep;
  gpd_metrics *m;
  gpd_config cfg;
  struct stat sb;
  char why[512], *t;
  int holder, port;
  (void)state;

  loop_begin(&loop, &keep);
  port = tcp_port(&holder);
  config_paths(&cfg, NULL, "metrics.sock");
  config_tcp(&cfg, port);
  assert_int_equal(gpd_metrics_new(&m), 0);
  assert_int_equal(gpd_metrics_start(m, &loop, &cfg, &fake_source), 0);
  assert_int_equal(gpd_metrics_degraded(m, why, sizeof why), 1);
  assert_non_null(strstr(why, "metrics tcp: "));
  assert_non_null(strstr(why, cfg.metrics_listen));
  assert_int_equal(stat(cfg.metrics_socket, &sb), 0);
  assert_true(S_ISSOCK(sb.st_mode));
  t = ask(&loop, cfg.metrics_socket, 0, "GET /metrics HTTP/1.1\r\n\r\n");
  check_stats_text(http_body(t, "200 OK", 0));
  free(t);
  close(holder);
  loop_done(&loop, &keep, m);
}

/* GET /metrics and / are 200, HEAD has the headers only, other paths 404, other methods 405
 * with Allow; over TCP as over the Unix socket, and the log names the bound address. */
static void test_http(void **state) {
  uv_loop_t loop;
  uv_timer_t keep;
  gpd_metrics *m;
  gpd_config cfg;
  char logpath[128], want[96], *t, *log;
  int port, saved;
  (void)state;

  loop_begin(&loop, &keep);
  port = tcp_port(NULL);
  config_paths(&cfg, NULL, "metrics.sock");
  config_tcp(&cfg, port);
  assert_int_equal(gpd_metrics_new(&m), 0);
  /* The log is stderr: catch what start says. */
  snprintf(logpath, sizeof logpath, "%s/log", tmpdir);
  fflush(stderr);
  saved = dup(2);
  {
    int fd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    dup2(fd, 2);
    close(fd);
  }
  assert_int_equal(gpd_metrics_start(m, &loop, &cfg, &fake_source), 0);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  log = read_file(logpath);
  assert_non_null(log);
  snprintf(want, sizeof want, "http://127.0.0.1:%d/metrics", port);
  if (strstr(log, want) == NULL)
    fail_msg("the log does not name %s:\n%s", want, log);
  free(log);

  for (int tcp = 0; tcp < 2; tcp++) {
    const char *sock = tcp ? NULL : cfg.metrics_socket;
    int p = tcp ? port : 0;
    const char *body;
    size_t len;

    t = ask(&loop, sock, p, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    body = http_body(t, "200 OK", 0);
    check_stats_text(body);
    len = strlen(body);
    assert_non_null(strstr(header(t, "Content-Type"), "text/plain; version=0.0.4"));
    free(t);

    t = ask(&loop, sock, p, "GET / HTTP/1.0\r\n\r\n");
    check_stats_text(http_body(t, "200 OK", 0));
    free(t);

    t = ask(&loop, sock, p, "HEAD /metrics HTTP/1.1\r\n\r\n");
    http_body(t, "200 OK", 1);
    /* The length a GET gets, give or take the counters' digits. */
    assert_true(strtoul(header(t, "Content-Length"), NULL, 10) + 64 > len);
    free(t);

    t = ask(&loop, sock, p, "GET /nonexistent HTTP/1.1\r\n\r\n");
    http_body(t, "404 Not Found", 0);
    free(t);

    t = ask(&loop, sock, p, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    http_body(t, "405 Method Not Allowed", 0);
    assert_non_null(header(t, "Allow"));
    assert_string_equal(header(t, "Allow"), "GET, HEAD");
    free(t);
  }
  loop_done(&loop, &keep, m);
}

/* metrics_socket_group gives the socket that group (root only: chown to any group). */
static void test_socket_group(void **state) {
  uv_loop_t loop;
  uv_timer_t keep;
  gpd_metrics *m;
  gpd_config cfg;
  struct stat sb;
  char why[256];
  (void)state;

  if (geteuid() != 0)
    skip();
  loop_begin(&loop, &keep);
  config_paths(&cfg, NULL, "metrics.sock");
  snprintf(cfg.metrics_socket_group, sizeof cfg.metrics_socket_group, "65534");
  cfg.metrics_socket_gid = 65534;
  assert_int_equal(gpd_metrics_new(&m), 0);
  assert_int_equal(gpd_metrics_start(m, &loop, &cfg, &fake_source), 0);
  assert_int_equal(gpd_metrics_degraded(m, why, sizeof why), 0);
  assert_int_equal(stat(cfg.metrics_socket, &sb), 0);
  assert_int_equal(sb.st_gid, 65534);
  assert_int_equal(sb.st_mode & 0777, 0640);
  loop_done(&loop, &keep, m);
}

/* The key takes a group name or a gid, and refuses a name that is no group, saying so. */
static void test_socket_group_key(void **state) {
  gpd_config cfg;
  (void)state;

  gpd_config_defaults(&cfg);
  assert_string_equal(cfg.metrics_socket_group, "");
  assert_int_equal(gpd_config_set(&cfg, "metrics_socket_group", "root"), 0);
  assert_int_equal(cfg.metrics_socket_gid, 0);
  assert_int_equal(gpd_config_set(&cfg, "metrics_socket_group", "4242"), 0);
  assert_int_equal(cfg.metrics_socket_gid, 4242);
  assert_int_not_equal(gpd_config_set(&cfg, "metrics_socket_group", "no-such-group-here"), 0);
  assert_non_null(strstr(gpupool__errmsg(), "no-such-group-here' is no group"));
}

static double value_of(const char *text, const char *name) {
  char want[96];
  const char *p;
  snprintf(want, sizeof want, "\n%s ", name);
  p = strstr(text, want);
  if (p == NULL)
    fail_msg("no %s in:\n%s", name, text);
  return strtod(p + strlen(want), NULL);
}

/* The standard process_* families, with their types and plausible values. */
static void test_process_metrics(void **state) {
  gpd_metrics *m;
  char *t;
  double now = (double)time(NULL);
  (void)state;

  assert_int_equal(gpd_metrics_new(&m), 0);
  t = gpd_metrics_render(m, NULL);
  assert_non_null(t);
  check_format(t);
  must_contain(t, "# TYPE process_cpu_seconds_total counter\n");
  must_contain(t, "# TYPE process_resident_memory_bytes gauge\n");
  must_contain(t, "# TYPE process_open_fds gauge\n");
  must_contain(t, "# TYPE process_max_fds gauge\n");
  must_contain(t, "# TYPE process_start_time_seconds gauge\n");
  assert_true(value_of(t, "process_cpu_seconds_total") >= 0);
  assert_true(value_of(t, "process_resident_memory_bytes") > 4096);
  assert_true(value_of(t, "process_open_fds") >= 3);
  assert_true(value_of(t, "process_open_fds") <= value_of(t, "process_max_fds"));
  /* Started before now, and not before this test binary could have been started. */
  assert_true(value_of(t, "process_start_time_seconds") <= now + 1);
  assert_true(value_of(t, "process_start_time_seconds") > now - 3600);
  free(t);
  gpd_metrics_close(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_counters_and_histogram),
      cmocka_unit_test(test_every_kind_named),
      cmocka_unit_test(test_render_stats),
      cmocka_unit_test(test_exporters),
      cmocka_unit_test(test_conns_per_uid),
      cmocka_unit_test(test_refuses_bad_paths),
      cmocka_unit_test(test_textfile_missing_dir),
      cmocka_unit_test(test_tcp_taken),
      cmocka_unit_test(test_http),
      cmocka_unit_test(test_socket_group),
      cmocka_unit_test(test_socket_group_key),
      cmocka_unit_test(test_process_metrics),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
