/*
 * Where the daemon's socket is by default: $GPUPOOL_SOCKET, else the system socket for root,
 * else the per-user socket under $XDG_RUNTIME_DIR (paths.c).
 */
#ifndef GPUPOOL_COMMON_PATHS_H
#define GPUPOOL_COMMON_PATHS_H

#include <stddef.h>

/* Socket path rules: for_client adds the fall-back to the system socket. */
int gpupool__socket_path(char *buf, size_t len, int for_client);

#endif
