/*
 * The client library's CUDA backend: imports a pool from the fd gpupoold sent
 * (cudaMemPoolImportFromShareableHandle), grants other devices access to it, maps slabs from
 * their export data (cudaMemPoolImportPointer), unmaps them in stream order, and opens,
 * records and waits on the daemon's inter-process events.
 *
 * Owns: the process-wide tables of imported pools (and the access granted on them) and of
 * imported slab pointers, and the opened events.
 *
 * Threads: the client core serializes calls per connection, but several connections may live
 * in one process (a library's client next to the application's), so the tables have their
 * own mutex. Calls that must run with a given
 * current device (it is a per-thread runtime setting that belongs to the application) save
 * and restore the caller's device around the call.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda.h"
#include "errors.h"
#include "vmm.h"

/*
 * The driver keeps imports per process, not per caller: importing a pool that this process has
 * imported already returns the same cudaMemPool_t, access set on it applies to every pointer
 * of it, and importing an allocation that is mapped already returns the same pointer (device
 * memory; the first free unmaps it for both) or fails with cudaErrorAlreadyMapped (pinned
 * host-NUMA memory). Each connection of the client core imports what it is sent, so two
 * connections of one process (one per PinnedLoader, a library's next to the application's)
 * meet the same pool and slabs. Hence one record per imported pool and per imported slab,
 * counted over every connection of the process: a pool's access is taken back and the pool
 * destroyed with its last user, a slab is imported by its first user and freed by its last.
 */
typedef struct ipool {
  cudaMemPool_t pool;
  uint64_t refs;   /* gpupool__cpool handles (connections) using it */
  int *granted;    /* devices given access; cleared again by the last user */
  int n_granted;
  struct ipool *next;
} ipool;

/* A slab of a survive=yes pool, mapped from its own fd (vmm.h): each connection imports and
 * maps its own, so none of the per-process sharing above applies. */
typedef struct vmap {
  void *va;
  uint64_t mapped;
  struct vmap *next;
} vmap;

struct gpupool__cpool {
  ipool *ip;    /* NULL for a survive=yes pool (vmm) */
  gpupool_mem_kind kind;
  int device;   /* resident device (DEVICE) or the GPU the daemon serves it to (HOST_NUMA) */
  int vmm;      /* slabs come with their own fds (the daemon sent no pool fd) */
  int *access;  /* vmm: devices given access, applied to every slab mapped now and later */
  int naccess;
  vmap *maps;   /* vmm: mapped slabs */
};

/* One imported slab: its export data names the allocation (it differs for every allocation,
 * even one at an address used before). */
typedef struct imp {
  cudaMemPool_t pool;
  uint8_t data[sizeof(struct cudaMemPoolPtrExportData)];
  void *ptr;
  uint64_t refs;       /* slab_map calls not yet undone */
  int device;
  cudaEvent_t freed;   /* dying: recorded after its cudaFreeAsync */
  struct imp *next;
} imp;

static pthread_mutex_t imp_lock = PTHREAD_MUTEX_INITIALIZER;
static ipool *ipools;
static imp *imports; /* mapped */
static imp *dying;   /* freed in a stream, the free perhaps not run yet */

/* One opened copy of the IPC event per device: cudaEventRecord needs the event and the stream
 * in the same context, and an application may record from streams of several devices. */
typedef struct {
  int device;
  cudaEvent_t ev;
} ev_slot;

struct gpupool__cevent {
  cudaIpcEventHandle_t handle;
  ev_slot *slots;
  int n;
};

/* Make device current, remembering the caller's device in *prev. */
static int push_device(int device, int *prev) {
  cudaError_t e = cudaGetDevice(prev);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaGetDevice", device,
                     "check that a CUDA device is visible to this process (CUDA_VISIBLE_DEVICES)");
  if (*prev == device)
    return 0;
  e = cudaSetDevice(device);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaSetDevice", device,
                     "the pool lives on a device this process cannot see; check "
                     "CUDA_VISIBLE_DEVICES (device ordinals must match the daemon's)");
  return 0;
}

static void pop_device(int device, int prev) {
  if (prev != device && cudaSetDevice(prev) != cudaSuccess)
    (void)cudaGetLastError();
}

static int set_access(cudaMemPool_t pool, int device, enum cudaMemAccessFlags flags) {
  cudaError_t e = gpupool__cuda_pool_access(pool, device, flags);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaMemPoolSetAccess", device, NULL);
  return 0;
}

static int add_granted(ipool *p, int device) {
  for (int i = 0; i < p->n_granted; i++)
    if (p->granted[i] == device)
      return 0;
  int *g = realloc(p->granted, (size_t)(p->n_granted + 1) * sizeof(*g));
  if (!g)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory recording pool access");
  g[p->n_granted++] = device;
  p->granted = g;
  return 0;
}

/* The last user of ip is gone: take back the access granted on it and destroy it. A destroyed
 * handle can be recycled for the next import in this process and inherit its peer access;
 * work already queued on a granted device may still read the pool (a release only orders the
 * free after it), and pulling the mapping from under a running kernel faults it: drain those
 * devices first. The resident device of a device pool cannot lose access and was never
 * granted. With imp_lock held. */
static void ipool_drop(ipool *ip) {
  int prev = -1;
  for (ipool **pp = &ipools; *pp; pp = &(*pp)->next)
    if (*pp == ip) {
      *pp = ip->next;
      break;
    }
  if (ip->n_granted > 0 && cudaGetDevice(&prev) == cudaSuccess) {
    for (int i = 0; i < ip->n_granted; i++) {
      struct cudaMemAccessDesc d;
      memset(&d, 0, sizeof(d));
      d.location.type = cudaMemLocationTypeDevice;
      d.location.id = ip->granted[i];
      d.flags = cudaMemAccessFlagsProtNone;
      /* Errors are dropped, not recorded: this also runs on failure paths whose message
       * the caller still has to report. */
      if (cudaSetDevice(ip->granted[i]) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
        (void)cudaGetLastError();
      if (cudaMemPoolSetAccess(ip->pool, &d, 1) != cudaSuccess)
        (void)cudaGetLastError();
    }
    pop_device(-1, prev);
  }
  if (cudaMemPoolDestroy(ip->pool) != cudaSuccess)
    (void)cudaGetLastError();
  free(ip->granted);
  free(ip);
}

static int cuda_pool_import(int fd, gpupool_mem_kind kind, int device, uint64_t capacity,
                            gpupool__cpool **out) {
  if (fd < 0) {
    /* A survive=yes pool: no pool-wide fd, each slab comes with its own. */
    if (kind != GPUPOOL_MEM_DEVICE && kind != GPUPOOL_MEM_HOST_NUMA)
      return gpupool__err(GPUPOOL_EPROTO, "the daemon sent no fd for a CUDA pool of memory kind %d", (int)kind);
    gpupool__cpool *v = calloc(1, sizeof(*v));
    if (!v)
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory importing a CUDA pool");
    v->kind = kind;
    v->device = device;
    v->vmm = 1;
    *out = v;
    return 0;
  }
  gpupool__cpool *p = NULL;
  ipool *ip = NULL;
  cudaMemPool_t pool;
  cudaError_t e;
  int prev = -1, rc;

  (void)capacity;
  *out = NULL;
  if (kind != GPUPOOL_MEM_DEVICE && kind != GPUPOOL_MEM_HOST_NUMA) {
    rc = gpupool__err(GPUPOOL_EPROTO, "the daemon sent a CUDA pool of memory kind %d, which "
                      "the CUDA backend cannot import", (int)kind);
    goto out_fd;
  }
  p = calloc(1, sizeof(*p));
  if (!p) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory importing a CUDA pool");
    goto out_fd;
  }
  p->kind = kind;
  p->device = device;
  if ((rc = push_device(device, &prev)) < 0)
    goto out_free;
  pthread_mutex_lock(&imp_lock);
  e = cudaMemPoolImportFromShareableHandle(&pool, (void *)(uintptr_t)fd,
                                           cudaMemHandleTypePosixFileDescriptor, 0);
  if (e != cudaSuccess) {
    rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaMemPoolImportFromShareableHandle", device,
                   "the daemon and this process must share the GPU and driver; in a "
                   "container, share the host's /dev/nvidia* and IPC namespace");
    goto out_unlock;
  }
  /* Imported before by another connection of this process: the driver returned its handle. */
  for (ip = ipools; ip && ip->pool != pool; ip = ip->next)
    ;
  if (!ip) {
    if (!(ip = calloc(1, sizeof(*ip)))) {
      rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory importing a CUDA pool");
      (void)cudaMemPoolDestroy(pool);
      (void)cudaGetLastError();
      goto out_unlock;
    }
    ip->pool = pool;
    ip->next = ipools;
    ipools = ip;
  }
  ip->refs++;
  /* A host-NUMA pool is accessible only from the CPU until access is granted; its GPU is
   * the resident device as far as the API promises, so grant it here. */
  if (kind == GPUPOOL_MEM_HOST_NUMA) {
    if ((rc = set_access(ip->pool, device, cudaMemAccessFlagsProtReadWrite)) < 0 ||
        (rc = add_granted(ip, device)) < 0) {
      if (--ip->refs == 0)
        ipool_drop(ip);
      goto out_unlock;
    }
  }
  pthread_mutex_unlock(&imp_lock);
  pop_device(device, prev);
  close(fd);
  p->ip = ip;
  *out = p;
  return 0;

out_unlock:
  pthread_mutex_unlock(&imp_lock);
  pop_device(device, prev);
out_free:
  free(p);
out_fd:
  close(fd);
  return rc;
}

/* Runs once per connection at disconnect; the pool itself goes with its last user. */
static void cuda_pool_release(gpupool__cpool *p) {
  if (!p)
    return;
  if (p->vmm) {
    /* Every slab was unmapped first (backend.h); one left would be a mapping nobody frees. */
    for (vmap *m = p->maps, *n; m; m = n) {
      n = m->next;
      if (gpupool__vmm_unmap(m->va, m->mapped) != 0)
        gpupool__err_clear();
      free(m);
    }
    free(p->access);
    free(p);
    return;
  }
  pthread_mutex_lock(&imp_lock);
  if (--p->ip->refs == 0)
    ipool_drop(p->ip);
  pthread_mutex_unlock(&imp_lock);
  free(p);
}

static int cuda_pool_set_access(gpupool__cpool *p, const int *devices, int n) {
  int ndev = 0, rc = 0;
  cudaError_t e;

  if (n < 0 || (n > 0 && !devices))
    return gpupool__err(GPUPOOL_EINVAL, "device list is NULL or has a negative length");
  e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaGetDeviceCount", p->device, NULL);
  /* Check every pair before changing anything, so a refused list leaves no partial access. */
  for (int i = 0; i < n; i++) {
    int d = devices[i], can = 0;
    if (d < 0 || d >= ndev)
      return gpupool__err(GPUPOOL_EINVAL, "device %d does not exist (this process sees %d): "
                          "pass ordinals as this process numbers them", d, ndev);
    if (p->kind != GPUPOOL_MEM_DEVICE || d == p->device)
      continue;
    e = cudaDeviceCanAccessPeer(&can, d, p->device);
    if (e != cudaSuccess)
      return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaDeviceCanAccessPeer", d, NULL);
    if (!can)
      return gpupool__err(GPUPOOL_ENOTSUP,
                          "device %d cannot access memory of device %d (no peer access): the "
                          "pool lives on device %d; use a pool on device %d, or GPUs connected "
                          "by NVLink or PCIe P2P (nvidia-smi topo -m)",
                          d, p->device, p->device, d);
  }
  if (p->vmm) {
    /* Access is per mapping: every slab this connection maps now, and those it maps later. */
    for (int i = 0; i < n && rc == 0; i++) {
      int d = devices[i], had = d == p->device;
      for (int j = 0; j < p->naccess && !had; j++)
        had = p->access[j] == d;
      if (had)
        continue;
      for (vmap *m = p->maps; m && rc == 0; m = m->next)
        rc = gpupool__vmm_access(m->va, m->mapped, d);
      if (rc == 0) {
        int *a = realloc(p->access, (size_t)(p->naccess + 1) * sizeof(*a));
        if (!a)
          return gpupool__err(GPUPOOL_ENOMEM, "out of memory recording pool access");
        a[p->naccess++] = d;
        p->access = a;
      }
    }
    return rc;
  }
  /* Access is the pool's, shared by every connection of the process that imported it: what
   * one grants, the others get too, until the last one releases the pool. */
  pthread_mutex_lock(&imp_lock);
  for (int i = 0; i < n && rc == 0; i++) {
    int d = devices[i];
    if (p->kind == GPUPOOL_MEM_DEVICE && d == p->device)
      continue;
    if ((rc = set_access(p->ip->pool, d, cudaMemAccessFlagsProtReadWrite)) == 0)
      rc = add_granted(p->ip, d);
  }
  pthread_mutex_unlock(&imp_lock);
  return rc;
}

static int stream_device(void *stream, int *dev);

/* Forget the dying slabs whose free has run (all of them, waiting, when wait is set). With
 * imp_lock held. */
static void reap_dying(int wait) {
  for (imp **pp = &dying; *pp;) {
    imp *m = *pp;
    cudaError_t e = wait ? cudaEventSynchronize(m->freed) : cudaEventQuery(m->freed);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      pp = &m->next;
      continue;
    }
    if (e != cudaSuccess)
      (void)cudaGetLastError(); /* the stream failed: the free will not run later either */
    if (cudaEventDestroy(m->freed) != cudaSuccess)
      (void)cudaGetLastError();
    *pp = m->next;
    free(m);
  }
}

static int cuda_slab_map(gpupool__cpool *p, const uint8_t *export_data, size_t export_len,
                         uint64_t size, int fd, int writable, void **base, void **priv) {
  struct cudaMemPoolPtrExportData d;
  imp *m;
  void *ptr = NULL;
  cudaError_t e;
  int rc = 0;

  (void)writable; /* read-only is advisory on CUDA: access flags are the importer's own */
  *base = NULL;
  *priv = NULL;
  if (p->vmm) {
    uint64_t mapped = 0;
    vmap *v;
    if (fd < 0)
      return gpupool__err(GPUPOOL_EPROTO, "the daemon sent no fd for a slab of a surviving CUDA pool");
    if (!gpupool__vmm_export_decode(export_data, export_len, &mapped) || mapped < size) {
      close(fd);
      return gpupool__err(GPUPOOL_EPROTO, "a surviving CUDA slab's export data does not describe %llu bytes: the "
                          "daemon and this library disagree on the backend; upgrade both to the same release",
                          (unsigned long long)size);
    }
    if (!(v = calloc(1, sizeof(*v)))) {
      close(fd);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory recording a mapped slab");
    }
    rc = gpupool__vmm_import(fd, p->device, p->kind == GPUPOOL_MEM_HOST_NUMA ? GPUPOOL__VMM_ANY_NODE : GPUPOOL__VMM_DEVICE,
                             mapped, 0, p->access, p->naccess, &v->va);
    close(fd); /* the mapping holds the memory */
    if (rc != 0) {
      free(v);
      return rc;
    }
    v->mapped = mapped;
    v->next = p->maps;
    p->maps = v;
    *base = v->va;
    *priv = v;
    return 0;
  }
  if (fd >= 0)
    close(fd);
  if ((rc = gpupool__cuda_export_decode(export_data, export_len, &d)) != 0)
    return rc;
  pthread_mutex_lock(&imp_lock);
  /* Mapped already by another connection of this process (or by this one for a second,
   * writable mapping): one import, counted. */
  for (m = imports; m; m = m->next)
    if (m->pool == p->ip->pool && !memcmp(m->data, &d, sizeof(m->data))) {
      m->refs++;
      *base = m->ptr;
      goto out;
    }
  /* A free of it, or of an allocation at the same address, queued in some stream may not have
   * run yet: importing before it has would map what is about to go. */
  reap_dying(0);
  for (m = dying; m; m = m->next)
    if (m->pool == p->ip->pool && !memcmp(m->data, &d, sizeof(m->data)))
      break;
  if (m)
    reap_dying(1);
  if (!(m = calloc(1, sizeof(*m)))) {
    rc = gpupool__err(GPUPOOL_ENOMEM, "out of memory recording a mapped slab");
    goto out;
  }
  e = cudaMemPoolImportPointer(&ptr, p->ip->pool, &d);
  if (e == cudaErrorAlreadyMapped && dying) {
    (void)cudaGetLastError();
    reap_dying(1);
    e = cudaMemPoolImportPointer(&ptr, p->ip->pool, &d);
  }
  if (e != cudaSuccess) {
    free(m);
    rc = gpupool__cuda_fail(e == cudaErrorMemoryAllocation ? GPUPOOL_ENOMEM : GPUPOOL_EBACKEND, e,
                   "cudaMemPoolImportPointer", p->device,
                   "the slab may have been freed by the daemon, or this process is out of "
                   "device address space");
    goto out;
  }
  m->pool = p->ip->pool;
  memcpy(m->data, &d, sizeof(m->data));
  m->ptr = ptr;
  m->refs = 1;
  m->device = p->device;
  m->next = imports;
  imports = m;
  *base = ptr;
out:
  pthread_mutex_unlock(&imp_lock);
  return rc;
}

static int cuda_slab_unmap(gpupool__cpool *p, void *base, uint64_t size, void *priv,
                           void *stream) {
  imp **pp, *m;
  cudaError_t e;
  int rc = 0, dev = -1, prev = -1;

  (void)size;
  if (!base)
    return 0;
  if (p->vmm) {
    /* No stream-ordered unmap exists: the caller's work on the slab runs to its end first. */
    vmap **vp, *v = priv;
    for (vp = &p->maps; *vp && *vp != v; vp = &(*vp)->next)
      ;
    if (!*vp)
      return 0; /* cannot happen: every mapping came from slab_map */
    *vp = v->next;
    e = cudaStreamSynchronize((cudaStream_t)stream);
    if (!stream && e == cudaSuccess && push_device(p->device, &prev) == 0) {
      /* The legacy stream is one per device: the caller's current device's, waited for above,
       * and the slab's own device's, where work on it may be queued too. */
      e = cudaStreamSynchronize(NULL);
      pop_device(p->device, prev);
    }
    gpupool__err_clear();
    rc = gpupool__vmm_unmap(v->va, v->mapped);
    if (e != cudaSuccess) /* a failed stream runs nothing more on the slab: unmapped all the same */
      rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaStreamSynchronize before unmapping a slab", p->device,
                              "the stream may belong to a destroyed context");
    free(v);
    return rc;
  }
  pthread_mutex_lock(&imp_lock);
  for (pp = &imports; *pp && (*pp)->ptr != base; pp = &(*pp)->next)
    ;
  if (!(m = *pp))
    goto out; /* cannot happen: every mapping came from slab_map */
  if (--m->refs > 0)
    goto out; /* another mapping of the same slab is still in use: freeing would unmap it too */
  *pp = m->next;
  /* Queued in the caller's stream after its work on the slab; queued under the lock so that
   * an import racing with this unmap is counted before or after it, never in between. */
  e = cudaFreeAsync(base, (cudaStream_t)stream);
  if (e != cudaSuccess) {
    rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaFreeAsync of an imported slab", p->device,
                   "the stream may belong to a destroyed context");
    free(m);
    goto out;
  }
  /* Until the free has run, an import of this allocation (or of a later one at its address)
   * must wait for it: an event marks its place in the stream. */
  if (stream_device(stream, &dev) == 0 && push_device(dev, &prev) == 0) {
    e = cudaEventCreateWithFlags(&m->freed, cudaEventDisableTiming);
    if (e == cudaSuccess && (e = cudaEventRecord(m->freed, (cudaStream_t)stream)) != cudaSuccess)
      (void)cudaEventDestroy(m->freed);
    pop_device(dev, prev);
  } else {
    e = cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    gpupool__err_clear();
    if (cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess)
      (void)cudaGetLastError();
    free(m);
    goto out;
  }
  m->next = dying;
  dying = m;
out:
  pthread_mutex_unlock(&imp_lock);
  return rc;
}

/* Device of a stream; NULL (the legacy default stream) belongs to the current device. */
static int stream_device(void *stream, int *dev) {
  cudaError_t e;
  if (!stream)
    e = cudaGetDevice(dev);
  else
    e = cudaStreamGetDevice((cudaStream_t)stream, dev);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, stream ? "cudaStreamGetDevice" : "cudaGetDevice", -1,
                     "pass a valid cudaStream_t (or NULL for the default stream)");
  return 0;
}

/* Open e's handle in device's context (making it current for the call). */
static int open_on(gpupool__cevent *e, int device, cudaEvent_t *out) {
  ev_slot *s;
  cudaError_t ce;
  int prev = -1, rc;

  for (int i = 0; i < e->n; i++)
    if (e->slots[i].device == device) {
      *out = e->slots[i].ev;
      return 0;
    }
  s = realloc(e->slots, (size_t)(e->n + 1) * sizeof(*s));
  if (!s)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory opening an IPC event");
  e->slots = s;
  if ((rc = push_device(device, &prev)) < 0)
    return rc;
  ce = cudaIpcOpenEventHandle(out, e->handle);
  pop_device(device, prev);
  if (ce != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, ce, "cudaIpcOpenEventHandle", device,
                     "this process cannot open gpupoold's event files in /dev/shm (another uid "
                     "than the daemon's, or another /dev/shm, as in a container): set "
                     "GPUPOOL_HOST_FENCES=1 (chosen by itself for another uid); or the daemon "
                     "restarted since it sent the event");
  s[e->n].device = device;
  s[e->n].ev = *out;
  e->n++;
  return 0;
}

static int cuda_event_open(const uint8_t *handle, size_t len, gpupool__cevent **out) {
  gpupool__cevent *e;
  cudaEvent_t ev;
  cudaError_t ce;
  int dev = 0, rc;

  *out = NULL;
  if (len != sizeof(cudaIpcEventHandle_t))
    return gpupool__err(GPUPOOL_EPROTO, "IPC event handle is %zu bytes, CUDA expects %zu: the "
                        "daemon and this library disagree on the backend", len,
                        sizeof(cudaIpcEventHandle_t));
  e = calloc(1, sizeof(*e));
  if (!e)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory opening an IPC event");
  memcpy(&e->handle, handle, sizeof(e->handle));
  ce = cudaGetDevice(&dev);
  if (ce != cudaSuccess) {
    rc = gpupool__cuda_fail(GPUPOOL_EBACKEND, ce, "cudaGetDevice", -1, NULL);
    goto fail;
  }
  /* Opened now on the current device so a bad handle fails here, not at first use. */
  if ((rc = open_on(e, dev, &ev)) < 0)
    goto fail;
  *out = e;
  return 0;

fail:
  free(e->slots);
  free(e);
  return rc;
}

static void cuda_event_close(gpupool__cevent *e) {
  if (!e)
    return;
  for (int i = 0; i < e->n; i++)
    if (cudaEventDestroy(e->slots[i].ev) != cudaSuccess)
      (void)cudaGetLastError();
  free(e->slots);
  free(e);
}

static int cuda_event_record(gpupool__cevent *e, void *stream) {
  cudaEvent_t ev;
  cudaError_t ce;
  int dev = 0, rc;

  if ((rc = stream_device(stream, &dev)) < 0)
    return rc;
  if ((rc = open_on(e, dev, &ev)) < 0)
    return rc;
  /* The daemon shares an event between several holds or buffers of this client, so a record
   * must not replace one whose work is still running: the stream waits for that first, and
   * the new record completes only after every earlier one. */
  ce = cudaEventQuery(ev);
  if (ce == cudaErrorNotReady) {
    (void)cudaGetLastError();
    ce = cudaStreamWaitEvent((cudaStream_t)stream, ev, 0);
  }
  if (ce != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, ce, "waiting for an IPC event's last record", dev, NULL);
  ce = cudaEventRecord(ev, (cudaStream_t)stream);
  if (ce != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, ce, "cudaEventRecord of an IPC event", dev, NULL);
  return 0;
}

static int cuda_stream_wait(gpupool__cevent *e, void *stream) {
  cudaError_t ce;
  /* A stream may wait on an event of another device, so any opened copy will do. */
  ce = cudaStreamWaitEvent((cudaStream_t)stream, e->slots[0].ev, 0);
  if (ce != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, ce, "cudaStreamWaitEvent on an IPC event",
                     e->slots[0].device, "pass a valid cudaStream_t (or NULL)");
  return 0;
}

static int cuda_event_query(gpupool__cevent *e) {
  cudaError_t ce = cudaEventQuery(e->slots[0].ev);
  if (ce == cudaSuccess)
    return 1;
  if (ce == cudaErrorNotReady)
    return 0;
  (void)cudaGetLastError();
  return gpupool__cuda_fail(GPUPOOL_EBACKEND, ce, "cudaEventQuery on an IPC event", e->slots[0].device, NULL);
}

static int cuda_stream_idle(void *stream) {
  cudaError_t ce = cudaStreamQuery((cudaStream_t)stream);
  if (ce == cudaSuccess)
    return 1;
  if (ce == cudaErrorNotReady)
    return 0;
  (void)cudaGetLastError();
  return gpupool__cuda_fail(GPUPOOL_EBACKEND, ce, "cudaStreamQuery", -1, "pass a valid cudaStream_t (or NULL)");
}

static int cuda_sync(void *stream) {
  cudaError_t ce = cudaStreamSynchronize((cudaStream_t)stream);
  if (ce != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, ce, "cudaStreamSynchronize", -1, NULL);
  return 0;
}

/* A file mapping is PROT_READ: pinning it needs cudaHostRegisterReadOnly (the driver would
 * otherwise ask for write access to the pages and fail). Mapped, so kernels read it in place
 * over PCIe; copies from it run at pinned speed. Registration is process-wide (every device
 * with unified addressing sees it). */
static int cuda_file_register(void *base, size_t len, void **dev) {
  cudaError_t e;
  int device = 0, ro = 0;
  if ((e = cudaGetDevice(&device)) != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaGetDevice", -1, NULL);
  if (cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, device) != cudaSuccess || !ro) {
    (void)cudaGetLastError();
    return gpupool__err(GPUPOOL_ENOTSUP,
                        "CUDA device %d cannot register read-only host memory "
                        "(cudaDevAttrHostRegisterReadOnlySupported is 0), so a file mapping cannot be pinned for "
                        "it; get the file with GPUPOOL_FILE_HOST_ONLY and copy from the CPU mapping",
                        device);
  }
  /* Portable: pinned for every context of the process, not only the current device's. */
  e = cudaHostRegister(base, len, cudaHostRegisterMapped | cudaHostRegisterPortable | cudaHostRegisterReadOnly);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaHostRegister(read-only, mapped) of a file mapping", device,
                              "check the locked-memory limit (ulimit -l) or get the file with "
                              "GPUPOOL_FILE_HOST_ONLY");
  e = cudaHostGetDevicePointer(dev, base, 0);
  if (e != cudaSuccess) {
    (void)cudaHostUnregister(base);
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaHostGetDevicePointer of a file mapping", device, NULL);
  }
  return 0;
}

static void cuda_file_unregister(void *base) {
  if (cudaHostUnregister(base) != cudaSuccess)
    (void)cudaGetLastError();
}

const gpupool__cbackend_ops gpupool__cuda_client_ops = {
    .has_events = 1,
    .pool_import = cuda_pool_import,
    .pool_release = cuda_pool_release,
    .pool_set_access = cuda_pool_set_access,
    .slab_map = cuda_slab_map,
    .slab_unmap = cuda_slab_unmap,
    .event_open = cuda_event_open,
    .event_close = cuda_event_close,
    .event_record = cuda_event_record,
    .stream_wait = cuda_stream_wait,
    .event_query = cuda_event_query,
    .stream_idle = cuda_stream_idle,
    .sync = cuda_sync,
    .file_register = cuda_file_register,
    .file_unregister = cuda_file_unregister,
};
