/*
 * Raw frames as a client (or a fake daemon) the library would never be puts them on a
 * socket: length prefix + packed protobuf through the wire module, fds riding in the same
 * sendmsg (SCM_RIGHTS). Used by the hostile integration tests, the fuzz corpus writer and
 * the benchmarks; no test framework here, so children use it too.
 */
#ifndef GPUPOOL_TESTS_SUPPORT_FRAMES_H
#define GPUPOOL_TESTS_SUPPORT_FRAMES_H

#include <stdint.h>

#include "wire.h"

/* A connected socket with a receive timeout of timeout_s, or -1. */
int ts_raw_connect(const char *path, int timeout_s);
/* Pack and send req with fds (may be NULL/0): 0 or a GPUPOOL_E* code. */
int ts_raw_send(int fd, gpupool__req *req, const int *fds, int nfds);
/* The same for a reply (the fake daemon's side). */
int ts_raw_send_reply(int fd, gpupool__rep *rep, const int *fds, int nfds);
/* Send a Stats request (the one with no fields) numbered seq, with fds: as ts_raw_send. */
int ts_raw_send_stats(int fd, uint64_t seq, const int *fds, int nfds);
/* Next reply, or NULL at end of connection (or after the receive timeout). */
gpupool__rep *ts_raw_recv(int fd);

/* req becomes Request seq 1 holding h, a Hello of protocol version, name and pid. */
void ts_hello(gpupool__req *req, Gpupool__Wire__Hello *h, uint32_t version, const char *name, int32_t pid);
/* Send a current-version Hello (as ts_hello) and read its reply: 0 when it is a HelloReply
 * without error, else -1. */
int ts_raw_hello(int fd, const char *name, int32_t pid);
/* Connect (as ts_raw_connect) and say Hello (as ts_raw_hello): the socket, or -1. */
int ts_raw_session(const char *path, int timeout_s, const char *name, int32_t pid);
/* Pool 1 "default" of the host backend in host memory, no device, of capacity bytes. */
void ts_host_pool_info(Gpupool__Wire__PoolInfo *p, uint64_t capacity);
/* t describes a dense tensor of ndim dimensions (shape, which t points to, not copies) of
 * one-lane elements of dtype code and bits; no strides, offset 0. */
void ts_tensor_meta(Gpupool__Wire__TensorMeta *t, uint32_t code, uint32_t bits, size_t ndim, int64_t *shape);

#endif
