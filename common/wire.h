/*
 * The one wire module both sides link: frame = 4-byte little-endian payload length, then a
 * packed protobuf-c message (Request client->daemon, Reply daemon->client). File descriptors
 * travel with SCM_RIGHTS on the first byte of the frame that names them.
 *
 * Receiving reads exactly one frame at a time (header, then payload), so every fd that
 * arrives belongs to the frame being read. A frame over the receiver's cap is refused before
 * any payload is read or unpacked; MSG_CTRUNC and more than GPUPOOL_WIRE_MAX_FDS fds are
 * protocol errors; fds are received close-on-exec and the receiver closes all it does not
 * take.
 */
#ifndef GPUPOOL_COMMON_WIRE_H
#define GPUPOOL_COMMON_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "gpupool.pb-c.h"
#include "gpupool/gpupool.h"

#define GPUPOOL_WIRE_HDR 4
#define GPUPOOL_WIRE_MAX_FDS 16
/* Default and hard limits on a frame's payload. */
#define GPUPOOL_WIRE_DEFAULT_MAX_FRAME (1u << 20)
#define GPUPOOL_WIRE_HARD_MAX_FRAME (64u << 20)

typedef Gpupool__Wire__Request gpupool__req;
typedef Gpupool__Wire__Reply gpupool__rep;

/* Pack a message into a new malloc'd frame (header included). Returns 0 or GPUPOOL_ENOMEM /
 * GPUPOOL_ETOOBIG (payload over GPUPOOL_WIRE_HARD_MAX_FRAME). The caller frees *buf. */
int gpupool__wire_pack_request(const gpupool__req *m, uint8_t **buf, size_t *len);
int gpupool__wire_pack_reply(const gpupool__rep *m, uint8_t **buf, size_t *len);

/* Blocking send of a whole frame, fds (may be NULL/0) attached to its first byte. Retries
 * on EINTR and partial writes; never raises SIGPIPE (MSG_NOSIGNAL). 0 or GPUPOOL_EIO /
 * GPUPOOL_ECLOSED. */
int gpupool__wire_send(int sock, const uint8_t *buf, size_t len, const int *fds, int nfds);

/* Nonblocking send step for the daemon: writes from buf+*off; attaches fds only when *off
 * is 0. Returns 1 when the whole frame is out, 0 when the socket would block (call again
 * when writable), or GPUPOOL_EIO / GPUPOOL_ECLOSED. */
int gpupool__wire_send_some(int sock, const uint8_t *buf, size_t len, size_t *off,
                            const int *fds, int nfds);

/* The most fds gpupool__wire_sendmsg attaches: more than a frame may carry, so that tests
 * and fuzzers can send what a well-behaved peer never would. */
#define GPUPOOL__WIRE_SENDMSG_MAX_FDS 32
/* One sendmsg of buf[0..len) with nfds fds (may be NULL/0) as SCM_RIGHTS, retried on EINTR,
 * MSG_NOSIGNAL added to flags; none of the checks of the frame senders above. Returns the
 * bytes sent, or -errno (-EINVAL for more than GPUPOOL__WIRE_SENDMSG_MAX_FDS fds). */
ssize_t gpupool__wire_sendmsg(int sock, const void *buf, size_t len, const int *fds, int nfds,
                              int flags);

/* Send queue for a nonblocking socket: frames that did not fit in the socket wait here, in
 * order, with duplicates of the fds their first byte carries (the originals stay the
 * caller's). `cost` counts what the queue really holds on the heap (frames, their headers and
 * bookkeeping), so a limit on it bounds the memory a peer that never reads can cost. */
typedef struct gpupool__wire_txframe gpupool__wire_txframe;
typedef struct {
  gpupool__wire_txframe *head, *tail;
  size_t bytes; /* frame bytes not yet written */
  size_t cost;  /* heap bytes held by the queue */
  void (*close_fd)(void *arg, int fd); /* as gpupool__wire_inbuf's; kept by clear */
  void *close_arg;
} gpupool__wire_txq;

void gpupool__wire_txq_init(gpupool__wire_txq *q);
/* Send a packed frame, or queue what the socket does not take now. Takes buf (freed here in
 * every case). 1 when all of it went out, 0 when (some of) it was queued, or GPUPOOL_EIO /
 * GPUPOOL_ECLOSED (socket error), GPUPOOL_ENOMEM, GPUPOOL_EFD (an fd could not be
 * duplicated). */
int gpupool__wire_txq_send(gpupool__wire_txq *q, int sock, uint8_t *buf, size_t len,
                           const int *fds, int nfds);
/* Write queued frames: 1 when the queue is empty, 0 when the socket would block, or an error
 * as above. */
int gpupool__wire_txq_flush(gpupool__wire_txq *q, int sock);
/* Drop every queued frame (closing their fds). */
void gpupool__wire_txq_clear(gpupool__wire_txq *q);

/* Incremental receiver of one frame at a time. */
typedef struct {
  uint8_t hdr[GPUPOOL_WIRE_HDR];
  uint32_t hdr_have;
  uint8_t *payload;     /* malloc'd, payload_len bytes once the header is in */
  uint32_t payload_len;
  uint32_t payload_have;
  uint32_t max_frame;   /* cap on payload_len */
  int fds[GPUPOOL_WIRE_MAX_FDS];
  int nfds;
  /* The length an oversized header claimed (0: none was refused); hdr keeps its bytes, so a
   * caller can say what a peer that is no gpupool peer sent. */
  uint32_t refused_len;
} gpupool__wire_rx;

void gpupool__wire_rx_init(gpupool__wire_rx *rx, uint32_t max_frame);
/* Close held fds and free the payload. */
void gpupool__wire_rx_reset(gpupool__wire_rx *rx);

/* Read from sock. Returns 1 when a whole frame is in rx (payload/payload_len/fds), 0 when
 * the socket would block (nonblocking) before that, or a negative code: GPUPOOL_ECLOSED on
 * EOF at a frame boundary, GPUPOOL_EPROTO on EOF mid-frame, an oversized frame (the message
 * says its size and the cap), MSG_CTRUNC or too many fds, GPUPOOL_EIO on a socket error.
 * On a blocking socket it returns only 1 or an error. After handling a frame (taking the fds
 * it wants by setting their slots to -1), call gpupool__wire_rx_reset(). */
int gpupool__wire_rx_read(gpupool__wire_rx *rx, int sock);

/* Unpack helpers over rx's payload; NULL on malformed input. Free with the protobuf-c
 * free_unpacked functions. */
gpupool__req *gpupool__wire_unpack_request(const gpupool__wire_rx *rx);
gpupool__rep *gpupool__wire_unpack_reply(const gpupool__wire_rx *rx);

/* Buffered receiver for the daemon: one recvmsg takes whatever frames are waiting, up to the
 * caller's byte budget (a client pipelining requests costs one system call, not two per
 * frame), and complete frames are then handed out in order.
 *
 * fds: a Unix stream recvmsg stops after the segment that carried fds, and a well-behaved
 * sender attaches them to the first byte of their frame (one sendmsg per frame), so the fds
 * a fill brings belong to the last frame that starts among the bytes it read. They are kept
 * with that frame's position and handed out with it (gpupool__wire_inbuf_take_fd); fds that
 * no frame can own (no frame starts in those bytes, or a previous group is still waiting for
 * its frame) are closed at once and counted, so the caller can refuse the next frame. */
typedef struct {
  uint8_t *buf;
  size_t len;         /* bytes held, starting at buf */
  size_t off;         /* start of the first frame not yet handed out */
  size_t cap;
  uint32_t max_frame;
  int fds[GPUPOOL_WIRE_MAX_FDS]; /* fds waiting for the frame that starts at fd_pos */
  int nfds;
  size_t fd_pos;
  int frame_fds[GPUPOOL_WIRE_MAX_FDS]; /* fds of the frame last handed out (-1 once taken) */
  int nframe_fds;
  /* Closes the fds it drops, when set (the daemon closes a client's fds off its loop: a close
   * can wait on the file's file system); else close(). Set after init. */
  void (*close_fd)(void *arg, int fd);
  void *close_arg;
} gpupool__wire_inbuf;

void gpupool__wire_inbuf_init(gpupool__wire_inbuf *b, uint32_t max_frame);
void gpupool__wire_inbuf_free(gpupool__wire_inbuf *b);
/* One recvmsg of what is available, at most max bytes (at least 1): the daemon reads a
 * connection a budget at a time, so a big frame is taken in over several turns of its sender
 * instead of in one gulp ahead of everyone else. > 0 bytes read; 0 when the socket would block;
 * GPUPOOL_ECLOSED on EOF at a frame boundary; GPUPOOL_EPROTO on EOF inside a frame or
 * truncated control data (with a message); GPUPOOL_EIO / GPUPOOL_ENOMEM. *fds_closed counts
 * the fds that came with the bytes and that no frame could own (closed). */
int gpupool__wire_inbuf_fill(gpupool__wire_inbuf *b, int sock, size_t max, int *fds_closed);
/* 1 when inbuf_next has something to say without reading: a complete frame, or a header over
 * max_frame (its refusal). */
int gpupool__wire_inbuf_complete(const gpupool__wire_inbuf *b);
/* Next complete frame: 1 with payload and len pointing into the buffer (valid until the next
 * fill); 0 when none is complete yet; GPUPOOL_EPROTO when the next frame exceeds max_frame
 * (checked on its header, before any payload is read). */
int gpupool__wire_inbuf_next(gpupool__wire_inbuf *b, const uint8_t **payload, uint32_t *len);
/* The fds that came with the frame inbuf_next last handed out: how many, and the first one
 * not yet taken (the caller then owns it), or -1. Those not taken are closed by the next
 * inbuf_next, fill or free. */
int gpupool__wire_inbuf_frame_nfds(const gpupool__wire_inbuf *b);
int gpupool__wire_inbuf_take_fd(gpupool__wire_inbuf *b);

/* Most fields one frame may carry that the receiver does not know (counted over nested
 * messages too). A newer peer adds a few fields; old ones skip them. Nothing in the protocol
 * depends on more: features are agreed in Hello/HelloReply (HelloReply.host_fences), not by
 * sending fields and seeing what sticks. */
#define GPUPOOL_WIRE_MAX_UNKNOWN_FIELDS 64

typedef struct {
  uint64_t seq;  /* the message's top-level field 1 if it was read (Request.seq, Reply.seq), else 0 */
  int malformed; /* the bytes are no protobuf encoding of the message (as opposed to refused) */
} gpupool__wire_verdict;

/* One linear pass over a packed message of type d, allocating nothing, before unpacking it:
 * 0, or GPUPOOL_EPROTO (malformed: v->malformed set; or more than
 * GPUPOOL_WIRE_MAX_UNKNOWN_FIELDS unknown fields) or GPUPOOL_EINVAL (a string field holds a
 * NUL or is not UTF-8), each with a message naming the field ("Request.publish.name"). What
 * it accepts, protobuf-c unpacks; v->seq lets the refusal answer the request it refuses. */
int gpupool__wire_validate(const ProtobufCMessageDescriptor *d, const uint8_t *buf, size_t len,
                           gpupool__wire_verdict *v);

/* Whether s[0..n) is UTF-8 (strict: no overlong forms, surrogates or code points past
 * U+10FFFF) without NUL: 0, else GPUPOOL__WIRE_UTF8_NUL or GPUPOOL__WIRE_UTF8_INVALID with
 * *bad the offset of the offending byte. */
#define GPUPOOL__WIRE_UTF8_NUL 1
#define GPUPOOL__WIRE_UTF8_INVALID 2
int gpupool__wire_utf8_check(const uint8_t *s, size_t n, size_t *bad);

/* Tensor metadata from the wire, checked: ranks, strides, dtype range, and a span (offset
 * included, overflow-checked) within size bytes. GPUPOOL_EMETA with a message otherwise. */
int gpupool__wire_meta_from(const Gpupool__Wire__TensorMeta *w, uint64_t size, gpupool_tensor_meta *m);
/* Only the conversion: what has a C form (ranks, strides, dtype range), unchecked otherwise. */
int gpupool__wire_meta_convert(const Gpupool__Wire__TensorMeta *w, gpupool_tensor_meta *m);
/* The same checks on a C struct (what gpupool__wire_meta_from ends with). */
int gpupool__wire_meta_check(const gpupool_tensor_meta *m, uint64_t size);
/* Fill w from m; w points into m's arrays, so m must outlive w's packing. */
void gpupool__wire_meta_to(const gpupool_tensor_meta *m, Gpupool__Wire__TensorMeta *w);
/* Memory kinds <-> LocationKind. The reverse refuses an unknown value with GPUPOOL_EPROTO. */
int gpupool__wire_location(gpupool_mem_kind k);
int gpupool__wire_mem_kind(int location, gpupool_mem_kind *out);

/* 1 when a Publish sets field 5 or 6 (share_gid, share_all: reserved, no client sends them
 * any more), which protobuf-c keeps as unknown fields: an old client asking to publish to
 * other users, which the daemon refuses. */
int gpupool__wire_publish_shares(const Gpupool__Wire__Publish *m);

/* A published name or a bundle member's name: 1..GPUPOOL_NAME_MAX bytes of UTF-8, no control
 * characters. GPUPOOL_ENAME with a message otherwise. The one check of names: the client
 * library runs it before sending (so the caller hears of a bad name at once), the daemon on
 * every name it is sent. */
int gpupool__wire_check_name(const char *name);
/* The same check of a name whose bytes are already known to be UTF-8 without NUL (the
 * daemon's frame validator checked every string of the request): the length and control
 * characters, with the same messages, without a second pass over the UTF-8. */
int gpupool__wire_check_utf8_name(const char *name);

/* Names of the wire enums as shown to people and in metrics ("host", "cuda", "device", ...). */
const char *gpupool__wire_backend_name(int kind);
const char *gpupool__wire_location_name(int kind);

#endif
