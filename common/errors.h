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

#endif
