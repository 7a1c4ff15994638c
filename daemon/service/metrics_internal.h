/*
 * What the metrics' two halves share: the gpd_metrics handle (the counters, and the state of
 * the exporters) and a scraper's connection. metrics.c counts and renders; metrics_export.c
 * serves the text (textfile, Unix socket, TCP) and bounds the scrapers.
 */
#ifndef GPUPOOL_DAEMON_METRICS_INTERNAL_H
#define GPUPOOL_DAEMON_METRICS_INTERNAL_H

#include <sys/socket.h>

#include "errors.h"
#include "metrics.h"
#include "requests.h"

/* Request types: index 0 counts frames whose body was missing or unknown, index i + 1 the row
 * i of the request table (common/requests.h), so every kind is counted under its own name. */
#define N_TYPES (GPUPOOL__NREQUESTS + 1)
/* Results: index 0 is success, index i (1..) is error code -i; the last slot takes codes
 * outside the known range so a new code is still counted somewhere. */
#define N_RESULTS (-GPUPOOL_ERRNO_MIN + 1)
#define RESULT_OTHER (N_RESULTS - 1)
/* Latency buckets, 10 us to 1 s (metrics.c: bucket_le, bucket_ns) */
#define N_BUCKETS 16

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
  /* Connections are taken ACCEPT_BATCH per turn of the loop: libuv's accept loop runs for as
   * long as connections wait, and a peer that reconnects as fast as it is refused kept the
   * daemon's one thread in it, answering no client. Past the batch, a listener's connection
   * waits in libuv (which stops watching that listener) until `resume`, at the next turn,
   * takes it; `accepts` counts since resume last ran. */
  uv_timer_t resume;
  int resume_on;
  unsigned accepts;
  uv_stream_t *deferred[2]; /* the Unix socket's, the TCP listener's */
};

#define ACCEPT_BATCH 32

/* metrics_export.c: free the handle once closed and its last handle is gone; a handle's close
 * callback; the text of now (rendered with a fresh stats snapshot; NULL when out of memory). */
void gpd_metrics_maybe_free(gpd_metrics *m);
void gpd_metrics_handle_closed(uv_handle_t *h);
char *gpd_metrics_snapshot_text(gpd_metrics *m);
/* metrics_http.c: a scraper connects to the Unix socket or the TCP listener. */
void gpd_metrics_on_conn(uv_stream_t *srv, int status);
/* metrics_http.c: the next turn's resume (see gpd_metrics.resume). */
void gpd_metrics_on_resume(uv_timer_t *t);
/* metrics_http.c: close a scraper's connection (freed from its handles' close callbacks). */
void gpd_metrics_conn_close(conn *c);

#endif
