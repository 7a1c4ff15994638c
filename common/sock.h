/*
 * Reaching gpupoold as its peer (sock.c): connecting to its Unix socket, saying who owns a
 * socket that refused us, packing a request and reading a reply. Linked by the client library and gpupoolctl,
 * which word their own messages from what these return.
 */
#ifndef GPUPOOL_COMMON_SOCK_H
#define GPUPOOL_COMMON_SOCK_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t gpupool__mono_ns(void);

/* A close-on-exec stream socket connected to the Unix socket at path: the fd, or -errno of
 * what failed. timeout_ms > 0 bounds connect() and every later send and receive (SO_SNDTIMEO,
 * SO_RCVTIMEO); otherwise nothing is bounded. With busy_retry, a connect refused because the
 * listener's accept queue is full (EAGAIN) is tried again after a short backoff until
 * timeout_ms has passed (forever when < 0), since a place may open. *tries: how many connect()
 * calls were made (0: the socket itself could not be made, or path is too long). */
int gpupool__sock_connect(const char *path, int timeout_ms, int busy_retry, int *tries);

/* "owner root, group gpupool, mode 0660" of the socket at path (0); or, when something other
 * than a socket is there, what it is and the fix (1); or why it cannot be seen (-1). A
 * buffer of GPUPOOL__SOCK_DESCRIBE_MAX bytes holds every text whole. */
#define GPUPOOL__SOCK_DESCRIBE_MAX 512
int gpupool__sock_describe(const char *path, char *buf, size_t len);

/* What a socket that answered Hello with no gpupool frame sent, from rx after the read
 * failed: its first bytes when they were refused as a frame header ("it began with
 * \"HTTP\""), else the read's own error, read_error (the caller took it from the failed
 * read). Into buf, cut to len. */
void gpupool__sock_foreign(const gpupool__wire_rx *rx, const char *read_error, char *buf, size_t len);

/* The name of the group owning path (its number when it has no name): 0, or -1 when path
 * cannot be seen. For "usermod -aG <group> $USER". */
int gpupool__sock_group(const char *path, char *buf, size_t len);

/* req packed into a frame (*buf, the caller frees it; *len bytes). max_frame > 0: the daemon's
 * frame cap, checked here (GPUPOOL_ETOOBIG) so that an oversized request is refused before it
 * goes out. 0 or a negative error code. */
int gpupool__sock_pack_request(gpupool__req *req, uint32_t max_frame, uint8_t **buf, size_t *len);

/* Read one reply frame from fd into rx: what gpupool__wire_rx_read returns (1 a frame, 0 timed
 * out, or a negative error code); with a frame, *rep is it unpacked (the caller frees it), or
 * NULL when it does not decode. */
int gpupool__sock_read_reply(gpupool__wire_rx *rx, int fd, gpupool__rep **rep);

#endif
