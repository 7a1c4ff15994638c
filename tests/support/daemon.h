/*
 * The one launcher of a private gpupoold for tests and benchmarks: a fresh temp dir holding
 * its socket, log and config, start-up until the socket accepts a connection, SIGTERM and
 * the exit status, the log printed when something went wrong. No test framework here: the
 * cmocka harness (tests/integration/harness.h), the GPU harness, the service tests and the
 * benchmarks all sit on it, so failures come back as -1 with the cause in d->why.
 */
#ifndef GPUPOOL_TESTS_SUPPORT_DAEMON_H
#define GPUPOOL_TESTS_SUPPORT_DAEMON_H

#include <stdio.h>
#include <sys/types.h>

typedef struct {
  char dir[256];  /* private temp dir, removed by ts_daemon_remove */
  char sock[320]; /* socket path inside dir */
  char log[320];  /* the daemon's stdout and stderr */
  char conf[320]; /* where ts_daemon_write_conf puts a config */
  pid_t pid;      /* 0 when not running */
  char why[512];  /* the cause of the last -1 */
} ts_daemon;

/* How ts_daemon_start runs gpupoold: --socket d->sock --backend BACKEND [--pool POOL]
 * --log-level LEVEL [--config d->conf] EXTRA... */
typedef struct {
  const char *gpupoold;     /* path of the executable */
  const char *backend;      /* "host", "cuda" */
  const char *pool;         /* --pool spec, or NULL */
  const char *log_level;    /* "debug", "info" */
  int use_conf;             /* pass --config d->conf */
  const char *const *extra; /* more arguments, NULL-terminated; NULL: none */
  int ready_ms;             /* how long start-up may take */
  int poll_ms;              /* how often to try the socket meanwhile */
  int (*hook)(void *arg);   /* runs in the child before exec (ts_exec); may be NULL */
  void *hook_arg;
  const char *const *wrapper; /* run under this command (NULL-terminated; found in PATH),
                               * e.g. unshare --pid --fork; NULL: none */
  int append_log;           /* append to d->log (a restarted daemon) rather than truncate it */
} ts_daemon_opts;

/* Runs in the child after its output went to the log and before exec: sets the environment
 * or fds a test needs. Nonzero makes the child exit 120. */
typedef int (*ts_child_hook)(void *arg);

/* A fresh private dir `tmpdir`/`name`XXXXXX (tmpdir NULL or "": /tmp) and the paths in it.
 * 0, or -1 (why set; also when the socket path is too long for AF_UNIX). */
int ts_daemon_prepare(ts_daemon *d, const char *tmpdir, const char *name);
/* Write text as d->conf. 0 or -1. */
int ts_daemon_write_conf(ts_daemon *d, const char *text);
/* Start gpupoold as o says and wait until its socket accepts a connection. 0, or -1 with
 * the log printed to stderr and the daemon, if it still ran, killed. */
int ts_daemon_start(ts_daemon *d, const ts_daemon_opts *o);
/* 1 while the daemon runs (a daemon that exited is reaped and said on stderr). */
int ts_daemon_alive(ts_daemon *d);
/* SIGTERM and reap (SIGKILL after timeout_ms; < 0: wait as long as it takes). The wait
 * status, or -1 when no daemon ran. The dir stays. */
int ts_daemon_stop(ts_daemon *d, int timeout_ms);
/* Unlink the files in the dir and remove it. */
void ts_daemon_remove(ts_daemon *d);
/* The first child of pid (the daemon a `gpupoold --supervise` runs now), or 0. */
pid_t ts_child_of(pid_t pid);
/* Print the daemon's log to stderr between two marker lines. */
void ts_daemon_dump_log(const ts_daemon *d);

/* ts_exec flags: only stderr goes to the log (stdout stays); the log is appended to. */
#define TS_EXEC_STDERR_ONLY 1
#define TS_EXEC_APPEND 2

/* fork + exec argv (argv[0] a path, or a name looked up in PATH) with stdout and stderr sent
 * to the file log (truncated; NULL: inherited) as flags say and stdin from /dev/null; hook
 * (may be NULL) runs in the child before exec. The child's pid, or -1. */
pid_t ts_exec(const char *const *argv, const char *log, int flags, ts_child_hook hook, void *arg);
/* Wait up to timeout_ms (< 0: forever) for pid: 0 with *status set, 1 when it is still
 * running (killed with SIGKILL and reaped when kill_late), -1 on error. */
int ts_wait_pid(pid_t pid, int timeout_ms, int kill_late, int *status);
/* 1 when a connection to the Unix socket path succeeds. */
int ts_can_connect(const char *path);
/* Copy the file at path to out between marker lines (nothing when it cannot be opened). */
void ts_print_file(FILE *out, const char *path, const char *title);

/* In a child: become uid (and gid = uid, no supplementary groups) when running as root, so
 * that what follows runs as another user; otherwise stay who we are. 0, or -1 on failure. */
int ts_become(uid_t uid);

/* The uid the tests run their other user as. */
#define TS_NOBODY 65534

#endif
