/*
 * The daemon's state: pools, slabs, buffers, holds, names, inter-process events, and the
 * bookkeeping that decides when memory may be reused. One owner for every resource:
 *   - a pool owns its slabs; a slab owns its sub-allocator;
 *   - a buffer lives while any holder (a client's hold or a published name) refers to it;
 *     when the last one lets go, its range waits for every recorded done event and for the
 *     lease of every client whose connection closed while holding it, then goes back to the
 *     slab (exactly once, in registry_sweep);
 *   - a slab is given back to the backend when it is empty, surplus (or dedicated, or
 *     trimmed) and every client that mapped it has unmapped it or lost its lease; a replica's
 *     dedicated slab waits, empty, for the next version's replica (slabs.c);
 *   - a lease is one end of a pipe the client keeps while it maps the daemon's memory; the
 *     kernel closes it when the last process holding it (forked children included) exits
 *     or closes it, and the daemon sees EOF on its own end. Liveness never comes from a pid.
 * Clients are owned by server.c; the registry keeps per-client holds and mapped slabs in
 * the gpd_client it is handed.
 */
#ifndef GPUPOOL_DAEMON_REGISTRY_H
#define GPUPOOL_DAEMON_REGISTRY_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "alloc.h"
#include "backend.h"
#include "config.h"
#include "errors.h"
#include "hmap.h"
#include "log.h"
#include "wire.h"

typedef struct gpd_pool gpd_pool;
typedef struct gpd_pinst gpd_pinst;
typedef struct gpd_slab gpd_slab;
typedef struct gpd_buffer gpd_buffer;
typedef struct gpd_hold gpd_hold;
typedef struct gpd_keep gpd_keep;
typedef struct gpd_event gpd_event;
typedef struct gpd_lease gpd_lease;
typedef struct gpd_client gpd_client;
typedef struct gpd_registry gpd_registry;
typedef struct gpd_layout gpd_layout;
typedef struct gpd_replica gpd_replica;
typedef struct gpd_copy gpd_copy;

#define GPUPOOL_NAME_KEY_MAX (GPUPOOL_NAME_MAX + 64)
/* A name a request carries, resolved once by the request's handler (gpd_name_key): every
 * function below the handlers takes this, never the raw name, so the name is checked and its
 * key built once per request. */
typedef struct gpd_rname {
  const char *name;                    /* as the client wrote it (for messages) */
  int rc;                              /* 0, or why it names nothing the client may reach */
  uint64_t owner;                      /* the tenant, or GROUP_SET | group of a group: name */
  char key[GPUPOOL_NAME_KEY_MAX + 1];  /* what the registry files it under */
  char why[GPUPOOL__ERRMSG_MAX];       /* rc's message */
} gpd_rname;

/* What keeps state on the registry's buffers from beside it (the replicas: replicas.c)
 * attaches here. The registry tells it its news through these and never calls it. */
typedef struct gpd_registry_ext {
  /* b's last holder let go, or b was published again (still held): what was made of it goes */
  void (*buffer_replaced)(gpd_registry *reg, gpd_buffer *b);
  void (*stop)(gpd_registry *reg);  /* the daemon stops: end the running work */
  void (*close)(gpd_registry *reg); /* before the registry frees names and buffers */
} gpd_registry_ext;

/* An inter-process event. CUDA gives a process 4096 of them, so they are shared: a client's
 * holds and buffers take turns on at most GPD_EVENTS_PER_CLIENT events of its own, and the
 * holds one request makes (an Open of many tokens, a bundle's get) share one. Sharing is safe
 * because the client library records an event cumulatively (the stream first waits for the
 * event's last record when that has not completed): once it completes, every earlier record
 * of it has. Events are never shared between clients, so no client can make another's wait
 * on its work. */
/* Events one client uses at most; more holds and buffers share them. */
#define GPD_EVENTS_PER_CLIENT 32

struct gpd_event {
  uint32_t id;
  uint32_t refs;          /* holds, buffers (ready), done dependencies and client tables */
  gpupool__bevent *be;
  uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE];
  gpd_event *next_free;
};

/* A connection's lease: the daemon's end (the read end of a pipe) of an fd the client holds
 * for as long as it maps any of this daemon's memory. The write end travels in the Hello
 * reply; fork shares it, exec closes it (close-on-exec, like the mappings), and the kernel
 * closes it with the last process that holds it. A pipe rather than a socketpair: its reader
 * sees EOF only once every writer is gone, and a holder cannot half-close it. Ranges and
 * mappings of a client whose connection closed are reused only once the lease is gone. */
struct gpd_lease {
  int fd;                 /* daemon's end; closed once gone */
  int gone;               /* no process holds the other end any more */
  int waiting;            /* connection closed, memory pinned: counted in its uid's usage */
  int counted;            /* its uid's record counts it (the record could be made) */
  int polling;            /* poll handle initialised; freed from its close callback */
  uint32_t refs;          /* the client's, one per pinned buffer and per slab mapping */
  uid_t uid;
  uint64_t tenant;        /* whose waiting leases it counts as */
  pid_t pid;              /* for logs only (0 when the client is in another PID namespace) */
  uint64_t client_id;     /* for logs */
  uint64_t since_ns;      /* when the connection closed */
  uint64_t store_id;      /* its name in the fd store (state.c), 0: not there */
  uint8_t resume[16];     /* with store_id, the token that gives its holds back after a restart */
  uv_poll_t poll;
  gpd_registry *reg;
  gpd_lease *prev, *next; /* in reg->waiting while waiting */
};

typedef struct {
  uint64_t client_id;  /* live mapper, or 0 */
  gpd_lease *lease;     /* mapper whose connection closed, until its lease is gone */
} gpd_mapper;

struct gpd_slab {
  uint64_t id;
  gpd_pool *pool;
  gpd_pinst *inst;  /* the backend pool it was taken from */
  gpupool__bslab bs;
  gpupool__alloc *alloc; /* NULL for a dedicated slab */
  int dedicated;
  int kept;              /* a dedicated slab made for a replica or a fetched copy (the
                          * GPD_PLACE_* it was placed for): kept (and left mapped by its
                          * clients) once empty, for the next version's of its owner and size
                          * on this device (slabs.c, gpd_place) */
  uint64_t owner;        /* tenant (or shared group) whose buffers it holds: every holder of
                          * one of its buffers gets its fd, so others' buffers never go in */
  int retiring;          /* no new buffers: being given back once empty and unmapped */
  uint32_t nbuffers;     /* live or pending buffers inside */
  gpd_mapper *mappers;
  uint32_t nmappers, capmappers;
  uint8_t *daemon_map;   /* the whole slab mapped read-write in the daemon (peer fetches write
                          * host slabs through it), or NULL; unmapped when the slab goes */
  int stored;             /* its fd is in the fd store (state.c) */
  int frozen;             /* restored while clients of the previous daemon may map it: no new
                           * buffers until they are gone (state.c) */
  gpd_slab *prev, *next;  /* in pool->slabs */
};

/* One backend pool of a configured pool. On a backend whose pool fd maps every allocation
 * (cuda) there is one per owner (tenant, or the group of a shared pool), created on first use
 * (an allocation, or an AttachPool of a client of that owner) and destroyed once idle: no
 * slabs, and no connected client has attached it. A client only ever receives buffers of its
 * own owner's instance, so the pool id on the wire names exactly one instance per client; an
 * instance is never destroyed while a connected client has it attached, so a client's
 * imported pool never goes stale under that id. Elsewhere (host) one instance serves every
 * owner, for the daemon's life: clients there receive per-slab fds, never a pool fd. */
struct gpd_pinst {
  gpd_pool *pool;
  uint64_t owner;        /* GPUPOOL__OWNER_ANY for the single instance of a host pool */
  uint64_t serial;       /* for logs */
  gpupool__bpool *bp;
  int fd;                /* its fd (owned by bp), sent in AttachPool replies; -1 when none */
  uint64_t reserved;     /* bytes in its slabs */
  uint64_t held;         /* bytes it keeps from the system: `reserved`, or on a backend whose
                          * pools keep freed memory the most it ever reserved */
  uint32_t nslabs;
  uint32_t attached;     /* connected clients that attached it */
  gpd_pinst *prev, *next; /* in pool->insts */
};

#define GPUPOOL__OWNER_ANY UINT64_MAX

struct gpd_pool {
  uint32_t id;
  gpupool__pool_config cfg;
  gpd_pinst *insts;
  uint32_t ninsts;
  uint64_t insts_created; /* over the daemon's life */
  uint64_t held;          /* sum of the instances' held bytes: bounded by cfg.capacity */
  gpd_slab *slabs;
  uint64_t used, reserved, used_high, reserved_high, nbuffers, nslabs;
  /* Backend counters of destroyed instances' high-water marks are lost with them: the
   * highest sum of the live instances' counters seen so far. */
  uint64_t backend_reserved_high, backend_used_high;
};

struct gpd_buffer {
  uint64_t id;
  gpd_slab *slab;
  uint64_t offset, size, asked;
  uint32_t refs;          /* holds + names */
  uint32_t names;
  gpd_event *ready;
  uint8_t secret[16];      /* a share token with this secret opens read-write... */
  uint8_t secret_ro[16];   /* ...with this one, read-only (a token never upgrades a hold) */
  int has_meta;
  gpupool_tensor_meta meta;
  uid_t owner_uid;
  uint64_t owner_tenant;  /* whose limits its bytes count against */
  pid_t owner_pid;
  uint64_t owner_client;  /* 0 once the owner disconnected */
  uint64_t created_ns;
  /* Dependencies that must clear before the range is reused (once refs == 0). */
  gpd_event **done;
  uint32_t ndone, capdone;
  gpd_lease **leases;
  uint32_t nleases, capleases;
  /* A holder's connection closed with it while the process still held its lease, so it never
   * said its GPU work on the buffer was done. On a backend with GPU work the range is not
   * handed out again: its slab takes no new buffers and goes back to the backend once empty
   * (CUDA keeps memory alive for a process that still maps it, whatever its queued work). */
  int died_in_use;
  gpd_layout *layout; /* the bundle allocation it is a chunk of (a reference), or NULL */
  gpd_buffer *pending_next;
  /* Its replicas on other devices (replicas.c), each holding one reference on its replica
   * buffer: they go when this buffer's last holder lets go, or when it is published again. */
  gpd_replica *replicas;
  uint64_t replica_of;    /* for a replica: the id of the buffer it copies, else 0 */
};

/* A replica of a source buffer (one version's) on another device: a buffer in a pool of that
 * device, filled by a copy job; handed out only once the copy is complete. */
struct gpd_replica {
  gpd_buffer *src;       /* the buffer it copies (it lists this record while attached) */
  gpd_buffer *buf;       /* the replica (this record's reference) */
  int device;
  int attached;          /* in src->replicas: 0 once the source was published again */
  gpd_copy *copy;        /* the job filling it, NULL once ready */
  gpd_replica *next;     /* in src->replicas */
};

/* A running copy job: one backend job filling replicas (one segment per source buffer, one
 * destination per device along a chain). It holds a reference on each source buffer, so no
 * source range is reused while an engine reads it. */
struct gpd_copy {
  uint64_t id;
  gpupool__bcopy *job;   /* NULL while it waits for a slot (GPD_COPIES_RUNNING_MAX) */
  gpupool__bcopy_seg *segs; /* what it copies, until it starts */
  int ndst;
  gpd_replica **reps;    /* the replicas it fills (source i to device d: reps[i * ndst + d]) */
  uint32_t nreps;
  uint32_t nmade;        /* replica buffers made so far: it starts once all nreps exist */
  gpd_buffer **srcs;     /* referenced once each while it runs */
  uint32_t nsrcs;
  uint64_t bytes;        /* bytes it writes, all destinations */
  uint64_t created_ns;   /* when it was asked for: it waits for its sources' ready events
                          * at most GPD_COPY_READY_WAIT_NS from then */
  gpd_copy *prev, *next; /* in reg->copies */
};

struct gpd_hold {
  uint64_t id;
  gpd_buffer *buf;
  gpd_client *client;
  gpd_event *done;
  int read_only;
  int owner;              /* the allocating hold: counts against the client's limits */
  uint64_t ready_group;    /* opened from a kept share of a group (gpd_keep): told in its desc */
  gpd_hold *prev, *next;   /* in client->holds */
};

/* A kept share: a hold the daemon keeps on a buffer for a token in flight (a tensor pickled
 * into a queue), so the token opens after its maker released the buffer or exited. It goes
 * when the token is opened (the opener's new hold takes its place) or share_keep_ms after it
 * was made, whichever comes first: a message never read leaks nothing for longer. It counts
 * as a hold of its maker's tenant, and against max_kept_shares_per_client of its maker's
 * connection while that is open. */
struct gpd_keep {
  uint64_t id;             /* from the registry's id space: never a buffer's id */
  gpd_buffer *buf;
  uint8_t secret[16];
  int read_only;           /* made from a read-only hold: opens read-only */
  uint64_t tenant;         /* whose holds it counts as */
  uint64_t client_id;      /* the connection that made it (gone when not in reg->clients) */
  uint64_t expires_ns;
  int claimed;             /* named by an earlier token of the Open being handled */
  /* Nonzero: made by a Share whose client recorded its buffers' ready events together
   * (Share.ready_together), the same for every keep of that Share; not kept across a restart
   * (the events are the old clients'): a restored keep has 0 and its opener waits on it alone. */
  uint64_t ready_group;
  gpd_keep *prev, *next;   /* in reg->keeps_head..keeps_tail, oldest first */
};

/* A published read-only file (files.c): the daemon's own open file description of the file
 * the publisher passed with PublishFile (reopened, so no client shares it), owned here until
 * the name goes and the last operation using it is done, and the range and identity it had
 * when published. Consumers each receive a description of their own; at each get the daemon
 * checks that the file still has that size and mtime and is long enough for the range. */
typedef struct {
  int fd;
  uint64_t offset, length;   /* the range consumers map (length > 0) */
  uint64_t size;             /* st_size at publish */
  uint64_t dev, ino;
  int64_t mtime_sec;
  uint32_t mtime_nsec;
  char *path;                /* as resolved from the fd, for messages */
  int leased;                /* holds a read lease (F_SETLEASE F_RDLCK) */
  int stale;                 /* the lease broke: opened for writing or truncated */
  int shared;                /* fd is the publisher's own description (it could not be reopened) */
  uint32_t refs;             /* the name, and each operation on a worker thread using fd */
  uint64_t tenant;           /* whose max_files_per_uid it counts against */
} gpd_file;

/* A member of a bundle: a named range of one of its buffers. */
typedef struct {
  char *name;
  uint32_t buffer;           /* index into the bundle's buffers */
  uint64_t offset, size;     /* inside that buffer */
  gpupool_tensor_meta *meta; /* NULL when published without one */
} gpd_member;

/* A member table, immutable once made: laid out by an allocation (its buffers each keep a
 * reference) or published as a bundle's members; names of that layout share it. Clients refer
 * to it by id, so a warm republish or get moves no members. */
struct gpd_layout {
  uint64_t id;
  uint64_t hash;             /* of the table and tenant: equal tables share one layout */
  uint32_t refs;
  uint64_t tenant;           /* whose members it counts as; only that tenant may publish by id */
  gpd_member *members;
  uint32_t n;
  uint32_t nbufs;            /* buffers it spans */
  uint64_t *need;            /* per buffer: where its last member ends */
};

/* A published name: its current version, one buffer (gpupool_buffer_publish) or a bundle (members
 * lying in one or more buffers). Publishing the name again swaps all of it at once: the
 * buffers of the previous version lose the name's reference and go when their last holder
 * lets go. */
typedef struct {
  char *name;                /* the key: "<namespace>/<name as published>" */
  uint64_t version;          /* 1 for the first publish, +1 for each one after */
  gpd_buffer **bufs;    /* each referenced once by the name */
  uint32_t nbufs;
  gpd_layout *layout;   /* its member table (a reference), NULL for a single buffer */
  gpd_file *file;       /* a published file (no buffers), or NULL */
  uid_t uid;                 /* who published the current version */
  uint64_t tenant;           /* whose names (and members) it counts against */
  uint64_t created_ns;
  int read_only;             /* published from a read-only hold: every get of it is read-only */
  int has_meta;              /* the tensor description published with a single buffer */
  gpupool_tensor_meta meta;
} gpd_name;

/* A bundle allocation, checked and laid out before any memory is taken (it waits in this form
 * when the pool is full): members one after the other, each aligned, cut into chunks of at
 * most one exported allocation; chunk i becomes buffer i. */
typedef struct {
  gpd_registry *reg;
  gpd_pool *pool;
  uint64_t align;
  gpd_layout *layout;   /* the plan's reference; each allocated chunk takes one more */
  gpd_member *members;  /* layout's: buffer = chunk index, offset inside the chunk */
  uint32_t nmembers;
  uint64_t *chunks;          /* chunk sizes */
  uint32_t nchunks;
  uint64_t total;            /* sum of the chunk sizes */
} gpd_bundle_plan;

/* Per-uid accounting for the per-uid limits. A buffer stays on its owner's account until
 * its range is really back in the slab (done events completed, leases gone). */
/* What one tenant (a uid, unless a [tenant] section groups several) has and holds, counted for
 * the limits named *_per_uid (per tenant: for an ungrouped uid, the same thing). */
typedef struct {
  uint64_t tenant;  /* gpd_tenant_of() */
  uint64_t bytes;
  uint32_t allocs;
  uint32_t names;   /* names it published that still exist */
  uint64_t members; /* members of its published bundles */
  uint64_t holds;   /* holds of its connections */
  uint32_t leases;  /* waiting leases of this uid's closed connections */
  uint32_t conns;   /* its connections (server.c) */
  uint32_t waiters; /* its requests waiting (server.c) */
  uint32_t files;   /* published files of its names (files.c) */
} gpd_uid_usage;

/* The registry's part of a connected client (embedded in server.c's connection). */
struct gpd_client {
  uint64_t id;
  uint64_t state_mark;      /* state.c: already named in what the next delta carries */
  uint64_t tenant;          /* see gpd_tenant_of() */
  pid_t pid;
  uid_t uid;
  gid_t gid;
  char name[64];
  uint64_t connected_ns;
  gpd_lease *lease;    /* from gpd_lease_new at connect; owned until client_drop */
  gpd_hold *holds;           /* list */
  uint64_t nholds;
  uint64_t bytes;           /* bytes of buffers it allocated and still live */
  uint32_t allocs;
  gpupool__hmap mapped;     /* slab id -> slab this client has mapped */
  gpupool__hmap mapped_ro;  /* the subset it has mapped read-only only */
  gpupool__hmap attached;   /* pool id -> gpd_pinst it attached (per-owner backends) */
  uint32_t nkept;           /* kept shares it made that are not yet opened or expired */
  uint64_t *revoke;         /* slab ids to send in the next reply */
  uint32_t nrevoke, caprevoke;
  gpupool__ratelimit log_rl; /* the lines it causes (gpupool__log_peer) */
  gpd_event **events;       /* its own events, at most GPD_EVENTS_PER_CLIENT (one reference each) */
  uint32_t nevents, capevents;
  uint32_t next_event;      /* the one the next hold or buffer takes once all are made */
  gpd_event *batch_done;    /* while a request makes many holds: the done event they share */
  /* Ids reserved for its kept shares with tokens it made itself (gpd_reserve): the next one
   * its next such share takes, and the end of its block. */
  uint64_t resv_next, resv_end;
  /* The ids of its last such share that failed, and why (an Open of one says so). */
  uint64_t fail_first, fail_end;
  char *fail_msg;
};

struct gpd_registry {
  const gpd_config *cfg;
  gpupool__backend *be;
  uv_loop_t *loop;
  gpd_pool *pools;
  int npools;
  gpupool__hmap buffers;     /* id -> gpd_buffer (live, refs > 0) */
  gpupool__hmap holds;       /* id -> gpd_hold */
  gpupool__hmap slabs;       /* id -> gpd_slab */
  gpupool__hmap clients;     /* id -> gpd_client */
  gpupool__smap names;       /* name -> gpd_name */
  gpupool__hmap layouts;     /* id -> gpd_layout */
  gpupool__hmap layout_hash; /* hash -> the gpd_layout filed under it */
  gpupool__hmap uids;        /* uid -> gpd_uid_usage */
  gpd_buffer *pending;        /* refs == 0, waiting on dependencies */
  uint64_t npending;
  gpd_lease *waiting;         /* leases of closed connections that still pin memory */
  uint64_t nwaiting;
  int stopped;                     /* gpd_registry_stop was called: reuse nothing more */
  gpd_event **events;         /* by id (1-based) */
  uint32_t nevents, capevents;
  gpd_event *free_events;
  uint64_t next_id;
  uint64_t nnames;
  uint64_t nmembers;         /* members of every layout, all tenants (max_members) */
  uint64_t nfiles;           /* published files (each holds one fd) */
  struct gpd_fileops *fops; /* where files' fds are closed, off the loop (NULL: inline) */
  int lease_signal;          /* the server handles SIGIO: file leases may be taken */
  uv_timer_t sweep_timer;
  int sweep_timer_on;
  gpupool__hmap keeps;       /* id -> gpd_keep */
  gpd_keep *keeps_head, *keeps_tail; /* by expiry (restored ones among them) */
  gpupool__hmap reserves;    /* reserved block (id / GPD_RESERVE_IDS) -> gpd_client */
  uint64_t open_pending;     /* the id the last GPD_OPEN_PENDING return waits for */
  uv_timer_t keep_timer;
  int keep_timer_on;
  int memory_returned;       /* set when a range or slab came back; the server retries waiters */
  /* Replica copies (replicas.c), oldest first: at most GPD_COPIES_RUNNING_MAX started on the
   * backend, the others waiting for a slot; polled by copy_timer while there are any. */
  gpd_copy *copies, *copies_tail;
  uint64_t copy_ready_scan; /* the id of the last job whose sources' readiness a tick checked */
  uint64_t ncopies, ncopies_started;
  uv_timer_t copy_timer;
  int copy_timer_on;
  /* Jobs whose replica buffers are still being made, a slice of loop time per turn. */
  uint64_t ncopies_making;
  uv_idle_t copy_make_idle;
  int copy_make_on;
  /* The backend's copy notifier (copy_notify_fd), watched for as long as the registry lives:
   * a job that ends is polled at once, not up to a timer tick later. */
  uv_poll_t copy_notify;
  int copy_notify_fd; /* -1: none, the timer alone polls */
  uint64_t copies_started, copies_failed, copy_bytes;
  /* Called when a copy job ended (rc 0, or the error with its message) after its replicas
   * became ready or were dropped: the server answers or retries the gets waiting on it. */
  void (*on_copy)(gpd_registry *reg, uint64_t copy_id, int rc, const char *msg);
  /* Called when memory came back to a pool (to retry waiting allocations). */
  void (*on_memory)(gpd_registry *reg, gpd_pool *pool);
  const gpd_registry_ext *ext; /* the replicas, once attached (gpd_replicas_attach) */
  void *owner;
  struct gpd_parts *parts; /* sharded versions waiting for parts (parts.c), NULL until the first */
  /* What outlives the process (state.c): NULL when nothing does. state_changes moves with
   * each change the cheap counters it compares do not show (a new version, a mapping). */
  struct gpd_state *state;
  uint64_t state_changes;
  /* Told of every slab and lease made or gone, so that what outlives the process keeps their
   * fds (state.c sets it when it keeps any): slabs.c and leases.c report through it rather
   * than call up into the state. NULL: nobody keeps them. */
  const struct gpd_keep_ops *keep;
};

struct gpd_keep_ops {
  void (*slab_new)(gpd_registry *reg, gpd_slab *s);
  void (*slab_gone)(gpd_registry *reg, gpd_slab *s);
  void (*lease_new)(gpd_registry *reg, gpd_lease *l);
  void (*lease_gone)(gpd_registry *reg, gpd_lease *l);
  /* A name published or taken out (key: as in reg->names), a buffer's range given back, a
   * layout freed: what the next change written must carry (a delta, state.c). */
  void (*name_changed)(gpd_registry *reg, const char *key);
  void (*buffer_gone)(gpd_registry *reg, uint64_t id);
  void (*layout_gone)(gpd_registry *reg, uint64_t id);
  /* A buffer made or its record changed; a client's holds or mappings changed; a client going
   * away with its lease (waiting: still pinning what it held and mapped, before its holds go). */
  void (*buffer_changed)(gpd_registry *reg, gpd_buffer *b);
  void (*client_changed)(gpd_registry *reg, gpd_client *c);
  void (*client_gone)(gpd_registry *reg, gpd_client *c, gpd_lease *lease, int waiting);
  /* A kept share made (its token may be opened after a restart), or gone (opened, expired). */
  void (*share_kept)(gpd_registry *reg, const gpd_keep *k);
  void (*share_gone)(gpd_registry *reg, uint64_t id);
};

int gpd_registry_init(gpd_registry *reg, uv_loop_t *loop, const gpd_config *cfg,
                     gpupool__backend *be);
/* Frees everything: buffers, slabs, pools, events. Call after every client is gone. */
void gpd_registry_close(gpd_registry *reg);

/* Stop watching leases and GPU work (the daemon is shutting down: it reuses nothing from now
 * on, so memory that live processes map stays valid) and log what was still pending. After
 * this the loop has nothing of the registry's left to wait for. */
void gpd_registry_stop(gpd_registry *reg);

/* A new lease for a connection of uid (pid for logs). *peer is the end to hand to the client
 * (the caller sends it in the Hello reply and closes its copy). GPUPOOL_ELIMIT when the
 * daemon has no fd left: refuse the connection, never serve it unwatched. */
int gpd_lease_new(gpd_registry *reg, uid_t uid, gid_t gid, pid_t pid, gpd_lease **out, int *peer);
/* Drop a lease that never reached a client (connection refused before client_init). */
void gpd_lease_discard(gpd_lease *l);

void gpd_client_init(gpd_registry *reg, gpd_client *c);
/* The connection closed: drop every hold of c. When it still held or mapped memory, its
 * ranges and mappings wait for c->lease (taken over here) to be gone; otherwise the lease is
 * closed at once. */
void gpd_client_drop(gpd_registry *reg, gpd_client *c);

gpd_pool *gpd_pool_find(gpd_registry *reg, const char *name, uint32_t id);

/* AttachPool: the backend pool c imports for pool p (its owner's instance, created when it
 * has none), kept alive while c stays connected. *fd is that pool's fd to send (owned by the
 * registry), or -1 when the backend has none. GPUPOOL_EPERM when p is shared with a group c
 * is not in. */
int gpd_attach(gpd_registry *reg, gpd_client *c, gpd_pool *p, int *fd);

/* Operations. Each returns 0 or a GPUPOOL_E* code with a gpupool__err() message. On success
 * *out is a new hold of c; fill a BufferDesc for it with gpd_fill_desc. */
int gpd_allocate(gpd_registry *reg, gpd_client *c, gpd_pool *pool, uint64_t size, uint64_t align,
                gpd_hold **out);
/* s mapped read-write in the daemon (made once, kept until s goes): *base is its start. Host
 * slabs only (those with an fd); EBACKEND with the reason otherwise. */
int gpd_slab_daemon_map(gpd_slab *s, uint8_t **base);
/* The same for a buffer the daemon fills in full before anyone gets it: place is
 * GPD_PLACE_FETCHED (registry_internal.h) for a version's copy fetched from a peer. */
int gpd_allocate_as(gpd_registry *reg, gpd_client *c, gpd_pool *pool, uint64_t size, uint64_t align, int place,
                    gpd_hold **out);
int gpd_release(gpd_registry *reg, gpd_client *c, uint64_t hold_id, int done_recorded, int *freed);
/* keep: a kept share (see gpd_keep), the token names the keep instead of the buffer. */
int gpd_share(gpd_registry *reg, gpd_client *c, uint64_t hold_id, int keep, uint8_t token[GPUPOOL_TOKEN_SIZE]);
/* Share hold_ids[0..n) in one go (tokens[i] for hold_ids[i]): all or nothing, no kept share
 * left behind when one fails. ready_together (kept shares of two or more holds): their ready
 * events were recorded together, and the keeps get one new ready group. */
int gpd_share_many(gpd_registry *reg, gpd_client *c, const uint64_t *hold_ids, size_t n, int keep,
                   int ready_together, uint8_t (*tokens)[GPUPOOL_TOKEN_SIZE]);
/* Open n tokens for c: all or nothing. *opened: how many were (the first ones; fewer than n
 * only when the rest would need more new slab fds than one reply carries, max_fds); out[i]
 * the hold of token i. The tokens not opened are untouched. */
int gpd_open_many(gpd_registry *reg, gpd_client *c, const uint8_t *const *tokens, const size_t *lens, size_t n,
                  int read_only, unsigned max_fds, gpd_hold **out, size_t *opened);
/* Whether c's hold hold_id is its buffer's only reference with every earlier holder's GPU work
 * on it done (completed done events are given back on the way): *idle 1 or 0. */
int gpd_hold_idle(gpd_registry *reg, gpd_client *c, uint64_t hold_id, int *idle);
/* Whether b's done events have completed and its dead holders' leases are gone (giving back
 * what has): 1 or 0. */
int gpd_buffer_deps_clear(gpd_registry *reg, gpd_buffer *b);
int gpd_open(gpd_registry *reg, gpd_client *c, const uint8_t *token, size_t len, int read_only,
            gpd_hold **out);
/* What gpd_open and gpd_open_many return (nothing opened, nothing claimed) for a token whose
 * id another connection reserved and has not shared yet: its share may be on its way (the
 * sharer does not wait for the reply), reg->open_pending the id to wait for. */
#define GPD_OPEN_PENDING 1
/* Reserve up to want (at most GPD_RESERVE_IDS) ids for c's shares with tokens it makes
 * itself, giving up those left of its previous reserve: *first and *count. */
#define GPD_RESERVE_IDS 256u
int gpd_reserve(gpd_registry *reg, gpd_client *c, uint32_t want, uint64_t *first, uint32_t *count);
/* Kept shares of hold_ids[0..n) (as gpd_share_many with keep) whose ids are c's next n
 * reserved ones and whose secrets are secrets[16 * i ...]: the ids are used up even when the
 * share fails (c made its tokens already), and the failure is remembered for their Open. */
int gpd_share_reserved(gpd_registry *reg, gpd_client *c, const uint64_t *hold_ids, size_t n, int ready_together,
                       const uint8_t *secrets, uint64_t *first);
/* The connection that reserved id and has not used it yet, or NULL. */
gpd_client *gpd_reserve_owner(gpd_registry *reg, uint64_t id);
/* c goes: its reserve with it (gpd_client_drop). */
void gpd_reserve_drop(gpd_registry *reg, gpd_client *c);
/* c's hold id: 0 and *out, or GPUPOOL_ENOENT with the reason. A request's handler finds
 * a hold once and passes it on. */
int gpd_hold_of(gpd_registry *reg, gpd_client *c, uint64_t id, gpd_hold **out);
/* Publish the buffer of c's hold h (found once, gpd_hold_of) under rn: a new name (version 1)
 * or the name's next version (*version gets it). */
int gpd_publish(gpd_registry *reg, gpd_client *c, gpd_hold *h, const gpd_rname *rn,
                     const Gpupool__Wire__TensorMeta *meta, gid_t share_gid, int share_all, uint64_t *version);
/* Tenants. A client's tenant is the [tenant] section naming its uid or primary gid, else its
 * uid alone; a pool shared with a [group] belongs to that group. Names live in namespaces:
 * a plain name in the caller's tenant's, "group:G/name" in group G's (members only).
 * gpd_name_key writes the key a name is filed under ("uid:1000/weights",
 * "tenant:ml/weights", "group:ml/weights") and the namespace's owner id. */
/* What one uid has and holds, counted for its limits: the record (created when create is
 * set; NULL when absent or out of memory), and its release, which frees it once every count
 * is zero. */
gpd_uid_usage *gpd_uid_usage_get(gpd_registry *reg, uint64_t tenant, int create);
/* "uid:1000", "tenant:NAME" or "group:NAME", for messages. */
void gpd_tenant_label(const gpd_config *cfg, uint64_t tenant, char *buf, size_t len);
void gpd_uid_usage_put(gpd_registry *reg, gpd_uid_usage *u);
/* Whose memory c's buffers in p are (the group of a shared pool, else c's tenant); GPUPOOL_EPERM
 * when c may not use p. */
int gpd_pool_owner(gpd_registry *reg, const gpd_client *c, const gpd_pool *p, uint64_t *owner);
uint64_t gpd_tenant_of(const gpd_config *cfg, uid_t uid, gid_t gid);
/* Resolve a request's name once, in its handler: the key it is filed under (the tenant's
 * label, or a group's name:GROUP/ prefix, then the name) and whose memory it names. 0, or
 * the error (ENAME for a malformed name, EPERM for a group c is not in), which is also kept
 * in *out: the functions given *out report it where they need the name, so a request refused
 * for another reason first is refused for that reason, as before. name is UTF-8 without NUL
 * already (the frame validator checks every string of a client's request, peers_serve.c the
 * name a peer asks for), so its UTF-8 is not read again here. */
int gpd_name_key(gpd_registry *reg, const gpd_client *c, const char *name, gpd_rname *out);
/* 0 when rn resolved, else its error again (code and message). */
int gpd_rname_ok(const gpd_rname *rn);
/* Lookup for Get: 0 with *out a new hold and *version the name's version; GPUPOOL_ENOENT
 * when absent, not visible, or not newer than newer_than (wait and try again);
 * GPUPOOL_EINVAL for a bundle of several buffers. */
int gpd_get(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int read_only, uint64_t newer_than,
                 gpd_hold **out, uint64_t *version);
/* The device of a pool: a device pool's GPU, a simulated one's (host backend), else -1. */
int gpd_pool_device(const gpd_registry *reg, const gpd_pool *p);
/* Publish a bundle: members (wire form) lying in the buffers of the nholds holds. Checks
 * everything first, each member name in full (members from a peer's reply, which no frame
 * validator saw); nothing changes on error. *version is the version made. */
int gpd_publish_bundle(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint64_t *hold_ids,
                            size_t nholds, Gpupool__Wire__BundleMember *const *members, size_t nmembers,
                            uint64_t layout_id, uint64_t *version);
/* The same for members of a client's request, which the frame validator passed: their names'
 * bytes are already known to be UTF-8 without NUL, so that is not checked a second time. */
int gpd_publish_bundle_checked(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, const uint64_t *hold_ids,
                               size_t nholds, Gpupool__Wire__BundleMember *const *members, size_t nmembers,
                               uint64_t layout_id, uint64_t *version);
/* Publish part idx of the nparts parts of a sharded version of name (parts.c): members as
 * gpd_publish_bundle_checked's (a client's request); the version is published when its last part
 * is in. */
typedef struct {
  uint64_t version;  /* the version the part belongs to (made, when complete) */
  uint32_t parts_in; /* its parts in so far */
  int complete;      /* this part completed it: it is published */
} gpd_part_result;
int gpd_publish_part(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, uint64_t version, uint32_t idx,
                     uint32_t nparts, const uint64_t *hold_ids, size_t nholds,
                     Gpupool__Wire__BundleMember *const *wm, size_t nmembers, uint64_t layout_id,
                     gpd_part_result *res);
/* c's connection closed: every version waiting for parts that has one of c's goes. */
void gpd_parts_client_gone(gpd_registry *reg, const gpd_client *c);
/* Drop every waiting version (the registry closes). */
void gpd_parts_close(gpd_registry *reg);
/* Get a bundle (or single buffer) by name: *holds (an array the caller frees) gets one new
 * hold per buffer, *name the name entry (valid until the loop runs again). Same codes as
 * gpd_get, except that a single buffer is a bundle of one. */
int gpd_get_bundle(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int read_only,
                        uint64_t newer_than, gpd_hold ***holds, const gpd_name **out);
/* Check and lay out a bundle allocation (no memory taken): 0 and *out (free it with
 * gpd_bundle_plan_free), or the error. specs come from a request the frame validator passed
 * (their names' UTF-8 is not checked again). */
int gpd_bundle_plan_new(gpd_registry *reg, gpd_client *c, gpd_pool *p,
                             Gpupool__Wire__MemberSpec *const *specs, size_t n, uint64_t align,
                             gpd_bundle_plan **out);
void gpd_bundle_plan_free(gpd_bundle_plan *plan);
/* Allocate a planned bundle: every chunk or none. *holds (caller frees the array) gets one
 * new hold per chunk. GPUPOOL_ENOSPC when it does not fit now. */
int gpd_bundle_allocate(gpd_registry *reg, gpd_client *c, const gpd_bundle_plan *plan,
                             gpd_hold ***holds);
/* Drop a hold made by the calls above before it reached the client (a reply failed). */
void gpd_hold_discard(gpd_registry *reg, gpd_hold *h);
int gpd_unpublish(gpd_registry *reg, gpd_client *c, const gpd_rname *rn);
/* Files (files.c). Both requests do their system calls on the file off the loop
 * (fileops.c) and answer through done, on the loop, unless the request is refused at once
 * (their return value; done is then never called). done's rc is 0 or the error (message in
 * gpupool__errmsg()); f is the file (valid during the call); fd is the fd to send the client
 * with the reply or -1, still files.c's: send it (a queued reply duplicates it), do not close
 * it. *op lets the caller forget the request (gpd_file_op_forget) if it goes away first.
 * PublishFile takes fd in every case: checks that it is a regular file opened read-only, the
 * operator's allow_files / file_paths, the range and the name limits, and files it under name
 * in c's namespace. GetFile: the file name c sees, checked against the file as it is now
 * (GPUPOOL_ESTALE when it changed since publishing); GPUPOOL_ENOENT when absent,
 * GPUPOOL_EINVAL for a buffer name. */
typedef struct gpd_file_op gpd_file_op;
typedef void (*gpd_file_done)(void *arg, int rc, const gpd_file *f, int fd);
int gpd_publish_file(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, int fd,
                          uint64_t offset, uint64_t length, gpd_file_done done, void *arg,
                          gpd_file_op **op);
int gpd_get_file(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, gpd_file_done done,
                      void *arg, gpd_file_op **op);
/* The requester went away: done will not be called; what the request made is let go. */
void gpd_file_op_forget(gpd_file_op *op);
/* Operator: remove the name filed under key (e.g. "uid:1000/weights", as AdminNames lists it),
 * whoever published it; GPUPOOL_ENOENT when there is none. */
int gpd_unpublish_key(gpd_registry *reg, const char *key);
/* Close a file object (its name is being removed). */
void gpd_file_close(gpd_registry *reg, gpd_file *f);
/* SIGIO came: find the files whose lease is breaking, mark them stale and let the lease go. */
void gpd_files_lease_check(gpd_registry *reg);
/* Let every lease go and take no more (SIGIO is no longer handled). */
void gpd_files_unlease(gpd_registry *reg);
/* Name lookup shared by buffers and files: ENAME for a malformed name, ENOENT when absent. */
int gpd_find_name(gpd_registry *reg, gpd_client *c, const gpd_rname *rn, gpd_name **out);

/* The client reports that it unmapped these slabs. */
void gpd_unmapped(gpd_registry *reg, gpd_client *c, const uint64_t *ids, size_t n);
/* Give back unused slabs; counts what was freed now and what awaits unmapping. */
void gpd_trim(gpd_registry *reg, uint32_t *freed, uint32_t *revoked);
/* Check pending ranges and retiring slabs; frees what is clear. */
void gpd_sweep(gpd_registry *reg);

/* Free bytes a request of `size` could use right now (for error messages). */
uint64_t gpd_pool_free_bytes(const gpd_pool *p);

/* Fills d (and its sub-messages, which the caller provides storage for). */
typedef struct {
  Gpupool__Wire__BufferDesc desc;
  Gpupool__Wire__SlabRef slab;
  Gpupool__Wire__EventRef ready, done;
  Gpupool__Wire__TensorMeta meta; /* points into the registry's copy of the metadata */
  int fd;                         /* to send with the reply (the slab's), or -1 */
} gpd_desc_storage;
/* Whether gpd_fill_desc of a hold (read_only or not) in sl sends c how to map sl (with the
 * slab's fd where it has one): c has not mapped it, or mapped it read-only and may now write. */
int gpd_desc_sends_slab(const gpd_client *c, const gpd_slab *sl, int read_only);
/* rn: the name the hold was got by, if any (its tensor description is sent; otherwise the
 * one the buffer was last published with). */
void gpd_fill_desc(gpd_registry *reg, gpd_client *c, gpd_hold *h, const gpd_rname *rn,
                  gpd_desc_storage *s);
void gpd_fill_pool_info(gpd_registry *reg, gpd_pool *p, Gpupool__Wire__PoolInfo *pi);

uint64_t gpd_now_ns(void);

#endif
