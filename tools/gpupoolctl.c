/*
 * gpupoolctl: the operator's view of a running gpupoold.
 *
 * It speaks the daemon's own protocol through the wire library (Hello, then one Stats or
 * admin request), so it needs no other interface in the daemon and sees exactly what the
 * daemon knows. Human output is a set of aligned tables with binary sizes; --json prints one
 * JSON document per command for scripts. Errors say what went wrong and what to do: which
 * socket was tried and how to start the daemon, or which users may make admin requests.
 *
 * Exit status: 0 success, 1 the daemon refused or failed the request (or drop-client found
 * no such client), 2 usage error, 3 the daemon could not be reached or spoke nonsense, 4 the
 * daemon is up but not serving because its configuration is invalid.
 */
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "errors.h"
#include "gpupool/gpupool.h"
#include "gpupool/version.h"
#include "requests.h"
#include "sock.h"
#include "wire.h"

#define EXIT_REFUSED 1
#define EXIT_USAGE 2
#define EXIT_UNREACHABLE 3
/* Internal: the daemon answered GPUPOOL_ENOENT to a request whose command words the message
 * itself; exits as EXIT_REFUSED. */
#define EXIT_NOT_FOUND 100
#define EXIT_CONFIG 4 /* up, answering, but not serving: what monitoring must tell from down */

typedef struct {
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  int fd;
  uint64_t seq;
  int timeout_s;
  int hello_timeout_ms; /* connect and Hello: $GPUPOOL_CONNECT_TIMEOUT_MS, else --timeout */
  int json;
  const char *cmd;
  pid_t daemon_pid;
  uid_t daemon_uid;
  gpupool__rep *hello; /* the HelloReply frame, kept for pool names and the daemon version */
} ctl;

/* With --json a failure is a JSON document too ({"error": "..."} on stdout), so a script
 * never has to parse an empty or half-written output. */
static int json_errors;
static void jstr(const char *s);
static size_t distance(const char *a, const char *b);

static void die_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void die_msg(const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "gpupoolctl: %s\n", msg);
  if (json_errors) {
    fputs("{\"error\":", stdout);
    jstr(msg);
    puts("}");
    json_errors = 0; /* one document */
  }
}

/* ---- output helpers ------------------------------------------------------------------------ */

/* JSON string: escapes quotes, backslashes and control bytes; bytes that are not valid
 * UTF-8 become U+FFFD so the document always parses. */
static void jstr(const char *s) {
  const unsigned char *p = (const unsigned char *)(s ? s : "");
  putchar('"');
  while (*p) {
    unsigned char ch = *p;
    int n = 0;
    if (ch == '"' || ch == '\\') {
      printf("\\%c", ch);
      p++;
      continue;
    }
    if (ch < 0x20) {
      if (ch == '\n')
        fputs("\\n", stdout);
      else if (ch == '\t')
        fputs("\\t", stdout);
      else if (ch == '\r')
        fputs("\\r", stdout);
      else
        printf("\\u%04x", ch);
      p++;
      continue;
    }
    if (ch < 0x80) {
      putchar(ch);
      p++;
      continue;
    }
    if (ch >= 0xc2 && ch <= 0xdf)
      n = 1;
    else if (ch >= 0xe0 && ch <= 0xef)
      n = 2;
    else if (ch >= 0xf0 && ch <= 0xf4)
      n = 3;
    if (n > 0) {
      int ok = 1;
      for (int i = 1; i <= n; i++)
        if ((p[i] & 0xc0) != 0x80)
          ok = 0;
      /* Reject overlong forms, UTF-16 surrogates and code points above U+10FFFF. */
      if (ok && ch == 0xe0 && p[1] < 0xa0)
        ok = 0;
      if (ok && ch == 0xed && p[1] > 0x9f)
        ok = 0;
      if (ok && ch == 0xf0 && p[1] < 0x90)
        ok = 0;
      if (ok && ch == 0xf4 && p[1] > 0x8f)
        ok = 0;
      if (ok) {
        fwrite(p, 1, (size_t)n + 1, stdout);
        p += n + 1;
        continue;
      }
    }
    fputs("\\ufffd", stdout);
    p++;
  }
  putchar('"');
}

static void jkey(const char *k, int *first) {
  if (!*first)
    putchar(',');
  *first = 0;
  jstr(k);
  putchar(':');
}

static void jkv_u64(const char *k, uint64_t v, int *first) {
  jkey(k, first);
  printf("%llu", (unsigned long long)v);
}

static void jkv_i64(const char *k, int64_t v, int *first) {
  jkey(k, first);
  printf("%lld", (long long)v);
}

static void jkv_str(const char *k, const char *v, int *first) {
  jkey(k, first);
  jstr(v);
}

static void jkv_bool(const char *k, int v, int *first) {
  jkey(k, first);
  fputs(v ? "true" : "false", stdout);
}

static const char *fmt_size(uint64_t v, char *buf, size_t len) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double d = (double)v;
  int u = -1;

  if (v < 1024) {
    snprintf(buf, len, "%llu B", (unsigned long long)v);
    return buf;
  }
  while (d >= 1024.0 && u < 5) {
    d /= 1024.0;
    u++;
  }
  snprintf(buf, len, d < 10.0 ? "%.2f %s" : d < 100.0 ? "%.1f %s" : "%.0f %s", d, units[u]);
  return buf;
}

static const char *fmt_age(uint64_t s, char *buf, size_t len) {
  unsigned long long d = s / 86400, h = s / 3600 % 24, m = s / 60 % 60, sec = s % 60;
  if (d > 0)
    snprintf(buf, len, "%llud %02lluh", d, h);
  else if (h > 0)
    snprintf(buf, len, "%lluh %02llum", h, m);
  else if (m > 0)
    snprintf(buf, len, "%llum %02llus", m, sec);
  else
    snprintf(buf, len, "%llus", sec);
  return buf;
}

/* Tables: cells are copied (with control characters replaced, so a client's chosen name
 * cannot drive the operator's terminal) and printed with columns padded to their widest. */
#define TABLE_MAX_COLS 12
typedef struct {
  int ncols;
  size_t nrows, cap;
  char **cells; /* nrows * ncols, row 0 is the header */
  int right[TABLE_MAX_COLS];
} table;

static void table_init(table *t, int ncols) {
  memset(t, 0, sizeof(*t));
  t->ncols = ncols;
}

static int table_row(table *t, ...) {
  va_list ap;
  if (t->nrows == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 16;
    char **n = realloc(t->cells, cap * (size_t)t->ncols * sizeof(char *));
    if (n == NULL)
      return -1;
    t->cells = n;
    t->cap = cap;
  }
  va_start(ap, t);
  for (int c = 0; c < t->ncols; c++) {
    const char *s = va_arg(ap, const char *);
    char *d = strdup(s ? s : "");
    if (d == NULL) {
      va_end(ap);
      for (int k = 0; k < c; k++)
        free(t->cells[t->nrows * (size_t)t->ncols + (size_t)k]);
      return -1;
    }
    for (char *q = d; *q; q++)
      if ((unsigned char)*q < 0x20 || *q == 0x7f)
        *q = '?';
    t->cells[t->nrows * (size_t)t->ncols + (size_t)c] = d;
  }
  va_end(ap);
  t->nrows++;
  return 0;
}

static void table_print(table *t) {
  size_t w[TABLE_MAX_COLS] = {0};
  for (size_t r = 0; r < t->nrows; r++)
    for (int c = 0; c < t->ncols; c++) {
      size_t l = strlen(t->cells[r * (size_t)t->ncols + (size_t)c]);
      if (l > w[c])
        w[c] = l;
    }
  for (size_t r = 0; r < t->nrows; r++)
    for (int c = 0; c < t->ncols; c++) {
      const char *s = t->cells[r * (size_t)t->ncols + (size_t)c];
      int last = c == t->ncols - 1;
      if (t->right[c])
        printf("%*s", (int)w[c], s);
      else if (last)
        fputs(s, stdout); /* no trailing blanks */
      else
        printf("%-*s", (int)w[c], s);
      fputs(last ? "\n" : "  ", stdout);
    }
}

static void table_free(table *t) {
  for (size_t i = 0; i < t->nrows * (size_t)t->ncols; i++)
    free(t->cells[i]);
  free(t->cells);
}

/* ---- talking to the daemon ------------------------------------------------------------------ */

static const char *fmt_secs(int ms, char *buf, size_t len) {
  snprintf(buf, len, "%g s", ms / 1000.0);
  return buf;
}

static int connect_daemon(ctl *c) {
  struct ucred cr;
  socklen_t crl = sizeof(cr);
  int fd, e, tries;

  fd = gpupool__sock_connect(c->path, c->hello_timeout_ms, 0, &tries);
  if (fd < 0) {
    char what[GPUPOOL__SOCK_DESCRIBE_MAX];
    e = -fd;
    if (tries == 0)
      die_msg("cannot create a socket: %s", strerror(e));
    else if (e == ECONNREFUSED && gpupool__sock_describe(c->path, what, sizeof what) == 1)
      die_msg("cannot connect to gpupoold: %s.", what);
    else if (e == ENOENT || e == ECONNREFUSED)
      die_msg("gpupoold is not running: %s %s.\n"
              "  Start it with 'systemctl start gpupoold.socket' (or run 'gpupoold --socket %s'),\n"
              "  or point gpupoolctl at the daemon's socket with --socket PATH or GPUPOOL_SOCKET.",
              e == ENOENT ? "there is no socket at" : "nothing accepts connections on",
              c->path, c->path);
    else if (e == EACCES || e == EPERM) {
      char group[64];
      struct stat st;
      gpupool__sock_describe(c->path, what, sizeof what);
      if (stat(c->path, &st) == 0 && st.st_gid == 0)
        /* Joining root's group would give far more than this socket: never advise it. */
        die_msg("permission denied connecting to %s (%s).\n"
                "  Connecting needs write access to the socket, whose group is root's: run gpupoolctl "
                "with sudo, or have the operator give the socket a group of its own (SocketGroup= in "
                "gpupoold.socket) and join that group.",
                c->path, what);
      else {
        if (gpupool__sock_group(c->path, group, sizeof group) != 0)
          snprintf(group, sizeof group, "<the socket's group>");
        die_msg("permission denied connecting to %s (%s).\n"
                "  Connecting needs write access to the socket: join its group ('sudo usermod -aG %s "
                "$USER', then log in again), or run gpupoolctl with sudo.",
                c->path, what, group);
      }
    } else if (e == EAGAIN || e == EINPROGRESS || e == ETIMEDOUT)
      die_msg("the daemon did not answer in %s: gpupoold at %s accepts no connections (stopped "
              "or stuck? see 'systemctl status gpupoold' and 'journalctl -u gpupoold')",
              fmt_secs(c->hello_timeout_ms, what, sizeof what), c->path);
    else
      die_msg("cannot connect to gpupoold at %s: %s", c->path, strerror(e));
    return -1;
  }
  /* Peer credentials of the socket: the daemon's own, unless a service manager created the
   * socket (socket activation: then they are the manager's). Hello says who the daemon is. */
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &crl) == 0) {
    c->daemon_pid = cr.pid;
    c->daemon_uid = cr.uid;
  } else {
    c->daemon_pid = -1;
    c->daemon_uid = (uid_t)-1;
  }
  c->fd = fd;
  return 0;
}

/* After Hello: every later request waits up to --timeout (0 = forever). */
static void set_request_timeout(ctl *c) {
  struct timeval tv = {.tv_sec = c->timeout_s, .tv_usec = 0};
  (void)setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

/* What the messages call a request: its proto message's name ("Hello", "AdminClients"). */
static const char *body_name(int body_case) {
  int i = gpupool__request_index(body_case);
  return i < 0 ? "request" : gpupool__request_kinds[i].message;
}

static int is_admin(int body_case) {
  int i = gpupool__request_index(body_case);
  return i >= 0 && (gpupool__request_kinds[i].flags & GPUPOOL__REQ_ADMIN);
}

/* Send req and read its reply. Returns 0 with *out (the caller frees it), EXIT_REFUSED when
 * the daemon answered with an error, EXIT_UNREACHABLE on transport or protocol failure; the
 * message is printed either way. The reply body case equals the request's (same numbers). */
static int call(ctl *c, gpupool__req *req, gpupool__rep **out) {
  gpupool__wire_rx rx;
  gpupool__rep *rep = NULL;
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc, ret = EXIT_UNREACHABLE;
  int bc = (int)req->body_case;

  *out = NULL;
  gpupool__wire_rx_init(&rx, GPUPOOL_WIRE_HARD_MAX_FRAME);
  req->seq = ++c->seq;
  rc = gpupool__sock_pack_request(req, 0, &buf, &len);
  if (rc < 0) {
    die_msg("cannot encode a %s request: %s", body_name(bc), gpupool__errmsg());
    goto out;
  }
  rc = gpupool__wire_send(c->fd, buf, len, NULL, 0);
  if (rc < 0) {
    die_msg("cannot send a %s request to %s: %s", body_name(bc), c->path, gpupool__errmsg());
    goto out;
  }
  rc = gpupool__sock_read_reply(&rx, c->fd, &rep);
  if (rc == 0) {
    char secs[32];
    die_msg("the daemon did not answer in %s: gpupoold at %s left a %s request unanswered "
            "(stopped or stuck? see 'systemctl status gpupoold' and 'journalctl -u gpupoold')",
            fmt_secs(bc == GPUPOOL__WIRE__REQUEST__BODY_HELLO ? c->hello_timeout_ms
                                                                : c->timeout_s * 1000,
                     secs, sizeof secs),
            c->path, body_name(bc));
    goto out;
  }
  if (bc == GPUPOOL__WIRE__REQUEST__BODY_HELLO && rc < 0) {
    /* Whatever answers here does not speak gpupool's framing. */
    if (rc == GPUPOOL_ECLOSED)
      die_msg("%s closed the connection without answering Hello: gpupoold failed to start (see "
              "'systemctl status gpupoold' and 'journalctl -u gpupoold'; check the configuration "
              "with 'gpupoold --check-config'), or this socket is not gpupoold (check --socket or "
              "GPUPOOL_SOCKET)", c->path);
    else {
      char seen[96];
      gpupool__sock_foreign(&rx, seen, sizeof seen);
      die_msg("this socket is not gpupoold: %s answered Hello with something that is not a "
              "gpupool frame (%s); check --socket or GPUPOOL_SOCKET", c->path, seen);
    }
    goto out;
  }
  if (rc == GPUPOOL_ECLOSED) {
    die_msg("gpupoold at %s closed the connection without answering a %s request; its log "
            "says why ('journalctl -u gpupoold'): often allow_uids/allow_gids or max_clients "
            "in its configuration",
            c->path, body_name(bc));
    goto out;
  }
  if (rc < 0) {
    die_msg("reading the reply from %s: %s", c->path, gpupool__errmsg());
    goto out;
  }
  if (rep == NULL) {
    if (bc == GPUPOOL__WIRE__REQUEST__BODY_HELLO)
      die_msg("this socket is not gpupoold: %s answered Hello with a frame that does not decode; "
              "check --socket or GPUPOOL_SOCKET",
              c->path);
    else
      die_msg("gpupoold at %s sent a reply that does not decode (a different protocol "
              "version?)",
              c->path);
    goto out;
  }
  if (rep->seq != req->seq && !(rep->seq == 0 && rep->error != NULL)) {
    die_msg("gpupoold at %s answered request %llu while %llu was expected", c->path,
            (unsigned long long)rep->seq, (unsigned long long)req->seq);
    goto out;
  }
  if (rep->error != NULL) {
    int code = rep->error->code;
    const char *msg = rep->error->message && rep->error->message[0] ? rep->error->message
                                                                    : gpupool_strerror(code);
    if (code == GPUPOOL_EPERM && is_admin(bc)) {
      struct passwd *pw = c->daemon_uid != (uid_t)-1 ? getpwuid(c->daemon_uid) : NULL;
      die_msg("%s: permission denied: %s\n"
              "  Admin requests need root or the daemon's own user (uid %d%s%s); try "
              "'sudo gpupoolctl %s'.",
              c->cmd, msg, (int)c->daemon_uid, pw ? ", " : "", pw ? pw->pw_name : "", c->cmd);
    } else if (code == GPUPOOL_ENOENT && bc == GPUPOOL__WIRE__REQUEST__BODY_ADMIN_UNPUBLISH) {
      ret = EXIT_NOT_FOUND; /* cmd_unpublish says it, with the keys meant */
      goto out;
    } else if (code == GPUPOOL_ENOENT && bc == GPUPOOL__WIRE__REQUEST__BODY_ADMIN_DROP_CLIENT) {
      die_msg("no client with pid %d is connected (see 'gpupoolctl clients')",
              (int)req->admin_drop_client->pid);
    } else {
      die_msg("%s: %s (%s)", c->cmd, msg, gpupool_err_name(code));
    }
    ret = bc != GPUPOOL__WIRE__REQUEST__BODY_HELLO ? EXIT_REFUSED
          : code == GPUPOOL_ECONFIG              ? EXIT_CONFIG
                                                 : EXIT_UNREACHABLE;
    goto out;
  }
  if ((int)rep->body_case != bc) {
    die_msg("gpupoold at %s answered a %s request with a reply of another kind (%d)", c->path,
            body_name(bc), (int)rep->body_case);
    goto out;
  }
  *out = rep;
  rep = NULL;
  ret = 0;

out:
  if (rep != NULL)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  gpupool__wire_rx_reset(&rx);
  free(buf);
  return ret;
}

static int hello(ctl *c) {
  Gpupool__Wire__Hello h = GPUPOOL__WIRE__HELLO__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  int rc;

  h.protocol_version = GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION;
  h.client_name = "gpupoolctl";
  h.pid = (int32_t)getpid();
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_HELLO;
  req.hello = &h;
  rc = call(c, &req, &c->hello);
  if (rc != 0)
    return rc;
  /* The daemon's own pid and uid (a daemon before 0.2 does not send them). */
  if (c->hello->hello->daemon_pid > 0) {
    c->daemon_pid = c->hello->hello->daemon_pid;
    c->daemon_uid = c->hello->hello->daemon_uid;
  }
  set_request_timeout(c);
  return 0;
}

static const char *pool_name(const ctl *c, uint32_t id, char *buf, size_t len) {
  const Gpupool__Wire__HelloReply *h = c->hello->hello;
  for (size_t i = 0; i < h->n_pools; i++)
    if (h->pools[i]->id == id)
      return h->pools[i]->name;
  snprintf(buf, len, "#%u", id);
  return buf;
}


/* ---- commands ------------------------------------------------------------------------------ */

static int get_stats(ctl *c, gpupool__rep **rep) {
  Gpupool__Wire__Stats s = GPUPOOL__WIRE__STATS__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  req.stats = &s;
  return call(c, &req, rep);
}

static void json_pool(const Gpupool__Wire__PoolInfo *p) {
  int f = 1;
  putchar('{');
  jkv_u64("id", p->id, &f);
  jkv_str("name", p->name, &f);
  jkv_str("backend", gpupool__wire_backend_name(p->backend), &f);
  jkv_str("location", gpupool__wire_location_name(p->location), &f);
  jkv_i64("device", p->device, &f);
  jkv_i64("numa_node", p->numa_node, &f);
  jkv_u64("capacity", p->capacity, &f);
  jkv_u64("slab_size", p->slab_size, &f);
  jkv_u64("max_alloc", p->max_alloc, &f);
  jkv_u64("used", p->used, &f);
  jkv_u64("reserved", p->reserved, &f);
  jkv_u64("used_high", p->used_high, &f);
  jkv_u64("reserved_high", p->reserved_high, &f);
  jkv_u64("backend_used", p->backend_used, &f);
  jkv_u64("backend_reserved", p->backend_reserved, &f);
  jkv_u64("backend_used_high", p->backend_used_high, &f);
  jkv_u64("backend_reserved_high", p->backend_reserved_high, &f);
  jkv_u64("buffers", p->buffers, &f);
  jkv_u64("slabs", p->slabs, &f);
  jkv_u64("held", p->held, &f);
  jkv_u64("instances", p->instances, &f);
  jkv_i64("simulated_device", p->simulated_device ? (int64_t)p->simulated_device - 1 : -1, &f);
  putchar('}');
}

static void json_stats(const ctl *c, const Gpupool__Wire__StatsReply *s) {
  int f = 1;
  putchar('{');
  jkv_str("socket", c->path, &f);
  jkv_i64("daemon_pid", s->daemon_pid > 0 ? s->daemon_pid : c->daemon_pid, &f);
  jkv_i64("daemon_uid", s->daemon_pid > 0 ? (int64_t)s->daemon_uid : (int64_t)c->daemon_uid, &f);
  jkv_str("daemon_version", s->daemon_version, &f);
  jkv_str("backend", gpupool__wire_backend_name(s->backend), &f);
  jkv_u64("protocol_version", c->hello->hello->protocol_version, &f);
  jkv_u64("uptime_s", s->uptime_s, &f);
  jkv_u64("clients", s->clients, &f);
  jkv_u64("buffers", s->buffers, &f);
  jkv_u64("holds", s->holds, &f);
  jkv_u64("names", s->names, &f);
  jkv_u64("requests", s->requests, &f);
  jkv_u64("errors", s->errors, &f);
  jkv_u64("open_fds", s->open_fds, &f);
  jkv_u64("pending_frees", s->pending_frees, &f);
  jkv_u64("waiting_leases", s->waiting_leases, &f);
  jkv_u64("replica_copies", s->replica_copies, &f);
  jkv_u64("replica_bytes", s->replica_bytes, &f);
  jkv_u64("replica_copies_running", s->replica_copies_running, &f);
  jkv_u64("replica_copies_failed", s->replica_copies_failed, &f);
  jkv_str("restart_pending", s->restart_pending, &f);
  jkv_str("metrics_exporters", s->metrics_exporters, &f);
  jkey("pools", &f);
  putchar('[');
  for (size_t i = 0; i < s->n_pools; i++) {
    if (i)
      putchar(',');
    json_pool(s->pools[i]);
  }
  puts("]}");
}

static int cmd_status(ctl *c) {
  gpupool__rep *rep;
  const Gpupool__Wire__StatsReply *s;
  char up[32], b[8][32];
  table t;
  int rc = get_stats(c, &rep);

  if (rc != 0)
    return rc;
  s = rep->stats;
  if (c->json) {
    json_stats(c, s);
    goto out;
  }
  {
    struct passwd *pw = getpwuid(c->daemon_uid);
    printf("gpupoold %s (pid %d, uid %u%s%s) on %s\n", s->daemon_version,
           (int)(s->daemon_pid > 0 ? s->daemon_pid : c->daemon_pid), (unsigned)c->daemon_uid,
           pw ? " " : "", pw ? pw->pw_name : "", c->path);
  }
  printf("backend %s, up %s\n", gpupool__wire_backend_name(s->backend), fmt_age(s->uptime_s, up, sizeof(up)));
  printf("clients %llu, buffers %llu, holds %llu, names %llu, pending frees %llu, "
         "waiting leases %llu, open fds %llu\n",
         (unsigned long long)s->clients, (unsigned long long)s->buffers,
         (unsigned long long)s->holds, (unsigned long long)s->names,
         (unsigned long long)s->pending_frees, (unsigned long long)s->waiting_leases,
         (unsigned long long)s->open_fds);
  printf("requests %llu, errors %llu\n", (unsigned long long)s->requests,
         (unsigned long long)s->errors);
  if (s->metrics_exporters && *s->metrics_exporters)
    printf("metrics exporters: %s\n", s->metrics_exporters);
  if (s->restart_pending && *s->restart_pending)
    printf("restart pending: a reload read new %s, which only a restart applies ('systemctl restart "
           "gpupoold' drops every hold)\n",
           s->restart_pending);
  putchar('\n');
  table_init(&t, 11);
  for (int i = 2; i <= 10; i++)
    t.right[i] = 1;
  table_row(&t, "POOL", "WHERE", "CAPACITY", "USED", "RESERVED", "USED HIGH", "RES HIGH",
            "BUFFERS", "SLABS", "SLAB SIZE", "MAX ALLOC");
  for (size_t i = 0; i < s->n_pools; i++) {
    const Gpupool__Wire__PoolInfo *p = s->pools[i];
    char where[48], nb[24], ns[24];
    if (p->location == GPUPOOL__WIRE__LOCATION_KIND__LOCATION_DEVICE)
      snprintf(where, sizeof(where), "gpu%d", p->device);
    else if (p->location == GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST_NUMA)
      snprintf(where, sizeof(where), "pinned numa%d", p->numa_node);
    else if (p->location == GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST && p->simulated_device)
      snprintf(where, sizeof(where), "memfd as gpu%u (SIMULATED)", p->simulated_device - 1);
    else if (p->location == GPUPOOL__WIRE__LOCATION_KIND__LOCATION_HOST)
      snprintf(where, sizeof(where), "memfd");
    else
      snprintf(where, sizeof(where), "%s", gpupool__wire_location_name(p->location));
    snprintf(nb, sizeof(nb), "%llu", (unsigned long long)p->buffers);
    snprintf(ns, sizeof(ns), "%llu", (unsigned long long)p->slabs);
    table_row(&t, p->name, where, fmt_size(p->capacity, b[0], 32), fmt_size(p->used, b[1], 32),
              fmt_size(p->reserved, b[2], 32), fmt_size(p->used_high, b[3], 32),
              fmt_size(p->reserved_high, b[4], 32), nb, ns, fmt_size(p->slab_size, b[5], 32),
              fmt_size(p->max_alloc, b[6], 32));
  }
  table_print(&t);
  table_free(&t);
out:
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

static int cmd_stats(ctl *c) {
  gpupool__rep *rep;
  const Gpupool__Wire__StatsReply *s;
  int rc = get_stats(c, &rep);

  if (rc != 0)
    return rc;
  s = rep->stats;
  if (c->json) {
    json_stats(c, s);
  } else {
    /* One "key value" per line, exact numbers: easy to grep, unlike the status table. */
    printf("daemon_version %s\nbackend %s\nuptime_s %llu\nclients %llu\nbuffers %llu\n"
           "holds %llu\nnames %llu\nrequests %llu\nerrors %llu\nopen_fds %llu\n"
           "pending_frees %llu\nwaiting_leases %llu\n",
           s->daemon_version, gpupool__wire_backend_name(s->backend), (unsigned long long)s->uptime_s,
           (unsigned long long)s->clients, (unsigned long long)s->buffers,
           (unsigned long long)s->holds, (unsigned long long)s->names,
           (unsigned long long)s->requests, (unsigned long long)s->errors,
           (unsigned long long)s->open_fds, (unsigned long long)s->pending_frees,
           (unsigned long long)s->waiting_leases);
    printf("replica_copies %llu\nreplica_bytes %llu\nreplica_copies_running %llu\nreplica_copies_failed %llu\n",
           (unsigned long long)s->replica_copies, (unsigned long long)s->replica_bytes,
           (unsigned long long)s->replica_copies_running, (unsigned long long)s->replica_copies_failed);
    for (size_t i = 0; i < s->n_pools; i++) {
      const Gpupool__Wire__PoolInfo *p = s->pools[i];
      const char *n = p->name;
      printf("pool.%s.id %u\npool.%s.location %s\npool.%s.device %d\npool.%s.capacity %llu\n"
             "pool.%s.used %llu\npool.%s.reserved %llu\npool.%s.used_high %llu\n"
             "pool.%s.reserved_high %llu\npool.%s.backend_used %llu\n"
             "pool.%s.backend_reserved %llu\npool.%s.buffers %llu\npool.%s.slabs %llu\n"
             "pool.%s.held %llu\npool.%s.instances %u\n",
             n, p->id, n, gpupool__wire_location_name(p->location), n, p->device, n,
             (unsigned long long)p->capacity, n, (unsigned long long)p->used, n,
             (unsigned long long)p->reserved, n, (unsigned long long)p->used_high, n,
             (unsigned long long)p->reserved_high, n, (unsigned long long)p->backend_used, n,
             (unsigned long long)p->backend_reserved, n, (unsigned long long)p->buffers, n,
             (unsigned long long)p->slabs, n, (unsigned long long)p->held, n, p->instances);
      if (p->simulated_device)
        printf("pool.%s.simulated_device %u\n", n, p->simulated_device - 1);
    }
  }
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

static int cmd_clients(ctl *c) {
  Gpupool__Wire__AdminClients ac = GPUPOOL__WIRE__ADMIN_CLIENTS__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *rep;
  const Gpupool__Wire__AdminClientsReply *r;
  table t;
  int rc;

  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_CLIENTS;
  req.admin_clients = &ac;
  rc = call(c, &req, &rep);
  if (rc != 0)
    return rc;
  r = rep->admin_clients;
  if (c->json) {
    printf("{\"clients\":[");
    for (size_t i = 0; i < r->n_clients; i++) {
      const Gpupool__Wire__ClientInfo *ci = r->clients[i];
      struct passwd *pw = getpwuid(ci->uid);
      int f = 1;
      printf("%s{", i ? "," : "");
      jkv_u64("id", ci->id, &f);
      jkv_i64("pid", ci->pid, &f);
      jkv_u64("uid", ci->uid, &f);
      jkv_str("user", pw ? pw->pw_name : "", &f);
      jkv_u64("gid", ci->gid, &f);
      jkv_str("name", ci->name, &f);
      jkv_u64("holds", ci->holds, &f);
      jkv_u64("bytes", ci->bytes, &f);
      jkv_u64("age_s", ci->age_s, &f);
      jkv_bool("self", ci->id == c->hello->hello->client_id, &f);
      putchar('}');
    }
    puts("]}");
    goto out;
  }
  table_init(&t, 7);
  t.right[0] = t.right[1] = t.right[4] = t.right[5] = t.right[6] = 1;
  table_row(&t, "ID", "PID", "USER", "NAME", "HOLDS", "BYTES", "AGE");
  for (size_t i = 0; i < r->n_clients; i++) {
    const Gpupool__Wire__ClientInfo *ci = r->clients[i];
    struct passwd *pw = getpwuid(ci->uid);
    char id[24], pid[16], user[64], holds[24], bytes[32], age[32];
    snprintf(id, sizeof(id), "%llu", (unsigned long long)ci->id);
    snprintf(pid, sizeof(pid), "%d", ci->pid);
    if (pw != NULL)
      snprintf(user, sizeof(user), "%s", pw->pw_name);
    else
      snprintf(user, sizeof(user), "%u", ci->uid);
    snprintf(holds, sizeof(holds), "%llu", (unsigned long long)ci->holds);
    table_row(&t, id, pid, user, ci->name, holds, fmt_size(ci->bytes, bytes, sizeof(bytes)),
              fmt_age(ci->age_s, age, sizeof(age)));
  }
  table_print(&t);
  table_free(&t);
out:
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

static int cmp_by_id(const void *a, const void *b) {
  const Gpupool__Wire__BufferInfo *x = *(Gpupool__Wire__BufferInfo *const *)a;
  const Gpupool__Wire__BufferInfo *y = *(Gpupool__Wire__BufferInfo *const *)b;
  return x->id < y->id ? -1 : x->id > y->id;
}

static int cmp_by_key(const void *a, const void *b) {
  const Gpupool__Wire__NameInfo *x = *(Gpupool__Wire__NameInfo *const *)a;
  const Gpupool__Wire__NameInfo *y = *(Gpupool__Wire__NameInfo *const *)b;
  return strcmp(x->key, y->key);
}

static void jkv_strs(const char *k, char **v, size_t n, int *first) {
  jkey(k, first);
  putchar('[');
  for (size_t i = 0; i < n; i++) {
    if (i)
      putchar(',');
    jstr(v[i]);
  }
  putchar(']');
}

static void jkv_u64s(const char *k, const uint64_t *v, size_t n, int *first) {
  jkey(k, first);
  putchar('[');
  for (size_t i = 0; i < n; i++)
    printf("%s%llu", i ? "," : "", (unsigned long long)v[i]);
  putchar(']');
}

/* "a, b, c": a buffer's names for the text table (the caller frees it). */
static char *join_names(char **v, size_t n) {
  size_t len = 1;
  char *s, *p;
  for (size_t i = 0; i < n; i++)
    len += strlen(v[i]) + 2;
  if (!(s = p = malloc(len)))
    return NULL;
  *p = '\0';
  for (size_t i = 0; i < n; i++)
    p += sprintf(p, "%s%s", i ? ", " : "", v[i]);
  return s;
}

static const Gpupool__Wire__BufferInfo *find_buffer(const Gpupool__Wire__AdminBuffersReply *r, uint64_t id) {
  for (size_t i = 0; i < r->n_buffers; i++)
    if (r->buffers[i]->id == id)
      return r->buffers[i];
  return NULL;
}

/* AdminBuffers: every live buffer, sorted by id (allocation order); *rep is the caller's. */
static int admin_buffers(ctl *c, gpupool__rep **rep) {
  Gpupool__Wire__AdminBuffers ab = GPUPOOL__WIRE__ADMIN_BUFFERS__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  int rc;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_BUFFERS;
  req.admin_buffers = &ab;
  if ((rc = call(c, &req, rep)) != 0)
    return rc;
  qsort((*rep)->admin_buffers->buffers, (*rep)->admin_buffers->n_buffers, sizeof(*(*rep)->admin_buffers->buffers),
        cmp_by_id);
  return 0;
}

/* `buffers`: every live buffer, sorted by id (allocation order), with all its names. */
static int cmd_buffers(ctl *c) {
  gpupool__rep *rep;
  Gpupool__Wire__AdminBuffersReply *r;
  Gpupool__Wire__BufferInfo **v;
  size_t n;
  table t;
  int rc;

  if ((rc = admin_buffers(c, &rep)) != 0)
    return rc;
  r = rep->admin_buffers;
  v = r->buffers;
  n = r->n_buffers;

  if (c->json) {
    printf("{\"buffers\":[");
    for (size_t i = 0; i < n; i++) {
      char pb[16];
      int f = 1;
      printf("%s{", i ? "," : "");
      jkv_u64("id", v[i]->id, &f);
      jkv_u64("pool_id", v[i]->pool_id, &f);
      jkv_str("pool", pool_name(c, v[i]->pool_id, pb, sizeof(pb)), &f);
      jkv_u64("size", v[i]->size, &f);
      jkv_u64("holders", v[i]->holders, &f);
      jkv_u64("age_s", v[i]->age_s, &f);
      jkv_i64("owner_pid", v[i]->owner_pid, &f);
      jkv_str("name", v[i]->name, &f);
      jkv_strs("names", v[i]->names, v[i]->n_names, &f);
      jkv_i64("device", v[i]->device, &f);
      jkv_u64("replica_of", v[i]->replica_of, &f);
      putchar('}');
    }
    puts("]}");
    goto out;
  }
  table_init(&t, 8);
  t.right[0] = t.right[2] = t.right[3] = t.right[4] = t.right[5] = 1;
  table_row(&t, "ID", "POOL", "SIZE", "HOLDERS", "AGE", "OWNER PID", "REPLICA OF", "NAMES");
  for (size_t i = 0; i < n; i++) {
    char id[24], pb[16], size[32], holders[16], age[32], pid[16], repl[48] = "-";
    char *names = join_names(v[i]->names, v[i]->n_names);
    snprintf(id, sizeof(id), "%llu", (unsigned long long)v[i]->id);
    if (v[i]->replica_of)
      snprintf(repl, sizeof(repl), "%llu on gpu%d", (unsigned long long)v[i]->replica_of, v[i]->device);
    snprintf(holders, sizeof(holders), "%u", v[i]->holders);
    snprintf(pid, sizeof(pid), "%d", v[i]->owner_pid);
    fmt_size(v[i]->size, size, sizeof(size));
    fmt_age(v[i]->age_s, age, sizeof(age));
    table_row(&t, id, pool_name(c, v[i]->pool_id, pb, sizeof(pb)), size, holders, age, pid, repl,
              names ? names : "");
    free(names);
  }
  table_print(&t);
  table_free(&t);
out:
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

/* `names`: every published name of every tenant, sorted by key, one row per name (a buffer
 * published under three names is three rows): buffers with their id, pool and holders,
 * bundles with their version and member count, files with their path. */
static int cmd_names(ctl *c) {
  Gpupool__Wire__AdminNames an = GPUPOOL__WIRE__ADMIN_NAMES__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *names, *bufs;
  Gpupool__Wire__NameInfo **v;
  size_t n;
  table t;
  int rc;

  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_NAMES;
  req.admin_names = &an;
  if ((rc = call(c, &req, &names)) != 0)
    return rc;
  if ((rc = admin_buffers(c, &bufs)) != 0) {
    gpupool__wire__reply__free_unpacked(names, NULL);
    return rc;
  }
  v = names->admin_names->names;
  n = names->admin_names->n_names;
  qsort(v, n, sizeof(*v), cmp_by_key);

  if (c->json) {
    printf("{\"names\":[");
    for (size_t i = 0; i < n; i++) {
      const Gpupool__Wire__BufferInfo *b =
          v[i]->n_buffer_ids ? find_buffer(bufs->admin_buffers, v[i]->buffer_ids[0]) : NULL;
      char pb[16];
      int f = 1;
      printf("%s{", i ? "," : "");
      jkv_str("name", v[i]->key, &f);
      jkv_str("kind", v[i]->kind, &f);
      jkv_u64("uid", v[i]->uid, &f);
      jkv_u64("version", v[i]->version, &f);
      jkv_u64("size", v[i]->size, &f);
      jkv_u64("age_s", v[i]->age_s, &f);
      jkv_u64("members", v[i]->members, &f);
      jkv_u64s("buffers", v[i]->buffer_ids, v[i]->n_buffer_ids, &f);
      jkv_str("path", v[i]->path, &f);
      if (b) { /* the (first) buffer's: what `buffers` shows of it */
        jkv_u64("id", b->id, &f);
        jkv_str("pool", pool_name(c, b->pool_id, pb, sizeof(pb)), &f);
        jkv_u64("holders", b->holders, &f);
        jkv_i64("owner_pid", b->owner_pid, &f);
      }
      putchar('}');
    }
    printf("],\"files\":[");
    for (size_t i = 0, k = 0; i < n; i++) {
      int f = 1;
      if (strcmp(v[i]->kind, "file") != 0)
        continue;
      printf("%s{", k++ ? "," : "");
      jkv_str("name", v[i]->key, &f);
      jkv_u64("uid", v[i]->uid, &f);
      jkv_u64("size", v[i]->size, &f);
      jkv_u64("age_s", v[i]->age_s, &f);
      jkv_str("path", v[i]->path, &f);
      putchar('}');
    }
    puts("]}");
    goto out;
  }
  table_init(&t, 9);
  t.right[2] = t.right[3] = t.right[4] = t.right[6] = t.right[7] = 1;
  table_row(&t, "NAME", "KIND", "VERSION", "SIZE", "UID", "POOL", "BUFFER", "AGE", "MEMBERS/PATH");
  for (size_t i = 0; i < n; i++) {
    const Gpupool__Wire__BufferInfo *b =
        v[i]->n_buffer_ids ? find_buffer(bufs->admin_buffers, v[i]->buffer_ids[0]) : NULL;
    char ver[24], size[32], uid[16], pb[16], id[24], age[32], what[32];
    snprintf(ver, sizeof(ver), "%llu", (unsigned long long)v[i]->version);
    fmt_size(v[i]->size, size, sizeof(size));
    snprintf(uid, sizeof(uid), "%u", v[i]->uid);
    snprintf(id, sizeof(id), "%llu", b ? (unsigned long long)b->id : 0ull);
    fmt_age(v[i]->age_s, age, sizeof(age));
    snprintf(what, sizeof(what), "%u member%s", v[i]->members, v[i]->members == 1 ? "" : "s");
    table_row(&t, v[i]->key, v[i]->kind, ver, size, uid, b ? pool_name(c, b->pool_id, pb, sizeof(pb)) : "-",
              b ? id : "-", age, strcmp(v[i]->kind, "file") == 0 ? v[i]->path
                                 : strcmp(v[i]->kind, "bundle") == 0 ? what : "");
  }
  table_print(&t);
  table_free(&t);
out:
  gpupool__wire__reply__free_unpacked(bufs, NULL);
  gpupool__wire__reply__free_unpacked(names, NULL);
  return 0;
}

/* `peers`: the configured peers, how each stands, and what was fetched from and served to it. */
static int cmd_peers(ctl *c) {
  Gpupool__Wire__AdminPeers ap = GPUPOOL__WIRE__ADMIN_PEERS__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *rep;
  const Gpupool__Wire__AdminPeersReply *r;
  table t;
  int rc;

  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_PEERS;
  req.admin_peers = &ap;
  if ((rc = call(c, &req, &rep)) != 0)
    return rc;
  r = rep->admin_peers;
  if (c->json) {
    int f = 1;
    putchar('{');
    jkv_str("transport", r->transport, &f);
    jkv_str("listen", r->listen, &f);
    jkv_str("device_memory", r->device_memory, &f);
    jkv_u64("staging_in_use", r->staging_in_use, &f);
    jkv_u64("staging_made", r->staging_made, &f);
    printf(",\"peers\":[");
    for (size_t i = 0; i < r->n_peers; i++) {
      const Gpupool__Wire__PeerInfo *p = r->peers[i];
      int g = 1;
      printf("%s{", i ? "," : "");
      jkv_str("name", p->name, &g);
      jkv_str("address", p->address, &g);
      jkv_str("state", p->state, &g);
      jkv_str("last_error", p->last_error, &g);
      jkv_u64("fetches_in_flight", p->fetches_in_flight, &g);
      jkv_u64("fetches", p->fetches, &g);
      jkv_u64("failures", p->failures, &g);
      jkv_u64("bytes_fetched", p->bytes_fetched, &g);
      jkv_u64("versions_served", p->versions_served, &g);
      jkv_u64("bytes_served", p->bytes_served, &g);
      jkv_u64("serving_now", p->serving_now, &g);
      jkv_u64("bytes_staged", p->bytes_staged, &g);
      jkv_str("fetch_transport", p->fetch_transport, &g);
      jkv_str("serve_transport", p->serve_transport, &g);
      jkv_u64("restarts", p->restarts, &g);
      putchar('}');
    }
    puts("]}");
    gpupool__wire__reply__free_unpacked(rep, NULL);
    return 0;
  }
  /* What UCX offers here; the transports a peer's data really uses are listed per peer below. */
  printf("transport: %s (available)\nlisten: %s\n", r->transport, r->listen && *r->listen ? r->listen : "(serves no peer)");
  if (r->device_memory && *r->device_memory) {
    char use[32], made[32];
    fmt_size(r->staging_in_use, use, sizeof(use));
    fmt_size(r->staging_made, made, sizeof(made));
    printf("device memory: %s\nstaging: %s in use of %s made\n", r->device_memory, use, made);
  }
  table_init(&t, 9);
  t.right[3] = t.right[4] = t.right[5] = t.right[6] = t.right[7] = 1;
  table_row(&t, "PEER", "ADDRESS", "STATE", "IN FLIGHT", "FETCHES", "FAILED", "FETCHED", "SERVED", "LAST ERROR");
  for (size_t i = 0; i < r->n_peers; i++) {
    const Gpupool__Wire__PeerInfo *p = r->peers[i];
    char fl[16], fe[24], fa[24], by[32], sv[24];
    snprintf(fl, sizeof(fl), "%u", p->fetches_in_flight);
    snprintf(fe, sizeof(fe), "%llu", (unsigned long long)p->fetches);
    snprintf(fa, sizeof(fa), "%llu", (unsigned long long)p->failures);
    fmt_size(p->bytes_fetched, by, sizeof(by));
    snprintf(sv, sizeof(sv), "%llu", (unsigned long long)p->versions_served);
    table_row(&t, p->name, p->address, p->state, fl, fe, fa, by, sv, p->last_error);
  }
  table_print(&t);
  table_free(&t);
  for (size_t i = 0; i < r->n_peers; i++) {
    const Gpupool__Wire__PeerInfo *p = r->peers[i];
    if (*p->fetch_transport || *p->serve_transport || p->restarts)
      printf("%s: fetched over %s; served over %s; restarts seen: %u\n", p->name,
             *p->fetch_transport ? p->fetch_transport : "(not connected yet)",
             *p->serve_transport ? p->serve_transport : "(not served yet)", p->restarts);
  }
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

/* No name is filed under key: say so, with the keys meant when there are. Keys start with
 * their tenant ("uid:1000/" or "group:NAME/"); a key given without it (what the publisher
 * called the name) is matched against the part after it, a near key by its spelling. */
static void not_filed(ctl *c, const char *key) {
  Gpupool__Wire__AdminNames an = GPUPOOL__WIRE__ADMIN_NAMES__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *rep = NULL;
  char hint[512] = "";
  size_t at = 0, found = 0;
  int saved = json_errors;

  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_NAMES;
  req.admin_names = &an;
  json_errors = 0;
  if (call(c, &req, &rep) == 0) {
    const Gpupool__Wire__AdminNamesReply *r = rep->admin_names;
    for (size_t i = 0; i < r->n_names && found < 4; i++) {
      const char *k = r->names[i]->key, *slash = strchr(k, '/');
      int match = slash && !strcmp(slash + 1, key);
      if (!match && strlen(key) > 3 && distance(key, k) <= 1 + strlen(k) / 8)
        match = 1;
      if (!match)
        continue;
      if (found++ == 3) {
        at += (size_t)snprintf(hint + at, sizeof hint - at, ", ...");
        break;
      }
      if (at < sizeof hint)
        at += (size_t)snprintf(hint + at, sizeof hint - at, "%s'%s'", at ? ", " : "", k);
      if (at >= sizeof hint)
        at = sizeof hint - 1;
    }
  }
  json_errors = saved;
  if (rep)
    gpupool__wire__reply__free_unpacked(rep, NULL);
  if (found)
    die_msg("no name is filed under '%s'; did you mean %s? (keys start with their tenant, as "
            "'gpupoolctl names' shows them)", key, hint);
  else if (!strchr(key, ':'))
    die_msg("no name is filed under '%s': keys start with their tenant, as 'gpupoolctl names' "
            "shows them (uid:1000/%s, group:NAME/%s)", key, key, key);
  else
    die_msg("no name is filed under '%s' (see 'gpupoolctl names' for the keys)", key);
}

/* Remove a name of any tenant, by the key `names` shows ("uid:1000/weights"). */
static int cmd_unpublish(ctl *c, const char *key) {
  Gpupool__Wire__AdminUnpublish au = GPUPOOL__WIRE__ADMIN_UNPUBLISH__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *rep;
  int rc;
  if (key == NULL || !*key) {
    die_msg("unpublish wants the name's key as 'gpupoolctl names' shows it, e.g. uid:1000/weights");
    return EXIT_USAGE;
  }
  au.key = (char *)key;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_UNPUBLISH;
  req.admin_unpublish = &au;
  if ((rc = call(c, &req, &rep)) == EXIT_NOT_FOUND) {
    not_filed(c, key);
    return EXIT_REFUSED;
  }
  if (rc != 0)
    return rc;
  if (c->json)
    printf("{\"unpublished\":\"%s\"}\n", key);
  else
    printf("unpublished %s\n", key);
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

static int cmd_drop(ctl *c, const char *arg) {
  Gpupool__Wire__AdminDropClient d = GPUPOOL__WIRE__ADMIN_DROP_CLIENT__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *rep;
  char *end = NULL;
  long pid;
  uint32_t dropped;
  int rc;

  errno = 0;
  pid = arg ? strtol(arg, &end, 10) : 0;
  if (arg == NULL || errno != 0 || end == arg || *end != '\0' || pid <= 0 || pid > INT32_MAX) {
    die_msg("drop-client needs the pid of a connected client (see 'gpupoolctl clients'), got "
            "'%s'",
            arg ? arg : "");
    return EXIT_USAGE;
  }
  d.pid = (int32_t)pid;
  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_ADMIN_DROP_CLIENT;
  req.admin_drop_client = &d;
  rc = call(c, &req, &rep);
  if (rc != 0)
    return rc;
  dropped = rep->admin_drop_client->dropped;
  gpupool__wire__reply__free_unpacked(rep, NULL);
  if (c->json) {
    int f = 1;
    putchar('{');
    jkv_i64("pid", pid, &f);
    jkv_u64("dropped", dropped, &f);
    puts("}");
  } else if (dropped > 0) {
    printf("dropped %u connection%s of pid %ld; the holds they had are released\n", dropped,
           dropped == 1 ? "" : "s", pid);
  }
  if (dropped == 0) {
    die_msg("no client with pid %ld is connected (see 'gpupoolctl clients')", pid);
    return EXIT_REFUSED;
  }
  return 0;
}

static int cmd_trim(ctl *c) {
  Gpupool__Wire__Trim tr = GPUPOOL__WIRE__TRIM__INIT;
  gpupool__req req = GPUPOOL__WIRE__REQUEST__INIT;
  gpupool__rep *rep;
  int rc;

  req.body_case = GPUPOOL__WIRE__REQUEST__BODY_TRIM;
  req.trim = &tr;
  rc = call(c, &req, &rep);
  if (rc != 0)
    return rc;
  if (c->json) {
    int f = 1;
    putchar('{');
    jkv_u64("slabs_freed", rep->trim->slabs_freed, &f);
    jkv_u64("slabs_revoked", rep->trim->slabs_revoked, &f);
    puts("}");
  } else {
    printf("freed %u empty slab%s; %u more wait for clients to unmap them\n",
           rep->trim->slabs_freed, rep->trim->slabs_freed == 1 ? "" : "s",
           rep->trim->slabs_revoked);
  }
  gpupool__wire__reply__free_unpacked(rep, NULL);
  return 0;
}

/* ---- main ---------------------------------------------------------------------------------- */

/* The commands, one row each: dispatch, --help and the did-you-mean read the rows; whether a
 * command is for operators comes from the request table's row of the request it makes
 * (common/requests.h), so --help says what the daemon enforces. */
typedef struct {
  const char *name;
  const char *arg;   /* its argument as --help writes it, or NULL */
  int body_case;     /* the request it makes (names also reads AdminBuffers, admin as well) */
  int (*run)(ctl *c, const char *arg);
  const char *help;  /* lines of --help after the name, '\n' between them */
} command;

static int run_status(ctl *c, const char *a) { (void)a; return cmd_status(c); }
static int run_clients(ctl *c, const char *a) { (void)a; return cmd_clients(c); }
static int run_buffers(ctl *c, const char *a) { (void)a; return cmd_buffers(c); }
static int run_names(ctl *c, const char *a) { (void)a; return cmd_names(c); }
static int run_peers(ctl *c, const char *a) { (void)a; return cmd_peers(c); }
static int run_stats(ctl *c, const char *a) { (void)a; return cmd_stats(c); }
static int run_trim(ctl *c, const char *a) { (void)a; return cmd_trim(c); }

static const command commands[] = {
    {"status", NULL, GPUPOOL__WIRE__REQUEST__BODY_STATS, run_status,
     "daemon version, backend, uptime, clients and pool usage; exporters\n"
     "and a restart a reload left pending"},
    {"clients", NULL, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_CLIENTS, run_clients,
     "connected clients: id, pid, user, name, holds, bytes, age"},
    {"buffers", NULL, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_BUFFERS, run_buffers,
     "live buffers sorted by id: pool, size, holders, age, owner pid, the\n"
     "buffer a replica copies and its device, and every name"},
    {"names", NULL, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_NAMES, run_names,
     "every tenant's published names sorted by key, one row each: buffers,\n"
     "bundles (version, members) and files (path)"},
    {"unpublish", "KEY", GPUPOOL__WIRE__REQUEST__BODY_ADMIN_UNPUBLISH, cmd_unpublish,
     "remove the name filed under KEY, as names shows it (uid:1000/x),\n"
     "whichever tenant published it"},
    {"peers", NULL, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_PEERS, run_peers,
     "the peer daemons: address, state, fetches in flight, fetched,\n"
     "failed, versions served and the last error"},
    {"stats", NULL, GPUPOOL__WIRE__REQUEST__BODY_STATS, run_stats, "every daemon and pool counter, one per line"},
    {"drop-client", "PID", GPUPOOL__WIRE__REQUEST__BODY_ADMIN_DROP_CLIENT, cmd_drop,
     "disconnect every connection of process PID, releasing its holds"},
    {"trim", NULL, GPUPOOL__WIRE__REQUEST__BODY_TRIM, run_trim,
     "give every tenant's empty slabs back to the backend"},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

static const command *find_command(const char *name) {
  for (size_t i = 0; i < NCOMMANDS; i++)
    if (!strcmp(commands[i].name, name))
      return &commands[i];
  return NULL;
}

/* Edit distance (with transpositions) of two short words, for the did-you-mean hints. */
static size_t distance(const char *a, const char *b) {
  enum { N = 64 };
  size_t la = strnlen(a, N - 1), lb = strnlen(b, N - 1), d[N][N];
  for (size_t i = 0; i <= la; i++)
    d[i][0] = i;
  for (size_t j = 0; j <= lb; j++)
    d[0][j] = j;
  for (size_t i = 1; i <= la; i++)
    for (size_t j = 1; j <= lb; j++) {
      size_t best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
      if (d[i - 1][j] + 1 < best)
        best = d[i - 1][j] + 1;
      if (d[i][j - 1] + 1 < best)
        best = d[i][j - 1] + 1;
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < best)
        best = d[i - 2][j - 2] + 1;
      d[i][j] = best;
    }
  return d[la][lb];
}

/* The nearest of words[0..n) to w when it is near enough to be a typo, else NULL. */
static const char *nearest(const char *w, const char *const *words, size_t n) {
  const char *best = NULL;
  size_t best_d = SIZE_MAX;
  for (size_t i = 0; i < n; i++) {
    size_t d = distance(w, words[i]);
    if (d < best_d) {
      best_d = d;
      best = words[i];
    }
  }
  return best && best_d <= 1 + strlen(best) / 4 ? best : NULL;
}

#define SHORT_USAGE "Usage: gpupoolctl [-s PATH] [-j] [-t SEC] COMMAND [ARG]"

/* A mistyped command line: the problem (already said), the short usage and where the rest is. */
static int usage_error(void) {
  fprintf(stderr, "%s\nTry 'gpupoolctl --help' for the commands and options.\n", SHORT_USAGE);
  return EXIT_USAGE;
}

static void usage(FILE *f) {
  fprintf(f,
          "Usage: gpupoolctl [OPTIONS] COMMAND [ARG]\n"
          "\n"
          "Inspect and manage a running gpupoold.\n"
          "\n"
          "Commands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++) {
    const command *k = &commands[i];
    int ri = gpupool__request_index(k->body_case);
    int admin = ri >= 0 && (gpupool__request_kinds[ri].flags & GPUPOOL__REQ_ADMIN);
    char head[32];
    const char *p = k->help;
    snprintf(head, sizeof head, "%s%s%s", k->name, k->arg ? " " : "", k->arg ? k->arg : "");
    fprintf(f, "  %-16s  ", head);
    for (;;) {
      const char *nl = strchr(p, '\n');
      if (!nl) {
        fprintf(f, "%s%s\n", p, admin ? " (admin)" : "");
        break;
      }
      fprintf(f, "%.*s\n%20s", (int)(nl - p), p, "");
      p = nl + 1;
    }
  }
  fprintf(f,
          "\n"
          "Options:\n"
          "  -s, --socket PATH   daemon socket (default: $GPUPOOL_SOCKET, else\n"
          "                      /run/gpupool/gpupoold.sock for root, else\n"
          "                      $XDG_RUNTIME_DIR/gpupool/gpupoold.sock)\n"
          "  -j, --json          print one JSON document instead of text\n"
          "  -t, --timeout SEC   how long to wait for the daemon's answer (default %d, the\n"
          "                      client library's connect timeout; 0 = wait forever)\n"
          "  -h, --help          show this help\n"
          "  -V, --version       show the version\n"
          "\n"
          "Admin commands need root or the daemon's own user.\n"
          "Environment: GPUPOOL_SOCKET (as --socket), GPUPOOL_CONNECT_TIMEOUT_MS (connect and\n"
          "  Hello only; default --timeout).\n"
          "Exit status: 0 success, 1 the daemon refused or failed the request, 2 usage error,\n"
          "3 the daemon could not be reached, 4 the daemon runs but does not serve: its\n"
          "configuration is invalid.\n",
          GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS / 1000);
}

int main(int argc, char **argv) {
  static const struct option opts[] = {
      {"socket", required_argument, NULL, 's'}, {"json", no_argument, NULL, 'j'},
      {"timeout", required_argument, NULL, 't'}, {"help", no_argument, NULL, 'h'},
      {"version", no_argument, NULL, 'V'},       {NULL, 0, NULL, 0}};
  ctl c;
  const char *sock = NULL, *arg;
  int o, rc;

  memset(&c, 0, sizeof(c));
  c.fd = -1;
  c.timeout_s = GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS / 1000;
  c.hello_timeout_ms = -1;
  const command *cmd;

  opterr = 0; /* the messages below say what was wrong, and the short usage */
  while ((o = getopt_long(argc, argv, ":s:jt:hV", opts, NULL)) != -1) {
    switch (o) {
    case 's': sock = optarg; break;
    case 'j': c.json = json_errors = 1; break;
    case 't': {
      char *end = NULL;
      long v = strtol(optarg, &end, 10);
      if (end == optarg || *end != '\0' || v < 0 || v > 86400) {
        die_msg("--timeout wants whole seconds (0 = wait forever), got '%s'", optarg);
        return usage_error();
      }
      c.timeout_s = (int)v;
      break;
    }
    case 'h': usage(stdout); return 0;
    case 'V': printf("gpupoolctl %s\n", GPUPOOL_VERSION_STRING); return 0;
    case ':':
      die_msg("option '%s' needs a value", argv[optind - 1]);
      return usage_error();
    default: {
      /* An option mistyped: name it, and the one meant when it is near enough. */
      const char *bad = argv[optind - 1], *near = NULL;
      char shown[8];
      if (optopt && strncmp(bad, "--", 2) != 0) {
        snprintf(shown, sizeof shown, "-%c", optopt);
        bad = shown;
      } else {
        const char *names[sizeof opts / sizeof opts[0]];
        size_t n = 0, len = strcspn(bad + 2, "=");
        char word[64];
        snprintf(word, sizeof word, "%.*s", (int)(len < sizeof word ? len : sizeof word - 1), bad + 2);
        for (const struct option *op = opts; op->name; op++)
          names[n++] = op->name;
        near = nearest(word, names, n);
      }
      if (near)
        die_msg("unknown option '%s'; did you mean '--%s'?", bad, near);
      else
        die_msg("unknown option '%s'", bad);
      return usage_error();
    }
    }
  }
  if (optind >= argc) {
    die_msg("no command given");
    return usage_error();
  }
  c.cmd = argv[optind];
  arg = optind + 1 < argc ? argv[optind + 1] : NULL;
  if (!(cmd = find_command(c.cmd))) {
    const char *names[NCOMMANDS], *near;
    for (size_t i = 0; i < NCOMMANDS; i++)
      names[i] = commands[i].name;
    near = nearest(c.cmd, names, NCOMMANDS);
    if (near)
      die_msg("unknown command '%s'; did you mean '%s'?", c.cmd, near);
    else
      die_msg("unknown command '%s'", c.cmd);
    return usage_error();
  }
  if (optind + 1 + (cmd->arg != NULL) < argc) {
    die_msg("unexpected argument '%s' after '%s'", argv[optind + 1 + (cmd->arg != NULL)], c.cmd);
    return usage_error();
  }

  if (sock != NULL) {
    if (strlen(sock) >= sizeof(c.path)) {
      die_msg("socket path '%s' is longer than a Unix socket address allows (%zu bytes)", sock,
              sizeof(c.path) - 1);
      return EXIT_USAGE;
    }
    snprintf(c.path, sizeof(c.path), "%s", sock);
  } else if (gpupool_client_default_socket_path(c.path, sizeof(c.path)) != 0) {
    die_msg("%s; pass --socket PATH", gpupool__errmsg());
    return EXIT_USAGE;
  }

  {
    const char *env = getenv("GPUPOOL_CONNECT_TIMEOUT_MS");
    char *end = NULL;
    long v = env && *env ? strtol(env, &end, 10) : -1;
    if (env && *env && (*end != '\0' || v < 0 || v > 86400000)) {
      die_msg("GPUPOOL_CONNECT_TIMEOUT_MS='%s' is not a number of milliseconds", env);
      return EXIT_USAGE;
    }
    c.hello_timeout_ms = v >= 0 ? (int)v : c.timeout_s * 1000;
  }
  if (connect_daemon(&c) != 0)
    return EXIT_UNREACHABLE;
  rc = hello(&c);
  if (rc != 0)
    goto out;
  rc = cmd->run(&c, arg);

out:
  if (c.hello != NULL)
    gpupool__wire__reply__free_unpacked(c.hello, NULL);
  close(c.fd);
  if (fflush(stdout) != 0 && rc == 0) {
    die_msg("cannot write the output: %s", strerror(errno));
    rc = EXIT_REFUSED;
  }
  return rc;
}
