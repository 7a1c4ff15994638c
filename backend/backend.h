/*
 * The backend layer: where pool memory comes from, on both sides of the socket.
 *
 * A backend is one descriptor (gpupool__backend_desc) in one table (backend.c): its wire kind
 * and name, the daemon half (create pools that can be shared through one fd, hand out slabs
 * described by opaque export data, and for CUDA inter-process events), the client half (import
 * a pool from that fd, map slabs from their export data, open/record/wait on events), the
 * pool defaults the daemon's config falls back on, and a support check. Each backend lives in
 * backend/NAME/ with both halves and one header that declares its slab export format, encoded
 * (daemon half) and decoded (client half) by the same code.
 *
 * Layering: common/ below, this layer, then daemon/ and client/ above. Nothing here includes
 * a daemon or client header. Every function returning int returns 0 or a negative GPUPOOL_E*
 * code with a message recorded through gpupool__err().
 */
#ifndef GPUPOOL_BACKEND_BACKEND_H
#define GPUPOOL_BACKEND_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "gpupool/gpupool.h"

/* No exported allocation (slab) may exceed this: importers crash or corrupt above it. */
#define GPUPOOL_SLAB_HARD_MAX (4ull << 30)
#define GPUPOOL_EXPORT_MAX 128
#define GPUPOOL_EVENT_HANDLE_SIZE 64

/* One pool as configured (config file, --pool, or a backend's defaults). */
typedef struct {
  char name[64];
  gpupool_mem_kind kind;    /* HOST (memfd), DEVICE, HOST_NUMA; 0 = the backend's default */
  int device;               /* CUDA ordinal for DEVICE (and the GPU that uses HOST_NUMA) */
  int numa_node;            /* for HOST_NUMA */
  uint64_t capacity;        /* max bytes in slabs (IPC pools never shrink: always bounded) */
  uint64_t slab_size;       /* regular slab size; larger requests get a dedicated slab */
  uint64_t alignment;       /* default buffer alignment */
  uint32_t keep_slabs;      /* empty regular slabs kept mapped for reuse */
  uint32_t keep_dedicated;  /* empty dedicated slabs kept mapped for the next allocation of
                             * their owner and size (0: given back at once) */
  /* CUDA pool attributes; < 0 = leave the driver's default. */
  int64_t release_threshold;
  int reuse_follow_event_deps;
  int reuse_allow_opportunistic;
  int reuse_allow_internal_deps;
  /* Slabs outlive the daemon (restored from the fd store after a restart or crash). Host
   * memory always does; CUDA: each slab is its own cuMemCreate allocation exported as an fd
   * (vmm.h) instead of a piece of a stream-ordered pool. 0 = no. */
  int survive;
  int line;                 /* where it was defined (for messages), 0 = command line/default */
} gpupool__pool_config;

/* Unset fields of a pool config (what a [pool] section or --pool starts from). */
void gpupool__pool_config_init(gpupool__pool_config *p);

typedef struct gpupool__backend_desc gpupool__backend_desc;

/* ---- daemon half ---------------------------------------------------------------------- */

typedef struct gpupool__backend gpupool__backend;
typedef struct gpupool__bpool gpupool__bpool;   /* backend-private pool */
typedef struct gpupool__bevent gpupool__bevent; /* backend-private event */

/* A slab as the backend describes it. */
typedef struct {
  uint64_t size;
  /* Backends whose clients map slabs from an fd (host): the slab's fd and a read-only fd of
   * it, sent with the reply that first names the slab to a client. -1 for the others, whose
   * clients import slabs through the pool (cuda). */
  int fd, fd_ro;
  /* 1 when fd can be mmap()ed by the daemon for the CPU (host memfds); 0 when it is a handle
   * only CUDA can import (a survive=yes CUDA slab). */
  int fd_maps;
  uint8_t export_data[GPUPOOL_EXPORT_MAX];
  uint32_t export_len;
  void *priv; /* backend's handle (device pointer, offset, ...) */
} gpupool__bslab;

typedef struct {
  uint64_t reserved_cur, reserved_high, used_cur, used_high;
} gpupool__bpool_stats;

/* Where bytes of a copy lie: a pool, one of its slabs, an offset into the slab. */
typedef struct {
  gpupool__bpool *pool;
  gpupool__bslab *slab;
  uint64_t off;
} gpupool__bloc;

#define GPUPOOL_COPY_MAX_DSTS 16
/* One segment of a copy job: len bytes from src to each of ndst destinations (chain order). */
typedef struct gpupool__bcopy_seg {
  gpupool__bloc src;
  gpupool__bloc dst[GPUPOOL_COPY_MAX_DSTS];
  uint64_t len;
} gpupool__bcopy_seg;

typedef struct gpupool__bcopy gpupool__bcopy; /* backend-private copy job */

typedef struct {
  int has_events;     /* 1 when event_* are implemented */
  /* Create a pool per cfg (already checked by the daemon's config). Called once per
   * configured pool, or on backends with pool_fd_maps_all once per tenant that uses it, and
   * then again for a tenant whose pool was destroyed when idle. *fd is the pool's
   * shareable fd, owned by the pool (sent to clients with SCM_RIGHTS, never closed by the
   * caller), or -1 when clients need none (host: each slab has its own fd). */
  int (*pool_create)(gpupool__backend *be, const gpupool__pool_config *cfg,
                     gpupool__bpool **out, int *fd);
  /* Frees the pool and gives back everything it reserved; every slab must have been freed
   * first. */
  void (*pool_destroy)(gpupool__bpool *p);
  /* Take a slab of size bytes (<= GPUPOOL_SLAB_HARD_MAX), exported for import by clients,
   * cleared past its first `filled` bytes: those the caller overwrites in full before any
   * client is told of the slab (a replica's copy), so clearing them first would only cost
   * time (CUDA: a memset of up to 4 GiB on the daemon's thread). 0 clears all of it.
   * GPUPOOL_ENOSPC when the pool cannot provide it. */
  int (*slab_alloc)(gpupool__bpool *p, uint64_t size, uint64_t filled, gpupool__bslab *out);
  /* Give a slab back. The daemon calls it only after every client that mapped it has
   * unmapped it (or exited) and every done event on it has completed. */
  void (*slab_free)(gpupool__bpool *p, gpupool__bslab *s);
  /* Take over a slab a previous daemon made (its fd, kept alive across the restart), checked
   * as if a client had sent it: the kind of fd, its size (size bytes exactly), its seals.
   * Takes fd on success only. NULL on backends whose memory cannot outlive its daemon;
   * GPUPOOL_ENOTSUP on a pool whose slabs cannot (CUDA without survive=yes). */
  int (*slab_adopt)(gpupool__bpool *p, int fd, uint64_t size, gpupool__bslab *out);
  int (*pool_stats)(gpupool__bpool *p, gpupool__bpool_stats *out);
  /* Inter-process events (has_events only). handle receives the IPC handle bytes. */
  int (*event_create)(gpupool__backend *be, gpupool__bevent **out,
                      uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE]);
  /* 1 when all work recorded in the event has completed, 0 when pending, < 0 on error. */
  int (*event_query)(gpupool__bevent *e);
  void (*event_destroy)(gpupool__bevent *e);
  /* Free the backend (after every pool). */
  void (*close)(gpupool__backend *be);

  /* Copies between pools (replicas of a version on another device). Optional: NULL when the
   * backend cannot copy. One job copies every segment: each segment's bytes go from src to
   * dst[0], and from dst[i-1] to dst[i] for the later destinations (a chain, pipelined chunk
   * by chunk, so n destinations cost about one copy time rather than n). The copy runs on
   * the backend's own engines (CUDA: its streams and copy engines; host: a thread), never on
   * the caller's thread; copy_poll says how it stands without blocking. */
  int (*copy_start)(gpupool__backend *be, const struct gpupool__bcopy_seg *segs, size_t nsegs,
                    int ndst, struct gpupool__bcopy **out);
  /* 1 when every byte of every segment is in every destination, 0 while running, < 0 when
   * the copy failed (error set; destinations hold unspecified bytes). */
  int (*copy_poll)(struct gpupool__bcopy *c);
  /* Stop a running copy (returns only once no engine touches its slabs any more) or forget a
   * finished one, and free it. */
  void (*copy_free)(struct gpupool__bcopy *c);
  /* Optional: an eventfd (owned by the backend, closed by close) that its engines make
   * readable when a copy job may have ended, so that the caller polls its jobs then rather than
   * only on a timer; the caller reads its 8 bytes to reset it. < 0 when there is none. */
  int (*copy_notify_fd)(gpupool__backend *be);
} gpupool__backend_ops;

/* An open backend in the daemon. */
struct gpupool__backend {
  const gpupool__backend_desc *desc;
  const gpupool__backend_ops *ops;
  void *priv;
};

/* ---- client half ---------------------------------------------------------------------- */

typedef struct gpupool__cpool gpupool__cpool;   /* backend-private imported pool */
typedef struct gpupool__cevent gpupool__cevent; /* backend-private opened event */

typedef struct {
  int has_events;
  /* Import a pool. Takes ownership of fd (closes it on failure too; -1 when the daemon sends
   * none). kind/device say where the memory lives. */
  int (*pool_import)(int fd, gpupool_mem_kind kind, int device, uint64_t capacity,
                     gpupool__cpool **out);
  /* Undo pool_import (after every slab is unmapped). */
  void (*pool_release)(gpupool__cpool *p);
  /* Give these devices read/write access to the pool (CUDA; host: no-op). */
  int (*pool_set_access)(gpupool__cpool *p, const int *devices, int n);
  /* Map a slab; *base is its address in this process, *priv the backend's handle. fd is the
   * slab's own fd when the daemon sent one (taken: closed here in every case), else -1;
   * writable says whether to map it for writing (an fd sent for a read-only hold is
   * read-only and cannot be mapped for writing). */
  int (*slab_map)(gpupool__cpool *p, const uint8_t *export_data, size_t export_len,
                  uint64_t size, int fd, int writable, void **base, void **priv);
  /* Unmap a slab in stream order (CUDA: cudaFreeAsync of the import in stream). */
  int (*slab_unmap)(gpupool__cpool *p, void *base, uint64_t size, void *priv, void *stream);
  /* Events (has_events only). */
  int (*event_open)(const uint8_t *handle, size_t len, gpupool__cevent **out);
  void (*event_close)(gpupool__cevent *e);
  int (*event_record)(gpupool__cevent *e, void *stream);
  int (*stream_wait)(gpupool__cevent *e, void *stream);
  /* 1 when all work recorded in e has completed, 0 when not, < 0 on error. A stream wait on
   * an inter-process event costs ~135 us on an H200 even when the event has completed, so
   * the client queries first and waits only for work still running. */
  int (*event_query)(gpupool__cevent *e);
  /* 1 when nothing is queued in stream (then recording an event there orders nothing and
   * is skipped), 0 when work is pending, < 0 on error. */
  int (*stream_idle)(void *stream);
  /* Wait until work queued in stream has run (NULL: nothing to wait for on this backend).
   * Used before telling the daemon that slabs unmapped outside any caller's stream are gone:
   * the importer's free must complete before the exporter frees. */
  int (*sync)(void *stream);
  /* Read-only file mappings (NULL on backends without a GPU: the mapping is used from the CPU
   * only). file_register makes len bytes mapped PROT_READ at base (page-aligned) readable by
   * the GPU in place (CUDA: cudaHostRegister mapped and read-only) and sets *dev to the
   * device address of base; file_unregister undoes it before the caller unmaps. */
  int (*file_register)(void *base, size_t len, void **dev);
  void (*file_unregister)(void *base);
} gpupool__cbackend_ops;

/* ---- the descriptor ------------------------------------------------------------------- */

struct gpupool__backend_desc {
  int kind;                 /* GPUPOOL__WIRE__BACKEND_KIND__BACKEND_* */
  const char *name;         /* "host", "cuda": config, command line, logs */
  const char *what;         /* what its memory is, for logs */
  /* Memory kinds its pools may have (bit 1 << gpupool_mem_kind), and the one a pool gets
   * when its config names none. */
  unsigned mem_kinds;
  gpupool_mem_kind default_mem_kind;
  /* Defaults for pools that leave these unset. */
  uint64_t default_slab_size;
  uint64_t default_capacity;
  /* Why a pool of an unsupported kind is refused, and what to do instead. */
  const char *(*refuse_kind)(gpupool_mem_kind kind);
  /* 1 when usable here, 0 when not (the reason in gpupool__errmsg()). */
  int (*probe)(void);
  /* Open the daemon half; GPUPOOL_ENOTSUP with a message when it cannot be used. */
  int (*open)(gpupool__backend **out);
  /* Add the pools a daemon gets when none are configured (at most max - *n). */
  int (*default_pools)(gpupool__pool_config *pools, int max, int *n);
  /* The client half; NULL when this build cannot import this backend's pools. */
  const gpupool__cbackend_ops *client;
  /* 1 when a pool's fd gives access to every allocation in it (cuda: an importer can import
   * any pointer of the pool, and export data is no secret). The daemon then keeps one backend
   * pool per (configured pool, tenant or shared group), so no client ever receives the fd of
   * a pool holding another tenant's memory. 0 when clients receive per-slab fds (host). */
  int pool_fd_maps_all;
  /* 1 when memory a pool reserved stays with it after its slabs are freed, until the pool is
   * destroyed (CUDA IPC pools: cudaMemPoolTrimTo is a no-op and the release threshold is
   * ignored). The daemon then counts the most a pool ever held against the capacity. */
  int pool_keeps_memory;
  /* 1 when every pool's slabs can outlive the daemon (host memfds); 0 when only pools with
   * survive=yes set can (cuda). */
  int every_pool_survives;
};

/* The table. NULL when no backend has that name / kind. */
const gpupool__backend_desc *gpupool__backend_by_name(const char *name);
const gpupool__backend_desc *gpupool__backend_by_kind(int kind);
/* "host, cuda" (for help texts and errors). */
const char *gpupool__backend_names(void);

/* Open the backend named by want, or pick one when want is NULL ("auto": cuda when a usable
 * GPU is present, host otherwise), logging which and why. The returned backend is freed with
 * be->ops->close(be). */
int gpupool__backend_open(const gpupool__backend_desc *want, gpupool__backend **out);

/* Fill a pool's unset fields from its backend's defaults and refuse kinds the backend
 * cannot serve (GPUPOOL_ECONFIG naming the pool and the fix). *key (may be NULL) is set to
 * the config key a refusal is about ("slab_size"), so the caller can point at its line. */
int gpupool__backend_pool_finish(const gpupool__backend_desc *d, gpupool__pool_config *p, const char **key);

/* The backends (backend/host/host.c, backend/cuda/cuda.c). */
extern const gpupool__backend_desc gpupool__backend_host;
extern const gpupool__backend_desc gpupool__backend_cuda;

#endif
