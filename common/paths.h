/*
 * Where the daemon's socket is by default: $GPUPOOL_SOCKET, else the system socket for root,
 * else the per-user socket under $XDG_RUNTIME_DIR (paths.c).
 */
#ifndef GPUPOOL_COMMON_PATHS_H
#define GPUPOOL_COMMON_PATHS_H

#include <stddef.h>

/* Socket path rules: for_client adds the fall-back to the system socket. */
int gpupool__socket_path(char *buf, size_t len, int for_client);
/* Before binding a Unix socket at path: 0 when nothing is there, 1 after removing a stale
 * socket nobody answers on; GPUPOOL_EBUSY when a live process answers on it and
 * GPUPOOL_ECONFIG when path is anything but a socket (it is never removed). `what` names
 * the setting in messages ("socket", "metrics_socket"). */
int gpupool__clear_stale_socket(const char *path, const char *what);
/* Remove path if, and only if, it is a socket (at shutdown). */
void gpupool__unlink_socket(const char *path);

#endif
