/*
 * Client side of the host backend: each slab comes as its own sealed memfd in the reply that
 * first names it (read-only when the hold is), and is mapped shared once per client, read-write
 * or read-only as its fd allows. No events: host memory written before a publish is visible to
 * every process that maps it.
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
  uint64_t capacity;
};

static int host_import(int fd, gpupool_mem_kind kind, int device, uint64_t capacity, gpupool__cpool **out) {
  gpupool__cpool *p;
  (void)device;
  if (fd >= 0)
    close(fd); /* host pools have no pool-wide fd: slabs come with their own */
  if (kind != GPUPOOL_MEM_HOST)
    return gpupool__err(GPUPOOL_ENOTSUP, "the host backend cannot import a pool of GPU memory");
  p = calloc(1, sizeof *p);
  if (!p)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  p->capacity = capacity;
  *out = p;
  return 0;
}

static void host_release(gpupool__cpool *p) { free(p); }

static int host_set_access(gpupool__cpool *p, const int *devices, int n) {
  (void)p;
  (void)devices;
  (void)n;
  return 0;
}

static int host_map(gpupool__cpool *p, const uint8_t *export_data, size_t export_len, uint64_t size,
                    int fd, int writable, void **base, void **priv) {
  gpupool__host_export e;
  struct stat st;
  void *m;
  int rc, seals;
  if ((rc = gpupool__host_export_decode(export_data, export_len, &e)) != 0)
    goto out;
  if (fd < 0) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon sent no fd for a host slab");
    goto out;
  }
  /* The kernel knows the slab's real size: a daemon that got it wrong must not make this
   * process map past the end of the memfd (SIGBUS on the first touch). */
  if (e.offset != 0 || e.size != size || fstat(fd, &st) != 0 || (uint64_t)st.st_size < e.size) {
    rc = gpupool__err(GPUPOOL_EPROTO, "host slab (%llu+%llu) does not match its memfd",
                      (unsigned long long)e.offset, (unsigned long long)e.size);
    goto out;
  }
  /* A memfd that may still shrink could be cut under the mapping later: SIGBUS on a touch.
   * gpupoold seals every slab; anything else is not from gpupoold. */
  seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    rc = gpupool__err(GPUPOOL_EPROTO, "a slab fd from the daemon is not a memfd sealed against shrinking; the "
                      "socket is not served by a gpupoold (check GPUPOOL_SOCKET or the path passed to connect)");
    goto out;
  }
  m = mmap(NULL, e.size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    rc = gpupool__err(GPUPOOL_EBACKEND, "cannot map %llu bytes of a slab: %s (check RLIMIT_AS / vm.max_map_count)",
                      (unsigned long long)e.size, strerror(errno));
    goto out;
  }
  (void)p;
  *base = m;
  *priv = NULL;
out:
  if (fd >= 0)
    close(fd); /* the mapping keeps the memory; the fd is not needed any more */
  return rc;
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
    /* No GPU: file mappings are used from the CPU as they are. */
    .file_register = NULL,
    .file_unregister = NULL,
};
