/*
 * systemd integration without libsystemd: the three small protocols gpupoold speaks with its
 * service manager.
 *
 * - Socket activation (sd_listen_fds(3)): the manager binds /run/gpupool/gpupoold.sock,
 *   passes it as fd 3 and names the receiving process in LISTEN_PID. gpupoold serves exactly
 *   one socket, so anything but one listening AF_UNIX stream socket is a configuration error
 *   reported before the daemon does any work.
 * - Readiness and status (sd_notify(3)): datagrams to $NOTIFY_SOCKET, a filesystem path or
 *   "@name" in the abstract namespace.
 * - The watchdog: WATCHDOG_USEC says how often the manager expects "WATCHDOG=1"; the loop in
 *   main.c pings at half that.
 *
 * Re-implementing these keeps the daemon free of a libsystemd dependency, so the same binary
 * runs in containers and on systems without systemd, where every function here is a no-op.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "errors.h"
#include "sd.h"

#define SD_LISTEN_FDS_START 3

/* Parse a whole decimal string into an unsigned 64-bit value; -1 on anything else. */
static int parse_u64(const char *s, uint64_t *out) {
  char *end = NULL;
  unsigned long long v;

  if (s == NULL || *s < '0' || *s > '9')
    return -1;
  errno = 0;
  v = strtoull(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0')
    return -1;
  *out = v;
  return 0;
}

/* LISTEN_PID / WATCHDOG_PID name the process the variables are meant for: a child that
 * inherited the environment must not act on them. */
static int env_pid_is_self(const char *name) {
  uint64_t pid;
  const char *s = getenv(name);

  if (s == NULL || parse_u64(s, &pid) != 0)
    return 0;
  return pid == (uint64_t)getpid();
}

static void unset_listen_env(void) {
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDS");
  unsetenv("LISTEN_FDNAMES");
}

/* Keep the fds the manager passed out of any program the daemon might execute later, even
 * when it refuses them. */
static void cloexec_range(int first, int n) {
  for (int fd = first; fd < first + n; fd++) {
    int fl = fcntl(fd, F_GETFD);
    if (fl >= 0)
      (void)fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
  }
}

static gpd_sd_stored stored[GPD_SD_STORE_MAX];
static int nstored;

/* Set the store's entries among the n passed fds aside (names from LISTEN_FDNAMES, ':'
 * separated); returns how many others there are, *other the last of them. An fd beyond
 * GPD_SD_STORE_MAX entries is closed (the store never holds more). */
static int take_stored(const char *names, int n, int *other) {
  const char *at = names;
  int others = 0;
  for (int i = 0; i < n; i++) {
    const char *end = at ? strchr(at, ':') : NULL;
    size_t len = at ? (end ? (size_t)(end - at) : strlen(at)) : 0;
    int fd = SD_LISTEN_FDS_START + i;
    if (at && len > strlen(GPD_SD_STORE_PREFIX) && len < sizeof stored[0].name &&
        strncmp(at, GPD_SD_STORE_PREFIX, strlen(GPD_SD_STORE_PREFIX)) == 0) {
      if (nstored < GPD_SD_STORE_MAX) {
        memcpy(stored[nstored].name, at, len);
        stored[nstored].name[len] = '\0';
        stored[nstored].fd = fd;
        nstored++;
      } else {
        close(fd);
      }
    } else {
      others++;
      *other = fd;
    }
    at = end ? end + 1 : NULL;
  }
  return others;
}

gpd_sd_stored *gpd_sd_stored_fds(int *n) {
  *n = nstored;
  return stored;
}

int gpd_sd_listen_fd(void) {
  const char *fds_s = getenv("LISTEN_FDS");
  uint64_t nfds = 0;
  int fd = SD_LISTEN_FDS_START;
  int type = 0, acc = 0, fl;
  socklen_t len;
  struct sockaddr_storage ss;
  int rc;

  if (fds_s == NULL) {
    rc = -1;
    goto out;
  }
  if (!env_pid_is_self("LISTEN_PID")) {
    /* Meant for another process (or malformed): not socket-activated. */
    rc = -1;
    goto out;
  }
  if (parse_u64(fds_s, &nfds) != 0 || nfds > INT_MAX - SD_LISTEN_FDS_START) {
    rc = gpupool__err(GPUPOOL_ECONFIG,
                      "socket activation: LISTEN_FDS='%s' is not a number of file descriptors; "
                      "start gpupoold from gpupoold.socket or without LISTEN_FDS in its "
                      "environment",
                      fds_s);
    goto out;
  }
  if (nfds == 0) {
    rc = -1;
    goto out;
  }
  cloexec_range(SD_LISTEN_FDS_START, (int)nfds);
  /* Entries of the fd store (FDSTORE=1, named GPD_SD_STORE_PREFIX...) come back with the
   * listening socket: set aside for the state's restore (state.c). */
  if ((rc = take_stored(getenv("LISTEN_FDNAMES"), (int)nfds, &fd)) < 0)
    goto out;
  nfds = (uint64_t)rc;
  if (nfds == 0) {
    rc = -1;
    goto out;
  }
  if (nfds != 1) {
    rc = gpupool__err(GPUPOOL_ECONFIG,
                      "socket activation: LISTEN_FDS=%llu but gpupoold serves exactly one "
                      "socket; give its .socket unit a single ListenStream= line (for "
                      "example ListenStream=/run/gpupool/gpupoold.sock)",
                      (unsigned long long)nfds);
    goto out;
  }

  len = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) {
    rc = gpupool__err(GPUPOOL_ECONFIG,
                      "socket activation: fd %d passed by the service manager is not a socket "
                      "(%s); use a .socket unit with ListenStream= set to a path",
                      fd, strerror(errno));
    goto out;
  }
  if (type != SOCK_STREAM) {
    rc = gpupool__err(GPUPOOL_ECONFIG,
                      "socket activation: fd %d is not a stream socket (type %d); use "
                      "ListenStream= (not ListenDatagram= or ListenSequentialPacket=) in the "
                      ".socket unit",
                      fd, type);
    goto out;
  }
  len = sizeof(acc);
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &len) != 0 || !acc) {
    rc = gpupool__err(GPUPOOL_ECONFIG,
                      "socket activation: fd %d is not a listening socket; the .socket unit "
                      "must not set Accept=yes",
                      fd);
    goto out;
  }
  len = sizeof(ss);
  memset(&ss, 0, sizeof(ss));
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 || ss.ss_family != AF_UNIX) {
    rc = gpupool__err(GPUPOOL_ECONFIG,
                      "socket activation: fd %d is not a Unix domain socket (family %d); "
                      "gpupoold passes file descriptors and checks peer credentials, which "
                      "need ListenStream= set to a filesystem path such as "
                      "/run/gpupool/gpupoold.sock",
                      fd, (int)ss.ss_family);
    goto out;
  }
  fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) {
    rc = gpupool__err(GPUPOOL_ECONFIG, "socket activation: cannot make fd %d nonblocking: %s",
                      fd, strerror(errno));
    goto out;
  }
  rc = fd;

out:
  unset_listen_env();
  return rc;
}

/* Fill addr from $NOTIFY_SOCKET. Returns the address length, 0 when unset, or an error. */
static int notify_addr(struct sockaddr_un *addr, socklen_t *alen) {
  const char *e = getenv("NOTIFY_SOCKET");
  size_t n;

  if (e == NULL || *e == '\0')
    return 0;
  n = strlen(e);
  if ((e[0] != '/' && e[0] != '@') || n >= sizeof(addr->sun_path))
    return gpupool__err(GPUPOOL_EIO,
                        "NOTIFY_SOCKET='%s' is not an absolute path or an abstract '@name' "
                        "that fits a Unix socket address; unset it or fix the service manager's "
                        "setting",
                        e);
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  memcpy(addr->sun_path, e, n);
  if (e[0] == '@')
    addr->sun_path[0] = '\0'; /* abstract namespace: the length, not a NUL, ends the name */
  *alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + (e[0] == '/' ? 1 : 0));
  return 1;
}

int gpd_sd_notify(const char *state) { return gpd_sd_notify_fd(state, -1); }

int gpd_sd_notify_fd(const char *state, int pass) {
  struct sockaddr_un addr;
  socklen_t alen = 0;
  size_t len;
  ssize_t w;
  int fd = -1, rc;
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(sizeof(int))];
  } cm;
  struct iovec iov;
  struct msghdr mh;

  if (state == NULL)
    return gpupool__err(GPUPOOL_EINVAL, "sd_notify: no state string given");
  rc = notify_addr(&addr, &alen);
  if (rc <= 0)
    return rc;
  fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    rc = gpupool__err(GPUPOOL_EIO, "sd_notify: cannot create a datagram socket: %s",
                      strerror(errno));
    goto out;
  }
  len = strlen(state);
  iov.iov_base = (void *)state;
  iov.iov_len = len;
  memset(&mh, 0, sizeof mh);
  mh.msg_name = &addr;
  mh.msg_namelen = alen;
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (pass >= 0) {
    memset(&cm, 0, sizeof cm);
    mh.msg_control = cm.buf;
    mh.msg_controllen = sizeof cm.buf;
    cm.h.cmsg_level = SOL_SOCKET;
    cm.h.cmsg_type = SCM_RIGHTS;
    cm.h.cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(&cm.h), &pass, sizeof pass);
  }
  do {
    w = sendmsg(fd, &mh, MSG_NOSIGNAL);
  } while (w < 0 && errno == EINTR);
  if (w < 0) {
    rc = gpupool__err(GPUPOOL_EIO, "sd_notify: cannot send to NOTIFY_SOCKET=%s: %s",
                      getenv("NOTIFY_SOCKET"), strerror(errno));
    goto out;
  }
  if ((size_t)w != len) {
    rc = gpupool__err(GPUPOOL_EIO, "sd_notify: short datagram to NOTIFY_SOCKET=%s (%zd of %zu)",
                      getenv("NOTIFY_SOCKET"), w, len);
    goto out;
  }
  rc = 0;

out:
  if (fd >= 0)
    close(fd);
  return rc;
}

int gpd_sd_notifyf(const char *fmt, ...) {
  va_list ap;
  char *s = NULL;
  int n, rc;

  if (getenv("NOTIFY_SOCKET") == NULL)
    return 0; /* skip the formatting on the common path outside systemd */
  va_start(ap, fmt);
  n = vasprintf(&s, fmt, ap);
  va_end(ap);
  if (n < 0)
    return gpupool__err(GPUPOOL_ENOMEM, "sd_notify: out of memory formatting a state string");
  rc = gpd_sd_notify(s);
  free(s);
  return rc;
}

size_t gpd_sd_fit(char *buf, size_t cap, const char *text) {
  static const char mark[] = " ...";
  size_t n = strlen(text), cut;

  if (cap == 0)
    return 0;
  if (n < cap) {
    memcpy(buf, text, n + 1);
    return n;
  }
  if (cap < sizeof mark) {
    buf[0] = '\0';
    return 0;
  }
  /* text[0..cut) and the mark fill the buffer at most. */
  cut = cap - sizeof mark;
  while (cut > 0 && text[cut] != ' ')
    cut--;
  while (cut > 0 && (text[cut - 1] == ' ' || text[cut - 1] == ',' || text[cut - 1] == ';' || text[cut - 1] == ':'))
    cut--;
  if (cut == 0) {
    /* One long word (a path): cut before a character's first byte. */
    cut = cap - sizeof mark;
    while (cut > 0 && ((unsigned char)text[cut] & 0xc0) == 0x80)
      cut--;
    memcpy(buf, text, cut);
    memcpy(buf + cut, mark + 1, sizeof mark - 1);
    return cut + sizeof mark - 2;
  }
  memcpy(buf, text, cut);
  memcpy(buf + cut, mark, sizeof mark);
  return cut + sizeof mark - 1;
}

size_t gpd_sd_status_add(char *buf, size_t cap, size_t len, const char *sep, const char *text, size_t keep) {
  size_t s = strlen(sep), room;

  if (len >= cap || cap - len <= keep)
    return len;
  room = cap - len - keep; /* for sep, text and the NUL */
  if (room < s + 8)        /* not even a short word and the mark */
    return len;
  memcpy(buf + len, sep, s);
  return len + s + gpd_sd_fit(buf + len + s, room - s, text);
}

uint64_t gpd_sd_watchdog_usec(void) {
  const char *s = getenv("WATCHDOG_USEC");
  uint64_t usec;

  if (s == NULL || parse_u64(s, &usec) != 0 || usec == 0)
    return 0;
  /* Without WATCHDOG_PID the variable is for us (systemd sets both since v209). */
  if (getenv("WATCHDOG_PID") != NULL && !env_pid_is_self("WATCHDOG_PID"))
    return 0;
  return usec;
}
