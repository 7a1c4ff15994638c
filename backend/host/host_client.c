/*
 * Client side of the host backend: the pool is a sealed memfd, a slab is (offset, size)
 * inside it, mapped shared and read/write once per client. No events: host memory written
 * before a publish is visible to every process that maps it.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "errors.h"
#include "host.h"

struct gpupool__cpool {
  int fd;
  uint64_t capacity;
};

static int host_import(int fd, gpupool_mem_kind kind, int device, uint64_t capacity, gpupool__cpool **out) {
  gpupool__cpool *p;
  struct stat st;
  int seals, rc;
  (void)device;
  if (kind != GPUPOOL_MEM_HOST) {
    close(fd);
    return gpupool__err(GPUPOOL_ENOTSUP, "the host backend cannot import a pool of GPU memory");
  }
  /* Slabs are mapped from this fd and then touched by the application: a file shorter than
   * the pool, or one that may still shrink, kills this process with SIGBUS. gpupoold sends a
   * memfd of exactly the pool's capacity, sealed against shrinking. */
  seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    close(fd);
    return gpupool__err(GPUPOOL_EPROTO,
                        "the pool fd from the daemon is not a memfd sealed against shrinking; the socket "
                        "is not served by a gpupoold (check GPUPOOL_SOCKET or the path passed to connect)");
  }
  if (fstat(fd, &st) != 0) {
    rc = gpupool__err(GPUPOOL_EPROTO, "cannot stat the pool fd from the daemon: %s", strerror(errno));
    close(fd);
    return rc;
  }
  if (st.st_size < 0 || (uint64_t)st.st_size < capacity) {
    close(fd);
    return gpupool__err(GPUPOOL_EPROTO,
                        "the pool fd from the daemon holds %lld bytes but the pool claims %llu; the socket "
                        "is not served by a gpupoold (check GPUPOOL_SOCKET or the path passed to connect)",
                        (long long)st.st_size, (unsigned long long)capacity);
  }
  p = calloc(1, sizeof *p);
  if (!p) {
    close(fd);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  p->fd = fd;
  p->capacity = capacity;
  *out = p;
  return 0;
}

static void host_release(gpupool__cpool *p) {
  if (!p)
    return;
  close(p->fd);
  free(p);
}

static int host_set_access(gpupool__cpool *p, const int *devices, int n) {
  (void)p;
  (void)devices;
  (void)n;
  return 0;
}

static int host_map(gpupool__cpool *p, const uint8_t *export_data, size_t export_len, uint64_t size,
                    void **base, void **priv) {
  gpupool__host_export e;
  uint64_t off, len;
  void *m;
  int rc;
  if ((rc = gpupool__host_export_decode(export_data, export_len, &e)) != 0)
    return rc;
  off = e.offset;
  len = e.size;
  if (len != size || off > p->capacity || len > p->capacity - off || off % 4096)
    return gpupool__err(GPUPOOL_EPROTO, "host slab (%llu+%llu) does not fit the pool's %llu bytes",
                        (unsigned long long)off, (unsigned long long)len, (unsigned long long)p->capacity);
  m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, (off_t)off);
  if (m == MAP_FAILED)
    return gpupool__err(GPUPOOL_EBACKEND, "cannot map %llu bytes of the pool: %s (check RLIMIT_AS / vm.max_map_count)",
                        (unsigned long long)len, strerror(errno));
  *base = m;
  *priv = NULL;
  return 0;
}

static int host_unmap(gpupool__cpool *p, void *base, uint64_t size, void *priv, void *stream) {
  (void)p;
  (void)priv;
  (void)stream;
  if (munmap(base, size) != 0)
    return gpupool__err(GPUPOOL_EBACKEND, "munmap failed: %s", strerror(errno));
  return 0;
}

const gpupool__cbackend_ops gpupool__host_client_ops = {
    .has_events = 0,
    .pool_import = host_import,
    .pool_release = host_release,
    .pool_set_access = host_set_access,
    .slab_map = host_map,
    .slab_unmap = host_unmap,
};
