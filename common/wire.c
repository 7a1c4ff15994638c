/*
 * The wire module: framing, fd passing and protobuf-c pack/unpack for both the daemon and
 * the client library. A frame is a 4-byte little-endian payload length followed by one
 * packed Request or Reply; fds ride SCM_RIGHTS on the frame's first byte.
 *
 * The receiver owns the safety rules: it reads one frame at a time (exactly the header, then
 * exactly the payload), so the kernel can never hand it fds that belong to the next frame
 * (a Unix stream recvmsg stops after the segment that carried fds, and we never ask for bytes
 * past the current frame). The control buffer has room for GPUPOOL_WIRE_MAX_FDS fds and no
 * more: a peer that sends more trips MSG_CTRUNC, and every fd that did arrive is closed. The
 * length cap is checked before the payload is allocated, so a hostile length costs nothing.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "errors.h"
#include "wire.h"

/* Linux 6.5+ delivers a pidfd as a control message when SO_PASSPIDFD is set; older libc
 * headers lack the name. It is an fd like SCM_RIGHTS and must be closed if it shows up. */
#ifndef SCM_PIDFD
#define SCM_PIDFD 0x04
#endif

#define CTRL_SPACE CMSG_SPACE(GPUPOOL_WIRE_MAX_FDS * sizeof(int))

/* Control buffer aligned for struct cmsghdr, sized exactly for the fds a frame may carry. */
typedef union {
  struct cmsghdr align;
  char buf[CTRL_SPACE];
} ctrl_buf;

static void put_le32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Pack through protobuf-c's message-generic entry points so requests and replies share the
 * size check and the header writing. */
static int pack_msg(const ProtobufCMessage *m, const char *what, uint8_t **buf, size_t *len) {
  size_t plen, n;
  uint8_t *b;

  if (m == NULL || buf == NULL || len == NULL)
    return gpupool__err(GPUPOOL_EINVAL, "cannot pack a %s: NULL argument", what);
  plen = protobuf_c_message_get_packed_size(m);
  if (plen > GPUPOOL_WIRE_HARD_MAX_FRAME)
    return gpupool__err(GPUPOOL_ETOOBIG,
                        "%s of %zu bytes exceeds the hard frame limit of %u bytes; send less "
                        "in one message",
                        what, plen, GPUPOOL_WIRE_HARD_MAX_FRAME);
  b = malloc(GPUPOOL_WIRE_HDR + plen);
  if (b == NULL)
    return gpupool__err(GPUPOOL_ENOMEM, "cannot allocate a %zu-byte frame for a %s",
                        GPUPOOL_WIRE_HDR + plen, what);
  n = protobuf_c_message_pack(m, b + GPUPOOL_WIRE_HDR);
  if (n != plen) {
    free(b);
    return gpupool__err(GPUPOOL_EPROTO, "packing a %s wrote %zu bytes, expected %zu", what, n,
                        plen);
  }
  put_le32(b, (uint32_t)plen);
  *buf = b;
  *len = GPUPOOL_WIRE_HDR + plen;
  return 0;
}

int gpupool__wire_pack_request(const gpupool__req *m, uint8_t **buf, size_t *len) {
  return pack_msg(m ? &m->base : NULL, "request", buf, len);
}

int gpupool__wire_pack_reply(const gpupool__rep *m, uint8_t **buf, size_t *len) {
  return pack_msg(m ? &m->base : NULL, "reply", buf, len);
}

static int send_error(int e) {
  if (e == EPIPE || e == ECONNRESET || e == ENOTCONN)
    return gpupool__err(GPUPOOL_ECLOSED, "peer closed the connection while sending (%s)",
                        strerror(e));
  return gpupool__err(GPUPOOL_EIO, "sendmsg on the gpupool socket failed: %s", strerror(e));
}

/* One sendmsg of buf[off..len), with fds attached when off is 0 (the frame's first byte).
 * Returns bytes written, or -errno. */
static ssize_t send_step(int sock, const uint8_t *buf, size_t len, size_t off, const int *fds,
                         int nfds, int flags) {
  return gpupool__wire_sendmsg(sock, buf + off, len - off, fds, off == 0 ? nfds : 0, flags);
}

ssize_t gpupool__wire_sendmsg(int sock, const void *buf, size_t len, const int *fds, int nfds,
                              int flags) {
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(GPUPOOL__WIRE_SENDMSG_MAX_FDS * sizeof(int))];
  } ctrl;
  struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
  struct msghdr msg;
  ssize_t n;

  if (nfds > GPUPOOL__WIRE_SENDMSG_MAX_FDS)
    return -EINVAL;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (nfds > 0) {
    struct cmsghdr *c;
    memset(&ctrl, 0, sizeof ctrl);
    msg.msg_control = ctrl.buf;
    msg.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
    c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
    memcpy(CMSG_DATA(c), fds, (size_t)nfds * sizeof(int));
  }
  do {
    n = sendmsg(sock, &msg, flags | MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n < 0 ? -errno : n;
}

static int check_send_args(const uint8_t *buf, size_t len, const int *fds, int nfds) {
  if (buf == NULL || len < GPUPOOL_WIRE_HDR)
    return gpupool__err(GPUPOOL_EINVAL, "cannot send a frame of %zu bytes: a frame has at least "
                        "a %d-byte header", len, GPUPOOL_WIRE_HDR);
  if (nfds < 0 || nfds > GPUPOOL_WIRE_MAX_FDS || (nfds > 0 && fds == NULL))
    return gpupool__err(GPUPOOL_EINVAL, "cannot send %d fds in one frame: the limit is %d", nfds,
                        GPUPOOL_WIRE_MAX_FDS);
  return 0;
}

int gpupool__wire_send(int sock, const uint8_t *buf, size_t len, const int *fds, int nfds) {
  size_t off = 0;
  int rc = check_send_args(buf, len, fds, nfds);

  if (rc < 0)
    return rc;
  while (off < len) {
    ssize_t n = send_step(sock, buf, len, off, fds, nfds, 0);
    if (n == -EAGAIN || n == -EWOULDBLOCK) {
      /* The caller asked for a blocking send on a nonblocking socket: wait for room rather
       * than spin. */
      struct pollfd p = {.fd = sock, .events = POLLOUT};
      int pr;
      do {
        pr = poll(&p, 1, -1);
      } while (pr < 0 && errno == EINTR);
      if (pr < 0)
        return send_error(errno);
      continue;
    }
    if (n < 0)
      return send_error((int)-n);
    off += (size_t)n;
  }
  return 0;
}

int gpupool__wire_send_some(int sock, const uint8_t *buf, size_t len, size_t *off,
                            const int *fds, int nfds) {
  int rc = check_send_args(buf, len, fds, nfds);

  if (rc < 0)
    return rc;
  if (off == NULL || *off > len)
    return gpupool__err(GPUPOOL_EINVAL, "send offset is outside the %zu-byte frame", len);
  while (*off < len) {
    ssize_t n = send_step(sock, buf, len, *off, fds, nfds, MSG_DONTWAIT);
    if (n == -EAGAIN || n == -EWOULDBLOCK)
      return 0;
    if (n < 0)
      return send_error((int)-n);
    *off += (size_t)n;
  }
  return 1;
}

void gpupool__wire_rx_init(gpupool__wire_rx *rx, uint32_t max_frame) {
  memset(rx, 0, sizeof *rx);
  /* 0 means "the default"; nothing may exceed the hard cap, whatever a config says. */
  if (max_frame == 0)
    max_frame = GPUPOOL_WIRE_DEFAULT_MAX_FRAME;
  if (max_frame > GPUPOOL_WIRE_HARD_MAX_FRAME)
    max_frame = GPUPOOL_WIRE_HARD_MAX_FRAME;
  rx->max_frame = max_frame;
  for (int i = 0; i < GPUPOOL_WIRE_MAX_FDS; i++)
    rx->fds[i] = -1;
}

void gpupool__wire_rx_reset(gpupool__wire_rx *rx) {
  for (int i = 0; i < rx->nfds; i++) {
    if (rx->fds[i] >= 0)
      close(rx->fds[i]);
    rx->fds[i] = -1;
  }
  rx->nfds = 0;
  free(rx->payload);
  rx->payload = NULL;
  rx->payload_len = 0;
  rx->payload_have = 0;
  rx->hdr_have = 0;
}

static void close_fd_array(const int *fds, int n) {
  for (int i = 0; i < n; i++)
    if (fds[i] >= 0)
      close(fds[i]);
}

/* Walks msg's control data: keeps up to max SCM_RIGHTS fds in got (returns how many), closes
 * every other fd (pidfds nobody asked for, fds past max) and counts the SCM_RIGHTS ones closed
 * in *extra. No fd that arrived is left unaccounted for. */
static int take_fds(struct msghdr *msg, int *got, int max, int *extra, void (*close_fd)(void *, int), void *arg) {
  int ngot = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
    size_t bytes;
    if (c->cmsg_level != SOL_SOCKET)
      continue;
    if (c->cmsg_type != SCM_RIGHTS && c->cmsg_type != SCM_PIDFD)
      continue; /* SCM_CREDENTIALS and the like hold no resources */
    bytes = c->cmsg_len > CMSG_LEN(0) ? c->cmsg_len - CMSG_LEN(0) : 0;
    for (size_t k = 0; k + sizeof(int) <= bytes; k += sizeof(int)) {
      int fd;
      memcpy(&fd, CMSG_DATA(c) + k, sizeof fd);
      if (c->cmsg_type == SCM_RIGHTS && ngot < max) {
        got[ngot++] = fd;
      } else {
        if (c->cmsg_type == SCM_RIGHTS)
          (*extra)++;
        if (close_fd)
          close_fd(arg, fd);
        else
          close(fd);
      }
    }
  }
  return ngot;
}

/* rx_step's result when the socket would block (errno values and GPUPOOL_E* codes overlap, so
 * this is neither: a positive value). */
#define RX_WOULD_BLOCK 1

/* Receive up to want bytes into dst, collecting fds into rx. Returns 0 with *got the bytes
 * read (0 on EOF), RX_WOULD_BLOCK, or a negative GPUPOOL_E* code. On a protocol error every
 * fd received by this call has been closed. */
static int rx_step(gpupool__wire_rx *rx, int sock, uint8_t *dst, size_t want, size_t *got_bytes) {
  struct iovec iov = {.iov_base = dst, .iov_len = want};
  struct msghdr msg;
  ctrl_buf ctrl;
  int got[GPUPOOL_WIRE_MAX_FDS];
  int ngot = 0, extra = 0;
  ssize_t n;

  for (;;) {
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl.buf;
    msg.msg_controllen = sizeof ctrl.buf;
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n >= 0)
      break;
    if (errno == EINTR)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return RX_WOULD_BLOCK;
    if (errno == ECONNRESET)
      return gpupool__err(GPUPOOL_ECLOSED, "peer reset the connection");
    return gpupool__err(GPUPOOL_EIO, "recvmsg on the gpupool socket failed: %s",
                        strerror(errno));
  }

  ngot = take_fds(&msg, got, GPUPOOL_WIRE_MAX_FDS, &extra, NULL, NULL);

  if (msg.msg_flags & MSG_CTRUNC) {
    close_fd_array(got, ngot);
    return gpupool__err(GPUPOOL_EPROTO,
                        "control data truncated: the peer sent more than %d fds with one "
                        "frame (or extra control messages); it must send at most %d",
                        GPUPOOL_WIRE_MAX_FDS, GPUPOOL_WIRE_MAX_FDS);
  }
  if (extra > 0 || rx->nfds + ngot > GPUPOOL_WIRE_MAX_FDS) {
    int total = rx->nfds + ngot + extra;
    close_fd_array(got, ngot);
    return gpupool__err(GPUPOOL_EPROTO,
                        "frame carries %d fds; a frame may carry at most %d", total,
                        GPUPOOL_WIRE_MAX_FDS);
  }
  for (int i = 0; i < ngot; i++)
    rx->fds[rx->nfds++] = got[i];
  *got_bytes = (size_t)n;
  return 0;
}

int gpupool__wire_rx_read(gpupool__wire_rx *rx, int sock) {
  size_t n = 0;
  int rc;

  if (rx->max_frame == 0)
    return gpupool__err(GPUPOOL_EINVAL, "receiver not initialised (gpupool__wire_rx_init)");

  while (rx->hdr_have < GPUPOOL_WIRE_HDR) {
    rc = rx_step(rx, sock, rx->hdr + rx->hdr_have, GPUPOOL_WIRE_HDR - rx->hdr_have, &n);
    if (rc == RX_WOULD_BLOCK)
      return 0;
    if (rc < 0)
      goto fail;
    if (n == 0) {
      if (rx->hdr_have == 0 && rx->nfds == 0)
        return gpupool__err(GPUPOOL_ECLOSED, "peer closed the connection");
      rc = gpupool__err(GPUPOOL_EPROTO, "peer closed the connection after %u of %d header bytes",
                        rx->hdr_have, GPUPOOL_WIRE_HDR);
      goto fail;
    }
    rx->hdr_have += (uint32_t)n;
    if (rx->hdr_have < GPUPOOL_WIRE_HDR)
      continue;
    rx->payload_len = get_le32(rx->hdr);
    rx->payload_have = 0;
    if (rx->payload_len > rx->max_frame) {
      rx->refused_len = rx->payload_len;
      rc = gpupool__err(GPUPOOL_EPROTO,
                        "frame of %u bytes exceeds the limit of %u bytes; the peer must send "
                        "smaller messages (or the receiver's frame limit must be raised)",
                        rx->payload_len, rx->max_frame);
      goto fail;
    }
    if (rx->payload_len > 0) {
      rx->payload = malloc(rx->payload_len);
      if (rx->payload == NULL) {
        rc = gpupool__err(GPUPOOL_ENOMEM, "cannot allocate %u bytes for a frame",
                          rx->payload_len);
        goto fail;
      }
    }
  }

  while (rx->payload_have < rx->payload_len) {
    rc = rx_step(rx, sock, rx->payload + rx->payload_have, rx->payload_len - rx->payload_have, &n);
    if (rc == RX_WOULD_BLOCK)
      return 0;
    if (rc < 0)
      goto fail;
    if (n == 0) {
      rc = gpupool__err(GPUPOOL_EPROTO,
                        "peer closed the connection after %u of %u payload bytes",
                        rx->payload_have, rx->payload_len);
      goto fail;
    }
    rx->payload_have += (uint32_t)n;
  }
  return 1;

fail:
  /* The stream cannot be resynchronised after any of these: drop what the frame held so
   * nothing leaks whether or not the caller resets. */
  gpupool__wire_rx_reset(rx);
  return rc;
}

static int rx_complete(const gpupool__wire_rx *rx) {
  return rx != NULL && rx->hdr_have == GPUPOOL_WIRE_HDR && rx->payload_have == rx->payload_len;
}

/* protobuf-c may read data even for a zero length; give it a valid pointer. */
static const uint8_t empty_payload[1];

gpupool__req *gpupool__wire_unpack_request(const gpupool__wire_rx *rx) {
  if (!rx_complete(rx))
    return NULL;
  return gpupool__wire__request__unpack(NULL, rx->payload_len,
                                        rx->payload ? rx->payload : empty_payload);
}

gpupool__rep *gpupool__wire_unpack_reply(const gpupool__wire_rx *rx) {
  if (!rx_complete(rx))
    return NULL;
  return gpupool__wire__reply__unpack(NULL, rx->payload_len,
                                      rx->payload ? rx->payload : empty_payload);
}

const char *gpupool__wire_backend_name(int kind) {
  switch (kind) {
  case GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST:
    return "host";
  case GPUPOOL__WIRE__BACKEND_KIND__BACKEND_CUDA:
    return "cuda";
  default:
    return "unknown";
  }
}

const char *gpupool__wire_location_name(int kind) {
  switch (kind) {
  case GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST:
    return "host";
  case GPUPOOL__WIRE__LOCATION_KIND__LOCATION_DEVICE:
    return "device";
  case GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST_NUMA:
    return "host-numa";
  default:
    return "unknown";
  }
}

/* ---- buffered receiver (daemon) ------------------------------------------------------------- */

#define INBUF_MIN (64u << 10)

void gpupool__wire_inbuf_init(gpupool__wire_inbuf *b, uint32_t max_frame) {
  memset(b, 0, sizeof *b);
  if (max_frame == 0)
    max_frame = GPUPOOL_WIRE_DEFAULT_MAX_FRAME;
  b->max_frame = max_frame > GPUPOOL_WIRE_HARD_MAX_FRAME ? GPUPOOL_WIRE_HARD_MAX_FRAME : max_frame;
}

static void inbuf_close_fds(const gpupool__wire_inbuf *b, const int *fds, int n) {
  if (!b->close_fd) {
    close_fd_array(fds, n);
    return;
  }
  for (int i = 0; i < n; i++)
    if (fds[i] >= 0)
      b->close_fd(b->close_arg, fds[i]);
}

/* Close the fds of the frame handed out last that the caller did not take. */
static void inbuf_drop_frame_fds(gpupool__wire_inbuf *b) {
  inbuf_close_fds(b, b->frame_fds, b->nframe_fds);
  b->nframe_fds = 0;
}

static void inbuf_drop_fds(gpupool__wire_inbuf *b) {
  inbuf_close_fds(b, b->fds, b->nfds);
  b->nfds = 0;
  inbuf_drop_frame_fds(b);
}

int gpupool__wire_inbuf_frame_nfds(const gpupool__wire_inbuf *b) { return b->nframe_fds; }

int gpupool__wire_inbuf_take_fd(gpupool__wire_inbuf *b) {
  for (int i = 0; i < b->nframe_fds; i++)
    if (b->frame_fds[i] >= 0) {
      int fd = b->frame_fds[i];
      b->frame_fds[i] = -1;
      return fd;
    }
  return -1;
}

/* Where the last frame starting in [from, b->len) starts (frames are walked from b->off,
 * always a frame start), or SIZE_MAX when none does. */
static size_t inbuf_last_start(const gpupool__wire_inbuf *b, size_t from) {
  size_t pos = b->off, last = SIZE_MAX;
  while (pos < b->len) {
    uint32_t n;
    if (pos >= from)
      last = pos;
    if (b->len - pos < GPUPOOL_WIRE_HDR)
      break;
    n = get_le32(b->buf + pos);
    if (n > b->max_frame)
      break; /* inbuf_next refuses it */
    pos += GPUPOOL_WIRE_HDR + (size_t)n;
  }
  return last;
}

void gpupool__wire_inbuf_free(gpupool__wire_inbuf *b) {
  inbuf_drop_fds(b);
  free(b->buf);
  b->buf = NULL;
  b->len = b->off = b->cap = 0;
}


/* Room for at least `need` more bytes after the held ones (frames already handed out are
 * dropped first). */
static int inbuf_reserve(gpupool__wire_inbuf *b, size_t need) {
  size_t ncap;
  uint8_t *n;
  if (b->off > 0) {
    memmove(b->buf, b->buf + b->off, b->len - b->off);
    b->len -= b->off;
    if (b->nfds)
      b->fd_pos -= b->off; /* a waiting group's frame is never one already handed out */
    b->off = 0;
  }
  if (b->cap - b->len >= need)
    return 0;
  ncap = b->cap ? b->cap : INBUF_MIN;
  while (ncap - b->len < need)
    ncap *= 2;
  /* Never more than one frame (header and largest payload) unless a single need is larger
   * (it is not: a partial frame needs at most the rest of itself). */
  if (ncap > (size_t)b->max_frame + GPUPOOL_WIRE_HDR && b->len + need <= (size_t)b->max_frame + GPUPOOL_WIRE_HDR)
    ncap = (size_t)b->max_frame + GPUPOOL_WIRE_HDR;
  n = realloc(b->buf, ncap);
  if (!n)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a receive buffer of %zu bytes", ncap);
  b->buf = n;
  b->cap = ncap;
  return 0;
}

int gpupool__wire_inbuf_fill(gpupool__wire_inbuf *b, int sock, size_t max, int *fds_closed) {
  struct iovec iov;
  struct msghdr msg;
  ctrl_buf ctrl;
  size_t need = 4096, start;
  int got[GPUPOOL_WIRE_MAX_FDS];
  int ngot, extra = 0;
  ssize_t n;
  int rc;

  *fds_closed = 0;
  if (max == 0)
    max = 1; /* a recvmsg of 0 bytes would read as end of stream */
  inbuf_drop_frame_fds(b);
  /* A partial frame needs room for all of it (its size was checked by inbuf_next). */
  if (b->len - b->off >= GPUPOOL_WIRE_HDR) {
    size_t want = GPUPOOL_WIRE_HDR + (size_t)get_le32(b->buf + b->off);
    if (want <= (size_t)b->max_frame + GPUPOOL_WIRE_HDR && want > b->len - b->off)
      need = want - (b->len - b->off);
  }
  if ((rc = inbuf_reserve(b, need)) != 0)
    return rc;
  start = b->len;
  for (;;) {
    memset(&msg, 0, sizeof msg);
    iov.iov_base = b->buf + b->len;
    iov.iov_len = b->cap - b->len < max ? b->cap - b->len : max;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl.buf;
    msg.msg_controllen = sizeof ctrl.buf;
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n >= 0)
      break;
    if (errno == EINTR)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return 0;
    if (errno == ECONNRESET)
      return gpupool__err(GPUPOOL_ECLOSED, "peer reset the connection");
    return gpupool__err(GPUPOOL_EIO, "recvmsg on the gpupool socket failed: %s", strerror(errno));
  }
  ngot = take_fds(&msg, got, GPUPOOL_WIRE_MAX_FDS, &extra, b->close_fd, b->close_arg);
  *fds_closed = extra;
  if (msg.msg_flags & MSG_CTRUNC) {
    inbuf_close_fds(b, got, ngot);
    return gpupool__err(GPUPOOL_EPROTO,
                        "control data truncated: the peer sent more than %d fds with one frame", GPUPOOL_WIRE_MAX_FDS);
  }
  if (n == 0) {
    inbuf_close_fds(b, got, ngot);
    if (b->len == b->off)
      return gpupool__err(GPUPOOL_ECLOSED, "peer closed the connection");
    return gpupool__err(GPUPOOL_EPROTO, "peer closed the connection in the middle of a frame (%zu bytes of it received)",
                        b->len - b->off);
  }
  b->len += (size_t)n;
  if (ngot > 0) {
    /* They belong to the last frame that starts in what was just read. */
    size_t pos = extra || b->nfds ? SIZE_MAX : inbuf_last_start(b, start);
    if (pos == SIZE_MAX) {
      inbuf_close_fds(b, got, ngot);
      *fds_closed += ngot;
    } else {
      memcpy(b->fds, got, (size_t)ngot * sizeof *got);
      b->nfds = ngot;
      b->fd_pos = pos;
    }
  }
  return (int)(n > INT32_MAX ? INT32_MAX : n);
}

int gpupool__wire_inbuf_complete(const gpupool__wire_inbuf *b) {
  size_t have = b->len - b->off;
  uint32_t n;
  if (have < GPUPOOL_WIRE_HDR)
    return 0;
  n = get_le32(b->buf + b->off);
  return n > b->max_frame || have - GPUPOOL_WIRE_HDR >= n;
}

int gpupool__wire_inbuf_next(gpupool__wire_inbuf *b, const uint8_t **payload, uint32_t *len) {
  size_t have = b->len - b->off;
  uint32_t n;
  if (have < GPUPOOL_WIRE_HDR)
    return 0;
  n = get_le32(b->buf + b->off);
  if (n > b->max_frame)
    return gpupool__err(GPUPOOL_EPROTO,
                        "frame of %u bytes exceeds the limit of %u bytes; the peer must send smaller "
                        "requests (max_frame in the daemon's config)",
                        n, b->max_frame);
  if (have - GPUPOOL_WIRE_HDR < n)
    return 0;
  inbuf_drop_frame_fds(b);
  if (b->nfds && b->fd_pos <= b->off) {
    if (b->fd_pos == b->off) {
      memcpy(b->frame_fds, b->fds, (size_t)b->nfds * sizeof *b->fds);
      b->nframe_fds = b->nfds;
    } else {
      inbuf_close_fds(b, b->fds, b->nfds); /* cannot happen: fd_pos is always a frame start */
    }
    b->nfds = 0;
  }
  *payload = b->buf + b->off + GPUPOOL_WIRE_HDR;
  *len = n;
  b->off += GPUPOOL_WIRE_HDR + n;
  if (b->off == b->len)
    b->off = b->len = 0; /* everything handed out: next fill starts at the front */
  return 1;
}

/* ---- send queue ------------------------------------------------------------------------------ */

struct gpupool__wire_txframe {
  gpupool__wire_txframe *next;
  uint8_t *buf;
  size_t len, off;
  int fds[GPUPOOL_WIRE_MAX_FDS];
  int nfds;
};

void gpupool__wire_txq_init(gpupool__wire_txq *q) { memset(q, 0, sizeof *q); }

static void txframe_free(const gpupool__wire_txq *q, gpupool__wire_txframe *f) {
  for (int i = 0; i < f->nfds; i++)
    if (f->fds[i] < 0)
      continue;
    else if (q->close_fd)
      q->close_fd(q->close_arg, f->fds[i]);
    else
      close(f->fds[i]);
  free(f->buf);
  free(f);
}

static size_t txframe_cost(const gpupool__wire_txframe *f) { return sizeof *f + f->len; }

int gpupool__wire_txq_send(gpupool__wire_txq *q, int sock, uint8_t *buf, size_t len,
                           const int *fds, int nfds) {
  gpupool__wire_txframe *f;
  size_t off = 0;

  if (nfds < 0 || nfds > GPUPOOL_WIRE_MAX_FDS) {
    free(buf);
    return gpupool__err(GPUPOOL_EINVAL, "a frame carries at most %d fds", GPUPOOL_WIRE_MAX_FDS);
  }
  if (!q->head) {
    int rc = gpupool__wire_send_some(sock, buf, len, &off, fds, nfds);
    if (rc != 0) {
      free(buf);
      return rc; /* 1: all out; < 0: socket error */
    }
  }
  f = calloc(1, sizeof *f);
  if (!f) {
    free(buf);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory queueing a frame");
  }
  f->buf = buf;
  f->len = len;
  f->off = off;
  if (off == 0)
    for (int i = 0; i < nfds; i++) {
      f->fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
      if (f->fds[i] < 0) {
        int e = errno;
        f->nfds = i;
        txframe_free(q, f);
        return gpupool__err(GPUPOOL_EFD, "cannot duplicate an fd for a queued frame: %s", strerror(e));
      }
      f->nfds = i + 1;
    }
  if (q->tail)
    q->tail->next = f;
  else
    q->head = f;
  q->tail = f;
  q->bytes += len - off;
  q->cost += txframe_cost(f);
  return 0;
}

int gpupool__wire_txq_flush(gpupool__wire_txq *q, int sock) {
  while (q->head) {
    gpupool__wire_txframe *f = q->head;
    size_t before = f->off;
    int rc = gpupool__wire_send_some(sock, f->buf, f->len, &f->off, f->fds, f->off == 0 ? f->nfds : 0);
    q->bytes -= f->off - before;
    if (rc <= 0)
      return rc;
    q->head = f->next;
    if (!q->head)
      q->tail = NULL;
    q->cost -= txframe_cost(f);
    txframe_free(q, f);
  }
  return 1;
}

void gpupool__wire_txq_clear(gpupool__wire_txq *q) {
  while (q->head) {
    gpupool__wire_txframe *f = q->head;
    q->head = f->next;
    txframe_free(q, f);
  }
  {
    void (*close_fd)(void *, int) = q->close_fd;
    void *arg = q->close_arg;
    gpupool__wire_txq_init(q);
    q->close_fd = close_fd;
    q->close_arg = arg;
  }
}
