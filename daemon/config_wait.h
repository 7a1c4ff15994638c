/*
 * The daemon's life while its configuration is invalid under socket activation (see
 * config_wait.c): main.c hands it the socket and a way to read the configuration again.
 */
#ifndef GPUPOOL_DAEMON_CONFIG_WAIT_H
#define GPUPOOL_DAEMON_CONFIG_WAIT_H

#include <uv.h>

#include "backend.h"
#include "config.h"

/* Read the configuration again into cfg and open the backend it names: 0 with *be open, or
 * an error (message set). */
typedef int (*gpd_retry_config_fn)(void *arg, gpd_config *cfg, gpupool__backend **be);
/* Wait, answering every client's Hello with GPUPOOL_ECONFIG and the reason, until SIGHUP brings
 * a valid configuration (1, with *be open and cfg loaded, through retry) or SIGINT/SIGTERM
 * ends the daemon (0). */
int gpd_wait_for_config(uv_loop_t *loop, int listen_fd, gpd_config *cfg, gpupool__backend **be,
                        gpd_retry_config_fn retry, void *retry_arg);

/* Close the three signal handles and the watchdog timer (NULL: none) of a loop that ends
 * (this mode's and the serving daemon's). */
void gpd_close_watch(uv_signal_t *sigint, uv_signal_t *sigterm, uv_signal_t *sighup, uv_timer_t *watchdog);

#endif
