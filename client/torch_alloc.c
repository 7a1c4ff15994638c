/*
 * libgpupool-torch-alloc: a torch.cuda.memory.CUDAPluggableAllocator over gpupool, so that
 * every CUDA tensor of a process is gpupool memory, shared by gpupool.torch without a copy.
 * torch calls gpupool_torch_alloc(size, device, stream) and gpupool_torch_free(ptr, size,
 * device, stream).
 *
 * A cache in the process, as torch's own caching allocator keeps one: tensors are blocks
 * carved from gpupool buffers (segments) the process keeps, so most allocations and frees
 * make no round trip to gpupoold. Sizes are rounded to 512 bytes; requests up to 1 MiB come
 * from 2 MiB segments (the small pool), larger ones from 20 MiB segments or, from 10 MiB on,
 * a segment of their own rounded to 2 MiB (the large pool); a free block is split when what
 * is left is worth keeping (512 bytes in the small pool, over 1 MiB in the large one) and
 * merged with free neighbours of its stream when freed. Reuse is stream-ordered: a block freed
 * on stream S is reused at once by an allocation on S; on another stream only once an event
 * recorded on S at the free has completed (events are recorded only once a device has seen a
 * second stream; on the host backend there are no streams to order, and a freed block is
 * free for every stream).
 *
 * Sharing: gpupool_torch_alloc_lookup tells gpupool.torch the segment's buffer and the
 * block's offset in it, and marks the block shared. A receiver opens the whole segment
 * buffer (as torch's own IPC hands out the whole cudaMalloc block), so a shared block is
 * never reused while the buffer is held elsewhere: freed, it is parked; once its segment
 * has no block in use, the daemon is asked whether anyone else holds the buffer (the Idle
 * request) and the parked blocks become free again, or the segment goes back to the daemon,
 * which keeps the memory for its holders.
 *
 * The cache is bounded by what torch keeps live plus free blocks: a failed allocation (pool
 * full, quota) gives back every segment with no block in use and tries once more, and
 * gpupool_torch_alloc_empty_cache does the same on demand (gpupool.torch.empty_cache, and
 * torch.cuda.empty_cache under use_allocator). At exit the connection's end gives the
 * daemon everything back.
 *
 * Only the public API of libgpupool-client is used; CUDA events through the driver library
 * (libcuda.so.1), loaded at the first free of device memory. Errors: alloc returns NULL
 * (torch raises its out-of-memory error) and the reason is kept for
 * gpupool_torch_alloc_last_error.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gpupool/gpupool.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 64

#define MIN_BLOCK 512u                 /* every size rounds up to this */
#define SMALL_SIZE (1u << 20)          /* up to this, the small pool */
#define SMALL_SEGMENT (2u << 20)       /* segment size of the small pool */
#define LARGE_SEGMENT (20u << 20)      /* segment of the large pool for requests under... */
#define MIN_LARGE_ALONE (10u << 20)    /* ...this; from here on a segment of its own */
#define ROUND_LARGE (2u << 20)         /* such a segment rounds to this */
#define NCLASSES 48                    /* size classes of the free lists (512 B << 47 at most) */

/* The library's interface (Python declares the same with ctypes; torch looks up the first two
 * by name). */
EXPORT int gpupool_torch_alloc_configure(const char *socket, const char *const *pool_names, int n);
EXPORT void *gpupool_torch_alloc(size_t size, int device, void *stream);
EXPORT void gpupool_torch_free(void *ptr, size_t size, int device, void *stream);
EXPORT int gpupool_torch_alloc_lookup(const void *ptr, gpupool_buffer **buf, size_t *offset, size_t *size);
EXPORT size_t gpupool_torch_alloc_lookup_many(const void *const *ptrs, const size_t *sizes, size_t n,
                                              gpupool_buffer **bufs, size_t *offsets);
EXPORT int gpupool_torch_alloc_empty_cache(void);
EXPORT const char *gpupool_torch_alloc_last_error(void);
EXPORT void gpupool_torch_alloc_counts(uint64_t *allocs, uint64_t *frees, uint64_t *live);
EXPORT int gpupool_torch_alloc_stats(uint64_t *out, int n);

/* Stream order across streams: an event recorded in a stream, whether it completed. */
typedef struct evops {
  int (*record)(int device, void *stream, void **ev); /* 0 or -1 */
  int (*done)(void *ev);                              /* 1 completed, 0 not yet, -1 error */
  void (*destroy)(void *ev);
  int (*sync)(int device); /* wait for all work of the device */
} evops;

struct seg;
struct blk;
typedef struct blk blk;

struct blk {
  uintptr_t ptr;
  size_t size;
  struct seg *seg;
  struct blk *prev, *next;   /* address neighbours in the segment */
  struct blk *fprev, *fnext; /* the free list (by size) */
  struct blk *hnext;         /* the table of blocks in use */
  void *stream;              /* the stream it was last used on */
  void *ev;                  /* free: event recorded on `stream` at the free, or NULL */
  unsigned char state;       /* B_FREE, B_USED, B_PARKED */
  unsigned char shared;      /* handed to gpupool.torch for sharing while in use */
};

enum { B_FREE, B_USED, B_PARKED };

typedef struct seg {
  gpupool_buffer *buf;
  uintptr_t base;
  size_t size;
  int device;
  int small;
  int used;     /* blocks in use */
  int parked;   /* shared blocks freed, waiting for the buffer to be idle */
  int checking; /* a thread asks the daemon whether the buffer is idle */
  const evops *ev;
  blk *head;    /* its first block (the others follow by address) */
  struct seg *prev, *next;
} seg;

typedef struct devstate {
  /* Free blocks: [1] the small pool, [0] the large; by size class (the power of two of
   * size / 512), each list ascending by size, so that a search and an insertion walk one
   * class, not every free block. */
  blk *free[2][NCLASSES];
  void *first_stream;
  int streams_seen; /* 0, 1, or 2 for "more than one": events are recorded from then on */
} devstate;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static gpupool_client *cli;
static char *socket_path;
static char *pools[MAX_DEVICES];
static devstate devs[MAX_DEVICES];
static seg *segs;
static blk **table;
static size_t nbuckets, nentries;
static char last_error[512];
/* Counters: torch's calls, segments, and the round trips to the daemon. */
static uint64_t nallocs, nfrees, nsegs, seg_bytes, daemon_allocs, daemon_releases, idle_asks, nparked;
static const evops *test_evops; /* set by the tests of this file, which include it */

/* ---- CUDA events through the driver library ---------------------------------------------- */
typedef int (*cu_i_fn)(unsigned);
typedef int (*cu_dev_fn)(int *, int);
typedef int (*cu_ctx_fn)(void **, int);
typedef int (*cu_push_fn)(void *);
typedef int (*cu_pop_fn)(void **);
typedef int (*cu_evc_fn)(void **, unsigned);
typedef int (*cu_evr_fn)(void *, void *);
typedef int (*cu_ev_fn)(void *);
typedef int (*cu_sync_fn)(void);

static struct {
  int tried, ok;
  cu_dev_fn dev_get;
  cu_ctx_fn primary;
  cu_push_fn push;
  cu_pop_fn pop;
  cu_evc_fn ev_create;
  cu_evr_fn ev_record;
  cu_ev_fn ev_query, ev_destroy;
  cu_sync_fn ctx_sync;
  void *ctx[MAX_DEVICES];
} cu;

/* Make the device's primary context (torch's) current on this thread, retained once. Called
 * with and without mu (a segment given back synchronizes without it): cu_mu guards cu.ctx. */
static pthread_mutex_t cu_mu = PTHREAD_MUTEX_INITIALIZER;

static int cu_enter(int device) {
  void *ctx;
  pthread_mutex_lock(&cu_mu);
  if (!cu.ctx[device]) {
    int d;
    if (cu.dev_get(&d, device) != 0 || cu.primary(&cu.ctx[device], d) != 0) {
      cu.ctx[device] = NULL;
      pthread_mutex_unlock(&cu_mu);
      return -1;
    }
  }
  ctx = cu.ctx[device];
  pthread_mutex_unlock(&cu_mu);
  return cu.push(ctx) == 0 ? 0 : -1;
}

static void cu_leave(void) {
  void *old;
  (void)cu.pop(&old);
}

/* Events are kept for reuse once their block is taken (creating and destroying one per free
 * would cost more than the rest of a free): a list per device, guarded by cu_mu. */
typedef struct cuev {
  void *ev;
  int device;
  struct cuev *next;
} cuev;
static cuev *cu_spare[MAX_DEVICES];

static int cu_record(int device, void *stream, void **out) {
  cuev *e;
  int rc = -1;
  pthread_mutex_lock(&cu_mu);
  if ((e = cu_spare[device]))
    cu_spare[device] = e->next;
  pthread_mutex_unlock(&cu_mu);
  if (cu_enter(device) != 0)
    goto out;
  if (!e && (e = calloc(1, sizeof *e)) && cu.ev_create(&e->ev, 2 /* CU_EVENT_DISABLE_TIMING */) != 0) {
    free(e);
    e = NULL;
  }
  if (e) {
    e->device = device;
    rc = cu.ev_record(e->ev, stream) == 0 ? 0 : -1;
  }
  cu_leave();
out:
  if (rc != 0 && e) {
    (void)cu.ev_destroy(e->ev);
    free(e);
  }
  *out = rc == 0 ? e : NULL;
  return rc;
}

static int cu_done(void *ev) {
  int r = cu.ev_query(((cuev *)ev)->ev);
  return r == 0 ? 1 : r == 600 /* CUDA_ERROR_NOT_READY */ ? 0 : -1;
}

static void cu_destroy(void *ev) {
  cuev *e = ev;
  pthread_mutex_lock(&cu_mu);
  e->next = cu_spare[e->device];
  cu_spare[e->device] = e;
  pthread_mutex_unlock(&cu_mu);
}

static int cu_sync(int device) {
  int rc;
  if (cu_enter(device) != 0)
    return -1;
  rc = cu.ctx_sync() == 0 ? 0 : -1;
  cu_leave();
  return rc;
}

static const evops cuda_evops = {cu_record, cu_done, cu_destroy, cu_sync};

/* With mu held. NULL when the driver library cannot be loaded: blocks are then reused only on
 * the stream they were freed on. */
static const evops *cuda_events(void) {
  if (!cu.tried) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    cu_i_fn init;
    cu.tried = 1;
    if (!h)
      h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h)
      return NULL;
    init = (cu_i_fn)dlsym(h, "cuInit");
    cu.dev_get = (cu_dev_fn)dlsym(h, "cuDeviceGet");
    cu.primary = (cu_ctx_fn)dlsym(h, "cuDevicePrimaryCtxRetain");
    cu.push = (cu_push_fn)dlsym(h, "cuCtxPushCurrent_v2");
    cu.pop = (cu_pop_fn)dlsym(h, "cuCtxPopCurrent_v2");
    cu.ev_create = (cu_evc_fn)dlsym(h, "cuEventCreate");
    cu.ev_record = (cu_evr_fn)dlsym(h, "cuEventRecord");
    cu.ev_query = (cu_ev_fn)dlsym(h, "cuEventQuery");
    cu.ev_destroy = (cu_ev_fn)dlsym(h, "cuEventDestroy_v2");
    cu.ctx_sync = (cu_sync_fn)dlsym(h, "cuCtxSynchronize");
    cu.ok = init && cu.dev_get && cu.primary && cu.push && cu.pop && cu.ev_create && cu.ev_record &&
            cu.ev_query && cu.ev_destroy && cu.ctx_sync && init(0) == 0;
  }
  return cu.ok ? &cuda_evops : NULL;
}

/* The events a segment's blocks are ordered by: none for host memory. With mu held. */
static const evops *events_for(gpupool_buffer *b) {
  if (test_evops)
    return test_evops;
  return gpupool_buffer_kind(b) == GPUPOOL_MEM_DEVICE ? cuda_events() : NULL;
}

/* ---- the table of blocks in use ----------------------------------------------------------- */
static size_t bucket_of(uintptr_t p, size_t n) {
  return (size_t)((p >> 9) * 0x9E3779B97F4A7C15ull) & (n - 1);
}

/* With mu held. */
static int grow(void) {
  size_t n = nbuckets ? nbuckets * 2 : 1024;
  blk **t = calloc(n, sizeof *t);
  if (!t)
    return -1;
  for (size_t i = 0; i < nbuckets; i++)
    for (blk *e = table[i], *nx; e; e = nx) {
      nx = e->hnext;
      e->hnext = t[bucket_of(e->ptr, n)];
      t[bucket_of(e->ptr, n)] = e;
    }
  free(table);
  table = t;
  nbuckets = n;
  return 0;
}

static void table_put(blk *b) {
  size_t i = bucket_of(b->ptr, nbuckets);
  b->hnext = table[i];
  table[i] = b;
  nentries++;
}

static blk *table_get(uintptr_t p, int take) {
  if (!nbuckets)
    return NULL;
  for (blk **pp = &table[bucket_of(p, nbuckets)]; *pp; pp = &(*pp)->hnext)
    if ((*pp)->ptr == p) {
      blk *b = *pp;
      if (take) {
        *pp = b->hnext;
        nentries--;
      }
      return b;
    }
  return NULL;
}

/* ---- free lists ------------------------------------------------------------------------- */
static int size_class(size_t size) {
  int c = 63 - __builtin_clzll((unsigned long long)(size / MIN_BLOCK) | 1);
  return c < NCLASSES ? c : NCLASSES - 1;
}

static blk **free_list(blk *b) { return &devs[b->seg->device].free[b->seg->small][size_class(b->size)]; }

static void free_insert(blk *b) {
  blk **head = free_list(b), *at = *head, *before = NULL;
  while (at && at->size < b->size) {
    before = at;
    at = at->fnext;
  }
  b->fprev = before;
  b->fnext = at;
  if (at)
    at->fprev = b;
  if (before)
    before->fnext = b;
  else
    *head = b;
}

static void free_remove(blk *b) {
  if (b->fprev)
    b->fprev->fnext = b->fnext;
  else
    *free_list(b) = b->fnext;
  if (b->fnext)
    b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
}

static void drop_event(blk *b) {
  if (b->ev) {
    b->seg->ev->destroy(b->ev);
    b->ev = NULL;
  }
}

/* Whether a free block last used on another stream may serve `stream` now. */
static int usable_elsewhere(blk *b) {
  const evops *ev = b->seg->ev;
  if (!ev)
    return 1; /* host memory: nothing to order */
  return b->ev && ev->done(b->ev) == 1;
}

/* The smallest free block of the pool that holds size bytes, in the first size class that
 * has one: one of `stream` first, else one whose stream's work at its free has completed.
 * With mu held. */
static blk *find_free(int device, int small, size_t size, void *stream) {
  for (int c = size_class(size); c < NCLASSES; c++) {
    blk *other = NULL;
    for (blk *b = devs[device].free[small][c]; b; b = b->fnext) {
      if (b->size < size)
        continue;
      if (b->stream == stream)
        return b;
      if (!other && usable_elsewhere(b))
        other = b;
    }
    if (other)
      return other;
  }
  return NULL;
}

/* Merge b (free, of its stream) with its free neighbours of the same stream; returns the
 * block that remains (not in the free list). With mu held. */
static blk *merge(blk *b) {
  blk *n;
  while ((n = b->prev) && n->state == B_FREE && n->stream == b->stream) {
    free_remove(n);
    drop_event(n); /* b's own event, recorded later in the same stream, covers it */
    n->size += b->size;
    n->next = b->next;
    if (b->next)
      b->next->prev = n;
    if (b->ev)
      n->ev = b->ev;
    free(b);
    b = n;
  }
  while ((n = b->next) && n->state == B_FREE && n->stream == b->stream) {
    free_remove(n);
    drop_event(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next)
      n->next->prev = b;
    free(n);
  }
  return b;
}

static size_t round_size(size_t size) {
  if (size < MIN_BLOCK)
    return MIN_BLOCK;
  return (size + MIN_BLOCK - 1) / MIN_BLOCK * MIN_BLOCK;
}

static size_t segment_size(size_t size) {
  if (size <= SMALL_SIZE)
    return SMALL_SEGMENT;
  if (size < MIN_LARGE_ALONE)
    return LARGE_SEGMENT;
  return (size + ROUND_LARGE - 1) / ROUND_LARGE * ROUND_LARGE;
}

/* Take b (free, in its list, at least size bytes) for `stream`: split off what is left when
 * it is worth keeping, and put it in the table of blocks in use. With mu held; -1 when out
 * of host memory (b then stays free). */
static int take(blk *b, size_t size, void *stream) {
  size_t rest = b->size - size;
  int split = b->seg->small ? rest >= MIN_BLOCK : rest > SMALL_SIZE;
  blk *r = NULL;
  if ((nentries + 1) * 2 > nbuckets && grow() != 0)
    return -1;
  if (split && !(r = calloc(1, sizeof *r)))
    return -1;
  free_remove(b);
  drop_event(b); /* the same stream, or completed: nothing left to wait for */
  if (r) {
    r->ptr = b->ptr + size;
    r->size = rest;
    r->seg = b->seg;
    r->prev = b;
    r->next = b->next;
    if (b->next)
      b->next->prev = r;
    b->next = r;
    b->size = size;
    /* The rest was idle for b's old stream too: it is free for the new one. */
    r->stream = stream;
    r->state = B_FREE;
    free_insert(r);
  }
  b->stream = stream;
  b->state = B_USED;
  b->shared = 0;
  b->seg->used++;
  table_put(b);
  return 0;
}

static void note_stream(int device, void *stream) {
  devstate *d = &devs[device];
  if (d->streams_seen == 0) {
    d->first_stream = stream;
    d->streams_seen = 1;
  } else if (d->streams_seen == 1 && stream != d->first_stream) {
    d->streams_seen = 2;
  }
}

static void set_error(const char *what, int rc) {
  snprintf(last_error, sizeof last_error, "%s: %s: %s", what, gpupool_err_name(rc), gpupool_last_error());
}

/* Take s (no block in use) out of the cache: out of the list of segments, its free blocks
 * out of the free lists, so that no other thread can hand them out any more. With mu held. */
static void detach(seg *s) {
  if (s->prev)
    s->prev->next = s->next;
  else
    segs = s->next;
  if (s->next)
    s->next->prev = s->prev;
  s->prev = s->next = NULL;
  for (blk *b = s->head; b; b = b->next)
    if (b->state == B_FREE)
      free_remove(b);
  nparked -= (uint64_t)s->parked;
  nsegs--;
  seg_bytes -= s->size;
  daemon_releases++;
}

/* Detach every segment of `device` (-1: of all) with no block in use or parked, and no idle
 * question in flight; returns them as a list (seg->next). With mu held. */
static seg *detach_unused(int device) {
  seg *out = NULL;
  for (seg *s = segs, *nx; s; s = nx) {
    nx = s->next;
    if ((device >= 0 && s->device != device) || s->used || s->parked || s->checking)
      continue;
    detach(s);
    s->next = out;
    out = s;
  }
  return out;
}

/* Give detached segments back to the daemon, in stream order (without mu: nothing else
 * reaches them). Returns how many. */
static int give_back(seg *list) {
  int n = 0;
  while (list) {
    seg *s = list;
    void *stream = s->head->stream;
    int one = 1;
    list = s->next;
    /* The release goes in the stream its blocks were last used on, or after the whole
     * device's work when they were used on several. */
    for (blk *b = s->head, *nx; b; b = nx) {
      nx = b->next;
      if (b->stream != stream)
        one = 0;
      if (b->ev)
        s->ev->destroy(b->ev);
      free(b);
    }
    if (!one && s->ev) {
      (void)s->ev->sync(s->device);
      stream = NULL;
    }
    (void)gpupool_buffer_release(s->buf, stream);
    free(s);
    n++;
  }
  return n;
}

/* Where the allocator connects (NULL: $GPUPOOL_SOCKET or the default) and the pool of each
 * device (pool_names[i] for device i; NULL or "": allocations there fail). Call before the
 * first allocation; 0, or -1 when out of memory. */
EXPORT int gpupool_torch_alloc_configure(const char *socket, const char *const *pool_names, int n) {
  int rc = 0;
  pthread_mutex_lock(&mu);
  free(socket_path);
  socket_path = socket && *socket ? strdup(socket) : NULL;
  if (socket && *socket && !socket_path)
    rc = -1;
  for (int i = 0; i < MAX_DEVICES; i++) {
    free(pools[i]);
    pools[i] = NULL;
    if (i < n && pool_names[i] && *pool_names[i] && !(pools[i] = strdup(pool_names[i])))
      rc = -1;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

/* A new segment of at least size bytes for `device`, from the daemon; a failure for lack of
 * memory gives back the unused cached segments and tries once more. With mu held (let go of
 * during the round trips); the new segment's one free block, or NULL with last_error set. */
static blk *new_segment(int device, int small, size_t size, void *stream) {
  size_t ssize = segment_size(size);
  gpupool_buffer *b = NULL;
  gpupool_client *c = cli;
  const char *pool = pools[device];
  seg *s = calloc(1, sizeof *s);
  blk *f = calloc(1, sizeof *f);
  int rc;
  if (!s || !f) {
    free(s);
    free(f);
    snprintf(last_error, sizeof last_error, "gpupool torch allocator: out of host memory for its cache");
    return NULL;
  }
  /* The round trip is made without the lock: other threads' frees and lookups (a
   * gpupool.torch send) do not wait behind it. */
  pthread_mutex_unlock(&mu);
  rc = gpupool_buffer_alloc(c, pool, ssize, 0, stream, &b);
  if (rc == GPUPOOL_ENOSPC || rc == GPUPOOL_ELIMIT) {
    pthread_mutex_lock(&mu);
    seg *unused = detach_unused(-1);
    pthread_mutex_unlock(&mu);
    if (give_back(unused) > 0)
      rc = gpupool_buffer_alloc(c, pool, ssize, 0, stream, &b);
  }
  pthread_mutex_lock(&mu);
  if (rc != 0) {
    char what[128];
    snprintf(what, sizeof what, "gpupool torch allocator: allocation of %zu bytes on device %d", size,
             device);
    set_error(what, rc);
    free(s);
    free(f);
    return NULL;
  }
  daemon_allocs++;
  s->buf = b;
  s->base = (uintptr_t)gpupool_buffer_ptr(b);
  s->size = ssize;
  s->device = device;
  s->small = small;
  s->ev = events_for(b);
  s->next = segs;
  if (segs)
    segs->prev = s;
  segs = s;
  nsegs++;
  seg_bytes += ssize;
  f->ptr = s->base;
  f->size = ssize;
  f->seg = s;
  f->stream = stream;
  f->state = B_FREE;
  s->head = f;
  free_insert(f);
  return f;
}

EXPORT void *gpupool_torch_alloc(size_t size, int device, void *stream) {
  blk *b;
  size_t want = round_size(size);
  int small = want <= SMALL_SIZE, rc;
  pthread_mutex_lock(&mu);
  if (!cli && (rc = gpupool_client_connect(socket_path, "torch-allocator", GPUPOOL_TIMEOUT_DEFAULT, &cli)) != 0) {
    cli = NULL;
    set_error("gpupool torch allocator: cannot connect to gpupoold", rc);
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  if (device < 0 || device >= MAX_DEVICES || !pools[device]) {
    snprintf(last_error, sizeof last_error,
             "gpupool torch allocator: no gpupool pool for CUDA device %d (the daemon has no device pool "
             "there, or use_allocator(pools=...) named none)", device);
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  note_stream(device, stream);
  b = find_free(device, small, want, stream);
  if (!b && !(b = new_segment(device, small, want, stream))) {
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  if (take(b, want, stream) != 0) {
    snprintf(last_error, sizeof last_error, "gpupool torch allocator: out of host memory for its cache");
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  nallocs++;
  pthread_mutex_unlock(&mu);
  return (void *)b->ptr;
}

/* A block freed: free for its stream (merged with its free neighbours of that stream), or
 * parked when it was shared. With mu held. */
static void release_block(blk *b) {
  seg *s = b->seg;
  s->used--;
  if (b->shared) {
    b->state = B_PARKED;
    s->parked++;
    nparked++;
    return;
  }
  b->state = B_FREE;
  /* Another stream may take it once the work queued in this one so far is done: recorded
   * only once the device has seen a second stream (one stream needs no event). */
  if (s->ev && devs[s->device].streams_seen > 1 && s->ev->record(s->device, b->stream, &b->ev) != 0)
    b->ev = NULL;
  free_insert(merge(b));
}

/* The parked blocks of s become free (nobody else holds its buffer any more). With mu held. */
static void unpark(seg *s) {
  for (;;) {
    blk *b = s->head;
    while (b && b->state != B_PARKED)
      b = b->next;
    if (!b)
      return;
    b->state = B_FREE;
    b->shared = 0;
    s->parked--;
    nparked--;
    free_insert(merge(b));
  }
}

EXPORT void gpupool_torch_free(void *ptr, size_t size, int device, void *stream) {
  blk *b;
  seg *s, *gone = NULL;
  (void)size;
  (void)device;
  (void)stream; /* the block's own: torch frees in the stream it allocated in */
  if (!ptr)
    return;
  pthread_mutex_lock(&mu);
  b = table_get((uintptr_t)ptr, 1);
  if (!b) {
    pthread_mutex_unlock(&mu);
    fprintf(stderr, "gpupool torch allocator: free of %p, which it did not allocate; ignored\n", ptr);
    return;
  }
  nfrees++;
  s = b->seg;
  release_block(b);
  if (s->used == 0 && s->parked && !s->checking) {
    /* Its blocks in use are gone and some were shared: ask whether anyone still holds the
     * buffer (without the lock). Idle: the parked blocks are free again; held: the segment
     * goes back to the daemon, which keeps the memory for its holders. */
    int idle = 0, rc;
    gpupool_buffer *buf = s->buf;
    s->checking = 1;
    idle_asks++;
    pthread_mutex_unlock(&mu);
    rc = gpupool_buffer_idle_many(&buf, 1, &idle);
    pthread_mutex_lock(&mu);
    s->checking = 0;
    if (rc == 0 && idle)
      unpark(s);
    else if (s->used == 0) {
      /* Still held (or the question failed): the whole segment goes. */
      detach(s);
      gone = s;
    }
  }
  pthread_mutex_unlock(&mu);
  if (gone)
    (void)give_back(gone);
}

/* The block that starts at ptr (a storage's data pointer), for sharing it: 1 with *buf (its
 * segment's buffer, owned by this library, valid while the block is in use), *offset (of the
 * block in it) and *size (the block's, at least what torch asked for); 0 when ptr is not a
 * block in use. The block is marked shared: freed, it is not reused while anyone else holds
 * the buffer. */
EXPORT int gpupool_torch_alloc_lookup(const void *ptr, gpupool_buffer **buf, size_t *offset, size_t *size) {
  blk *b;
  pthread_mutex_lock(&mu);
  b = table_get((uintptr_t)ptr, 0);
  if (b) {
    b->shared = 1;
    *buf = b->seg->buf;
    *offset = b->ptr - b->seg->base;
    *size = b->size;
  }
  pthread_mutex_unlock(&mu);
  return b != NULL;
}

/* gpupool_torch_alloc_lookup for the n storages of a message at once (one lock, one call
 * from Python instead of one per storage): for each ptrs[i] that starts a block in use of at
 * least sizes[i] bytes, bufs[i] and offsets[i] as lookup gives them (the block is marked
 * shared); for any other, bufs[i] = NULL. Returns how many were found. */
EXPORT size_t gpupool_torch_alloc_lookup_many(const void *const *ptrs, const size_t *sizes, size_t n,
                                              gpupool_buffer **bufs, size_t *offsets) {
  size_t found = 0;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < n; i++) {
    blk *b = table_get((uintptr_t)ptrs[i], 0);
    bufs[i] = NULL;
    offsets[i] = 0;
    if (b == NULL || sizes[i] > b->size)
      continue;
    b->shared = 1;
    bufs[i] = b->seg->buf;
    offsets[i] = b->ptr - b->seg->base;
    found++;
  }
  pthread_mutex_unlock(&mu);
  return found;
}

/* Give back to the daemon every cached segment with no block in use (or waiting to be idle):
 * what torch's caching allocator does in torch.cuda.empty_cache. Returns how many went. */
EXPORT int gpupool_torch_alloc_empty_cache(void) {
  seg *unused;
  pthread_mutex_lock(&mu);
  unused = detach_unused(-1);
  pthread_mutex_unlock(&mu);
  return give_back(unused);
}

/* Why the last allocation failed ("" when none did). */
EXPORT const char *gpupool_torch_alloc_last_error(void) { return last_error; }

/* Allocations and frees so far, and allocations live now. */
EXPORT void gpupool_torch_alloc_counts(uint64_t *allocs, uint64_t *frees, uint64_t *live) {
  pthread_mutex_lock(&mu);
  *allocs = nallocs;
  *frees = nfrees;
  *live = nentries;
  pthread_mutex_unlock(&mu);
}

/* What the cache holds and what it cost, in out[0..n) (n up to 9): allocations, frees, blocks
 * in use, segments kept, their bytes, Allocate requests made (segments made), segments given
 * back, Idle questions asked, shared blocks parked now. Returns how many it wrote. */
EXPORT int gpupool_torch_alloc_stats(uint64_t *out, int n) {
  uint64_t v[9];
  int k = n < 9 ? n : 9;
  pthread_mutex_lock(&mu);
  v[0] = nallocs;
  v[1] = nfrees;
  v[2] = nentries;
  v[3] = nsegs;
  v[4] = seg_bytes;
  v[5] = daemon_allocs;
  v[6] = daemon_releases;
  v[7] = idle_asks;
  v[8] = nparked;
  pthread_mutex_unlock(&mu);
  for (int i = 0; i < k; i++)
    out[i] = v[i];
  return k < 0 ? 0 : k;
}
