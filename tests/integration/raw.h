/*
 * Raw frames onto the daemon's socket, for the tests that play a client the library would
 * never be (hostile, flooding or half-broken ones). No cmocka assertions here: children use
 * these too.
 */
#ifndef GPUPOOL_TEST_RAW_H
#define GPUPOOL_TEST_RAW_H

#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "wire.h"

/* A connected socket with a receive timeout of timeout_s, or -1. */
static inline int th_raw_connect(const char *path, int timeout_s) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  struct timeval tv = {timeout_s, 0};
  int fd;
  if (strlen(path) >= sizeof a.sun_path)
    return -1;
  memcpy(a.sun_path, path, strlen(path) + 1);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/* Pack and send req with fds (may be NULL/0): 0 or a GPUPOOL_E* code. */
static inline int th_raw_send(int fd, gpupool__req *req, const int *fds, int nfds) {
  uint8_t *buf;
  size_t len;
  int rc = gpupool__wire_pack_request(req, &buf, &len);
  if (rc != 0)
    return rc;
  rc = gpupool__wire_send(fd, buf, len, fds, nfds);
  free(buf);
  return rc;
}

/* Send a Stats request (the one with no fields) numbered seq, with fds: as th_raw_send. */
static inline int th_raw_send_stats(int fd, uint64_t seq, const int *fds, int nfds) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &st;
  return th_raw_send(fd, &req, fds, nfds);
}

/* Next reply, or NULL at end of connection (or after the receive timeout). */
static inline gpupool__rep *th_raw_recv(int fd) {
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  if (gpupool__wire_rx_read(&rx, fd) == 1)
    rep = gpupool__wire_unpack_reply(&rx);
  gpupool__wire_rx_reset(&rx);
  return rep;
}

#endif
