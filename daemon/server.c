/*
 * gpupoold's connections: accept, peer credentials, handshake, framing, who is served next
 * (the fair loop), dispatch, replies, waiting requests and disconnects. Single-threaded on the
 * libuv loop; never blocks on a client (replies that do not fit in the socket are queued and
 * flushed when writable).
 *
 * A connection is freed only from its handles' close callbacks, never inside its own
 * callback. A client that breaks the protocol gets an error reply and is dropped; one whose
 * request is merely wrong gets an error reply and carries on.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "errors.h"
#include "fileops.h"
#include "paths.h"
#include "log.h"
#include "metrics.h"
#include "server.h"

#define WAIT_FOREVER UINT32_MAX

typedef struct gpupool__conn gpupool__conn;
typedef struct share share;

/* A PublishFile or GetFile whose system calls run off the loop (files.c): answered when they
 * are done, or forgotten if the connection goes first. */
typedef struct fwait fwait;
struct fwait {
  gpupool__conn *conn;
  uint64_t seq;
  int kind;             /* the reply body case */
  int count;            /* counted in the metrics when answered (not a waiter's: that was counted) */
  char *name;
  gpupool__file_op *op;
  uint64_t started_ns;
  fwait *prev, *next;   /* in conn->fwaits */
};

/* What a waiting request is: an allocation, a get, a bundle get, a bundle allocation, a get
 * of a file. */
enum { WAIT_ALLOC = 1, WAIT_GET = 2, WAIT_BGET = 3, WAIT_ABUNDLE = 4, WAIT_GET_FILE = 5 };

typedef struct gpupool__waiter gpupool__waiter;

/* Waiting requests: the allocations of one pool and owner (a FIFO), or the gets of one name.
 * Gets sit in a binary min-heap on (newer_than, arrival): a publish of version v serves
 * exactly those with newer_than < v, which are at the top, so it pops them in O(log n) each
 * and never looks at a get waiting for a later version (thousands of those parked on a name
 * would otherwise make every publish of it cost thousands of lookups). Appending and removing
 * are O(1) for allocations and O(log n) for gets; a pass over a queue touches only the
 * requests that could now succeed. */
typedef struct wqueue wqueue;
struct wqueue {
  gpupool__waiter *head, *tail; /* allocations, oldest first */
  char *name;           /* for a queue of gets: the name (the key it is filed under) */
  uint64_t akey;        /* for a queue of allocations: owner * 64 + pool index (its key) */
  wqueue *anext;        /* the next allocation queue of the same pool */
  gpupool__waiter **heap; /* gets */
  uint32_t n, cap;
  int waking;           /* a publish is serving it: that pass frees it once empty */
};

#define NOT_IN_HEAP UINT32_MAX

struct gpupool__waiter {
  gpupool__conn *conn;
  uint64_t seq;
  int kind;
  gpupool__pool *pool;
  uint64_t size, align;
  char *name;
  int read_only;
  uint64_t newer_than;          /* gets: wait for a version past this */
  uint64_t known_layout;   /* bundle gets: the member table the client already has */
  gpupool__bundle_plan *plan;   /* WAIT_ABUNDLE: the checked layout (owned) */
  uint64_t started_ns;
  uint64_t order;               /* arrival, for FIFO among the gets one publish serves */
  uv_timer_t timer;
  int removed;
  wqueue *q;
  uint32_t hidx;                /* gets: the position in q->heap, or NOT_IN_HEAP */
  gpupool__waiter *prev, *next;   /* in q (allocations) */
  gpupool__waiter *cprev, *cnext; /* in conn->waiters */
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
  gpupool__conn *rhead, *rtail; /* its connections with frames read and not yet handled */
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
  gpupool__event *ev[]; /* still pending when the reply was parked */
} fenced;

struct gpupool__conn {
  gpupool__client cl;
  gpupool__server *srv;
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
  gpupool__waiter *waiters;
  uint32_t nwaiters;
  fwait *fwaits;
  gpupool__uid_usage *u; /* its uid's record in the registry (connections, waiters, ...) */
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
  gpupool__conn *rprev, *rnext;
  gpupool__conn *prev, *next;
};

struct gpupool__server {
  uv_loop_t *loop;
  const gpupool__config *cfg;
  gpupool__registry *reg;
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
  gpupool__conn *conns;
  uint64_t nconns;
  /* Waiting allocations: one FIFO per pool and owner (tenant, or the group of a shared pool),
   * so one owner's request that does not fit never holds up another owner's. */
  gpupool__hmap alloc_q;               /* owner * 64 + pool index -> wqueue */
  wqueue *alloc_lists[GPUPOOL_MAX_POOLS]; /* the queues of each pool */
  gpupool__smap get_q;               /* name -> wqueue */
  size_t heap;                       /* sum of the connections' heap */
  uint64_t requests, errors;
  uint64_t started_ns;
  int stopping;
  int in_retry;
  uint64_t last_activity_ns;
  gpupool__metrics *metrics; /* counters and exporters; closed with the server */
  uv_signal_t sigio;         /* file leases breaking (files.c) */
  gpupool__fileops *fops;    /* closes and file calls off the loop (fileops.c) */
  uint32_t npaused;          /* connections with fops_paused */
  int sigio_on;
  FILE *trace;               /* GPUPOOL_TRACE: a line per request, as the client library writes */
  uv_timer_t fence_timer;    /* polls the events of held-back replies while there are any */
  uv_timer_t log_timer;      /* reports what the log rate limits left out, when no line follows */
  uint64_t nfenced;          /* replies held back, all connections */
  /* Waiting gets publishes tried, and answered: equal when a publish touches only the
   * waiters it serves (Stats waiting_gets_tried/answered). */
  uint64_t gets_tried, gets_answered;
  uint64_t waiter_order;     /* arrivals of waiting requests, numbered */
  /* The fair loop: uids with frames waiting, and the handles that run turn() after each poll
   * (check) and keep the poll from blocking while any is left (idle). */
  gpupool__hmap shares;      /* tenant -> share */
  share *ready;
  share *serving;            /* the share turn() is charging: freed by turn(), not conn_close */
  uv_check_t turn_check;
  uv_idle_t turn_idle;
  int turn_on;
};

static void conn_close(gpupool__conn *c, const char *why);
static void conn_update_poll(gpupool__conn *c);
static void conn_drop_after_flush(gpupool__conn *c);
static void conn_heap(gpupool__conn *c);
static void retry_waiters(gpupool__registry *reg, gpupool__pool *pool);
static void conn_unready(gpupool__conn *c);
static void share_put(gpupool__server *s, share *sh);

/* Every fd a client sent, and every copy of a file's fd, is closed off the loop: closing a file
 * on a stalled file system waits (FUSE sends FLUSH). Charged to the connection's tenant. */
static void conn_close_fd(void *arg, int fd) {
  gpupool__conn *c = arg;
  if (c->srv->fops)
    gpupool__fileops_close(c->srv->fops, c->cl.tenant, fd);
  else if (fd >= 0)
    close(fd);
}

uint64_t gpupool__server_clients(const gpupool__server *s) { return s->nconns; }
uint64_t gpupool__server_last_activity(const gpupool__server *s) { return s->last_activity_ns; }

static uint64_t count_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  uint64_t n = 0;
  if (!d)
    return 0;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n > 0 ? n - 1 : 0; /* not counting the directory's own fd */
}

/* ---- sending -------------------------------------------------------------------------------- */

/* Send or queue a packed frame; takes buf. fds are duplicated when queued (the originals
 * stay the caller's). A client whose queue passes MAX_TX_QUEUE is dropped, not buffered. */
static void conn_send(gpupool__conn *c, uint8_t *buf, size_t len, const int *fds, int nfds) {
  int rc;
  if (c->closing) {
    free(buf);
    return;
  }
  rc = gpupool__wire_txq_send(&c->txq, c->fd, buf, len, fds, nfds);
  if (rc < 0) {
    conn_close(c, rc == GPUPOOL_EIO || rc == GPUPOOL_ECLOSED ? "write failed" : gpupool__errmsg());
    return;
  }
  conn_heap(c);
  conn_update_poll(c);
}

static void conn_flush(gpupool__conn *c) {
  int rc = gpupool__wire_txq_flush(&c->txq, c->fd);
  conn_heap(c);
  if (rc < 0) {
    conn_close(c, "write failed");
    return;
  }
  if (rc == 1 && c->drop_after_flush) {
    conn_close(c, "protocol violation");
    return;
  }
  conn_update_poll(c);
}

static int pack_reply(gpupool__conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, uint8_t **buf, size_t *len) {
  rep->seq = seq;
  /* Piggyback slab revocations on every reply. */
  rep->n_revoke_slabs = c->cl.nrevoke;
  rep->revoke_slabs = c->cl.revoke;
  if (gpupool__wire_pack_reply(rep, buf, len) != 0) {
    conn_close(c, "cannot pack a reply");
    return -1;
  }
  c->cl.nrevoke = 0;
  return 0;
}

static void park_reply(gpupool__conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds,
                       gpupool__event *const *ev, uint32_t nev);

static void send_reply(gpupool__conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds) {
  uint8_t *buf;
  size_t len;
  /* Replies leave in order: one held back (see send_reply_fenced) may carry the export data
   * of a slab that later replies only name. */
  if (c->fenced_head) {
    park_reply(c, seq, rep, fds, nfds, NULL, 0);
    return;
  }
  if (pack_reply(c, seq, rep, &buf, &len) == 0)
    conn_send(c, buf, len, fds, nfds);
}

/* ---- replies held back for clients without events (Request.host_fences) --------------------- */

static void fenced_free(gpupool__conn *c, fenced *f) {
  for (int i = 0; i < f->nfds; i++)
    conn_close_fd(c, f->fds[i]);
  free(f->buf);
  free(f);
}

/* 1 when every event f waits for has completed (one whose query fails counts as completed: it
 * is logged, and waiting on it could last forever). */
static int fenced_ready(gpupool__server *s, fenced *f) {
  while (f->nev > 0) {
    int q = s->reg->be->ops->event_query(f->ev[f->nev - 1]->be);
    if (q == 0)
      return 0;
    if (q < 0)
      GPUPOOL__WARN("event %u query failed (%s); answering the client that waits for it", f->ev[f->nev - 1]->id,
                    gpupool__errmsg());
    f->nev--;
  }
  return 1;
}

/* Send c's held-back replies, oldest first, up to the first whose events are still pending. */
static void fenced_flush(gpupool__conn *c) {
  gpupool__server *s = c->srv;
  while (!c->closing && c->fenced_head && fenced_ready(s, c->fenced_head)) {
    fenced *f = c->fenced_head;
    c->fenced_head = f->next;
    if (!c->fenced_head)
      c->fenced_tail = &c->fenced_head;
    c->fenced_bytes -= f->len;
    s->nfenced--;
    conn_send(c, f->buf, f->len, f->fds, f->nfds); /* takes buf (even when it closes c); copies the fds */
    f->buf = NULL;
    fenced_free(c, f);
  }
}

static void fence_tick(uv_timer_t *t) {
  gpupool__server *s = t->data;
  gpupool__conn *c, *next;
  for (c = s->conns; c && s->nfenced; c = next) {
    next = c->next;
    if (c->fenced_head)
      fenced_flush(c);
  }
  if (!s->nfenced)
    uv_timer_stop(&s->fence_timer);
}

static void fenced_drop_all(gpupool__conn *c) {
  while (c->fenced_head) {
    fenced *f = c->fenced_head;
    c->fenced_head = f->next;
    c->srv->nfenced--;
    fenced_free(c, f);
  }
  c->fenced_tail = &c->fenced_head;
  c->fenced_bytes = 0;
}

/* Queue a reply behind c's held-back ones, to be sent once events ev (and those of every reply
 * before it) have completed. The reply's holds are already recorded: failing here closes the
 * connection, which gives them back. */
static void park_reply(gpupool__conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds,
                       gpupool__event *const *ev, uint32_t nev) {
  gpupool__server *s = c->srv;
  fenced *f;
  if (c->closing)
    return;
  if (!(f = calloc(1, sizeof *f + nev * sizeof f->ev[0]))) {
    conn_close(c, "out of memory holding a reply back until its buffers are ready");
    return;
  }
  for (uint32_t i = 0; i < nev; i++)
    f->ev[i] = ev[i];
  f->nev = nev;
  for (int i = 0; i < nfds; i++)
    if ((f->fds[f->nfds] = fcntl(fds[i], F_DUPFD_CLOEXEC, 3)) >= 0)
      f->nfds++;
  if (f->nfds != nfds) {
    fenced_free(c, f);
    conn_close(c, "out of file descriptors holding a reply back until its buffers are ready");
    return;
  }
  if (pack_reply(c, seq, rep, &f->buf, &f->len) != 0) {
    fenced_free(c, f); /* pack_reply closed the connection */
    return;
  }
  *c->fenced_tail = f;
  c->fenced_tail = &f->next;
  c->fenced_bytes += f->len;
  if (s->nfenced++ == 0)
    uv_timer_start(&s->fence_timer, fence_tick, 1, 1);
  conn_heap(c);
}

/* Send a reply that hands over holds hs: at once, unless c cannot wait on events itself and
 * the ready event of one of those buffers is still pending; then it is held back (with every
 * reply after it) until they have all completed, polled every millisecond. The get's timeout
 * does not cover that wait, as a stream waiting on the event would not time out either. */
static void send_reply_fenced(gpupool__conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds,
                              gpupool__hold *const *hs, uint32_t nhs) {
  gpupool__server *s = c->srv;
  gpupool__event *pending[GPUPOOL_WIRE_MAX_FDS], **ev = pending;
  uint32_t n = 0;
  if (c->host_fences && s->reg->be->ops->has_events) {
    if (nhs > GPUPOOL_WIRE_MAX_FDS && !(ev = malloc(nhs * sizeof *ev))) {
      conn_close(c, "out of memory holding a reply back until its buffers are ready");
      return;
    }
    for (uint32_t i = 0; i < nhs; i++) {
      gpupool__event *e = hs[i]->buf->ready;
      if (e && s->reg->be->ops->event_query(e->be) == 0)
        ev[n++] = e;
    }
  }
  if (n || c->fenced_head)
    park_reply(c, seq, rep, fds, nfds, ev, n);
  else
    send_reply(c, seq, rep, fds, nfds);
  if (ev != pending)
    free(ev);
}

static void send_error(gpupool__conn *c, uint64_t seq, int code, const char *msg) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  err.code = code;
  err.message = (char *)(msg && *msg ? msg : gpupool_strerror(code));
  rep.error = &err;
  c->srv->errors++;
  send_reply(c, seq, &rep, NULL, 0);
}

/* ---- waiting requests ----------------------------------------------------------------------- */

static void waiter_closed(uv_handle_t *h) {
  gpupool__waiter *w = h->data;
  gpupool__bundle_plan_free(w->plan);
  free(w->name);
  free(w);
}

/* ---- the heap of a name's waiting gets ---- */

static int get_before(const gpupool__waiter *a, const gpupool__waiter *b) {
  return a->newer_than != b->newer_than ? a->newer_than < b->newer_than : a->order < b->order;
}

static void heap_set(wqueue *q, uint32_t i, gpupool__waiter *w) {
  q->heap[i] = w;
  w->hidx = i;
}

static void heap_up(wqueue *q, uint32_t i) {
  gpupool__waiter *w = q->heap[i];
  while (i > 0 && get_before(w, q->heap[(i - 1) / 2])) {
    heap_set(q, i, q->heap[(i - 1) / 2]);
    i = (i - 1) / 2;
  }
  heap_set(q, i, w);
}

static void heap_down(wqueue *q, uint32_t i) {
  gpupool__waiter *w = q->heap[i];
  for (;;) {
    uint32_t m = 2 * i + 1;
    if (m >= q->n)
      break;
    if (m + 1 < q->n && get_before(q->heap[m + 1], q->heap[m]))
      m++;
    if (!get_before(q->heap[m], w))
      break;
    heap_set(q, i, q->heap[m]);
    i = m;
  }
  heap_set(q, i, w);
}

static int heap_push(wqueue *q, gpupool__waiter *w) {
  if (q->n == q->cap) {
    uint32_t ncap = q->cap ? q->cap * 2 : 8;
    gpupool__waiter **h = realloc(q->heap, ncap * sizeof *h);
    if (!h)
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    q->heap = h;
    q->cap = ncap;
  }
  heap_set(q, q->n++, w);
  heap_up(q, q->n - 1);
  return 0;
}

static void heap_del(wqueue *q, gpupool__waiter *w) {
  uint32_t i = w->hidx;
  gpupool__waiter *last = q->heap[--q->n];
  w->hidx = NOT_IN_HEAP;
  if (i == q->n)
    return;
  heap_set(q, i, last);
  heap_up(q, i);
  heap_down(q, last->hidx);
}

static void get_q_free(gpupool__server *s, wqueue *q) {
  gpupool__smap_del(&s->get_q, q->name);
  free(q->heap);
  free(q->name);
  free(q);
}

/* Unlinks w; its memory stays valid until the timer's close callback, so a loop over a queue
 * that triggered this (through a nested disconnect) can still step past it. */
static void waiter_remove(gpupool__waiter *w) {
  gpupool__conn *c = w->conn;
  gpupool__server *s = c->srv;
  wqueue *q = w->q;
  if (w->removed)
    return;
  w->removed = 1;
  if (q->name) {
    if (w->hidx != NOT_IN_HEAP)
      heap_del(q, w);
  } else {
    if (w->prev)
      w->prev->next = w->next;
    else
      q->head = w->next;
    if (w->next)
      w->next->prev = w->prev;
    else
      q->tail = w->prev;
  }
  if (w->cprev)
    w->cprev->cnext = w->cnext;
  else
    c->waiters = w->cnext;
  if (w->cnext)
    w->cnext->cprev = w->cprev;
  c->nwaiters--;
  c->u->waiters--;
  if (q->name && !q->n && !q->waking)
    get_q_free(s, q);
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, waiter_closed);
}

static void reply_hold(gpupool__conn *c, uint64_t seq, int kind, gpupool__hold *h, const char *name,
                       uint64_t version);
static void reply_bundle(gpupool__conn *c, uint64_t seq, int kind, gpupool__hold **hs, uint32_t nhs,
                         const gpupool__layout *layout, const gpupool__name *nm, uint64_t known_layout);
static void reply_file(gpupool__conn *c, uint64_t seq, const gpupool__file *f, const char *name, int kind, int fd);
static int file_get_start(gpupool__conn *c, uint64_t seq, const char *name, int count);
static int body_of(int kind) {
  switch (kind) {
  case WAIT_ALLOC: return GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE;
  case WAIT_GET: return GPUPOOL__WIRE__REQUEST__BODY_GET;
  case WAIT_BGET: return GPUPOOL__WIRE__REQUEST__BODY_GET_BUNDLE;
  case WAIT_GET_FILE: return GPUPOOL__WIRE__REQUEST__BODY_GET_FILE;
  default: return GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE_BUNDLE;
  }
}

/* Try a waiting allocation (single or bundle) now: 0 and the reply sent, or the error. */
static int try_alloc(gpupool__waiter *w) {
  gpupool__conn *c = w->conn;
  gpupool__registry *reg = c->srv->reg;
  int rc;
  if (w->kind == WAIT_ABUNDLE) {
    gpupool__hold **hs = NULL;
    if ((rc = gpupool__bundle_allocate(reg, &c->cl, w->plan, &hs)) == 0) {
      reply_bundle(c, w->seq, WAIT_ABUNDLE, hs, w->plan->nchunks, w->plan->layout, NULL, 0);
      free(hs);
    }
    return rc;
  }
  gpupool__hold *h = NULL;
  if ((rc = gpupool__allocate(reg, &c->cl, w->pool, w->size, w->align, &h)) == 0)
    reply_hold(c, w->seq, WAIT_ALLOC, h, NULL, 0);
  return rc;
}

/* Try a waiting get now: 0 and the reply sent, or the error (ENOENT: keep waiting). */
static int try_get(gpupool__waiter *w) {
  gpupool__conn *c = w->conn;
  gpupool__registry *reg = c->srv->reg;
  int rc;
  if (w->kind == WAIT_GET_FILE)
    return file_get_start(c, w->seq, w->name, 0); /* answered once the file was looked at */
  if (w->kind == WAIT_BGET) {
    gpupool__hold **hs = NULL;
    const gpupool__name *nm = NULL;
    if ((rc = gpupool__get_bundle(reg, &c->cl, w->name, w->read_only, w->newer_than, &hs, &nm)) == 0) {
      reply_bundle(c, w->seq, WAIT_BGET, hs, nm->nbufs, nm->layout, nm, w->known_layout);
      free(hs);
    }
    return rc;
  }
  gpupool__hold *h = NULL;
  uint64_t version = 0;
  if ((rc = gpupool__get(reg, &c->cl, w->name, w->read_only, w->newer_than, &h, &version)) == 0)
    reply_hold(c, w->seq, WAIT_GET, h, w->name, version);
  return rc;
}

static void waiter_timeout(uv_timer_t *t) {
  gpupool__waiter *w = t->data;
  gpupool__conn *c = w->conn;
  char msg[GPUPOOL__ERRMSG_MAX];
  if (w->kind == WAIT_ALLOC || w->kind == WAIT_ABUNDLE) {
    /* One last try, so the error says exactly how much is free now. */
    int rc = try_alloc(w);
    if (rc != 0) {
      snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for memory: %s",
               (gpupool__now_ns() - w->started_ns) / 1000000, gpupool__errmsg());
      send_error(c, w->seq, rc == GPUPOOL_ENOSPC ? GPUPOOL_ETIMEDOUT : rc, msg);
    }
    gpupool__metrics_request(c->srv->metrics, body_of(w->kind), rc == 0 ? 0 : GPUPOOL_ETIMEDOUT,
                             gpupool__now_ns() - w->started_ns);
  } else {
    if (w->newer_than)
      snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for a version of '%s' newer than %" PRIu64,
               (gpupool__now_ns() - w->started_ns) / 1000000, w->name, w->newer_than);
    else
      snprintf(msg, sizeof msg, "timed out after %" PRIu64 " ms waiting for a producer to publish '%s'",
               (gpupool__now_ns() - w->started_ns) / 1000000, w->name);
    send_error(c, w->seq, GPUPOOL_ETIMEDOUT, msg);
    gpupool__metrics_request(c->srv->metrics, body_of(w->kind), GPUPOOL_ETIMEDOUT, gpupool__now_ns() - w->started_ns);
  }
  waiter_remove(w);
}

/* Checks the waiting-request limits of c and its uid. */
static int waiter_limits(gpupool__conn *c) {
  const gpupool__config *cfg = c->srv->cfg;
  if (cfg->max_waiters_per_client && c->nwaiters >= cfg->max_waiters_per_client)
    return gpupool__err(GPUPOOL_ELIMIT,
                        "this client already has %u requests waiting, the limit (max_waiters_per_client) "
                        "is %u; wait for them to finish or time out", c->nwaiters, cfg->max_waiters_per_client);
  if (cfg->max_waiters_per_uid && c->u->waiters >= cfg->max_waiters_per_uid) {
    char who[80];
    gpupool__tenant_label(cfg, c->cl.tenant, who, sizeof who);
    return gpupool__err(GPUPOOL_ELIMIT, "%s already has %u requests waiting, the limit (max_waiters_per_uid) is %u",
                        who, c->u->waiters, cfg->max_waiters_per_uid);
  }
  return 0;
}

/* Queue a request to be retried. For WAIT_ABUNDLE it takes over plan (also on error). */
static int waiter_add(gpupool__conn *c, uint64_t seq, int kind, uint32_t timeout_ms, gpupool__pool *pool,
                      uint64_t size, uint64_t align, const char *name, int read_only, uint64_t newer_than,
                      gpupool__bundle_plan *plan) {
  gpupool__server *s = c->srv;
  gpupool__waiter *w;
  wqueue *q;
  int rc;
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  uint64_t owner;

  if ((rc = waiter_limits(c)) != 0) {
    gpupool__bundle_plan_free(plan);
    return rc;
  }
  /* Gets wait filed under the name's key in the caller's namespace: what a publish there wakes. */
  if (kind != WAIT_ALLOC && kind != WAIT_ABUNDLE &&
      (rc = gpupool__name_key(s->reg, &c->cl, name, key, sizeof key, &owner)) != 0)
    return rc;
  if (kind == WAIT_ALLOC || kind == WAIT_ABUNDLE) {
    int idx = (int)(pool - s->reg->pools);
    uint64_t akey;
    if ((rc = gpupool__pool_owner(s->reg, &c->cl, pool, &owner)) != 0) {
      gpupool__bundle_plan_free(plan);
      return rc;
    }
    akey = owner * 64 + (uint64_t)idx;
    if (!(q = gpupool__hmap_get(&s->alloc_q, akey))) {
      if (!(q = calloc(1, sizeof *q)) || gpupool__hmap_put(&s->alloc_q, akey, q) != 0) {
        free(q);
        gpupool__bundle_plan_free(plan);
        return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
      }
      q->akey = akey;
      q->anext = s->alloc_lists[idx];
      s->alloc_lists[idx] = q;
    }
  } else if (!(q = gpupool__smap_get(&s->get_q, key))) {
    if (!(q = calloc(1, sizeof *q)) || !(q->name = strdup(key)) || gpupool__smap_put(&s->get_q, key, q) != 0) {
      if (q)
        free(q->name);
      free(q);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    }
  }
  w = calloc(1, sizeof *w);
  if (w) {
    w->newer_than = newer_than;
    w->order = s->waiter_order++;
  }
  if (!w || (name && !(w->name = strdup(name))) || (q->name && heap_push(q, w) != 0)) {
    if (w)
      free(w->name);
    free(w);
    gpupool__bundle_plan_free(plan);
    if (q->name && !q->n && !q->waking)
      get_q_free(s, q);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  w->conn = c;
  w->seq = seq;
  w->kind = kind;
  w->pool = pool;
  w->size = size;
  w->align = align;
  w->read_only = read_only;
  w->plan = plan;
  w->started_ns = gpupool__now_ns();
  w->q = q;
  uv_timer_init(s->loop, &w->timer);
  w->timer.data = w;
  if (timeout_ms != WAIT_FOREVER)
    uv_timer_start(&w->timer, waiter_timeout, timeout_ms, 0);
  if (!q->name) {
    w->hidx = NOT_IN_HEAP;
    w->prev = q->tail;
    if (q->tail)
      q->tail->next = w;
    else
      q->head = w;
    q->tail = w;
  }
  w->cnext = c->waiters;
  if (c->waiters)
    c->waiters->cprev = w;
  c->waiters = w;
  c->nwaiters++;
  c->u->waiters++;
  return 0;
}

/* Serve waiting allocations in FIFO order per pool and owner: each owner's head is tried
 * only when the pool has room for it, and a head that still does not fit keeps that owner's
 * later requests waiting behind it (but no other owner's). Empty queues are freed here, at
 * the start of a pass, never while one runs (a nested disconnect may empty any of them). */
static void retry_pool(gpupool__server *s, int idx) {
  wqueue **pq = &s->alloc_lists[idx], *q;
  while ((q = *pq)) {
    if (q->head) {
      pq = &q->anext;
      continue;
    }
    *pq = q->anext;
    gpupool__hmap_del(&s->alloc_q, q->akey);
    free(q);
  }
  for (q = s->alloc_lists[idx]; q; q = q->anext) {
    while (q->head) {
      gpupool__waiter *w = q->head;
      int rc;
      if (w->conn->closing || gpupool__pool_free_bytes(w->pool) < w->size)
        break;
      rc = try_alloc(w);
      if (rc == GPUPOOL_ENOSPC)
        break;
      if (rc != 0)
        send_error(w->conn, w->seq, rc, gpupool__errmsg());
      gpupool__metrics_request(s->metrics, body_of(w->kind), rc, gpupool__now_ns() - w->started_ns);
      waiter_remove(w);
    }
  }
}

static void retry_waiters(gpupool__registry *reg, gpupool__pool *pool) {
  gpupool__server *s = reg->owner;
  (void)pool;
  if (!s || s->in_retry)
    return; /* the running pass picks up what a nested free returned */
  s->in_retry = 1;
  while (reg->memory_returned) {
    reg->memory_returned = 0;
    for (int i = 0; i < reg->npools; i++)
      retry_pool(s, i);
  }
  s->in_retry = 0;
}

static int by_arrival(const void *a, const void *b) {
  uint64_t x = (*(gpupool__waiter *const *)a)->order, y = (*(gpupool__waiter *const *)b)->order;
  return x < y ? -1 : x > y;
}

/* Answer one waiting get that a publish reached (already out of q's heap): 1 when it must
 * wait on after all (the name went away meanwhile), and it is back in the heap. */
static int serve_get(gpupool__server *s, wqueue *q, gpupool__waiter *w) {
  int rc;
  if (w->removed || w->conn->closing)
    return 0; /* a nested disconnect took it after it was popped */
  s->gets_tried++;
  rc = try_get(w);
  if (rc == GPUPOOL_ENOENT) {
    if ((rc = heap_push(q, w)) == 0)
      return 1;
  }
  s->gets_answered++;
  if (rc != 0)
    send_error(w->conn, w->seq, rc, gpupool__errmsg());
  gpupool__metrics_request(s->metrics, body_of(w->kind), rc, gpupool__now_ns() - w->started_ns);
  waiter_remove(w);
  return 0;
}

/* Serve the gets waiting for key (a name in one namespace) now that it is at version: those
 * waiting for an older one, and no other (they stay in the heap untouched), in the order they
 * came. */
static void wake_getters(gpupool__server *s, const char *key, uint64_t version) {
  wqueue *q = gpupool__smap_get(&s->get_q, key);
  gpupool__waiter **batch;
  uint32_t m = 0;
  if (!q || !q->n || q->heap[0]->newer_than >= version)
    return;
  /* The queue stays (even empty) while this pass holds waiters popped from it. */
  q->waking++;
  if ((batch = malloc(q->n * sizeof *batch))) {
    while (q->n && q->heap[0]->newer_than < version) {
      batch[m++] = q->heap[0];
      heap_del(q, q->heap[0]);
    }
    /* The heap pops by version first: put them back in arrival order. */
    if (m > 1)
      qsort(batch, m, sizeof *batch, by_arrival);
    for (uint32_t i = 0; i < m; i++)
      serve_get(s, q, batch[i]);
    free(batch);
  } else {
    /* Out of memory for the batch: one at a time, FIFO within each version waited for. */
    while (q->n && q->heap[0]->newer_than < version) {
      gpupool__waiter *w = q->heap[0];
      heap_del(q, w);
      if (serve_get(s, q, w))
        break;
    }
  }
  if (--q->waking == 0 && !q->n)
    get_q_free(s, q);
}

/* ---- replies carrying a buffer -------------------------------------------------------------- */

static void reply_hold(gpupool__conn *c, uint64_t seq, int kind, gpupool__hold *h, const char *name,
                       uint64_t version) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AllocateReply ar = GPUPOOL__WIRE__ALLOCATE_REPLY__INIT;
  Gpupool__Wire__GetReply gr = GPUPOOL__WIRE__GET_REPLY__INIT;
  Gpupool__Wire__OpenReply orp = GPUPOOL__WIRE__OPEN_REPLY__INIT;
  gpupool__desc_storage ds;

  gpupool__fill_desc(c->srv->reg, &c->cl, h, name, &ds);
  switch (kind) {
  case WAIT_ALLOC:
    ar.buffer = &ds.desc;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ALLOCATE;
    rep.allocate = &ar;
    break;
  case WAIT_GET:
    gr.buffer = &ds.desc;
    gr.version = version;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_GET;
    rep.get = &gr;
    break;
  default:
    orp.buffer = &ds.desc;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_OPEN;
    rep.open = &orp;
    break;
  }
  if (kind == WAIT_ALLOC)
    send_reply(c, seq, &rep, ds.fd >= 0 ? &ds.fd : NULL, ds.fd >= 0 ? 1 : 0);
  else
    send_reply_fenced(c, seq, &rep, ds.fd >= 0 ? &ds.fd : NULL, ds.fd >= 0 ? 1 : 0, &h, 1);
}

/* A bundle reply: one BufferDesc per hold (the slab fds that go with them, in that order) and
 * the member table, left out when the client said it has it (known_layout). nm: the name it
 * was got by (a single buffer without members comes as one member named ""), or NULL for an
 * allocation. */
static void reply_bundle(gpupool__conn *c, uint64_t seq, int kind, gpupool__hold **hs, uint32_t nhs,
                         const gpupool__layout *layout, const gpupool__name *nm, uint64_t known_layout) {
  const gpupool__member *members = layout ? layout->members : NULL;
  uint32_t nmembers = layout ? layout->n : 0;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AllocateBundleReply ar = GPUPOOL__WIRE__ALLOCATE_BUNDLE_REPLY__INIT;
  Gpupool__Wire__GetBundleReply gr = GPUPOOL__WIRE__GET_BUNDLE_REPLY__INIT;
  Gpupool__Wire__Bundle b = GPUPOOL__WIRE__BUNDLE__INIT;
  gpupool__member single;
  gpupool__desc_storage *ds = NULL;
  Gpupool__Wire__BufferDesc **descs = NULL;
  Gpupool__Wire__BundleMember *wm = NULL, **wmp = NULL;
  Gpupool__Wire__TensorMeta *tm = NULL;
  int fds[GPUPOOL_WIRE_MAX_FDS], nfds = 0;

  if (layout && known_layout == layout->id)
    nmembers = 0; /* the client has this table */
  else if (!members) {
    /* A buffer published on its own: one member covering it, with the name's description. */
    memset(&single, 0, sizeof single);
    single.name = (char *)"";
    single.size = hs[0]->buf->asked;
    single.meta = nm && nm->has_meta ? (gpupool_tensor_meta *)&nm->meta : NULL;
    members = &single;
    nmembers = 1;
  }
  if (!(ds = calloc(nhs, sizeof *ds)) || !(descs = calloc(nhs, sizeof *descs)) ||
      !(wm = calloc(nmembers + 1, sizeof *wm)) || !(wmp = calloc(nmembers + 1, sizeof *wmp)) ||
      !(tm = calloc(nmembers + 1, sizeof *tm))) {
    /* The holds go with the connection; the client learns why. */
    for (uint32_t i = 0; i < nhs; i++)
      gpupool__hold_discard(c->srv->reg, hs[i]);
    send_error(c, seq, GPUPOOL_ENOMEM, "out of memory in the daemon building the bundle's reply");
    goto out;
  }
  for (uint32_t i = 0; i < nhs; i++) {
    gpupool__fill_desc(c->srv->reg, &c->cl, hs[i], NULL, &ds[i]);
    descs[i] = &ds[i].desc;
    if (ds[i].fd >= 0 && nfds < GPUPOOL_WIRE_MAX_FDS)
      fds[nfds++] = ds[i].fd;
  }
  for (uint32_t i = 0; i < nmembers; i++) {
    gpupool__wire__bundle_member__init(&wm[i]);
    wm[i].name = members[i].name;
    wm[i].buffer = members[i].buffer;
    wm[i].offset = members[i].offset;
    wm[i].size = members[i].size;
    if (members[i].meta) {
      gpupool__wire_meta_to(members[i].meta, &tm[i]);
      wm[i].tensor = &tm[i];
    }
    wmp[i] = &wm[i];
  }
  b.n_buffers = nhs;
  b.buffers = descs;
  b.n_members = nmembers;
  b.members = wmp;
  b.version = nm ? nm->version : 0;
  b.layout_id = layout ? layout->id : 0;
  if (kind == WAIT_ABUNDLE) {
    ar.bundle = &b;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ALLOCATE_BUNDLE;
    rep.allocate_bundle = &ar;
  } else {
    gr.bundle = &b;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_GET_BUNDLE;
    rep.get_bundle = &gr;
  }
  if (kind == WAIT_ABUNDLE)
    send_reply(c, seq, &rep, nfds ? fds : NULL, nfds);
  else
    send_reply_fenced(c, seq, &rep, nfds ? fds : NULL, nfds, hs, nhs);
out:
  free(ds);
  free(descs);
  free(wm);
  free(wmp);
  free(tm);
}

/* A file name's description, and its fd in the same frame. kind: the reply body case. */
static void reply_file(gpupool__conn *c, uint64_t seq, const gpupool__file *f, const char *name, int kind, int fd) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__PublishFileReply pr = GPUPOOL__WIRE__PUBLISH_FILE_REPLY__INIT;
  Gpupool__Wire__GetFileReply gr = GPUPOOL__WIRE__GET_FILE_REPLY__INIT;
  Gpupool__Wire__FileInfo fi = GPUPOOL__WIRE__FILE_INFO__INIT;
  fi.name = (char *)name;
  fi.offset = f->offset;
  fi.length = f->length;
  fi.size = f->size;
  fi.dev = f->dev;
  fi.ino = f->ino;
  fi.mtime_sec = f->mtime_sec;
  fi.mtime_nsec = f->mtime_nsec;
  fi.path = f->path;
  if (kind == GPUPOOL__WIRE__REPLY__BODY_GET_FILE) {
    gr.file = &fi;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_GET_FILE;
    rep.get_file = &gr;
    send_reply(c, seq, &rep, &fd, 1);
  } else {
    pr.file = &fi;
    rep.body_case = GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE;
    rep.publish_file = &pr;
    send_reply(c, seq, &rep, NULL, 0);
  }
}

/* ---- stats ---------------------------------------------------------------------------------- */

/* Frees what server_stats allocated in *st (not st itself). */
static void stats_free(Gpupool__Wire__StatsReply *st) {
  for (size_t i = 0; i < st->n_pools; i++)
    free(st->pools[i]);
  free(st->pools);
  st->pools = NULL;
  st->n_pools = 0;
}

/* Current statistics (the Stats reply's content); free with stats_free. Also the metrics'
 * stats source (the server hands itself in when it starts them). */
static int server_stats(void *server, Gpupool__Wire__StatsReply *st) {
  gpupool__server *s = server;
  gpupool__registry *reg = s->reg;
  gpupool__wire__stats_reply__init(st);
  st->pools = calloc((size_t)reg->npools, sizeof *st->pools);
  if (!st->pools && reg->npools)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  for (int i = 0; i < reg->npools; i++) {
    st->pools[i] = malloc(sizeof *st->pools[i]);
    if (!st->pools[i]) {
      stats_free(st);
      return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
    }
    st->n_pools++;
    gpupool__fill_pool_info(reg, &reg->pools[i], st->pools[i]);
  }
  st->clients = s->nconns;
  st->buffers = reg->buffers.len;
  st->holds = reg->holds.len;
  st->names = reg->nnames;
  st->uptime_s = (gpupool__now_ns() - s->started_ns) / 1000000000ull;
  st->daemon_version = (char *)GPUPOOL_VERSION_STRING;
  st->daemon_pid = (int32_t)getpid();
  st->daemon_uid = (uint32_t)geteuid();
  st->backend = reg->be->desc->kind;
  st->requests = s->requests;
  st->errors = s->errors;
  st->open_fds = count_open_fds();
  st->pending_frees = reg->npending;
  st->waiting_leases = reg->nwaiting;
  st->waiting_gets_tried = s->gets_tried;
  st->waiting_gets_answered = s->gets_answered;
  return 0;
}

/* ---- request handlers ----------------------------------------------------------------------- */

static int is_admin(const gpupool__conn *c) { return c->cl.uid == 0 || c->cl.uid == geteuid(); }

static int admin_denied(gpupool__conn *c) {
  return gpupool__err(GPUPOOL_EPERM,
                      "this request is for operators: it needs root or the daemon's own uid (%u); "
                      "you are uid %u",
                      (unsigned)geteuid(), (unsigned)c->cl.uid);
}

static int handle_hello(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Hello *m) {
  gpupool__server *s = c->srv;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__HelloReply hr = GPUPOOL__WIRE__HELLO_REPLY__INIT;
  Gpupool__Wire__PoolInfo *pis, **pptr;

  if (c->hello_done)
    return gpupool__err(GPUPOOL_EPROTO, "second Hello on one connection");
  if (m->protocol_version != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION) {
    conn_drop_after_flush(c);
    return gpupool__err(GPUPOOL_EVERSION,
                        "client speaks protocol version %u, this gpupoold (%s) speaks %d; "
                        "use a libgpupool-client of the same major version as the daemon",
                        m->protocol_version, GPUPOOL_VERSION_STRING, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  }
  c->hello_done = 1;
  uv_timer_stop(&c->hs_timer);
  snprintf(c->cl.name, sizeof c->cl.name, "%s", m->client_name && *m->client_name ? m->client_name : "-");
  for (char *p = c->cl.name; *p; p++)
    if ((unsigned char)*p < 0x20)
      *p = '?';
  /* Every connect at debug level; at info, within the limits of what clients may log. */
  if (gpupool__log_get_level() >= GPUPOOL_LOG_DEBUG)
    GPUPOOL__DEBUG("client %" PRIu64 " connected: pid %d uid %u gid %u name '%s'", c->cl.id, (int)c->cl.pid,
                   (unsigned)c->cl.uid, (unsigned)c->cl.gid, c->cl.name);
  else
    GPUPOOL__PEER_INFO(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " connected: pid %d uid %u gid %u name '%s'",
                       c->cl.id, (int)c->cl.pid, (unsigned)c->cl.uid, (unsigned)c->cl.gid, c->cl.name);
  pis = calloc((size_t)s->reg->npools, sizeof *pis);
  pptr = calloc((size_t)s->reg->npools, sizeof *pptr);
  if (!pis || !pptr) {
    free(pis);
    free(pptr);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (int i = 0; i < s->reg->npools; i++) {
    gpupool__fill_pool_info(s->reg, &s->reg->pools[i], &pis[i]);
    pptr[i] = &pis[i];
  }
  hr.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  hr.daemon_version = (char *)GPUPOOL_VERSION_STRING;
  hr.daemon_pid = (int32_t)getpid();
  hr.daemon_uid = (uint32_t)geteuid();
  hr.host_fences = 1;
  hr.backend = s->reg->be->desc->kind;
  hr.n_pools = (size_t)s->reg->npools;
  hr.pools = pptr;
  hr.client_id = c->cl.id;
  hr.max_frame = s->cfg->max_frame;
  hr.lease = 1;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_HELLO;
  rep.hello = &hr;
  /* The lease travels with this frame; the daemon's copy of the client's end goes now (a
   * queued frame holds its own duplicate), so only the client's processes hold it. */
  send_reply(c, seq, &rep, &c->lease_peer, 1);
  close(c->lease_peer);
  c->lease_peer = -1;
  free(pis);
  free(pptr);
  return 0;
}

static int handle_attach(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__AttachPool *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AttachPoolReply ar = GPUPOOL__WIRE__ATTACH_POOL_REPLY__INIT;
  Gpupool__Wire__PoolInfo pi;
  gpupool__pool *p = gpupool__pool_find(c->srv->reg, NULL, m->pool_id);
  int fd = -1, rc;
  if (!p || m->pool_id == 0)
    return gpupool__err(GPUPOOL_ENOENT, "no pool with id %u", m->pool_id);
  /* The fd of the backend pool of the caller's tenant (or the pool's group): never one that
   * maps another tenant's memory. */
  if ((rc = gpupool__attach(c->srv->reg, &c->cl, p, &fd)) != 0)
    return rc;
  gpupool__fill_pool_info(c->srv->reg, p, &pi);
  ar.pool = &pi;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ATTACH_POOL;
  rep.attach_pool = &ar;
  send_reply(c, seq, &rep, fd >= 0 ? &fd : NULL, fd >= 0 ? 1 : 0);
  return 0;
}

/* The pool a request names (by name, or by id when the name is empty). */
static int pool_asked(gpupool__registry *reg, const char *name, uint32_t id, gpupool__pool **out) {
  if ((*out = gpupool__pool_find(reg, name, id)))
    return 0;
  if (name && *name)
    return gpupool__err(GPUPOOL_ENOENT, "no pool named '%s' (gpupoolctl status lists the pools)", name);
  return gpupool__err(GPUPOOL_ENOENT, "no pool with id %u", id);
}

static int handle_allocate(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Allocate *m, int *deferred) {
  gpupool__registry *reg = c->srv->reg;
  gpupool__pool *p;
  gpupool__hold *h = NULL;
  int rc;
  if ((rc = pool_asked(reg, m->pool_name, m->pool_id, &p)) != 0)
    return rc;
  rc = gpupool__allocate(reg, &c->cl, p, m->size, m->alignment, &h);
  if (rc == GPUPOOL_ENOSPC && m->timeout_ms > 0) {
    if ((rc = waiter_add(c, seq, WAIT_ALLOC, m->timeout_ms, p, m->size, m->alignment, NULL, 0, 0, NULL)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc != 0)
    return rc;
  reply_hold(c, seq, WAIT_ALLOC, h, NULL, 0);
  return 0;
}

static int handle_release(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Release *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__ReleaseReply rr = GPUPOOL__WIRE__RELEASE_REPLY__INIT;
  int freed = 0, rc = gpupool__release(c->srv->reg, &c->cl, m->hold_id, m->done_recorded, &freed);
  if (rc != 0)
    return rc;
  rr.freed = freed;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_RELEASE;
  rep.release = &rr;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

static int handle_share(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Share *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__ShareReply sr = GPUPOOL__WIRE__SHARE_REPLY__INIT;
  uint8_t token[GPUPOOL_TOKEN_SIZE];
  int rc = gpupool__share(c->srv->reg, &c->cl, m->hold_id, token);
  if (rc != 0)
    return rc;
  sr.token.data = token;
  sr.token.len = sizeof token;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_SHARE;
  rep.share = &sr;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

static int handle_open(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Open *m) {
  gpupool__hold *h = NULL;
  int rc = gpupool__open(c->srv->reg, &c->cl, m->token.data, m->token.len, m->read_only, &h);
  if (rc != 0)
    return rc;
  reply_hold(c, seq, 0, h, NULL, 0);
  return 0;
}

/* A name got a new version: serve the gets waiting for it first (they are the handoff's
 * critical path), before the publisher's own reply. */
static void published(gpupool__conn *c, const char *name, uint64_t version) {
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  uint64_t owner;
  if (gpupool__name_key(c->srv->reg, &c->cl, name, key, sizeof key, &owner) == 0)
    wake_getters(c->srv, key, version);
}

static int handle_publish(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Publish *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__PublishReply pr = GPUPOOL__WIRE__PUBLISH_REPLY__INIT;
  uint64_t version = 0;
  int rc = gpupool__publish(c->srv->reg, &c->cl, m->hold_id, m->name, m->tensor, 0, gpupool__wire_publish_shares(m),
                            &version);
  if (rc != 0)
    return rc;
  published(c, m->name, version);
  pr.version = version;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_PUBLISH;
  rep.publish = &pr;
  send_reply(c, seq, &rep, NULL, 0);
  GPUPOOL__DEBUG("client %" PRIu64 " published '%s' version %" PRIu64, c->cl.id, m->name, version);
  return 0;
}

static int handle_publish_bundle(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__PublishBundle *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__PublishBundleReply pr = GPUPOOL__WIRE__PUBLISH_BUNDLE_REPLY__INIT;
  uint64_t version = 0;
  int rc = gpupool__publish_bundle(c->srv->reg, &c->cl, m->name, m->hold_ids, m->n_hold_ids, m->members,
                                   m->n_members, m->layout_id, &version);
  if (rc != 0)
    return rc;
  published(c, m->name, version);
  pr.version = version;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_PUBLISH_BUNDLE;
  rep.publish_bundle = &pr;
  send_reply(c, seq, &rep, NULL, 0);
  GPUPOOL__DEBUG("client %" PRIu64 " published bundle '%s' (%zu members) version %" PRIu64, c->cl.id, m->name,
                 m->n_members, version);
  return 0;
}

static int handle_allocate_bundle(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__AllocateBundle *m,
                                  int *deferred) {
  gpupool__registry *reg = c->srv->reg;
  gpupool__pool *p;
  gpupool__bundle_plan *plan = NULL;
  gpupool__hold **hs = NULL;
  int rc;
  if ((rc = pool_asked(reg, m->pool_name, m->pool_id, &p)) != 0)
    return rc;
  if ((rc = gpupool__bundle_plan_new(reg, &c->cl, p, m->members, m->n_members, m->alignment, &plan)) != 0)
    return rc;
  if (plan->nchunks > GPUPOOL_WIRE_MAX_FDS) {
    rc = gpupool__err(GPUPOOL_ETOOBIG, "bundle of %" PRIu64 " bytes needs %u buffers, more than the %d one "
                      "request may hold; split it into several bundles", plan->total, plan->nchunks,
                      GPUPOOL_WIRE_MAX_FDS);
    gpupool__bundle_plan_free(plan);
    return rc;
  }
  rc = gpupool__bundle_allocate(reg, &c->cl, plan, &hs);
  if (rc == GPUPOOL_ENOSPC && m->timeout_ms > 0) {
    if ((rc = waiter_add(c, seq, WAIT_ABUNDLE, m->timeout_ms, p, plan->total, plan->align, NULL, 0, 0, plan)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc == 0) {
    reply_bundle(c, seq, WAIT_ABUNDLE, hs, plan->nchunks, plan->layout, NULL, 0);
    free(hs);
  }
  gpupool__bundle_plan_free(plan);
  return rc;
}

static int handle_get_bundle(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__GetBundle *m, int *deferred) {
  gpupool__hold **hs = NULL;
  const gpupool__name *nm = NULL;
  int rc = gpupool__get_bundle(c->srv->reg, &c->cl, m->name, m->read_only, m->newer_than, &hs, &nm);
  if (rc == GPUPOOL_ENOENT && m->timeout_ms > 0) {
    if ((rc = waiter_add(c, seq, WAIT_BGET, m->timeout_ms, NULL, 0, 0, m->name, m->read_only, m->newer_than,
                         NULL)) != 0)
      return rc;
    c->waiters->known_layout = m->known_layout; /* waiter_add put it first */
    *deferred = 1;
    return 0;
  }
  if (rc != 0)
    return rc;
  reply_bundle(c, seq, WAIT_BGET, hs, nm->nbufs, nm->layout, nm, m->known_layout);
  free(hs);
  return 0;
}

static int handle_get(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Get *m, int *deferred) {
  gpupool__hold *h = NULL;
  uint64_t version = 0;
  int rc = gpupool__get(c->srv->reg, &c->cl, m->name, m->read_only, m->newer_than, &h, &version);
  if (rc == GPUPOOL_ENOENT && m->timeout_ms > 0) {
    if ((rc = waiter_add(c, seq, WAIT_GET, m->timeout_ms, NULL, 0, 0, m->name, m->read_only, m->newer_than,
                         NULL)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc != 0)
    return rc;
  reply_hold(c, seq, WAIT_GET, h, m->name, version);
  return 0;
}

static int handle_unpublish(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__Unpublish *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__UnpublishReply ur = GPUPOOL__WIRE__UNPUBLISH_REPLY__INIT;
  int rc = gpupool__unpublish(c->srv->reg, &c->cl, m->name);
  if (rc != 0)
    return rc;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_UNPUBLISH;
  rep.unpublish = &ur;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

static void fwait_unlink(fwait *fw) {
  gpupool__conn *c = fw->conn;
  if (fw->prev)
    fw->prev->next = fw->next;
  else
    c->fwaits = fw->next;
  if (fw->next)
    fw->next->prev = fw->prev;
}

static fwait *fwait_new(gpupool__conn *c, uint64_t seq, int kind, const char *name, int count) {
  fwait *fw = calloc(1, sizeof *fw);
  if (!fw || !(fw->name = strdup(name))) {
    free(fw);
    gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
    return NULL;
  }
  fw->conn = c;
  fw->seq = seq;
  fw->kind = kind;
  fw->count = count;
  fw->started_ns = gpupool__now_ns();
  fw->next = c->fwaits;
  if (c->fwaits)
    c->fwaits->prev = fw;
  c->fwaits = fw;
  return fw;
}

static void fwait_free(fwait *fw) {
  free(fw->name);
  free(fw);
}

/* files.c is done with a PublishFile or GetFile of c's: answer it. */
static void file_done(void *arg, int rc, const gpupool__file *f, int fd) {
  fwait *fw = arg;
  gpupool__conn *c = fw->conn;
  fwait_unlink(fw);
  if (rc != 0)
    send_error(c, fw->seq, rc, gpupool__errmsg());
  else
    reply_file(c, fw->seq, f, fw->name, fw->kind, fd);
  if (rc == 0 && fw->kind == GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE && !c->closing)
    published(c, fw->name, 1); /* a file is not versioned */
  if (fw->count && c->srv->metrics)
    gpupool__metrics_request(c->srv->metrics,
                             fw->kind == GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE ? GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_FILE
                                                                               : GPUPOOL__WIRE__REQUEST__BODY_GET_FILE,
                             rc, gpupool__now_ns() - fw->started_ns);
  fwait_free(fw);
}

/* A GetFile of name for c, answered when files.c has looked at the file: 0, or the error now. */
static int file_get_start(gpupool__conn *c, uint64_t seq, const char *name, int count) {
  fwait *fw = fwait_new(c, seq, GPUPOOL__WIRE__REPLY__BODY_GET_FILE, name, count);
  int rc;
  if (!fw)
    return GPUPOOL_ENOMEM;
  if ((rc = gpupool__get_file(c->srv->reg, &c->cl, name, file_done, fw, &fw->op)) != 0) {
    fwait_unlink(fw);
    fwait_free(fw);
  }
  return rc;
}

static int handle_publish_file(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__PublishFile *m, int *deferred) {
  fwait *fw;
  int fd = c->frame_fd, rc;
  c->frame_fd = -1;
  if (fd < 0)
    return gpupool__err(GPUPOOL_EFD, "PublishFile carries no fd: the client opens the file O_RDONLY and sends the "
                        "fd with the request (gpupool_file_publish does)");
  if (!(fw = fwait_new(c, seq, GPUPOOL__WIRE__REPLY__BODY_PUBLISH_FILE, m->name, 1))) {
    conn_close_fd(c, fd);
    return GPUPOOL_ENOMEM;
  }
  if ((rc = gpupool__publish_file(c->srv->reg, &c->cl, m->name, fd, m->offset, m->length, file_done, fw,
                                  &fw->op)) != 0) {
    fwait_unlink(fw); /* fd closed there */
    fwait_free(fw);
    return rc;
  }
  *deferred = 1;
  return 0;
}

static int handle_get_file(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__GetFile *m, int *deferred) {
  int rc = file_get_start(c, seq, m->name, 1);
  if (rc == GPUPOOL_ENOENT && m->timeout_ms > 0) {
    if ((rc = waiter_add(c, seq, WAIT_GET_FILE, m->timeout_ms, NULL, 0, 0, m->name, 1, 0, NULL)) != 0)
      return rc;
    *deferred = 1;
    return 0;
  }
  if (rc == 0)
    *deferred = 1;
  return rc;
}

static int handle_stats(gpupool__conn *c, uint64_t seq) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__StatsReply st;
  int rc = server_stats(c->srv, &st);
  if (rc != 0)
    return rc;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_STATS;
  rep.stats = &st;
  send_reply(c, seq, &rep, NULL, 0);
  stats_free(&st);
  return 0;
}

static int handle_admin_clients(gpupool__conn *c, uint64_t seq) {
  gpupool__server *s = c->srv;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AdminClientsReply ar = GPUPOOL__WIRE__ADMIN_CLIENTS_REPLY__INIT;
  Gpupool__Wire__ClientInfo *infos, **ptrs;
  uint64_t now = gpupool__now_ns();
  size_t n = 0;
  if (!is_admin(c))
    return admin_denied(c);
  infos = calloc(s->nconns + 1, sizeof *infos);
  ptrs = calloc(s->nconns + 1, sizeof *ptrs);
  if (!infos || !ptrs) {
    free(infos);
    free(ptrs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (gpupool__conn *o = s->conns; o && n < s->nconns + 1; o = o->next) {
    if (o->closing)
      continue;
    gpupool__wire__client_info__init(&infos[n]);
    infos[n].id = o->cl.id;
    infos[n].pid = o->cl.pid;
    infos[n].uid = o->cl.uid;
    infos[n].gid = o->cl.gid;
    infos[n].name = o->cl.name;
    infos[n].holds = o->cl.nholds;
    for (gpupool__hold *h = o->cl.holds; h; h = h->next)
      infos[n].bytes += h->buf->size;
    infos[n].age_s = (now - o->cl.connected_ns) / 1000000000ull;
    ptrs[n] = &infos[n];
    n++;
  }
  ar.n_clients = n;
  ar.clients = ptrs;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ADMIN_CLIENTS;
  rep.admin_clients = &ar;
  send_reply(c, seq, &rep, NULL, 0);
  free(infos);
  free(ptrs);
  return 0;
}

static int handle_admin_buffers(gpupool__conn *c, uint64_t seq) {
  gpupool__registry *reg = c->srv->reg;
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AdminBuffersReply ar = GPUPOOL__WIRE__ADMIN_BUFFERS_REPLY__INIT;
  Gpupool__Wire__BufferInfo *infos, **ptrs;
  uint64_t now = gpupool__now_ns();
  size_t n = 0;
  if (!is_admin(c))
    return admin_denied(c);
  infos = calloc(reg->buffers.len + 1, sizeof *infos);
  ptrs = calloc(reg->buffers.len + 1, sizeof *ptrs);
  if (!infos || !ptrs) {
    free(infos);
    free(ptrs);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  for (size_t i = 0; i < reg->buffers.cap; i++) {
    gpupool__buffer *b;
    if (!gpupool__hmap_slot_used(&reg->buffers, i))
      continue;
    b = reg->buffers.slots[i].val;
    gpupool__wire__buffer_info__init(&infos[n]);
    infos[n].id = b->id;
    infos[n].pool_id = b->slab->pool->id;
    infos[n].size = b->asked;
    infos[n].holders = b->refs;
    infos[n].age_s = (now - b->created_ns) / 1000000000ull;
    infos[n].owner_pid = b->owner_pid;
    infos[n].name = (char *)"";
    ptrs[n] = &infos[n];
    n++;
  }
  /* Names: one lookup pass over the name table. */
  for (size_t i = 0; i < reg->names.cap; i++) {
    gpupool__name *nm;
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    nm = reg->names.slots[i].val;
    for (size_t k = 0; k < n; k++)
      for (uint32_t j = 0; j < nm->nbufs; j++)
        if (infos[k].id == nm->bufs[j]->id && !*infos[k].name)
          infos[k].name = nm->name;
  }
  ar.n_buffers = n;
  ar.buffers = ptrs;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ADMIN_BUFFERS;
  rep.admin_buffers = &ar;
  send_reply(c, seq, &rep, NULL, 0);
  free(infos);
  free(ptrs);
  return 0;
}

static int handle_admin_drop(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__AdminDropClient *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AdminDropClientReply ar = GPUPOOL__WIRE__ADMIN_DROP_CLIENT_REPLY__INIT;
  gpupool__conn *o, *next;
  if (!is_admin(c))
    return admin_denied(c);
  if (m->pid <= 0)
    return gpupool__err(GPUPOOL_EINVAL, "pid %d is not a valid process id", m->pid);
  for (o = c->srv->conns; o; o = next) {
    next = o->next;
    if (o != c && !o->closing && o->cl.pid == m->pid) {
      GPUPOOL__INFO("operator (uid %u) dropped client %" PRIu64 " (pid %d)", (unsigned)c->cl.uid, o->cl.id, m->pid);
      conn_close(o, "dropped by an operator");
      ar.dropped++;
    }
  }
  if (ar.dropped == 0)
    return gpupool__err(GPUPOOL_ENOENT, "no connected client has pid %d", m->pid);
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ADMIN_DROP_CLIENT;
  rep.admin_drop_client = &ar;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

/* Every tenant's names, files included: what an operator needs to find and remove names that
 * outlived their publisher. */
static int handle_admin_names(gpupool__conn *c, uint64_t seq) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AdminNamesReply ar = GPUPOOL__WIRE__ADMIN_NAMES_REPLY__INIT;
  gpupool__registry *reg = c->srv->reg;
  Gpupool__Wire__NameInfo *infos = NULL, **ptrs = NULL;
  uint64_t now = gpupool__now_ns();
  size_t n = 0;
  if (!is_admin(c))
    return admin_denied(c);
  if (reg->names.len &&
      (!(infos = calloc(reg->names.len, sizeof *infos)) || !(ptrs = calloc(reg->names.len, sizeof *ptrs)))) {
    free(infos);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory listing %zu names", reg->names.len);
  }
  for (size_t i = 0; i < reg->names.cap && n < reg->names.len; i++) {
    gpupool__name *nm;
    Gpupool__Wire__NameInfo *ni = &infos[n];
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    nm = reg->names.slots[i].val;
    gpupool__wire__name_info__init(ni);
    ni->key = nm->name;
    ni->uid = (uint32_t)nm->uid;
    ni->version = nm->version;
    ni->age_s = (now - nm->created_ns) / 1000000000ull;
    ni->path = (char *)"";
    if (nm->file) {
      ni->kind = (char *)"file";
      ni->path = nm->file->path;
      ni->size = nm->file->length;
    } else {
      ni->kind = nm->layout ? (char *)"bundle" : (char *)"buffer";
      for (uint32_t j = 0; j < nm->nbufs; j++)
        ni->size += nm->bufs[j]->asked;
    }
    ptrs[n++] = ni;
  }
  ar.n_names = n;
  ar.names = ptrs;
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ADMIN_NAMES;
  rep.admin_names = &ar;
  send_reply(c, seq, &rep, NULL, 0);
  free(infos);
  free(ptrs);
  return 0;
}

static int handle_admin_unpublish(gpupool__conn *c, uint64_t seq, const Gpupool__Wire__AdminUnpublish *m) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AdminUnpublishReply ar = GPUPOOL__WIRE__ADMIN_UNPUBLISH_REPLY__INIT;
  int rc;
  if (!is_admin(c))
    return admin_denied(c);
  if ((rc = gpupool__unpublish_key(c->srv->reg, m->key)) != 0)
    return rc;
  GPUPOOL__INFO("operator (uid %u) unpublished '%s'", (unsigned)c->cl.uid, m->key);
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_ADMIN_UNPUBLISH;
  rep.admin_unpublish = &ar;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

static int handle_trim(gpupool__conn *c, uint64_t seq) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__TrimReply tr = GPUPOOL__WIRE__TRIM_REPLY__INIT;
  gpupool__trim(c->srv->reg, &tr.slabs_freed, &tr.slabs_revoked);
  rep.body_case = GPUPOOL__WIRE__REPLY__BODY_TRIM;
  rep.trim = &tr;
  send_reply(c, seq, &rep, NULL, 0);
  return 0;
}

/* The one dispatch point. Returns 0 when a reply was sent or deferred, else an error code
 * for the caller to send. */
static int dispatch(gpupool__conn *c, const Gpupool__Wire__Request *req, int *deferred) {
  if (!c->hello_done && req->body_case != GPUPOOL__WIRE__REQUEST__BODY_HELLO) {
    conn_drop_after_flush(c);
    return gpupool__err(GPUPOOL_EPROTO, "the first request on a connection must be Hello");
  }
  if (req->n_unmapped_slabs)
    gpupool__unmapped(c->srv->reg, &c->cl, req->unmapped_slabs, req->n_unmapped_slabs);
  switch (req->body_case) {
  case GPUPOOL__WIRE__REQUEST__BODY_HELLO:
    return handle_hello(c, req->seq, req->hello);
  case GPUPOOL__WIRE__REQUEST__BODY_ATTACH_POOL:
    return handle_attach(c, req->seq, req->attach_pool);
  case GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE:
    return handle_allocate(c, req->seq, req->allocate, deferred);
  case GPUPOOL__WIRE__REQUEST__BODY_RELEASE:
    return handle_release(c, req->seq, req->release);
  case GPUPOOL__WIRE__REQUEST__BODY_SHARE:
    return handle_share(c, req->seq, req->share);
  case GPUPOOL__WIRE__REQUEST__BODY_OPEN:
    return handle_open(c, req->seq, req->open);
  case GPUPOOL__WIRE__REQUEST__BODY_PUBLISH:
    return handle_publish(c, req->seq, req->publish);
  case GPUPOOL__WIRE__REQUEST__BODY_GET:
    return handle_get(c, req->seq, req->get, deferred);
  case GPUPOOL__WIRE__REQUEST__BODY_UNPUBLISH:
    return handle_unpublish(c, req->seq, req->unpublish);
  case GPUPOOL__WIRE__REQUEST__BODY_STATS:
    return handle_stats(c, req->seq);
  case GPUPOOL__WIRE__REQUEST__BODY_ADMIN_CLIENTS:
    return handle_admin_clients(c, req->seq);
  case GPUPOOL__WIRE__REQUEST__BODY_ADMIN_BUFFERS:
    return handle_admin_buffers(c, req->seq);
  case GPUPOOL__WIRE__REQUEST__BODY_ADMIN_DROP_CLIENT:
    return handle_admin_drop(c, req->seq, req->admin_drop_client);
  case GPUPOOL__WIRE__REQUEST__BODY_TRIM:
    return handle_trim(c, req->seq);
  case GPUPOOL__WIRE__REQUEST__BODY_ALLOCATE_BUNDLE:
    return handle_allocate_bundle(c, req->seq, req->allocate_bundle, deferred);
  case GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_BUNDLE:
    return handle_publish_bundle(c, req->seq, req->publish_bundle);
  case GPUPOOL__WIRE__REQUEST__BODY_GET_BUNDLE:
    return handle_get_bundle(c, req->seq, req->get_bundle, deferred);
  case GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_FILE:
    return handle_publish_file(c, req->seq, req->publish_file, deferred);
  case GPUPOOL__WIRE__REQUEST__BODY_GET_FILE:
    return handle_get_file(c, req->seq, req->get_file, deferred);
  case GPUPOOL__WIRE__REQUEST__BODY_ADMIN_NAMES:
    return handle_admin_names(c, req->seq);
  case GPUPOOL__WIRE__REQUEST__BODY_ADMIN_UNPUBLISH:
    return handle_admin_unpublish(c, req->seq, req->admin_unpublish);
  default:
    return gpupool__err(GPUPOOL_EPROTO,
                        "unknown request type (field %d); this daemon (%s) may be older than the client",
                        (int)req->body_case, GPUPOOL_VERSION_STRING);
  }
}

static void handle_frame(gpupool__conn *c, const uint8_t *payload, uint32_t len) {
  gpupool__server *s = c->srv;
  Gpupool__Wire__Request *req;
  gpupool__wire_verdict verdict;
  uint64_t t0 = gpupool__now_ns();
  int rc, deferred = 0, body = 0;

  s->requests++;
  if (c->fds_pending) {
    /* Clients never send fds: they were closed on arrival; refuse the frame they came with. */
    c->fds_pending = 0;
    send_error(c, 0, GPUPOOL_EFD, "the daemon accepts no file descriptors from clients; they were closed");
    return;
  }
  c->frame_fd = -1;
  if (gpupool__wire_inbuf_frame_nfds(&c->in) > 0) {
    /* Only PublishFile carries an fd, and only one. */
    int nfds = gpupool__wire_inbuf_frame_nfds(&c->in);
    c->frame_fd = gpupool__wire_inbuf_take_fd(&c->in);
    if (nfds > 1) {
      conn_close_fd(c, c->frame_fd);
      c->frame_fd = -1;
      send_error(c, 0, GPUPOOL_EFD, "a request carries at most one of the client's file descriptors (PublishFile's file); these were "
                 "closed");
      return;
    }
  }
  /* A linear, allocation-free pass first: protobuf-c would allocate for every unknown field
   * and cut strings at a NUL. A frame it refuses without being malformed is answered and the
   * connection kept; a malformed one goes the way of any undecodable frame below. */
  if ((rc = gpupool__wire_validate(&gpupool__wire__request__descriptor, payload, len, &verdict)) != 0 &&
      !verdict.malformed) {
    if (c->frame_fd >= 0)
      close(c->frame_fd);
    c->frame_fd = -1;
    GPUPOOL__DEBUG("client %" PRIu64 ": frame refused before decoding: %s", c->cl.id, gpupool__errmsg());
    send_error(c, verdict.seq, rc, gpupool__errmsg());
    gpupool__metrics_request(s->metrics, 0, rc, gpupool__now_ns() - t0);
    return;
  }
  req = rc == 0 ? gpupool__wire__request__unpack(NULL, len, payload) : NULL;
  if (req && c->frame_fd >= 0 && req->body_case != GPUPOOL__WIRE__REQUEST__BODY_PUBLISH_FILE) {
    conn_close_fd(c, c->frame_fd);
    c->frame_fd = -1;
    send_error(c, req->seq, GPUPOOL_EFD, "the daemon accepts file descriptors only with PublishFile; the one sent with this "
                 "request was closed");
    gpupool__wire__request__free_unpacked(req, NULL);
    return;
  }
  if (!req) {
    if (c->frame_fd >= 0)
      conn_close_fd(c, c->frame_fd);
    c->frame_fd = -1;
    GPUPOOL__PEER_WARN(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " (pid %d) sent a malformed frame; dropping it",
                       c->cl.id, (int)c->cl.pid);
    conn_drop_after_flush(c);
    send_error(c, 0, GPUPOOL_EPROTO, "malformed request frame (not a valid gpupool Request); closing the connection");
    gpupool__metrics_request(s->metrics, 0, GPUPOOL_EPROTO, gpupool__now_ns() - t0);
    return;
  }
  body = (int)req->body_case;
  c->host_fences = req->host_fences;
  gpupool__err_clear();
  rc = dispatch(c, req, &deferred);
  if (rc != 0) {
    GPUPOOL__DEBUG("client %" PRIu64 ": request %d refused: %s", c->cl.id, body, gpupool__errmsg());
    if (rc != GPUPOOL_ENOSPC && rc != GPUPOOL_ENOENT && rc != GPUPOOL_ETIMEDOUT)
      GPUPOOL__PEER_INFO(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " (pid %d): refused %s: %s", c->cl.id,
                         (int)c->cl.pid, gpupool_err_name(rc), gpupool__errmsg());
    send_error(c, req->seq, rc, gpupool__errmsg());
  }
  if (c->frame_fd >= 0) {
    conn_close_fd(c, c->frame_fd); /* refused before the handler took it */
    c->frame_fd = -1;
  }
  if (!deferred)
    gpupool__metrics_request(s->metrics, body, rc, gpupool__now_ns() - t0);
  if (s->trace)
    fprintf(s->trace, "%d %.1f daemon-req%d %.1fus %" PRIu64 "\n", (int)getpid(), (double)t0 / 1e3, body,
            (double)(gpupool__now_ns() - t0) / 1e3, req->seq);
  if (gpupool__now_ns() - t0 > 50000)
    GPUPOOL__DEBUG("slow request %d from client %" PRIu64 ": %" PRIu64 " us", body, c->cl.id, (gpupool__now_ns() - t0) / 1000);
  gpupool__wire__request__free_unpacked(req, NULL);
  if (s->reg->memory_returned)
    retry_waiters(s->reg, NULL);
}

/* ---- connection lifetime -------------------------------------------------------------------- */

static void conn_handle_closed(uv_handle_t *h) {
  gpupool__conn *c = h->data;
  if (--c->handles_open > 0)
    return;
  gpupool__wire_txq_clear(&c->txq);
  gpupool__wire_inbuf_free(&c->in);
  if (c->lease_peer >= 0)
    close(c->lease_peer);
  close(c->fd);
  free(c);
}

static void conn_close(gpupool__conn *c, const char *why) {
  gpupool__server *s = c->srv;
  gpupool__waiter *w, *next;
  if (c->closing)
    return;
  c->closing = 1;
  if (c->fops_paused)
    s->npaused--;
  if (gpupool__log_get_level() >= GPUPOOL_LOG_DEBUG)
    GPUPOOL__DEBUG("client %" PRIu64 " disconnected (pid %d uid %u '%s'): %s; had %" PRIu64 " hold(s)", c->cl.id,
                   (int)c->cl.pid, (unsigned)c->cl.uid, c->cl.name, why, c->cl.nholds);
  else
    GPUPOOL__PEER_INFO(&c->cl.log_rl, c->cl.id,
                       "client %" PRIu64 " disconnected (pid %d uid %u '%s'): %s; had %" PRIu64 " hold(s)", c->cl.id,
                       (int)c->cl.pid, (unsigned)c->cl.uid, c->cl.name, why, c->cl.nholds);
  for (w = c->waiters; w; w = next) {
    next = w->cnext;
    waiter_remove(w);
  }
  while (c->fwaits) {
    fwait *fw = c->fwaits;
    gpupool__file_op_forget(fw->op); /* files.c lets go of what it made */
    fwait_unlink(fw);
    fwait_free(fw);
  }
  /* Before its holds go: the events of those buffers may be handed out again after. */
  fenced_drop_all(c);
  conn_unready(c);
  c->sh->conns--;
  share_put(s, c->sh);
  c->u->conns--;
  gpupool__uid_usage_put(s->reg, c->u);
  s->heap -= c->heap;
  c->heap = 0;
  gpupool__client_drop(s->reg, &c->cl);
  gpupool__log_peer_flush(&c->cl.log_rl, c->cl.id, 1);
  if (c->prev)
    c->prev->next = c->next;
  else
    s->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  s->nconns--;
  uv_poll_stop(&c->poll);
  uv_close((uv_handle_t *)&c->poll, conn_handle_closed);
  uv_close((uv_handle_t *)&c->hs_timer, conn_handle_closed);
  if (s->reg->memory_returned)
    retry_waiters(s->reg, NULL);
}

static void conn_io(uv_poll_t *p, int status, int events);

/* Reads stop once a connection is to be dropped: nothing it sends after a protocol violation
 * is looked at, so it cannot make the daemon buffer more. */
static void conn_update_poll(gpupool__conn *c) {
  int want = (c->drop_after_flush || c->fops_paused || c->ready_paused ? 0 : UV_READABLE) |
             (c->txq.head ? UV_WRITABLE : 0);
  if (c->closing || want == c->poll_events)
    return;
  c->poll_events = want;
  if (want)
    uv_poll_start(&c->poll, want, conn_io);
  else
    uv_poll_stop(&c->poll);
}

static void drop_timeout(uv_timer_t *t) {
  conn_close(t->data, "it did not read its last reply within 1 s of a protocol violation");
}

/* After a protocol violation: send what is queued (the error saying why), read nothing more,
 * and hang up when the queue is out or after a second, whichever comes first. */
static void conn_drop_after_flush(gpupool__conn *c) {
  if (c->drop_after_flush || c->closing)
    return;
  c->drop_after_flush = 1;
  uv_timer_start(&c->hs_timer, drop_timeout, 1000, 0);
  conn_update_poll(c);
}

/* Recount what this connection's queue and input buffer hold on the heap, and drop it if its
 * queue passes max_queued_bytes_per_client or the daemon's total passes
 * max_queued_bytes_total (a client that never reads is dropped, not buffered for). */
static void conn_heap(gpupool__conn *c) {
  gpupool__server *s = c->srv;
  const gpupool__config *cfg = s->cfg;
  size_t h = c->txq.cost + c->in.cap + c->fenced_bytes;
  char why[320];
  s->heap = s->heap - c->heap + h;
  c->heap = h;
  if (c->closing)
    return;
  /* Replies held back until their buffers are ready (host fences) are queued output too: a
   * client that piles requests behind one that never completes is bounded like one that
   * does not read. */
  size_t queued = c->txq.cost + c->fenced_bytes;
  if (cfg->max_queued_bytes_per_client && queued > cfg->max_queued_bytes_per_client) {
    snprintf(why, sizeof why, "%s (%zu bytes queued, %zu of them held back until its buffers are ready, over "
             "max_queued_bytes_per_client %" PRIu64 ")",
             c->fenced_bytes > c->txq.cost ? "its replies pile up behind one that waits for a producer's GPU work"
                                            : "it does not read its replies",
             queued, c->fenced_bytes, cfg->max_queued_bytes_per_client);
    conn_close(c, why);
  } else if (cfg->max_queued_bytes_total && s->heap > cfg->max_queued_bytes_total && queued > 0) {
    snprintf(why, sizeof why, "the daemon's queues hold %zu bytes, over max_queued_bytes_total %" PRIu64
             ", and this client has %zu of them unsent or unread", s->heap, cfg->max_queued_bytes_total, queued);
    conn_close(c, why);
  }
}

/* ---- the fair loop ---------------------------------------------------------------------------
 *
 * A readable connection is read once (one recvmsg, at most one input buffer of frames) in the
 * poll phase, and then put on its uid's ready list instead of having every frame it brought
 * handled there and then: it is not read again until what it has buffered is handled.
 * turn(), a check handle that runs right after each poll, handles the buffered frames, one
 * frame per pick, and goes back to polling as soon as anything else waits in the loop (looked
 * at every CHECK_NS, with a poll(2) of the loop's own epoll fd) or after TURN_NS at most, so a
 * request that arrives meanwhile waits for about one frame, not for what others pipelined. An
 * idle handle keeps that poll from blocking while frames are left. A connection still ready
 * at the end of a pass has its readable events unsubscribed until it is not (the bytes left in
 * its socket would otherwise read as new work at every look).
 *
 * Which frame next: the one of the ready uid whose requests took the least loop time lately
 * (a sum decayed with a half-life of LOAD_HALF_LIFE_NS), and within that uid its connections
 * in turn. A uid sending a little (a trainer's allocate and release) therefore goes ahead of
 * one that floods, however many connections the flood comes on and however costly its
 * requests: it waits for the flood's frame already running, and no more. Two busy uids end up
 * with equal time, whatever their request mix (counting time, not requests, is what makes a
 * costly request count as such). Only uids with work are compared, so a lone uid runs at full
 * speed: nothing is ever kept idle (work-conserving). The half-life is short so that the past
 * counts for little: a uid that had the loop to itself is, once another busy uid appears,
 * behind it only until that one has caught up, a few milliseconds at most. Deficit round robin
 * (a quantum per busy uid and round) would make a light uid wait a quantum of every busy uid
 * instead. */

#define TURN_NS 1000000ull
#define CHECK_NS 10000ull
#define LOAD_HALF_LIFE_NS 4000000ull

/* 2^(-k/16) in 1/65536ths, k = 0..16: decaying by a fraction of a half-life without libm. */
static const uint32_t half_frac[17] = {65536, 62757, 60097, 57551, 55109, 52773, 50535, 48393, 46341,
                                       44376, 42495, 40693, 38968, 37316, 35734, 34219, 32768};

static void share_decay(share *sh, uint64_t now) {
  uint64_t dt, r, k, f;
  if (now <= sh->stamp_ns)
    return;
  dt = now - sh->stamp_ns;
  sh->stamp_ns = now;
  if (dt / LOAD_HALF_LIFE_NS >= 64) {
    sh->load_ns = 0;
    return;
  }
  sh->load_ns >>= dt / LOAD_HALF_LIFE_NS;
  r = (dt % LOAD_HALF_LIFE_NS) * 16; /* the rest, in 16ths of a half-life, interpolated */
  k = r / LOAD_HALF_LIFE_NS;
  f = half_frac[k] - (half_frac[k] - half_frac[k + 1]) * (r % LOAD_HALF_LIFE_NS) / LOAD_HALF_LIFE_NS;
  sh->load_ns = sh->load_ns * f >> 16;
}

/* Charge dt ns of loop time, spent now, to sh. */
static void share_charge(share *sh, uint64_t now, uint64_t dt) {
  share_decay(sh, now);
  sh->load_ns += dt;
}

static share *share_get(gpupool__server *s, uint64_t key) {
  share *sh = gpupool__hmap_get(&s->shares, key);
  if (sh)
    return sh;
  if (!(sh = calloc(1, sizeof *sh)))
    return NULL;
  sh->key = key;
  sh->stamp_ns = gpupool__now_ns();
  if (gpupool__hmap_put(&s->shares, key, sh) != 0) {
    free(sh);
    return NULL;
  }
  return sh;
}

/* Frees sh once no connection refers to it (its load goes with it: a uid comes back fresh). */
static void share_put(gpupool__server *s, share *sh) {
  if (sh->conns || sh == s->serving)
    return;
  gpupool__hmap_del(&s->shares, sh->key);
  free(sh);
}

static void turn(uv_check_t *h);
static void turn_idle(uv_idle_t *h) { (void)h; }

/* c has bytes read that may hold frames: queue it behind its uid's other ready connections.
 * It is not read again until they are handled (its input buffer never holds more); its
 * readable events are let by meanwhile, and unsubscribed only if it is still ready after a
 * pass (two system calls: not for every request of a client that waits for its replies). */
static void conn_ready(gpupool__conn *c) {
  gpupool__server *s = c->srv;
  share *sh = c->sh;
  if (c->ready || c->closing)
    return;
  c->ready = 1;
  c->rnext = NULL;
  c->rprev = sh->rtail;
  if (sh->rtail) {
    sh->rtail->rnext = c;
  } else {
    sh->rhead = c;
    sh->rprev = NULL;
    sh->rnext = s->ready;
    if (s->ready)
      s->ready->rprev = sh;
    s->ready = sh;
  }
  sh->rtail = c;
  if (!s->turn_on) {
    uv_check_start(&s->turn_check, turn);
    uv_idle_start(&s->turn_idle, turn_idle);
    s->turn_on = 1;
  }
}

static void conn_unready(gpupool__conn *c) {
  gpupool__server *s = c->srv;
  share *sh = c->sh;
  if (!c->ready)
    return;
  c->ready = 0;
  if (c->rprev)
    c->rprev->rnext = c->rnext;
  else
    sh->rhead = c->rnext;
  if (c->rnext)
    c->rnext->rprev = c->rprev;
  else
    sh->rtail = c->rprev;
  c->rprev = c->rnext = NULL;
  if (!sh->rhead) {
    if (sh->rprev)
      sh->rprev->rnext = sh->rnext;
    else
      s->ready = sh->rnext;
    if (sh->rnext)
      sh->rnext->rprev = sh->rprev;
    sh->rprev = sh->rnext = NULL;
  }
  if (c->ready_paused) {
    c->ready_paused = 0;
    conn_update_poll(c);
  }
}

/* After one frame of c: behind the other ready connections of its uid. */
static void conn_requeue(gpupool__conn *c) {
  share *sh = c->sh;
  if (sh->rtail == c)
    return;
  if (c->rprev)
    c->rprev->rnext = c->rnext;
  else
    sh->rhead = c->rnext;
  c->rnext->rprev = c->rprev;
  c->rprev = sh->rtail;
  c->rnext = NULL;
  sh->rtail->rnext = c;
  sh->rtail = c;
}

/* What ends reading a connection: end of stream, or a stream that cannot be read on. */
static void conn_input_error(gpupool__conn *c, int rc) {
  char why[GPUPOOL__ERRMSG_MAX + 32];
  if (rc == GPUPOOL_ECLOSED) {
    conn_close(c, "end of connection");
    return;
  }
  snprintf(why, sizeof why, "protocol error: %s", gpupool__errmsg());
  GPUPOOL__PEER_WARN(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " (pid %d): %s", c->cl.id, (int)c->cl.pid,
                     gpupool__errmsg());
  if (rc == GPUPOOL_EPROTO && !c->drop_after_flush) {
    /* Tell it why before hanging up (the stream cannot be resynchronised). */
    conn_drop_after_flush(c);
    send_error(c, 0, GPUPOOL_EPROTO, gpupool__errmsg());
    if (!c->txq.head && !c->closing)
      conn_close(c, why);
  } else {
    conn_close(c, why);
  }
}

/* Handle c's next buffered frame: 1 when one was handled, 0 when none is complete (or c
 * can take no more). */
static int conn_serve(gpupool__conn *c) {
  const uint8_t *payload;
  uint32_t len;
  int rc;
  if (c->closing || c->drop_after_flush)
    return 0;
  rc = gpupool__wire_inbuf_next(&c->in, &payload, &len);
  if (rc < 0) {
    conn_input_error(c, rc);
    return 0;
  }
  if (rc == 0)
    return 0;
  handle_frame(c, payload, len);
  if (c->drop_after_flush && !c->txq.head && !c->closing)
    conn_close(c, "protocol violation");
  return 1;
}

/* 1 when the loop has something waiting: a request, a connection, a socket to write to. */
static int loop_has_events(gpupool__server *s) {
  struct pollfd p = {uv_backend_fd(s->loop), POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

static void turn(uv_check_t *h) {
  gpupool__server *s = h->data;
  uint64_t start = gpupool__now_ns(), t = start, looked = start;
  for (share *sh = s->ready; sh; sh = sh->rnext)
    share_decay(sh, start);
  while (s->ready) {
    share *sh = s->ready;
    gpupool__conn *c;
    uint64_t t1;
    int served;
    for (share *o = sh->rnext; o; o = o->rnext)
      if (o->load_ns < sh->load_ns)
        sh = o;
    c = sh->rhead;
    s->serving = sh; /* a disconnect inside may drop the last connection of sh */
    served = conn_serve(c);
    s->serving = NULL;
    t1 = gpupool__now_ns();
    sh->load_ns += t1 - t;
    t = t1;
    if (!sh->conns) {
      share_put(s, sh); /* c closed, and with it the last connection of its uid */
    } else if (c->ready) {
      /* Nothing complete buffered (or no more wanted): it is read again. Else it goes
       * behind its uid's other ready connections. */
      if (served && !c->drop_after_flush)
        conn_requeue(c);
      else
        conn_unready(c);
    }
    if (t1 - start >= TURN_NS)
      break;
    if (t1 - looked >= CHECK_NS) {
      looked = t1;
      if (loop_has_events(s))
        break;
    }
  }
  for (share *sh = s->ready; sh; sh = sh->rnext)
    for (gpupool__conn *c = sh->rhead; c; c = c->rnext)
      if (!c->ready_paused) {
        c->ready_paused = 1;
        conn_update_poll(c);
      }
  if (!s->ready && s->turn_on) {
    uv_check_stop(&s->turn_check);
    uv_idle_stop(&s->turn_idle);
    s->turn_on = 0;
  }
}

static void conn_io(uv_poll_t *p, int status, int events) {
  gpupool__conn *c = p->data;
  uint64_t t0;
  int fds = 0, rc;
  if (status < 0) {
    conn_close(c, uv_strerror(status));
    return;
  }
  if (events & UV_WRITABLE) {
    conn_flush(c);
    if (c->closing)
      return;
  }
  /* A ready connection is read again only once its buffer has no complete frame left. */
  if (!(events & UV_READABLE) || c->drop_after_flush || c->ready)
    return;
  if (c->srv->fops && gpupool__fileops_backlog(c->srv->fops, c->cl.tenant) >= GPUPOOL_FILEOPS_BACKLOG_PAUSE) {
    /* Its tenant's file calls pile up (a file system that does not answer): each fd it sends
     * would be held until its close can run, so nothing more is read from it until they
     * drain (fops_drained). */
    c->fops_paused = 1;
    c->srv->npaused++;
    conn_update_poll(c);
    return;
  }
  t0 = c->srv->last_activity_ns = gpupool__now_ns();
  rc = gpupool__wire_inbuf_fill(&c->in, c->fd, &fds);
  share_charge(c->sh, gpupool__now_ns(), gpupool__now_ns() - t0);
  conn_heap(c);
  if (c->closing)
    return;
  if (fds > 0) {
    GPUPOOL__PEER_WARN(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " (pid %d) sent %d unexpected fd(s); closed them",
                       c->cl.id, (int)c->cl.pid, fds);
    c->fds_pending = 1;
  }
  if (rc > 0)
    conn_ready(c); /* turn() handles what came, right after this poll */
  else if (rc < 0)
    conn_input_error(c, rc);
}

static void hs_timeout(uv_timer_t *t) {
  gpupool__conn *c = t->data;
  char why[96];
  snprintf(why, sizeof why, "no Hello within %u ms", c->srv->cfg->handshake_timeout_ms);
  conn_close(c, why);
}

/* Refuse a connection with one error frame (best effort, nonblocking) and close it. */
static void refuse(int fd, int code, const char *msg) {
  Gpupool__Wire__Reply rep = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__Error err = GPUPOOL__WIRE__ERROR__INIT;
  uint8_t *buf;
  size_t len, off = 0;
  err.code = code;
  err.message = (char *)msg;
  rep.error = &err;
  if (gpupool__wire_pack_reply(&rep, &buf, &len) == 0) {
    gpupool__wire_send_some(fd, buf, len, &off, NULL, 0);
    free(buf);
  }
  close(fd);
}

static int id_allowed(const uint32_t *ids, int n, uint32_t id) {
  for (int i = 0; i < n; i++)
    if (ids[i] == id)
      return 1;
  return 0;
}

/* Connection limits: the total (with reserved_clients slots that only root and the daemon's
 * own uid may take, so an operator can always get in) and per uid. 0, or -1 with the reason in
 * msg. */
static int conn_limits(gpupool__server *s, const struct ucred *cred, char *msg, size_t len) {
  const gpupool__config *cfg = s->cfg;
  int admin = cred->uid == 0 || cred->uid == geteuid();
  uint64_t tenant = gpupool__tenant_of(cfg, cred->uid, cred->gid);
  const gpupool__uid_usage *u = gpupool__uid_usage_get(s->reg, tenant, 0);
  char who[80];
  uint64_t cap = cfg->max_clients;
  if (cap && !admin)
    cap = cfg->reserved_clients < cap ? cap - cfg->reserved_clients : 0;
  if (cfg->max_clients && s->nconns >= cap) {
    snprintf(msg, len, "gpupoold already serves %" PRIu64 " clients, its limit (max_clients %u, of which "
             "reserved_clients %u are kept for root and the daemon's user); try later",
             s->nconns, cfg->max_clients, cfg->reserved_clients);
    return -1;
  }
  if (!admin && cfg->max_clients_per_uid && u && u->conns >= cfg->max_clients_per_uid) {
    gpupool__tenant_label(cfg, tenant, who, sizeof who);
    snprintf(msg, len, "%s already has %u connections to gpupoold, its limit (max_clients_per_uid); "
             "close some or share one connection between threads", who, u->conns);
    return -1;
  }
  return 0;
}

#define ACCEPT_BACKOFF_MS 250
#define ACCEPT_LOG_INTERVAL_NS (10ull * 1000000000ull)
#define ACCEPT_REFUSE_BURST 64
#define ACCEPT_BATCH 32
#define LOG_FLUSH_MS 1000

static void log_tick(uv_timer_t *t);

static void on_accept(uv_poll_t *p, int status, int events);

static void accept_resume(uv_timer_t *t) {
  gpupool__server *s = t->data;
  if (s->stopping || !s->accept_paused)
    return;
  s->accept_paused = 0;
  uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
}

static void log_refused_nofd(gpupool__server *s, int err, int force) {
  uint64_t now = gpupool__now_ns();
  struct rlimit rl;
  if (!s->refused_nofd || (!force && s->refused_logged_ns && now - s->refused_logged_ns < ACCEPT_LOG_INTERVAL_NS))
    return;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
    rl.rlim_cur = 0;
  GPUPOOL__WARN("out of file descriptors (%s; %" PRIu64 " open, limit %llu): refused %" PRIu64
                " connection(s) since the last report and stop accepting for %d ms at a time; clients already "
                "connected are served. Raise LimitNOFILE= (ulimit -n) or lower max_clients",
                err ? strerror(err) : "accept", count_open_fds(), (unsigned long long)rl.rlim_cur, s->refused_nofd,
                ACCEPT_BACKOFF_MS);
  s->refused_nofd = 0;
  s->refused_logged_ns = now;
}

/* accept4 failed for lack of fds. Spinning on a listener that stays readable would take a
 * core and flood the log: refuse what is waiting (with the reason, through a reserved fd),
 * rest the listener, and count. */
static void accept_out_of_fds(gpupool__server *s, int err) {
  static const char msg[] = "gpupoold is out of file descriptors and cannot take this connection now; try again "
                            "later. Operators: raise the daemon's fd limit (LimitNOFILE= in gpupoold.service, "
                            "ulimit -n) or lower max_clients";
  if (s->reserve_fd >= 0) {
    close(s->reserve_fd);
    s->reserve_fd = -1;
    for (int i = 0; i < ACCEPT_REFUSE_BURST; i++) {
      int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0)
        break;
      refuse(fd, GPUPOOL_ELIMIT, msg);
      s->refused_nofd++;
    }
    s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  } else {
    s->refused_nofd++;
  }
  log_refused_nofd(s, err, 0);
  if (!s->accept_paused) {
    s->accept_paused = 1;
    uv_poll_stop(&s->listen_poll);
    uv_timer_start(&s->accept_timer, accept_resume, ACCEPT_BACKOFF_MS, 0);
  }
}

/* The connection of an accepted fd that passed every check, holding its lease; when there is
 * no memory for it, the fd, the lease and its peer end are closed. */
static void conn_new(gpupool__server *s, int fd, const struct ucred *cred, gpupool__lease *lease, int peer) {
  gpupool__conn *c = calloc(1, sizeof *c);
  uint64_t tenant = gpupool__tenant_of(s->cfg, cred->uid, cred->gid);

  if (!c || !(c->u = gpupool__uid_usage_get(s->reg, tenant, 1)) || !(c->sh = share_get(s, tenant))) {
    if (c && c->u)
      gpupool__uid_usage_put(s->reg, c->u);
    free(c);
    gpupool__lease_discard(lease);
    close(peer);
    close(fd);
    return;
  }
  c->sh->conns++;
  c->u->conns++;
  c->srv = s;
  c->fd = fd;
  c->lease_peer = peer;
  c->frame_fd = -1;
  c->cl.pid = cred->pid;
  c->cl.uid = cred->uid;
  c->cl.gid = cred->gid;
  c->cl.lease = lease;
  snprintf(c->cl.name, sizeof c->cl.name, "-");
  gpupool__wire_inbuf_init(&c->in, s->cfg->max_frame);
  gpupool__wire_txq_init(&c->txq);
  c->in.close_fd = c->txq.close_fd = conn_close_fd;
  c->in.close_arg = c->txq.close_arg = c;
  c->fenced_tail = &c->fenced_head;
  gpupool__client_init(s->reg, &c->cl);
  uv_poll_init(s->loop, &c->poll, fd);
  c->poll.data = c;
  uv_timer_init(s->loop, &c->hs_timer);
  c->hs_timer.data = c;
  c->handles_open = 2;
  if (s->cfg->handshake_timeout_ms)
    uv_timer_start(&c->hs_timer, hs_timeout, s->cfg->handshake_timeout_ms, 0);
  c->next = s->conns;
  if (s->conns)
    s->conns->prev = c;
  s->conns = c;
  s->nconns++;
  GPUPOOL__DEBUG("accepted pid %d uid %u gid %u as client %" PRIu64, (int)cred->pid, (unsigned)cred->uid,
           (unsigned)cred->gid, c->cl.id);
  conn_update_poll(c);
}

static void on_accept(uv_poll_t *p, int status, int events) {
  gpupool__server *s = p->data;
  (void)events;
  if (status < 0) {
    GPUPOOL__ERROR("listening socket error: %s", uv_strerror(status));
    return;
  }
  /* A bounded batch per wake-up: the poll is level-triggered and comes back for the rest, so
   * a flood that keeps the queue full cannot keep the loop from serving connected clients. */
  for (int batch = 0; batch < ACCEPT_BATCH; batch++) {
    struct ucred cred;
    socklen_t cl = sizeof cred;
    gpupool__lease *lease = NULL;
    char msg[512];
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC), peer = -1;
    if (fd < 0) {
      int e = errno;
      if (e == EINTR || e == ECONNABORTED)
        continue;
      if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        accept_out_of_fds(s, e);
        return;
      }
      if (e != EAGAIN && e != EWOULDBLOCK)
        GPUPOOL__PEER_WARN(NULL, 0, "accept failed: %s", strerror(e));
      log_refused_nofd(s, 0, 0);
      return;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
      GPUPOOL__PEER_WARN(NULL, 0, "cannot read peer credentials: %s", strerror(errno));
      close(fd);
      continue;
    }
    if ((s->cfg->n_allow_uids || s->cfg->n_allow_gids) && cred.uid != 0 && cred.uid != geteuid() &&
        !id_allowed((const uint32_t *)s->cfg->allow_uids, s->cfg->n_allow_uids, cred.uid) &&
        !id_allowed((const uint32_t *)s->cfg->allow_gids, s->cfg->n_allow_gids, cred.gid)) {
      GPUPOOL__PEER_INFO(NULL, 0, "refused connection from pid %d uid %u gid %u: not in allow_uids/allow_gids",
                         (int)cred.pid, (unsigned)cred.uid, (unsigned)cred.gid);
      snprintf(msg, sizeof msg,
               "uid %u / gid %u is not allowed by this gpupoold (allow_uids/allow_gids in its config)",
               (unsigned)cred.uid, (unsigned)cred.gid);
      refuse(fd, GPUPOOL_EPERM, msg);
      continue;
    }
    if (conn_limits(s, &cred, msg, sizeof msg) != 0) {
      GPUPOOL__PEER_WARN(NULL, 0, "refused connection from pid %d uid %u: %s", (int)cred.pid, (unsigned)cred.uid, msg);
      refuse(fd, GPUPOOL_ELIMIT, msg);
      continue;
    }
    /* Liveness comes from the lease, never from the pid: without one the connection is not
     * served at all (unknown liveness must not read as "exited"). */
    if (gpupool__lease_new(s->reg, cred.uid, cred.gid, cred.pid, &lease, &peer) != 0) {
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      s->refused_nofd++;
      log_refused_nofd(s, EMFILE, 0);
      refuse(fd, GPUPOOL_ELIMIT, msg);
      continue;
    }
    conn_new(s, fd, &cred, lease, peer);
  }
}

/* ---- listener ------------------------------------------------------------------------------- */

static int mkdir_parents(const char *path) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  char *slash;
  snprintf(dir, sizeof dir, "%s", path);
  slash = strrchr(dir, '/');
  if (!slash || slash == dir)
    return 0;
  *slash = '\0';
  for (char *p = dir + 1; *p; p++) {
    if (*p != '/')
      continue;
    *p = '\0';
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
      return gpupool__err(GPUPOOL_EIO, "cannot create directory %s: %s", dir, strerror(errno));
    *p = '/';
  }
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return gpupool__err(GPUPOOL_EIO, "cannot create directory %s: %s", dir, strerror(errno));
  return 0;
}

static int bind_socket(const gpupool__config *cfg, int *out) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd, rc;
  if (strlen(cfg->socket_path) >= sizeof addr.sun_path || !cfg->socket_path[0])
    return gpupool__err(GPUPOOL_ECONFIG, "socket path '%s' is empty or longer than %zu bytes", cfg->socket_path,
                        sizeof addr.sun_path - 1);
  strcpy(addr.sun_path, cfg->socket_path);
  if ((rc = mkdir_parents(cfg->socket_path)) != 0)
    return rc;
  if ((rc = gpupool__clear_stale_socket(cfg->socket_path, "socket")) < 0)
    return rc;
  if (rc == 1)
    GPUPOOL__INFO("removed the stale socket %s (nothing answered on it)", cfg->socket_path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return gpupool__err(GPUPOOL_EIO, "socket: %s", strerror(errno));
  if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0)
    goto bind_fail;
  if (chmod(cfg->socket_path, cfg->socket_mode) != 0)
    GPUPOOL__WARN("cannot chmod %s to %o: %s", cfg->socket_path, (unsigned)cfg->socket_mode, strerror(errno));
  /* The kernel caps the backlog at net.core.somaxconn. */
  if (listen(fd, (int)(cfg->listen_backlog ? cfg->listen_backlog : SOMAXCONN)) != 0) {
    rc = gpupool__err(GPUPOOL_EIO, "listen on %s: %s", cfg->socket_path, strerror(errno));
    close(fd);
    gpupool__unlink_socket(cfg->socket_path);
    return rc;
  }
  *out = fd;
  return 0;
bind_fail:
  rc = gpupool__err(GPUPOOL_EIO, "cannot bind %s: %s", cfg->socket_path, strerror(errno));
  close(fd);
  return rc;
}

static void on_sigio(uv_signal_t *h, int signum) {
  gpupool__server *s = h->data;
  (void)signum;
  gpupool__files_lease_check(s->reg);
}

/* A tenant's file calls drained below the pause mark: read its connections again. */
static void fops_drained(void *arg, uint64_t tenant) {
  gpupool__server *s = arg;
  if (!s->npaused)
    return;
  for (gpupool__conn *c = s->conns; c; c = c->next)
    if (c->fops_paused && c->cl.tenant == tenant) {
      c->fops_paused = 0;
      s->npaused--;
      conn_update_poll(c);
    }
}

static void stats_release(void *server, Gpupool__Wire__StatsReply *st) {
  (void)server;
  stats_free(st);
}

int gpupool__server_start(gpupool__server **out, uv_loop_t *loop, const gpupool__config *cfg, gpupool__registry *reg,
                    int listen_fd) {
  gpupool__server *s = calloc(1, sizeof *s);
  gpupool__stats_source src = {server_stats, stats_release, NULL};
  int rc;
  if (!s)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  if ((rc = gpupool__metrics_new(&s->metrics)) != 0) {
    free(s);
    return rc;
  }
  s->loop = loop;
  s->cfg = cfg;
  s->reg = reg;
  s->started_ns = gpupool__now_ns();
  if (!(s->fops = gpupool__fileops_new(loop))) {
    gpupool__metrics_close(s->metrics);
    free(s);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  }
  reg->fops = s->fops;
  s->fops->on_drain = fops_drained;
  s->fops->drain_arg = s;
  {
    /* GPUPOOL_TRACE=FILE: when each request came in (CLOCK_MONOTONIC us) and how long handling
     * it took, to line up with the clients' traces of the same handoff. */
    const char *tp = getenv("GPUPOOL_TRACE");
    if (tp && *tp && (s->trace = fopen(tp, "ae")) != NULL) {
      setvbuf(s->trace, NULL, _IOLBF, 0);
      GPUPOOL__INFO("tracing every request to %s (GPUPOOL_TRACE)", tp);
    }
  }
  gpupool__smap_init(&s->get_q);
  gpupool__hmap_init(&s->alloc_q);
  gpupool__hmap_init(&s->shares);
  reg->owner = s;
  reg->on_memory = retry_waiters;
  if (listen_fd >= 0) {
    s->listen_fd = listen_fd;
  } else {
    if ((rc = bind_socket(cfg, &s->listen_fd)) != 0) {
      reg->owner = NULL;
      reg->on_memory = NULL;
      reg->fops = NULL;
      gpupool__fileops_free(s->fops);
      gpupool__smap_free(&s->get_q);
      gpupool__hmap_free(&s->alloc_q);
      gpupool__hmap_free(&s->shares);
      gpupool__metrics_close(s->metrics);
      free(s);
      return rc;
    }
    s->own_socket = 1;
  }
  /* Kept for refusing connections with the reason when every other fd is taken. */
  s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  /* A breaking file lease is announced with SIGIO, whose default action would end the daemon:
   * leases are taken only once it is handled. */
  uv_signal_init(loop, &s->sigio);
  s->sigio.data = s;
  if (cfg->file_leases && uv_signal_start(&s->sigio, on_sigio, SIGIO) == 0) {
    s->sigio_on = 1;
    reg->lease_signal = 1;
  }
  uv_timer_init(loop, &s->accept_timer);
  s->accept_timer.data = s;
  uv_timer_init(loop, &s->fence_timer);
  s->fence_timer.data = s;
  uv_timer_init(loop, &s->log_timer);
  s->log_timer.data = s;
  uv_timer_start(&s->log_timer, log_tick, LOG_FLUSH_MS, LOG_FLUSH_MS);
  uv_unref((uv_handle_t *)&s->log_timer);
  uv_check_init(loop, &s->turn_check);
  s->turn_check.data = s;
  uv_idle_init(loop, &s->turn_idle);
  s->turn_idle.data = s;
  uv_poll_init(loop, &s->listen_poll, s->listen_fd);
  s->listen_poll.data = s;
  s->listen_open = 1;
  uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
  /* Metrics are a convenience: the daemon serves without them, counting all the same. */
  src.arg = s;
  if (gpupool__metrics_start(s->metrics, loop, cfg, &src) != 0)
    GPUPOOL__WARN("metrics disabled: %s", gpupool__errmsg());
  *out = s;
  return 0;
}

/* What the log rate limits left out is told once their interval is over, even when the
 * client that caused it says nothing more (or is gone: conn_close told its count then). */
static void log_tick(uv_timer_t *t) {
  gpupool__server *s = t->data;
  for (gpupool__conn *c = s->conns; c; c = c->next)
    gpupool__log_peer_flush(&c->cl.log_rl, c->cl.id, 0);
  gpupool__log_peer_flush(NULL, 0, 0);
}

static void listen_closed(uv_handle_t *h) {
  gpupool__server *s = h->data;
  if (h == (uv_handle_t *)&s->listen_poll)
    close(s->listen_fd);
  if (--s->listen_open > 0)
    return;
  if (s->reserve_fd >= 0)
    close(s->reserve_fd);
  /* Every connection is closed, so every waiter is gone; empty allocation queues remain. */
  gpupool__smap_free(&s->get_q);
  for (int i = 0; i < GPUPOOL_MAX_POOLS; i++)
    while (s->alloc_lists[i]) {
      wqueue *q = s->alloc_lists[i];
      s->alloc_lists[i] = q->anext;
      free(q);
    }
  gpupool__hmap_free(&s->alloc_q);
  gpupool__hmap_free(&s->shares); /* every share went with its last connection */
  free(s);
}

void gpupool__server_stop(gpupool__server *s) {
  if (s->stopping)
    return;
  s->stopping = 1;
  while (s->conns)
    conn_close(s->conns, "daemon shutting down");
  /* What is queued is cancelled, what runs finishes; closes from now on happen here. */
  s->reg->fops = NULL;
  gpupool__fileops_free(s->fops);
  s->fops = NULL;
  if (s->own_socket)
    gpupool__unlink_socket(s->cfg->socket_path);
  s->reg->on_memory = NULL;
  gpupool__metrics_close(s->metrics);
  s->metrics = NULL;
  if (s->trace)
    fclose(s->trace);
  s->trace = NULL;
  log_refused_nofd(s, 0, 1);
  uv_poll_stop(&s->listen_poll);
  s->listen_open = 7; /* the handles closed below, each ending in listen_closed */
  if (s->sigio_on) {
    /* Nothing handles SIGIO from now on: let every lease go first (a break would otherwise
     * kill the daemon, or hold a writer up for the kernel's lease-break-time). */
    gpupool__files_unlease(s->reg);
    uv_signal_stop(&s->sigio);
    signal(SIGIO, SIG_IGN);
  }
  s->sigio.data = s;
  uv_close((uv_handle_t *)&s->listen_poll, listen_closed);
  uv_close((uv_handle_t *)&s->accept_timer, listen_closed);
  uv_timer_stop(&s->fence_timer);
  uv_close((uv_handle_t *)&s->fence_timer, listen_closed);
  uv_timer_stop(&s->log_timer);
  uv_close((uv_handle_t *)&s->log_timer, listen_closed);
  gpupool__log_peer_flush(NULL, 0, 1);
  uv_close((uv_handle_t *)&s->sigio, listen_closed);
  uv_check_stop(&s->turn_check);
  uv_idle_stop(&s->turn_idle);
  s->turn_on = 0;
  uv_close((uv_handle_t *)&s->turn_check, listen_closed);
  uv_close((uv_handle_t *)&s->turn_idle, listen_closed);
}
