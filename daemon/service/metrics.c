/*
 * Prometheus metrics for gpupoold.
 *
 * This file owns three things: the request counters and latency histogram that the server
 * bumps on every request (plain arrays indexed by request type and result, so counting costs
 * a few additions on the hot path), the rendering of those together with a StatsReply
 * snapshot (and the standard process_* families) into the text exposition format 0.0.4, and
 * the three ways the text leaves the process:
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
#include "metrics.h"
#include "requests.h"

/* ---- counters ------------------------------------------------------------------------------ */

/* Request types: index 0 counts frames whose body was missing or unknown, index i + 1 the row
 * i of the request table (common/requests.h), so every kind is counted under its own name. */
#define N_TYPES (GPUPOOL__NREQUESTS + 1)

static const char *type_name(int t) { return t == 0 ? "unknown" : gpupool__request_kinds[t - 1].name; }

/* Results: index 0 is success, index i (1..) is error code -i; the last slot takes codes
 * outside the known range so a new code is still counted somewhere. */
#define N_RESULTS (-GPUPOOL_ERRNO_MIN + 1)
#define RESULT_OTHER (N_RESULTS - 1)

/* Upper bounds in seconds (Prometheus "le"), 10 us to 1 s, and the same in nanoseconds. */
static const char *const bucket_le[] = {"1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025",
                                        "0.0005", "0.001", "0.0025", "0.005", "0.01",
                                        "0.025", "0.05", "0.1", "0.25", "0.5", "1"};
static const uint64_t bucket_ns[] = {10000ull,    25000ull,    50000ull,     100000ull,
                                     250000ull,   500000ull,   1000000ull,   2500000ull,
                                     5000000ull,  10000000ull, 25000000ull,  50000000ull,
                                     100000000ull, 250000000ull, 500000000ull, 1000000000ull};
#define N_BUCKETS ((int)(sizeof(bucket_ns) / sizeof(bucket_ns[0])))

/* ---- the handle ---------------------------------------------------------------------------- */

#define MAX_CONNS GPUPOOL__METRICS_MAX_CONNS
#define MAX_CONNS_PER_UID GPUPOOL__METRICS_MAX_CONNS_PER_UID
#define RESERVED_CONNS GPUPOOL__METRICS_RESERVED_CONNS
/* The accept queue of each listener: listen_backlog, as for the client socket (the kernel caps
 * it at net.core.somaxconn). Deep, so that another user's burst of connections waiting there
 * while the loop is busy does not get root's connect refused (a scraper's non-blocking
 * connect fails at once on a full queue); once accepted, the slots below decide. */
#define BACKLOG(cfg) ((int)((cfg)->listen_backlog ? (cfg)->listen_backlog : SOMAXCONN))
#define REQ_MAX 8192
#define REQ_TIMEOUT_MS 1000
/* From the answer being queued to the connection being closed, read or not: a peer that
 * never reads must not keep its slot. */
#define WRITE_TIMEOUT_MS 2000

/* One scraper's connection. */
typedef struct conn {
  /* Unix or TCP: both stream handles start with the same fields, so the code below uses
   * `pipe` for either (and `tcp` where the type matters: uv_tcp_init). */
  union {
    uv_pipe_t pipe;
    uv_tcp_t tcp;
  };
  gpd_metrics *m;
  uv_timer_t timer;
  uv_write_t wr;
  char rbuf[512];
  char tail[4];   /* last bytes seen, to find the blank line across reads */
  size_t seen;    /* request bytes read so far */
  char line[128]; /* the start of the request line ("GET /metrics HTTP/1.1") */
  size_t linelen;
  int line_done;
  int answered;
  int open_handles;
  int on_tcp;     /* came in on the TCP listener (its slots are apart from the Unix socket's) */
  int has_uid;    /* uid is the peer's: SO_PEERCRED on the Unix socket, sock_diag for a local TCP peer */
  uid_t uid;
  struct sockaddr_storage addr; /* TCP: the peer's address (its port ignored) */
  char *resp;
  struct conn *next;
} conn;

struct gpd_metrics {
  /* Counters, bumped on every request. */
  uint64_t req_count[N_TYPES][N_RESULTS];
  /* Per-bucket (not cumulative) counts; slot N_BUCKETS holds what is above the last bound. */
  uint64_t lat_bucket[N_TYPES][N_BUCKETS + 1];
  uint64_t lat_sum_ns[N_TYPES];
  uint64_t lat_count[N_TYPES];

  /* Exporters. */
  int started;
  int closing;      /* close() was called: free when the last handle has closed */
  int open_handles; /* the handles below that are open or closing (conns count apart) */
  uv_loop_t *loop;
  gpd_stats_source src;
  char textfile[sizeof(((gpd_config *)0)->metrics_textfile)];
  char tmpfile[sizeof(((gpd_config *)0)->metrics_textfile) + 8];
  char sock[sizeof(((gpd_config *)0)->metrics_socket)];
  uv_timer_t timer;
  int timer_on;
  uv_pipe_t srv;
  int srv_on;
  uv_tcp_t tcp_srv;
  int tcp_on;
  char listen[sizeof(((gpd_config *)0)->metrics_listen)];
  int sock_bound; /* the socket file is ours to remove */
  /* Why each exporter is not serving ("" while it is): each starts and fails on its own. */
  char why_textfile[GPUPOOL__ERRMSG_MAX];
  char why_socket[GPUPOOL__ERRMSG_MAX];
  char why_tcp[GPUPOOL__ERRMSG_MAX];
  /* A TCP listener that could not start (the port taken, the address not there yet) is tried
   * again, every retry_ms, doubling up to RETRY_MAX_MS, until it serves. */
  struct sockaddr_storage tcp_addr;
  int backlog; /* the listeners' accept queue, kept for the retries (which have no config) */
  uv_timer_t retry;
  int retry_on;
  uint32_t retry_ms;
  int write_failing;
  conn *conns;
  int nconns;
  /* Takes a connection off the backlog when there is no memory for it: libuv stops accepting
   * until the pending one is taken, so it must be taken even to be dropped. */
  uv_pipe_t drop_pipe;
  int drop_busy;
};

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
  if (st->n_peers) {
    /* Each [peer]: what was fetched from it and served to it. */
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

/* ---- exposition: textfile and socket -------------------------------------------------------- */

#define CT_METRICS "text/plain; version=0.0.4; charset=utf-8"

/* Frees m once close() was called and nothing of it is open any more. */
static void maybe_free(gpd_metrics *m) {
  if (m->closing && m->open_handles == 0 && m->conns == NULL)
    free(m);
}

/* Close callback of m's own handles (timer, listeners, drop pipe). */
static void handle_closed(uv_handle_t *h) {
  gpd_metrics *m = h->data;
  m->open_handles--;
  maybe_free(m);
}

static void close_handle(gpd_metrics *m, uv_handle_t *h) {
  h->data = m;
  uv_close(h, handle_closed);
}

/* Text for the current state; NULL (logged) when out of memory. */
static char *snapshot_text(gpd_metrics *m) {
  Gpupool__Wire__StatsReply st = GPUPOOL__WIRE__STATS_REPLY__INIT;
  char *text;
  int have = 0;

  if (m->src.fill != NULL) {
    int rc = m->src.fill(m->src.arg, &st);
    if (rc == 0)
      have = 1;
    else
      GPUPOOL__PEER_WARN(NULL, 0, "metrics: cannot take a stats snapshot (%s); exporting request counters only",
              gpupool__errmsg()[0] ? gpupool__errmsg() : gpupool_strerror(rc));
  }
  text = gpd_metrics_render(m, have ? &st : NULL);
  if (have && m->src.release != NULL)
    m->src.release(m->src.arg, &st);
  if (text == NULL)
    GPUPOOL__PEER_WARN(NULL, 0, "metrics: out of memory rendering the metrics text");
  return text;
}

static int write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

static void write_textfile(gpd_metrics *m) {
  char *text = snapshot_text(m);
  const char *what = NULL;
  int fd = -1, err = 0;

  if (text == NULL)
    return;
  fd = open(m->tmpfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    what = "create";
    err = errno;
    goto out;
  }
  /* Readable by the collector (another user) whatever the daemon's umask. */
  if (fchmod(fd, 0644) != 0 || write_all(fd, text, strlen(text)) != 0) {
    what = "write";
    err = errno;
    goto out;
  }
  if (close(fd) != 0) {
    fd = -1;
    what = "close";
    err = errno;
    goto out;
  }
  fd = -1;
  if (rename(m->tmpfile, m->textfile) != 0) {
    what = "rename";
    err = errno;
    goto out;
  }

out:
  if (fd >= 0)
    close(fd);
  if (what != NULL) {
    unlink(m->tmpfile);
    /* Say it once when it starts failing and once when it recovers, not every interval. */
    if (!m->write_failing) {
      snprintf(m->why_textfile, sizeof m->why_textfile, "cannot %s %s: %s", what,
               what[0] == 'r' ? m->textfile : m->tmpfile, strerror(err));
      GPUPOOL__WARN("metrics: textfile exporter degraded: %s; the textfile keeps its last content "
                    "and is retried every interval",
                    m->why_textfile);
    }
    m->write_failing = 1;
  } else if (m->write_failing) {
    GPUPOOL__INFO("metrics: textfile exporter recovered: writing %s again", m->textfile);
    m->write_failing = 0;
    m->why_textfile[0] = '\0';
  }
  free(text);
}

static void on_timer(uv_timer_t *t) {
  write_textfile(t->data);
}

static void conn_closed(uv_handle_t *h) {
  conn *c = h->data;
  gpd_metrics *m = c->m;
  conn **pp;

  if (--c->open_handles > 0)
    return;
  for (pp = &m->conns; *pp != NULL; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  m->nconns--;
  free(c->resp);
  free(c);
  maybe_free(m);
}

static void conn_close(conn *c) {
  if (!uv_is_closing((uv_handle_t *)&c->pipe))
    uv_close((uv_handle_t *)&c->pipe, conn_closed);
  if (!uv_is_closing((uv_handle_t *)&c->timer))
    uv_close((uv_handle_t *)&c->timer, conn_closed);
}

static void on_written(uv_write_t *wr, int status) {
  (void)status;
  conn_close(wr->data);
}

static void on_write_timeout(uv_timer_t *t) {
  conn_close(t->data);
}

/* What the request line asks for: the status line, extra headers and whether the metrics
 * (or a short text) go in the body. Only GET and HEAD of /metrics (or /) are served, as
 * Prometheus and curl ask; an empty request (a peer that sends nothing) gets the metrics. */
typedef struct {
  const char *status;
  const char *extra;
  const char *body; /* NULL: the metrics text */
  int head_only;
} http_answer;

static http_answer route(const conn *c) {
  char method[16] = "", target[96] = "";
  http_answer a = {"200 OK", "", NULL, 0};
  char *q;

  if (c->linelen == 0)
    return a;
  if (sscanf(c->line, "%15s %95s", method, target) != 2 || target[0] != '/') {
    a.status = "400 Bad Request";
    a.body = "bad request: send GET /metrics\n";
    return a;
  }
  if ((q = strchr(target, '?')) != NULL)
    *q = '\0';
  if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
    a.status = "405 Method Not Allowed";
    a.extra = "Allow: GET, HEAD\r\n";
    a.body = "method not allowed: use GET or HEAD\n";
    return a;
  }
  a.head_only = method[0] == 'H';
  if (strcmp(target, "/metrics") != 0 && strcmp(target, "/") != 0) {
    a.status = "404 Not Found";
    a.body = "not found: the metrics are at /metrics\n";
  }
  return a;
}

static void conn_answer(conn *c) {
  http_answer a = route(c);
  char *text = NULL;
  const char *body;
  char head[256];
  size_t tl, hl;
  uv_buf_t buf;

  if (c->answered)
    return;
  c->answered = 1;
  uv_timer_stop(&c->timer);
  if (a.body == NULL) {
    text = snapshot_text(c->m);
    if (text == NULL) {
      conn_close(c);
      return;
    }
  }
  body = text != NULL ? text : a.body;
  tl = strlen(body);
  hl = (size_t)snprintf(head, sizeof head,
                        "HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%sConnection: close\r\n\r\n",
                        a.status, text != NULL ? CT_METRICS : "text/plain; charset=utf-8", tl, a.extra);
  if (a.head_only)
    tl = 0;
  c->resp = malloc(hl + tl);
  if (c->resp == NULL) {
    free(text);
    GPUPOOL__PEER_WARN(NULL, 0, "metrics: out of memory answering a metrics request");
    conn_close(c);
    return;
  }
  memcpy(c->resp, head, hl);
  memcpy(c->resp + hl, body, tl);
  free(text);
  buf = uv_buf_init(c->resp, (unsigned)(hl + tl));
  c->wr.data = c;
  if (uv_write(&c->wr, (uv_stream_t *)&c->pipe, &buf, 1, on_written) != 0 ||
      uv_timer_start(&c->timer, on_write_timeout, WRITE_TIMEOUT_MS, 0) != 0)
    conn_close(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  conn *c = h->data;
  (void)suggested;
  *buf = uv_buf_init(c->rbuf, sizeof(c->rbuf));
}

/* The request is read (so closing does not reset the peer's connection); its line decides
 * the answer, its headers are ignored. The answer goes out at the blank line that ends the
 * request head, at EOF, or after a second. */
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  conn *c = s->data;

  if (nread < 0) {
    if (nread == UV_EOF)
      conn_answer(c);
    else
      conn_close(c);
    return;
  }
  for (ssize_t i = 0; i < nread && !c->answered; i++) {
    if (!c->line_done) {
      if (buf->base[i] == '\r' || buf->base[i] == '\n')
        c->line_done = c->linelen > 0;
      else if (c->linelen < sizeof c->line - 1)
        c->line[c->linelen++] = buf->base[i];
    }
    memmove(c->tail, c->tail + 1, sizeof(c->tail) - 1);
    c->tail[sizeof(c->tail) - 1] = buf->base[i];
    if (memcmp(c->tail, "\r\n\r\n", 4) == 0 || memcmp(c->tail + 2, "\n\n", 2) == 0)
      conn_answer(c);
  }
  c->seen += (size_t)nread;
  if (c->seen >= REQ_MAX)
    conn_answer(c);
}

static void on_req_timeout(uv_timer_t *t) {
  conn_answer(t->data);
}

static void drop_closed(uv_handle_t *h) {
  gpd_metrics *m = h->data;
  m->drop_busy = 0;
  handle_closed(h);
}

static void drop_conn(gpd_metrics *m, uv_stream_t *srv) {
  if (m->drop_busy || uv_pipe_init(m->loop, &m->drop_pipe, 0) != 0)
    return;
  m->drop_busy = 1;
  m->open_handles++;
  m->drop_pipe.data = m;
  (void)uv_accept(srv, (uv_stream_t *)&m->drop_pipe);
  uv_close((uv_handle_t *)&m->drop_pipe, drop_closed);
}

/* Puts c (its stream initialised, open_handles set) on m's list. */
static void conn_link(gpd_metrics *m, conn *c) {
  c->m = m;
  c->next = m->conns;
  m->conns = c;
  m->nconns++;
}

/* The uid owning the other end of a TCP connection from this host, through sock_diag (the
 * same lookup as `ss -e`): 0 and *uid, or -1 when the peer is not local or the lookup is not
 * possible (e.g. netlink denied by the service's sandbox). */
static int local_tcp_uid(const struct sockaddr_storage *peer, const struct sockaddr_storage *self, uid_t *uid) {
  struct {
    struct nlmsghdr nlh;
    struct inet_diag_req_v2 r;
  } req;
  union {
    struct nlmsghdr nlh;
    char buf[1024];
  } rep;
  struct sockaddr_nl nl = {.nl_family = AF_NETLINK};
  const struct inet_diag_msg *msg;
  struct timeval tv = {0, 100000};
  ssize_t n;
  int fd, rc = -1;

  if (peer->ss_family != self->ss_family || (peer->ss_family != AF_INET && peer->ss_family != AF_INET6))
    return -1;
  memset(&req, 0, sizeof req);
  req.nlh.nlmsg_len = sizeof req;
  req.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  req.nlh.nlmsg_flags = NLM_F_REQUEST;
  req.r.sdiag_family = (uint8_t)peer->ss_family;
  req.r.sdiag_protocol = IPPROTO_TCP;
  req.r.idiag_states = ~0u;
  /* The peer's socket: its own address and port first, ours as its destination. */
  if (peer->ss_family == AF_INET) {
    const struct sockaddr_in *p = (const void *)peer, *l = (const void *)self;
    req.r.id.idiag_sport = p->sin_port;
    req.r.id.idiag_dport = l->sin_port;
    memcpy(req.r.id.idiag_src, &p->sin_addr, 4);
    memcpy(req.r.id.idiag_dst, &l->sin_addr, 4);
  } else {
    const struct sockaddr_in6 *p = (const void *)peer, *l = (const void *)self;
    req.r.id.idiag_sport = p->sin6_port;
    req.r.id.idiag_dport = l->sin6_port;
    memcpy(req.r.id.idiag_src, &p->sin6_addr, 16);
    memcpy(req.r.id.idiag_dst, &l->sin6_addr, 16);
  }
  req.r.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0)
    return -1;
  /* The kernel answers at once; the bound only guards the loop against a surprise. */
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (sendto(fd, &req, sizeof req, 0, (struct sockaddr *)&nl, sizeof nl) != (ssize_t)sizeof req)
    goto out;
  n = recv(fd, &rep, sizeof rep, 0);
  if (n < (ssize_t)NLMSG_LENGTH(sizeof *msg) || !NLMSG_OK(&rep.nlh, (size_t)n) ||
      rep.nlh.nlmsg_type != SOCK_DIAG_BY_FAMILY)
    goto out;
  msg = NLMSG_DATA(&rep.nlh);
  *uid = msg->idiag_uid;
  rc = 0;
out:
  close(fd);
  return rc;
}

/* Records who is at the other end of c, just accepted: 0, or -1 when that cannot be told. */
static int conn_identify(conn *c) {
  uv_os_fd_t fd;

  if (uv_fileno((uv_handle_t *)&c->pipe, &fd) != 0)
    return -1;
  if (!c->on_tcp) {
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
      return -1;
    c->has_uid = 1;
    c->uid = cred.uid;
  } else {
    struct sockaddr_storage self;
    int n = sizeof c->addr, ns = sizeof self;
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&c->addr, &n) != 0 ||
        uv_tcp_getsockname(&c->tcp, (struct sockaddr *)&self, &ns) != 0)
      return -1;
    c->has_uid = local_tcp_uid(&c->addr, &self, &c->uid) == 0;
  }
  return 0;
}

/* Says (within the limits of what peers may log) why c was closed unanswered. */
static void refused(gpd_metrics *m, const conn *c, const char *why) {
  char who[INET6_ADDRSTRLEN + 32] = "";
  (void)m;
  if (c->has_uid)
    snprintf(who, sizeof who, "uid %u", (unsigned)c->uid);
  else if (c->addr.ss_family == AF_INET)
    inet_ntop(AF_INET, &((const struct sockaddr_in *)&c->addr)->sin_addr, who, sizeof who);
  else if (c->addr.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)&c->addr)->sin6_addr, who, sizeof who);
  GPUPOOL__PEER_INFO(NULL, 0, "metrics: closed a %s connection from %s unanswered: %s", c->on_tcp ? "TCP" : "Unix-socket",
                     who[0] ? who : "an unknown peer", why);
}

/* Whether a and b count as one peer: the same uid where both are known, else the same
 * source address. */
static int same_peer(const conn *a, const conn *b) {
  if (a->has_uid || b->has_uid)
    return a->has_uid && b->has_uid && a->uid == b->uid;
  if (a->addr.ss_family != b->addr.ss_family)
    return 0;
  if (a->addr.ss_family == AF_INET)
    return !memcmp(&((const struct sockaddr_in *)&a->addr)->sin_addr,
                   &((const struct sockaddr_in *)&b->addr)->sin_addr, sizeof(struct in_addr));
  if (a->addr.ss_family == AF_INET6)
    return !memcmp(&((const struct sockaddr_in6 *)&a->addr)->sin6_addr,
                   &((const struct sockaddr_in6 *)&b->addr)->sin6_addr, sizeof(struct in6_addr));
  return 0;
}

/* Whether c, just accepted and identified, may take one of its listener's slots: within the
 * listener's MAX_CONNS, outside the RESERVED_CONNS unless root or the daemon's uid, and within
 * its peer's MAX_CONNS_PER_UID. Sets *why to the reason when not. */
static int slot_allows(gpd_metrics *m, const conn *c, const char **why) {
  int total = 0, same = 0;
  int operator = c->has_uid && (c->uid == 0 || c->uid == geteuid());

  /* Connections already closing are gone by the next loop turn: they do not count. */
  for (const conn *o = m->conns; o != NULL; o = o->next) {
    if (o == c || o->on_tcp != c->on_tcp || uv_is_closing((const uv_handle_t *)&o->pipe))
      continue;
    total++;
    same += same_peer(o, c);
  }
  if (total >= MAX_CONNS || (!operator && total >= MAX_CONNS - RESERVED_CONNS)) {
    *why = "every slot is taken";
    return 0;
  }
  if (same >= MAX_CONNS_PER_UID) {
    *why = c->has_uid ? "its uid holds its share of the slots" : "its address holds its share of the slots";
    return 0;
  }
  return 1;
}

static void on_conn(uv_stream_t *srv, int status) {
  gpd_metrics *m = srv->data;
  const char *why = NULL;
  conn *c;

  if (status < 0) {
    GPUPOOL__PEER_WARN(NULL, 0, "metrics: accept on %s failed: %s", m->sock, uv_strerror(status));
    return;
  }
  c = calloc(1, sizeof(*c));
  if (c == NULL) {
    drop_conn(m, srv);
    return;
  }
  if ((srv == (uv_stream_t *)&m->tcp_srv ? uv_tcp_init(m->loop, &c->tcp)
                                           : uv_pipe_init(m->loop, &c->pipe, 0)) != 0) {
    free(c);
    drop_conn(m, srv);
    return;
  }
  if (uv_timer_init(m->loop, &c->timer) != 0) {
    /* The pipe is a handle now: it goes through close, and conn_closed frees c. */
    c->pipe.data = c;
    c->open_handles = 1;
    conn_link(m, c);
    uv_close((uv_handle_t *)&c->pipe, conn_closed);
    drop_conn(m, srv);
    return;
  }
  c->pipe.data = c;
  c->timer.data = c;
  c->open_handles = 2;
  conn_link(m, c);
  if (uv_accept(srv, (uv_stream_t *)&c->pipe) != 0) {
    conn_close(c);
    return;
  }
  c->on_tcp = srv == (uv_stream_t *)&m->tcp_srv;
  /* Slow or idle scrapers must not pile up connections in the daemon, nor one user take
   * every slot and lock the others (the scraper) out. */
  if (conn_identify(c) != 0 || !slot_allows(m, c, &why)) {
    refused(m, c, why ? why : "its peer cannot be identified");
    conn_close(c);
    return;
  }
  if (uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read) != 0 ||
      uv_timer_start(&c->timer, on_req_timeout, REQ_TIMEOUT_MS, 0) != 0)
    conn_close(c);
}

static int start_socket(gpd_metrics *m, const gpd_config *cfg) {
  mode_t mode = cfg->socket_mode ? cfg->socket_mode : 0660;
  mode_t old;
  int rc;

  rc = gpupool__clear_stale_socket(m->sock, "metrics_socket");
  if (rc < 0)
    return rc;
  rc = uv_pipe_init(m->loop, &m->srv, 0);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "metrics_socket: %s", uv_strerror(rc));
  m->srv.data = m;
  m->open_handles++;
  m->srv_on = 1;
  /* Bound here, not with uv_pipe_bind(): libuv unlinks a bound pipe's path when it closes
   * the handle, whatever is at that path by then. Created with no access for anyone but the
   * owner, then opened up to the configured mode, so there is no moment when the umask's
   * wider mode applies. */
  {
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
      return gpupool__err(GPUPOOL_ECONFIG, "metrics_socket: socket(): %s", strerror(errno));
    snprintf(a.sun_path, sizeof a.sun_path, "%s", m->sock);
    old = umask(0177);
    rc = bind(fd, (struct sockaddr *)&a, sizeof a) == 0 ? 0 : -errno;
    umask(old);
    if (rc == 0 && (rc = uv_pipe_open(&m->srv, fd)) != 0)
      unlink(m->sock);
    if (rc != 0) {
      close(fd);
      return gpupool__err(GPUPOOL_ECONFIG,
                          "cannot bind metrics_socket %s: %s; check that its directory exists "
                          "and is writable by the daemon (under systemd: in RuntimeDirectory= or "
                          "ReadWritePaths=)",
                          m->sock, strerror(-rc));
    }
    m->sock_bound = 1;
  }
  if (chmod(m->sock, mode) != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "cannot chmod metrics_socket %s to %04o: %s", m->sock,
                        (unsigned)mode, strerror(errno));
  /* Scrapers join this group instead of the daemon's, which would let them allocate. */
  if (cfg->metrics_socket_group[0] != '\0' && chown(m->sock, (uid_t)-1, cfg->metrics_socket_gid) != 0)
    return gpupool__err(GPUPOOL_ECONFIG,
                        "cannot give metrics_socket %s the group %s (gid %u): %s; the daemon must "
                        "be root or a member of that group (under systemd: SupplementaryGroups=)",
                        m->sock, cfg->metrics_socket_group, (unsigned)cfg->metrics_socket_gid,
                        strerror(errno));
  rc = uv_listen((uv_stream_t *)&m->srv, m->backlog, on_conn);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "cannot listen on metrics_socket %s: %s", m->sock,
                        uv_strerror(rc));
  uv_unref((uv_handle_t *)&m->srv);
  GPUPOOL__INFO("metrics: serving Prometheus text on %s", m->sock);
  return 0;
}

static int start_tcp(gpd_metrics *m, const gpd_config *cfg) {
  int rc = uv_tcp_init(m->loop, &m->tcp_srv);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "metrics_listen: %s", uv_strerror(rc));
  m->tcp_srv.data = m;
  m->open_handles++;
  m->tcp_on = 1;
  (void)cfg;
  rc = uv_tcp_bind(&m->tcp_srv, (const struct sockaddr *)&m->tcp_addr, 0);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&m->tcp_srv, m->backlog, on_conn);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG,
                        "cannot listen on metrics_listen %s: %s; choose a free port (under "
                        "systemd, allow the address family and address in a drop-in: "
                        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK, IPAddressAllow=)",
                        m->listen, uv_strerror(rc));
  uv_unref((uv_handle_t *)&m->tcp_srv);
  {
    /* The address really bound (metrics_listen may be a bare port), as a scraper names it. */
    struct sockaddr_storage a;
    char ip[INET6_ADDRSTRLEN] = "?";
    int n = sizeof a, port = 0;
    if (uv_tcp_getsockname(&m->tcp_srv, (struct sockaddr *)&a, &n) == 0) {
      if (a.ss_family == AF_INET6) {
        uv_ip6_name((const struct sockaddr_in6 *)&a, ip, sizeof ip);
        port = ntohs(((const struct sockaddr_in6 *)&a)->sin6_port);
      } else {
        uv_ip4_name((const struct sockaddr_in *)&a, ip, sizeof ip);
        port = ntohs(((const struct sockaddr_in *)&a)->sin_port);
      }
    }
    GPUPOOL__INFO("metrics: serving Prometheus text on http://%s%s%s:%d/metrics (TCP)",
                  a.ss_family == AF_INET6 ? "[" : "", ip, a.ss_family == AF_INET6 ? "]" : "", port);
  }
  return 0;
}

static int start_textfile(gpd_metrics *m, const gpd_config *cfg) {
  uint32_t every = cfg->metrics_interval_ms ? cfg->metrics_interval_ms : 5000;
  int fd, rc;

  /* Find an unwritable directory now, with the configuration at hand, not in a log line
   * every interval later. */
  fd = open(m->tmpfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    /* Degraded, not given up: the timer below retries every interval, so a directory made
     * later (e.g. node_exporter installed after the daemon started) is picked up. */
    snprintf(m->why_textfile, sizeof m->why_textfile, "cannot create %s: %s", m->tmpfile, strerror(errno));
    GPUPOOL__WARN("metrics: textfile exporter degraded: %s; create the directory, make it writable "
                  "by the daemon (under systemd: ReadWritePaths=), or change metrics_textfile; "
                  "retried every %u ms",
                  m->why_textfile, every);
    m->write_failing = 1;
  } else {
    close(fd);
    unlink(m->tmpfile);
  }
  rc = uv_timer_init(m->loop, &m->timer);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "metrics timer: %s", uv_strerror(rc));
  m->timer.data = m;
  m->open_handles++;
  m->timer_on = 1;
  /* First write on the loop's first turn, once the server is up, then every interval. */
  rc = uv_timer_start(&m->timer, on_timer, 0, every);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "metrics timer: %s", uv_strerror(rc));
  uv_unref((uv_handle_t *)&m->timer);
  if (!m->write_failing)
    GPUPOOL__INFO("metrics: writing %s every %u ms", m->textfile, every);
  return 0;
}

static void stop_textfile(gpd_metrics *m) {
  if (m->timer_on) {
    uv_timer_stop(&m->timer);
    close_handle(m, (uv_handle_t *)&m->timer);
    m->timer_on = 0;
    /* A stopped daemon's numbers must not look current to the textfile collector. */
    unlink(m->textfile);
    unlink(m->tmpfile);
  }
}

static void stop_socket(gpd_metrics *m) {
  if (m->srv_on) {
    close_handle(m, (uv_handle_t *)&m->srv);
    m->srv_on = 0;
  }
  if (m->sock_bound) {
    gpupool__unlink_socket(m->sock);
    m->sock_bound = 0;
  }
}

static void stop_tcp(gpd_metrics *m) {
  if (m->tcp_on) {
    close_handle(m, (uv_handle_t *)&m->tcp_srv);
    m->tcp_on = 0;
  }
}

#define RETRY_FIRST_MS 1000u
#define RETRY_MAX_MS 30000u

/* The TCP exporter's retry: its listener (closed after the failure, in an earlier turn of the
 * loop, so the handle may be set up again) is started afresh. */
static void on_retry(uv_timer_t *t) {
  gpd_metrics *m = t->data;
  if (m->closing || !m->why_tcp[0])
    return;
  if (start_tcp(m, NULL) == 0) {
    GPUPOOL__INFO("metrics: tcp exporter recovered after: %s", m->why_tcp);
    m->why_tcp[0] = '\0';
    return;
  }
  snprintf(m->why_tcp, sizeof m->why_tcp, "%s", gpupool__errmsg());
  stop_tcp(m);
  m->retry_ms = m->retry_ms * 2 > RETRY_MAX_MS ? RETRY_MAX_MS : m->retry_ms * 2;
  GPUPOOL__DEBUG("metrics: tcp exporter still degraded, next try in %u ms: %s", m->retry_ms, m->why_tcp);
  uv_timer_start(&m->retry, on_retry, m->retry_ms, 0);
}

static void start_retry(gpd_metrics *m) {
  if (uv_timer_init(m->loop, &m->retry) != 0)
    return;
  m->retry.data = m;
  m->open_handles++;
  m->retry_on = 1;
  m->retry_ms = RETRY_FIRST_MS;
  uv_timer_start(&m->retry, on_retry, m->retry_ms, 0);
  uv_unref((uv_handle_t *)&m->retry);
}

static void stop_retry(gpd_metrics *m) {
  if (m->retry_on) {
    uv_timer_stop(&m->retry);
    close_handle(m, (uv_handle_t *)&m->retry);
    m->retry_on = 0;
  }
}

/* Closes every exporter; the handle itself stays (its counters still count). */
static void stop_exporters(gpd_metrics *m) {
  stop_retry(m);
  stop_textfile(m);
  stop_socket(m);
  stop_tcp(m);
  for (conn *c = m->conns; c != NULL; c = c->next)
    conn_close(c);
}

/* Runs one exporter's start; on failure closes that one only, keeps why and logs it. */
static void start_one(gpd_metrics *m, const gpd_config *cfg, const char *what, char *why, size_t whylen,
                      int (*start)(gpd_metrics *, const gpd_config *), void (*stop)(gpd_metrics *)) {
  if (start(m, cfg) == 0)
    return;
  /* Keep the message: closing may run calls that record their own. */
  snprintf(why, whylen, "%s", gpupool__errmsg());
  stop(m);
  GPUPOOL__WARN("metrics: %s exporter degraded: %s; the other exporters serve all the same%s", what, why,
                start == start_tcp ? "; retried until it serves" : "");
}

void gpd_metrics_health(const gpd_metrics *m, char *buf, size_t len) {
  const struct {
    const char *name, *conf, *why;
  } e[] = {{"textfile", m->textfile, m->why_textfile}, {"socket", m->sock, m->why_socket},
           {"tcp", m->listen, m->why_tcp}};
  size_t at = 0;
  if (len > 0)
    buf[0] = '\0';
  for (size_t i = 0; i < sizeof e / sizeof e[0] && at < len; i++) {
    int w;
    if (!e[i].conf[0])
      continue;
    w = snprintf(buf + at, len - at, "%s%s %s%s%s", at ? "; " : "", e[i].name, e[i].why[0] ? "degraded" : "ok",
                 e[i].why[0] ? ": " : "", e[i].why);
    at = w < 0 ? len : at + (size_t)w;
  }
}

int gpd_metrics_degraded(const gpd_metrics *m, char *buf, size_t len) {
  const struct {
    const char *name, *why;
  } e[] = {{"textfile", m->why_textfile}, {"socket", m->why_socket}, {"tcp", m->why_tcp}};
  size_t at = 0;
  int n = 0;

  if (len > 0)
    buf[0] = '\0';
  for (size_t i = 0; i < sizeof e / sizeof e[0]; i++) {
    if (e[i].why[0] == '\0')
      continue;
    if (at < len) {
      int w = snprintf(buf + at, len - at, "%smetrics %s: %s", n ? "; " : "", e[i].name, e[i].why);
      at = w < 0 ? len : at + (size_t)w;
    }
    n++;
  }
  return n;
}

int gpd_metrics_start(gpd_metrics *m, uv_loop_t *loop, const gpd_config *cfg,
                           const gpd_stats_source *src) {
  if (m->started)
    return gpupool__err(GPUPOOL_EINVAL, "metrics: already started");
  m->started = 1;
  m->loop = loop;
  if (src != NULL)
    m->src = *src;
  snprintf(m->textfile, sizeof(m->textfile), "%s", cfg->metrics_textfile);
  snprintf(m->tmpfile, sizeof(m->tmpfile), "%s.tmp", cfg->metrics_textfile);
  snprintf(m->sock, sizeof(m->sock), "%s", cfg->metrics_socket);
  snprintf(m->listen, sizeof(m->listen), "%s", cfg->metrics_listen);
  m->backlog = BACKLOG(cfg);
  if (m->textfile[0] != '\0')
    start_one(m, cfg, "textfile", m->why_textfile, sizeof m->why_textfile, start_textfile, stop_textfile);
  if (m->sock[0] != '\0')
    start_one(m, cfg, "socket", m->why_socket, sizeof m->why_socket, start_socket, stop_socket);
  m->tcp_addr = cfg->metrics_addr;
  if (m->listen[0] != '\0') {
    start_one(m, cfg, "tcp", m->why_tcp, sizeof m->why_tcp, start_tcp, stop_tcp);
    if (m->why_tcp[0])
      start_retry(m);
  }
  return 0;
}

void gpd_metrics_close(gpd_metrics *m) {
  if (m == NULL || m->closing)
    return;
  m->closing = 1;
  stop_exporters(m);
  maybe_free(m);
}
