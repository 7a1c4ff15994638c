/*
 * What the daemon half of the CUDA backend shares between its files: the backend's state
 * (devices, their streams, peer access, the staging cache), the pool, and the copy engine's
 * entry points (copy.c). Not seen outside backend/cuda/.
 */
#ifndef GPUPOOL_BACKEND_CUDA_DAEMON_H
#define GPUPOOL_BACKEND_CUDA_DAEMON_H

#include <stdint.h>

#include "cuda.h"

/* Pinned staging rings kept for the next staged copy once their job ends. */
#define GPUPOOL__CUDA_STAGE_KEEP 2
/* Copy events kept per device for the next jobs (a hop takes 8): creating and destroying
 * them was 16 CUDA calls per hop of every job, tens of microseconds of a replica's get. */
#define GPUPOOL__CUDA_EVENTS_KEEP 64

typedef struct {
  int usable;          /* pools with POSIX-fd handles are supported */
  cudaStream_t stream; /* daemon stream (allocations, frees), created on first use */
  int has_stream;
  /* Copy stream: the copy engine's own (cudaStreamNonBlocking), so that a slab allocation's
   * synchronize never waits for a multi-gigabyte copy queued before it. */
  cudaStream_t copy_stream;
  int has_copy_stream;
  /* Idle copy events of this device (every record in them completed). */
  cudaEvent_t ev_idle[GPUPOOL__CUDA_EVENTS_KEEP];
  int nev_idle;
} gpupool__cuda_dev;

typedef struct {
  int ndev;
  gpupool__cuda_dev *dev;
  int event_dev; /* device the IPC events live on: the first pool's, else the first usable */
  int event_dev_fixed;
  /* peer[a * ndev + b]: can device b's copy engines reach device a's memory, and is that
   * enabled in this process: 0 not asked yet, 1 enabled, -1 not possible. */
  signed char *peer;
  /* Idle pinned staging rings (GPUPOOL__CUDA_STAGE_KEEP at most). */
  void *stage_idle[GPUPOOL__CUDA_STAGE_KEEP];
  int nstage_idle;
  /* eventfd written when a copy job ends (-1: none): the daemon's loop hears of a finished
   * copy at once instead of on its next timer. Written by the copy watcher (copy.c), a thread
   * that queries the running jobs' last events; by a host function queued after each hop
   * when that thread could not be started. */
  int copy_efd;
  struct gpupool__cuda_watch *watch; /* NULL: no watcher thread */
} gpupool__cuda_state;

struct gpupool__bpool {
  gpupool__cuda_state *st;
  cudaMemPool_t pool;
  int fd;         /* exported POSIX fd, owned here */
  int device;     /* device whose stream allocates and frees (the GPU for HOST_NUMA) */
  int host;       /* 1 for HOST_NUMA (pinned host memory), 0 for device memory */
  int granted;    /* HOST_NUMA: device was given access here (taken back before destroying) */
  /* Devices other than `device` the copy engine gave access to this pool (bit d = device d,
   * devices below 64), taken back before the pool is destroyed. */
  uint64_t copy_access;
  char name[64];
  /* survive=yes: no stream-ordered pool; each slab is its own cuMemCreate allocation with an
   * exported fd (vmm.h), fd is -1 and clients map slabs from their fds. */
  int vmm;
  int numa;                      /* vmm: the NUMA node of a host-NUMA pool, -1 for device memory */
  uint64_t gran;                 /* allocation granularity: slabs are mapped rounded up to it */
  uint64_t capacity, reserved, reserved_high; /* bytes mapped in slabs (bounded here) */
  struct gpupool__cuda_vslab *vslabs; /* this pool's slabs, for access given later */
};

/* A slab of a survive=yes pool: its mapping in the daemon. */
typedef struct gpupool__cuda_vslab {
  void *va;
  uint64_t mapped; /* bytes mapped at va (the slab's size rounded up to the granularity) */
  int fd;          /* the first export's fd, owned here */
  struct gpupool__cuda_vslab *next;
} gpupool__cuda_vslab;

/* cudaSetDevice with an error naming the device and the fix. */
int gpupool__cuda_set_device(int device);

/* The copy engine (copy.c): the backend ops of backend.h. */
int gpupool__cuda_copy_start(gpupool__backend *be, const gpupool__bcopy_seg *segs, size_t nsegs,
                             int ndst, gpupool__bcopy **out);
int gpupool__cuda_copy_poll(gpupool__bcopy *c);
void gpupool__cuda_copy_free(gpupool__bcopy *c);
int gpupool__cuda_copy_notify_fd(gpupool__backend *be);
/* Make what the copy engine keeps in st from the backend's open (its notifier). */
void gpupool__cuda_copy_init(gpupool__cuda_state *st);
/* Free what the copy engine keeps in st (staging rings, copy streams), at backend close. */
void gpupool__cuda_copy_close(gpupool__cuda_state *st);
/* Take back the access the copy engine gave other devices to p, before it is destroyed. */
void gpupool__cuda_copy_pool_forget(gpupool__bpool *p);

#endif
