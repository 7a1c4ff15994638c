/*
 * What the files of gpupoold's server share (not an interface outside daemon/: server.h is):
 * the connection, the server, waiting requests and held-back replies, and the functions one
 * file of the server calls in another. Each file's top comment says what it owns.
 */
#ifndef GPUPOOL_DAEMON_SERVER_INTERNAL_H
#define GPUPOOL_DAEMON_SERVER_INTERNAL_H

#include <stdint.h>
#include <stdio.h>
#include <uv.h>

#include "errors.h"
#include "fileops.h"
#include "log.h"
#include "metrics.h"
#include "paths.h"
#include "requests.h"
#include "server.h"

#define WAIT_FOREVER UINT32_MAX

typedef struct gpd_conn gpd_conn;
typedef struct share share;
typedef struct opwait opwait; /* an Open waiting for a share on its way (open_wait.c) */

/* A PublishFile or GetFile whose system calls run off the loop (files.c): answered when they
 * are done, or forgotten if the connection goes first. */
typedef struct fwait fwait;
struct fwait {
  gpd_conn *conn;
  uint64_t seq;
  int kind;             /* the reply body case */
  int count;            /* counted in the metrics when answered (not a waiter's: that was counted) */
  char *name;
  gpd_rname rn;         /* the name resolved, rn.name = name */
  gpd_file_op *op;
  uint64_t started_ns;
  fwait *prev, *next;   /* in conn->fwaits */
};

/* What a waiting request is: an allocation, a get, a bundle get, a bundle allocation, a get
 * of a file. */
enum { WAIT_ALLOC = 1, WAIT_GET = 2, WAIT_BGET = 3, WAIT_ABUNDLE = 4, WAIT_GET_FILE = 5 };

typedef struct gpd_waiter gpd_waiter;

/* Waiting requests: the allocations of one pool and owner (a FIFO), or the gets of one name.
 * Gets sit in a binary min-heap on (newer_than, arrival): a publish of version v serves
 * exactly those with newer_than < v, which are at the top, so it pops them in O(log n) each
 * and never looks at a get waiting for a later version (thousands of those parked on a name
 * would otherwise make every publish of it cost thousands of lookups). Appending and removing
 * are O(1) for allocations and O(log n) for gets; a pass over a queue touches only the
 * requests that could now succeed. */
typedef struct wqueue wqueue;
struct wqueue {
  gpd_waiter *head, *tail; /* allocations, oldest first */
  char *name;           /* for a queue of gets: the name (the key it is filed under) */
  uint64_t akey;        /* for a queue of allocations: owner * 64 + pool index (its key) */
  uint64_t copy_id;     /* for a queue of gets waiting on a replica copy: the job (its key) */
  wqueue *anext;        /* the next allocation queue of the same pool */
  gpd_waiter **heap; /* gets */
  uint32_t n, cap;
  int waking;           /* a publish (or a copy's end) is serving it: that pass frees it once empty */
};

#define NOT_IN_HEAP UINT32_MAX

struct gpd_waiter {
  gpd_conn *conn;
  uint64_t seq;
  int kind;
  gpd_pool *pool;
  uint64_t size, align;
  char *name;
  int read_only;
  uint64_t newer_than;          /* gets: wait for a version past this */
  int device;                   /* gets: the device asked for (Get.target_device - 1), or -1 */
  uint64_t known_layout;   /* bundle gets: the member table the client already has */
  gpd_bundle_plan *plan;   /* WAIT_ABUNDLE: the checked layout (owned) */
  uint64_t started_ns;
  uint64_t order;               /* arrival, for FIFO among the gets one publish serves */
  int peer_nowait;              /* a get of a peer's name that asked not to wait: answered
                                 * once the peer says it has nothing newer */
  uv_timer_t timer;
  int removed;
  wqueue *q;
  uint32_t hidx;                /* gets: the position in q->heap, or NOT_IN_HEAP */
  gpd_waiter *prev, *next;   /* in q (allocations) */
  gpd_waiter *cprev, *cnext; /* in conn->waiters */
};

/* A uid's share of the loop (keyed like its limits: by tenant, which is the uid unless a
 * [tenant] section groups uids). Frames are read in the poll phase but handled in a pass that
 * runs after it (turn()): each pick serves one frame of the connection at the head of the
 * ready uid that used the least loop time lately, then moves that connection behind its uid's
 * other ready ones. See turn() for why. */
struct share {
  uint64_t key;
  uint32_t conns;        /* connections that refer to it; freed at 0 */
  uint64_t load_ns;      /* loop time its requests took, decayed (LOAD_HALF_LIFE_NS) */
  uint64_t stamp_ns;     /* when load_ns was last decayed */
  gpd_conn *rhead, *rtail; /* its connections with frames read and not yet handled */
  share *rprev, *rnext;  /* in srv->ready while rhead is set */
};

/* A reply held back until the ready events of what it hands over have completed: for a client
 * that cannot wait on the daemon's inter-process events itself (Request.host_fences). */
typedef struct fenced {
  struct fenced *next;
  uint8_t *buf; /* the packed frame */
  size_t len;
  int fds[GPUPOOL_WIRE_MAX_FDS]; /* duplicates, closed once sent */
  int nfds;
  uint32_t nev;
  gpd_event *ev[]; /* still pending when the reply was parked */
} fenced;

struct gpd_conn {
  gpd_client cl;
  gpd_server *srv;
  int fd;
  int lease_peer;    /* the client's end of its lease until the Hello reply carries it, or -1 */
  uv_poll_t poll;
  int poll_events;
  uv_timer_t hs_timer;
  int handles_open;
  gpupool__wire_inbuf in;
  int fds_pending;   /* fds arrived (and were closed): refuse the next frame with EFD */
  int frame_fd;      /* the fd the frame being handled carried (PublishFile), or -1 */
  gpupool__wire_txq txq;
  size_t heap;        /* what this connection's queue and input buffer hold (counted in srv) */
  gpd_waiter *waiters;
  opwait *opwaits;   /* its Opens waiting for shares on their way (counted in nwaiters) */
  uint32_t nwaiters;
  fwait *fwaits;
  gpd_uid_usage *u; /* its uid's record in the registry (connections, waiters, ...) */
  int hello_done;
  int closing;
  int drop_after_flush;
  int fops_paused;    /* not read while its tenant's file calls pile up (fileops.c) */
  int host_fences;    /* its last request said it cannot use the daemon's events */
  fenced *fenced_head, **fenced_tail;
  size_t fenced_bytes;
  share *sh;          /* its uid's share of the loop */
  int ready;          /* in sh's ready list: its input buffer may hold frames; not read meanwhile */
  int ready_paused;   /* ready across a pass: its readable events are unsubscribed meanwhile */
  gpd_conn *rprev, *rnext;
  gpd_conn *prev, *next;
};

struct gpd_server {
  /* The connection layer (conn.c), for the sending half below the handlers (send.c): what
   * closes a connection, and what its poll calls. Set at start. */
  void (*close_conn)(gpd_conn *c, const char *why);
  uv_poll_cb conn_io;
  uv_loop_t *loop;
  const gpd_config *cfg;
  gpd_registry *reg;
  int listen_fd;
  int own_socket;
  uv_poll_t listen_poll;
  int listen_open;
  /* Out of fds at accept: the listener rests, connections that wait are refused with the
   * reason (through the reserve fd), and one log line per interval counts them. */
  uv_timer_t accept_timer;
  int reserve_fd;
  int accept_paused;
  uint64_t refused_nofd, refused_logged_ns;
  gpd_conn *conns;
  uint64_t nconns;
  /* Waiting allocations: one FIFO per pool and owner (tenant, or the group of a shared pool),
   * so one owner's request that does not fit never holds up another owner's. */
  gpupool__hmap alloc_q;               /* owner * 64 + pool index -> wqueue */
  wqueue *alloc_lists[GPUPOOL_MAX_POOLS]; /* the queues of each pool */
  gpupool__smap get_q;               /* name -> wqueue */
  gpupool__hmap copy_q;              /* copy job id -> wqueue of the gets waiting for its replicas */
  gpupool__hmap open_q;              /* reserved id -> the Opens waiting for its share (open_wait.c) */
  size_t heap;                       /* sum of the connections' heap */
  uint64_t requests, errors;
  uint64_t bytes_read;       /* from clients' sockets, all connections (Stats bytes_read) */
  uint64_t started_ns;
  int stopping;
  int in_retry;
  uint64_t last_activity_ns;
  gpd_metrics *metrics; /* counters and exporters; closed with the server */
  uv_signal_t sigio;         /* file leases breaking (files.c) */
  gpd_fileops *fops;    /* closes and file calls off the loop (fileops.c) */
  uint32_t npaused;          /* connections with fops_paused */
  int sigio_on;
  FILE *trace;               /* GPUPOOL_TRACE: a line per request, as the client library writes */
  uv_timer_t fence_timer;    /* polls the events of held-back replies while there are any */
  uv_timer_t log_timer;      /* reports what the log rate limits left out, when no line follows */
  uint64_t nfenced;          /* replies held back, all connections */
  /* Waiting gets publishes tried, and answered: equal when a publish touches only the
   * waiters it serves (Stats waiting_gets_tried/answered). */
  uint64_t gets_tried, gets_answered;
  uint64_t opens_waited, opens_waiting; /* Opens parked for a share on its way (open_wait.c) */
  uint64_t waiter_order;     /* arrivals of waiting requests, numbered */
  /* The fair loop: uids with frames waiting, and the handles that run turn() after each poll
   * (check) and keep the poll from blocking while any is left (idle). */
  gpupool__hmap shares;      /* tenant -> share */
  share *ready;
  share *serving;            /* the share turn() is charging: freed by turn(), not gpd_conn_close */
  uv_check_t turn_check;
  uv_idle_t turn_idle;
  int turn_on;
  struct gpd_peers *peers;   /* other gpupoolds (peers.c), or NULL when none is configured */
  char restart_pending[512]; /* what a reload left for a restart (Stats restart_pending) */
};

/* ---- conn.c: sending, closing, the fair loop */
void gpd_conn_close_fd(void *arg, int fd);
void gpd_conn_send(gpd_conn *c, uint8_t *buf, size_t len, const int *fds, int nfds);
int gpd_pack_reply(gpd_conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, uint8_t **buf, size_t *len);
void gpd_send_reply(gpd_conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds);
/* Sends the reply whose oneof body is `field` (case GPUPOOL__WIRE__REPLY__BODY_<CASE>) and carries
 * no fd: how most handlers end, once they have filled their reply message. */
#define GPUPOOL__SEND_BODY(c, seq, CASE, field, body)                                                      \
  do {                                                                                                      \
    Gpupool__Wire__Reply rep_ = GPUPOOL__WIRE__REPLY__INIT;                                                 \
    rep_.body_case = GPUPOOL__WIRE__REPLY__BODY_##CASE;                                                    \
    rep_.field = (body);                                                                                    \
    gpd_send_reply((c), (seq), &rep_, NULL, 0);                                                        \
  } while (0)
void gpd_send_error(gpd_conn *c, uint64_t seq, int code, const char *msg);
/* conn.c: close c (its waiters, replies held back and holds go); its poll callback */
void gpd_conn_close(gpd_conn *c, const char *why);
void gpd_conn_io(uv_poll_t *p, int status, int events);
/* send.c: close c from below the connection layer (through the server's close_conn) */
void gpd_conn_drop(gpd_conn *c, const char *why);
void gpd_conn_flush(gpd_conn *c);
void gpd_conn_update_poll(gpd_conn *c);
void gpd_conn_drop_after_flush(gpd_conn *c);
void gpd_conn_heap(gpd_conn *c);
share *gpd_share_get(gpd_server *s, uint64_t key);

/* ---- fences.c: replies held back until their ready events have completed */
void gpd_fenced_drop_all(gpd_conn *c);
void gpd_park_reply(gpd_conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds,
                         gpd_event *const *ev, uint32_t nev);
void gpd_send_reply_fenced(gpd_conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds,
                                gpd_hold *const *hs, uint32_t nhs);

/* ---- waiters.c: requests that wait for memory or for a publish */
void gpd_waiter_remove(gpd_waiter *w);
int gpd_waiter_add(gpd_conn *c, uint64_t seq, int kind, uint32_t timeout_ms, gpd_pool *pool,
                        uint64_t size, uint64_t align, const gpd_rname *rn, int read_only, uint64_t newer_than,
                        gpd_bundle_plan *plan);
void gpd_retry_waiters(gpd_registry *reg, gpd_pool *pool);
void gpd_wake_getters(gpd_server *s, const char *key, uint64_t version);
/* A get (the connection's newest waiter, just added) waits for copy job copy_id instead. */
int gpd_waiter_on_copy(gpd_waiter *w, uint64_t copy_id);
/* The registry's on_copy: answer or move on the gets waiting for that job. */
void gpd_copy_ended(gpd_registry *reg, uint64_t copy_id, int rc, const char *msg);
/* Answer the gets waiting for key with an error (only_nowait: only those of peers' names
 * that asked not to wait), and take them out. */
void gpd_fail_getters(gpd_server *s, const char *key, int code, const char *msg, int only_nowait);

/* Checks the waiting-request limits of c and its uid (max_waiters_per_client, _per_uid). */
int gpd_waiter_limits(gpd_conn *c);

/* ---- open_wait.c: Opens that wait for a share on its way (see there) */
/* Park c's Open (seq; its n tokens and their lengths, copied) until reserved id is shared. */
int gpd_open_park(gpd_conn *c, uint64_t seq, const uint8_t *const *toks, const size_t *lens, size_t n,
                  int read_only, uint64_t id);
/* The ids first..first+n were shared (or their share failed): try their waiting Opens again. */
void gpd_opens_shared(gpd_server *s, uint64_t first, size_t n);
/* x gave up its reserved ids from..end (disconnected, why = "disconnected", or reserved anew):
 * their waiting Opens fail, saying so. */
void gpd_opens_unreserved(gpd_server *s, const gpd_client *x, uint64_t from, uint64_t end, const char *why);
/* c goes: its waiting Opens with it (no reply). */
void gpd_opens_drop(gpd_conn *c);
/* handlers_buffers.c: open n tokens for c and send the reply: 0, an error code (nothing sent),
 * or GPD_OPEN_PENDING with *pending the reserved id to wait for (nothing sent). */
int gpd_open_now(gpd_conn *c, uint64_t seq, const uint8_t *const *toks, const size_t *lens, size_t n, int read_only,
                 uint64_t *pending);

/* ---- replies.c: replies that hand over a buffer, a bundle or a file */
void gpd_srv_reply_hold(gpd_conn *c, uint64_t seq, int kind, gpd_hold *h, const gpd_rname *rn,
                             uint64_t version);
/* An Open reply for several tokens: hs[0] as its buffer, the rest as its more (the slab fds
 * that go with them, in order). */
void gpd_srv_reply_open_many(gpd_conn *c, uint64_t seq, gpd_hold **hs, uint32_t nhs);
void gpd_srv_reply_bundle(gpd_conn *c, uint64_t seq, int kind, gpd_hold **hs, uint32_t nhs,
                               const gpd_layout *layout, const gpd_name *nm, uint64_t known_layout);
void gpd_srv_reply_file(gpd_conn *c, uint64_t seq, const gpd_file *f, const gpd_rname *rn, int kind, int fd);

/* ---- handlers_admin.c: Hello, Stats, Trim and the operators' requests */
uint64_t gpd_count_open_fds(void);
void gpd_stats_free(Gpupool__Wire__StatsReply *st);
int gpd_server_stats(void *server, Gpupool__Wire__StatsReply *st);

/* A name got a new version: wake the gets waiting for it, then the peers' (waiters.c). */
void gpd_published(gpd_conn *c, const gpd_rname *rn, uint64_t version);

/* ---- handlers_files.c: published files, their calls off the loop */
void gpd_fwait_unlink(fwait *fw);
void gpd_fwait_free(fwait *fw);
int gpd_file_get_start(gpd_conn *c, uint64_t seq, const gpd_rname *rn, int count);

/* ---- the handlers (handlers_*.c): gpd_handle_<name> for each row of GPUPOOL__REQUEST_MAP
 * (common/requests.h), so a row without its handler does not link. Each returns 0 when it sent
 * the reply or, for a GPUPOOL__REQ_MAY_WAIT row, set *deferred (a handler of another row gets
 * NULL); else the error code for dispatch to send. The row's flags were checked before. */
typedef int gpd_handler(gpd_conn *c, const Gpupool__Wire__Request *req, int *deferred);
#define GPUPOOL__HANDLER_DECL(CASE, name, Message, flags) gpd_handler gpd_handle_##name;
GPUPOOL__REQUEST_MAP(GPUPOOL__HANDLER_DECL)
#undef GPUPOOL__HANDLER_DECL

/* ---- dispatch.c: a frame in, its handler, its error reply */
void gpd_handle_frame(gpd_conn *c, const uint8_t *payload, uint32_t len);

#endif
