/*
 * libgpupool-client, connect.c: The life of a client: connecting (socket, Hello, lease),
 * reconnecting after the daemon went away (stale generations, lost names), disconnecting, the
 * connection's settings, and the daemon-wide requests (stats, trim). See internal.h for how the
 * client is put together.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <pwd.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* Connect to the daemon's socket at path (common/sock.c), a failure worded for a program
 * (in *err). */
static int connect_socket(const char *path, int timeout_ms, int *out, gpupool__error *err) {
  char what[GPUPOOL__SOCK_DESCRIBE_MAX];
  int tries, fd, e;
  if (strlen(path) >= sizeof ((struct sockaddr_un *)0)->sun_path)
    return gpupool__error_set(err, GPUPOOL_EINVAL, "socket path '%s' is longer than %zu bytes", path,
                              sizeof ((struct sockaddr_un *)0)->sun_path - 1);
  if ((fd = gpupool__sock_connect(path, timeout_ms, 1, &tries)) >= 0) {
    *out = fd;
    return 0;
  }
  e = -fd;
  if (tries == 0)
    return gpupool__error_set(err, GPUPOOL_ECONNECT, "socket: %s", strerror(e));
  if (e == ECONNREFUSED && gpupool__sock_describe(path, what, sizeof what) == 1)
    return gpupool__error_set(err, GPUPOOL_ECONNECT, "cannot connect to gpupoold: %s", what);
  if (e == ENOENT || e == ECONNREFUSED)
    return gpupool__error_set(err, GPUPOOL_ECONNECT,
                              "cannot connect to gpupoold at %s: %s; is the daemon running? Start it "
                              "(gpupoold --socket %s, or systemctl start gpupoold.socket) or set GPUPOOL_SOCKET",
                              path, strerror(e), path);
  if (e == EACCES || e == EPERM) {
    gpupool__sock_describe(path, what, sizeof what);
    return gpupool__error_set(err, GPUPOOL_ECONNECT,
                              "cannot connect to gpupoold at %s: permission denied (%s); connecting needs "
                              "write access to the socket: join its group or ask the operator",
                              path, what);
  }
  if (e == EAGAIN)
    return gpupool__error_set(err, GPUPOOL_ETIMEDOUT,
                              "the daemon did not answer in %g s: gpupoold at %s kept its queue of waiting "
                              "connections full all that time (%d tries): it is stopped, stuck or flooded with "
                              "connections (see 'systemctl status gpupoold' and its log; the queue is listen_backlog "
                              "in its config); the timeout is gpupool_client_connect() or GPUPOOL_CONNECT_TIMEOUT_MS",
                              timeout_ms / 1000.0, path, tries);
  if (e == EINPROGRESS || e == ETIMEDOUT)
    return gpupool__error_set(err, GPUPOOL_ETIMEDOUT,
                              "the daemon did not answer in %g s: gpupoold at %s accepts no connections "
                              "(stopped or stuck? see 'systemctl status gpupoold')",
                              timeout_ms / 1000.0, path);
  return gpupool__error_set(err, GPUPOOL_ECONNECT, "cannot connect to gpupoold at %s: %s", path, strerror(e));
}

/* Whether this connection orders GPU work without the daemon's inter-process events. CUDA
 * backs each such event with a file in /dev/shm that only the daemon's uid may open: a client
 * of another uid (root excepted) synchronizes its stream before Publish and Release instead,
 * and the daemon holds its gets back until the producer's work is done. GPUPOOL_HOST_FENCES
 * decides instead when set (1: always, e.g. in a container with its own /dev/shm; 0: never). */
static int host_fences_for(gpupool_client *c, const Gpupool__Wire__HelloReply *hr) {
  int want;
  /* A daemon that does not hold gets back would hand over unfinished work: then events it is
   * (failing with the reason when they cannot be opened). */
  if (!c->be->has_events || !hr->host_fences)
    return 0;
  /* The daemon's own uid (the socket's peer may be the service manager, under socket
   * activation). */
  want = c->host_fences_env >= 0 ? c->host_fences_env : geteuid() != 0 && hr->daemon_uid != geteuid();
  return want;
}

/* What a Hello reply tells this connection: the protocol, the backend, the pools (or why
 * not, in *err). */
static int take_hello(gpupool_client *c, const Gpupool__Wire__HelloReply *hr, gpupool__error *err) {
  const gpupool__backend_desc *d;
  int rc;

  if (hr->protocol_version != GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION)
    return gpupool__error_set(err, GPUPOOL_EVERSION, "gpupoold %s speaks protocol %u, this library (%s) speaks %d",
                              hr->daemon_version, hr->protocol_version, GPUPOOL_VERSION_STRING,
                              GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  c->client_id = hr->client_id;
  c->max_frame = hr->max_frame;
  c->backend_kind = hr->backend;
  if (!(d = gpupool__backend_by_kind(hr->backend)))
    return gpupool__error_set(err, GPUPOOL_EPROTO, "gpupoold %s runs backend %d, which this library (%s) does "
                              "not know; upgrade libgpupool-client", hr->daemon_version, hr->backend,
                              GPUPOOL_VERSION_STRING);
  if (!d->client)
    return gpupool__error_set(err, GPUPOOL_ENOTSUP,
                              "gpupoold serves %s but this libgpupool-client was built without it; "
                              "rebuild it with the CUDA toolkit", d->what);
  c->be = d->client;
  c->host_fences = host_fences_for(c, hr);
  c->max_release_batch = hr->max_release_batch;
  c->pools = calloc(hr->n_pools ? hr->n_pools : 1, sizeof *c->pools);
  if (!c->pools)
    return gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory");
  c->npools = 0;
  for (size_t i = 0; i < hr->n_pools; i++) {
    const Gpupool__Wire__PoolInfo *pi = hr->pools[i];
    cpool *p = &c->pools[c->npools++];
    p->id = pi->id;
    snprintf(p->name, sizeof p->name, "%s", pi->name ? pi->name : "");
    if ((rc = gpupool__wire_mem_kind(pi->location, &p->kind)) != 0)
      return gpupool__error_take(err, rc);
    p->device = pi->device;
    p->capacity = pi->capacity;
  }
  return 0;
}

/* The holds the daemon gave back (a restart that kept its state): each lost buffer of the
 * previous connection that the daemon names is this connection's again, under its new hold id.
 * Its mapping is the previous daemon's (released as a lost buffer's is, see
 * gpupool__release_local). A hold the daemon names for a buffer this process let go of while
 * the daemon was away (released locally, as lost) is released at once: nothing here would
 * ever release it, and its memory would stay in use for as long as this connection lives.
 * Then the token to send after the next restart. */
static void take_resumed(gpupool_client *c, const Gpupool__Wire__HelloReply *hr) {
  for (size_t i = 0; i < hr->n_resumed; i++) {
    const Gpupool__Wire__ResumedHold *r = hr->resumed[i];
    gpupool_buffer *b;
    for (b = c->buffers; b; b = b->next)
      if (b->lost && b->buffer_id == r->buffer_id && b->read_only == (int)r->read_only) {
        b->lost = 0;
        b->hold_id = r->hold_id;
        if (c->holds_lost)
          c->holds_lost--;
        break;
      }
    if (!b) {
      gpupool__error e;
      /* Not recorded: its mapping was dropped with the buffer (or is the stale slab's). A
       * broken connection here is seen by the next request, which reconnects again. */
      if (gpupool__send_release(c, r->hold_id, 0, &e) != 0)
        break;
    }
  }
  c->resume_len = 0;
  if (hr->resume.len && hr->resume.len <= sizeof c->resume) {
    memcpy(c->resume, hr->resume.data, hr->resume.len);
    c->resume_len = hr->resume.len;
  }
}

/* Connect to c->socket_path and say Hello; fills the pool list. With c->mu held and
 * c->fd == -1. On failure the fd is closed again, and *err says why. */
static int handshake(gpupool_client *c, gpupool__error *err) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Hello hello = GPUPOOL__WIRE__HELLO__INIT;
  gpupool__rep *rep = NULL;
  const Gpupool__Wire__HelloReply *hr;
  int rc, fd = -1, lease = -1;

  c->hs_closed = 0;
  if ((rc = connect_socket(c->socket_path, c->connect_timeout_ms, &fd, err)) != 0)
    return rc;
  c->fd = fd;
  c->broken = 0;
  c->broken_msg[0] = '\0';
  gpupool__wire_rx_reset(&c->rx);
  c->rx.refused_len = 0;
  if (c->connect_timeout_ms > 0)
    c->hs_deadline_ns = gpupool__mono_ns() + (uint64_t)c->connect_timeout_ms * 1000000u;
  hello.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  hello.client_name = c->name;
  hello.pid = (int32_t)getpid();
  /* The previous connection's token: a daemon that kept its state gives its holds back. */
  hello.resume.data = c->resume;
  hello.resume.len = c->resume_len;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  req.hello = &hello;
  rc = gpupool__call(c, &req, &rep, &lease, err);
  c->hs_deadline_ns = 0;
  if (rc != 0) {
    if (c->broken == GPUPOOL_ETIMEDOUT || c->broken == GPUPOOL_EPROTO)
      rc = gpupool__error_set(err, c->broken, "%s", c->broken_msg);
    goto fail;
  }
  {
    /* Requests after Hello wait as long as they need (gets and allocations have their own
     * timeouts, kept by the daemon). */
    struct timeval tv = {0, 0};
    (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    (void)setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  hr = rep->hello;
  if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_HELLO || !hr) {
    rc = gpupool__error_set(err, GPUPOOL_EPROTO, "the daemon answered Hello with something else");
    goto fail;
  }
  if (hr->lease && lease < 0) {
    rc = gpupool__error_set(err, GPUPOOL_EPROTO,
                            "the daemon announced a lease but sent no fd with its Hello reply");
    goto fail;
  }
  if (!hr->lease && lease >= 0) {
    close(lease); /* an fd this library did not ask for */
    lease = -1;
  }
  if ((rc = take_hello(c, hr, err)) != 0)
    goto fail;
  take_resumed(c, hr);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  c->lease_fd = lease;
  return 0;
fail:
  if (rep)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  if (lease >= 0)
    close(lease);
  close(c->fd);
  c->fd = -1;
  if (!c->broken)
    gpupool__set_broken(c, GPUPOOL_ECLOSED, err->msg);
  return rc;
}

/* The daemon went away: keep what this process still maps (buffers stay readable), mark every
 * hold and published name lost, and connect again with backoff for up to reconnect_ms.
 * With c->mu held. */

static int reconnect(gpupool_client *c, gpupool__error *err) {
  stale_gen *g;
  uint64_t start = 0;
  long delay_ms = 20;
  int rc;
  struct timespec ts;
  gpupool__error why; /* the last handshake's failure */

  while (c->reader_active)
    pthread_cond_wait(&c->cv, &c->mu);
  if (!c->broken)
    return 0; /* another thread reconnected meanwhile */
  if (c->fd >= 0) {
    close(c->fd);
    c->fd = -1;
    g = calloc(1, sizeof *g);
    if (!g)
      return gpupool__error_set(err, GPUPOOL_ENOMEM, "out of memory");
    g->pools = c->pools;
    g->npools = c->npools;
    g->events = c->events;
    g->lease_fd = c->lease_fd;
    c->lease_fd = -1;
    gpupool__hmap_init(&c->events);
    for (size_t i = 0; i < c->slabs.cap; i++)
      if (gpupool__hmap_slot_used(&c->slabs, i)) {
        cslab *s = c->slabs.slots[i].val;
        if (s->refs == 0) {
          /* Kept for reuse by a daemon that is gone: nothing will use it again. */
          c->be->slab_unmap(s->pool->bp, s->base, s->size, s->priv, NULL);
          free(s);
          continue;
        }
        s->stale = g;
        g->live_slabs++;
      }
    if (c->be && c->be->sync)
      c->be->sync(NULL);
    gpupool__hmap_free(&c->slabs);
    gpupool__hmap_init(&c->slabs);
    gpupool__exports_clear(c);
    gpupool__layout_cache_clear(c);
    c->pools = NULL;
    c->npools = 0;
    c->nunmapped = 0;
    g->next = c->stale;
    c->stale = g;
    if (g->live_slabs == 0)
      gpupool__stale_gen_free(c, g);
    for (gpupool_buffer *b = c->buffers; b; b = b->next)
      if (!b->lost) {
        b->lost = 1;
        c->holds_lost++;
      }
    for (size_t i = 0; i < c->npublished; i++) {
      char **n = realloc(c->lost_names, (c->nlost_names + 1) * sizeof *n);
      if (!n) {
        free(c->published[i]);
        continue;
      }
      c->lost_names = n;
      c->lost_names[c->nlost_names++] = c->published[i];
    }
    c->npublished = 0;
  }
  clock_gettime(CLOCK_MONOTONIC, &ts);
  start = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
  for (;;) {
    uint64_t now;
    rc = handshake(c, &why);
    if (rc == 0)
      break;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    /* Refused outright (wrong version, not allowed, over a limit): give up. Nobody
     * listening, or a connection that closed before the Hello reply (a daemon still going
     * down or coming up): try again within the budget. */
    if ((rc != GPUPOOL_ECONNECT && rc != GPUPOOL_ECLOSED && rc != GPUPOOL_EIO &&
         !(rc == GPUPOOL_EPROTO && c->hs_closed)) ||
        now - start >= (uint64_t)c->reconnect_ms) {
      return gpupool__error_set(err, rc, "the daemon went away and did not come back within %d ms: %s",
                                c->reconnect_ms, why.msg);
    }
    /* Sleep without the lock so other threads can fail fast or see the new connection. */
    pthread_mutex_unlock(&c->mu);
    ts.tv_sec = delay_ms / 1000;
    ts.tv_nsec = (delay_ms % 1000) * 1000000L;
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&c->mu);
    if (!c->broken)
      return 0;
    delay_ms = delay_ms * 2 > 500 ? 500 : delay_ms * 2;
  }
  c->reconnects++;
  c->resv_next = c->resv_end = 0; /* a new connection has no ids reserved */
  c->resv_asked = 0;
  return 0;
}

/* The limit a connection keeps for connecting and the handshake (> 0 ms, < 0 forever) from
 * the caller's timeout_ms. 0 means "do not wait" as everywhere in the API: one try, and the
 * daemon's answer to Hello must come within a millisecond (the handshake has no limit of 0,
 * which the connection reads as "none"). */
static int connect_limit(int timeout_ms) {
  const char *env;
  int ms;
  if (timeout_ms == 0)
    return 1;
  if (timeout_ms != GPUPOOL_TIMEOUT_DEFAULT)
    return timeout_ms;
  env = getenv("GPUPOOL_CONNECT_TIMEOUT_MS");
  ms = env && *env ? atoi(env) : GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS;
  return ms == 0 ? GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS : ms;
}

int gpupool_client_connect(const char *socket_path, const char *client_name, int timeout_ms,
                           gpupool_client **out) {
  gpupool_client *c;
  const char *env;
  gpupool__error err; /* why the handshake failed */
  int rc;

  gpupool__err_clear();
  if (!out)
    return gpupool__err(GPUPOOL_EINVAL, "out is NULL");
  *out = NULL;
  c = calloc(1, sizeof *c);
  if (!c)
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  if (!socket_path || !*socket_path) {
    if ((rc = gpupool_client_default_socket_path(c->socket_path, sizeof c->socket_path)) != 0) {
      free(c);
      return rc;
    }
  } else if (strlen(socket_path) >= sizeof c->socket_path) {
    free(c);
    return gpupool__err(GPUPOOL_EINVAL, "socket path '%s' is longer than %zu bytes", socket_path,
                        sizeof c->socket_path - 1);
  } else {
    strcpy(c->socket_path, socket_path);
  }
  snprintf(c->name, sizeof c->name, "%s", client_name ? client_name : "");
  gpupool__utf8_scrub(c->name);
  env = getenv("GPUPOOL_RECONNECT_MS");
  c->reconnect_ms = env && *env ? atoi(env) : 5000;
  c->connect_timeout_ms = connect_limit(timeout_ms);
  env = getenv("GPUPOOL_SPIN_US");
  c->spin_us = env && *env ? atoi(env) : 0;
  if (c->spin_us < 0 || c->spin_us > 1000000)
    c->spin_us = 0;
  env = getenv("GPUPOOL_HOST_FENCES");
  c->host_fences_env = env && *env ? atoi(env) != 0 : -1;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  gpupool__hmap_init(&c->slabs);
  gpupool__hmap_init(&c->exports);
  gpupool__hmap_init(&c->events);
  gpupool__smap_init(&c->layout_cache);
  gpupool__wire_rx_init(&c->rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  c->fd = -1;
  c->lease_fd = -1;
  c->reconnect = reconnect;
  c->revoked = gpupool__handle_revokes;
  pthread_mutex_lock(&c->mu);
  rc = handshake(c, &err);
  pthread_mutex_unlock(&c->mu);
  if (rc != 0) {
    gpupool__wire_rx_reset(&c->rx);
    gpupool__hmap_free(&c->slabs);
    gpupool__hmap_free(&c->exports);
    gpupool__hmap_free(&c->events);
    free(c->pools);
    free(c->unmapped); /* revocations the refused Hello reply carried */
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
    return gpupool__error_report(&err, rc);
  }
  *out = c;
  gpupool__err_clear();
  return 0;
}

int gpupool_client_set_reconnect(gpupool_client *c, int budget_ms) {
  if (!c || budget_ms < 0)
    return gpupool__err(GPUPOOL_EINVAL, "set_reconnect: client must not be NULL and the budget must be >= 0");
  pthread_mutex_lock(&c->mu);
  c->reconnect_ms = budget_ms;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

int gpupool_client_set_connect_timeout(gpupool_client *c, int timeout_ms) {
  if (!c)
    return gpupool__err(GPUPOOL_EINVAL, "set_connect_timeout: client must not be NULL");
  pthread_mutex_lock(&c->mu);
  c->connect_timeout_ms = connect_limit(timeout_ms);
  pthread_mutex_unlock(&c->mu);
  return 0;
}

uint64_t gpupool_client_slab_maps(gpupool_client *c) {
  uint64_t n;
  if (!c)
    return 0;
  pthread_mutex_lock(&c->mu);
  n = c->slab_maps;
  pthread_mutex_unlock(&c->mu);
  return n;
}

uint64_t gpupool_client_ready_waits(gpupool_client *c) {
  uint64_t n;
  if (!c)
    return 0;
  pthread_mutex_lock(&c->mu);
  n = c->ready_waits;
  pthread_mutex_unlock(&c->mu);
  return n;
}

uint64_t gpupool_client_reconnect_count(gpupool_client *c) {
  uint64_t n;
  if (!c)
    return 0;
  pthread_mutex_lock(&c->mu);
  n = c->reconnects;
  pthread_mutex_unlock(&c->mu);
  return n;
}

int gpupool_client_lost_names(gpupool_client *c, char (*names)[GPUPOOL_NAME_MAX + 1], int max, int *n) {
  int k = 0;
  if (!c || !n || max < 0 || (max > 0 && !names))
    return gpupool__err(GPUPOOL_EINVAL, "lost_names: bad arguments");
  pthread_mutex_lock(&c->mu);
  while (k < max && c->nlost_names > 0) {
    char *nm = c->lost_names[--c->nlost_names];
    gpupool_bundle *b = NULL;
    int rc;
    /* A daemon that restored its state still has it: ask (without the lock, as any request). */
    pthread_mutex_unlock(&c->mu);
    rc = gpupool_bundle_get(c, nm, 0, 0, GPUPOOL_READ_ONLY, NULL, &b);
    if (rc == 0)
      (void)gpupool_bundle_release(b, NULL);
    pthread_mutex_lock(&c->mu);
    if (rc == 0) {
      gpupool__note_published(c, nm); /* still this client's name: lost again if the next daemon loses it */
      free(nm);
      continue;
    }
    snprintf(names[k++], GPUPOOL_NAME_MAX + 1, "%s", nm);
    free(nm);
  }
  *n = k;
  pthread_mutex_unlock(&c->mu);
  return 0;
}

int gpupool_buffer_lost(const gpupool_buffer *b) { return b ? b->lost : 0; }

int gpupool_client_set_devices(gpupool_client *c, const int *devices, int n) {
  gpupool__error err = {.code = 0}; /* why reconnecting or attaching a pool failed */
  int rc = 0;
  if (!c || n < 0 || n > 64 || (n > 0 && !devices))
    return gpupool__err(GPUPOOL_EINVAL, "set_devices: bad arguments (at most 64 devices)");
  gpupool__err_clear();
  pthread_mutex_lock(&c->mu);
  memcpy(c->devices, devices, (size_t)n * sizeof *devices);
  c->ndevices = n;
  /* Import every pool now, so a device pair without peer access is refused here, not at the
   * first buffer (pool_attach applies c->devices). */
  if ((rc = gpupool__ensure_connected(c, &err)) == 0)
    for (int i = 0; i < c->npools && rc == 0; i++) {
      rc = c->pools[i].bp ? c->be->pool_set_access(c->pools[i].bp, devices, n)
                          : gpupool__pool_attach(c, &c->pools[i], &err);
      /* A pool shared with a group this client is not in: it never gets memory of it. */
      if (rc == GPUPOOL_EPERM) {
        rc = 0;
        err.code = 0;
        gpupool__err_clear();
      }
    }
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}

void gpupool_client_disconnect(gpupool_client *c) {
  if (!c)
    return;
  pthread_mutex_lock(&c->mu);
  /* Lost buffers unmap their dead daemon's slabs as they go, and the last one of a
   * generation closes that generation's pools, events and lease. */
  while (c->buffers) {
    gpupool__error ignored; /* the daemon drops what a closing connection held anyway */
    gpupool__release_locked(c, c->buffers, NULL, &ignored);
  }
  for (size_t i = 0; i < c->slabs.cap; i++)
    if (gpupool__hmap_slot_used(&c->slabs, i)) {
      cslab *s = c->slabs.slots[i].val;
      gpupool__be_unmap(c, s, NULL);
      free(s);
    }
  gpupool__hmap_free(&c->slabs);
  if (c->be && c->be->sync)
    c->be->sync(NULL); /* imports freed before the daemon sees this connection close */
  gpupool__exports_clear(c);
  gpupool__hmap_free(&c->exports);
  gpupool__layout_cache_clear(c);
  gpupool__smap_free(&c->layout_cache);
  gpupool__release_imports(c, &c->events, c->pools, c->npools);
  while (c->stale)
    gpupool__stale_gen_free(c, c->stale);
  pthread_mutex_unlock(&c->mu);
  /* Nothing of the daemon's memory is mapped any more: the lease goes first, so the daemon
   * finds it gone when it sees the connection close. */
  if (c->lease_fd >= 0)
    close(c->lease_fd);
  if (c->fd >= 0)
    close(c->fd);
  gpupool__wire_rx_reset(&c->rx);
  free(c->pools);
  free(c->unmapped);
  for (size_t i = 0; i < c->npublished; i++)
    free(c->published[i]);
  free(c->published);
  for (size_t i = 0; i < c->nlost_names; i++)
    free(c->lost_names[i]);
  free(c->lost_names);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  free(c);
}

int gpupool_client_stats_sized(gpupool_client *c, gpupool_daemon_stats *ds_out, size_t ds_size,
                               gpupool_pool_stats *pools, size_t pool_size, int max_pools, int *n_pools) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  gpupool__rep *rep;
  gpupool__error err = {.code = 0}; /* why the transport failed */
  int rc, n = 0;
  gpupool_daemon_stats ds_full, *ds = ds_out ? &ds_full : NULL;
  if (!c)
    return gpupool__err(GPUPOOL_EINVAL, "stats: client is NULL");
  /* A caller built against an older header passes smaller structs: fill what it knows. */
  if ((ds_out && ds_size < GPUPOOL_STATS_MIN_DAEMON_SIZE) || (pools && pool_size < GPUPOOL_STATS_MIN_POOL_SIZE))
    return gpupool__err(GPUPOOL_EINVAL, "stats: struct sizes %zu/%zu are below the first release's; "
                        "call gpupool_client_stats() from gpupool.h", ds_size, pool_size);
  gpupool__err_clear();
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &st;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__call_retry(c, &req, &rep, -1, &err);
  pthread_mutex_unlock(&c->mu);
  if (rc != 0)
    return gpupool__error_report(&err, rc);
  if (rep->body_case != GPUPOOL__WIRE__REPLY__BODY_STATS || !rep->stats) {
    gpupool__wire__reply__free_unpacked(rep, NULL);
    return gpupool__err(GPUPOOL_EPROTO, "the daemon answered Stats with something else");
  }
  if (ds) {
    const Gpupool__Wire__StatsReply *s = rep->stats;
    memset(ds, 0, sizeof *ds);
    ds->clients = s->clients;
    ds->buffers = s->buffers;
    ds->holds = s->holds;
    ds->names = s->names;
    ds->requests = s->requests;
    ds->errors = s->errors;
    ds->open_fds = s->open_fds;
    ds->pending_frees = s->pending_frees;
    ds->uptime_s = s->uptime_s;
    ds->opens_waited = s->opens_waited;
    ds->opens_waiting = s->opens_waiting;
    memcpy(ds_out, ds, ds_size < sizeof *ds ? ds_size : sizeof *ds);
  }
  for (size_t i = 0; pools && i < rep->stats->n_pools && n < max_pools; i++, n++) {
    const Gpupool__Wire__PoolInfo *pi = rep->stats->pools[i];
    gpupool_pool_stats full, *o = &full;
    memset(o, 0, sizeof *o);
    o->id = pi->id;
    snprintf(o->name, sizeof o->name, "%s", pi->name ? pi->name : "");
    if (gpupool__wire_mem_kind(pi->location, &o->kind) != 0)
      o->kind = GPUPOOL_MEM_HOST; /* a newer daemon's kind: shown as host rather than failing stats */
    o->device = pi->device;
    o->simulated_device = pi->simulated_device ? (int32_t)pi->simulated_device - 1 : -1;
    o->capacity = pi->capacity;
    o->slab_size = pi->slab_size;
    o->max_alloc = pi->max_alloc;
    o->used = pi->used;
    o->reserved = pi->reserved;
    o->used_high = pi->used_high;
    o->reserved_high = pi->reserved_high;
    o->backend_used = pi->backend_used;
    o->backend_reserved = pi->backend_reserved;
    o->buffers = pi->buffers;
    o->slabs = pi->slabs;
    memcpy((char *)pools + (size_t)n * pool_size, o, pool_size < sizeof *o ? pool_size : sizeof *o);
  }
  if (n_pools)
    *n_pools = n;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

int gpupool_client_trim(gpupool_client *c) {
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Trim tr = GPUPOOL__WIRE__TRIM__INIT;
  gpupool__rep *rep;
  gpupool__error err = {.code = 0}; /* why the transport failed */
  int rc;
  if (!c)
    return gpupool__err(GPUPOOL_EINVAL, "trim: client is NULL");
  gpupool__err_clear();
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_TRIM;
  req.trim = &tr;
  pthread_mutex_lock(&c->mu);
  rc = gpupool__call_retry(c, &req, &rep, -1, &err);
  if (rc == 0)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  pthread_mutex_unlock(&c->mu);
  return gpupool__error_report(&err, rc);
}
