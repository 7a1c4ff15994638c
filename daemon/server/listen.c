/*
 * gpupoold's listening socket: binding it (or taking systemd's), accepting connections with
 * their peer credentials, the limits checked at accept (allowed uids and gids, connections
 * per uid, running out of fds), the handshake timeout, and starting and stopping the server.
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

#include "peers.h"
#include "server_internal.h"
#include "replicas.h"

uint64_t gpd_server_clients(const gpd_server *s) { return s->nconns; }
uint64_t gpd_server_last_activity(const gpd_server *s) { return s->last_activity_ns; }

int gpd_server_metrics_degraded(const gpd_server *s, char *buf, size_t len) {
  if (!s->metrics) {
    if (len)
      buf[0] = '\0';
    return 0;
  }
  return gpd_metrics_degraded(s->metrics, buf, len);
}

void gpd_server_set_restart_pending(gpd_server *s, const char *what) {
  snprintf(s->restart_pending, sizeof s->restart_pending, "%s", what);
}
                                 
                                 static void hs_timeout(uv_timer_t *t) {
  gpd_conn *c = t->data;
  char why[96];
  snprintf(why, sizeof why, "no Hello within %u ms", c->srv->cfg->handshake_timeout_ms);
  gpd_conn_close(c, why);
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

/* Whether cfg's allow-lists let uid (primary gid gid) in: root and the daemon's own uid always
 * are. Checked at accept, and again for every open connection after a reload. */
static int conn_allowed(const gpd_config *cfg, uid_t uid, gid_t gid) {
  return (!cfg->n_allow_uids && !cfg->n_allow_gids) || uid == 0 || uid == geteuid() ||
         id_allowed((const uint32_t *)cfg->allow_uids, cfg->n_allow_uids, uid) ||
         id_allowed((const uint32_t *)cfg->allow_gids, cfg->n_allow_gids, gid);
}

/* Connection limits: the total (with reserved_clients slots that only root and the daemon's
 * own uid may take, so an operator can always get in) and per uid. 0, or -1 with the reason in
 * msg. */
static int conn_limits(gpd_server *s, const struct ucred *cred, char *msg, size_t len) {
  const gpd_config *cfg = s->cfg;
  int admin = cred->uid == 0 || cred->uid == geteuid();
  uint64_t tenant = gpd_tenant_of(cfg, cred->uid, cred->gid);
  const gpd_uid_usage *u = gpd_uid_usage_get(s->reg, tenant, 0);
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
    gpd_tenant_label(cfg, tenant, who, sizeof who);
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
  gpd_server *s = t->data;
  if (s->stopping || !s->accept_paused)
    return;
  s->accept_paused = 0;
  uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
}

static void log_refused_nofd(gpd_server *s, int err, int force) {
  uint64_t now = gpd_now_ns();
  struct rlimit rl;
  if (!s->refused_nofd || (!force && s->refused_logged_ns && now - s->refused_logged_ns < ACCEPT_LOG_INTERVAL_NS))
    return;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
    rl.rlim_cur = 0;
  GPUPOOL__WARN("out of file descriptors (%s; %" PRIu64 " open, limit %llu): refused %" PRIu64
                " connection(s) since the last report and stop accepting for %d ms at a time; clients already "
                "connected are served. Raise LimitNOFILE= (ulimit -n) or lower max_clients",
                err ? strerror(err) : "accept", gpd_count_open_fds(), (unsigned long long)rl.rlim_cur, s->refused_nofd,
                ACCEPT_BACKOFF_MS);
  s->refused_nofd = 0;
  s->refused_logged_ns = now;
}

/* accept4 failed for lack of fds. Spinning on a listener that stays readable would take a
 * core and flood the log: refuse what is waiting (with the reason, through a reserved fd),
 * rest the listener, and count. */
static void accept_out_of_fds(gpd_server *s, int err) {
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
static void conn_new(gpd_server *s, int fd, const struct ucred *cred, gpd_lease *lease, int peer) {
  gpd_conn *c = calloc(1, sizeof *c);
  uint64_t tenant = gpd_tenant_of(s->cfg, cred->uid, cred->gid);

  if (!c || !(c->u = gpd_uid_usage_get(s->reg, tenant, 1)) || !(c->sh = gpd_share_get(s, tenant))) {
    if (c && c->u)
      gpd_uid_usage_put(s->reg, c->u);
    free(c);
    gpd_lease_discard(lease);
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
  c->in.close_fd = c->txq.close_fd = gpd_conn_close_fd;
  c->in.close_arg = c->txq.close_arg = c;
  c->fenced_tail = &c->fenced_head;
  gpd_client_init(s->reg, &c->cl);
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
  gpd_conn_update_poll(c);
}

static void on_accept(uv_poll_t *p, int status, int events) {
  gpd_server *s = p->data;
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
    gpd_lease *lease = NULL;
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
    if (!conn_allowed(s->cfg, cred.uid, cred.gid)) {
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
    if (gpd_lease_new(s->reg, cred.uid, cred.gid, cred.pid, &lease, &peer) != 0) {
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      s->refused_nofd++;
      log_refused_nofd(s, EMFILE, 0);
      refuse(fd, GPUPOOL_ELIMIT, msg);
      continue;
    }
    conn_new(s, fd, &cred, lease, peer);
  }
}

/* A reload changed the configuration in place: what accept decided for each open connection
 * is decided again. A connection whose uid the allow-lists no longer let in, or whose tenant
 * changed (its uid joined, left or moved between [tenant] sections), is told why and closed:
 * its tenant was fixed at connect, and a connection left open would go on reaching the old
 * tenant's names and slabs (or be refused nothing). Its holds and waiting requests go with it;
 * what its process already mapped stays mapped (the kernel keeps that), and nothing new of
 * the old tenant reaches it. A client of a moved uid reconnects into its new tenant; one no
 * longer allowed is refused. Groups need nothing here: membership is looked up at each
 * request. */
void gpd_server_reloaded(gpd_server *s) {
  uint64_t refused = 0, moved = 0;
  for (gpd_conn *c = s->conns, *next; c; c = next) {
    char why[512], was[80], now[80];
    uint64_t tenant = gpd_tenant_of(s->cfg, c->cl.uid, c->cl.gid);
    next = c->next;
    if (c->closing)
      continue;
    if (!conn_allowed(s->cfg, c->cl.uid, c->cl.gid)) {
      snprintf(why, sizeof why, "uid %u / gid %u is no longer allowed by this gpupoold (a reload changed "
               "allow_uids/allow_gids in its config)", (unsigned)c->cl.uid, (unsigned)c->cl.gid);
      gpd_send_error(c, 0, GPUPOOL_EPERM, why);
      refused++;
    } else if (tenant != c->cl.tenant) {
      gpd_tenant_label(s->cfg, c->cl.tenant, was, sizeof was);
      gpd_tenant_label(s->cfg, tenant, now, sizeof now);
      snprintf(why, sizeof why, "a reload moved uid %u from %s to %s ([tenant] sections changed): this "
               "connection's holds are gone; reconnect to work as %s", (unsigned)c->cl.uid, was, now, now);
      /* ECLOSED: the library reconnects (into the new tenant) as after any closed connection. */
      gpd_send_error(c, 0, GPUPOOL_ECLOSED, why);
      moved++;
    } else {
      continue;
    }
    /* Closed now, not after the reason is flushed: meanwhile a publish could answer one of its
     * waiting gets. The reason reaches a client that reads (it is in the socket already). */
    gpd_conn_close(c, why);
  }
  if (refused || moved)
    GPUPOOL__INFO("reload: closed %" PRIu64 " connection(s) of uids no longer allowed and %" PRIu64
                  " of uids whose tenant changed (each line 'client N disconnected' says which)", refused, moved);
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

/* After a failure to create or bind the socket: a user other than root without
 * XDG_RUNTIME_DIR (a service or a container with no login session) falls back to the system
 * socket under /run, which only root may create. Say so, and the ways out, to the message. */
static int socket_path_hint(const gpd_config *cfg, int rc, int e) {
  char msg[GPUPOOL__ERRMSG_MAX];
  const char *xdg = getenv("XDG_RUNTIME_DIR"), *env = getenv("GPUPOOL_SOCKET");
  if (geteuid() == 0 || (xdg && *xdg) || (env && *env) || strncmp(cfg->socket_path, "/run/gpupool/", 13) != 0 ||
      (e != EACCES && e != EPERM && e != EROFS))
    return rc;
  snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
  return gpupool__err(rc, "%s; a user other than root gets the system socket when XDG_RUNTIME_DIR is not set: "
                      "set XDG_RUNTIME_DIR (a login session does), or choose a socket this user may create with "
                      "--socket PATH, socket = in [daemon] or GPUPOOL_SOCKET",
                      msg);
}

/* The socket appears at its path only once it listens: it is bound and listened to under a
 * name of its own beside the path, then renamed into place. A client that waits for the path
 * to exist (a script's [ -S PATH ], inotify) and connects at once would otherwise meet the
 * window between bind and listen and be refused (ECONNREFUSED). Where the path leaves no
 * room for the suffix, the socket is bound in place. */
static int bind_socket(const gpd_config *cfg, int *out) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd, rc, e, n;
  if (strlen(cfg->socket_path) >= sizeof addr.sun_path || !cfg->socket_path[0])
    return gpupool__err(GPUPOOL_ECONFIG, "socket path '%s' is empty or longer than %zu bytes", cfg->socket_path,
                        sizeof addr.sun_path - 1);
  n = snprintf(addr.sun_path, sizeof addr.sun_path, "%s.%ld.new", cfg->socket_path, (long)getpid());
  if (n < 0 || (size_t)n >= sizeof addr.sun_path)
    strcpy(addr.sun_path, cfg->socket_path);
  if ((rc = mkdir_parents(cfg->socket_path)) != 0)
    return socket_path_hint(cfg, rc, errno);
  if ((rc = gpupool__clear_stale_socket(cfg->socket_path, "socket")) < 0)
    return rc;
  if (rc == 1)
    GPUPOOL__INFO("removed the stale socket %s (nothing answered on it)", cfg->socket_path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return gpupool__err(GPUPOOL_EIO, "socket: %s", strerror(errno));
  (void)unlink(addr.sun_path); /* a temporary name left by a daemon of this pid that died here */
  if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0)
    goto bind_fail;
  if (chmod(addr.sun_path, cfg->socket_mode) != 0)
    GPUPOOL__WARN("cannot chmod %s to %o: %s", addr.sun_path, (unsigned)cfg->socket_mode, strerror(errno));
  /* Test hook: widen the window between bind and listen (a loaded machine's preemption). */
  if (getenv("GPUPOOL_TEST_LISTEN_DELAY_MS"))
    usleep((useconds_t)strtoul(getenv("GPUPOOL_TEST_LISTEN_DELAY_MS"), NULL, 10) * 1000u);
  /* The kernel caps the backlog at net.core.somaxconn. */
  if (listen(fd, (int)(cfg->listen_backlog ? cfg->listen_backlog : SOMAXCONN)) != 0) {
    rc = gpupool__err(GPUPOOL_EIO, "listen on %s: %s", cfg->socket_path, strerror(errno));
    goto fail;
  }
  if (strcmp(addr.sun_path, cfg->socket_path) != 0 && rename(addr.sun_path, cfg->socket_path) != 0) {
    rc = gpupool__err(GPUPOOL_EIO, "cannot move the socket %s into place as %s: %s", addr.sun_path,
                      cfg->socket_path, strerror(errno));
    goto fail;
  }
  *out = fd;
  return 0;
fail:
  close(fd);
  (void)unlink(addr.sun_path);
  return rc;
bind_fail:
  e = errno;
  rc = gpupool__err(GPUPOOL_EIO, "cannot bind %s: %s", cfg->socket_path, strerror(e));
  rc = socket_path_hint(cfg, rc, e);
  close(fd);
  return rc;
}

static void on_sigio(uv_signal_t *h, int signum) {
  gpd_server *s = h->data;
  (void)signum;
  gpd_files_lease_check(s->reg);
}

/* A tenant's file calls drained below the pause mark: read its connections again. */
static void fops_drained(void *arg, uint64_t tenant) {
  gpd_server *s = arg;
  if (!s->npaused)
    return;
  for (gpd_conn *c = s->conns; c; c = c->next)
    if (c->fops_paused && c->cl.tenant == tenant) {
      c->fops_paused = 0;
      s->npaused--;
      gpd_conn_update_poll(c);
    }
}

/* The metrics' snapshot: the Stats reply's content and the peers' counters. */
static int metrics_stats(void *server, Gpupool__Wire__StatsReply *st) {
  gpd_server *s = server;
  Gpupool__Wire__AdminPeersReply ap = GPUPOOL__WIRE__ADMIN_PEERS_REPLY__INIT;
  int rc = gpd_server_stats(server, st);
  if (rc == 0 && gpd_peers_admin(s, &ap) == 0) {
    st->n_peers = ap.n_peers;
    st->peers = ap.peers;
  }
  return rc;
}

static void stats_release(void *server, Gpupool__Wire__StatsReply *st) {
  Gpupool__Wire__AdminPeersReply ap = GPUPOOL__WIRE__ADMIN_PEERS_REPLY__INIT;
  (void)server;
  ap.n_peers = st->n_peers;
  ap.peers = st->peers;
  gpd_peers_admin_free(&ap);
  st->n_peers = 0;
  st->peers = NULL;
  gpd_stats_free(st);
}

/* What the peers tell the waiting gets of. */
static const gpd_peers_news peers_news = {gpd_wake_getters, gpd_fail_getters};

int gpd_server_start(gpd_server **out, uv_loop_t *loop, const gpd_config *cfg, gpd_registry *reg,
                          int listen_fd) {
  gpd_server *s;
  gpd_stats_source src = {metrics_stats, stats_release, NULL};
  int rc;
  /* The peers' secret files first (gpd_peers_start reads them again): a daemon about to refuse
   * its configuration must not bind, let alone accept on, its socket for a moment before it
   * exits (a health check or a client would see it up). */
  if ((rc = gpd_peers_check_secrets(cfg)) != 0)
    return rc;
  if (!(s = calloc(1, sizeof *s)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  if ((rc = gpd_metrics_new(&s->metrics)) != 0) {
    free(s);
    return rc;
  }
  s->close_conn = gpd_conn_close;
  s->conn_io = gpd_conn_io;
  s->loop = loop;
  s->cfg = cfg;
  s->reg = reg;
  s->started_ns = gpd_now_ns();
  if (!(s->fops = gpd_fileops_new(loop))) {
    gpd_metrics_close(s->metrics);
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
  gpupool__hmap_init(&s->copy_q);
  gpupool__hmap_init(&s->open_q);
  gpupool__hmap_init(&s->alloc_q);
  gpupool__hmap_init(&s->shares);
  reg->owner = s;
  reg->on_memory = gpd_retry_waiters;
  gpd_replicas_attach(reg);
  reg->on_copy = gpd_copy_ended;
  /* Metrics are a convenience: the daemon serves without them, counting all the same. Their
   * sockets are bound before the clients' socket listens, so whoever sees that socket accept
   * (a health check, a test) finds the metrics sockets in place too. */
  src.arg = s;
  if (gpd_metrics_start(s->metrics, loop, cfg, &src) != 0)
    GPUPOOL__WARN("metrics disabled: %s", gpupool__errmsg());
  if (listen_fd >= 0) {
    s->listen_fd = listen_fd;
  } else {
    if ((rc = bind_socket(cfg, &s->listen_fd)) != 0) {
      reg->owner = NULL;
      reg->on_memory = NULL;
      reg->on_copy = NULL;
      reg->fops = NULL;
      gpd_fileops_free(s->fops);
      gpupool__smap_free(&s->get_q);
      gpupool__hmap_free(&s->copy_q);
      gpupool__hmap_free(&s->open_q);
      gpupool__hmap_free(&s->alloc_q);
      gpupool__hmap_free(&s->shares);
      gpd_metrics_close(s->metrics);
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
  if ((rc = gpd_peers_start(s, &peers_news)) != 0) {
    char msg[GPUPOOL__ERRMSG_MAX];
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    gpd_server_stop(s);
    return gpupool__err(rc, "%s", msg);
  }
  *out = s;
  return 0;
}

/* What the log rate limits left out is told once their interval is over, even when the
 * client that caused it says nothing more (or is gone: gpd_conn_close told its count then). */
static void log_tick(uv_timer_t *t) {
  gpd_server *s = t->data;
  for (gpd_conn *c = s->conns; c; c = c->next)
    gpupool__log_peer_flush(&c->cl.log_rl, c->cl.id, 0);
  gpupool__log_peer_flush(NULL, 0, 0);
}

static void listen_closed(uv_handle_t *h) {
  gpd_server *s = h->data;
  if (h == (uv_handle_t *)&s->listen_poll)
    close(s->listen_fd);
  if (--s->listen_open > 0)
    return;
  if (s->reserve_fd >= 0)
    close(s->reserve_fd);
  /* Every connection is closed, so every waiter is gone; empty allocation queues remain. */
  gpupool__smap_free(&s->get_q);
  gpupool__hmap_free(&s->copy_q);
  gpupool__hmap_free(&s->open_q);
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

void gpd_server_stop(gpd_server *s) {
  if (s->stopping)
    return;
  s->stopping = 1;
  gpd_peers_stop(s);
  while (s->conns)
    gpd_conn_close(s->conns, "daemon shutting down");
  /* What is queued is cancelled, what runs finishes; closes from now on happen here. */
  s->reg->fops = NULL;
  gpd_fileops_free(s->fops);
  s->fops = NULL;
  if (s->own_socket)
    gpupool__unlink_socket(s->cfg->socket_path);
  s->reg->on_memory = NULL;
  s->reg->on_copy = NULL;
  gpd_metrics_close(s->metrics);
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
    gpd_files_unlease(s->reg);
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
