/*
 * The leases of closed connections: each connection's Hello reply carries the write end of
 * a pipe the daemon keeps the read end of; once the connection closes, its lease keeps what
 * it held or mapped from reuse until the kernel reports EOF (every process holding the other
 * end has exited or closed it). No pid is ever used for liveness.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "errors.h"
#include "list.h"
#include "log.h"
#include "registry_internal.h"
#include "state.h"

int gpd_lease_new(gpd_registry *reg, uid_t uid, gid_t gid, pid_t pid, gpd_lease **out, int *peer) {
  gpd_lease *l;
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {
    int e = errno;
    if (e == EMFILE || e == ENFILE)
      return gpupool__err(GPUPOOL_ELIMIT,
                          "gpupoold is out of file descriptors (%s): it cannot give this connection a lease, "
                          "so it could not tell when the memory it maps is free again, and refuses it instead. "
                          "Try again later; operators: raise the daemon's fd limit (LimitNOFILE= in "
                          "gpupoold.service, ulimit -n) or lower max_clients",
                          strerror(e));
    return gpupool__err(GPUPOOL_EIO, "gpupoold cannot give this connection a lease (pipe2: %s) and refuses it",
                        strerror(e));
  }
  l = calloc(1, sizeof *l);
  if (!l) {
    close(p[0]);
    close(p[1]);
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  }
  (void)fcntl(p[0], F_SETFL, O_NONBLOCK);
  /* Nothing is ever written: charge the daemon's user the fewest pipe pages. */
  (void)fcntl(p[1], F_SETPIPE_SZ, 4096);
  l->fd = p[0];
  l->refs = 1;
  l->uid = uid;
  l->tenant = gpd_tenant_of(reg->cfg, uid, gid);
  l->pid = pid;
  l->reg = reg;
  gpd_state_lease_new(reg, l);
  *out = l;
  *peer = p[1];
  return 0;
}

/* 1 when no process holds the other end any more (EOF on the pipe). Bytes a holder wrote
 * are read and dropped: only EOF counts. */
static int lease_probe(gpd_lease *l) {
  char buf[4096];
  for (int i = 0; i < 16; i++) {
    ssize_t n = read(l->fd, buf, sizeof buf);
    if (n == 0)
      return 1;
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return 0; /* EAGAIN: still held */
  }
  return 0;
}

static void lease_unwait(gpd_lease *l) {
  gpd_registry *reg = l->reg;
  gpd_uid_usage *u;
  if (!l->waiting)
    return;
  l->waiting = 0;
  GPUPOOL__LIST_UNLINK(reg->waiting, l, prev, next);
  l->prev = l->next = NULL;
  reg->nwaiting--;
  if (l->counted && (u = gpd_uid_usage_get(reg, l->tenant, 0))) {
    u->leases--;
    gpd_uid_usage_put(reg, u);
  }
  l->counted = 0;
}

static void lease_closed(uv_handle_t *h) {
  gpd_lease *l = h->data;
  if (l->fd >= 0)
    close(l->fd);
  l->fd = -1;
  l->polling = 0;
  if (l->refs == 0)
    free(l);
}

/* Close the daemon's end (through the poll handle when one watches it). */
static void lease_close_fd(gpd_lease *l) {
  gpd_state_lease_gone(l);
  if (l->polling) {
    if (!uv_is_closing((uv_handle_t *)&l->poll))
      uv_close((uv_handle_t *)&l->poll, lease_closed);
    return;
  }
  if (l->fd >= 0)
    close(l->fd);
  l->fd = -1;
}

static void lease_gone(gpd_lease *l) {
  if (l->gone)
    return;
  l->gone = 1;
  if (l->waiting)
    GPUPOOL__PEER_INFO(NULL, 0, "client %" PRIu64 " (pid %d uid %u): every process holding its lease has exited or closed it, "
                  "%.1f s after its connection closed; its memory can be reused",
                  l->client_id, (int)l->pid, (unsigned)l->uid, (double)(gpd_now_ns() - l->since_ns) / 1e9);
  lease_unwait(l);
  lease_close_fd(l);
}

void gpd_lease_unref(gpd_lease *l) {
  if (--l->refs > 0)
    return;
  lease_unwait(l);
  lease_close_fd(l);
  if (!l->polling)
    free(l);
}

void gpd_lease_discard(gpd_lease *l) {
  if (l)
    gpd_lease_unref(l);
}

static void lease_readable(uv_poll_t *p, int status, int events) {
  gpd_lease *l = p->data;
  gpd_registry *reg = l->reg;
  (void)events;
  if (status < 0) {
    /* Unknown is never "gone": the memory stays pinned rather than reused under a holder. */
    GPUPOOL__ERROR("cannot watch the lease of client %" PRIu64 " (pid %d): %s; its memory stays pinned until the "
                   "daemon restarts",
                   l->client_id, (int)l->pid, uv_strerror(status));
    uv_poll_stop(p);
    return;
  }
  if (!lease_probe(l))
    return;
  lease_gone(l);
  gpd_sweep(reg);
  if (reg->on_memory)
    reg->on_memory(reg, NULL);
}

/* The connection closed while its client held or mapped memory: wait for the lease, unless
 * it is already gone. Returns 1 when it is waiting. */
int gpd_lease_wait(gpd_registry *reg, gpd_lease *l) {
  gpd_uid_usage *u;
  int rc;
  if (l->gone)
    return 0;
  if (lease_probe(l)) {
    lease_gone(l);
    return 0;
  }
  l->since_ns = gpd_now_ns();
  if (!reg->stopped) {
    if ((rc = uv_poll_init(reg->loop, &l->poll, l->fd)) != 0) {
      GPUPOOL__ERROR("cannot watch the lease of client %" PRIu64 " (pid %d): %s; its memory stays pinned until "
                     "the daemon restarts",
                     l->client_id, (int)l->pid, uv_strerror(rc));
    } else {
      l->polling = 1;
      l->poll.data = l;
      uv_poll_start(&l->poll, UV_READABLE, lease_readable);
    }
  }
  l->waiting = 1;
  l->next = reg->waiting;
  if (reg->waiting)
    reg->waiting->prev = l;
  reg->waiting = l;
  reg->nwaiting++;
  /* Counted only where the record could be made; lease_unwait takes back only what was. */
  l->counted = (u = gpd_uid_usage_get(reg, l->tenant, 1)) != NULL;
  if (l->counted)
    u->leases++;
  return 1;
}
