/*
 * The metrics' exporters: how the text metrics.c renders leaves the process (a textfile, a
 * Unix socket, a TCP address; see metrics.c for what each does), each starting and failing on
 * its own, and the bounds on the scrapers that connect (slots per listener, per uid or
 * address, a couple kept for root and the daemon's uid, a deadline per connection).
 */
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "errors.h"
#include "paths.h"
#include "log.h"
#include "metrics_internal.h"

/* ---- exposition: textfile and socket -------------------------------------------------------- */

/* Frees m once close() was called and nothing of it is open any more. */
void gpd_metrics_maybe_free(gpd_metrics *m) {
  if (m->closing && m->open_handles == 0 && m->conns == NULL)
    free(m);
}

/* Close callback of m's own handles (timer, listeners, drop pipe). */
void gpd_metrics_handle_closed(uv_handle_t *h) {
  gpd_metrics *m = h->data;
  m->open_handles--;
  gpd_metrics_maybe_free(m);
}

static void close_handle(gpd_metrics *m, uv_handle_t *h) {
  h->data = m;
  uv_close(h, gpd_metrics_handle_closed);
}

/* Text for the current state; NULL (logged) when out of memory. */
char *gpd_metrics_snapshot_text(gpd_metrics *m) {
  Gpupool__Wire__StatsReply st = GPUPOOL__WIRE__STATS_REPLY__INIT;
  char *text;
  int have = 0;

  if (m->src.fill != NULL) {
    int rc = m->src.fill(m->src.arg, &st);
    if (rc == 0)
      have = 1;
    else
      GPUPOOL__PEER_WARN(NULL, 0, "metrics: cannot take a stats snapshot (%s); exporting request counters only",
              gpupool__errmsg()[0] ? gpupool__errmsg() : gpupool_strerror(rc));
  }
  text = gpd_metrics_render(m, have ? &st : NULL);
  if (have && m->src.release != NULL)
    m->src.release(m->src.arg, &st);
  if (text == NULL)
    GPUPOOL__PEER_WARN(NULL, 0, "metrics: out of memory rendering the metrics text");
  return text;
}

static int write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

static void write_textfile(gpd_metrics *m) {
  char *text = gpd_metrics_snapshot_text(m);
  const char *what = NULL;
  int fd = -1, err = 0;

  if (text == NULL)
    return;
  fd = open(m->tmpfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    what = "create";
    err = errno;
    goto out;
  }
  /* Readable by the collector (another user) whatever the daemon's umask. */
  if (fchmod(fd, 0644) != 0 || write_all(fd, text, strlen(text)) != 0) {
    what = "write";
    err = errno;
    goto out;
  }
  if (close(fd) != 0) {
    fd = -1;
    what = "close";
    err = errno;
    goto out;
  }
  fd = -1;
  if (rename(m->tmpfile, m->textfile) != 0) {
    what = "rename";
    err = errno;
    goto out;
  }

out:
  if (fd >= 0)
    close(fd);
  if (what != NULL) {
    unlink(m->tmpfile);
    /* Say it once when it starts failing and once when it recovers, not every interval. */
    if (!m->write_failing) {
      snprintf(m->why_textfile, sizeof m->why_textfile, "cannot %s %s: %s", what,
               what[0] == 'r' ? m->textfile : m->tmpfile, strerror(err));
      GPUPOOL__WARN("metrics: textfile exporter degraded: %s; the textfile keeps its last content "
                    "and is retried every interval",
                    m->why_textfile);
    }
    m->write_failing = 1;
  } else if (m->write_failing) {
    GPUPOOL__INFO("metrics: textfile exporter recovered: writing %s again", m->textfile);
    m->write_failing = 0;
    m->why_textfile[0] = '\0';
  }
  free(text);
}

static void on_timer(uv_timer_t *t) {
  write_textfile(t->data);
}

static int start_socket(gpd_metrics *m, const gpd_config *cfg) {
  mode_t mode = cfg->socket_mode ? cfg->socket_mode : 0660;
  mode_t old;
  int rc;

  rc = gpupool__clear_stale_socket(m->sock, "metrics_socket");
  if (rc < 0)
    return rc;
  rc = uv_pipe_init(m->loop, &m->srv, 0);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "metrics_socket: %s", uv_strerror(rc));
  m->srv.data = m;
  m->open_handles++;
  m->srv_on = 1;
  /* Bound here, not with uv_pipe_bind(): libuv unlinks a bound pipe's path when it closes
   * the handle, whatever is at that path by then. Created with no access for anyone but the
   * owner, then opened up to the configured mode, so there is no moment when the umask's
   * wider mode applies. */
  {
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
      return gpupool__err(GPUPOOL_ECONFIG, "metrics_socket: socket(): %s", strerror(errno));
    snprintf(a.sun_path, sizeof a.sun_path, "%s", m->sock);
    old = umask(0177);
    rc = bind(fd, (struct sockaddr *)&a, sizeof a) == 0 ? 0 : -errno;
    umask(old);
    if (rc == 0 && (rc = uv_pipe_open(&m->srv, fd)) != 0)
      unlink(m->sock);
    if (rc != 0) {
      close(fd);
      return gpupool__err(GPUPOOL_ECONFIG,
                          "cannot bind metrics_socket %s: %s; check that its directory exists "
                          "and is writable by the daemon (under systemd: in RuntimeDirectory= or "
                          "ReadWritePaths=)",
                          m->sock, strerror(-rc));
    }
    m->sock_bound = 1;
  }
  if (chmod(m->sock, mode) != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "cannot chmod metrics_socket %s to %04o: %s", m->sock,
                        (unsigned)mode, strerror(errno));
  /* Scrapers join this group instead of the daemon's, which would let them allocate. */
  if (cfg->metrics_socket_group[0] != '\0' && chown(m->sock, (uid_t)-1, cfg->metrics_socket_gid) != 0)
    return gpupool__err(GPUPOOL_ECONFIG,
                        "cannot give metrics_socket %s the group %s (gid %u): %s; the daemon must "
                        "be root or a member of that group (under systemd: SupplementaryGroups=)",
                        m->sock, cfg->metrics_socket_group, (unsigned)cfg->metrics_socket_gid,
                        strerror(errno));
  rc = uv_listen((uv_stream_t *)&m->srv, m->backlog, gpd_metrics_on_conn);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "cannot listen on metrics_socket %s: %s", m->sock,
                        uv_strerror(rc));
  uv_unref((uv_handle_t *)&m->srv);
  GPUPOOL__INFO("metrics: serving Prometheus text on %s", m->sock);
  return 0;
}

static int start_tcp(gpd_metrics *m, const gpd_config *cfg) {
  int rc = uv_tcp_init(m->loop, &m->tcp_srv);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "metrics_listen: %s", uv_strerror(rc));
  m->tcp_srv.data = m;
  m->open_handles++;
  m->tcp_on = 1;
  (void)cfg;
  rc = uv_tcp_bind(&m->tcp_srv, (const struct sockaddr *)&m->tcp_addr, 0);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&m->tcp_srv, m->backlog, gpd_metrics_on_conn);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG,
                        "cannot listen on metrics_listen %s: %s; choose a free port (under "
                        "systemd, allow the address family and address in a drop-in: "
                        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK, IPAddressAllow=)",
                        m->listen, uv_strerror(rc));
  uv_unref((uv_handle_t *)&m->tcp_srv);
  {
    /* The address really bound (metrics_listen may be a bare port), as a scraper names it. */
    struct sockaddr_storage a;
    char ip[INET6_ADDRSTRLEN] = "?";
    int n = sizeof a, port = 0;
    if (uv_tcp_getsockname(&m->tcp_srv, (struct sockaddr *)&a, &n) == 0) {
      if (a.ss_family == AF_INET6) {
        uv_ip6_name((const struct sockaddr_in6 *)&a, ip, sizeof ip);
        port = ntohs(((const struct sockaddr_in6 *)&a)->sin6_port);
      } else {
        uv_ip4_name((const struct sockaddr_in *)&a, ip, sizeof ip);
        port = ntohs(((const struct sockaddr_in *)&a)->sin_port);
      }
    }
    GPUPOOL__INFO("metrics: serving Prometheus text on http://%s%s%s:%d/metrics (TCP)",
                  a.ss_family == AF_INET6 ? "[" : "", ip, a.ss_family == AF_INET6 ? "]" : "", port);
  }
  return 0;
}

static int start_textfile(gpd_metrics *m, const gpd_config *cfg) {
  uint32_t every = cfg->metrics_interval_ms ? cfg->metrics_interval_ms : 5000;
  int fd, rc;

  /* Find an unwritable directory now, with the configuration at hand, not in a log line
   * every interval later. */
  fd = open(m->tmpfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    /* Degraded, not given up: the timer below retries every interval, so a directory made
     * later (e.g. node_exporter installed after the daemon started) is picked up. */
    snprintf(m->why_textfile, sizeof m->why_textfile, "cannot create %s: %s", m->tmpfile, strerror(errno));
    GPUPOOL__WARN("metrics: textfile exporter degraded: %s; create the directory, make it writable "
                  "by the daemon (under systemd: ReadWritePaths=), or change metrics_textfile; "
                  "retried every %u ms",
                  m->why_textfile, every);
    m->write_failing = 1;
  } else {
    close(fd);
    unlink(m->tmpfile);
  }
  rc = uv_timer_init(m->loop, &m->timer);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "metrics timer: %s", uv_strerror(rc));
  m->timer.data = m;
  m->open_handles++;
  m->timer_on = 1;
  /* First write on the loop's first turn, once the server is up, then every interval. */
  rc = uv_timer_start(&m->timer, on_timer, 0, every);
  if (rc != 0)
    return gpupool__err(GPUPOOL_ECONFIG, "metrics timer: %s", uv_strerror(rc));
  uv_unref((uv_handle_t *)&m->timer);
  if (!m->write_failing)
    GPUPOOL__INFO("metrics: writing %s every %u ms", m->textfile, every);
  return 0;
}

static void stop_textfile(gpd_metrics *m) {
  if (m->timer_on) {
    uv_timer_stop(&m->timer);
    close_handle(m, (uv_handle_t *)&m->timer);
    m->timer_on = 0;
    /* A stopped daemon's numbers must not look current to the textfile collector. */
    unlink(m->textfile);
    unlink(m->tmpfile);
  }
}

static void stop_socket(gpd_metrics *m) {
  if (m->srv_on) {
    close_handle(m, (uv_handle_t *)&m->srv);
    m->srv_on = 0;
  }
  if (m->sock_bound) {
    gpupool__unlink_socket(m->sock);
    m->sock_bound = 0;
  }
}

static void stop_tcp(gpd_metrics *m) {
  if (m->tcp_on) {
    close_handle(m, (uv_handle_t *)&m->tcp_srv);
    m->tcp_on = 0;
  }
}

#define RETRY_FIRST_MS 1000u
#define RETRY_MAX_MS 30000u

/* The TCP exporter's retry: its listener (closed after the failure, in an earlier turn of the
 * loop, so the handle may be set up again) is started afresh. */
static void on_retry(uv_timer_t *t) {
  gpd_metrics *m = t->data;
  if (m->closing || !m->why_tcp[0])
    return;
  if (start_tcp(m, NULL) == 0) {
    GPUPOOL__INFO("metrics: tcp exporter recovered after: %s", m->why_tcp);
    m->why_tcp[0] = '\0';
    return;
  }
  snprintf(m->why_tcp, sizeof m->why_tcp, "%s", gpupool__errmsg());
  stop_tcp(m);
  m->retry_ms = m->retry_ms * 2 > RETRY_MAX_MS ? RETRY_MAX_MS : m->retry_ms * 2;
  GPUPOOL__DEBUG("metrics: tcp exporter still degraded, next try in %u ms: %s", m->retry_ms, m->why_tcp);
  uv_timer_start(&m->retry, on_retry, m->retry_ms, 0);
}

static void start_retry(gpd_metrics *m) {
  if (uv_timer_init(m->loop, &m->retry) != 0)
    return;
  m->retry.data = m;
  m->open_handles++;
  m->retry_on = 1;
  m->retry_ms = RETRY_FIRST_MS;
  uv_timer_start(&m->retry, on_retry, m->retry_ms, 0);
  uv_unref((uv_handle_t *)&m->retry);
}

static void stop_retry(gpd_metrics *m) {
  if (m->retry_on) {
    uv_timer_stop(&m->retry);
    close_handle(m, (uv_handle_t *)&m->retry);
    m->retry_on = 0;
  }
}

/* Closes every exporter; the handle itself stays (its counters still count). */
static void stop_exporters(gpd_metrics *m) {
  stop_retry(m);
  if (m->resume_on) {
    uv_timer_stop(&m->resume);
    close_handle(m, (uv_handle_t *)&m->resume);
    m->resume_on = 0;
    m->deferred[0] = m->deferred[1] = NULL;
  }
  stop_textfile(m);
  stop_socket(m);
  stop_tcp(m);
  for (conn *c = m->conns; c != NULL; c = c->next)
    gpd_metrics_conn_close(c);
}

/* Runs one exporter's start; on failure closes that one only, keeps why and logs it. */
static void start_one(gpd_metrics *m, const gpd_config *cfg, const char *what, char *why, size_t whylen,
                      int (*start)(gpd_metrics *, const gpd_config *), void (*stop)(gpd_metrics *)) {
  if (start(m, cfg) == 0)
    return;
  /* Keep the message: closing may run calls that record their own. */
  snprintf(why, whylen, "%s", gpupool__errmsg());
  stop(m);
  GPUPOOL__WARN("metrics: %s exporter degraded: %s; the other exporters serve all the same%s", what, why,
                start == start_tcp ? "; retried until it serves" : "");
}

void gpd_metrics_health(const gpd_metrics *m, char *buf, size_t len) {
  const struct {
    const char *name, *conf, *why;
  } e[] = {{"textfile", m->textfile, m->why_textfile}, {"socket", m->sock, m->why_socket},
           {"tcp", m->listen, m->why_tcp}};
  size_t at = 0;
  if (len > 0)
    buf[0] = '\0';
  for (size_t i = 0; i < sizeof e / sizeof e[0] && at < len; i++) {
    int w;
    if (!e[i].conf[0])
      continue;
    w = snprintf(buf + at, len - at, "%s%s %s%s%s", at ? "; " : "", e[i].name, e[i].why[0] ? "degraded" : "ok",
                 e[i].why[0] ? ": " : "", e[i].why);
    at = w < 0 ? len : at + (size_t)w;
  }
}

int gpd_metrics_degraded(const gpd_metrics *m, char *buf, size_t len) {
  const struct {
    const char *name, *why;
  } e[] = {{"textfile", m->why_textfile}, {"socket", m->why_socket}, {"tcp", m->why_tcp}};
  size_t at = 0;
  int n = 0;

  if (len > 0)
    buf[0] = '\0';
  for (size_t i = 0; i < sizeof e / sizeof e[0]; i++) {
    if (e[i].why[0] == '\0')
      continue;
    if (at < len) {
      int w = snprintf(buf + at, len - at, "%smetrics %s: %s", n ? "; " : "", e[i].name, e[i].why);
      at = w < 0 ? len : at + (size_t)w;
    }
    n++;
  }
  return n;
}

int gpd_metrics_start(gpd_metrics *m, uv_loop_t *loop, const gpd_config *cfg,
                           const gpd_stats_source *src) {
  if (m->started)
    return gpupool__err(GPUPOOL_EINVAL, "metrics: already started");
  m->started = 1;
  m->loop = loop;
  if (src != NULL)
    m->src = *src;
  snprintf(m->textfile, sizeof(m->textfile), "%s", cfg->metrics_textfile);
  snprintf(m->tmpfile, sizeof(m->tmpfile), "%s.tmp", cfg->metrics_textfile);
  snprintf(m->sock, sizeof(m->sock), "%s", cfg->metrics_socket);
  snprintf(m->listen, sizeof(m->listen), "%s", cfg->metrics_listen);
  m->backlog = BACKLOG(cfg);
  if (uv_timer_init(loop, &m->resume) == 0) {
    m->resume.data = m;
    m->open_handles++;
    m->resume_on = 1;
    uv_unref((uv_handle_t *)&m->resume);
  }
  if (m->textfile[0] != '\0')
    start_one(m, cfg, "textfile", m->why_textfile, sizeof m->why_textfile, start_textfile, stop_textfile);
  if (m->sock[0] != '\0')
    start_one(m, cfg, "socket", m->why_socket, sizeof m->why_socket, start_socket, stop_socket);
  m->tcp_addr = cfg->metrics_addr;
  if (m->listen[0] != '\0') {
    start_one(m, cfg, "tcp", m->why_tcp, sizeof m->why_tcp, start_tcp, stop_tcp);
    if (m->why_tcp[0])
      start_retry(m);
  }
  return 0;
}

void gpd_metrics_close(gpd_metrics *m) {
  if (m == NULL || m->closing)
    return;
  m->closing = 1;
  stop_exporters(m);
  gpd_metrics_maybe_free(m);
}
