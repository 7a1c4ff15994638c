/*
 * Unit tests of the host backend's client half against the fds a peer may send: only a memfd
 * sealed against shrinking and at least as large as the slab it claims to be is mapped
 * (anything else would let the peer kill the client with SIGBUS once it touches a buffer;
 * found by fuzz_client, regression input tests/fuzz/regress/client/).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "../support/run_tests.h"

#include "errors.h"
#include "host/host.h"

#define MIB (1ull << 20)

static int memfd(uint64_t size, int sealed) {
  int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  assert_true(fd >= 0);
  assert_int_equal(ftruncate(fd, (off_t)size), 0);
  if (sealed)
    assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
  return fd;
}

static gpupool__cpool *import_pool(void) {
  gpupool__cpool *p = NULL;
  /* Host pools come without a pool-wide fd: each slab brings its own. */
  assert_int_equal(gpupool__host_client_ops.pool_import(-1, GPUPOOL_MEM_HOST, -1, 8 * MIB, &p), 0);
  return p;
}

/* Map a slab from fd (taken) with an export of size bytes at offset 0. */
static int map(gpupool__cpool *p, int fd, uint64_t size, void **base) {
  uint8_t ex[GPUPOOL__HOST_EXPORT_LEN];
  uint32_t len = gpupool__host_export_encode(&(gpupool__host_export){.offset = 0, .size = size}, ex);
  void *priv = NULL;
  return gpupool__host_client_ops.slab_map(p, ex, len, size, fd, 1, base, &priv);
}

static void test_sealed_slab_maps_and_is_usable(void **state) {
  gpupool__cpool *p = import_pool();
  void *base = NULL;
  (void)state;
  assert_int_equal(map(p, memfd(2 * MIB, 1), 2 * MIB, &base), 0);
  memset(base, 0xa5, 2 * MIB);
  assert_int_equal(gpupool__host_client_ops.slab_unmap(p, base, 2 * MIB, NULL, NULL), 0);
  gpupool__host_client_ops.pool_release(p);
}

/* fd offered as a slab of slab_size: refused with GPUPOOL_EPROTO, nothing mapped, and the
 * message says why. */
static void expect_refused(int fd, uint64_t slab_size, const char *why) {
  gpupool__cpool *p = import_pool();
  void *base = NULL;
  assert_int_equal(map(p, fd, slab_size, &base), GPUPOOL_EPROTO);
  assert_null(base);
  assert_non_null(strstr(gpupool__errmsg(), why));
  gpupool__host_client_ops.pool_release(p);
}

static void test_unsealed_memfd_refused(void **state) {
  (void)state;
  expect_refused(memfd(2 * MIB, 0), 2 * MIB, "sealed");
}

static void test_memfd_shorter_than_slab_refused(void **state) {
  (void)state;
  expect_refused(memfd(4096, 1), 2 * MIB, "does not match its memfd");
}

static void test_pipe_refused(void **state) {
  gpupool__cpool *p = import_pool();
  void *base = NULL;
  int fds[2];
  (void)state;
  assert_int_equal(pipe2(fds, O_CLOEXEC), 0);
  assert_int_equal(map(p, fds[0], 2 * MIB, &base), GPUPOOL_EPROTO);
  assert_null(base);
  /* slab_map took fds[0] and closed it: a second close fails. */
  assert_int_equal(close(fds[0]), -1);
  close(fds[1]);
  gpupool__host_client_ops.pool_release(p);
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_sealed_slab_maps_and_is_usable,
                      test_unsealed_memfd_refused,
                      test_memfd_shorter_than_slab_refused,
                      test_pipe_refused);
}
