/*
 * The daemon's socket side: the listening socket, one connection per client (raw sockets
 * watched with uv_poll_t, since libuv pipes cannot pass arbitrary fds), framing through the
 * wire library, the single dispatch point for requests, and requests that wait (allocate
 * until memory comes back, get until a name is published). Its files and what they own are
 * listed in server_internal.h and docs/ARCHITECTURE.md; the request kinds are one table,
 * common/requests.h.
 */
#ifndef GPUPOOL_DAEMON_SERVER_H
#define GPUPOOL_DAEMON_SERVER_H

#include <uv.h>

#include "config.h"
#include "registry.h"

typedef struct gpd_server gpd_server;

/* Start serving on listen_fd (already listening, e.g. from systemd) or, when it is -1, on a
 * socket bound at cfg->socket_path (parent directory created; a stale socket file replaced;
 * refused if another daemon answers there). Also starts the metrics exporters configured in
 * cfg; when they cannot start, that is logged ("metrics disabled: ...") and serving goes on. */
int gpd_server_start(gpd_server **out, uv_loop_t *loop, const gpd_config *cfg,
                    gpd_registry *reg, int listen_fd);
/* Close the listener, the metrics and every connection (their holds are dropped). Handles
 * close on the next loop iterations; the server is freed when the last one has closed. */
void gpd_server_stop(gpd_server *s);
/* After a reload changed s's configuration in place: every open connection whose uid the
 * allow-lists no longer let in, or whose tenant changed, is told why and closed. */
void gpd_server_reloaded(gpd_server *s);
/* Monotonic ns of the last client input (for busy polling). */
uint64_t gpd_server_last_activity(const gpd_server *s);
/* Number of connected clients. */
uint64_t gpd_server_clients(const gpd_server *s);
/* The metrics exporters that failed and why ("metrics textfile: ...; ..."), for STATUS=: how
 * many (0: all serve, or none configured). */
int gpd_server_metrics_degraded(const gpd_server *s, char *buf, size_t len);
/* What the last reload read but left for a restart (comma-separated; "" when nothing waits),
 * kept for Stats (gpupoolctl status) until a later reload finds nothing waiting. */
void gpd_server_set_restart_pending(gpd_server *s, const char *what);

#endif
