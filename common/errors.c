/*
 * Error codes and messages: gpupool_strerror()/gpupool_err_name() from the one X-macro list
 * in gpupool.h, and the thread-local message buffer behind gpupool__err() and
 * gpupool_last_error().
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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

/* Formats into a temporary first: callers add context to the previous failure with
 * gpupool__err(rc, "member %d: %s", i, gpupool__errmsg()), and vsnprintf into the buffer it
 * is reading from is undefined (glibc writes the prefix over the text before copying it,
 * which came out as "member 0: member 0: ..."). */
int gpupool__err(int code, const char *fmt, ...) {
  char tmp[GPUPOOL__ERRMSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  memcpy(errmsg, tmp, sizeof errmsg);
  return code;
}

const char *gpupool__errmsg(void) { return errmsg; }

void gpupool__err_clear(void) { errmsg[0] = '\0'; }

const char *gpupool_last_error(void) { return errmsg; }

int gpupool__error_set(gpupool__error *e, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
  e->code = code;
  return code;
}

int gpupool__error_take(gpupool__error *e, int code) {
  memcpy(e->msg, errmsg, sizeof e->msg);
  e->code = code;
  return code;
}

int gpupool__error_prefix(gpupool__error *e, const char *fmt, ...) {
  char tmp[GPUPOOL__ERRMSG_MAX];
  va_list ap;
  int n;
  va_start(ap, fmt);
  n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n < 0)
    n = 0;
  if ((size_t)n < sizeof tmp - 1) {
    size_t len = strnlen(e->msg, sizeof tmp - 1 - (size_t)n);
    memcpy(tmp + n, e->msg, len);
    tmp[(size_t)n + len] = '\0';
  }
  memcpy(e->msg, tmp, sizeof e->msg);
  return e->code;
}

int gpupool__error_report(const gpupool__error *e, int rc) {
  if (!e->code)
    return rc;
  memcpy(errmsg, e->msg, sizeof errmsg);
  return e->code;
}
