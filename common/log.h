/*
 * Logging to stderr, one line per event, with a level. When stderr is connected to the
 * journal (JOURNAL_STREAM is set) lines carry the "<N>" syslog priority prefix instead of a
 * timestamp, so journald files them at the right level.
 */
#ifndef GPUPOOL_COMMON_LOG_H
#define GPUPOOL_COMMON_LOG_H

#include <stdint.h>

enum { GPUPOOL_LOG_ERROR = 3, GPUPOOL_LOG_WARN = 4, GPUPOOL_LOG_INFO = 6, GPUPOOL_LOG_DEBUG = 7 };

/* Parse "error|warn|info|debug" into *level; returns 0 or GPUPOOL_EINVAL. */
int gpupool__log_parse_level(const char *s, int *level);
void gpupool__log_set_level(int level);
int gpupool__log_get_level(void);
void gpupool__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A journald-style rate limit (RateLimitIntervalSec/RateLimitBurst): at most `burst` lines per
 * interval; the rest are counted and the count is reported once the interval has passed. Zero
 * it to start. */
typedef struct {
  uint64_t window_ns;  /* when the current interval began (CLOCK_MONOTONIC) */
  uint32_t lines;      /* logged in it */
  uint64_t suppressed; /* left out in it */
} gpupool__ratelimit;

/* Whether one more line fits in rl's interval (and count it either way). When a new interval
 * begins, *report is what the last one left out, for the caller to log; 0 otherwise. */
int gpupool__ratelimit_allow(gpupool__ratelimit *rl, uint32_t burst, uint64_t interval_ns, uint64_t *report);

/* Lines that a peer can cause (a client's requests, connects and disconnects, protocol errors,
 * scrapers of the metrics): what a peer does must not decide how much the daemon logs. Each
 * line must fit within its client's limit (rl, NULL for a peer that is no client yet) and
 * within the daemon-wide limit that all peers share, so that many clients each under their own
 * limit cannot flood the journal either. Lines above the log level are not counted. */
#define GPUPOOL__PEER_LOG_BURST 10
#define GPUPOOL__PEER_LOG_INTERVAL_NS (10ull * 1000000000ull)
#define GPUPOOL__ALL_PEERS_LOG_BURST 200
#define GPUPOOL__ALL_PEERS_LOG_INTERVAL_NS (10ull * 1000000000ull)
void gpupool__log_peer(gpupool__ratelimit *rl, uint64_t client_id, int level, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Reports what the limits left out in an interval that is over, so a count is told even when
 * no further line comes: rl's (the client client_id's; NULL for none), and the daemon-wide one.
 * Call it from a timer. `final`: report now, whether the interval is over or not: rl's count
 * (the client is going away), or with rl NULL the daemon-wide count (the daemon is stopping). */
void gpupool__log_peer_flush(gpupool__ratelimit *rl, uint64_t client_id, int final);

#define GPUPOOL__PEER_WARN(rl, id, ...) gpupool__log_peer(rl, id, GPUPOOL_LOG_WARN, __VA_ARGS__)
#define GPUPOOL__PEER_INFO(rl, id, ...) gpupool__log_peer(rl, id, GPUPOOL_LOG_INFO, __VA_ARGS__)

#define GPUPOOL__ERROR(...) gpupool__log(GPUPOOL_LOG_ERROR, __VA_ARGS__)
#define GPUPOOL__WARN(...) gpupool__log(GPUPOOL_LOG_WARN, __VA_ARGS__)
#define GPUPOOL__INFO(...) gpupool__log(GPUPOOL_LOG_INFO, __VA_ARGS__)
#define GPUPOOL__DEBUG(...)                                                   \
  do {                                                                  \
    if (gpupool__log_get_level() >= GPUPOOL_LOG_DEBUG)                  \
      gpupool__log(GPUPOOL_LOG_DEBUG, __VA_ARGS__);                     \
  } while (0)

#endif
