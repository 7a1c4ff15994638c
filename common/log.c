/*
 * One line per event on stderr. Under systemd (JOURNAL_STREAM set) each line starts with the
 * "<N>" priority prefix journald understands; otherwise with a UTC timestamp and the level.
 *
 * Also the rate limits of the lines that peers cause: one per client and one daemon-wide,
 * each reporting what it left out. The daemon is single-threaded, so they need no locking.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "errors.h"
#include "log.h"

static int log_level = GPUPOOL_LOG_INFO;
static int log_journal = -1;

int gpupool__log_parse_level(const char *s, int *level) {
  static const struct {
    const char *name;
    int level;
  } names[] = {{"error", GPUPOOL_LOG_ERROR}, {"warn", GPUPOOL_LOG_WARN},
               {"warning", GPUPOOL_LOG_WARN}, {"info", GPUPOOL_LOG_INFO},
               {"debug", GPUPOOL_LOG_DEBUG}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcmp(s, names[i].name) == 0) {
      *level = names[i].level;
      return 0;
    }
  return gpupool__err(GPUPOOL_EINVAL, "unknown log level '%s' (use error, warn, info or debug)", s);
}

void gpupool__log_set_level(int level) { log_level = level; }
int gpupool__log_get_level(void) { return log_level; }

static void vlog(int level, const char *fmt, va_list ap) {
  char line[1024];
  int n;

  if (log_journal < 0)
    log_journal = getenv("JOURNAL_STREAM") != NULL;
  if (log_journal) {
    n = snprintf(line, sizeof line, "<%d>", level);
  } else {
    struct timespec ts;
    struct tm tm;
    const char *lv = level <= GPUPOOL_LOG_ERROR  ? "error"
                     : level == GPUPOOL_LOG_WARN ? "warn"
                     : level == GPUPOOL_LOG_INFO ? "info"
                                                 : "debug";
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ gpupoold[%d] %s: ",
                 tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                 ts.tv_nsec / 1000000, (int)getpid(), lv);
  }
  if (n < 0 || (size_t)n >= sizeof line)
    n = 0;
  vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  n = (int)strlen(line);
  line[n++] = '\n';
  /* One write per line so lines from several processes do not interleave. */
  if (write(STDERR_FILENO, line, (size_t)n) < 0) {
    /* Nowhere left to report it. */
  }
}

void gpupool__log(int level, const char *fmt, ...) {
  va_list ap;

  if (level > log_level)
    return;
  va_start(ap, fmt);
  vlog(level, fmt, ap);
  va_end(ap);
}

/* ---- rate limits ---------------------------------------------------------------------------- */

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Starts a new interval at now when the current one is over; returns what it left out. */
static uint64_t rl_roll(gpupool__ratelimit *rl, uint64_t interval_ns, uint64_t now) {
  uint64_t left_out = 0;
  if (rl->window_ns == 0 || now - rl->window_ns >= interval_ns) {
    left_out = rl->suppressed;
    rl->window_ns = now;
    rl->lines = 0;
    rl->suppressed = 0;
  }
  return left_out;
}

int gpupool__ratelimit_allow(gpupool__ratelimit *rl, uint32_t burst, uint64_t interval_ns, uint64_t *report) {
  *report = rl_roll(rl, interval_ns, mono_ns());
  if (rl->lines < burst) {
    rl->lines++;
    return 1;
  }
  rl->suppressed++;
  return 0;
}

/* The limit all peers' lines share. */
static gpupool__ratelimit all_peers;

static void report_all_peers(uint64_t n) {
  if (n)
    gpupool__log(GPUPOOL_LOG_WARN,
                 "%" PRIu64 " more lines caused by clients were not logged (at most %d per %llu s from all "
                 "clients together)",
                 n, GPUPOOL__ALL_PEERS_LOG_BURST, GPUPOOL__ALL_PEERS_LOG_INTERVAL_NS / 1000000000ull);
}

/* Whether a line fits in the daemon-wide limit; reports the last interval's count first. */
static int all_peers_allow(void) {
  uint64_t report;
  int ok = gpupool__ratelimit_allow(&all_peers, GPUPOOL__ALL_PEERS_LOG_BURST, GPUPOOL__ALL_PEERS_LOG_INTERVAL_NS,
                                    &report);
  report_all_peers(report);
  return ok;
}

/* One client's count of left-out lines: itself a line that client caused, so it goes through
 * the daemon-wide limit, which counts those lines as its own when it leaves the report out. */
static void report_peer(uint64_t id, uint64_t n) {
  if (!n)
    return;
  if (all_peers_allow())
    gpupool__log(GPUPOOL_LOG_INFO, "client %" PRIu64 ": %" PRIu64 " more lines were not logged (at most %d per %llu s per client)",
                 id, n, GPUPOOL__PEER_LOG_BURST, GPUPOOL__PEER_LOG_INTERVAL_NS / 1000000000ull);
  else
    all_peers.suppressed += n;
}

void gpupool__log_peer(gpupool__ratelimit *rl, uint64_t client_id, int level, const char *fmt, ...) {
  va_list ap;

  if (level > log_level)
    return;
  if (rl != NULL) {
    uint64_t report;
    int ok = gpupool__ratelimit_allow(rl, GPUPOOL__PEER_LOG_BURST, GPUPOOL__PEER_LOG_INTERVAL_NS, &report);
    report_peer(client_id, report);
    if (!ok)
      return;
  }
  if (!all_peers_allow())
    return;
  va_start(ap, fmt);
  vlog(level, fmt, ap);
  va_end(ap);
}

void gpupool__log_peer_flush(gpupool__ratelimit *rl, uint64_t client_id, int final) {
  uint64_t now = mono_ns();

  if (rl != NULL && rl->suppressed) {
    if (final) {
      report_peer(client_id, rl->suppressed);
      rl->suppressed = 0;
    } else {
      report_peer(client_id, rl_roll(rl, GPUPOOL__PEER_LOG_INTERVAL_NS, now));
    }
  }
  if (all_peers.suppressed && rl == NULL && final) {
    report_all_peers(all_peers.suppressed);
    all_peers.suppressed = 0;
  } else if (all_peers.suppressed) {
    report_all_peers(rl_roll(&all_peers, GPUPOOL__ALL_PEERS_LOG_INTERVAL_NS, now));
  }
}
