/*
 * The daemon's state: pools, slabs, buffers, holds, names, inter-process events, and the
 * bookkeeping that decides when memory may be reused. One owner for every resource:
 *   - a pool owns its slabs; a slab owns its sub-allocator;
 *   - a buffer lives while any holder (a client's hold or a published name) refers to it;
 *     when the last one lets go, its range waits for every recorded done event and for
 *     every holder process that died while holding it to have fully exited, then goes back
 *     to the slab (exactly once, in registry_sweep);
 *   - a slab is given back to the backend when it is empty, surplus (or dedicated, or
 *     trimmed) and every client that mapped it has unmapped it or exited.
 * Clients are owned by server.c; the registry keeps per-client holds and mapped slabs in
 * the gpupool__client it is handed.
 */
#ifndef GPUPOOL_DAEMON_REGISTRY_H
#define GPUPOOL_DAEMON_REGISTRY_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "alloc.h"
#include "backend.h"
#include "config.h"
#include "hmap.h"
#include "wire.h"

typedef struct gp_pool gp_pool;
typedef struct gp_slab gp_slab;
typedef struct gp_buffer gp_buffer;
typedef struct gp_hold gp_hold;
typedef struct gp_event gp_event;
typedef struct gp_corpse gp_corpse;
typedef struct gp_client gp_client;
typedef struct gp_registry gp_registry;

struct gp_event {
  uint32_t id;
  gpupool__bevent *be;
  uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE];
  gp_event *next_free;
};

/* A client process that went away while it still held memory: its ranges and mappings are
 * reused only once the process has fully exited (pidfd readable). */
struct gp_corpse {
  pid_t pid;
  int pidfd;
  int exited;
  uint32_t refs;
  uv_poll_t poll;
  gp_registry *reg;
};

typedef struct {
  uint64_t client_id;  /* live mapper, or 0 */
  gp_corpse *corpse;   /* dead mapper awaiting exit, or NULL */
} gp_mapper;

struct gp_slab {
  uint64_t id;
  gp_pool *pool;
  gpupool__bslab bs;
  gpupool__alloc *alloc; /* NULL for a dedicated slab */
  int dedicated;
  int retiring;          /* empty, being given back: no new buffers */
  uint32_t nbuffers;     /* live or pending buffers inside */
  gp_mapper *mappers;
  uint32_t nmappers, capmappers;
  gp_slab *prev, *next;  /* in pool->slabs */
};

struct gp_pool {
  uint32_t id;
  gpupool__pool_config cfg;
  gpupool__bpool *bp;
  int fd;
  gp_slab *slabs;
  uint64_t used, reserved, used_high, reserved_high, nbuffers, nslabs;
};

struct gp_buffer {
  uint64_t id;
  gp_slab *slab;
  uint64_t offset, size, asked;
  uint32_t refs;          /* holds + names */
  uint32_t names;
  gp_event *ready;
  uint8_t secret[16];
  int has_meta;
  gpupool_tensor_meta meta;
  uid_t owner_uid;
  pid_t owner_pid;
  uint64_t owner_client;  /* 0 once the owner disconnected */
  uint64_t created_ns;
  /* Dependencies that must clear before the range is reused (once refs == 0). */
  gp_event **done;
  uint32_t ndone, capdone;
  gp_corpse **corpses;
  uint32_t ncorpses, capcorpses;
  gp_buffer *pending_next;
};

struct gp_hold {
  uint64_t id;
  gp_buffer *buf;
  gp_client *client;
  gp_event *done;
  int read_only;
  int owner;              /* the allocating hold: counts against the client's limits */
  gp_hold *prev, *next;   /* in client->holds */
};

typedef struct {
  char *name;
  gp_buffer *buf;
  uid_t uid;
  gid_t share_gid;
  int share_all;
  uint64_t created_ns;
  int has_meta;              /* the tensor description published with this name */
  gpupool_tensor_meta meta;
} gp_name;

/* Per-uid accounting for the per-uid limits. */
typedef struct {
  uid_t uid;
  uint64_t bytes;
  uint32_t allocs;
} gp_uid_usage;

/* The registry's part of a connected client (embedded in server.c's connection). */
struct gp_client {
  uint64_t id;
  pid_t pid;
  uid_t uid;
  gid_t gid;
  char name[64];
  uint64_t connected_ns;
  int pidfd;                /* pidfd_open(pid) at connect, or -1 */
  gp_hold *holds;           /* list */
  uint64_t nholds;
  uint64_t bytes;           /* bytes of buffers it allocated and still live */
  uint32_t allocs;
  gpupool__hmap mapped;     /* slab id -> slab this client has mapped */
  uint64_t *revoke;         /* slab ids to send in the next reply */
  uint32_t nrevoke, caprevoke;
};

struct gp_registry {
  const gpupool__config *cfg;
  gpupool__backend *be;
  uv_loop_t *loop;
  gp_pool *pools;
  int npools;
  gpupool__hmap buffers;     /* id -> gp_buffer (live, refs > 0) */
  gpupool__hmap holds;       /* id -> gp_hold */
  gpupool__hmap slabs;       /* id -> gp_slab */
  gpupool__hmap clients;     /* id -> gp_client */
  gpupool__smap names;       /* name -> gp_name */
  gpupool__hmap uids;        /* uid -> gp_uid_usage */
  gp_buffer *pending;        /* refs == 0, waiting on dependencies */
  uint64_t npending;
  gp_event **events;         /* by id (1-based) */
  uint32_t nevents, capevents;
  gp_event *free_events;
  uint64_t next_id;
  uint64_t nnames;
  uv_timer_t sweep_timer;
  int sweep_timer_on;
  int memory_returned;       /* set when a range or slab came back; the server retries waiters */
  /* Called when memory came back to a pool (to retry waiting allocations). */
  void (*on_memory)(gp_registry *reg, gp_pool *pool);
  void *owner;
};

int gp_registry_init(gp_registry *reg, uv_loop_t *loop, const gpupool__config *cfg,
                     gpupool__backend *be);
/* Frees everything: buffers, slabs, pools, events. Call after every client is gone. */
void gp_registry_close(gp_registry *reg);

void gp_client_init(gp_registry *reg, gp_client *c);
/* The connection is the lease: drop every hold of c. When it still had holds (it died or
 * never released them), its ranges and mappings wait for its process to exit (c->pidfd,
 * which this takes over). */
void gp_client_drop(gp_registry *reg, gp_client *c);

gp_pool *gp_pool_find(gp_registry *reg, const char *name, uint32_t id);

/* Operations. Each returns 0 or a GPUPOOL_E* code with a gpupool__err() message. On success
 * *out is a new hold of c; fill a BufferDesc for it with gp_fill_desc. */
int gp_allocate(gp_registry *reg, gp_client *c, gp_pool *pool, uint64_t size, uint64_t align,
                gp_hold **out);
int gp_release(gp_registry *reg, gp_client *c, uint64_t hold_id, int done_recorded, int *freed);
int gp_share(gp_registry *reg, gp_client *c, uint64_t hold_id, uint8_t token[GPUPOOL_TOKEN_SIZE]);
int gp_open(gp_registry *reg, gp_client *c, const uint8_t *token, size_t len, int read_only,
            gp_hold **out);
int gp_publish(gp_registry *reg, gp_client *c, uint64_t hold_id, const char *name,
               const Gpupool__Wire__TensorMeta *meta, gid_t share_gid, int share_all);
/* Lookup for Get: 0 with *out a new hold, GPUPOOL_ENOENT when absent or not visible. */
int gp_get(gp_registry *reg, gp_client *c, const char *name, int read_only, gp_hold **out);
int gp_unpublish(gp_registry *reg, gp_client *c, const char *name);
/* The client reports that it unmapped these slabs. */
void gp_unmapped(gp_registry *reg, gp_client *c, const uint64_t *ids, size_t n);
/* Give back unused slabs; counts what was freed now and what awaits unmapping. */
void gp_trim(gp_registry *reg, uint32_t *freed, uint32_t *revoked);
/* Check pending ranges and retiring slabs; frees what is clear. */
void gp_sweep(gp_registry *reg);
/* Validates a name: 1..GPUPOOL_NAME_MAX bytes, printable, no NUL. */
int gp_check_name(const char *name);

/* Free bytes a request of `size` could use right now (for error messages). */
uint64_t gp_pool_free_bytes(const gp_pool *p);

/* Fills d (and its sub-messages, which the caller provides storage for). */
typedef struct {
  Gpupool__Wire__BufferDesc desc;
  Gpupool__Wire__SlabRef slab;
  Gpupool__Wire__EventRef ready, done;
  Gpupool__Wire__TensorMeta meta;
  int64_t shape[GPUPOOL_MAX_NDIM], strides[GPUPOOL_MAX_NDIM];
} gp_desc_storage;
/* name: the name the hold was got by, if any (its tensor description is sent; otherwise the
 * one the buffer was last published with). */
void gp_fill_desc(gp_registry *reg, gp_client *c, gp_hold *h, const char *name,
                  gp_desc_storage *s);
void gp_fill_pool_info(gp_registry *reg, gp_pool *p, Gpupool__Wire__PoolInfo *pi);

uint64_t gp_now_ns(void);

#endif
