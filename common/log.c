/*
 * One line per event on stderr. Under systemd (JOURNAL_STREAM set) each line starts with the
 * "<N>" priority prefix journald understands; otherwise with a UTC timestamp and the level.
 */
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

void gpupool__log(int level, const char *fmt, ...) {
  char line[1024];
  va_list ap;
  int n;

  if (level > log_level)
    return;
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
  va_start(ap, fmt);
  vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  va_end(ap);
  n = (int)strlen(line);
  line[n++] = '\n';
  /* One write per line so lines from several processes do not interleave. */
  if (write(STDERR_FILENO, line, (size_t)n) < 0) {
    /* Nowhere left to report it. */
  }
}
