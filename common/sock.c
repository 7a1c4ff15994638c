/*
 * Reaching gpupoold as its peer: the one implementation of connecting to its socket,
 * describing a socket that refused us, packing a request under the daemon's frame cap and
 * reading one reply, for the client library and gpupoolctl. Messages stay with the callers:
 * each words them for its own user (a program's error string, an operator's terminal). */
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "errors.h"
#include "sock.h"

/* Backoff between connects refused because the daemon's accept queue is full. */
#define CONNECT_RETRY_FIRST_MS 1
#define CONNECT_RETRY_MAX_MS 50

uint64_t gpupool__mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void ms_to_timeval(int ms, struct timeval *tv) {
  tv->tv_sec = ms > 0 ? ms / 1000 : 0;
  tv->tv_usec = ms > 0 ? (ms % 1000) * 1000 : 0;
}

int gpupool__sock_connect(const char *path, int timeout_ms, int busy_retry, int *tries) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  struct timeval tv;
  uint64_t deadline = gpupool__mono_ns() + (timeout_ms > 0 ? (uint64_t)timeout_ms * 1000000u : 0);
  int fd, pause_ms = CONNECT_RETRY_FIRST_MS;
  *tries = 0;
  if (strlen(path) >= sizeof addr.sun_path)
    return -ENAMETOOLONG;
  strcpy(addr.sun_path, path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -errno;
  /* connect() on a Unix socket whose listener is stopped blocks once the backlog is full:
   * SO_SNDTIMEO bounds it (and the Hello that follows). */
  ms_to_timeval(timeout_ms, &tv);
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  while ((*tries)++, connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    int e = errno;
    uint64_t now;
    if (e == EINTR)
      continue;
    /* The accept queue was full (a flood, or a daemon busy for a moment): a place may open
     * before the timeout, so try again after a short pause rather than fail at once. */
    if (busy_retry && e == EAGAIN && (timeout_ms < 0 || (now = gpupool__mono_ns()) < deadline)) {
      int ms = pause_ms;
      if (timeout_ms > 0 && (uint64_t)ms * 1000000u > deadline - now)
        ms = (int)((deadline - now) / 1000000u) + 1;
      if (timeout_ms > 0) {
        /* What is left of the timeout bounds the next wait in connect(). */
        ms_to_timeval((int)((deadline - now) / 1000000u) + 1, &tv);
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
      }
      poll(NULL, 0, ms);
      pause_ms = pause_ms * 2 > CONNECT_RETRY_MAX_MS ? CONNECT_RETRY_MAX_MS : pause_ms * 2;
      continue;
    }
    close(fd);
    return -e;
  }
  return fd;
}

static const char *file_kind(mode_t m) {
  switch (m & S_IFMT) {
  case S_IFDIR: return "a directory";
  case S_IFREG: return "a regular file";
  case S_IFLNK: return "a symbolic link";
  case S_IFIFO: return "a named pipe";
  case S_IFCHR: return "a character device";
  case S_IFBLK: return "a block device";
  default: return "something else";
  }
}

int gpupool__sock_describe(const char *path, char *buf, size_t len) {
  struct stat st;
  struct passwd pw, *pwp = NULL;
  struct group gr, *grp = NULL;
  char pwbuf[1024], grbuf[4096], u[16], g[16];
  if (stat(path, &st) != 0) {
    snprintf(buf, len, "its directory cannot be searched by this user: %s", strerror(errno));
    return -1;
  }
  if (S_ISDIR(st.st_mode)) {
    /* A directory (/tmp, the socket's own directory) was named instead of the socket in it:
     * never advise removing it. */
    snprintf(buf, len, "%s is a directory, not a socket: name the daemon's socket in it (such as "
             "%s%sgpupoold.sock) with --socket PATH or GPUPOOL_SOCKET",
             path, path, path[0] && path[strlen(path) - 1] == '/' ? "" : "/");
    return 1;
  }
  if (!S_ISSOCK(st.st_mode)) {
    /* connect() says only "Connection refused" here: name what is in the way, and the fix. */
    snprintf(buf, len, "%s is %s, not a socket: remove it (or fix what created it) and restart the "
             "daemon, or point at the daemon's socket with --socket PATH or GPUPOOL_SOCKET",
             path, file_kind(st.st_mode));
    return 1;
  }
  (void)getpwuid_r(st.st_uid, &pw, pwbuf, sizeof pwbuf, &pwp);
  (void)getgrgid_r(st.st_gid, &gr, grbuf, sizeof grbuf, &grp);
  snprintf(u, sizeof u, "%u", (unsigned)st.st_uid);
  snprintf(g, sizeof g, "%u", (unsigned)st.st_gid);
  snprintf(buf, len, "owner %s, group %s, mode %04o", pwp ? pwp->pw_name : u, grp ? grp->gr_name : g,
           (unsigned)(st.st_mode & 07777));
  return 0;
}

void gpupool__sock_foreign(const gpupool__wire_rx *rx, const char *read_error, char *buf, size_t len) {
  char seen[4 * GPUPOOL_WIRE_HDR + 1];
  size_t at = 0;
  if (!rx->refused_len) {
    snprintf(buf, len, "%s", read_error);
    return;
  }
  /* Not the frame-size limit's advice: this peer speaks another protocol altogether. */
  for (int i = 0; i < GPUPOOL_WIRE_HDR; i++) {
    unsigned char ch = rx->hdr[i];
    at += (size_t)snprintf(seen + at, sizeof seen - at, ch >= 0x20 && ch < 0x7f && ch != '"' && ch != '\\'
                                                            ? "%c" : "\\x%02x", ch);
  }
  snprintf(buf, len, "it began with \"%s\"", seen);
}

int gpupool__sock_group(const char *path, char *buf, size_t len) {
  struct stat st;
  struct group gr, *grp = NULL;
  char grbuf[4096];
  if (stat(path, &st) != 0)
    return -1;
  (void)getgrgid_r(st.st_gid, &gr, grbuf, sizeof grbuf, &grp);
  if (grp)
    snprintf(buf, len, "%s", grp->gr_name);
  else
    snprintf(buf, len, "%u", (unsigned)st.st_gid);
  return 0;
}

int gpupool__sock_pack_request(gpupool__req *req, uint32_t max_frame, uint8_t **buf, size_t *len) {
  int rc;
  if ((rc = gpupool__wire_pack_request(req, buf, len)) != 0)
    return rc;
  if (max_frame && *len - GPUPOOL_WIRE_HDR > max_frame) {
    free(*buf);
    *buf = NULL;
    return gpupool__err(GPUPOOL_ETOOBIG, "request of %zu bytes exceeds the daemon's frame limit of %u (max_frame "
                        "in its config)", *len - GPUPOOL_WIRE_HDR, max_frame);
  }
  return 0;
}

int gpupool__sock_read_reply(gpupool__wire_rx *rx, int fd, gpupool__rep **rep) {
  int rc = gpupool__wire_rx_read(rx, fd);
  *rep = rc == 1 ? gpupool__wire_unpack_reply(rx) : NULL;
  return rc;
}
