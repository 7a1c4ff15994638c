/*
 * Error codes and messages: gpupool_strerror()/gpupool_err_name() from the one X-macro list
 * in gpupool.h, and the thread-local message buffer behind gpupool__err() and
 * gpupool_last_error().
 */
#include <stdarg.h>
#include <stdio.h>

#include "errors.h"

static _Thread_local char errmsg[GPUPOOL__ERRMSG_MAX];

const char *gpupool_err_name(int err) {
  switch (err) {
  case 0:
    return "OK";
#define X(name, val, msg) \
  case val:               \
    return #name;
    GPUPOOL_ERRNO_MAP(X)
#undef X
  default:
    return "UNKNOWN";
  }
}

const char *gpupool_strerror(int err) {
  switch (err) {
  case 0:
    return "success";
#define X(name, val, msg) \
  case val:               \
    return msg;
    GPUPOOL_ERRNO_MAP(X)
#undef X
  default:
    return "unknown error";
  }
}

int gpupool__err(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(errmsg, sizeof errmsg, fmt, ap);
  va_end(ap);
  return code;
}

const char *gpupool__errmsg(void) { return errmsg; }

void gpupool__err_clear(void) { errmsg[0] = '\0'; }

const char *gpupool_last_error(void) { return errmsg; }
