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

typedef struct gpupool__pool gpupool__pool;
typedef struct gpupool__slab gpupool__slab;
typedef struct gpupool__buffer gpupool__buffer;
typedef struct gpupool__hold gpupool__hold;
typedef struct gpupool__event gpupool__event;
typedef struct gpupool__corpse gpupool__corpse;
typedef struct gpupool__client gpupool__client;
typedef struct gpupool__registry gpupool__registry;

struct gpupool__event {
  uint32_t id;
  gpupool__bevent *be;
  uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE];
  gpupool__event *next_free;
};

/* A client process that went away while it still held memory: its ranges and mappings are
 * reused only once the process has fully exited (pidfd readable). */
struct gpupool__corpse {
  pid_t pid;
  int pidfd;
  int exited;
  uint32_t refs;
  uv_poll_t poll;
  gpupool__registry *reg;
};

typedef struct {
  uint64_t client_id;  /* live mapper, or 0 */
  gpupool__corpse *corpse;   /* dead mapper awaiting exit, or NULL */
} gpupool__mapper;

struct gpupool__slab {
  uint64_t id;
  gpupool__pool *pool;
  gpupool__bslab bs;
  gpupool__alloc *alloc; /* NULL for a dedicated slab */
  int dedicated;
  uint64_t owner;        /* tenant (or shared group) whose buffers it holds: every holder of
                          * one of its buffers gets its fd, so others' buffers never go in */
  int retiring;          /* empty, being given back: no new buffers */
  uint32_t nbuffers;     /* live or pending buffers inside */
  gpupool__mapper *mappers;
  uint32_t nmappers, capmappers;
  gpupool__slab *prev, *next;  /* in pool->slabs */
};

struct gpupool__pool {
  uint32_t id;
  gpupool__pool_config cfg;
  gpupool__bpool *bp;
  int fd;
  gpupool__slab *slabs;
  uint64_t used, reserved, used_high, reserved_high, nbuffers, nslabs;
};

struct gpupool__buffer {
  uint64_t id;
  gpupool__slab *slab;
  uint64_t offset, size, asked;
  uint32_t refs;          /* holds + names */
  uint32_t names;
  gpupool__event *ready;
  uint8_t secret[16];      /* a share token with this secret opens read-write... */
  uint8_t secret_ro[16];   /* ...with this one, read-only (a token never upgrades a hold) */
  int has_meta;
  gpupool_tensor_meta meta;
  uid_t owner_uid;
  pid_t owner_pid;
  uint64_t owner_client;  /* 0 once the owner disconnected */
  uint64_t created_ns;
  /* Dependencies that must clear before the range is reused (once refs == 0). */
  gpupool__event **done;
  uint32_t ndone, capdone;
  gpupool__corpse **corpses;
  uint32_t ncorpses, capcorpses;
  gpupool__buffer *pending_next;
};

struct gpupool__hold {
  uint64_t id;
  gpupool__buffer *buf;
  gpupool__client *client;
  gpupool__event *done;
  int read_only;
  int owner;              /* the allocating hold: counts against the client's limits */
  gpupool__hold *prev, *next;   /* in client->holds */
};

typedef struct {
  char *name;                /* the key: "<namespace>/<name as published>" */
  gpupool__buffer *buf;
  uid_t uid;                 /* who published it */
  uint64_t created_ns;
  int has_meta;              /* the tensor description published with this name */
  gpupool_tensor_meta meta;
} gpupool__name;

/* Per-uid accounting for the per-uid limits. */
typedef struct {
  uid_t uid;
  uint64_t bytes;
  uint32_t allocs;
  uint32_t names;   /* names it published that still exist */
  uint64_t holds;   /* holds of its connections */
} gpupool__uid_usage;

/* The registry's part of a connected client (embedded in server.c's connection). */
struct gpupool__client {
  uint64_t id;
  uint64_t tenant;          /* see gpupool__tenant_of() */
  pid_t pid;
  uid_t uid;
  gid_t gid;
  char name[64];
  uint64_t connected_ns;
  int pidfd;                /* pidfd_open(pid) at connect, or -1 */
  gpupool__hold *holds;           /* list */
  uint64_t nholds;
  uint64_t bytes;           /* bytes of buffers it allocated and still live */
  uint32_t allocs;
  gpupool__hmap mapped;     /* slab id -> slab this client has mapped */
  gpupool__hmap mapped_ro;  /* the subset it has mapped read-only only */
  uint64_t *revoke;         /* slab ids to send in the next reply */
  uint32_t nrevoke, caprevoke;
};

struct gpupool__registry {
  const gpupool__config *cfg;
  gpupool__backend *be;
  uv_loop_t *loop;
  gpupool__pool *pools;
  int npools;
  gpupool__hmap buffers;     /* id -> gpupool__buffer (live, refs > 0) */
  gpupool__hmap holds;       /* id -> gpupool__hold */
  gpupool__hmap slabs;       /* id -> gpupool__slab */
  gpupool__hmap clients;     /* id -> gpupool__client */
  gpupool__smap names;       /* name -> gpupool__name */
  gpupool__hmap uids;        /* uid -> gpupool__uid_usage */
  gpupool__buffer *pending;        /* refs == 0, waiting on dependencies */
  uint64_t npending;
  gpupool__event **events;         /* by id (1-based) */
  uint32_t nevents, capevents;
  gpupool__event *free_events;
  uint64_t next_id;
  uint64_t nnames;
  uv_timer_t sweep_timer;
  int sweep_timer_on;
  int memory_returned;       /* set when a range or slab came back; the server retries waiters */
  /* Called when memory came back to a pool (to retry waiting allocations). */
  void (*on_memory)(gpupool__registry *reg, gpupool__pool *pool);
  void *owner;
};

int gpupool__registry_init(gpupool__registry *reg, uv_loop_t *loop, const gpupool__config *cfg,
                     gpupool__backend *be);
/* Frees everything: buffers, slabs, pools, events. Call after every client is gone. */
void gpupool__registry_close(gpupool__registry *reg);

void gpupool__client_init(gpupool__registry *reg, gpupool__client *c);
/* The connection is the lease: drop every hold of c. When it still had holds (it died or
 * never released them), its ranges and mappings wait for its process to exit (c->pidfd,
 * which this takes over). */
void gpupool__client_drop(gpupool__registry *reg, gpupool__client *c);

gpupool__pool *gpupool__pool_find(gpupool__registry *reg, const char *name, uint32_t id);

/* Operations. Each returns 0 or a GPUPOOL_E* code with a gpupool__err() message. On success
 * *out is a new hold of c; fill a BufferDesc for it with gpupool__fill_desc. */
int gpupool__allocate(gpupool__registry *reg, gpupool__client *c, gpupool__pool *pool, uint64_t size, uint64_t align,
                gpupool__hold **out);
int gpupool__release(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, int done_recorded, int *freed);
int gpupool__share(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, uint8_t token[GPUPOOL_TOKEN_SIZE]);
int gpupool__open(gpupool__registry *reg, gpupool__client *c, const uint8_t *token, size_t len, int read_only,
            gpupool__hold **out);
int gpupool__publish(gpupool__registry *reg, gpupool__client *c, uint64_t hold_id, const char *name,
               const Gpupool__Wire__TensorMeta *meta, gid_t share_gid, int share_all);
/* Tenants. A client's tenant is the [tenant] section naming its uid or primary gid, else its
 * uid alone; a pool shared with a [group] belongs to that group. Names live in namespaces:
 * a plain name in the caller's tenant's, "group:G/name" in group G's (members only).
 * gpupool__name_key writes the key a name is filed under ("uid:1000/weights",
 * "tenant:ml/weights", "group:ml/weights") and the namespace's owner id. */
uint64_t gpupool__tenant_of(const gpupool__config *cfg, uid_t uid, gid_t gid);
int gpupool__name_key(gpupool__registry *reg, const gpupool__client *c, const char *name, char *key,
                      size_t len, uint64_t *owner);
#define GPUPOOL_NAME_KEY_MAX (GPUPOOL_NAME_MAX + 64)
/* Lookup for Get: 0 with *out a new hold, GPUPOOL_ENOENT when absent or not visible. */
int gpupool__get(gpupool__registry *reg, gpupool__client *c, const char *name, int read_only, gpupool__hold **out);
int gpupool__unpublish(gpupool__registry *reg, gpupool__client *c, const char *name);
/* The client reports that it unmapped these slabs. */
void gpupool__unmapped(gpupool__registry *reg, gpupool__client *c, const uint64_t *ids, size_t n);
/* Give back unused slabs; counts what was freed now and what awaits unmapping. */
void gpupool__trim(gpupool__registry *reg, uint32_t *freed, uint32_t *revoked);
/* Check pending ranges and retiring slabs; frees what is clear. */
void gpupool__sweep(gpupool__registry *reg);
/* Validates a name: 1..GPUPOOL_NAME_MAX bytes, printable, no NUL. */
int gpupool__check_name(const char *name);

/* Free bytes a request of `size` could use right now (for error messages). */
uint64_t gpupool__pool_free_bytes(const gpupool__pool *p);

/* Fills d (and its sub-messages, which the caller provides storage for). */
typedef struct {
  Gpupool__Wire__BufferDesc desc;
  Gpupool__Wire__SlabRef slab;
  Gpupool__Wire__EventRef ready, done;
  Gpupool__Wire__TensorMeta meta; /* points into the registry's copy of the metadata */
  int fd;                         /* to send with the reply (the slab's), or -1 */
} gpupool__desc_storage;
/* name: the name the hold was got by, if any (its tensor description is sent; otherwise the
 * one the buffer was last published with). */
void gpupool__fill_desc(gpupool__registry *reg, gpupool__client *c, gpupool__hold *h, const char *name,
                  gpupool__desc_storage *s);
void gpupool__fill_pool_info(gpupool__registry *reg, gpupool__pool *p, Gpupool__Wire__PoolInfo *pi);

uint64_t gpupool__now_ns(void);

#endif
