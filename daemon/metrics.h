/*
 * Prometheus metrics: counters of requests by type and result, a request latency histogram,
 * and gauges from a StatsReply snapshot (pools' bytes, buffers, clients). Exposed as a
 * text-format file rewritten atomically every interval and/or on a Unix socket that answers
 * each connection with an HTTP/1.0 response holding the text. No TCP listener.
 */
#ifndef GPUPOOL_DAEMON_METRICS_H
#define GPUPOOL_DAEMON_METRICS_H

#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "wire.h"

/* Fills *out with the daemon's current stats (the same content as a Stats reply). The
 * metrics module frees its contents with gpupool__stats_free(). */
typedef int (*gpupool__stats_fn)(void *arg, Gpupool__Wire__StatsReply *out);
void gpupool__stats_free(Gpupool__Wire__StatsReply *st);

/* Count one handled request: body_case is the Request's oneof case (e.g.
 * GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE), result 0 or a GPUPOOL_E* code. Cheap: called on
 * every request. */
void gpupool__metrics_request(int body_case, int result, uint64_t latency_ns);

/* Prometheus text for the counters and the snapshot; malloc'd, caller frees. */
char *gpupool__metrics_render(const Gpupool__Wire__StatsReply *st);

/* Start the textfile writer / socket listener configured in cfg (neither = nothing to do).
 * 0 or a GPUPOOL_E* code with a message. */
int gpupool__metrics_start(uv_loop_t *loop, const gpupool__config *cfg, gpupool__stats_fn fn,
                           void *arg);
/* Close the handles opened by start (the loop then runs their close callbacks) and remove the
 * metrics socket file. */
void gpupool__metrics_stop(void);

#endif
