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

/* An error as a value, for an internal step whose message must outlive the calls that follow
 * its failure (cleanup that can fail and record a message of its own): the step fills it, and
 * the public entry point reports it with gpupool__error_report(), the one place the message
 * becomes the thread's last error. Leaf functions (wire checks, backends) keep recording with
 * gpupool__err(); a step takes their message into its value at once, and adds its context with
 * gpupool__error_prefix(). In client/ and backend/ nothing below the public functions reads
 * gpupool__errmsg() (to wrap, log or save it): tools/errors.py --check, run as unit_errors. */
typedef struct {
  int code; /* 0: nothing recorded */
  char msg[GPUPOOL__ERRMSG_MAX];
} gpupool__error;

/* Fill e with code and a message; returns code. */
int gpupool__error_set(gpupool__error *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Fill e with code and the message the failing leaf just recorded; returns code. */
int gpupool__error_take(gpupool__error *e, int code);
/* Put fmt's text before the message e holds ("member 2: " + "empty name; ..."), the context a
 * step adds to the failure of the call it made; returns e->code. */
int gpupool__error_prefix(gpupool__error *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* At a public entry point: when e holds an error, record its message as the thread's last
 * and return its code; otherwise return rc (a failure recorded the usual way, or 0). */
int gpupool__error_report(const gpupool__error *e, int rc);

#endif
