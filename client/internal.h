/*
 * libgpupool-client internals: the client struct and what the files of client/ share.
 * Not installed; nothing here is exported from the shared library.
 *
 * libgpupool-client: one connection to gpupoold, shared by every thread of the caller.
 *
 * Requests carry a sequence number; replies may come back in any order (a get that waits
 * for a publisher does not hold up an allocate from another thread). Whichever waiting
 * thread finds no reader active becomes the reader, reads one frame without the lock, hands
 * it to the thread whose request it answers, and wakes everyone. All other state (imported
 * pools, mapped slabs, opened events, live buffers) is guarded by the one mutex.
 *
 * Memory: each pool is imported once, each slab mapped once (refcounted by the buffers this
 * client has in it), each event opened once. A buffer is (slab base + offset).
 *
 * Lease: the Hello reply carries an fd this client keeps (close-on-exec) for as long as it maps
 * any of that daemon's memory; forked children share it. The daemon reuses what a closed
 * connection held or mapped only once no process holds the lease any more, so it is closed
 * only after the last mapping of its daemon's memory is gone.
 *
 * The files, each calling only those below it (docs/ARCHITECTURE.md, "Inside the client"):
 * refit.c, connect.c (connect, reconnect, disconnect), pending.c (pipelining), files.c
 * (published files), parts.c, bundles.c, buffers.c, maps.c (pools, slabs, events, stale
 * generations), names.c (names this client published or lost), conn.c (transport, reader
 * election, call; it reports reconnects and revocations upward through the callbacks in the
 * client struct).
 */
#ifndef GPUPOOL_CLIENT_INTERNAL_H
#define GPUPOOL_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#include "backend.h"
#include "errors.h"
#include "hmap.h"
#include "sock.h"
#include "wire.h"

#define GPUPOOL_WAIT_FOREVER UINT32_MAX

typedef struct cpool {
  uint32_t id;
  char name[64];
  gpupool_mem_kind kind;
  int device;
  uint64_t capacity;
  gpupool__cpool *bp; /* NULL until attached */
} cpool;

typedef struct cslab {
  uint64_t id;
  cpool *pool;
  void *base;     /* the first mapping: read-write, or read-only when `writable` is 0 */
  void *base_rw;  /* a second, read-write mapping, made when a writable hold came later */
  int writable;   /* base is read-write */
  uint64_t size;
  void *priv;
  int dedicated;
  uint32_t refs; /* buffers of this client inside */
  int keep;      /* dedicated, but stays mapped when empty until revoked (GPUPOOL_KEEP_MAPPED) */
  struct stale_gen *stale; /* set when its daemon connection is gone */
} cslab;

/* How to map a slab, kept from the reply that carried it: with several threads, the reply
 * that carries a slab's export data may be processed after another reply that only names it. */
typedef struct slab_export {
  uint32_t pool_id;
  uint64_t size;
  int dedicated;
  int fd;        /* the slab's own fd, when the frame carried one (host), else -1 */
  int writable;  /* the fd (or the hold it came for) allows writing */
  size_t len;
  uint8_t data[];
} slab_export;

typedef struct pending {
  uint64_t seq;
  uint64_t gen;   /* c->reconnects when it was sent */
  gpupool__rep *rep;
  int fds[GPUPOOL_WIRE_MAX_FDS];
  int nfds;
  int done;
  int err; /* set with done when the connection broke before the reply came */
  int detached; /* nobody waits for it (a share that does not wait): read_one frees it */
  struct pending *next;
} pending;

/* What is left of a connection to a daemon that went away: its pools and events stay
 * imported while buffers obtained through it still map its slabs (mappings outlive the
 * daemon), and go when the last such buffer is released. */
typedef struct stale_gen {
  cpool *pools;
  int npools;
  gpupool__hmap events;
  uint64_t live_slabs;
  int lease_fd;            /* closed with the generation's last mapping */
  struct stale_gen *next;
} stale_gen;

struct gpupool_client {
  int fd;
  int lease_fd;            /* this connection's lease, or -1 */
  uint8_t resume[32];      /* the daemon's resume token for this connection (HelloReply.resume) */
  size_t resume_len;       /* 0: none (a daemon that keeps no state) */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t next_seq;
  int reader_active;
  int broken;              /* 0 or the error that ended the connection */
  char broken_msg[GPUPOOL__ERRMSG_MAX];
  pending *pend;
  gpupool__wire_rx rx;     /* used only by the active reader */
  const gpupool__cbackend_ops *be;
  int backend_kind;
  cpool *pools;
  int npools;
  gpupool__hmap slabs;     /* id -> cslab */
  gpupool__hmap exports;   /* slab id -> slab_export seen in a reply, not yet mapped */
  gpupool__hmap events;    /* id -> gpupool__cevent */
  uint64_t *unmapped;      /* slab ids to report in the next request */
  size_t nunmapped, capunmapped;
  gpupool_buffer *buffers; /* live buffers (for disconnect) */
  int devices[64];
  int ndevices;
  uint64_t client_id;
  uint32_t max_frame;
  /* Reconnection after the daemon went away (restart, crash). */
  char socket_path[108];
  char name[64];
  int reconnect_ms;        /* budget for reconnecting before a request fails */
  int connect_timeout_ms;  /* connect + Hello; < 0: wait forever */
  uint64_t hs_deadline_ns; /* while saying Hello: when to give up (0 otherwise) */
  int hs_closed;           /* the last Hello went unanswered and the peer hung up: on a socket
                            * that served us before, most likely a daemon restarting */
  int spin_us;             /* GPUPOOL_SPIN_US: poll this long for a reply before sleeping */
  int host_fences_env;     /* GPUPOOL_HOST_FENCES: 1 on, 0 off, -1 decide per connection */
  int host_fences;         /* this connection orders work by synchronizing streams, not with
                            * the daemon's IPC events (see gpupool_client_host_fences) */
  uint32_t max_release_batch; /* holds one Release may name (HelloReply); 0 or 1: one each */
  uint64_t reconnects;
  uint64_t slab_maps;      /* backend mappings (imports) of slabs made, over the client's life */
  uint64_t ready_waits;    /* streams made to wait on a producer's ready event, over its life */
  /* Shares that do not wait for their reply (gpupool_buffer_share_kept_many_nowait): the ids
   * reserved for this connection's tokens, the replies not read yet, and the failures. */
  uint64_t resv_next, resv_end;
  int resv_asked;          /* a Share that reserves ids is in flight (one at a time) */
  uint32_t nowait_inflight;
  uint64_t nowait_failed;
  char nowait_msg[GPUPOOL__ERRMSG_MAX];
  stale_gen *stale;
  char **published;        /* names this client published and has not unpublished */
  size_t npublished, cappublished;
  char **lost_names;       /* names lost in a restart, until gpupool_client_lost_names() reads them */
  gpupool__smap layout_cache; /* name -> clayout (a reference): member tables got by name */
  size_t nlayout_cache;
  size_t nlost_names;
  uint64_t holds_lost;
  /* What the transport (conn.c) reports to the layer above, given at connect (connect.c):
   * the transport calls nothing above it. */
  int (*reconnect)(gpupool_client *c, gpupool__error *err); /* replace a connection the daemon closed
                                                             (c->mu held); why it failed in *err */
  void (*revoked)(gpupool_client *c, const uint64_t *slabs, size_t n); /* slabs a reply revoked */
};

struct gpupool_buffer {
  gpupool_client *c;
  uint64_t hold_id, buffer_id;
  cslab *slab;
  void *base;     /* the slab mapping this buffer uses (read-only holds may use a read-only one) */
  uint64_t offset, size;
  int read_only;
  uint32_t ready_id, done_id;
  int has_meta;
  gpupool_tensor_meta meta;
  int lost; /* its hold died with a previous daemon connection */
  gpupool_buffer *prev, *next;
};
/* A member table as the daemon sent it, shared by the bundles laid out that way (members'
 * ptr fields are unset: a bundle adds its buffers' addresses) and cached per name, so a later
 * get of the same layout receives no members. */
typedef struct clayout {
  uint64_t id;               /* the daemon's layout id (0: none, e.g. a single buffer) */
  uint32_t refs;
  int n;
  uint32_t nbufs;
  gpupool_member *members;   /* ptr is NULL; name points into names */
  char *names;
  uint64_t *need;            /* per buffer: where its last member ends */
} clayout;
struct gpupool_bundle {
  gpupool_client *c;
  gpupool_buffer **bufs;  /* owned: one hold each */
  int nbufs;
  clayout *layout;        /* a reference */
  uint64_t version;
};

/* GPUPOOL_TRACE (conn.c). */
extern FILE *gpupool__trace_file;
extern pthread_once_t gpupool__trace_once;
#define TRACE_ON() (pthread_once(&gpupool__trace_once, gpupool__trace_open), gpupool__trace_file != NULL)

/* conn.c */
void gpupool__trace_open(void);
void gpupool__trace(const char *what, uint64_t t0, uint64_t detail);
void gpupool__set_broken(gpupool_client *c, int code, const char *msg);
void gpupool__export_free(slab_export *e);
void gpupool__exports_clear(gpupool_client *c);
const Gpupool__Wire__BufferDesc *gpupool__reply_desc(const gpupool__rep *rep, int want);
const Gpupool__Wire__Bundle *gpupool__reply_bundle(const gpupool__rep *rep);
/* The transport's calls record no message: a failure fills *err (code and message) and returns
 * its code, for the public entry point to report with gpupool__error_report(); *err is left
 * alone on success. */
/* An Idle request about bufs[0..n) into req and id (*ids: the hold ids, the caller frees);
 * its reply's answers into idle[0..n) (the reply freed). */
int gpupool__idle_request(gpupool_buffer *const *bufs, int n, gpupool__req *req, Gpupool__Wire__Idle *id,
                          uint64_t **ids);
int gpupool__idle_answer(gpupool__rep *rep, int n, int *idle);
/* Read one reply and hand it to its waiter (or, detached, handle it). With c->mu, not while
 * another thread reads (c->reader_active). */
void gpupool__read_reply(gpupool_client *c);
int gpupool__call_send(gpupool_client *c, gpupool__req *req, pending **out, int send_fd, gpupool__error *err);
int gpupool__call_wait(gpupool_client *c, pending *p, gpupool__rep **out, int *fds_out, int *nfds_out,
                       gpupool__error *err);
int gpupool__call(gpupool_client *c, gpupool__req *req, gpupool__rep **out, int *fd_out, gpupool__error *err);
int gpupool__ensure_connected(gpupool_client *c, gpupool__error *err);
int gpupool__call_retry(gpupool_client *c, gpupool__req *req, gpupool__rep **out, int send_fd,
                        gpupool__error *err);

/* maps.c */
int gpupool__be_unmap(gpupool_client *c, cslab *s, void *stream);
void gpupool__slab_unmap(gpupool_client *c, cslab *s, void *stream);
void gpupool__handle_revokes(gpupool_client *c, const uint64_t *slabs, size_t n);
int gpupool__pool_attach(gpupool_client *c, cpool *p, gpupool__error *err);
int gpupool__send_release(gpupool_client *c, uint64_t hold_id, int done_recorded, gpupool__error *err);
int gpupool__materialize(gpupool_client *c, const Gpupool__Wire__BufferDesc *d, int wait_ready, void *stream,
                         gpupool_buffer **out, gpupool__error *err);

/* maps.c: stale generations */
void gpupool__release_imports(gpupool_client *c, gpupool__hmap *events, cpool *pools, int npools);
void gpupool__stale_gen_free(gpupool_client *c, stale_gen *g);

/* names.c */
void gpupool__utf8_scrub(char *s);
void gpupool__note_published(gpupool_client *c, const char *name);
void gpupool__note_unpublished(gpupool_client *c, const char *name);

/* buffers.c */
void gpupool__release_local(gpupool_client *c, gpupool_buffer *b, void *stream, uint64_t *hold_id, int *recorded);
void gpupool__release_request(gpupool__req *req, Gpupool__Wire__Release *rl, uint64_t hold_id, int recorded);
int gpupool__release_locked(gpupool_client *c, gpupool_buffer *b, void *stream, gpupool__error *err);
int gpupool__release_many_locked(gpupool_client *c, gpupool_buffer **bs, int n, void *stream, gpupool__error *err);
uint32_t gpupool__wire_timeout(int timeout_ms);
int gpupool__lost_err(const gpupool_buffer *b);
int gpupool__record_ready(gpupool_client *c, gpupool_buffer *b, void *stream);
int gpupool__hand_over_prepare(gpupool_client *c, gpupool_buffer *b, void *stream, gpupool__error *err);
void gpupool__keep_mapped(gpupool_buffer *b, unsigned flags);
uint64_t gpupool__reply_version(const gpupool__rep *rep);
int gpupool__publish_request(gpupool_buffer *b, const char *name, const gpupool_tensor_meta *meta, gpupool__req *req,
                             Gpupool__Wire__Publish *pb, Gpupool__Wire__TensorMeta *tm);
int gpupool__get_across_restarts(gpupool_client *c, gpupool__req *req, uint32_t *wire_timeout_ms, int timeout_ms,
                                 gpupool__rep **out, uint64_t *known_layout, gpupool__error *err);
/* Get.target_device / GetBundle.target_device from a get's flags (GPUPOOL_ON_DEVICE(d)): 1 + d,
 * or 0 for wherever the version lies. */
static inline uint32_t gpupool__target_device(unsigned flags) {
  return (flags & GPUPOOL_TARGET_DEVICE) ? ((flags >> 16) & 0x3ffu) + 1 : 0;
}
/* The devices of a broadcast publish (n of them, 0..16) checked and copied to out. */
int gpupool__replicate_to(const int *devices, int n, uint32_t *out);
int gpupool__get_request(const char *name, uint64_t newer_than, int timeout_ms, unsigned flags, gpupool__req *req,
                         Gpupool__Wire__Get *gt);
int gpupool__get_finish(gpupool_client *c, gpupool__rep *rep, unsigned flags, void *stream, gpupool_buffer **out,
                        uint64_t *version, gpupool__error *err);

/* bundles.c */
void gpupool__clayout_unref(clayout *l);
void gpupool__layout_cache_clear(gpupool_client *c);
clayout *gpupool__layout_cached(gpupool_client *c, const char *name);
void gpupool__release_holds_from(gpupool_client *c, const Gpupool__Wire__Bundle *wb, size_t from, uint64_t gen);
int gpupool__bundle_get_request(const char *name, uint64_t newer_than, int timeout_ms, unsigned flags,
                                gpupool__req *req, Gpupool__Wire__GetBundle *gb);
int gpupool__bundle_get_finish(gpupool_client *c, gpupool__rep *rep, unsigned flags, void *stream, const char *name,
                               clayout *known, gpupool_bundle **out, gpupool__error *err);

#endif
