/*
 * gpupoold --supervise: the daemon's own fd store, for containers and machines without
 * systemd. A small parent runs the daemon as its child and speaks to it the part of the
 * sd_notify protocol that keeps state (sd_notify(3)): FDSTORE=1 with FDNAME= puts the fds of a
 * message in the store, FDSTOREREMOVE=1 with FDNAME= takes those of that name out. When the
 * child dies (a crash: killed by a signal, or exit status 1) the parent starts it again, with
 * the stored fds in LISTEN_FDS / LISTEN_FDNAMES exactly as systemd would pass them, so the
 * daemon takes its state back the same way under both.
 *
 * The parent holds the memory of every kept slab (their memfds) for as long as it runs:
 * stopping it (SIGTERM, SIGINT) stops the daemon and lets everything go. SIGHUP is passed to
 * the daemon (reload); SIGUSR2 restarts it, from the executable now at the path this one was
 * started from (an upgrade). Exit status 0 (a clean stop) and 2 (a configuration the daemon
 * refuses, or a state from a newer daemon) end the supervisor too: starting again cannot help.
 * A crash is restarted after 100 ms, twice as long after each crash within 10 s of its start,
 * up to 5 s (GPUPOOL_SUPERVISE_MAX_DELAY_MS sets that bound).
 *
 * Only the child may store fds: each message's sender is checked (SCM_CREDENTIALS), so
 * another process that finds the socket's abstract name cannot put fds in or take them out.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sd.h"
#include "supervise.h"

#define MSG_FDS_MAX 16
#define SD_LISTEN_FDS_FIRST 3

typedef struct {
  char name[64];
  int fd;
} entry;

static entry *store;
static int nstore, maxstore;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
  va_list ap;
  char buf[512];
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "gpupoold --supervise[%d]: %s\n", (int)getpid(), buf);
}

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void store_remove(const char *name) {
  int k = 0;
  for (int i = 0; i < nstore; i++) {
    if (strcmp(store[i].name, name) == 0) {
      close(store[i].fd);
      continue;
    }
    store[k++] = store[i];
  }
  nstore = k;
}

/* A name as systemd accepts it: printable ASCII, no ':', at most 255 bytes (ours are short). */
static int name_ok(const char *s, size_t n) {
  if (n == 0 || n >= sizeof store[0].name)
    return 0;
  for (size_t i = 0; i < n; i++)
    if (s[i] <= ' ' || s[i] > '~' || s[i] == ':')
      return 0;
  return 1;
}

static void on_message(int sock, pid_t child) {
  char buf[4096], name[64] = "stored";
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(MSG_FDS_MAX * sizeof(int))];
  } cm;
  struct iovec iov = {buf, sizeof buf - 1};
  struct msghdr mh = {0};
  struct cmsghdr *c;
  struct ucred *cred = NULL;
  int fds[MSG_FDS_MAX], nfds = 0, fdstore = 0, remove = 0;
  ssize_t n;

  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cm.b;
  mh.msg_controllen = sizeof cm.b;
  n = recvmsg(sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0)
    return;
  for (c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      for (int i = 0; i < k; i++) {
        int fd;
        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        if (nfds < MSG_FDS_MAX)
          fds[nfds++] = fd;
        else
          close(fd);
      }
    } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
      cred = (struct ucred *)CMSG_DATA(c);
    }
  }
  if (!cred || cred->pid != child || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    return; /* not from the daemon, or cut: ignored */
  }
  buf[n] = '\0';
  for (char *line = buf, *next; line && *line; line = next) {
    next = strchr(line, '\n');
    if (next)
      *next++ = '\0';
    if (strcmp(line, "FDSTORE=1") == 0)
      fdstore = 1;
    else if (strcmp(line, "FDSTOREREMOVE=1") == 0)
      remove = 1;
    else if (strncmp(line, "FDNAME=", 7) == 0 && name_ok(line + 7, strlen(line + 7)))
      snprintf(name, sizeof name, "%s", line + 7);
  }
  if (remove)
    store_remove(name);
  for (int i = 0; i < nfds; i++) {
    if (fdstore && nstore < maxstore) {
      snprintf(store[nstore].name, sizeof store[nstore].name, "%s", name);
      store[nstore].fd = fds[i];
      nstore++;
    } else {
      if (fdstore)
        say("the fd store is full (%d entries); an fd named %s is dropped", maxstore, name);
      close(fds[i]);
    }
  }
}

/* In the child: the stored fds at 3..., the variables that say so, then the daemon. */
static void exec_child(const char *exe, char **argv, const char *notify) {
  char num[32], *names;
  size_t len = 1;
  int base = SD_LISTEN_FDS_FIRST, high;
  sigset_t none;

  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  /* A supervisor that dies (even by SIGKILL) takes the daemon with it: nothing would keep its
   * store or restart it. */
  (void)prctl(PR_SET_PDEATHSIG, SIGTERM);
  for (int i = 0; i < nstore; i++)
    len += strlen(store[i].name) + 1;
  names = malloc(len);
  if (!names)
    _exit(1);
  names[0] = '\0';
  /* Move every fd above the range first, so placing one never overwrites another. */
  high = base + nstore + 64;
  for (int i = 0; i < nstore; i++) {
    int fd = fcntl(store[i].fd, F_DUPFD, high);
    if (fd < 0)
      _exit(1);
    store[i].fd = fd;
    strcat(names, i ? ":" : "");
    strcat(names, store[i].name);
  }
  for (int i = 0; i < nstore; i++) {
    if (dup2(store[i].fd, base + i) < 0)
      _exit(1);
    close(store[i].fd);
  }
  /* Nothing else the supervisor was started with reaches the daemon (as under systemd): each
   * start sees the same fds. */
  if (close_range((unsigned)(base + nstore), ~0u, 0) != 0) {
    long max = sysconf(_SC_OPEN_MAX);
    for (long fd = base + nstore; fd < (max > 0 && max < 65536 ? max : 65536); fd++)
      (void)close((int)fd);
  }
  unsetenv("LISTEN_FDS");
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDNAMES");
  if (nstore > 0) {
    snprintf(num, sizeof num, "%d", nstore);
    setenv("LISTEN_FDS", num, 1);
    snprintf(num, sizeof num, "%d", (int)getpid());
    setenv("LISTEN_PID", num, 1);
    setenv("LISTEN_FDNAMES", names, 1);
  }
  setenv("NOTIFY_SOCKET", notify, 1);
  snprintf(num, sizeof num, "%d", maxstore);
  setenv("FDSTORE", num, 1);
  unsetenv("WATCHDOG_USEC");
  unsetenv("WATCHDOG_PID");
  execv(exe, argv);
  fprintf(stderr, "gpupoold --supervise: cannot run %s: %s\n", exe, strerror(errno));
  _exit(1);
}

/* Everything the supervisor holds goes (it is exiting): the store's fds, the argument copy. */
static int finish(char **cargv, int sock, int sfd, int code) {
  for (int i = 0; i < nstore; i++)
    close(store[i].fd);
  nstore = 0;
  free(store);
  store = NULL;
  free(cargv);
  if (sock >= 0)
    close(sock);
  if (sfd >= 0)
    close(sfd);
  return code;
}

int gpd_supervise(int argc, char **argv) {
  char exe[PATH_MAX], notify[108];
  char **cargv;
  struct sockaddr_un addr = {0};
  struct rlimit rl;
  sigset_t sigs;
  int sock = -1, sfd = -1, one = 1, k = 0, stopping = 0, restart_now = 0, status = 0, code = 0;
  pid_t child = -1, was;
  long delay_ms = 100, max_ms = 5000;
  const char *env = getenv("GPUPOOL_SUPERVISE_MAX_DELAY_MS");
  uint64_t started = 0;
  ssize_t n;

  n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    say("cannot find this executable (/proc/self/exe: %s); is /proc mounted?", strerror(errno));
    return 1;
  }
  exe[n] = '\0';
  if (env && *env)
    max_ms = strtol(env, NULL, 10) < 1 ? 1 : strtol(env, NULL, 10);
  if (n > 10 && strcmp(exe + n - 10, " (deleted)") == 0)
    exe[n - 10] = '\0';
  cargv = calloc((size_t)argc + 1, sizeof *cargv);
  if (!cargv)
    return 1;
  for (int i = 0; i < argc; i++)
    if (strcmp(argv[i], "--supervise") != 0)
      cargv[k++] = argv[i];
  cargv[k] = NULL;
  /* As many entries as fds can be held, leaving room for the parent's own. */
  maxstore = GPD_SD_STORE_MAX;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (rlim_t)maxstore + 128)
    maxstore = rl.rlim_cur > 192 ? (int)rl.rlim_cur - 128 : 64;
  store = calloc((size_t)maxstore, sizeof *store);
  if (!store)
    return finish(cargv, sock, sfd, 1);

  sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (sock < 0)
    return say("socket: %s", strerror(errno)), finish(cargv, sock, sfd, 1);
  addr.sun_family = AF_UNIX;
  snprintf(notify, sizeof notify, "@gpupoold-supervise-%d-%08x", (int)getpid(), (unsigned)arc4random());
  memcpy(addr.sun_path + 1, notify + 1, strlen(notify) - 1);
  if (bind(sock, (struct sockaddr *)&addr, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(notify))) != 0 ||
      setsockopt(sock, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0)
    return say("cannot bind its notify socket: %s", strerror(errno)), finish(cargv, sock, sfd, 1);
  /* Larger messages than a notify datagram are refused by the kernel, not cut here. */
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGCHLD);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGHUP);
  sigaddset(&sigs, SIGUSR2);
  sigprocmask(SIG_BLOCK, &sigs, NULL);
  sfd = signalfd(-1, &sigs, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0)
    return say("signalfd: %s", strerror(errno)), finish(cargv, sock, sfd, 1);

  for (;;) {
    if (child < 0) {
      started = now_ms();
      child = fork();
      if (child < 0)
        return say("fork: %s", strerror(errno)), finish(cargv, sock, sfd, 1);
      if (child == 0)
        exec_child(exe, cargv, notify);
      say("started gpupoold (pid %d) with %d kept fd(s)", (int)child, nstore);
    }
    struct pollfd p[2] = {{sock, POLLIN, 0}, {sfd, POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR)
      return say("poll: %s", strerror(errno)), finish(cargv, sock, sfd, 1);
    if (p[0].revents & POLLIN)
      for (int i = 0; i < 64; i++)
        on_message(sock, child);
    if (!(p[1].revents & POLLIN))
      continue;
    struct signalfd_siginfo si;
    while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
      if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
        stopping = 1;
        kill(child, (int)si.ssi_signo);
      } else if (si.ssi_signo == SIGHUP) {
        kill(child, SIGHUP);
      } else if (si.ssi_signo == SIGUSR2) {
        restart_now = 1;
        kill(child, SIGTERM);
      }
    }
    if (waitpid(child, &status, WNOHANG) != child)
      continue;
    was = child;
    /* What it sent before it went is still in the socket: take it first. */
    for (int i = 0; i < 4096; i++) {
      struct pollfd q = {sock, POLLIN, 0};
      if (poll(&q, 1, 0) <= 0)
        break;
      on_message(sock, child);
    }
    child = -1;
    code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (stopping) {
      say("gpupoold stopped (%s %d); dropping %d kept fd(s)", WIFEXITED(status) ? "exit status" : "signal",
          WIFEXITED(status) ? code : WTERMSIG(status), nstore);
      return finish(cargv, sock, sfd, WIFEXITED(status) ? code : 0);
    }
    if (restart_now) {
      restart_now = 0;
      delay_ms = 100;
      say("restarting gpupoold from %s", exe);
      continue;
    }
    if (WIFEXITED(status) && (code == 0 || code == 2)) {
      say("gpupoold exited with status %d: %s; not restarting", code,
          code == 0 ? "it was stopped" : "it refuses to start (see its log), restarting cannot help");
      return finish(cargv, sock, sfd, code);
    }
    if (now_ms() - started > 10000)
      delay_ms = 100;
    if (delay_ms > max_ms)
      delay_ms = max_ms;
    say("gpupoold (pid %d) %s %d; restarting it in %ld ms with %d kept fd(s)", (int)was,
        WIFEXITED(status) ? "exited with status" : "was killed by signal",
        WIFEXITED(status) ? code : WTERMSIG(status), delay_ms, nstore);
    {
      struct timespec ts = {delay_ms / 1000, (delay_ms % 1000) * 1000000L};
      while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
    }
    delay_ms = delay_ms * 2 > max_ms ? max_ms : delay_ms * 2;
  }
}
