/*
 * Unit tests of the wire module over real AF_UNIX stream socketpairs: message round trips,
 * fd passing (fds must arrive usable, in the frame that carried them, close-on-exec),
 * framing under tiny writes and large partial writes, and every refusal the receiver makes
 * (oversized length, EOF mid-frame, MSG_CTRUNC, too many fds, garbage payloads) without
 * leaking a single fd.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "errors.h"
#include "wire.h"

/* --- helpers ---------------------------------------------------------------------------------- */

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  int n = 0;

  assert_non_null(d);
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

static void pair(int sv[2]) { assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0); }

/* Close both ends of a pair and check that no fd is left over from the test (base: the
 * count before it). */
static void close_pair(int sv[2], int base) {
  close(sv[0]);
  close(sv[1]);
  assert_int_equal(count_fds(), base);
}

static void set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  assert_true(fl >= 0);
  assert_int_equal(fcntl(fd, F_SETFL, fl | O_NONBLOCK), 0);
}

static int memfd_with(const char *text) {
  int fd = memfd_create("wire-test", MFD_CLOEXEC);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
  return fd;
}

/* Read the whole content of a memfd from offset 0 into buf (NUL-terminated). */
static void memfd_read(int fd, char *buf, size_t len) {
  ssize_t n = pread(fd, buf, len - 1, 0);
  assert_true(n >= 0);
  buf[n] = '\0';
}

static void write_all(int fd, const void *p, size_t len) {
  const uint8_t *b = p;
  while (len > 0) {
    ssize_t n = write(fd, b, len);
    if (n < 0 && errno == EINTR)
      continue;
    assert_true(n > 0);
    b += n;
    len -= (size_t)n;
  }
}

/* sendmsg with nfds fds on buf, bypassing the wire module's limits. */
static ssize_t raw_send(int sock, const void *buf, size_t len, const int *fds, int nfds) {
  return gpupool__wire_sendmsg(sock, buf, len, fds, nfds, 0);
}

static void le32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

/* A Hello request with the given seq and client name, packed into a frame. */
static void pack_hello(uint64_t seq, const char *name, uint8_t **buf, size_t *len) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Hello hello = GPUPOOL__WIRE__HELLO__INIT;

  hello.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  hello.client_name = (char *)name;
  hello.pid = (int32_t)getpid();
  req.seq = seq;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  req.hello = &hello;
  assert_int_equal(gpupool__wire_pack_request(&req, buf, len), 0);
}

static void send_hello(int sock, uint64_t seq, const char *name, const int *fds, int nfds) {
  uint8_t *buf;
  size_t len;

  pack_hello(seq, name, &buf, &len);
  assert_int_equal(gpupool__wire_send(sock, buf, len, fds, nfds), 0);
  free(buf);
}

/* Receive one Hello frame (blocking) and check its seq, name and sender pid; the frame's fds
 * stay in rx. */
static void recv_hello_from(gpupool__wire_rx *rx, int sock, uint64_t seq, const char *name,
                            pid_t sender) {
  gpupool__req *req;

  assert_int_equal(gpupool__wire_rx_read(rx, sock), 1);
  req = gpupool__wire_unpack_request(rx);
  assert_non_null(req);
  assert_int_equal(req->seq, seq);
  assert_int_equal(req->body_case, GPUPOOL__WIRE__REQUEST__BODY_HELLO);
  assert_string_equal(req->hello->client_name, name);
  assert_int_equal(req->hello->pid, sender);
  gpupool__wire__request__free_unpacked(req, NULL);
}

static void recv_hello(gpupool__wire_rx *rx, int sock, uint64_t seq, const char *name) {
  recv_hello_from(rx, sock, seq, name, getpid());
}

static int wait_child(pid_t pid) {
  int st;
  while (waitpid(pid, &st, 0) < 0)
    assert_int_equal(errno, EINTR);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* --- round trips ------------------------------------------------------------------------------ */

static void test_request_roundtrip(void **state) {
  int sv[2], base = count_fds();
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT, *got;
  Gpupool__Wire__Allocate al = GPUPOOL__WIRE__ALLOCATE__INIT;
  uint64_t unmapped[] = {7, 1ull << 40, UINT64_MAX};
  gpupool__wire_rx rx;
  uint8_t *buf;
  size_t len;

  pair(sv);
  al.pool_name = "gpu0";
  al.size = 123456789012ull;
  al.alignment = 256;
  al.timeout_ms = 5000;
  req.seq = 42;
  req.n_unmapped_slabs = 3;
  req.unmapped_slabs = unmapped;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  req.allocate = &al;
  assert_int_equal(gpupool__wire_pack_request(&req, &buf, &len), 0);
  assert_int_equal(len, GPUPOOL_WIRE_HDR + gpupool__wire__request__get_packed_size(&req));
  assert_int_equal(buf[0] | buf[1] << 8 | buf[2] << 16 | (uint32_t)buf[3] << 24,
                   len - GPUPOOL_WIRE_HDR);
  assert_int_equal(gpupool__wire_send(sv[0], buf, len, NULL, 0), 0);
  free(buf);

  gpupool__wire_rx_init(&rx, 0);
  assert_int_equal(rx.max_frame, GPUPOOL_WIRE_DEFAULT_MAX_FRAME);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 1);
  assert_int_equal(rx.nfds, 0);
  got = gpupool__wire_unpack_request(&rx);
  assert_non_null(got);
  assert_int_equal(got->seq, 42);
  assert_int_equal(got->n_unmapped_slabs, 3);
  assert_memory_equal(got->unmapped_slabs, unmapped, sizeof unmapped);
  assert_int_equal(got->body_case, GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE);
  assert_string_equal(got->allocate->pool_name, "gpu0");
  assert_int_equal(got->allocate->size, 123456789012ull);
  assert_int_equal(got->allocate->alignment, 256);
  assert_int_equal(got->allocate->timeout_ms, 5000);
  gpupool__wire__request__free_unpacked(got, NULL);
  gpupool__wire_rx_reset(&rx);

  close_pair(sv, base);
}

static void test_reply_roundtrip(void **state) {
  int sv[2];
  gpupool__rep rep = GPUPOOL__WIRE__REPLY__INIT, *got;
  Gpupool__Wire__HelloReply hr = GPUPOOL__WIRE__HELLO_REPLY__INIT;
  Gpupool__Wire__PoolInfo p0 = GPUPOOL__WIRE__POOL_INFO__INIT, p1 = GPUPOOL__WIRE__POOL_INFO__INIT;
  Gpupool__Wire__PoolInfo *pools[2] = {&p0, &p1};
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  uint64_t revoke[] = {3, 9};
  gpupool__wire_rx rx;
  uint8_t *buf;
  size_t len;

  pair(sv);
  p0.id = 1;
  p0.name = "default";
  p0.backend = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST;
  p0.device = -1;
  p0.capacity = 1ull << 34;
  p1.id = 2;
  p1.name = "gpu1";
  p1.backend = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_CUDA;
  p1.device = 1;
  p1.used_high = 77;
  hr.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  hr.daemon_version = "0.1.0";
  hr.n_pools = 2;
  hr.pools = pools;
  hr.client_id = 99;
  hr.max_frame = GPUPOOL_WIRE_DEFAULT_MAX_FRAME;
  rep.seq = 5;
  rep.n_revoke_slabs = 2;
  rep.revoke_slabs = revoke;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_HELLO;
  rep.hello = &hr;
  assert_int_equal(gpupool__wire_pack_reply(&rep, &buf, &len), 0);
  assert_int_equal(gpupool__wire_send(sv[1], buf, len, NULL, 0), 0);
  free(buf);

  /* An error reply right behind it. */
  memset(&rep, 0, sizeof rep);
  gpupool__wire__reply__init(&rep);
  err.code = GPUPOOL_ENOSPC;
  err.message = "pool default is full: asked 10 bytes, 0 free";
  rep.seq = 6;
  rep.error = &err;
  assert_int_equal(gpupool__wire_pack_reply(&rep, &buf, &len), 0);
  assert_int_equal(gpupool__wire_send(sv[1], buf, len, NULL, 0), 0);
  free(buf);

  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_DEFAULT_MAX_FRAME);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[0]), 1);
  got = gpupool__wire_unpack_reply(&rx);
  assert_non_null(got);
  assert_int_equal(got->seq, 5);
  assert_null(got->error);
  assert_int_equal(got->n_revoke_slabs, 2);
  assert_int_equal(got->revoke_slabs[1], 9);
  assert_int_equal(got->body_case, GPUPOOL__WIRE__REPLY__BODY_HELLO);
  assert_int_equal(got->hello->n_pools, 2);
  assert_string_equal(got->hello->pools[0]->name, "default");
  assert_int_equal(got->hello->pools[0]->device, -1);
  assert_int_equal(got->hello->pools[0]->capacity, 1ull << 34);
  assert_string_equal(got->hello->pools[1]->name, "gpu1");
  assert_int_equal(got->hello->pools[1]->backend, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_CUDA);
  assert_int_equal(got->hello->pools[1]->used_high, 77);
  assert_int_equal(got->hello->client_id, 99);
  gpupool__wire__reply__free_unpacked(got, NULL);
  gpupool__wire_rx_reset(&rx);

  assert_int_equal(gpupool__wire_rx_read(&rx, sv[0]), 1);
  got = gpupool__wire_unpack_reply(&rx);
  assert_non_null(got);
  assert_int_equal(got->seq, 6);
  assert_non_null(got->error);
  assert_int_equal(got->error->code, GPUPOOL_ENOSPC);
  assert_string_equal(got->error->message, "pool default is full: asked 10 bytes, 0 free");
  assert_int_equal(got->body_case, GPUPOOL__WIRE__REPLY__BODY__NOT_SET);
  gpupool__wire__reply__free_unpacked(got, NULL);
  gpupool__wire_rx_reset(&rx);
  close(sv[0]);
  close(sv[1]);
}

/* A zero-length payload is a valid frame: the empty message. */
static void test_empty_frame(void **state) {
  int sv[2];
  uint8_t hdr[4] = {0, 0, 0, 0};
  gpupool__wire_rx rx;
  gpupool__req *req;
  gpupool__rep *rep;

  pair(sv);
  write_all(sv[0], hdr, 4);
  gpupool__wire_rx_init(&rx, 64);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 1);
  assert_int_equal(rx.payload_len, 0);
  req = gpupool__wire_unpack_request(&rx);
  assert_non_null(req);
  assert_int_equal(req->seq, 0);
  assert_int_equal(req->body_case, GPUPOOL__WIRE__REQUEST__BODY__NOT_SET);
  gpupool__wire__request__free_unpacked(req, NULL);
  rep = gpupool__wire_unpack_reply(&rx);
  assert_non_null(rep);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  gpupool__wire_rx_reset(&rx);
  close(sv[0]);
  close(sv[1]);
}

/* --- fd passing ------------------------------------------------------------------------------- */

static void test_fds_passed(void **state) {
  int sv[2], p[2], mfd, base = count_fds();
  int fds[2];
  gpupool__wire_rx rx;
  char text[64];

  pair(sv);
  assert_int_equal(pipe(p), 0);
  mfd = memfd_with("slab contents");
  fds[0] = mfd;
  fds[1] = p[0];
  send_hello(sv[0], 1, "fd-sender", fds, 2);
  /* The sender's copies can go at once: the receiver's are independent. */
  close(mfd);
  close(p[0]);

  gpupool__wire_rx_init(&rx, 0);
  recv_hello(&rx, sv[1], 1, "fd-sender");
  assert_int_equal(rx.nfds, 2);
  assert_true(rx.fds[0] >= 0 && rx.fds[1] >= 0);
  /* Received close-on-exec, so a fork+exec in the receiver cannot leak them. */
  assert_true(fcntl(rx.fds[0], F_GETFD) & FD_CLOEXEC);
  assert_true(fcntl(rx.fds[1], F_GETFD) & FD_CLOEXEC);
  memfd_read(rx.fds[0], text, sizeof text);
  assert_string_equal(text, "slab contents");
  write_all(p[1], "through the pipe", 16);
  assert_int_equal(read(rx.fds[1], text, sizeof text), 16);
  assert_memory_equal(text, "through the pipe", 16);

  /* Taking an fd: set its slot to -1 and reset closes only the rest. */
  mfd = rx.fds[0];
  rx.fds[0] = -1;
  gpupool__wire_rx_reset(&rx);
  assert_int_equal(rx.nfds, 0);
  memfd_read(mfd, text, sizeof text);
  assert_string_equal(text, "slab contents");
  close(mfd);
  close(p[1]);
  close_pair(sv, base);
}

/* Frames sent back to back, some with fds, before the receiver reads any: each fd must come
 * out with the frame that carried it. */
static void test_back_to_back(void **state) {
  enum { N = 8 };
  const int nfds_of[N] = {0, 1, 0, 4, 2, 0, 0, 3};
  int sv[2], base = count_fds();
  gpupool__wire_rx rx;

  pair(sv);
  for (int f = 0; f < N; f++) {
    int fds[GPUPOOL_WIRE_MAX_FDS];
    char name[32], text[32];
    snprintf(name, sizeof name, "frame-%d", f);
    for (int k = 0; k < nfds_of[f]; k++) {
      snprintf(text, sizeof text, "f%d-k%d", f, k);
      fds[k] = memfd_with(text);
    }
    send_hello(sv[0], (uint64_t)f + 100, name, fds, nfds_of[f]);
    for (int k = 0; k < nfds_of[f]; k++)
      close(fds[k]);
  }

  gpupool__wire_rx_init(&rx, 0);
  for (int f = 0; f < N; f++) {
    char name[32], want[32], text[32];
    snprintf(name, sizeof name, "frame-%d", f);
    recv_hello(&rx, sv[1], (uint64_t)f + 100, name);
    assert_int_equal(rx.nfds, nfds_of[f]);
    for (int k = 0; k < nfds_of[f]; k++) {
      snprintf(want, sizeof want, "f%d-k%d", f, k);
      memfd_read(rx.fds[k], text, sizeof text);
      assert_string_equal(text, want);
    }
    gpupool__wire_rx_reset(&rx);
  }
  close_pair(sv, base);
}

/* --- framing under odd writes ------------------------------------------------------------------ */

/* One frame trickled a byte at a time into a nonblocking receiver: 0 until the last byte,
 * the fd attached to the first byte arrives with it. */
static void test_tiny_writes_nonblocking(void **state) {
  int sv[2], mfd, base = count_fds();
  gpupool__wire_rx rx;
  uint8_t *buf;
  size_t len;
  char text[32];

  pair(sv);
  set_nonblock(sv[1]);
  pack_hello(7, "trickle", &buf, &len);
  mfd = memfd_with("first-byte fd");
  gpupool__wire_rx_init(&rx, 0);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 0);
  assert_int_equal(raw_send(sv[0], buf, 1, &mfd, 1), 1);
  close(mfd);
  for (size_t i = 1; i < len; i++) {
    assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 0);
    write_all(sv[0], buf + i, 1);
  }
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 1);
  assert_int_equal(rx.nfds, 1);
  memfd_read(rx.fds[0], text, sizeof text);
  assert_string_equal(text, "first-byte fd");
  {
    gpupool__req *req = gpupool__wire_unpack_request(&rx);
    assert_non_null(req);
    assert_int_equal(req->seq, 7);
    assert_string_equal(req->hello->client_name, "trickle");
    gpupool__wire__request__free_unpacked(req, NULL);
  }
  gpupool__wire_rx_reset(&rx);
  /* Nothing more: would block. */
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 0);
  free(buf);
  close_pair(sv, base);
}

/* Several frames from another process in 1..3-byte writes with pauses; a blocking receiver
 * reassembles each. */
static void test_tiny_writes_blocking(void **state) {
  int sv[2];
  pid_t pid;
  gpupool__wire_rx rx;

  pair(sv);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(sv[1]);
    for (int f = 0; f < 3; f++) {
      uint8_t *buf;
      size_t len, off = 0;
      char name[32];
      snprintf(name, sizeof name, "child-frame-%d", f);
      pack_hello((uint64_t)f, name, &buf, &len);
      while (off < len) {
        size_t n = 1 + (off % 3);
        if (n > len - off)
          n = len - off;
        if (write(sv[0], buf + off, n) != (ssize_t)n)
          _exit(2);
        off += n;
        usleep(200);
      }
      free(buf);
    }
    close(sv[0]);
    _exit(0);
  }
  close(sv[0]);
  gpupool__wire_rx_init(&rx, 0);
  for (int f = 0; f < 3; f++) {
    char name[32];
    snprintf(name, sizeof name, "child-frame-%d", f);
    recv_hello_from(&rx, sv[1], (uint64_t)f, name, pid);
    gpupool__wire_rx_reset(&rx);
  }
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_ECLOSED);
  assert_int_equal(wait_child(pid), 0);
  close(sv[1]);
}

static void test_nonblocking_partial(void **state) {
  int sv[2];
  gpupool__wire_rx rx;
  uint8_t *buf;
  size_t len;

  pair(sv);
  set_nonblock(sv[1]);
  pack_hello(11, "partial", &buf, &len);
  gpupool__wire_rx_init(&rx, 0);
  write_all(sv[0], buf, 2);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 0);
  assert_int_equal(rx.hdr_have, 2);
  write_all(sv[0], buf + 2, 2);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 0);
  assert_int_equal(rx.hdr_have, 4);
  assert_int_equal(rx.payload_len, len - 4);
  write_all(sv[0], buf + 4, (len - 4) / 2);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 0);
  assert_int_equal(rx.payload_have, (len - 4) / 2);
  /* Half a frame does not unpack. */
  assert_null(gpupool__wire_unpack_request(&rx));
  write_all(sv[0], buf + 4 + (len - 4) / 2, len - 4 - (len - 4) / 2);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 1);
  {
    gpupool__req *req = gpupool__wire_unpack_request(&rx);
    assert_non_null(req);
    assert_string_equal(req->hello->client_name, "partial");
    gpupool__wire__request__free_unpacked(req, NULL);
  }
  gpupool__wire_rx_reset(&rx);
  free(buf);
  close(sv[0]);
  close(sv[1]);
}

/* A 4 MiB frame through send_some on a nonblocking socket, with the receiver draining in
 * between: partial writes resume where they stopped and the fd goes only once. */
static void test_send_some_large(void **state) {
  enum { BIG = 4 << 20 };
  int sv[2], mfd, base = count_fds(), sender_done = 0, got = 0, rounds = 0;
  gpupool__rep rep = GPUPOOL__WIRE__REPLY__INIT, *out;
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  gpupool__wire_rx rx;
  uint8_t *buf;
  size_t len, off = 0;
  char *big = malloc(BIG + 1), text[32];

  assert_non_null(big);
  for (size_t i = 0; i < BIG; i++)
    big[i] = (char)('a' + i % 26);
  big[BIG] = '\0';
  err.code = GPUPOOL_EIO;
  err.message = big;
  rep.seq = 77;
  rep.error = &err;
  assert_int_equal(gpupool__wire_pack_reply(&rep, &buf, &len), 0);
  assert_true(len > BIG);

  pair(sv);
  set_nonblock(sv[0]);
  set_nonblock(sv[1]);
  mfd = memfd_with("big frame fd");
  gpupool__wire_rx_init(&rx, 8u << 20);
  while (!got) {
    if (!sender_done) {
      int rc = gpupool__wire_send_some(sv[0], buf, len, &off, &mfd, 1);
      assert_true(rc == 0 || rc == 1);
      sender_done = rc == 1;
      rounds++;
    }
    {
      int rc = gpupool__wire_rx_read(&rx, sv[1]);
      assert_true(rc == 0 || rc == 1);
      got = rc == 1;
    }
  }
  assert_true(sender_done);
  assert_int_equal(off, len);
  assert_true(rounds > 1); /* the socket buffer is far smaller than 4 MiB */
  assert_int_equal(rx.nfds, 1);
  memfd_read(rx.fds[0], text, sizeof text);
  assert_string_equal(text, "big frame fd");
  out = gpupool__wire_unpack_reply(&rx);
  assert_non_null(out);
  assert_int_equal(out->seq, 77);
  assert_int_equal(strlen(out->error->message), BIG);
  assert_memory_equal(out->error->message, big, BIG);
  gpupool__wire__reply__free_unpacked(out, NULL);
  gpupool__wire_rx_reset(&rx);
  /* The whole frame was sent once: nothing is left behind it. */
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 0);
  assert_int_equal(gpupool__wire_send_some(sv[0], buf, len, &off, NULL, 0), 1);

  free(buf);
  free(big);
  close(mfd);
  close_pair(sv, base);
}

/* The blocking send of a frame larger than the socket buffer, from another process, also on
 * a nonblocking socket (where it must wait for room instead of failing). */
static void test_send_blocking_large(void **state) {
  enum { BIG = 6 << 20 };
  int sv[2];
  pid_t pid;
  gpupool__wire_rx rx;
  gpupool__rep *out;
  char text[32];

  pair(sv);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    gpupool__rep rep = GPUPOOL__WIRE__REPLY__INIT;
    Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
    uint8_t *buf;
    size_t len;
    char *big = malloc(BIG + 1);
    int mfd = memfd_with("from the child");
    close(sv[1]);
    if (big == NULL)
      _exit(3);
    memset(big, 'z', BIG);
    big[BIG] = '\0';
    err.message = big;
    rep.seq = 1;
    rep.error = &err;
    if (gpupool__wire_pack_reply(&rep, &buf, &len) != 0)
      _exit(4);
    if (gpupool__wire_send(sv[0], buf, len, &mfd, 1) != 0)
      _exit(5);
    fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK);
    rep.seq = 2;
    free(buf);
    if (gpupool__wire_pack_reply(&rep, &buf, &len) != 0)
      _exit(6);
    if (gpupool__wire_send(sv[0], buf, len, NULL, 0) != 0)
      _exit(7);
    free(buf);
    free(big);
    close(mfd);
    close(sv[0]);
    _exit(0);
  }
  close(sv[0]);
  gpupool__wire_rx_init(&rx, 8u << 20);
  for (uint64_t seq = 1; seq <= 2; seq++) {
    usleep(20000); /* let the child fill the socket buffer and block */
    assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 1);
    out = gpupool__wire_unpack_reply(&rx);
    assert_non_null(out);
    assert_int_equal(out->seq, seq);
    assert_int_equal(strlen(out->error->message), BIG);
    assert_int_equal(rx.nfds, seq == 1 ? 1 : 0);
    if (seq == 1) {
      memfd_read(rx.fds[0], text, sizeof text);
      assert_string_equal(text, "from the child");
    }
    gpupool__wire__reply__free_unpacked(out, NULL);
    gpupool__wire_rx_reset(&rx);
  }
  assert_int_equal(wait_child(pid), 0);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_ECLOSED);
  close(sv[1]);
}

/* --- refusals --------------------------------------------------------------------------------- */

static void test_oversized_refused(void **state) {
  int sv[2], avail = -1;
  uint8_t frame[4 + 100];
  gpupool__wire_rx rx;
  char want[128];

  pair(sv);
  set_nonblock(sv[1]); /* a receiver that waited for the payload would fail, not hang */
  le32(frame, 4096);
  memset(frame + 4, 0x5a, 100);
  write_all(sv[0], frame, sizeof frame);
  gpupool__wire_rx_init(&rx, 1024);
  gpupool__err_clear();
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_EPROTO);
  snprintf(want, sizeof want, "frame of 4096 bytes exceeds the limit of 1024 bytes");
  assert_non_null(strstr(gpupool__errmsg(), want));
  assert_null(rx.payload);
  /* Not a byte of the payload was read. */
  assert_int_equal(ioctl(sv[1], FIONREAD, &avail), 0);
  assert_int_equal(avail, 100);

  /* Limits: 0 is the default, anything above the hard cap is clamped to it; a length over
   * the hard cap is refused the same way. */
  gpupool__wire_rx_init(&rx, UINT32_MAX);
  assert_int_equal(rx.max_frame, GPUPOOL_WIRE_HARD_MAX_FRAME);
  le32(frame, UINT32_MAX);
  close(sv[0]);
  close(sv[1]);
  pair(sv);
  set_nonblock(sv[1]);
  write_all(sv[0], frame, 4);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_EPROTO);
  snprintf(want, sizeof want, "frame of %u bytes exceeds the limit of %u bytes", UINT32_MAX,
           GPUPOOL_WIRE_HARD_MAX_FRAME);
  assert_non_null(strstr(gpupool__errmsg(), want));
  gpupool__wire_rx_reset(&rx);
  close(sv[0]);
  close(sv[1]);
}

static void test_eof(void **state) {
  int sv[2], mfd, base = count_fds();
  uint8_t frame[4 + 10];
  gpupool__wire_rx rx;

  /* EOF at a frame boundary, before anything: closed. */
  pair(sv);
  close(sv[0]);
  gpupool__wire_rx_init(&rx, 0);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_ECLOSED);
  close(sv[1]);

  /* EOF after a whole frame: closed. */
  pair(sv);
  send_hello(sv[0], 1, "last", NULL, 0);
  close(sv[0]);
  recv_hello(&rx, sv[1], 1, "last");
  gpupool__wire_rx_reset(&rx);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_ECLOSED);
  close(sv[1]);

  /* EOF inside the header. */
  pair(sv);
  le32(frame, 10);
  write_all(sv[0], frame, 2);
  close(sv[0]);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_EPROTO);
  close(sv[1]);

  /* EOF inside the payload of a frame that carried an fd: error, and the fd is closed. */
  pair(sv);
  memset(frame + 4, 0, 10);
  mfd = memfd_with("orphan");
  assert_int_equal(raw_send(sv[0], frame, 7, &mfd, 1), 7);
  close(mfd);
  close(sv[0]);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_EPROTO);
  assert_non_null(strstr(gpupool__errmsg(), "after 3 of 10 payload bytes"));
  assert_int_equal(rx.nfds, 0);
  assert_null(rx.payload);
  gpupool__wire_rx_reset(&rx); /* harmless after the receiver already dropped the frame */
  close(sv[1]);
  assert_int_equal(count_fds(), base);
}

/* More fds than GPUPOOL_WIRE_MAX_FDS on one byte: the control buffer overflows, the kernel
 * sets MSG_CTRUNC, and the receiver must refuse the frame and close what did arrive. */
static void test_ctrunc(void **state) {
  enum { N = GPUPOOL_WIRE_MAX_FDS + 2 };
  int sv[2], fds[N], base = count_fds();
  uint8_t *buf;
  size_t len;
  gpupool__wire_rx rx;

  pair(sv);
  for (int i = 0; i < N; i++)
    fds[i] = memfd_with("x");
  pack_hello(1, "greedy", &buf, &len);
  assert_int_equal(raw_send(sv[0], buf, len, fds, N), (ssize_t)len);
  for (int i = 0; i < N; i++)
    close(fds[i]);
  free(buf);
  assert_int_equal(count_fds(), base + 2);

  gpupool__wire_rx_init(&rx, 0);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_EPROTO);
  assert_non_null(strstr(gpupool__errmsg(), "truncated"));
  assert_int_equal(rx.nfds, 0);
  assert_int_equal(count_fds(), base + 2);
  gpupool__wire_rx_reset(&rx);

  /* The wire module itself refuses to send that many. */
  pack_hello(1, "greedy", &buf, &len);
  for (int i = 0; i < N; i++)
    fds[i] = 0;
  assert_int_equal(gpupool__wire_send(sv[0], buf, len, fds, N), GPUPOOL_EINVAL);
  free(buf);
  close_pair(sv, base);
}

/* Within limits per recvmsg but too many over one frame: fds on two different bytes. */
static void test_too_many_fds_in_frame(void **state) {
  enum { H = GPUPOOL_WIRE_MAX_FDS / 2 + 1 };
  int sv[2], a[H], b[H], base = count_fds();
  uint8_t *buf;
  size_t len;
  gpupool__wire_rx rx;

  pair(sv);
  for (int i = 0; i < H; i++) {
    a[i] = memfd_with("a");
    b[i] = memfd_with("b");
  }
  pack_hello(1, "split", &buf, &len);
  assert_int_equal(raw_send(sv[0], buf, 1, a, H), 1);
  assert_int_equal(raw_send(sv[0], buf + 1, len - 1, b, H), (ssize_t)len - 1);
  for (int i = 0; i < H; i++) {
    close(a[i]);
    close(b[i]);
  }
  free(buf);
  gpupool__wire_rx_init(&rx, 0);
  assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), GPUPOOL_EPROTO);
  assert_non_null(strstr(gpupool__errmsg(), "at most 16"));
  assert_int_equal(rx.nfds, 0);
  close_pair(sv, base);
}

static void test_garbage_payload(void **state) {
  /* field 1 with wire type 7 (no such type); a length-delimited field 2 claiming 127 bytes
   * with none following; a truncated varint. */
  static const uint8_t bad[][4] = {{0x0f, 0, 0, 0}, {0x12, 0x7f, 0, 0}, {0x08, 0xff, 0xff, 0xff}};
  static const size_t bad_len[] = {1, 2, 4};
  int sv[2];
  gpupool__wire_rx rx;

  pair(sv);
  gpupool__wire_rx_init(&rx, 0);
  for (size_t i = 0; i < sizeof bad_len / sizeof bad_len[0]; i++) {
    uint8_t frame[8];
    le32(frame, (uint32_t)bad_len[i]);
    memcpy(frame + 4, bad[i], bad_len[i]);
    write_all(sv[0], frame, 4 + bad_len[i]);
    assert_int_equal(gpupool__wire_rx_read(&rx, sv[1]), 1);
    assert_null(gpupool__wire_unpack_request(&rx));
    assert_null(gpupool__wire_unpack_reply(&rx));
    gpupool__wire_rx_reset(&rx);
  }
  /* The stream is still in step: a good frame right after is read fine. */
  send_hello(sv[0], 3, "after garbage", NULL, 0);
  recv_hello(&rx, sv[1], 3, "after garbage");
  gpupool__wire_rx_reset(&rx);
  /* No frame at all does not unpack either. */
  assert_null(gpupool__wire_unpack_request(&rx));
  close(sv[0]);
  close(sv[1]);
}

/* --- sender-side behaviour -------------------------------------------------------------------- */

static void test_pack_too_big(void **state) {
  size_t n = GPUPOOL_WIRE_HARD_MAX_FRAME + 1;
  char *huge = malloc(n + 1);
  gpupool__rep rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  uint8_t *buf = NULL;
  size_t len = 0;

  assert_non_null(huge);
  memset(huge, 'q', n);
  huge[n] = '\0';
  err.message = huge;
  rep.error = &err;
  assert_int_equal(gpupool__wire_pack_reply(&rep, &buf, &len), GPUPOOL_ETOOBIG);
  assert_null(buf);
  assert_int_equal(gpupool__wire_pack_reply(NULL, &buf, &len), GPUPOOL_EINVAL);
  free(huge);
}

static void test_send_to_closed_peer(void **state) {
  int sv[2];
  uint8_t *buf;
  size_t len, off = 0;

  /* SIGPIPE would kill the test process if MSG_NOSIGNAL were missing. */
  pair(sv);
  close(sv[1]);
  pack_hello(1, "nobody listens", &buf, &len);
  assert_int_equal(gpupool__wire_send(sv[0], buf, len, NULL, 0), GPUPOOL_ECLOSED);
  assert_int_equal(gpupool__wire_send_some(sv[0], buf, len, &off, NULL, 0), GPUPOOL_ECLOSED);
  assert_int_equal(gpupool__wire_send(sv[0], buf, 2, NULL, 0), GPUPOOL_EINVAL);
  assert_int_equal(gpupool__wire_send(-1, buf, len, NULL, 0), GPUPOOL_EIO);
  free(buf);
  close(sv[0]);
}

/* --- receiver robustness ---------------------------------------------------------------------- */

static volatile sig_atomic_t alarms;
static void on_alarm(int sig) { alarms++; }

/* A blocking receive interrupted by a signal (no SA_RESTART) keeps waiting. */
static void test_eintr(void **state) {
  struct sigaction sa, old;
  struct itimerval it = {.it_value = {.tv_sec = 0, .tv_usec = 30000}};
  int sv[2];
  pid_t pid;
  gpupool__wire_rx rx;

  pair(sv);
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_alarm;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  assert_int_equal(sigaction(SIGALRM, &sa, &old), 0);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(sv[1]);
    usleep(300000);
    send_hello(sv[0], 9, "late", NULL, 0);
    close(sv[0]);
    _exit(0);
  }
  close(sv[0]);
  alarms = 0;
  assert_int_equal(setitimer(ITIMER_REAL, &it, NULL), 0);
  gpupool__wire_rx_init(&rx, 0);
  recv_hello_from(&rx, sv[1], 9, "late", pid);
  gpupool__wire_rx_reset(&rx);
  assert_int_equal(alarms, 1);
  assert_int_equal(wait_child(pid), 0);
  assert_int_equal(sigaction(SIGALRM, &old, NULL), 0);
  close(sv[1]);
}

/* Credentials control messages (SO_PASSCRED) carry no fds and are ignored. */
static void test_passcred_ignored(void **state) {
  int sv[2], one = 1;
  gpupool__wire_rx rx;

  pair(sv);
  assert_int_equal(setsockopt(sv[1], SOL_SOCKET, SO_PASSCRED, &one, sizeof one), 0);
  send_hello(sv[0], 4, "with creds", NULL, 0);
  gpupool__wire_rx_init(&rx, 0);
  recv_hello(&rx, sv[1], 4, "with creds");
  assert_int_equal(rx.nfds, 0);
  gpupool__wire_rx_reset(&rx);
  close(sv[0]);
  close(sv[1]);
}

/* ---- buffered receiver (the daemon's) -------------------------------------------------------- */

/* Drain every complete frame; returns how many, checking each is a Hello with seq base+i. */
static int inbuf_drain(gpupool__wire_inbuf *b, uint64_t base) {
  const uint8_t *p;
  uint32_t len;
  int n = 0, rc;
  while ((rc = gpupool__wire_inbuf_next(b, &p, &len)) == 1) {
    gpupool__req *r = gpupool__wire__request__unpack(NULL, len, p);
    assert_non_null(r);
    assert_int_equal(r->seq, base + (uint64_t)n);
    gpupool__wire__request__free_unpacked(r, NULL);
    n++;
  }
  assert_int_equal(rc, 0);
  return n;
}

static void test_inbuf_many_frames_one_read(void **state) {
  int sv[2], fds = -1, got = 0;
  gpupool__wire_inbuf b;
  (void)state;
  pair(sv);
  set_nonblock(sv[1]);
  gpupool__wire_inbuf_init(&b, 0);
  for (int i = 0; i < 50; i++)
    send_hello(sv[0], 100 + (uint64_t)i, "pipelined", NULL, 0);
  /* One fill takes them all (they are all in the socket already). */
  assert_true(gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds) > 0);
  assert_int_equal(fds, 0);
  got = inbuf_drain(&b, 100);
  assert_int_equal(got, 50);
  assert_int_equal(gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds), 0); /* would block */
  gpupool__wire_inbuf_free(&b);
  close(sv[0]);
  close(sv[1]);
}

/* The input buffer never grows past one frame: a client pipelining many small frames is read
 * one buffer's worth at a time. */
static void test_inbuf_capped_at_one_frame(void **state) {
  int sv[2], fds = -1, got = 0;
  gpupool__wire_inbuf b;
  char name[201];
  (void)state;
  pair(sv);
  set_nonblock(sv[1]);
  memset(name, 'n', 200);
  name[200] = '\0';
  gpupool__wire_inbuf_init(&b, 4096);
  /* 100 frames of ~220 bytes: 22 KB waiting, five times the cap (and within the socket's
   * buffer, so the sends do not block before the reads). */
  for (int i = 0; i < 100; i++)
    send_hello(sv[0], 100 + (uint64_t)i, name, NULL, 0);
  while (got < 100) {
    int rc = gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds);
    assert_true(rc > 0);
    assert_true(b.cap <= 4096 + GPUPOOL_WIRE_HDR);
    got += inbuf_drain(&b, 100 + (uint64_t)got);
  }
  gpupool__wire_inbuf_free(&b);
  close(sv[0]);
  close(sv[1]);
}

static void test_inbuf_split_and_large(void **state) {
  int sv[2], fds = -1;
  gpupool__wire_inbuf b;
  uint8_t *buf;
  size_t len;
  char big[300000];
  (void)state;
  pair(sv);
  set_nonblock(sv[1]);
  gpupool__wire_inbuf_init(&b, 1u << 20);
  /* A frame larger than the initial buffer, delivered in pieces. */
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  pack_hello(7, big, &buf, &len);
  for (size_t off = 0; off < len;) {
    size_t chunk = len - off < 70000 ? len - off : 70000;
    const uint8_t *p;
    uint32_t plen;
    write_all(sv[0], buf + off, chunk);
    off += chunk;
    while (gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds) > 0)
      ;
    if (off < len)
      assert_int_equal(gpupool__wire_inbuf_next(&b, &p, &plen), 0);
  }
  assert_int_equal(inbuf_drain(&b, 7), 1);
  free(buf);
  gpupool__wire_inbuf_free(&b);
  close(sv[0]);
  close(sv[1]);
}

/* A fill reads at most its budget, whatever the socket and the frame hold; the frame comes
 * together over several fills, and inbuf_complete says so only once it has. */
static void test_inbuf_fill_budget(void **state) {
  int sv[2], fds = -1, rc, fills = 0;
  gpupool__wire_inbuf b;
  uint8_t *buf;
  size_t len, got = 0;
  char big[100000];
  (void)state;
  pair(sv);
  set_nonblock(sv[1]);
  gpupool__wire_inbuf_init(&b, 1u << 20);
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  pack_hello(9, big, &buf, &len);
  write_all(sv[0], buf, len);
  while (!gpupool__wire_inbuf_complete(&b)) {
    rc = gpupool__wire_inbuf_fill(&b, sv[1], 4096, &fds);
    assert_true(rc > 0 && rc <= 4096);
    got += (size_t)rc;
    fills++;
  }
  assert_int_equal(got, len);
  assert_true(fills >= (int)(len / 4096));
  assert_int_equal(inbuf_drain(&b, 9), 1);
  assert_false(gpupool__wire_inbuf_complete(&b));
  assert_int_equal(gpupool__wire_inbuf_fill(&b, sv[1], 4096, &fds), 0); /* would block */
  free(buf);
  gpupool__wire_inbuf_free(&b);
  close(sv[0]);
  close(sv[1]);
}

/* fds go with the frame whose first byte they rode on, also when earlier frames arrive in the
 * same read; taking one gives it to the caller, the rest are closed with the next frame. */
static void test_inbuf_fds_follow_their_frame(void **state) {
  int sv[2], fds = -1, before = count_fds(), m = memfd_with("x"), two[2] = {m, m}, got;
  gpupool__wire_inbuf b;
  const uint8_t *p;
  uint32_t plen;
  (void)state;
  pair(sv);
  set_nonblock(sv[1]);
  gpupool__wire_inbuf_init(&b, 4096);
  send_hello(sv[0], 1, "plain", NULL, 0);
  send_hello(sv[0], 2, "with-fd", two, 2);
  send_hello(sv[0], 3, "after", NULL, 0);
  close(m);
  while (gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds) > 0)
    assert_int_equal(fds, 0);
  assert_int_equal(gpupool__wire_inbuf_next(&b, &p, &plen), 1);
  assert_int_equal(gpupool__wire_inbuf_frame_nfds(&b), 0);
  assert_int_equal(gpupool__wire_inbuf_take_fd(&b), -1);
  assert_int_equal(gpupool__wire_inbuf_next(&b, &p, &plen), 1);
  assert_int_equal(gpupool__wire_inbuf_frame_nfds(&b), 2);
  got = gpupool__wire_inbuf_take_fd(&b);
  assert_true(got >= 0);
  close(got);
  assert_int_equal(gpupool__wire_inbuf_next(&b, &p, &plen), 1);
  assert_int_equal(gpupool__wire_inbuf_frame_nfds(&b), 0);
  gpupool__wire_inbuf_free(&b);
  close(sv[0]);
  close(sv[1]);
  assert_int_equal(count_fds(), before);
}

static void test_inbuf_fds_closed_oversize_eof(void **state) {
  int sv[2], fds = -1, before = count_fds(), m = memfd_with("x"), three[3] = {m, m, m};
  gpupool__wire_inbuf b;
  uint8_t hdr[4];
  const uint8_t *p;
  uint32_t plen;
  (void)state;
  pair(sv);
  set_nonblock(sv[1]);
  gpupool__wire_inbuf_init(&b, 4096);
  send_hello(sv[0], 1, "with-fds", three, 3);
  close(m);
  assert_true(gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds) > 0);
  assert_int_equal(fds, 0); /* kept with their frame, closed once it is handled */
  assert_int_equal(inbuf_drain(&b, 1), 1);
  assert_int_equal(gpupool__wire_inbuf_frame_nfds(&b), 3);
  /* Oversized: refused on the header. */
  le32(hdr, 5000);
  write_all(sv[0], hdr, sizeof hdr);
  assert_true(gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds) > 0);
  assert_int_equal(gpupool__wire_inbuf_next(&b, &p, &plen), GPUPOOL_EPROTO);
  assert_non_null(strstr(gpupool__errmsg(), "exceeds the limit of 4096"));
  gpupool__wire_inbuf_free(&b);
  /* EOF inside a frame, then at a boundary. */
  gpupool__wire_inbuf_init(&b, 4096);
  le32(hdr, 10);
  write_all(sv[0], hdr, sizeof hdr);
  close(sv[0]);
  while (gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds) > 0)
    ;
  assert_int_equal(gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds), GPUPOOL_EPROTO);
  gpupool__wire_inbuf_free(&b);
  close(sv[1]);
  pair(sv);
  gpupool__wire_inbuf_init(&b, 4096);
  close(sv[0]);
  assert_int_equal(gpupool__wire_inbuf_fill(&b, sv[1], SIZE_MAX, &fds), GPUPOOL_ECLOSED);
  gpupool__wire_inbuf_free(&b);
  close(sv[1]);
  assert_int_equal(count_fds(), before);
}

/* The send queue: frames the socket does not take wait in order, with their fds, and come out
 * whole once the peer reads. */
static void test_txq_order_and_fds(void **state) {
  int sv[2], pfd[2];
  gpupool__wire_txq q;
  int sndbuf = 4096, queued = 0;
  (void)state;
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
  assert_int_equal(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf), 0);
  assert_int_equal(pipe(pfd), 0);
  gpupool__wire_txq_init(&q);
  for (int i = 0; i < 64; i++) {
    size_t len = 8192;
    uint8_t *buf = malloc(len);
    assert_non_null(buf);
    memset(buf, i, len);
    int rc = gpupool__wire_txq_send(&q, sv[0], buf, len, i == 40 ? &pfd[0] : NULL, i == 40 ? 1 : 0);
    assert_true(rc == 0 || rc == 1);
    queued += rc == 0;
  }
  assert_true(queued > 0);
  assert_true(q.cost >= q.bytes);
  close(pfd[0]); /* the queue holds its own duplicate */
  {
    uint8_t *got = malloc(64 * 8192);
    size_t have = 0;
    int fds_seen = 0;
    while (have < 64 * 8192) {
      struct msghdr mh = {0};
      struct iovec iov = {got + have, 64 * 8192 - have};
      union { char b[CMSG_SPACE(sizeof(int) * 4)]; struct cmsghdr a; } ctl;
      ssize_t n;
      mh.msg_iov = &iov;
      mh.msg_iovlen = 1;
      mh.msg_control = ctl.b;
      mh.msg_controllen = sizeof ctl.b;
      n = recvmsg(sv[1], &mh, MSG_CMSG_CLOEXEC);
      if (n < 0) {
        assert_int_equal(errno, EAGAIN);
        assert_true(gpupool__wire_txq_flush(&q, sv[0]) >= 0);
        continue;
      }
      for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
        int fd;
        memcpy(&fd, CMSG_DATA(cm), sizeof fd);
        close(fd);
        fds_seen++;
        /* with the read that holds the first byte of frame 40 */
        assert_true(have <= 40 * 8192 && 40 * 8192 < have + (size_t)n);
      }
      have += (size_t)n;
    }
    for (size_t i = 0; i < have; i++)
      assert_int_equal(got[i], i / 8192);
    assert_int_equal(fds_seen, 1);
    free(got);
  }
  assert_int_equal(gpupool__wire_txq_flush(&q, sv[0]), 1);
  assert_int_equal(q.bytes, 0);
  assert_int_equal(q.cost, 0);
  gpupool__wire_txq_clear(&q);
  close(pfd[1]);
  close(sv[0]);
  close(sv[1]);
}

/* Tensor metadata is checked by the same code on both sides: a description that does not fit
 * its buffer, or that overflows, is refused with a message. */
static void test_meta_conversion(void **state) {
  gpupool_tensor_meta m = {0}, back;
  Gpupool__Wire__TensorMeta w;
  int64_t shape[GPUPOOL_MAX_NDIM + 1] = {0};
  (void)state;
  m.dtype_code = GPUPOOL_DTYPE_FLOAT;
  m.dtype_bits = 32;
  m.dtype_lanes = 1;
  m.ndim = 2;
  m.shape[0] = 4;
  m.shape[1] = 8;
  gpupool__wire_meta_to(&m, &w);
  assert_int_equal(gpupool__wire_meta_from(&w, 128, &back), 0);
  assert_int_equal(back.ndim, 2);
  assert_int_equal(back.shape[1], 8);
  assert_int_equal(gpupool__wire_meta_from(&w, 127, &back), GPUPOOL_EMETA);
  assert_non_null(strstr(gpupool__errmsg(), "spans 128 bytes"));
  w.n_shape = GPUPOOL_MAX_NDIM + 1;
  w.shape = shape;
  w.n_strides = 0;
  assert_int_equal(gpupool__wire_meta_from(&w, 1 << 20, &back), GPUPOOL_EMETA);
  m.shape[0] = INT64_MAX;
  m.shape[1] = INT64_MAX;
  assert_int_equal(gpupool__wire_meta_check(&m, UINT64_MAX), GPUPOOL_EMETA);
  assert_non_null(strstr(gpupool__errmsg(), "overflows"));
}

static void test_mem_kinds(void **state) {
  gpupool_mem_kind k;
  (void)state;
  for (int i = GPUPOOL_MEM_HOST; i <= GPUPOOL_MEM_HOST_NUMA; i++) {
    assert_int_equal(gpupool__wire_mem_kind(gpupool__wire_location((gpupool_mem_kind)i), &k), 0);
    assert_int_equal(k, i);
  }
  assert_int_equal(gpupool__wire_mem_kind(99, &k), GPUPOOL_EPROTO);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_request_roundtrip),
      cmocka_unit_test(test_reply_roundtrip),
      cmocka_unit_test(test_empty_frame),
      cmocka_unit_test(test_fds_passed),
      cmocka_unit_test(test_back_to_back),
      cmocka_unit_test(test_tiny_writes_nonblocking),
      cmocka_unit_test(test_tiny_writes_blocking),
      cmocka_unit_test(test_nonblocking_partial),
      cmocka_unit_test(test_send_some_large),
      cmocka_unit_test(test_send_blocking_large),
      cmocka_unit_test(test_oversized_refused),
      cmocka_unit_test(test_eof),
      cmocka_unit_test(test_ctrunc),
      cmocka_unit_test(test_too_many_fds_in_frame),
      cmocka_unit_test(test_garbage_payload),
      cmocka_unit_test(test_pack_too_big),
      cmocka_unit_test(test_send_to_closed_peer),
      cmocka_unit_test(test_eintr),
      cmocka_unit_test(test_passcred_ignored),
      cmocka_unit_test(test_inbuf_many_frames_one_read),
      cmocka_unit_test(test_inbuf_split_and_large),
      cmocka_unit_test(test_inbuf_fill_budget),
      cmocka_unit_test(test_inbuf_capped_at_one_frame),
      cmocka_unit_test(test_inbuf_fds_closed_oversize_eof),
      cmocka_unit_test(test_inbuf_fds_follow_their_frame),
      cmocka_unit_test(test_txq_order_and_fds),
      cmocka_unit_test(test_meta_conversion),
      cmocka_unit_test(test_mem_kinds),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
