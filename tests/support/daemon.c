/*
 * The private gpupoold of a test or benchmark (daemon.h): its dir, start-up, stop, log, and
 * the process plumbing around it (exec with the output in a file, waits with a deadline,
 * becoming another uid).
 */
#include "daemon.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

static int say(ts_daemon *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int say(ts_daemon *d, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(d->why, sizeof d->why, fmt, ap);
  va_end(ap);
  return -1;
}

int ts_daemon_prepare(ts_daemon *d, const char *tmpdir, const char *name) {
  memset(d, 0, sizeof *d);
  snprintf(d->dir, sizeof d->dir, "%s/%sXXXXXX", tmpdir && *tmpdir ? tmpdir : "/tmp", name);
  if (!mkdtemp(d->dir)) {
    int e = errno;
    say(d, "mkdtemp %s: %s", d->dir, strerror(e));
    d->dir[0] = '\0';
    return -1;
  }
  snprintf(d->sock, sizeof d->sock, "%s/gpupoold.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/gpupoold.log", d->dir);
  snprintf(d->conf, sizeof d->conf, "%s/gpupoold.conf", d->dir);
  if (strlen(d->sock) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
    say(d, "socket path %s is too long for AF_UNIX: set TMPDIR to a shorter dir", d->sock);
    ts_daemon_remove(d);
    return -1;
  }
  return 0;
}

int ts_daemon_write_conf(ts_daemon *d, const char *text) {
  FILE *f = fopen(d->conf, "w");
  if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
    int e = errno;
    return say(d, "writing %s: %s", d->conf, strerror(e));
  }
  return 0;
}

pid_t ts_exec(const char *const *argv, const char *log, int flags, ts_child_hook hook, void *arg) {
  pid_t pid = fork();
  if (pid != 0)
    return pid;
  {
    int nul = open("/dev/null", O_RDONLY), fd;
    if (nul >= 0 && nul != 0) {
      dup2(nul, 0);
      close(nul);
    }
    if (log && (fd = open(log, O_WRONLY | O_CREAT | O_CLOEXEC | (flags & TS_EXEC_APPEND ? O_APPEND : O_TRUNC),
                          0644)) >= 0) {
      dup2(fd, 2);
      if (!(flags & TS_EXEC_STDERR_ONLY))
        dup2(fd, 1);
    }
    if (hook && hook(arg) != 0)
      _exit(120);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
  }
}

int ts_wait_pid(pid_t pid, int timeout_ms, int kill_late, int *status) {
  uint64_t end = now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
  for (;;) {
    pid_t r = waitpid(pid, status, timeout_ms < 0 ? 0 : WNOHANG);
    if (r == pid)
      return 0;
    if (r < 0 && errno != EINTR)
      return -1;
    if (timeout_ms >= 0 && now_ms() >= end)
      break;
    if (r == 0)
      sleep_ms(5);
  }
  if (kill_late) {
    kill(pid, SIGKILL);
    waitpid(pid, status, 0);
  }
  return 1;
}

int ts_can_connect(const char *path) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  int fd, ok;
  if (strlen(path) >= sizeof a.sun_path)
    return 0;
  memcpy(a.sun_path, path, strlen(path) + 1);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

void ts_print_file(FILE *out, const char *path, const char *title) {
  char buf[4096];
  size_t n;
  FILE *f = fopen(path, "r");
  if (!f)
    return;
  fprintf(out, "---- %s (%s) ----\n", title, path);
  while ((n = fread(buf, 1, sizeof buf, f)) > 0)
    fwrite(buf, 1, n, out);
  fprintf(out, "---- end of %s ----\n", title);
  fclose(f);
}

void ts_daemon_dump_log(const ts_daemon *d) { ts_print_file(stderr, d->log, "gpupoold log"); }

pid_t ts_child_of(pid_t pid) {
  char path[64];
  long child = 0;
  FILE *f;
  snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)pid, (int)pid);
  if (!(f = fopen(path, "r")))
    return 0;
  if (fscanf(f, "%ld", &child) != 1)
    child = 0;
  fclose(f);
  return (pid_t)child;
}

int ts_daemon_alive(ts_daemon *d) {
  int st;
  if (d->pid <= 0)
    return 0;
  if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
    fprintf(stderr, "gpupoold exited (%s %d)\n", WIFEXITED(st) ? "status" : "signal",
            WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    d->pid = 0;
    return 0;
  }
  return 1;
}

int ts_daemon_start(ts_daemon *d, const ts_daemon_opts *o) {
  const char *argv[48];
  int argc = 0, st;
  uint64_t end;

  for (int i = 0; o->wrapper && o->wrapper[i] && argc < 8; i++)
    argv[argc++] = o->wrapper[i];
  argv[argc++] = o->gpupoold;
  argv[argc++] = "--socket";
  argv[argc++] = d->sock;
  argv[argc++] = "--backend";
  argv[argc++] = o->backend;
  if (o->pool) {
    argv[argc++] = "--pool";
    argv[argc++] = o->pool;
  }
  argv[argc++] = "--log-level";
  argv[argc++] = o->log_level;
  if (o->use_conf) {
    argv[argc++] = "--config";
    argv[argc++] = d->conf;
  }
  for (int i = 0; o->extra && o->extra[i] && argc < 47; i++)
    argv[argc++] = o->extra[i];
  argv[argc] = NULL;
  d->why[0] = '\0';
  if ((d->pid = ts_exec(argv, d->log, o->append_log ? TS_EXEC_APPEND : 0, o->hook, o->hook_arg)) < 0) {
    int e = errno;
    d->pid = 0;
    return say(d, "fork: %s", strerror(e));
  }
  end = now_ms() + (uint64_t)o->ready_ms;
  do {
    if (ts_can_connect(d->sock))
      return 0;
    if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
      d->pid = 0;
      ts_daemon_dump_log(d);
      return say(d, "gpupoold (%s) exited during start-up (status %d)", o->gpupoold, st);
    }
    sleep_ms(o->poll_ms);
  } while (now_ms() < end);
  ts_daemon_dump_log(d);
  kill(d->pid, SIGKILL);
  waitpid(d->pid, NULL, 0);
  d->pid = 0;
  return say(d, "gpupoold did not accept connections on %s within %d ms", d->sock, o->ready_ms);
}

int ts_daemon_stop(ts_daemon *d, int timeout_ms) {
  int st = 0;
  if (d->pid <= 0)
    return -1;
  kill(d->pid, SIGTERM);
  if (ts_wait_pid(d->pid, timeout_ms, 1, &st) == 1)
    fprintf(stderr, "gpupoold did not exit within %d ms of SIGTERM; killed it\n", timeout_ms);
  d->pid = 0;
  return st;
}

void ts_daemon_remove(ts_daemon *d) {
  DIR *dir;
  struct dirent *de;
  char path[PATH_MAX];
  if (!d->dir[0])
    return;
  if ((dir = opendir(d->dir)) != NULL) {
    while ((de = readdir(dir)) != NULL) {
      if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
        continue;
      snprintf(path, sizeof path, "%s/%s", d->dir, de->d_name);
      unlink(path);
    }
    closedir(dir);
  }
  rmdir(d->dir);
  d->dir[0] = '\0';
}

int ts_become(uid_t uid) {
  if (getuid() != 0)
    return 0;
  if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0)
    return -1;
  return 0;
}
