/*
 * The CUDA backend of gpupoold: stream-ordered memory pools exported with POSIX file
 * descriptors, slabs taken from them with cudaMallocFromPoolAsync and exported with
 * cudaMemPoolExportPointer, and inter-process events the clients record and wait on.
 *
 * This file owns every CUDA object the daemon creates: one daemon stream per device that has
 * a pool (created on first use, so GPUs without a pool get no context), the pools and their
 * exported fds, the slabs' device pointers and the IPC events. The daemon loop is
 * single-threaded, so nothing here locks. The current device is a per-thread setting of the
 * runtime; every per-device call below sets it first rather than trusting what the previous
 * call left behind.
 *
 * Traps this code is shaped around (see DESIGN.md): pointer export fails until the pool has
 * been exported once, so pools are exported at creation; plain host pools cannot carry a
 * POSIX fd, so GPUPOOL_MEM_HOST is refused here; a slab must be materialized (its stream
 * synchronized) before a client imports it; no slab may exceed GPUPOOL_SLAB_HARD_MAX; a
 * host-NUMA pool is mapped only for the CPU until cudaMemPoolSetAccess grants a device, and the
 * daemon's GPU clears every new slab, so the daemon grants its pool's GPU access too.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda.h"
#include "cuda_daemon.h"
#include "errors.h"
#include "gpupool.pb-c.h"
#include "log.h"
#include "vmm.h"

/* Slab size of the pools made when none is configured. */
#define DEFAULT_SLAB (256ull << 20)

typedef gpupool__cuda_dev cuda_dev;
typedef gpupool__cuda_state cuda_state;

struct gpupool__bevent {
  cudaEvent_t ev;
  int device;
};

int gpupool__cuda_set_device(int device) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaSetDevice", device,
                     "check that the device exists and is not in exclusive or prohibited "
                     "compute mode (nvidia-smi -q -d COMPUTE)");
  return 0;
}

/*
 * Look at the driver and every device. Fills usable[] (may be NULL) and returns the number of
 * usable devices (>= 0), with a message naming what is missing when it is 0; *ndev_out gets
 * the device count. Shared by probe, open and default_pools so all three agree. advise: the
 * message also says what to do; without it (auto's probe, which then serves host memory and
 * needs no fix) it names only the cause.
 */
static int scan(int *ndev_out, int **usable_out, int advise) {
  int drv = 0, ndev = 0, nusable = 0;
  int *usable = NULL;
  char why[GPUPOOL__ERRMSG_MAX];
  size_t wl = 0;
  cudaError_t e;

  *ndev_out = 0;
  if (usable_out)
    *usable_out = NULL;
  e = cudaDriverGetVersion(&drv);
  if (e != cudaSuccess) {
    gpupool__cuda_fail(GPUPOOL_ENOTSUP, e, "cudaDriverGetVersion", -1,
              advise ? "install the NVIDIA driver or run gpupoold with --backend host" : NULL);
    return 0;
  }
  if (drv == 0) {
    gpupool__err(GPUPOOL_ENOTSUP, "no NVIDIA driver found (cudaDriverGetVersion returned 0)%s",
                 advise ? ": install the NVIDIA driver or run gpupoold with --backend host" : "");
    return 0;
  }
  e = cudaGetDeviceCount(&ndev);
  if (e == cudaErrorInsufficientDriver) {
    (void)cudaGetLastError();
    gpupool__err(GPUPOOL_ENOTSUP,
                 "the NVIDIA driver supports CUDA %d.%d but gpupoold was built with CUDA %d.%d "
                 "(cudaErrorInsufficientDriver)%s",
                 drv / 1000, (drv % 1000) / 10, CUDART_VERSION / 1000,
                 (CUDART_VERSION % 1000) / 10,
                 advise ? ": upgrade the driver or rebuild gpupool against an older CUDA toolkit" : "");
    return 0;
  }
  if (e == cudaErrorNoDevice || (e == cudaSuccess && ndev == 0)) {
    (void)cudaGetLastError();
    gpupool__err(GPUPOOL_ENOTSUP,
                 "no CUDA device visible (driver %d.%d)%s", drv / 1000, (drv % 1000) / 10,
                 advise ? ": check CUDA_VISIBLE_DEVICES, that /dev/nvidia* exist and are "
                          "accessible to this user, or run gpupoold with --backend host" : "");
    return 0;
  }
  if (e != cudaSuccess) {
    gpupool__cuda_fail(GPUPOOL_ENOTSUP, e, "cudaGetDeviceCount", -1,
              advise ? "check the driver installation (nvidia-smi) or run gpupoold with --backend host"
                     : NULL);
    return 0;
  }
  usable = calloc((size_t)ndev, sizeof(*usable));
  if (!usable) {
    gpupool__err(GPUPOOL_ENOMEM, "out of memory while probing %d CUDA devices", ndev);
    return 0;
  }
  why[0] = '\0';
  for (int d = 0; d < ndev; d++) {
    int pools = 0, types = 0;
    const char *miss = NULL;
    e = cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, d);
    if (e == cudaSuccess && pools)
      e = cudaDeviceGetAttribute(&types, cudaDevAttrMemoryPoolSupportedHandleTypes, d);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      miss = cudaGetErrorName(e);
    } else if (!pools) {
      miss = "lacks stream-ordered memory pools (cudaDevAttrMemoryPoolsSupported = 0)";
    } else if (!(types & cudaMemHandleTypePosixFileDescriptor)) {
      miss = "lacks POSIX-fd pool handles (cudaDevAttrMemoryPoolSupportedHandleTypes has no "
             "cudaMemHandleTypePosixFileDescriptor)";
    }
    if (miss) {
      int n = snprintf(why + wl, sizeof(why) - wl, "%sdevice %d %s", wl ? "; " : "", d, miss);
      if (n > 0 && (size_t)n < sizeof(why) - wl)
        wl += (size_t)n;
      continue;
    }
    usable[d] = 1;
    nusable++;
  }
  if (nusable == 0)
    gpupool__err(GPUPOOL_ENOTSUP,
                 "no usable CUDA device among %d (driver %d.%d): %s%s",
                 ndev, drv / 1000, (drv % 1000) / 10, why,
                 advise ? "; gpupool needs memory pools exportable as POSIX fds (CUDA 11.2+ "
                          "driver, Linux, not WSL); run gpupoold with --backend host" : "");
  *ndev_out = ndev;
  if (usable_out)
    *usable_out = usable;
  else
    free(usable);
  return nusable;
}

int gpupool__cuda_probe(void) {
  int ndev = 0;
  return scan(&ndev, NULL, 0) > 0 ? 1 : 0;
}

int gpupool__cuda_default_pools(gpupool__pool_config *pools, int max, int *n) {
  int ndev = 0, *usable = NULL, rc = 0;

  if (*n > 0)
    return 0;
  if (scan(&ndev, &usable, 1) == 0) {
    free(usable);
    return GPUPOOL_ENOTSUP; /* message recorded by scan() */
  }
  for (int d = 0; d < ndev; d++) {
    struct cudaDeviceProp prop;
    gpupool__pool_config *p;
    cudaError_t e;
    uint64_t cap;

    if (!usable[d])
      continue;
    if (*n >= max) {
      GPUPOOL__WARN("cuda: %d devices but at most %d pools; device %d and later get no default pool",
              ndev, max, d);
      break;
    }
    e = cudaGetDeviceProperties(&prop, d);
    if (e != cudaSuccess) {
      rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaGetDeviceProperties", d,
                     "configure pools explicitly with --pool or [pool NAME] sections");
      goto out;
    }
    /* A quarter of the device: leaves room for the clients' own contexts and allocations,
     * since an IPC pool never gives memory back once reserved. */
    cap = (uint64_t)prop.totalGlobalMem / 4 / DEFAULT_SLAB * DEFAULT_SLAB;
    if (cap < DEFAULT_SLAB) {
      GPUPOOL__WARN("cuda: device %d has only %zu bytes; no default pool for it", d,
              prop.totalGlobalMem);
      continue;
    }
    p = &pools[*n];
    gpupool__pool_config_init(p);
    snprintf(p->name, sizeof(p->name), "gpu%d", d);
    p->kind = GPUPOOL_MEM_DEVICE;
    p->device = d;
    p->capacity = cap;
    p->slab_size = DEFAULT_SLAB;
    (*n)++;
    GPUPOOL__INFO("cuda: default pool \"%s\" on device %d (%s), capacity %llu MiB", p->name, d,
            prop.name, (unsigned long long)(cap >> 20));
  }
  if (*n == 0)
    rc = gpupool__err(GPUPOOL_ENOTSUP, "no CUDA device has enough memory for a default pool: "
                      "configure a pool explicitly with --pool");
out:
  free(usable);
  return rc;
}

/* The daemon stream of a device, created on first use. */
static int dev_stream(cuda_state *st, int device, cudaStream_t *out) {
  cuda_dev *d;
  cudaError_t e;
  int rc;

  if (device < 0 || device >= st->ndev)
    return gpupool__err(GPUPOOL_EINVAL, "CUDA device %d does not exist (%d visible): fix the "
                        "pool's device= setting", device, st->ndev);
  d = &st->dev[device];
  if ((rc = gpupool__cuda_set_device(device)) < 0)
    return rc;
  if (!d->has_stream) {
    /* Non-blocking: the daemon's allocations and frees must not serialize with anything a
     * library might queue on the legacy default stream of the same context. */
    e = cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess)
      return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaStreamCreateWithFlags", device, NULL);
    d->has_stream = 1;
  }
  *out = d->stream;
  return 0;
}

static int set_pool_attr(cudaMemPool_t pool, enum cudaMemPoolAttr attr, const char *what,
                         int64_t v, int device) {
  cudaError_t e;
  if (v < 0)
    return 0;
  if (attr == cudaMemPoolAttrReleaseThreshold) {
    unsigned long long u = (unsigned long long)v;
    e = cudaMemPoolSetAttribute(pool, attr, &u);
  } else {
    int i = v ? 1 : 0;
    e = cudaMemPoolSetAttribute(pool, attr, &i);
  }
  if (e != cudaSuccess) {
    char call[96];
    snprintf(call, sizeof(call), "cudaMemPoolSetAttribute(%s)", what);
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, call, device, "remove the setting from the pool");
  }
  return 0;
}

static int cuda_pool_create(gpupool__backend *be, const gpupool__pool_config *cfg,
                            gpupool__bpool **out, int *fd_out) {
  cuda_state *st = be->priv;
  struct cudaMemPoolProps props;
  gpupool__bpool *p = NULL;
  cudaStream_t stream = NULL; /* set by dev_stream; initialised for -O3 -Werror (maybe-uninitialized) */
  cudaError_t e;
  int rc, fd = -1, created = 0;

  *out = NULL;
  *fd_out = -1;
  if (cfg->kind == GPUPOOL_MEM_HOST)
    return gpupool__err(GPUPOOL_ENOTSUP,
                        "pool \"%s\": kind=host cannot be shared by the CUDA backend (CUDA "
                        "refuses POSIX-fd handles for plain host pools): use kind=host-numa "
                        "with numa=<node> for pinned host memory, or run gpupoold with "
                        "--backend host", cfg->name);
  if (cfg->kind != GPUPOOL_MEM_DEVICE && cfg->kind != GPUPOOL_MEM_HOST_NUMA)
    return gpupool__err(GPUPOOL_EINVAL, "pool \"%s\": unknown memory kind %d", cfg->name,
                        (int)cfg->kind);
  if (cfg->device < 0 || cfg->device >= st->ndev)
    return gpupool__err(GPUPOOL_ECONFIG, "pool \"%s\": CUDA device %d does not exist (%d "
                        "visible): fix device=", cfg->name, cfg->device, st->ndev);
  if (!st->dev[cfg->device].usable)
    return gpupool__err(GPUPOOL_ENOTSUP, "pool \"%s\": CUDA device %d lacks memory pools with "
                        "POSIX-fd handles: put the pool on another device", cfg->name,
                        cfg->device);
  if (cfg->capacity == 0)
    return gpupool__err(GPUPOOL_ECONFIG, "pool \"%s\": capacity is 0: set capacity=",
                        cfg->name);
  if (cfg->kind == GPUPOOL_MEM_HOST_NUMA) {
    int ok = 0;
    e = cudaDeviceGetAttribute(&ok, cudaDevAttrHostNumaMemoryPoolsSupported, cfg->device);
    if (e != cudaSuccess)
      return gpupool__cuda_fail(GPUPOOL_EBACKEND, e,
                       "cudaDeviceGetAttribute(cudaDevAttrHostNumaMemoryPoolsSupported)",
                       cfg->device, NULL);
    if (!ok)
      return gpupool__err(GPUPOOL_ENOTSUP, "pool \"%s\": CUDA device %d does not support "
                          "host-NUMA memory pools (cudaDevAttrHostNumaMemoryPoolsSupported = "
                          "0): use kind=device", cfg->name, cfg->device);
    if (cfg->numa_node < 0)
      return gpupool__err(GPUPOOL_ECONFIG, "pool \"%s\": kind=host-numa needs numa=<node>",
                          cfg->name);
  }
  if ((rc = dev_stream(st, cfg->device, &stream)) < 0)
    return rc;

  p = calloc(1, sizeof(*p));
  if (!p)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory creating pool \"%s\"", cfg->name);
  p->st = st;
  p->fd = -1;
  p->device = cfg->device;
  p->host = cfg->kind == GPUPOOL_MEM_HOST_NUMA;
  p->capacity = cfg->capacity;
  snprintf(p->name, sizeof(p->name), "%s", cfg->name);
  if (cfg->survive) {
    /* No pool object at all: each slab is its own allocation with its own fd (vmm.h), and
     * clients get no pool fd. Pool attributes belong to stream-ordered pools only. */
    if (cfg->release_threshold >= 0 || cfg->reuse_follow_event_deps >= 0 ||
        cfg->reuse_allow_opportunistic >= 0 || cfg->reuse_allow_internal_deps >= 0) {
      rc = gpupool__err(GPUPOOL_ECONFIG, "pool \"%s\": release_threshold and reuse_* are attributes of "
                        "stream-ordered pools, which a survive=yes pool does not use: remove them", cfg->name);
      goto fail;
    }
    p->numa = cfg->kind == GPUPOOL_MEM_HOST_NUMA ? cfg->numa_node : -1;
    if ((rc = gpupool__vmm_granularity(cfg->device, p->numa, &p->gran)) != 0) {
      gpupool__error why;
      gpupool__error_take(&why, rc);
      rc = gpupool__err(rc, "pool \"%s\": %s", cfg->name, why.msg);
      goto fail;
    }
    p->vmm = 1;
    if (!st->event_dev_fixed) {
      st->event_dev = cfg->device;
      st->event_dev_fixed = 1;
    }
    GPUPOOL__DEBUG("cuda: pool \"%s\" created on %s %d, max %llu MiB, surviving slabs (granularity %llu KiB)",
                   cfg->name, p->numa < 0 ? "device" : "NUMA node", p->numa < 0 ? cfg->device : p->numa,
                   (unsigned long long)(cfg->capacity >> 20), (unsigned long long)(p->gran >> 10));
    *out = p;
    return 0;
  }

  memset(&props, 0, sizeof(props));
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypePosixFileDescriptor;
  if (cfg->kind == GPUPOOL_MEM_DEVICE) {
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = cfg->device;
  } else {
    props.location.type = cudaMemLocationTypeHostNuma;
    props.location.id = cfg->numa_node;
  }
  /* An IPC pool never returns memory to the system, so its bound is the only bound. */
  props.maxSize = (size_t)cfg->capacity;
  e = cudaMemPoolCreate(&p->pool, &props);
  if (e != cudaSuccess) {
    rc = gpupool__cuda_fail(e == cudaErrorMemoryAllocation ? GPUPOOL_ENOSPC : GPUPOOL_EBACKEND, e,
                   "cudaMemPoolCreate (POSIX-fd handles)", cfg->device,
                   "check the pool's capacity against the device memory and, for host-numa, "
                   "that the NUMA node exists");
    goto fail;
  }
  created = 1;
  if ((rc = set_pool_attr(p->pool, cudaMemPoolAttrReleaseThreshold, "release_threshold",
                          cfg->release_threshold, cfg->device)) < 0 ||
      (rc = set_pool_attr(p->pool, cudaMemPoolReuseFollowEventDependencies,
                          "reuse_follow_event_deps", cfg->reuse_follow_event_deps,
                          cfg->device)) < 0 ||
      (rc = set_pool_attr(p->pool, cudaMemPoolReuseAllowOpportunistic,
                          "reuse_allow_opportunistic", cfg->reuse_allow_opportunistic,
                          cfg->device)) < 0 ||
      (rc = set_pool_attr(p->pool, cudaMemPoolReuseAllowInternalDependencies,
                          "reuse_allow_internal_deps", cfg->reuse_allow_internal_deps,
                          cfg->device)) < 0)
    goto fail;
  /* A host-NUMA pool's memory is mapped only for the CPU until a device is granted access
   * (cudaMemPoolCreate), and the daemon clears every new slab with cudaMemsetAsync on this
   * GPU's stream: without access that memset would touch memory the GPU does not map.
   * Access is per process, so this grants no client anything; clients grant their own
   * (cuda_client.c). */
  if (cfg->kind == GPUPOOL_MEM_HOST_NUMA) {
    e = gpupool__cuda_pool_access(p->pool, cfg->device, cudaMemAccessFlagsProtReadWrite);
    if (e != cudaSuccess) {
      rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e,
                              "cudaMemPoolSetAccess (the pool's GPU on a host-NUMA pool)",
                              cfg->device, "use kind=device, or a driver that supports "
                              "host-NUMA memory pools fully");
      goto fail;
    }
    p->granted = 1;
  }

  /* Export once now: cudaMemPoolExportPointer returns cudaErrorInvalidValue on a pool that
   * was never exported, and this fd is what every client imports. */
  e = cudaMemPoolExportToShareableHandle(&fd, p->pool, cudaMemHandleTypePosixFileDescriptor, 0);
  if (e != cudaSuccess) {
    rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaMemPoolExportToShareableHandle", cfg->device,
                   "check the open-files limit (ulimit -n) and that the driver supports "
                   "POSIX-fd pool export");
    goto fail;
  }
  if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
    GPUPOOL__WARN("cuda: pool \"%s\": cannot set close-on-exec on its fd: %s", cfg->name,
            strerror(errno));
  p->fd = fd;
  /* Events live on the first pool's device: its context exists already, so creating events
   * opens no context on a GPU the daemon would not otherwise touch. */
  if (!st->event_dev_fixed) {
    st->event_dev = cfg->device;
    st->event_dev_fixed = 1;
  }
  /* Debug: one is made per tenant on first use, which tenants (not the operator) decide. */
  GPUPOOL__DEBUG("cuda: pool \"%s\" created on %s %d, max %llu MiB, fd %d", cfg->name,
          cfg->kind == GPUPOOL_MEM_DEVICE ? "device" : "NUMA node",
          cfg->kind == GPUPOOL_MEM_DEVICE ? cfg->device : cfg->numa_node,
          (unsigned long long)(cfg->capacity >> 20), fd);
  *out = p;
  *fd_out = fd;
  return 0;

fail:
  if (p->granted && gpupool__cuda_pool_access(p->pool, p->device, cudaMemAccessFlagsProtNone) != cudaSuccess)
    (void)cudaGetLastError();
  if (created) {
    e = cudaMemPoolDestroy(p->pool);
    if (e != cudaSuccess)
      (void)cudaGetLastError();
  }
  free(p);
  return rc;
}

/* The registry destroys a tenant's pool once idle: every slab freed (each cudaFreeAsync
 * synchronized, so nothing of it is outstanding) and no connected client attached. Destroying
 * is what gives an IPC pool's memory back. The access the daemon granted (its GPU's to a
 * host-NUMA pool, other GPUs' for the copy engine) is taken back first, so a recycled handle
 * inherits no access state (importers clear theirs before destroying their imports,
 * cuda_client.c). */
static void cuda_pool_destroy(gpupool__bpool *p) {
  gpupool__error why;
  cudaError_t e;
  int rc;
  if (!p)
    return;
  gpupool__cuda_copy_pool_forget(p);
  if (p->vmm) {
    /* Nothing to destroy: every slab was freed (and unmapped) first. */
    if (p->vslabs)
      GPUPOOL__ERROR("cuda: pool \"%s\" destroyed with slabs still mapped", p->name);
    free(p);
    return;
  }
  if ((rc = gpupool__cuda_set_device(p->device)) == 0) {
    if (p->granted) {
      e = gpupool__cuda_pool_access(p->pool, p->device, cudaMemAccessFlagsProtNone);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        GPUPOOL__WARN("cuda: pool \"%s\": taking back device %d's access before destroying it: "
                      "%s (%s)", p->name, p->device, cudaGetErrorName(e), cudaGetErrorString(e));
      }
    }
    e = cudaMemPoolDestroy(p->pool);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      GPUPOOL__ERROR("cuda: cudaMemPoolDestroy of pool \"%s\" on device %d: %s (%s)", p->name,
               p->device, cudaGetErrorName(e), cudaGetErrorString(e));
    }
  } else {
    gpupool__error_take(&why, rc);
    GPUPOOL__ERROR("cuda: pool \"%s\": %s", p->name, why.msg);
  }
  if (p->fd >= 0)
    close(p->fd);
  free(p);
}

/* ---- survive=yes pools: a cuMemCreate allocation per slab, exported as an fd ------------- */

static int vslab_room(gpupool__bpool *p, uint64_t mapped) {
  if (p->reserved + mapped > p->capacity)
    return gpupool__err(GPUPOOL_ENOSPC, "pool \"%s\" has no room for a slab of %llu bytes (%llu of %llu "
                        "bytes in slabs): free buffers or raise the pool's capacity", p->name,
                        (unsigned long long)mapped, (unsigned long long)p->reserved,
                        (unsigned long long)p->capacity);
  return 0;
}

static int vslab_add(gpupool__bpool *p, void *va, uint64_t size, uint64_t mapped, int fd, gpupool__bslab *out) {
  gpupool__cuda_vslab *v = calloc(1, sizeof *v);
  if (!v)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory recording a slab");
  v->va = va;
  v->mapped = mapped;
  v->fd = fd;
  v->next = p->vslabs;
  p->vslabs = v;
  p->reserved += mapped;
  if (p->reserved > p->reserved_high)
    p->reserved_high = p->reserved;
  memset(out, 0, sizeof *out);
  out->size = size;
  /* Read-only is advisory for CUDA memory (access flags are the importer's own), as on the
   * stream-ordered pools: a read-only hold gets the same fd. */
  out->fd = out->fd_ro = fd;
  out->export_len = gpupool__vmm_export_encode(mapped, out->export_data);
  out->priv = va;
  return 0;
}

static int vslab_alloc(gpupool__bpool *p, uint64_t size, uint64_t filled, gpupool__bslab *out) {
  cudaStream_t stream = NULL;
  uint64_t mapped = gpupool__vmm_round(size, p->gran);
  void *va = NULL;
  cudaError_t e;
  int rc, fd = -1;

  if ((rc = vslab_room(p, mapped)) != 0 || (rc = dev_stream(p->st, p->device, &stream)) < 0)
    return rc;
  if ((rc = gpupool__vmm_create(p->device, p->numa, mapped, p->copy_access, &fd, &va)) != 0)
    return rc;
  (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
  /* Fresh physical memory may hold what another process freed: clear it before anyone sees
   * it (see cuda_slab_alloc), except what the caller overwrites. */
  e = filled < mapped ? cudaMemsetAsync((char *)va + filled, 0, (size_t)(mapped - filled), stream) : cudaSuccess;
  if (e == cudaSuccess)
    e = cudaStreamSynchronize(stream);
  if (e == cudaSuccess && (rc = vslab_add(p, va, size, mapped, fd, out)) == 0)
    return 0;
  {
    gpupool__error why;
    if (e != cudaSuccess)
      rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "clearing a new slab (cudaMemsetAsync)", p->device, NULL);
    gpupool__error_take(&why, rc); /* kept across the clean-up's own calls */
    (void)gpupool__vmm_unmap(va, mapped);
    close(fd);
    return gpupool__err(rc, "%s", why.msg);
  }
}

static void vslab_free(gpupool__bpool *p, gpupool__bslab *s) {
  gpupool__cuda_vslab **pp, *v;
  cudaStream_t stream = NULL;
  gpupool__error why;
  int rc;

  for (pp = &p->vslabs; *pp && (*pp)->va != s->priv; pp = &(*pp)->next)
    ;
  if (!(v = *pp)) {
    GPUPOOL__ERROR("cuda: pool \"%s\": freeing slab %p, which it does not have", p->name, s->priv);
    return;
  }
  *pp = v->next;
  /* The daemon's own work on it (a memset, the copy engine's copies) is done: the registry
   * frees a slab only once its copies ended. Its stream is synchronized all the same, since
   * unmapping under a running memset would fault it. */
  if (dev_stream(p->st, p->device, &stream) == 0 && cudaStreamSynchronize(stream) != cudaSuccess)
    (void)cudaGetLastError();
  gpupool__err_clear();
  if ((rc = gpupool__vmm_unmap(v->va, v->mapped)) != 0) {
    gpupool__error_take(&why, rc);
    GPUPOOL__ERROR("cuda: pool \"%s\": unmapping slab %p (%llu bytes): %s", p->name, v->va,
                   (unsigned long long)v->mapped, why.msg);
  }
  /* The memory goes back to the driver with the last fd and mapping of it: ours now, the
   * clients' already (they unmapped before the registry frees). */
  close(v->fd);
  p->reserved -= v->mapped;
  free(v);
  s->priv = NULL;
  s->fd = s->fd_ro = -1;
}

/* A slab a previous daemon made: import its fd (the first export's, kept in the store; an
 * imported handle cannot be exported again) and map it as that daemon did. */
static int cuda_slab_adopt(gpupool__bpool *p, int fd, uint64_t size, gpupool__bslab *out) {
  uint64_t mapped;
  void *va = NULL;
  int rc;

  if (!p->vmm)
    return gpupool__err(GPUPOOL_ENOTSUP, "pool \"%s\" is not survive=yes: its slabs are pieces of a "
                        "stream-ordered pool, which no later daemon can own", p->name);
  if (size == 0 || size > GPUPOOL_SLAB_HARD_MAX)
    return gpupool__err(GPUPOOL_EINVAL, "a slab of %llu bytes is not a size this backend makes",
                        (unsigned long long)size);
  mapped = gpupool__vmm_round(size, p->gran);
  if ((rc = vslab_room(p, mapped)) != 0)
    return rc;
  if ((rc = gpupool__vmm_import(fd, p->device, p->numa >= 0 ? p->numa : GPUPOOL__VMM_DEVICE, mapped, p->copy_access,
                                NULL, 0, &va)) != 0)
    return rc;
  (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
  if ((rc = vslab_add(p, va, size, mapped, fd, out)) != 0) {
    (void)gpupool__vmm_unmap(va, mapped);
    return rc;
  }
  return 0;
}

static int cuda_slab_alloc(gpupool__bpool *p, uint64_t size, uint64_t filled, gpupool__bslab *out) {
  struct cudaMemPoolPtrExportData exp;
  cudaStream_t stream = NULL; /* set by dev_stream; initialised for -O3 -Werror (maybe-uninitialized) */
  void *ptr = NULL;
  cudaError_t e;
  int rc;

  memset(out, 0, sizeof(*out));
  if (size == 0)
    return gpupool__err(GPUPOOL_EINVAL, "pool \"%s\": slab of 0 bytes", p->name);
  if (size > GPUPOOL_SLAB_HARD_MAX)
    return gpupool__err(GPUPOOL_ETOOBIG,
                        "pool \"%s\": a slab of %llu bytes exceeds the %llu-byte limit on one "
                        "exported CUDA allocation (importers crash or corrupt above it): split "
                        "the buffer", p->name, (unsigned long long)size,
                        (unsigned long long)GPUPOOL_SLAB_HARD_MAX);
  if (p->vmm)
    return vslab_alloc(p, size, filled, out);
  if ((rc = dev_stream(p->st, p->device, &stream)) < 0)
    return rc;
  e = cudaMallocFromPoolAsync(&ptr, (size_t)size, p->pool, stream);
  if (e == cudaErrorMemoryAllocation)
    return gpupool__cuda_fail(GPUPOOL_ENOSPC, e, "cudaMallocFromPoolAsync", p->device,
                     "the pool reached its capacity or the device is out of memory; free "
                     "buffers or raise the pool's capacity");
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaMallocFromPoolAsync", p->device, NULL);
  /* A new slab may be memory another tenant's pool gave back to the driver inside this
   * process, which the driver does not clear: zero it before anyone sees it (in stream
   * order, so the synchronize below covers it), except the first `filled` bytes, which the
   * caller overwrites before any client is told of the slab. Reuse of ranges inside a slab
   * never crosses tenants (each tenant has its own pool). */
  if (filled < size) {
    e = cudaMemsetAsync((char *)ptr + filled, 0, (size_t)(size - filled), stream);
    if (e != cudaSuccess) {
      rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaMemsetAsync clearing a new slab", p->device, NULL);
      goto fail;
    }
  }
  /* Clients import the slab from another process, outside this stream's order: the
   * allocation must have completed before its export data leaves the daemon. */
  e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaStreamSynchronize after cudaMallocFromPoolAsync",
                   p->device, NULL);
    goto fail;
  }
  memset(&exp, 0, sizeof(exp));
  e = cudaMemPoolExportPointer(&exp, ptr);
  if (e != cudaSuccess) {
    rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaMemPoolExportPointer", p->device, NULL);
    goto fail;
  }
  out->export_len = gpupool__cuda_export_encode(&exp, out->export_data);
  out->size = size;
  out->fd = out->fd_ro = -1; /* clients import slabs through the pool's fd */
  out->priv = ptr;
  return 0;

fail:
  e = cudaFreeAsync(ptr, stream);
  if (e == cudaSuccess)
    e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    GPUPOOL__ERROR("cuda: pool \"%s\": freeing a slab that failed to export: %s (%s)", p->name,
             cudaGetErrorName(e), cudaGetErrorString(e));
  }
  return rc;
}

static void cuda_slab_free(gpupool__bpool *p, gpupool__bslab *s) {
  cudaStream_t stream = NULL; /* set by dev_stream; initialised for -O3 -Werror (maybe-uninitialized) */
  gpupool__error why;
  cudaError_t e;
  int rc;

  if (!s || !s->priv)
    return;
  if (p->vmm) {
    vslab_free(p, s);
    return;
  }
  if ((rc = dev_stream(p->st, p->device, &stream)) < 0) {
    gpupool__error_take(&why, rc);
    GPUPOOL__ERROR("cuda: pool \"%s\": cannot free slab %p: %s", p->name, s->priv, why.msg);
    return;
  }
  e = cudaFreeAsync(s->priv, stream);
  /* Synchronize so the pool's used counter and the next allocation see the memory back. */
  if (e == cudaSuccess)
    e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    GPUPOOL__ERROR("cuda: pool \"%s\": freeing slab %p (%llu bytes) on device %d: %s (%s)", p->name,
             s->priv, (unsigned long long)s->size, p->device, cudaGetErrorName(e),
             cudaGetErrorString(e));
  }
  s->priv = NULL;
}

static int cuda_pool_stats(gpupool__bpool *p, gpupool__bpool_stats *out) {
  static const struct {
    enum cudaMemPoolAttr attr;
    const char *name;
  } attrs[4] = {
      {cudaMemPoolAttrReservedMemCurrent, "cudaMemPoolAttrReservedMemCurrent"},
      {cudaMemPoolAttrReservedMemHigh, "cudaMemPoolAttrReservedMemHigh"},
      {cudaMemPoolAttrUsedMemCurrent, "cudaMemPoolAttrUsedMemCurrent"},
      {cudaMemPoolAttrUsedMemHigh, "cudaMemPoolAttrUsedMemHigh"},
  };
  unsigned long long v[4];
  cudaError_t e;

  memset(out, 0, sizeof(*out));
  if (p->vmm) {
    /* Every mapped byte is a slab's: in use as far as the driver is concerned. */
    out->reserved_cur = out->used_cur = p->reserved;
    out->reserved_high = out->used_high = p->reserved_high;
    return 0;
  }
  for (int i = 0; i < 4; i++) {
    v[i] = 0;
    e = cudaMemPoolGetAttribute(p->pool, attrs[i].attr, &v[i]);
    if (e != cudaSuccess) {
      char call[96];
      snprintf(call, sizeof(call), "cudaMemPoolGetAttribute(%s)", attrs[i].name);
      return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, call, p->device, NULL);
    }
  }
  out->reserved_cur = v[0];
  out->reserved_high = v[1];
  out->used_cur = v[2];
  out->used_high = v[3];
  return 0;
}

static int cuda_event_create(gpupool__backend *be, gpupool__bevent **out,
                             uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE]) {
  cuda_state *st = be->priv;
  gpupool__bevent *ev;
  cudaIpcEventHandle_t h;
  cudaError_t e;
  int rc;

  _Static_assert(sizeof(h) == GPUPOOL_EVENT_HANDLE_SIZE, "IPC event handle is 64 bytes");
  *out = NULL;
  ev = calloc(1, sizeof(*ev));
  if (!ev)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory creating an IPC event");
  ev->device = st->event_dev;
  if ((rc = gpupool__cuda_set_device(ev->device)) < 0)
    goto fail;
  e = cudaEventCreateWithFlags(&ev->ev, cudaEventInterprocess | cudaEventDisableTiming);
  if (e != cudaSuccess) {
    rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e,
                   "cudaEventCreateWithFlags(cudaEventInterprocess|cudaEventDisableTiming)",
                   ev->device, NULL);
    goto fail;
  }
  e = cudaIpcGetEventHandle(&h, ev->ev);
  if (e != cudaSuccess) {
    rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaIpcGetEventHandle", ev->device,
                   "IPC events need a Linux driver with unified addressing");
    (void)cudaEventDestroy(ev->ev);
    goto fail;
  }
  memcpy(handle, &h, sizeof(h));
  *out = ev;
  return 0;

fail:
  free(ev);
  return rc;
}

static int cuda_event_query(gpupool__bevent *ev) {
  cudaError_t e;
  int rc;
  if ((rc = gpupool__cuda_set_device(ev->device)) < 0)
    return rc;
  e = cudaEventQuery(ev->ev);
  if (e == cudaSuccess)
    return 1;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return 0;
  }
  return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaEventQuery", ev->device,
                   "a client's work on this buffer failed; the buffer's range is not reused");
}

static void cuda_event_destroy(gpupool__bevent *ev) {
  cudaError_t e;
  if (!ev)
    return;
  if (gpupool__cuda_set_device(ev->device) == 0) {
    e = cudaEventDestroy(ev->ev);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      GPUPOOL__ERROR("cuda: cudaEventDestroy on device %d: %s (%s)", ev->device, cudaGetErrorName(e),
               cudaGetErrorString(e));
    }
  }
  free(ev);
}

static void cuda_close(gpupool__backend *be) {
  cuda_state *st;
  if (!be)
    return;
  st = be->priv;
  if (st) {
    gpupool__cuda_copy_close(st);
    for (int d = 0; d < st->ndev; d++) {
      if (!st->dev[d].has_stream)
        continue;
      if (cudaSetDevice(d) == cudaSuccess && cudaStreamDestroy(st->dev[d].stream) == cudaSuccess)
        continue;
      (void)cudaGetLastError();
      GPUPOOL__WARN("cuda: cannot destroy the daemon stream of device %d", d);
    }
    free(st->peer);
    free(st->dev);
    free(st);
  }
  free(be);
}

static const gpupool__backend_ops cuda_ops = {
    .has_events = 1,
    .pool_create = cuda_pool_create,
    .pool_destroy = cuda_pool_destroy,
    .slab_alloc = cuda_slab_alloc,
    .slab_free = cuda_slab_free,
    .slab_adopt = cuda_slab_adopt,
    .pool_stats = cuda_pool_stats,
    .event_create = cuda_event_create,
    .event_query = cuda_event_query,
    .event_destroy = cuda_event_destroy,
    .close = cuda_close,
    .copy_start = gpupool__cuda_copy_start,
    .copy_poll = gpupool__cuda_copy_poll,
    .copy_free = gpupool__cuda_copy_free,
    .copy_notify_fd = gpupool__cuda_copy_notify_fd,
};

int gpupool__cuda_open(gpupool__backend **out) {
  gpupool__backend *be = NULL;
  cuda_state *st = NULL;
  int ndev = 0, nusable, *usable = NULL, rc;

  *out = NULL;
  nusable = scan(&ndev, &usable, 1);
  if (nusable == 0) {
    free(usable);
    return GPUPOOL_ENOTSUP; /* message recorded by scan() */
  }
  be = calloc(1, sizeof(*be));
  st = calloc(1, sizeof(*st));
  if (!be || !st) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory opening the CUDA backend");
    goto fail;
  }
  st->dev = calloc((size_t)ndev, sizeof(*st->dev));
  st->peer = calloc((size_t)ndev * (size_t)ndev, sizeof(*st->peer));
  if (!st->dev || !st->peer) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory opening the CUDA backend");
    goto fail;
  }
  st->ndev = ndev;
  st->event_dev = -1;
  gpupool__cuda_copy_init(st);
  for (int d = 0; d < ndev; d++) {
    st->dev[d].usable = usable[d];
    if (usable[d] && st->event_dev < 0)
      st->event_dev = d;
    if (!usable[d])
      GPUPOOL__WARN("cuda: device %d lacks memory pools with POSIX-fd handles; pools on it are "
              "refused", d);
  }
  be->desc = &gpupool__backend_cuda;
  be->ops = &cuda_ops;
  be->priv = st;
  free(usable);
  {
    int drv = 0;
    (void)cudaDriverGetVersion(&drv);
    GPUPOOL__INFO("cuda: backend open, driver %d.%d, runtime %d.%d, %d of %d devices usable",
            drv / 1000, (drv % 1000) / 10, CUDART_VERSION / 1000,
            (CUDART_VERSION % 1000) / 10, nusable, ndev);
  }
  *out = be;
  return 0;

fail:
  if (st) {
    free(st->peer);
    free(st->dev);
  }
  free(st);
  free(be);
  free(usable);
  return rc;
}
