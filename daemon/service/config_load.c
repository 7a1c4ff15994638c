/*
 * Reading the configuration: a file (its sections through one table, section_row, as its
 * keys go through gpd_config_keys), --pool specs, and the final checks of what was read
 * (gpd_config_finish). Every error is told, not only the first (--check-config lists them),
 * and names the file and line or the --pool spec, and what to write.
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "config.h"
#include "config_internal.h"
#include "errors.h"
#include "log.h"

/* The [tenant NAME] or [group NAME] section of that name, added when new. */
static gpd_member_set *find_or_add_set(gpd_member_set *sets, int *n, const char *name) {
  for (int i = 0; i < *n; i++)
    if (!strcmp(sets[i].name, name))
      return &sets[i];
  if (*n >= GPUPOOL_MAX_SETS)
    return NULL;
  memset(&sets[*n], 0, sizeof sets[*n]);
  snprintf(sets[*n].name, sizeof sets[*n].name, "%s", name);
  return &sets[(*n)++];
}

/* A [peer] or [tenant]/[group] name: [A-Za-z0-9_-]{1,32}. */
static int peer_name_ok(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n > 32)
    return 0;
  for (size_t i = 0; i < n; i++)
    if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-')
      return 0;
  return 1;
}

static gpupool__pool_config *find_or_add_pool(gpd_config *c, const char *name) {
  for (int i = 0; i < c->n_pools; i++)
    if (!strcmp(c->pools[i].name, name))
      return &c->pools[i];
  if (c->n_pools >= GPUPOOL_MAX_POOLS)
    return NULL;
  gpupool__pool_config_init(&c->pools[c->n_pools]);
  snprintf(c->pools[c->n_pools].name, sizeof c->pools[0].name, "%s", name);
  return &c->pools[c->n_pools++];
}

/* Cut an inline comment: a '#' at the start or after whitespace. A '#' inside a word (a path
 * like /run/a#b) stays part of the value. */
static void cut_comment(char *s) {
  for (char *p = s; *p; p++)
    if (*p == '#' && (p == s || isspace((unsigned char)p[-1]))) {
      *p = '\0';
      return;
    }
}

static char *trim(char *s) {
  char *e;
  while (isspace((unsigned char)*s))
    s++;
  e = s + strlen(s);
  while (e > s && isspace((unsigned char)e[-1]))
    *--e = '\0';
  return s;
}

/* Opens path for reading only if it is a regular file. Opened non-blocking first so that a FIFO
 * with no writer cannot hold the daemon at start-up, and checked with fstat on the open fd (not
 * stat on the name) so the file read is the file checked; a directory would read as empty. */
static int open_regular(const char *path, FILE **out) {
  struct stat st;
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC), flags;
  FILE *f;

  if (fd < 0)
    return gpupool__err(GPUPOOL_ECONFIG, "cannot open config file %s: %s", path, strerror(errno));
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return gpupool__err(GPUPOOL_ECONFIG, "cannot stat config file %s: %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return gpupool__err(GPUPOOL_ECONFIG, "config file %s is %s, not a regular file; give the path of the file itself",
                        path,
                        S_ISDIR(st.st_mode)    ? "a directory"
                        : S_ISFIFO(st.st_mode) ? "a FIFO"
                        : S_ISSOCK(st.st_mode) ? "a socket"
                        : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                                                       : "not a file");
  }
  if ((flags = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 || !(f = fdopen(fd, "r"))) {
    int e = errno;
    close(fd);
    return gpupool__err(GPUPOOL_ECONFIG, "cannot read config file %s: %s", path, strerror(e));
  }
  *out = f;
  return 0;
}

/* ---- errors: all of them, not only the first ---------------------------------------------- */

static FILE *report_to;
static int reported;

void gpd_config_report_errors(FILE *f) {
  report_to = f;
  reported = 0;
}

int gpd_config_errors_reported(void) { return reported; }

/* The errors of one pass over a file (or of gpd_config_finish): the first is what the caller
 * gets as the message; each goes to report_to as it is found. */
typedef struct {
  int n, code;
  char first[GPUPOOL__ERRMSG_MAX];
} errlist;

/* Records the error whose message gpupool__errmsg() holds; returns code. */
static int err_add(errlist *e, int code) {
  if (report_to) {
    fprintf(report_to, "gpupoold: %s\n", gpupool__errmsg());
    reported++;
  }
  if (e->n++ == 0) {
    e->code = code;
    snprintf(e->first, sizeof e->first, "%s", gpupool__errmsg());
  }
  return code;
}

/* 0, or the first error's code with its message and how many more there were. */
static int err_end(errlist *e) {
  if (e->n == 0)
    return 0;
  if (e->n == 1)
    return gpupool__err(e->code, "%s", e->first);
  return gpupool__err(e->code, "%s (and %d more error%s: gpupoold --check-config lists them all)", e->first,
                      e->n - 1, e->n == 2 ? "" : "s");
}

#define CONF_ERR(e, ...) err_add((e), gpupool__err(GPUPOOL_ECONFIG, __VA_ARGS__))

/* The pool keys whose line a message points at (gpd_config's pool_key_line). */
static const char *const line_keys[GPD_POOL_LINE_KEYS] = {"kind", "capacity", "slab_size", "alignment", "share"};

static int line_key_index(const char *key) {
  const gpd_config_key *row = gpd_config_key_find(GPUPOOL__CS_POOL, key);
  for (int i = 0; i < GPD_POOL_LINE_KEYS; i++)
    if (row && !strcmp(row->name, line_keys[i]))
      return i;
  return -1;
}

/* ---- reading a file: its sections through one table, as its keys ------------------------- */

/* A file being read: where, the errors so far, and the section its keys go to. */
typedef struct section_row section_row;
typedef struct {
  gpd_config *c;
  const char *path;
  int lineno;
  errlist errs;
  int daemon_line;              /* where [daemon] was, 0 before */
  const section_row *sec;       /* the open section; NULL before the first */
  int skip;                     /* after a refused header: its keys are skipped, not refused again */
  void *obj;                    /* what its keys set */
  gpupool__pool_config *pool;   /* a [pool]'s, for share and the keys' lines */
  char in[80];                  /* " in [...]" for an unknown key's message */
} reader;

/* The sections a file may hold: a row each, read as the keys' rows are. The header [WORD] or
 * [WORD NAME] opens the row whose word it starts with: open() finds or makes the object its
 * keys set (0), or tells why not (CONF_ERR, -1: its keys are then skipped); each key after
 * it is set through gpd_config_keys for the row's section, under the row's noun. */
struct section_row {
  const char *word;
  int named;       /* 0: the word alone ([daemon]); 1: a name follows; 2: a name may follow */
  unsigned section; /* GPUPOOL__CS_* of its keys */
  const char *noun; /* what an unknown key of it is called */
  int (*open)(reader *r, const char *name);
};

static int open_daemon(reader *r, const char *name) {
  (void)name;
  /* A second section of one name would be merged silently, its keys overriding the first's. */
  if (r->daemon_line) {
    CONF_ERR(&r->errs, "%s:%d: [daemon] repeats the section at %s:%d; keep one [daemon] section", r->path,
             r->lineno, r->path, r->daemon_line);
    return -1;
  }
  r->daemon_line = r->lineno;
  r->obj = r->c;
  snprintf(r->in, sizeof r->in, " in [daemon]");
  return 0;
}

static int open_set(reader *r, const char *name) {
  int is_tenant = r->sec->section == GPUPOOL__CS_TENANT;
  const char *what = is_tenant ? "tenant" : "group";
  gpd_member_set *m;
  if (!*name || strlen(name) >= sizeof m->name || strpbrk(name, "/: ")) {
    CONF_ERR(&r->errs, "%s:%d: [%s NAME] needs a name of 1 to %zu characters without '/', ':' or spaces", r->path,
             r->lineno, what, sizeof m->name - 1);
    return -1;
  }
  m = is_tenant ? find_or_add_set(r->c->tenants, &r->c->n_tenants, name)
                : find_or_add_set(r->c->groups, &r->c->n_groups, name);
  if (!m) {
    CONF_ERR(&r->errs, "%s:%d: more than %d [%s] sections", r->path, r->lineno, GPUPOOL_MAX_SETS, what);
    return -1;
  }
  if (m->line) {
    CONF_ERR(&r->errs, "%s:%d: [%s %s] repeats the section at %s:%d; keep one section per name", r->path, r->lineno,
             what, name, r->path, m->line);
    return -1;
  }
  m->line = r->lineno;
  r->obj = m;
  snprintf(r->in, sizeof r->in, " in [%s]", m->name);
  return 0;
}

static int open_peer(reader *r, const char *name) {
  gpd_config *c = r->c;
  gpd_peer_conf *peer;
  if (!peer_name_ok(name)) {
    CONF_ERR(&r->errs, "%s:%d: [peer NAME] needs a name of 1 to 32 letters, digits, '_' or '-', not '%s'", r->path,
             r->lineno, name);
    return -1;
  }
  for (int i = 0; i < c->n_peers; i++)
    if (!strcmp(c->peers[i].name, name)) {
      CONF_ERR(&r->errs, "%s:%d: [peer %s] repeats the section at %s:%d; keep one section per peer", r->path,
               r->lineno, name, r->path, c->peers[i].line);
      return -1;
    }
  if (c->n_peers >= GPUPOOL_MAX_PEERS) {
    CONF_ERR(&r->errs, "%s:%d: more than %d [peer] sections", r->path, r->lineno, GPUPOOL_MAX_PEERS);
    return -1;
  }
  peer = &c->peers[c->n_peers++];
  memset(peer, 0, sizeof *peer);
  snprintf(peer->name, sizeof peer->name, "%s", name);
  peer->line = r->lineno;
  r->obj = peer;
  snprintf(r->in, sizeof r->in, " in [peer %s]", peer->name);
  return 0;
}

static int open_pool(reader *r, const char *name) {
  gpupool__pool_config *p;
  if (!*name)
    name = "default";
  if (strlen(name) >= sizeof p->name) {
    CONF_ERR(&r->errs, "%s:%d: pool name '%s' is too long", r->path, r->lineno, name);
    return -1;
  }
  if (!(p = find_or_add_pool(r->c, name))) {
    CONF_ERR(&r->errs, "%s:%d: more than %d pools", r->path, r->lineno, GPUPOOL_MAX_POOLS);
    return -1;
  }
  if (p->line) {
    CONF_ERR(&r->errs, "%s:%d: [pool %s] repeats the section at %s:%d; keep one section per pool", r->path,
             r->lineno, name, r->path, p->line);
    return -1;
  }
  p->line = r->lineno;
  r->obj = r->pool = p;
  r->in[0] = '\0';
  return 0;
}

static const section_row sections[] = {
    {"daemon", 0, GPUPOOL__CS_DAEMON, "key", open_daemon},
    {"tenant", 1, GPUPOOL__CS_TENANT, "key", open_set},
    {"group", 1, GPUPOOL__CS_GROUP, "key", open_set},
    {"peer", 1, GPUPOOL__CS_PEER, "key", open_peer},
    {"pool", 2, GPUPOOL__CS_POOL, "pool key", open_pool},
};

/* A section header (s without its brackets' line end checked): the row it opens, or none. */
static void section_header(reader *r, char *s) {
  char *end = strchr(s, ']');
  r->sec = NULL;
  r->obj = r->pool = NULL;
  r->skip = 1;
  if (!end || end[1] != '\0') {
    CONF_ERR(&r->errs, "%s:%d: malformed section header '%s' (write [daemon] or [pool NAME])", r->path, r->lineno, s);
    return;
  }
  *end = '\0';
  s = trim(s + 1);
  for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++) {
    const section_row *row = &sections[i];
    size_t n = strlen(row->word);
    if (strncmp(s, row->word, n))
      continue;
    if (row->named == 0 ? s[n] != '\0'
        : row->named == 1 ? !isspace((unsigned char)s[n])
                          : s[n] != '\0' && !isspace((unsigned char)s[n]))
      continue;
    r->sec = row;
    if (row->open(r, trim(s + n)) != 0) {
      r->sec = NULL;
      return;
    }
    r->skip = 0;
    return;
  }
  CONF_ERR(&r->errs, "%s:%d: unknown section [%s] (use [daemon], [pool NAME], [tenant NAME], [group NAME] or "
           "[peer NAME])", r->path, r->lineno, s);
}

/* A key = value line of the open section. */
static void section_key(reader *r, char *s) {
  char *eq = strchr(s, '='), *k, *v, msg[GPUPOOL__ERRMSG_MAX];
  gpd_config *c = r->c;
  if (!eq) {
    CONF_ERR(&r->errs, "%s:%d: expected 'key = value', got '%s'", r->path, r->lineno, s);
    return;
  }
  if (r->skip)
    return;
  *eq = '\0';
  k = trim(s);
  v = trim(eq + 1);
  if (!r->sec) {
    CONF_ERR(&r->errs, "%s:%d: key '%s' outside a section (put it under [daemon] or [pool NAME])", r->path,
             r->lineno, k);
    return;
  }
  if (r->pool && !strcmp(k, "share")) {
    /* Resolved against the [group] sections by gpd_config_finish (they may come later). */
    int idx = (int)(r->pool - c->pools);
    if (gpd_config_copy_str(c->pool_share_name[idx], sizeof c->pool_share_name[idx], v) != 0)
      CONF_ERR(&r->errs, "%s:%d: group name '%s' is too long", r->path, r->lineno, v);
    else
      c->pool_key_line[idx][line_key_index(k)] = r->lineno;
    return;
  }
  if (gpd_config_set_key(r->obj, r->sec->section, k, v, r->sec->noun, r->in) != 0) {
    snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
    CONF_ERR(&r->errs, "%s:%d: %s", r->path, r->lineno, msg);
  } else if (r->pool && line_key_index(k) >= 0) {
    c->pool_key_line[r->pool - c->pools][line_key_index(k)] = r->lineno; /* the value in force */
  }
}

int gpd_config_load(gpd_config *c, const char *path) {
  FILE *f = NULL;
  char line[1024];
  reader r = {.c = c, .path = path};
  int rc;

  if ((rc = open_regular(path, &f)) != 0)
    return rc;
  snprintf(c->path, sizeof c->path, "%s", path);
  while (fgets(line, sizeof line, f)) {
    char *s;
    r.lineno++;
    if (!strchr(line, '\n') && !feof(f)) {
      /* The rest of the line would read as lines of its own: stop here. */
      CONF_ERR(&r.errs, "%s:%d: line longer than %zu bytes", path, r.lineno, sizeof line - 2);
      break;
    }
    s = trim(line);
    if (*s == ';')
      continue;
    cut_comment(s);
    s = trim(s);
    if (*s == '[')
      section_header(&r, s);
    else if (*s != '\0')
      section_key(&r, s);
  }
  fclose(f);
  return err_end(&r.errs);
}

int gpd_config_add_pool_spec(gpd_config *c, const char *spec) {
  char buf[512], *save = NULL, *tok, msg[GPUPOOL__ERRMSG_MAX];
  gpupool__pool_config p;

  if (strlen(spec) >= sizeof buf)
    return gpupool__err(GPUPOOL_ECONFIG, "--pool spec too long");
  if (c->n_pools >= GPUPOOL_MAX_POOLS)
    return gpupool__err(GPUPOOL_ECONFIG, "more than %d pools", GPUPOOL_MAX_POOLS);
  strcpy(buf, spec);
  gpupool__pool_config_init(&p);
  for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(tok, '=');
    if (!eq)
      return gpupool__err(GPUPOOL_ECONFIG, "--pool '%s': '%s' is not key=value", spec, tok);
    *eq = '\0';
    if (gpd_config_set_key(&p, GPUPOOL__CS_SPEC, trim(tok), trim(eq + 1), "pool key", "") != 0) {
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      return gpupool__err(GPUPOOL_ECONFIG, "--pool '%s': %s", spec, msg);
    }
  }
  if (!p.name[0])
    snprintf(p.name, sizeof p.name, "pool%d", c->n_pools);
  for (int i = 0; i < c->n_pools; i++)
    if (!strcmp(c->pools[i].name, p.name)) {
      c->pools[i] = p; /* the command line overrides the file */
      return 0;
    }
  c->pools[c->n_pools++] = p;
  return 0;
}

/* Where pool p was written, as a message prefix: "FILE:LINE: [pool NAME] " for a file's
 * section (LINE that of key when the file sets it, else the section's), "--pool NAME: " for a
 * command-line spec, "" for a backend's default pool. */
static void pool_where(const gpd_config *c, const gpupool__pool_config *p, const char *key, char *buf, size_t len) {
  int li = key ? line_key_index(key) : -1;
  int line = li >= 0 && c->pool_key_line[p - c->pools][li] ? c->pool_key_line[p - c->pools][li] : p->line;
  if (p->line > 0 && c->path[0])
    snprintf(buf, len, "%s:%d: [pool %s] ", c->path, line, p->name);
  else if (p->line == 0 && p->name[0])
    snprintf(buf, len, "--pool %s: ", p->name);
  else
    buf[0] = '\0';
}

/* The [peer] sections and export_peers against each other and the [group] sections. */
static void peers_check(const gpd_config *c, errlist *errs) {
  const char *path = c->path[0] ? c->path : "gpupoold.conf";
  for (int i = 0; i < c->n_peers; i++) {
    const gpd_peer_conf *p = &c->peers[i];
    if (!p->address[0])
      CONF_ERR(errs, "%s:%d: [peer %s] has no address; add address = ADDR:PORT (the "
                          "peer_listen of that gpupoold)", path, p->line, p->name);
    if (!p->secret_file[0] && !c->peer_secret_file[0])
      CONF_ERR(errs, "%s:%d: [peer %s] has no secret: set peer_secret_file in [daemon] or "
                          "secret_file here", path, p->line, p->name);
    for (int g = 0; g < c->n_groups; g++)
      if (!strcmp(c->groups[g].name, p->name))
        CONF_ERR(errs, "%s:%d: [peer %s] has the name of [group %s] at %s:%d (PEER:NAME and "
                            "group:NAME would read alike); rename one of them", path, p->line, p->name,
                            c->groups[g].name, path, c->groups[g].line);
    if (!strcmp(p->name, "group"))
      CONF_ERR(errs, "%s:%d: a peer cannot be named 'group' (group:NAME/... names a group's "
                          "names); rename it", path, p->line);
  }
  if (c->peer_listen[0] && !c->peer_secret_file[0])
    CONF_ERR(errs, "%s: peer_listen is set but peer_secret_file is not: peers authenticate "
                        "with that shared secret; set it in [daemon]", path);
  for (int t = 0; t < c->n_tenants + c->n_groups; t++) {
    const gpd_member_set *m = t < c->n_tenants ? &c->tenants[t] : &c->groups[t - c->n_tenants];
    char buf[sizeof m->export_peers], *save = NULL, *tok;
    snprintf(buf, sizeof buf, "%s", m->export_peers);
    for (tok = strtok_r(buf, ", \t", &save); tok; tok = strtok_r(NULL, ", \t", &save))
      if (strcmp(tok, "*") && !gpd_peer_find(c, tok))
        CONF_ERR(errs, "%s:%d: [%s %s] export_peers names '%s', which has no [peer %s] "
                            "section; add one (address, secret) or remove the name", path, m->line,
                            t < c->n_tenants ? "tenant" : "group", m->name, tok, tok);
  }
}

/* A [tenant] or [group] without uids = or gids = is valid but covers no user: whatever it
 * says (export_peers, a pool shared with it) applies to nobody. Said at every load (start,
 * reload, --check-config), not refused: a section may be emptied on purpose. */
static void warn_empty_sets(const gpd_config *c) {
  const char *path = c->path[0] ? c->path : "gpupoold.conf";
  for (int t = 0; t < c->n_tenants + c->n_groups; t++) {
    const gpd_member_set *m = t < c->n_tenants ? &c->tenants[t] : &c->groups[t - c->n_tenants];
    if (m->n_uids == 0 && m->n_gids == 0)
      GPUPOOL__WARN("%s:%d: [%s %s] has no uids = or gids = line: it covers no user, so %s applies to nobody "
                    "(the section's name is not a user's); list its members (uids = 1000, 1001 or gids = 990) "
                    "or remove the section", path, m->line, t < c->n_tenants ? "tenant" : "group", m->name,
                    t < c->n_tenants ? "what it sets (export_peers, one namespace and budget)"
                                     : "what it shares (its pools, group:NAME/ names, export_peers)");
  }
}

int gpd_config_finish(gpd_config *c, const gpupool__backend_desc *backend) {
  char where[512], msg[GPUPOOL__ERRMSG_MAX];
  int rc, defaults = c->n_pools == 0;
  errlist errs = {0};
  warn_empty_sets(c);
  peers_check(c, &errs);
  for (int i = 0; i < GPUPOOL_MAX_POOLS; i++) {
    c->pool_share[i] = -1;
    if (i >= c->n_pools || !c->pool_share_name[i][0])
      continue;
    for (int g = 0; g < c->n_groups; g++)
      if (!strcmp(c->groups[g].name, c->pool_share_name[i]))
        c->pool_share[i] = g;
    if (c->pool_share[i] < 0) {
      pool_where(c, &c->pools[i], "share", where, sizeof where);
      CONF_ERR(&errs, "%spool '%s' is shared with group '%s', which has no [group %s] section", where,
               c->pools[i].name, c->pool_share_name[i], c->pool_share_name[i]);
    }
  }
  if (defaults && (rc = backend->default_pools(c->pools, GPUPOOL_MAX_POOLS, &c->n_pools)) != 0) {
    err_add(&errs, rc);
    return err_end(&errs);
  }
  for (int i = 0; i < c->n_pools; i++) {
    const char *key = NULL;
    if ((rc = gpupool__backend_pool_finish(backend, &c->pools[i], &key)) != 0) {
      if (defaults) {
        err_add(&errs, rc);
        continue;
      }
      /* The backend's check knows the pool and the key, not where they were written: add
       * the file and the key's own line. */
      snprintf(msg, sizeof msg, "%s", gpupool__errmsg());
      pool_where(c, &c->pools[i], key, where, sizeof where);
      err_add(&errs, gpupool__err(rc, "%s%s", where, msg));
    }
  }
  return err_end(&errs);
}
