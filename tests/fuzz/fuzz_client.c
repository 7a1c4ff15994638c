/*
 * Fuzz target: the client library's reply path, with a hostile peer where the daemon should
 * be. The input (chunks, fuzz.h) is everything the "daemon" sends, Hello reply included,
 * fds (memfds) attached where the chunks say; a peer thread writes it on the accepted
 * connection while reading whatever the client sends, then hangs up.
 *
 * The main thread uses the public API as a producer and consumer would, in this order (the
 * sequence numbers the seeds answer; make_corpus.c builds them):
 *   1 Hello (gpupool_client_connect)      2 Stats           3 Allocate, 4 AttachPool (its fd)
 *   5 Share   6 Publish   7 Open   8 Get   9 Trim   10 Unpublish   11-13 Release
 * and touches every byte of each buffer it gets, as an application would. The buffer from
 * Get goes to a DLPack consumer (its tensor description comes from the peer), which reads
 * the first and last byte of the tensor and releases it (13) through the deleter. A failed
 * call shifts the numbers; the connection breaking ends the sequence (reconnection is off).
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "fuzz.h"
#include "gpupool/gpupool.h"

static char sock_dir[64], sock_path[108];
static int listen_fd = -1;

typedef struct {
  fuzz_chunk chunks[FUZZ_MAX_CHUNKS];
  size_t nchunks;
} peer_arg;

static void cleanup(void) {
  if (sock_path[0])
    unlink(sock_path);
  if (sock_dir[0])
    rmdir(sock_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  (void)argc;
  (void)argv;
  /* One connection per input: a broken connection must not be retried. */
  setenv("GPUPOOL_RECONNECT_MS", "0", 1);
  unsetenv("GPUPOOL_SPIN_US");
  unsetenv("GPUPOOL_TRACE");
  snprintf(sock_dir, sizeof sock_dir, "/tmp/gpupool-fuzz-client-XXXXXX");
  if (!mkdtemp(sock_dir))
    fuzz_fail("mkdtemp: %s", strerror(errno));
  snprintf(sock_path, sizeof sock_path, "%s/s", sock_dir);
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock_path);
  listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd < 0 || bind(listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(listen_fd, 4) != 0)
    fuzz_fail("cannot listen on %s: %s", sock_path, strerror(errno));
  atexit(cleanup);
  return 0;
}

/* The hostile daemon: send every chunk while reading what the client sends (so neither side
 * can block the other), hang up, and read until the client closes. */
static void *peer(void *p) {
  peer_arg *a = p;
  size_t i = 0, off = 0;
  int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0)
    fuzz_fail("accept: %s", strerror(errno));
  while (i < a->nchunks) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN | POLLOUT};
    int rc;
    if (poll(&pfd, 1, -1) < 0 && errno != EINTR)
      fuzz_fail("poll: %s", strerror(errno));
    if ((pfd.revents & (POLLIN | POLLHUP | POLLERR)) && fuzz_drain(fd))
      break; /* the client closed the connection */
    if (!(pfd.revents & POLLOUT))
      continue;
    rc = fuzz_send_chunk(fd, &a->chunks[i], &off);
    if (rc < 0)
      break;
    if (rc == 1) {
      i++;
      off = 0;
    }
  }
  shutdown(fd, SHUT_WR);
  for (;;) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (poll(&pfd, 1, -1) < 0 && errno != EINTR)
      fuzz_fail("poll: %s", strerror(errno));
    if (fuzz_drain(fd))
      break;
  }
  close(fd);
  return NULL;
}

/* Read every byte, and write it too unless the hold is read-only (the kernel enforces that on
 * the host backend), as the application the buffer was handed to would. */
static void touch(gpupool_buffer *b) {
  volatile uint8_t *p = gpupool_buffer_ptr(b);
  size_t n = gpupool_buffer_size(b);
  int rw = !gpupool_buffer_read_only(b);
  uint8_t sum = 0;
  if (!p)
    fuzz_fail("a buffer without an address");
  for (size_t i = 0; i < n; i += 512) {
    if (rw)
      p[i] = (uint8_t)i;
    sum ^= p[i];
  }
  if (n > 0) {
    if (rw)
      p[n - 1] = sum;
    (void)p[n - 1];
  }
}

/* The tensor a consumer of b is told about must lie inside b: read its first and last byte. */
static void consume_tensor(gpupool_buffer *b) {
  gpupool_tensor_meta m;
  const volatile uint8_t *base = gpupool_buffer_ptr(b);
  size_t size = gpupool_buffer_size(b);
  uint64_t span;
  int err;
  if (gpupool_buffer_tensor(b, &m) == 0) {
    span = gpupool_tensor_span(&m, &err);
    if (err)
      fuzz_fail("the library accepted tensor metadata it calls invalid");
    if (span > size)
      fuzz_fail("a tensor reaches byte %llu of a %zu-byte buffer", (unsigned long long)span, size);
    if (span > m.byte_offset) {
      (void)base[m.byte_offset];
      (void)base[span - 1];
    }
  }
  gpupool_buffer_release(b, NULL);
}

/* Every member of a bundle must lie inside its buffer: check, then read its first and last byte. */
static void touch_members(gpupool_bundle *b) {
  for (int i = 0; i < gpupool_bundle_count(b); i++) {
    gpupool_member m;
    const gpupool_buffer *buf;
    const volatile uint8_t *p;
    if (gpupool_bundle_member(b, i, &m) != 0)
      fuzz_fail("member %d of %d cannot be read", i, gpupool_bundle_count(b));
    buf = gpupool_bundle_buffer(b, m.buffer);
    if (!buf || (char *)m.ptr < (char *)gpupool_buffer_ptr(buf) || m.size == 0 ||
        (char *)m.ptr + m.size > (char *)gpupool_buffer_ptr(buf) + gpupool_buffer_size(buf))
      fuzz_fail("member %d lies outside its buffer", i);
    p = m.ptr;
    (void)p[0];
    (void)p[m.size - 1];
  }
}

static void use_client(gpupool_client *c) {
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps[4];
  gpupool_buffer *mine = NULL, *opened = NULL, *got = NULL;
  gpupool_token tok;
  gpupool_tensor_meta meta = {.dtype_code = GPUPOOL_DTYPE_FLOAT, .dtype_bits = 32, .dtype_lanes = 1,
                              .ndim = 2, .shape = {16, 64}};
  char lost[4][GPUPOOL_NAME_MAX + 1];
  int n = 0;

  gpupool_client_stats(c, &ds, ps, 4, &n);
  if (gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &mine) == 0) {
    touch(mine);
    if (gpupool_buffer_share(mine, NULL, &tok) == 0) {
      gpupool_buffer_publish(mine, "fuzz", &meta, NULL, NULL);
      if (gpupool_buffer_open(c, &tok, 0, NULL, &opened) == 0)
        touch(opened);
    }
  }
  if (gpupool_buffer_get(c, "fuzz", 0, 0, GPUPOOL_READ_ONLY, NULL, &got, NULL) == 0) {
    gpupool_tensor_meta m;
    touch(got);
    gpupool_buffer_tensor(got, &m);
  }
  gpupool_client_trim(c);
  gpupool_name_unpublish(c, "fuzz");
  if (got)
    consume_tensor(got);
  if (opened)
    gpupool_buffer_release(opened, NULL);
  if (mine)
    gpupool_buffer_release(mine, NULL);
  gpupool_client_lost_names(c, lost, 4, &n);
  /* A bundle, twice: the second reply may leave the member table out (known layout). */
  for (int k = 0; k < 2; k++) {
    gpupool_bundle *bd;
    if (gpupool_bundle_get(c, "fuzz-dict", 0, 0, GPUPOOL_READ_ONLY, NULL, &bd) == 0) {
      touch_members(bd);
      gpupool_bundle_release(bd, NULL);
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static peer_arg arg;
  int fds_before = fuzz_count_fds();
  gpupool_client *c = NULL;
  pthread_t th;

  arg.nchunks = fuzz_chunks(data, size, arg.chunks, FUZZ_MAX_CHUNKS);
  if (pthread_create(&th, NULL, peer, &arg) != 0)
    fuzz_fail("pthread_create failed");
  if (gpupool_client_connect(sock_path, "fuzz", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0) {
    use_client(c);
    gpupool_client_disconnect(c);
  }
  pthread_join(th, NULL);
  if (fuzz_count_fds() != fds_before)
    fuzz_fail("%d fds open after the input, %d before", fuzz_count_fds(), fds_before);
  return 0;
}
