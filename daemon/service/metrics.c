/*
 * Prometheus metrics for gpupoold.
 *
 * This file owns two things: the request counters and latency histogram that the server
 * bumps on every request (plain arrays indexed by request type and result, so counting costs
 * a few additions on the hot path), and the rendering of those together with a StatsReply
 * snapshot (and the standard process_* families) into the text exposition format 0.0.4.
 * metrics_export.c owns the three ways the text leaves the process (metrics_http.c the
 * scrapers' connections):
 * - a textfile (for node_exporter's textfile collector) rewritten every metrics_interval_ms
 *   by writing "<path>.tmp" and rename(2)-ing it over the file, so a scraper never reads a
 *   half-written file;
 * - a Unix socket that answers every connection with one HTTP/1.0 response and then closes
 *   (GET or HEAD of /metrics or / gets the text with its Content-Length, another path 404,
 *   another method 405); whoever may connect is decided by file permissions and the
 *   socket's group (metrics_socket_group, so scrapers need not be in the daemon's group);
 * - opt-in (metrics_listen), the same answer on a TCP address that Prometheus can scrape
 *   directly: loopback unless the operator names another address.
 *
 * Each of the three starts and fails on its own: one that cannot start is logged as degraded
 * with its reason (gpd_metrics_degraded() gives the list to a status line) while the others
 * serve, and the textfile one keeps retrying on its timer.
 *
 * Scrapers are other users' processes, so their connections are bounded like clients': each
 * listener has slots of its own (one busy listener cannot lock the other out), a peer holds a
 * few of them at most (on the Unix socket per uid, from SO_PEERCRED; on TCP per uid too when
 * the peer is on this host, found through sock_diag, else per source address), a couple are
 * kept for root and the daemon's uid, and each connection is closed after a short deadline
 * whether or not the peer reads its answer.
 *
 * All of that state is one gpd_metrics handle, owned by the server, which hands in
 * itself as the stats source; nothing here names the server. The daemon is single-threaded
 * on its libuv loop, so the state here needs no locking.
 */
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "errors.h"
#include "paths.h"
#include "log.h"
#include "metrics_internal.h"

/* ---- counters ------------------------------------------------------------------------------ */

static const char *type_name(int t) { return t == 0 ? "unknown" : gpupool__request_kinds[t - 1].name; }

/* Upper bounds in seconds (Prometheus "le"), 10 us to 1 s, and the same in nanoseconds. */
static const char *const bucket_le[] = {"1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025",
                                        "0.0005", "0.001", "0.0025", "0.005", "0.01",
                                        "0.025", "0.05", "0.1", "0.25", "0.5", "1"};
static const uint64_t bucket_ns[] = {10000ull,    25000ull,    50000ull,     100000ull,
                                     250000ull,   500000ull,   1000000ull,   2500000ull,
                                     5000000ull,  10000000ull, 25000000ull,  50000000ull,
                                     100000000ull, 250000000ull, 500000000ull, 1000000000ull};
_Static_assert(sizeof(bucket_ns) / sizeof(bucket_ns[0]) == N_BUCKETS, "one bound per bucket");
_Static_assert(sizeof(bucket_le) / sizeof(bucket_le[0]) == N_BUCKETS, "one label per bucket");

int gpd_metrics_new(gpd_metrics **out) {
  gpd_metrics *m = calloc(1, sizeof(*m));
  if (m == NULL)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory for the metrics");
  *out = m;
  return 0;
}

void gpd_metrics_request(gpd_metrics *m, int body_case, int result, uint64_t latency_ns) {
  int t = gpupool__request_index(body_case) + 1;
  int r = result == 0 ? 0 : (result < 0 && -result < RESULT_OTHER ? -result : RESULT_OTHER);
  int b = 0;

  m->req_count[t][r]++;
  while (b < N_BUCKETS && latency_ns > bucket_ns[b])
    b++;
  m->lat_bucket[t][b]++;
  m->lat_sum_ns[t] += latency_ns;
  m->lat_count[t]++;
}

/* ---- rendering ----------------------------------------------------------------------------- */

typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} sbuf;

static void sb_vprintf(sbuf *b, const char *fmt, va_list ap) {
  va_list ap2;
  int n;

  if (b->oom)
    return;
  va_copy(ap2, ap);
  n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap2);
  va_end(ap2);
  if (n < 0) {
    b->oom = 1;
    return;
  }
  if (b->p == NULL || b->len + (size_t)n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    char *np;
    while (cap < b->len + (size_t)n + 1)
      cap *= 2;
    np = realloc(b->p, cap);
    if (np == NULL) {
      b->oom = 1;
      return;
    }
    b->p = np;
    b->cap = cap;
    vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
  }
  b->len += (size_t)n;
}

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sb_vprintf(b, fmt, ap);
  va_end(ap);
}

/* A label value with the three characters the exposition format escapes. */
static void sb_label(sbuf *b, const char *s) {
  for (; s != NULL && *s; s++) {
    if (*s == '\\')
      sb_printf(b, "\\\\");
    else if (*s == '"')
      sb_printf(b, "\\\"");
    else if (*s == '\n')
      sb_printf(b, "\\n");
    else
      sb_printf(b, "%c", *s);
  }
}

static void family(sbuf *b, const char *name, const char *type, const char *help) {
  sb_printf(b, "# HELP gpupool_%s %s\n# TYPE gpupool_%s %s\n", name, help, name, type);
}

static const char *result_name(int r) {
  if (r == 0)
    return "ok";
  if (r == RESULT_OTHER)
    return "other";
  return gpupool_err_name(-r);
}

static void render_requests(sbuf *b, const gpd_metrics *m) {
  family(b, "requests_total", "counter", "Requests handled, by request type and result.");
  for (int t = 0; t < N_TYPES; t++)
    for (int r = 0; r < N_RESULTS; r++)
      if (m->req_count[t][r])
        sb_printf(b, "gpupool_requests_total{type=\"%s\",result=\"%s\"} %llu\n", type_name(t),
                  result_name(r), (unsigned long long)m->req_count[t][r]);

  family(b, "request_duration_seconds", "histogram",
         "Time from reading a request to queuing its reply, by request type.");
  for (int t = 0; t < N_TYPES; t++) {
    uint64_t cum = 0;
    if (m->lat_count[t] == 0)
      continue;
    for (int i = 0; i < N_BUCKETS; i++) {
      cum += m->lat_bucket[t][i];
      sb_printf(b, "gpupool_request_duration_seconds_bucket{type=\"%s\",le=\"%s\"} %llu\n",
                type_name(t), bucket_le[i], (unsigned long long)cum);
    }
    sb_printf(b, "gpupool_request_duration_seconds_bucket{type=\"%s\",le=\"+Inf\"} %llu\n",
              type_name(t), (unsigned long long)m->lat_count[t]);
    sb_printf(b, "gpupool_request_duration_seconds_sum{type=\"%s\"} %.9f\n", type_name(t),
              (double)m->lat_sum_ns[t] / 1e9);
    sb_printf(b, "gpupool_request_duration_seconds_count{type=\"%s\"} %llu\n", type_name(t),
              (unsigned long long)m->lat_count[t]);
  }
}


/* One per-pool gauge family: the value of each pool is read at `off` in PoolInfo. */
typedef struct {
  const char *name;
  const char *help;
  size_t off;
} pool_gauge;

#define PG(field, name, help) {name, help, offsetof(Gpupool__Wire__PoolInfo, field)}
static const pool_gauge pool_gauges[] = {
    PG(capacity, "pool_capacity_bytes", "Most bytes the pool may hold in slabs."),
    PG(slab_size, "pool_slab_size_bytes", "Size of a regular slab."),
    PG(max_alloc, "pool_max_alloc_bytes", "Largest single allocation the pool accepts."),
    PG(used, "pool_used_bytes", "Bytes in live buffers."),
    PG(reserved, "pool_reserved_bytes", "Bytes in slabs taken from the backend."),
    PG(used_high, "pool_used_high_bytes", "High-water mark of used bytes."),
    PG(reserved_high, "pool_reserved_high_bytes", "High-water mark of reserved bytes."),
    PG(backend_used, "pool_backend_used_bytes",
       "Backend's own used-bytes counter (cudaMemPoolAttrUsedMemCurrent), 0 if none."),
    PG(backend_reserved, "pool_backend_reserved_bytes",
       "Backend's own reserved-bytes counter (cudaMemPoolAttrReservedMemCurrent), 0 if none."),
    PG(backend_used_high, "pool_backend_used_high_bytes", "Backend's used high-water mark."),
    PG(backend_reserved_high, "pool_backend_reserved_high_bytes",
       "Backend's reserved high-water mark."),
    PG(buffers, "pool_buffers", "Live buffers in the pool."),
    PG(slabs, "pool_slabs", "Slabs the pool holds."),
};
#undef PG

/* Each [peer]: what was fetched from it and served to it. */
static void render_peers(sbuf *b, const Gpupool__Wire__StatsReply *st) {
  if (!st->n_peers)
    return;
  static const struct {
    const char *name, *type, *help;
    size_t off;
  } pg[] = {
      {"peer_up", "gauge", "1 while the connection to the peer is up and authenticated.", 0},
      {"peer_fetches_in_flight", "gauge", "Fetches from the peer in flight.",
       offsetof(Gpupool__Wire__PeerInfo, fetches_in_flight)},
      {"peer_fetches_total", "counter", "Versions fetched from the peer.", offsetof(Gpupool__Wire__PeerInfo, fetches)},
      {"peer_fetch_failures_total", "counter", "Fetches from the peer that failed.",
       offsetof(Gpupool__Wire__PeerInfo, failures)},
      {"peer_fetched_bytes_total", "counter", "Bytes fetched from the peer.",
       offsetof(Gpupool__Wire__PeerInfo, bytes_fetched)},
      {"peer_versions_served_total", "counter", "Versions served to the peer.",
       offsetof(Gpupool__Wire__PeerInfo, versions_served)},
      {"peer_served_bytes_total", "counter", "Bytes of the versions served to the peer.",
       offsetof(Gpupool__Wire__PeerInfo, bytes_served)},
      {"peer_staged_bytes_total", "counter",
       "Bytes fetched from or served to the peer through pinned host staging (device memory).",
       offsetof(Gpupool__Wire__PeerInfo, bytes_staged)},
  };
  for (size_t i = 0; i < sizeof(pg) / sizeof(pg[0]); i++) {
    family(b, pg[i].name, pg[i].type, pg[i].help);
    for (size_t p = 0; p < st->n_peers; p++) {
      const Gpupool__Wire__PeerInfo *pi = st->peers[p];
      unsigned long long v;
      if (i == 0)
        v = !strcmp(pi->state, "connected");
      else if (pg[i].off == offsetof(Gpupool__Wire__PeerInfo, fetches_in_flight))
        v = pi->fetches_in_flight;
      else {
        uint64_t x;
        memcpy(&x, (const char *)pi + pg[i].off, sizeof x);
        v = x;
      }
      sb_printf(b, "gpupool_%s{peer=\"", pg[i].name);
      sb_label(b, pi->name);
      sb_printf(b, "\"} %llu\n", v);
    }
  }
}

static void render_stats(sbuf *b, const Gpupool__Wire__StatsReply *st) {
  struct {
    const char *name, *help;
    uint64_t v;
  } g[] = {
      {"clients", "Connected clients.", st->clients},
      {"buffers", "Live buffers.", st->buffers},
      {"holds", "Live holds on buffers.", st->holds},
      {"names", "Published names.", st->names},
      {"open_fds", "File descriptors the daemon has open.", st->open_fds},
      {"pending_frees", "Buffers whose ranges wait on events or a lease before reuse.",
       st->pending_frees},
      {"waiting_leases", "Closed connections whose processes still hold their lease (memory pinned).",
       st->waiting_leases},
      {"uptime_seconds", "Seconds since the daemon started.", st->uptime_s},
      {"replica_copies_in_flight", "Replica copy jobs not yet ended (running, or waiting for a copy slot).",
       st->replica_copies_running},
      {"opens_waiting", "Opens waiting for the share of a token handed on before the daemon read that share.",
       st->opens_waiting},
  };
  struct {
    const char *name, *help;
    uint64_t v;
  } ctr[] = {
      {"replica_copies_total", "Replica copy jobs started (one per version and device, or per broadcast).",
       st->replica_copies},
      {"replica_bytes_copied_total", "Bytes copied into replicas by completed jobs, per destination.",
       st->replica_bytes},
      {"replica_copies_failed_total", "Replica copy jobs that failed or were cancelled.",
       st->replica_copies_failed},
      {"opens_waited_total", "Opens that waited for the share of a token handed on before the daemon read "
       "that share.", st->opens_waited},
  };

  family(b, "build_info", "gauge", "Daemon version and backend; the value is always 1.");
  sb_printf(b, "gpupool_build_info{version=\"");
  sb_label(b, st->daemon_version);
  sb_printf(b, "\",backend=\"%s\"} 1\n", gpupool__wire_backend_name(st->backend));
  for (size_t i = 0; i < sizeof(g) / sizeof(g[0]); i++) {
    family(b, g[i].name, "gauge", g[i].help);
    sb_printf(b, "gpupool_%s %llu\n", g[i].name, (unsigned long long)g[i].v);
  }
  for (size_t i = 0; i < sizeof(ctr) / sizeof(ctr[0]); i++) {
    family(b, ctr[i].name, "counter", ctr[i].help);
    sb_printf(b, "gpupool_%s %llu\n", ctr[i].name, (unsigned long long)ctr[i].v);
  }

  family(b, "pool_info", "gauge", "Where each pool's memory lives; the value is always 1.");
  for (size_t p = 0; p < st->n_pools; p++) {
    const Gpupool__Wire__PoolInfo *pi = st->pools[p];
    sb_printf(b, "gpupool_pool_info{pool=\"");
    sb_label(b, pi->name);
    sb_printf(b, "\",id=\"%u\",backend=\"%s\",location=\"%s\",device=\"%d\",numa_node=\"%d\"} 1\n",
              pi->id, gpupool__wire_backend_name(pi->backend), gpupool__wire_location_name(pi->location), pi->device,
              pi->numa_node);
  }
  render_peers(b, st);
  for (size_t i = 0; i < sizeof(pool_gauges) / sizeof(pool_gauges[0]); i++) {
    family(b, pool_gauges[i].name, "gauge", pool_gauges[i].help);
    for (size_t p = 0; p < st->n_pools; p++) {
      const Gpupool__Wire__PoolInfo *pi = st->pools[p];
      uint64_t v;
      memcpy(&v, (const char *)pi + pool_gauges[i].off, sizeof(v));
      sb_printf(b, "gpupool_%s{pool=\"", pool_gauges[i].name);
      sb_label(b, pi->name);
      sb_printf(b, "\"} %llu\n", (unsigned long long)v);
    }
  }
}

/* The standard process_* families (Prometheus client libraries' names and types), from
 * /proc/self: what a dashboard made for any exporter shows without knowing gpupool. A value
 * that cannot be read is left out rather than shown as 0. */
static void render_process(sbuf *b) {
  long tck = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
  unsigned long long utime = 0, stime = 0, start = 0, vsize = 0, btime = 0;
  long long rss = 0;
  int have_stat = 0, fds = -1;
  struct rlimit rl;
  char buf[1024];
  FILE *f;

  f = fopen("/proc/self/stat", "re");
  if (f != NULL) {
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    char *p;
    buf[n] = '\0';
    fclose(f);
    /* Fields after the command name, which may hold spaces: state is field 3. */
    p = strrchr(buf, ')');
    if (p != NULL &&
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d %*d "
                      "%llu %llu %lld", &utime, &stime, &start, &vsize, &rss) == 5)
      have_stat = 1;
  }
  f = fopen("/proc/stat", "re");
  if (f != NULL) {
    while (fgets(buf, sizeof buf, f) != NULL)
      if (sscanf(buf, "btime %llu", &btime) == 1)
        break;
    fclose(f);
  }
  {
    DIR *d = opendir("/proc/self/fd");
    if (d != NULL) {
      struct dirent *e;
      fds = 0;
      while ((e = readdir(d)) != NULL)
        fds += e->d_name[0] != '.';
      fds--; /* the directory's own fd */
      closedir(d);
    }
  }
  if (have_stat && tck > 0) {
    sb_printf(b, "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
                 "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total %.2f\n",
              (double)(utime + stime) / (double)tck);
    sb_printf(b, "# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
                 "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes %lld\n",
              rss * (long long)page);
    sb_printf(b, "# HELP process_virtual_memory_bytes Virtual memory size in bytes.\n"
                 "# TYPE process_virtual_memory_bytes gauge\nprocess_virtual_memory_bytes %llu\n", vsize);
    if (btime > 0)
      sb_printf(b, "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
                   "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %.2f\n",
                (double)btime + (double)start / (double)tck);
  }
  if (fds >= 0)
    sb_printf(b, "# HELP process_open_fds Number of open file descriptors.\n"
                 "# TYPE process_open_fds gauge\nprocess_open_fds %d\n", fds);
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    sb_printf(b, "# HELP process_max_fds Maximum number of open file descriptors.\n"
                 "# TYPE process_max_fds gauge\nprocess_max_fds %llu\n", (unsigned long long)rl.rlim_cur);
}

/* Whether each configured exporter serves: what an alert on a degraded exporter reads (the
 * reason is in the log and in gpupoolctl status). */
static void render_exporters(sbuf *b, const gpd_metrics *m) {
  const struct {
    const char *name, *conf, *why;
  } e[] = {{"textfile", m->textfile, m->why_textfile}, {"socket", m->sock, m->why_socket},
           {"tcp", m->listen, m->why_tcp}};
  int any = 0;
  for (size_t i = 0; i < sizeof e / sizeof e[0]; i++) {
    if (!e[i].conf[0])
      continue;
    if (!any++)
      family(b, "metrics_exporter_up", "gauge",
             "1 while a configured metrics exporter serves, 0 while it is degraded (retried).");
    sb_printf(b, "gpupool_metrics_exporter_up{exporter=\"%s\"} %d\n", e[i].name, e[i].why[0] ? 0 : 1);
  }
}

char *gpd_metrics_render(const gpd_metrics *m, const Gpupool__Wire__StatsReply *st) {
  sbuf b = {0};

  if (st != NULL)
    render_stats(&b, st);
  render_exporters(&b, m);
  render_requests(&b, m);
  render_process(&b);
  if (b.oom) {
    free(b.p);
    return NULL;
  }
  return b.p;
}

