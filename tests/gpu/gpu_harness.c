/*
 * Process harness for the GPU tests and the benchmark (see gpu_harness.h): GPU check, private
 * daemon lifecycle, worker processes over pipes, timing helpers. Plain POSIX; the only CUDA
 * call is the device count.
 */
#include "gpu_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

int gh_driver_start(int argc, char **argv, int nargs, const char *usage, int need, const char *why) {
  if (argc != nargs) {
    fprintf(stderr, "usage: %s %s\n", argv[0], usage);
    exit(2);
  }
  signal(SIGPIPE, SIG_IGN);
  setvbuf(stdout, NULL, _IOLBF, 0);
  return gh_gpu_count_or_skip(need, why);
}

uint64_t gh_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void gh_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
    ;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double gh_percentile(double *v, size_t n, double pct) {
  size_t i;
  if (n == 0)
    return 0.0;
  qsort(v, n, sizeof(*v), cmp_double);
  i = (size_t)(pct / 100.0 * (double)(n - 1) + 0.5);
  return v[i < n ? i : n - 1];
}

int gh_gpu_count_or_skip(int need, const char *why) {
  int n = 0, drv = 0;
  cudaError_t e;
  if (cudaDriverGetVersion(&drv) != cudaSuccess || drv == 0) {
    printf("SKIP: no CUDA device (no NVIDIA driver: cudaDriverGetVersion reports none)\n");
    fflush(stdout);
    exit(GH_SKIP);
  }
  e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    printf("SKIP: no CUDA device (cudaGetDeviceCount: %s: %s)\n", cudaGetErrorName(e),
           cudaGetErrorString(e));
    fflush(stdout);
    exit(GH_SKIP);
  }
  if (n < need) {
    printf("SKIP: %s needs %d CUDA device%s, this machine has %d\n", why, need,
           need == 1 ? "" : "s", n);
    fflush(stdout);
    exit(GH_SKIP);
  }
  return n;
}

int gh_daemon_alive(gh_daemon *d) { return ts_daemon_alive(d); }

int gh_daemon_start(gh_daemon *d, const char *gpupoold, const char *pool_spec) {
  return gh_daemon_start_conf(d, gpupoold, pool_spec, NULL);
}

int gh_daemon_start_opts(gh_daemon *d, const ts_daemon_opts *o, const char *conf) {
  if (ts_daemon_prepare(d, getenv("TMPDIR"), "gpupool-gpu.") != 0 ||
      (conf && ts_daemon_write_conf(d, conf) != 0) || ts_daemon_start(d, o) != 0) {
    fprintf(stderr, "%s\n", d->why);
    ts_daemon_remove(d);
    return -1;
  }
  return 0;
}

int gh_daemon_start_conf(gh_daemon *d, const char *gpupoold, const char *pool_spec, const char *conf) {
  /* CUDA initialization in the daemon can take seconds on a cold driver. */
  ts_daemon_opts o = {.gpupoold = gpupoold, .backend = "cuda", .pool = pool_spec, .log_level = "info",
                      .use_conf = conf != NULL, .ready_ms = 60000, .poll_ms = 20};
  return gh_daemon_start_opts(d, &o, conf);
}

int gh_daemon_start_supervised(gh_daemon *d, const char *gpupoold, const char *conf) {
  static const char *const extra[] = {"--supervise", NULL};
  const char *lvl = getenv("GH_LOG_LEVEL");
  ts_daemon_opts o = {.gpupoold = gpupoold, .backend = "cuda", .log_level = lvl && *lvl ? lvl : "info", .use_conf = 1,
                      .extra = extra, .ready_ms = 60000, .poll_ms = 20};
  return gh_daemon_start_opts(d, &o, conf);
}

pid_t gh_wait_restarted(const gh_daemon *d, pid_t old, int timeout_ms) {
  uint64_t end = gh_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  while (gh_now_ns() < end) {
    pid_t c = ts_child_of(d->pid);
    if (c && c != old && ts_can_connect(d->sock))
      return c;
    gh_sleep_ms(2);
  }
  return 0;
}

int gh_daemon_stop(gh_daemon *d, int print_log) {
  int st = ts_daemon_stop(d, 10000);
  if (print_log)
    ts_daemon_dump_log(d);
  ts_daemon_remove(d);
  return st;
}

int gh_spawn(gh_proc *p, const char *const *argv, const int *extra, int n_extra) {
  static char self[PATH_MAX];
  int in[2] = {-1, -1}, out[2] = {-1, -1}, hi[16];
  const char **av;
  int n = 0;

  memset(p, 0, sizeof(*p));
  p->pid = -1;
  p->in = p->out = -1;
  if (n_extra > 13)
    return -1;
  if (!self[0]) {
    ssize_t l = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (l <= 0) {
      fprintf(stderr, "readlink /proc/self/exe: %s\n", strerror(errno));
      return -1;
    }
    self[l] = '\0';
  }
  while (argv[n])
    n++;
  av = calloc((size_t)n + 1, sizeof(*av));
  if (!av)
    return -1;
  av[0] = self;
  for (int i = 1; i < n; i++)
    av[i] = argv[i];
  if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0) {
    fprintf(stderr, "pipe2: %s\n", strerror(errno));
    goto fail;
  }
  fflush(stdout);
  fflush(stderr);
  p->pid = fork();
  if (p->pid == 0) {
    /* Only async-signal-safe calls until exec: the parent may have CUDA threads. Move every
     * source above the targets first so that mapping one cannot clobber another. */
    int fds[16], k = 0;
    fds[k++] = in[0];
    fds[k++] = out[1];
    for (int i = 0; i < n_extra; i++)
      fds[k++] = extra[i];
    for (int i = 0; i < k; i++) {
      hi[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 100);
      if (hi[i] < 0)
        _exit(126);
    }
    if (dup2(hi[0], 0) < 0 || dup2(hi[1], 1) < 0)
      _exit(126);
    for (int i = 0; i < n_extra; i++)
      if (dup2(hi[2 + i], 3 + i) < 0)
        _exit(126);
    execv(self, (char *const *)av);
    _exit(127);
  }
  if (p->pid < 0) {
    fprintf(stderr, "fork: %s\n", strerror(errno));
    goto fail;
  }
  close(in[0]);
  close(out[1]);
  p->in = in[1];
  p->out = out[0];
  free(av);
  return 0;

fail:
  for (int i = 0; i < 2; i++) {
    if (in[i] >= 0)
      close(in[i]);
    if (out[i] >= 0)
      close(out[i]);
  }
  free(av);
  return -1;
}

int gh_readline(gh_proc *p, char *line, size_t len, int timeout_ms) {
  uint64_t end = gh_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  for (;;) {
    char *nl = memchr(p->buf, '\n', p->len);
    if (nl) {
      size_t l = (size_t)(nl - p->buf);
      size_t c = l < len - 1 ? l : len - 1;
      memcpy(line, p->buf, c);
      line[c] = '\0';
      memmove(p->buf, nl + 1, p->len - l - 1);
      p->len -= l + 1;
      return 0;
    }
    if (p->len == sizeof(p->buf) || p->out < 0)
      return -1;
    uint64_t now = gh_now_ns();
    if (now >= end)
      return -1;
    struct pollfd pf = {p->out, POLLIN, 0};
    int r = poll(&pf, 1, (int)((end - now) / 1000000ull) + 1);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    ssize_t got = read(p->out, p->buf + p->len, sizeof(p->buf) - p->len);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      return -1;
    p->len += (size_t)got;
  }
}

int gh_expect(gh_proc *p, const char *prefix, char *line, size_t len, int timeout_ms) {
  uint64_t end = gh_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  for (;;) {
    uint64_t now = gh_now_ns();
    if (now >= end)
      return -1;
    if (gh_readline(p, line, len, (int)((end - now) / 1000000ull) + 1) < 0)
      return -1;
    if (!strncmp(line, prefix, strlen(prefix)))
      return 0;
  }
}

int gh_writeline(gh_proc *p, const char *line) {
  char buf[1024];
  int n = snprintf(buf, sizeof(buf), "%s\n", line);
  if (p->in < 0 || n <= 0 || (size_t)n >= sizeof(buf))
    return -1;
  return write(p->in, buf, (size_t)n) == n ? 0 : -1;
}

int gh_wait(gh_proc *p, int timeout_ms) {
  int st = 0, r;
  if (p->pid <= 0)
    return -1;
  if (p->in >= 0) {
    close(p->in);
    p->in = -1;
  }
  r = ts_wait_pid(p->pid, timeout_ms, 0, &st);
  if (r == 1) {
    fprintf(stderr, "worker %d still running after %d ms; killing it\n", (int)p->pid,
            timeout_ms);
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &st, 0);
  } else if (r < 0) {
    st = -1;
  }
  p->pid = -1;
  if (p->out >= 0) {
    close(p->out);
    p->out = -1;
  }
  if (st == -1)
    return -1;
  if (WIFEXITED(st))
    return WEXITSTATUS(st);
  return 128 + WTERMSIG(st);
}

void gh_signal(gh_proc *p, int sig) {
  if (p->pid > 0)
    kill(p->pid, sig);
}

int gh_full_io(int fd, void *buf, size_t n, int wr) {
  uint8_t *p = buf;
  while (n) {
    ssize_t r = wr ? write(fd, p, n) : read(fd, p, n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

void gh_say(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  putchar('\n');
  fflush(stdout);
}
