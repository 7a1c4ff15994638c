/*
 * Error messages shared by the daemon and the client library.
 *
 * Every internal function that fails returns a negative GPUPOOL_E* code and, where it has
 * something to say beyond the code, records a message with gpupool__err() in a thread-local
 * buffer. The daemon copies that message into its error reply; the client library exposes
 * it as gpupool_last_error().
 */
#ifndef GPUPOOL_COMMON_ERRORS_H
#define GPUPOOL_COMMON_ERRORS_H

#include "gpupool/gpupool.h"

#define GPUPOOL__ERRMSG_MAX 512

/* Record a message for code and return code (so `return gpupool__err(GPUPOOL_EINVAL, ...)`). */
int gpupool__err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The calling thread's last message ("" if none). */
const char *gpupool__errmsg(void);
/* Forget the calling thread's message. */
void gpupool__err_clear(void);

/* Socket path rules (paths.c): for_client adds the fall-back to the system socket. */
int gpupool__socket_path(char *buf, size_t len, int for_client);
/* Before binding a Unix socket at path: 0 when nothing is there, 1 after removing a stale
 * socket nobody answers on; GPUPOOL_EBUSY when a live process answers on it and
 * GPUPOOL_ECONFIG when path is anything but a socket (it is never removed). `what` names
 * the setting in messages ("socket", "metrics_socket"). */
int gpupool__clear_stale_socket(const char *path, const char *what);
/* Remove path if, and only if, it is a socket (at shutdown). */
void gpupool__unlink_socket(const char *path);

#endif
