/*
 * gpupoolctl, the output side: JSON and aligned tables (control characters replaced, binary
 * sizes), and one renderer per command that prints its reply as text or --json. The
 * renderers only print: requests and their errors are gpupoolctl.c's.
 */
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpupoolctl.h"

/* ---- output helpers ------------------------------------------------------------------------ */

/* JSON string: escapes quotes, backslashes and control bytes; bytes that are not valid
 * UTF-8 become U+FFFD so the document always parses. */
void jstr(const char *s) {
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

const char *fmt_secs(int ms, char *buf, size_t len) {
  snprintf(buf, len, "%g s", ms / 1000.0);
  return buf;
}

const char *pool_name(const ctl *c, uint32_t id, char *buf, size_t len) {
  const Gpupool__Wire__HelloReply *h = c->hello->hello;
  for (size_t i = 0; i < h->n_pools; i++)
    if (h->pools[i]->id == id)
      return h->pools[i]->name;
  snprintf(buf, len, "#%u", id);
  return buf;
}



/* ---- the commands' replies ----------------------------------------------------------------- */

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
  jkv_u64("opens_waited", s->opens_waited, &f);
  jkv_u64("opens_waiting", s->opens_waiting, &f);
  jkv_u64("opens_waited", s->opens_waited, &f);
  jkv_u64("opens_waiting", s->opens_waiting, &f);
  jkv_str("restart_pending", s->restart_pending, &f);
  jkv_str("metrics_exporters", s->metrics_exporters, &f);
  jkv_str("survival", s->survival, &f);
  jkey("pools", &f);
  putchar('[');
  for (size_t i = 0; i < s->n_pools; i++) {
    if (i)
      putchar(',');
    json_pool(s->pools[i]);
  }
  puts("]}");
}

int render_status(ctl *c, gpupool__rep *rep, const char *arg) {
  const Gpupool__Wire__StatsReply *s = rep->stats;
  char up[32], b[8][32];
  table t;

  (void)arg;
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
  if (s->survival && *s->survival)
    printf("survival: %s\n", s->survival);
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
  return 0;
}

int render_stats(ctl *c, gpupool__rep *rep, const char *arg) {
  const Gpupool__Wire__StatsReply *s = rep->stats;

  (void)arg;
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
    printf("opens_waited %llu\nopens_waiting %llu\n", (unsigned long long)s->opens_waited,
           (unsigned long long)s->opens_waiting);
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
  return 0;
}

int render_clients(ctl *c, gpupool__rep *rep, const char *arg) {
  const Gpupool__Wire__AdminClientsReply *r = rep->admin_clients;
  table t;

  (void)arg;
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

/* An AdminBuffers reply's buffers sorted by id (allocation order). */
static void sort_buffers(gpupool__rep *rep) {
  qsort(rep->admin_buffers->buffers, rep->admin_buffers->n_buffers, sizeof(*rep->admin_buffers->buffers), cmp_by_id);
}

/* `buffers`: every live buffer, sorted by id (allocation order), with all its names. */
int render_buffers(ctl *c, gpupool__rep *rep, const char *arg) {
  Gpupool__Wire__AdminBuffersReply *r = rep->admin_buffers;
  Gpupool__Wire__BufferInfo **v = r->buffers;
  size_t n = r->n_buffers;
  table t;

  (void)arg;
  sort_buffers(rep);

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
  return 0;
}

/* `names`: every published name of every tenant, sorted by key, one row per name (a buffer
 * published under three names is three rows): buffers with their id, pool and holders,
 * bundles with their version and member count, files with their path. The buffers' rows come
 * from a second request, AdminBuffers. */
int render_names(ctl *c, gpupool__rep *names, const char *arg) {
  gpupool__rep *bufs;
  Gpupool__Wire__NameInfo **v;
  size_t n;
  table t;
  int rc;

  (void)arg;
  if ((rc = ctl_admin_buffers(c, &bufs)) != 0)
    return rc;
  sort_buffers(bufs);
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
  return 0;
}

/* `peers`: the configured peers, how each stands, and what was fetched from and served to it. */
int render_peers(ctl *c, gpupool__rep *rep, const char *arg) {
  const Gpupool__Wire__AdminPeersReply *r = rep->admin_peers;
  table t;

  (void)c;
  (void)arg;
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
  return 0;
}

/* `unpublish KEY`: the name under KEY is gone. */
int render_unpublish(ctl *c, gpupool__rep *rep, const char *key) {
  (void)rep;
  if (c->json)
    printf("{\"unpublished\":\"%s\"}\n", key);
  else
    printf("unpublished %s\n", key);
  return 0;
}

/* `drop-client PID`: how many connections of PID were dropped; none is a failure. */
int render_drop(ctl *c, gpupool__rep *rep, const char *arg) {
  long pid = strtol(arg, NULL, 10); /* checked by the request */
  uint32_t dropped = rep->admin_drop_client->dropped;
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

int render_trim(ctl *c, gpupool__rep *rep, const char *arg) {
  (void)arg;
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
  return 0;
}
