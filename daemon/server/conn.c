/*
 * One connection's life in gpupoold: the fair loop (which connection's frames are handled
 * next: per-uid shares of the loop, turn()), reading, handing frames to dispatch, and
 * closing (its waiters, held-back replies and file calls go with it; its holds are dropped).
 * Sending and queueing replies is send.c, below the handlers.
 *
 * A connection is freed only from its handles' close callbacks, never inside its own
 * callback.
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

#include "server_internal.h"

static void conn_unready(gpd_conn *c);
static void share_put(gpd_server *s, share *sh);

/* ---- connection lifetime -------------------------------------------------------------------- */

static void conn_handle_closed(uv_handle_t *h) {
  gpd_conn *c = h->data;
  if (--c->handles_open > 0)
    return;
  gpupool__wire_txq_clear(&c->txq);
  gpupool__wire_inbuf_free(&c->in);
  if (c->lease_peer >= 0)
    close(c->lease_peer);
  close(c->fd);
  free(c);
}

void gpd_conn_close(gpd_conn *c, const char *why) {
  gpd_server *s = c->srv;
  gpd_waiter *w, *next;
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
    gpd_waiter_remove(w);
  }
  gpd_opens_drop(c);
  while (c->fwaits) {
    fwait *fw = c->fwaits;
    gpd_file_op_forget(fw->op); /* files.c lets go of what it made */
    gpd_fwait_unlink(fw);
    gpd_fwait_free(fw);
  }
  /* Before its holds go: the events of those buffers may be handed out again after. */
  gpd_fenced_drop_all(c);
  conn_unready(c);
  c->sh->conns--;
  share_put(s, c->sh);
  c->u->conns--;
  gpd_uid_usage_put(s->reg, c->u);
  s->heap -= c->heap;
  c->heap = 0;
  {
    /* Opens waiting for shares it had not sent yet fail once its reserve is gone. */
    uint64_t from = c->cl.resv_next, end = c->cl.resv_end;
    gpd_client_drop(s->reg, &c->cl);
    gpd_opens_unreserved(s, &c->cl, from, end, "disconnected");
  }
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
    gpd_retry_waiters(s->reg, NULL);
}

/* ---- the fair loop ---------------------------------------------------------------------------
 *
 * Reading is part of the fair pass, not of the poll: a readable connection is only put on its
 * uid's ready list there, and read when its turn comes. Otherwise every readable socket would
 * be read (a recvmsg of up to a socket buffer each: hundreds of KiB of a big frame, or one read
 * for each of hundreds of connections) before the first frame of a light uid is handled.
 * turn(), a check handle that runs right after each poll, picks a connection at a time: it
 * handles one complete buffered frame if there is one, else reads once, at most READ_BUDGET
 * bytes, and handles the frame that read completed, if any. The time of both is charged to
 * the uid. A connection stays ready while it has a complete frame buffered or its last read
 * filled the budget (more may wait in its socket); else it leaves the list and waits for its
 * next readable event (polling is level-triggered: bytes still in its socket bring it back).
 * turn() goes back to polling as soon as anything else waits in the loop (looked at every
 * CHECK_NS, with a poll(2) of the loop's own epoll fd) or after TURN_NS at most, so a request
 * that arrives meanwhile waits for about one pick, not for what others pipelined. An idle
 * handle keeps that poll from blocking while connections are ready. A connection still ready
 * at the end of a pass has its readable events unsubscribed until it is not (its socket would
 * otherwise read as new work at every look, and the loop spin).
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
#define READ_BUDGET (64u << 10) /* bytes read from one connection per pick */
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

share *gpd_share_get(gpd_server *s, uint64_t key) {
  share *sh = gpupool__hmap_get(&s->shares, key);
  if (sh)
    return sh;
  if (!(sh = calloc(1, sizeof *sh)))
    return NULL;
  sh->key = key;
  sh->stamp_ns = gpd_now_ns();
  if (gpupool__hmap_put(&s->shares, key, sh) != 0) {
    free(sh);
    return NULL;
  }
  return sh;
}

/* Frees sh once no connection refers to it (its load goes with it: a uid comes back fresh). */
static void share_put(gpd_server *s, share *sh) {
  if (sh->conns || sh == s->serving)
    return;
  gpupool__hmap_del(&s->shares, sh->key);
  free(sh);
}

static void turn(uv_check_t *h);
static void turn_idle(uv_idle_t *h) { (void)h; }

/* c is readable, or has frames buffered: queue it behind its uid's other ready connections.
 * While it is queued its readable events are let by, and unsubscribed only if it is still
 * ready after a pass (two system calls: not for every request of a client that waits for its
 * replies). */
static void conn_ready(gpd_conn *c) {
  gpd_server *s = c->srv;
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

static void conn_unready(gpd_conn *c) {
  gpd_server *s = c->srv;
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
    gpd_conn_update_poll(c);
  }
}

/* After one frame of c: behind the other ready connections of its uid. */
static void conn_requeue(gpd_conn *c) {
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
static void conn_input_error(gpd_conn *c, int rc) {
  char why[GPUPOOL__ERRMSG_MAX + 32];
  if (rc == GPUPOOL_ECLOSED) {
    gpd_conn_close(c, "end of connection");
    return;
  }
  snprintf(why, sizeof why, "protocol error: %s", gpupool__errmsg());
  GPUPOOL__PEER_WARN(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " (pid %d): %s", c->cl.id, (int)c->cl.pid,
                     gpupool__errmsg());
  if (rc == GPUPOOL_EPROTO && !c->drop_after_flush) {
    /* Tell it why before hanging up (the stream cannot be resynchronised). */
    gpd_conn_drop_after_flush(c);
    gpd_send_error(c, 0, GPUPOOL_EPROTO, gpupool__errmsg());
    if (!c->txq.head && !c->closing)
      gpd_conn_close(c, why);
  } else {
    gpd_conn_close(c, why);
  }
}

/* Handle c's next buffered frame: 1 when one was handled, 0 when none is complete (or c
 * can take no more). */
static int conn_serve(gpd_conn *c) {
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
  gpd_handle_frame(c, payload, len);
  if (c->drop_after_flush && !c->txq.head && !c->closing)
    gpd_conn_close(c, "protocol violation");
  return 1;
}

/* One read of c's socket, at most READ_BUDGET bytes: how many were read; 0 when none were
 * (its socket is empty, or its tenant's file calls pile up); < 0 when c is closed or to be. */
static int conn_read(gpd_conn *c) {
  gpd_server *s = c->srv;
  int fds = 0, rc;
  if (s->fops && gpd_fileops_backlog(s->fops, c->cl.tenant) >= GPUPOOL_FILEOPS_BACKLOG_PAUSE) {
    /* Its tenant's file calls pile up (a file system that does not answer): each fd it sends
     * would be held until its close can run, so nothing more is read from it until they
     * drain (fops_drained). */
    if (!c->fops_paused) {
      c->fops_paused = 1;
      s->npaused++;
    }
    gpd_conn_update_poll(c);
    return 0;
  }
  s->last_activity_ns = gpd_now_ns();
  rc = gpupool__wire_inbuf_fill(&c->in, c->fd, READ_BUDGET, &fds);
  if (rc > 0)
    s->bytes_read += (uint64_t)rc;
  gpd_conn_heap(c);
  if (c->closing)
    return -1;
  if (fds > 0) {
    GPUPOOL__PEER_WARN(&c->cl.log_rl, c->cl.id, "client %" PRIu64 " (pid %d) sent %d unexpected fd(s); closed them",
                       c->cl.id, (int)c->cl.pid, fds);
    c->fds_pending = 1;
  }
  if (rc < 0) {
    conn_input_error(c, rc);
    return -1;
  }
  return rc;
}

/* One pick of c: its next buffered frame, or else one read and the frame it completed.
 * 1 when c stays ready (a complete frame is still buffered, or the read filled its budget and
 * more may wait in the socket); 0 when it is to wait for its next readable event. */
static int conn_pick(gpd_conn *c) {
  int n = 0;
  if (c->closing || c->drop_after_flush)
    return 0;
  if (!gpupool__wire_inbuf_complete(&c->in)) {
    if ((n = conn_read(c)) <= 0)
      return 0;
    if (!gpupool__wire_inbuf_complete(&c->in))
      return n == READ_BUDGET;
  }
  conn_serve(c);
  if (c->closing || c->drop_after_flush)
    return 0;
  return gpupool__wire_inbuf_complete(&c->in) || n == READ_BUDGET;
}

/* 1 when the loop has something waiting: a request, a connection, a socket to write to. */
static int loop_has_events(gpd_server *s) {
  struct pollfd p = {uv_backend_fd(s->loop), POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

static void turn(uv_check_t *h) {
  gpd_server *s = h->data;
  uint64_t start = gpd_now_ns(), t = start, looked = start;
  for (share *sh = s->ready; sh; sh = sh->rnext)
    share_decay(sh, start);
  while (s->ready) {
    share *sh = s->ready;
    gpd_conn *c;
    uint64_t t1;
    int more;
    for (share *o = sh->rnext; o; o = o->rnext)
      if (o->load_ns < sh->load_ns)
        sh = o;
    c = sh->rhead;
    s->serving = sh; /* a disconnect inside may drop the last connection of sh */
    more = conn_pick(c);
    s->serving = NULL;
    t1 = gpd_now_ns();
    sh->load_ns += t1 - t;
    t = t1;
    if (!sh->conns) {
      share_put(s, sh); /* c closed, and with it the last connection of its uid */
    } else if (c->ready) {
      /* Still work: behind its uid's other ready connections. Else it waits for its socket
       * to be readable again. */
      if (more)
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
    for (gpd_conn *c = sh->rhead; c; c = c->rnext)
      if (!c->ready_paused) {
        c->ready_paused = 1;
        gpd_conn_update_poll(c);
      }
  if (!s->ready && s->turn_on) {
    uv_check_stop(&s->turn_check);
    uv_idle_stop(&s->turn_idle);
    s->turn_on = 0;
  }
}

void gpd_conn_io(uv_poll_t *p, int status, int events) {
  gpd_conn *c = p->data;
  if (status < 0) {
    gpd_conn_close(c, uv_strerror(status));
    return;
  }
  if (events & UV_WRITABLE) {
    gpd_conn_flush(c);
    if (c->closing)
      return;
  }
  if (!(events & (UV_READABLE | UV_DISCONNECT)) || c->drop_after_flush || c->fops_paused || c->ready)
    return;
  /* A peer that hung up with nothing left unread is closed at once, as reading would have
   * done: its slot (max_clients, max_clients_per_uid) is free before a reconnect that comes
   * in the same poll is accepted. One peek, on hang-ups only. */
  if (events & UV_DISCONNECT) {
    char b;
    if (recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0) {
      conn_read(c);
      return;
    }
  }
  /* Not read here: turn() reads it when its uid's turn comes (see "the fair loop"). */
  conn_ready(c);
}
