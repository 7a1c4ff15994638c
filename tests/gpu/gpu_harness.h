/*
 * Process harness shared by the GPU tests and the benchmark: check for a GPU (skip with 77
 * when there is none), start a private gpupoold on a socket in a fresh temp dir and stop it,
 * and run worker processes (this same executable re-executed with a role) with pipes on
 * their stdin/stdout and extra fds mapped to 3, 4, ...
 *
 * CUDA does not survive fork(): workers are always fork+exec'd, never forked alone, so the
 * parent may use CUDA before spawning them.
 */
#ifndef GPUPOOL_TESTS_GPU_HARNESS_H
#define GPUPOOL_TESTS_GPU_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define GH_SKIP 77

#include "daemon.h"

/* tests/support's daemon: dir (removed by gh_daemon_stop), sock, log (stdout+stderr). */
typedef ts_daemon gh_daemon;

typedef struct {
  pid_t pid;
  int in;  /* write end of the child's stdin, -1 once closed */
  int out; /* read end of the child's stdout */
  char buf[4096];
  size_t len;
} gh_proc;

/* Number of CUDA devices; when there are fewer than need, prints "SKIP: ..." (why names
 * what the test needs) and exits GH_SKIP. */
int gh_gpu_count_or_skip(int need, const char *why);

/* The driver's start (after the worker dispatch): with argc other than nargs, prints
 * "usage: PROG usage" and exits 2; then ignores SIGPIPE (a worker that died is seen as a
 * failed write), line-buffers stdout, and returns gh_gpu_count_or_skip(need, why). */
int gh_driver_start(int argc, char **argv, int nargs, const char *usage, int need, const char *why);

/* Start gpupoold --backend cuda with the given pool spec on a private socket and wait until
 * the socket accepts a connection. 0, or -1 with the daemon's log printed to stderr. */
int gh_daemon_start(gh_daemon *d, const char *gpupoold, const char *pool_spec);
/* Prepare d's private dir, write conf there (NULL: none) and start gpupoold as o says: 0,
 * or -1 with the reason printed and the dir removed. */
int gh_daemon_start_opts(gh_daemon *d, const ts_daemon_opts *o, const char *conf);
/* The same with a config file holding conf (NULL: none), written into the private dir. */
int gh_daemon_start_conf(gh_daemon *d, const char *gpupoold, const char *pool_spec, const char *conf);
/* The same under gpupoold --supervise (its own fd store: slabs of survive=yes pools, names
 * and versions outlive a crash of the daemon it restarts); d->pid is the supervisor's. */
int gh_daemon_start_supervised(gh_daemon *d, const char *gpupoold, const char *conf);
/* Wait up to timeout_ms for the supervisor to run a daemon other than old that accepts
 * connections: its pid, or 0. */
pid_t gh_wait_restarted(const gh_daemon *d, pid_t old, int timeout_ms);
/* 1 while the daemon runs. */
int gh_daemon_alive(gh_daemon *d);
/* SIGTERM (then SIGKILL after 10 s), reap, print the log when print_log, remove the dir.
 * Returns the daemon's exit status as waitpid reports it, or -1. */
int gh_daemon_stop(gh_daemon *d, int print_log);

/* Run this executable again with argv (argv[0] is replaced by its path); extra[i] becomes
 * fd 3 + i in the child. 0 or -1. */
int gh_spawn(gh_proc *p, const char *const *argv, const int *extra, int n_extra);
/* Read one line (without the newline) from the child's stdout. 0, or -1 on EOF/timeout. */
int gh_readline(gh_proc *p, char *line, size_t len, int timeout_ms);
/* Read lines until one starts with prefix; copies it into line. 0 or -1. */
int gh_expect(gh_proc *p, const char *prefix, char *line, size_t len, int timeout_ms);
/* Write line + "\n" to the child's stdin. 0 or -1. */
int gh_writeline(gh_proc *p, const char *line);
/* Wait for the child to exit (SIGKILL after timeout_ms). Returns its exit code, 128+signal
 * when killed by a signal, or -1. Closes the pipes. */
int gh_wait(gh_proc *p, int timeout_ms);
void gh_signal(gh_proc *p, int sig);

/* CLOCK_MONOTONIC in ns (one clock for all processes of the machine). */
uint64_t gh_now_ns(void);
void gh_sleep_ms(int ms);

/* Percentile (0..100) of n values, sorting v in place. */
double gh_percentile(double *v, size_t n, double pct);

/* Read (wr = 0) or write exactly n bytes, retrying on EINTR and short transfers: 0, or -1 on
 * EOF or error. Workers pass binary messages over inherited pipes with it. */
int gh_full_io(int fd, void *buf, size_t n, int wr);

/* printf one line to stdout and flush it: how workers talk to the parent, line by line. */
void gh_say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
