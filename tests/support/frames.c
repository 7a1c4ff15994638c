/*
 * Raw frames for tests and benchmarks (frames.h): connect, send and receive through the wire
 * module, and the Hello and PoolInfo messages that every raw client or fake daemon starts with.
 */
#include "frames.h"

#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

int ts_raw_connect(const char *path, int timeout_s) {
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

/* Send what pack_rc says was packed into buf (freed here): 0 or a GPUPOOL_E* code. */
static int send_packed(int fd, int pack_rc, uint8_t *buf, size_t len, const int *fds, int nfds) {
  int rc;
  if (pack_rc != 0)
    return pack_rc;
  rc = gpupool__wire_send(fd, buf, len, fds, nfds);
  free(buf);
  return rc;
}

int ts_raw_send(int fd, gpupool__req *req, const int *fds, int nfds) {
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc = gpupool__wire_pack_request(req, &buf, &len); /* before buf and len are read */
  return send_packed(fd, rc, buf, len, fds, nfds);
}

int ts_raw_send_reply(int fd, gpupool__rep *rep, const int *fds, int nfds) {
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc = gpupool__wire_pack_reply(rep, &buf, &len);
  return send_packed(fd, rc, buf, len, fds, nfds);
}

int ts_raw_send_stats(int fd, uint64_t seq, const int *fds, int nfds) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &st;
  return ts_raw_send(fd, &req, fds, nfds);
}

gpupool__rep *ts_raw_recv(int fd) {
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  if (gpupool__wire_rx_read(&rx, fd) == 1)
    rep = gpupool__wire_unpack_reply(&rx);
  gpupool__wire_rx_reset(&rx);
  return rep;
}

void ts_hello(gpupool__req *req, Gpupool__Wire__Hello *h, uint32_t version, const char *name, int32_t pid) {
  gpupool__wire__request__init(req);
  gpupool__wire__hello__init(h);
  h->protocol_version = version;
  h->client_name = (char *)name;
  h->pid = pid;
  req->seq = 1;
  req->body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  req->hello = h;
}

int ts_raw_hello(int fd, const char *name, int32_t pid) {
  gpupool__req req;
  Gpupool__Wire__Hello h;
  gpupool__rep *rep;
  int ok;
  ts_hello(&req, &h, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, name, pid);
  if (ts_raw_send(fd, &req, NULL, 0) != 0 || !(rep = ts_raw_recv(fd)))
    return -1;
  ok = rep->error == NULL && rep->body_case == GPUPOOL__WIRE__REPLY__BODY_HELLO;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return ok ? 0 : -1;
}

int ts_raw_session(const char *path, int timeout_s, const char *name, int32_t pid) {
  int fd = ts_raw_connect(path, timeout_s);
  if (fd >= 0 && ts_raw_hello(fd, name, pid) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void ts_host_pool_info(Gpupool__Wire__PoolInfo *p, uint64_t capacity) {
  gpupool__wire__pool_info__init(p);
  p->id = 1;
  p->name = (char *)"default";
  p->backend = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST;
  p->location = GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST;
  p->device = -1;
  p->capacity = capacity;
}

void ts_tensor_meta(Gpupool__Wire__TensorMeta *t, uint32_t code, uint32_t bits, size_t ndim, int64_t *shape) {
  gpupool__wire__tensor_meta__init(t);
  t->present = 1;
  t->dtype_code = code;
  t->dtype_bits = bits;
  t->dtype_lanes = 1;
  t->n_shape = ndim;
  t->shape = shape;
}
