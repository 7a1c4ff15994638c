/*
 * Logging to stderr, one line per event, with a level. When stderr is connected to the
 * journal (JOURNAL_STREAM is set) lines carry the "<N>" syslog priority prefix instead of a
 * timestamp, so journald files them at the right level.
 */
#ifndef GPUPOOL_COMMON_LOG_H
#define GPUPOOL_COMMON_LOG_H

enum { GPUPOOL_LOG_ERROR = 3, GPUPOOL_LOG_WARN = 4, GPUPOOL_LOG_INFO = 6, GPUPOOL_LOG_DEBUG = 7 };

/* Parse "error|warn|info|debug" into *level; returns 0 or GPUPOOL_EINVAL. */
int gpupool__log_parse_level(const char *s, int *level);
void gpupool__log_set_level(int level);
int gpupool__log_get_level(void);
void gpupool__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define GPUPOOL__ERROR(...) gpupool__log(GPUPOOL_LOG_ERROR, __VA_ARGS__)
#define GPUPOOL__WARN(...) gpupool__log(GPUPOOL_LOG_WARN, __VA_ARGS__)
#define GPUPOOL__INFO(...) gpupool__log(GPUPOOL_LOG_INFO, __VA_ARGS__)
#define GPUPOOL__DEBUG(...)                                                   \
  do {                                                                  \
    if (gpupool__log_get_level() >= GPUPOOL_LOG_DEBUG)                  \
      gpupool__log(GPUPOOL_LOG_DEBUG, __VA_ARGS__);                     \
  } while (0)

#endif
