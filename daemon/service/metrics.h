/*
 * Prometheus metrics: counters of requests by type and result, a request latency histogram,
 * and gauges from a StatsReply snapshot (pools' bytes, buffers, clients). Exposed as a
 * text-format file rewritten atomically every interval, on a Unix socket that answers each
 * connection with an HTTP/1.0 response holding the text, and (opt-in) on a TCP address.
 *
 * All of it lives in one handle owned by whoever creates it (the server). The snapshot comes
 * from a stats source handed in at start, so this module names nothing of the server's.
 */
#ifndef GPUPOOL_DAEMON_METRICS_H
#define GPUPOOL_DAEMON_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "wire.h"

typedef struct gpd_metrics gpd_metrics;

/* Where the gauges come from. fill() puts the daemon's current stats in *out (the same
 * content as a Stats reply) and returns 0 or a GPUPOOL_E* code with a message; after a
 * successful fill the metrics call release() on the same reply to free what fill allocated. */
typedef struct {
  int (*fill)(void *arg, Gpupool__Wire__StatsReply *out);
  void (*release)(void *arg, Gpupool__Wire__StatsReply *st);
  void *arg;
} gpd_stats_source;

/* Connections each listener (the Unix socket, the TCP address) serves at once; its slots are
 * its own, so one listener kept busy cannot lock scrapers out of the other. */
#define GPUPOOL__METRICS_MAX_CONNS 16
/* Most of those one uid may hold (SO_PEERCRED on the Unix socket; on TCP the uid of a peer on
 * this host, else its source address), so one user cannot take every slot. */
#define GPUPOOL__METRICS_MAX_CONNS_PER_UID 4
/* Of each listener's slots, kept for root and the daemon's uid. */
#define GPUPOOL__METRICS_RESERVED_CONNS 2

/* A handle with zeroed counters and no exporter: 0 or GPUPOOL_ENOMEM. Free it with
 * gpd_metrics_close(). */
int gpd_metrics_new(gpd_metrics **out);

/* Count one handled request: body_case is the Request's oneof case (e.g.
 * GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE), result 0 or a GPUPOOL_E* code. Cheap: called on
 * every request. */
void gpd_metrics_request(gpd_metrics *m, int body_case, int result, uint64_t latency_ns);

/* Prometheus text for m's counters and the snapshot st (NULL: counters only); malloc'd,
 * caller frees. */
char *gpd_metrics_render(const gpd_metrics *m, const Gpupool__Wire__StatsReply *st);

/* Start the textfile writer / socket and TCP listeners configured in cfg on loop (none
 * configured = nothing to do); src is copied. Each exporter starts or fails on its own: one
 * that fails is logged and left out (see gpd_metrics_degraded; the textfile one is retried
 * every interval, the TCP one after 1 s, then at doubling intervals up to 30 s) while the
 * others serve, so this returns 0 unless the handle was already started (GPUPOOL_EINVAL). */
int gpd_metrics_start(gpd_metrics *m, uv_loop_t *loop, const gpd_config *cfg,
                           const gpd_stats_source *src);

/* Which configured exporters are not serving and why, for a status line: writes
 * "metrics socket: <why>; metrics tcp: <why>" (or "" when all serve) into buf (truncated to
 * len) and returns how many are degraded. */
int gpd_metrics_degraded(const gpd_metrics *m, char *buf, size_t len);

/* Every configured exporter and how it stands, for gpupoolctl status: "textfile ok; tcp
 * degraded: <why>" into buf (truncated to len; "" when none is configured). */
void gpd_metrics_health(const gpd_metrics *m, char *buf, size_t len);

/* Close every exporter (the metrics socket file and the textfile are removed) and free the
 * handle once the loop has run the close callbacks of its handles (at once when it has none
 * open). m must not be used afterwards. NULL is ignored. */
void gpd_metrics_close(gpd_metrics *m);

#endif
