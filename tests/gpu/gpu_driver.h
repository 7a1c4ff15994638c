/*
 * What the GPU checks' driver side shares (the parent process, the one that starts gpupoold and
 * the workers): the PASS and FAIL lines, a pool's stats by name, waiting
 * for a pool to drain, and running one check against a daemon already started. The worker
 * side's counterpart is gpu_worker.h; both sit on gpu_harness.h.
 */
#ifndef GPUPOOL_GPU_DRIVER_H
#define GPUPOOL_GPU_DRIVER_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "gpu_harness.h"
#include "gpupool/gpupool.h"

/* "PASS: check: message" when rc is 0, else "FAIL: ...", on one flushed line of stdout (what
 * the test scripts read); returns rc. */
static inline int gh_verdict(int rc, const char *check, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline int gh_verdict(int rc, const char *check, const char *fmt, ...) {
  va_list ap;
  printf("%s: %s: ", rc ? "FAIL" : "PASS", check);
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  putchar('\n');
  fflush(stdout);
  return rc;
}

/* The stats of the pool named pool (and the daemon's into ds, unless NULL): 0, or a negative
 * code / -1 with the reason on stderr. */
static inline int gh_pool_stats(gpupool_client *c, const char *pool, gpupool_pool_stats *ps,
                                gpupool_daemon_stats *ds) {
  gpupool_pool_stats all[8];
  gpupool_daemon_stats dtmp;
  int n = 0, rc = gpupool_client_stats(c, ds ? ds : &dtmp, all, 8, &n);
  if (rc < 0) {
    fprintf(stderr, "gpupool_client_stats: %s: %s\n", gpupool_err_name(rc), gpupool_last_error());
    return rc;
  }
  for (int i = 0; i < n && i < 8; i++)
    if (!strcmp(all[i].name, pool)) {
      *ps = all[i];
      return 0;
    }
  fprintf(stderr, "gpupool_client_stats lists no pool named %s\n", pool);
  return -1;
}

/* Poll until the pool's used bytes equal want (the daemon drops a dead client's holds and
 * frees ranges once events complete, both asynchronously): 0, or -1 with the last count in got. */
static inline int gh_wait_used(gpupool_client *c, const char *pool, uint64_t want, int timeout_ms,
                               uint64_t *got) {
  uint64_t end = gh_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  gpupool_pool_stats ps;
  do {
    if (gh_pool_stats(c, pool, &ps, NULL) < 0)
      return -1;
    *got = ps.used;
    if (ps.used == want)
      return 0;
    gh_sleep_ms(50);
  } while (gh_now_ns() < end);
  return -1;
}

/* Runs fn against the started daemon d as client `client`, then stops d (printing its log
 * when the check failed): fn's result, or 1 after a FAIL line for check when the connect
 * fails, or the daemon died during fn or did not exit cleanly on SIGTERM. */
static inline int gh_run_on_daemon(gh_daemon *d, const char *check, const char *client,
                                   int (*fn)(const gh_daemon *, gpupool_client *)) {
  gpupool_client *c = NULL;
  int rc, st;
  if ((rc = gpupool_client_connect(d->sock, client, GPUPOOL_TIMEOUT_DEFAULT, &c)) < 0) {
    gh_daemon_stop(d, 1);
    return gh_verdict(1, check, "gpupool_client_connect: %s: %s", gpupool_err_name(rc), gpupool_last_error());
  }
  rc = fn(d, c);
  gpupool_client_disconnect(c);
  if (!gh_daemon_alive(d)) {
    gh_daemon_stop(d, 1);
    return rc ? rc : gh_verdict(1, check, "gpupoold died during the check");
  }
  st = gh_daemon_stop(d, rc != 0);
  if (rc == 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
    return gh_verdict(1, check, "gpupoold did not exit cleanly on SIGTERM (wait status %d)", st);
  return rc;
}

#endif
