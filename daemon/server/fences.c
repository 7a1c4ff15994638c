/*
 * Replies held back for clients that cannot wait on the daemon's inter-process events
 * (Request.host_fences): parked until the ready events of what they hand over have completed,
 * polled every millisecond; once one reply of a connection is held back, every later one
 * queues behind it, so replies leave in order.
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

/* ---- replies held back for clients without events (Request.host_fences) --------------------- */

static void fenced_free(gpd_conn *c, fenced *f) {
  for (int i = 0; i < f->nfds; i++)
    gpd_conn_close_fd(c, f->fds[i]);
  free(f->buf);
  free(f);
}

/* 1 when every event f waits for has completed (one whose query fails counts as completed: it
 * is logged, and waiting on it could last forever). */
static int fenced_ready(gpd_server *s, fenced *f) {
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
static void fenced_flush(gpd_conn *c) {
  gpd_server *s = c->srv;
  while (!c->closing && c->fenced_head && fenced_ready(s, c->fenced_head)) {
    fenced *f = c->fenced_head;
    c->fenced_head = f->next;
    if (!c->fenced_head)
      c->fenced_tail = &c->fenced_head;
    c->fenced_bytes -= f->len;
    s->nfenced--;
    gpd_conn_send(c, f->buf, f->len, f->fds, f->nfds); /* takes buf (even when it closes c); copies the fds */
    f->buf = NULL;
    fenced_free(c, f);
  }
}

static void fence_tick(uv_timer_t *t) {
  gpd_server *s = t->data;
  gpd_conn *c, *next;
  for (c = s->conns; c && s->nfenced; c = next) {
    next = c->next;
    if (c->fenced_head)
      fenced_flush(c);
  }
  if (!s->nfenced)
    uv_timer_stop(&s->fence_timer);
}

void gpd_fenced_drop_all(gpd_conn *c) {
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
void gpd_park_reply(gpd_conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds,
                         gpd_event *const *ev, uint32_t nev) {
  gpd_server *s = c->srv;
  fenced *f;
  if (c->closing)
    return;
  if (!(f = calloc(1, sizeof *f + nev * sizeof f->ev[0]))) {
    gpd_conn_drop(c, "out of memory holding a reply back until its buffers are ready");
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
    gpd_conn_drop(c, "out of file descriptors holding a reply back until its buffers are ready");
    return;
  }
  if (gpd_pack_reply(c, seq, rep, &f->buf, &f->len) != 0) {
    fenced_free(c, f); /* gpd_pack_reply closed the connection */
    return;
  }
  *c->fenced_tail = f;
  c->fenced_tail = &f->next;
  c->fenced_bytes += f->len;
  if (s->nfenced++ == 0)
    uv_timer_start(&s->fence_timer, fence_tick, 1, 1);
  gpd_conn_heap(c);
}

/* Send a reply that hands over holds hs: at once, unless c cannot wait on events itself and
 * the ready event of one of those buffers is still pending; then it is held back (with every
 * reply after it) until they have all completed, polled every millisecond. The get's timeout
 * does not cover that wait, as a stream waiting on the event would not time out either. */
void gpd_send_reply_fenced(gpd_conn *c, uint64_t seq, Gpupool__Wire__Reply *rep, const int *fds, int nfds,
                                gpd_hold *const *hs, uint32_t nhs) {
  gpd_server *s = c->srv;
  gpd_event *pending[GPUPOOL_WIRE_MAX_FDS], **ev = pending;
  uint32_t n = 0;
  if (c->host_fences && s->reg->be->ops->has_events) {
    if (nhs > GPUPOOL_WIRE_MAX_FDS && !(ev = malloc(nhs * sizeof *ev))) {
      gpd_conn_drop(c, "out of memory holding a reply back until its buffers are ready");
      return;
    }
    for (uint32_t i = 0; i < nhs; i++) {
      gpd_event *e = hs[i]->buf->ready;
      if (e && s->reg->be->ops->event_query(e->be) == 0)
        ev[n++] = e;
    }
  }
  if (n || c->fenced_head)
    gpd_park_reply(c, seq, rep, fds, nfds, ev, n);
  else
    gpd_send_reply(c, seq, rep, fds, nfds);
  if (ev != pending)
    free(ev);
}
