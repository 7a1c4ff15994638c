/*
 * The registry's state across a crash, a restart or an upgrade of the daemon (state.h).
 *
 * Where it lives: every slab's memfd goes to the fd store when the slab is made
 * ("gpd.slab.<id>") and leaves it when the slab is given back; every lease's read end the same
 * way ("gpd.lease.<id>"). The registry's tables are written, whole, into a new sealed memfd
 * ("gpd.state.<generation>"); only once it is complete and sealed is it put in the store, and
 * only then are the previous generation and its deltas taken out. Between whole states, what
 * changed is written as deltas: small sealed memfds of their own ("gpd.delta.<the generation
 * they follow>", the sequence number in the header), each with the records of what the
 * journal names (names changed with the buffers, slabs and layouts they refer to, buffers and
 * slabs made, the lease records of clients whose holds or mappings changed, a closing
 * connection's pins) and the ids of what is gone, so that a write costs what changed, not the
 * size of the state. A change of names is written before its reply (gpd_state_sync), the
 * others at the end of the loop turn, at most every 100 ms; a whole state (a compaction) is
 * written when the deltas pass their bounds, after a while with nothing to write, and first
 * after a start. A crash at any instruction therefore leaves the previous generation, the
 * new one, or both, and each delta whole or not at all (the next daemon takes the newest
 * state that checks out, then its deltas in sequence up to the first missing or unsound
 * one): never half of one change.
 *
 * The format (GPD_STATE_FORMAT): a fixed header (magic, format, generation, payload length,
 * checksum of the payload; a delta's sequence) and the payload, a sequence of records in this
 * machine's byte order (the store never leaves the machine). A delta's records each carry an
 * op: a put replaces the record of its key (id, or a name's key), a delete removes it; they are
 * merged into the state's records before the restore reads them. Everything read is checked
 * before use: counts against the bytes left, ids against what was restored before, ranges
 * against their slab, fds against what a slab must be (backend slab_adopt). A piece that does
 * not check out is discarded with what depends on it (a name whose buffer is gone is lost; the
 * rest is kept) and the reason goes to the log.
 *
 * Test hooks: GPUPOOL_TEST_STATE_CRASH=STEP:FILE kills the daemon (SIGKILL, as a crash) at
 * step STEP of the first write that finds FILE (removed first, so it happens once across
 * restarts). A whole state: 1: memfd half written, 2: written, not sealed, 3: sealed, not in
 * the store, 4: in the store, the previous generation not yet removed; a delta: 5 to 8 the
 * same (8: in the store, its reply not yet sent); a compaction: 9: the new state in the store,
 * the previous one's deltas taken out, the previous state not yet. GPUPOOL_TEST_STATE_FORMAT=N
 * writes the state in format N (a state from a newer daemon, for the refusal's test).
 * GPUPOOL_TEST_STATE_DELTAS=N: at most N deltas on a state (0: every write is whole).
 * GPUPOOL_TEST_STATE_EVERY_MS=N: whole states for other changes at most every N ms (100).
 * GPUPOOL_TEST_STATE_DELTA=damage:N:FILE (drop:N:FILE): the Nth delta written while FILE exists
 * gets a wrong checksum (is left out of the store), and FILE is removed.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "errors.h"
#include "gpupool/version.h"
#include "log.h"
#include "registry_internal.h"
#include "sd.h"
#include "sha256.h"
#include "state.h"

#define MAGIC "GPDSTATE"
#define DELTA_MAGIC "GPDDELTA"
/* magic 8, format 4, header length 4, generation 8, payload 8, checksum 8, then 0s (a delta:
 * its sequence 8 at 40, the generation is that of the state it follows) */
#define HEADER_LEN 64
#define STATE_MAX ((uint64_t)1 << 31)
/* The most deltas on one state (fewer in a small store: an eighth of its entries). */
#define MAX_DELTAS 1024
/* Deltas are compacted once their bytes pass half the whole state's, or this much for a small
 * one: a restore reads both. */
#define DELTA_BYTES_MIN (64 * 1024)
#define STATE_PREFIX_LEN (sizeof GPD_SD_STORE_PREFIX "state." - 1)

typedef struct gpd_state gpd_state;
struct gpd_state {
  gpd_registry *reg;
  gpd_state_info info;
  uv_check_t check;
  int check_on;
  uint64_t generation;   /* of the last state in the store, 0: none */
  uint64_t nstored;      /* entries this daemon has in the store */
  int full_warned;
  uint64_t last[8];      /* what the last write saw (changes since: write again) */
  uint64_t synced;       /* reg->state_changes the last write saw */
  long crash_step;
  char crash_file[256];
  uint32_t format;       /* written (GPD_STATE_FORMAT, unless a test says otherwise) */
  uint8_t *buf;          /* the payload being built */
  size_t len, cap;
  int oom;
  uint64_t ndiscards;
  /* The leases of the previous daemon's clients, one reference each, until they are gone.
   * While any is there, the slabs restored take no new buffers: a client may map a range the
   * state did not record it holding (it got it in the moment before the crash), and ranges are
   * handed out again only once no process of before can touch them. */
  struct before {
    gpd_lease *l;
    uint64_t *pins;    /* the buffers its connection held (bit 63: read-only), to give back */
    uint32_t npins;
    int resumed;       /* given back to a new connection already */
  } *before;
  uint32_t nbefore, capbefore;
  int frozen;
  uint64_t last_write_ns;
  uv_timer_t later;      /* a write held back by the rate limit */
  uv_timer_t idle;       /* deltas compacted after 10 write intervals with nothing to write */
  int later_on;
  int handles;           /* open uv handles (closed by gpd_state_stop) */
  /* Deltas: what changed since the last write that the next delta carries (names by key, ids
   * of what is gone), how many deltas the store has on top of `generation` and their bytes. */
  struct jent {
    uint32_t op;         /* OP_NAME (key), OP_CLIENT, OP_SLAB, OP_BUFFER (id: written as they are
                          * then), OP_LEASE (blob: its record), OP_*_DEL (id) */
    uint64_t id;
    char *key;
    uint8_t *blob;
    size_t blen;
  } *journal;
  uint64_t mark;         /* moves at each write: what carries an older mark is not named yet */
  uint32_t njournal, capjournal;
  size_t journal_bytes;  /* of its records taken ahead (closing connections') */
  int need_whole;        /* the next write is a whole state (journal overflowed, a write failed) */
  uint64_t seq, delta_bytes, whole_bytes, max_deltas;
  uint64_t every_ns;     /* whole states for other changes at most this often (WRITE_EVERY_NS) */
  long damage_seq;       /* GPUPOOL_TEST_STATE_DELTA: the Nth delta while the file exists */
  long damage_seen;      /* deltas written while it existed */
  int damage_drop, damage_now;
  char damage_file[256];
};

/* A checksum of the payload: 8 bytes at a time in four lanes (multiply, rotate), fast enough to
 * run before every reply that follows a publish. It finds what a crash or damage leaves (a cut
 * or changed state), not what an adversary makes: only the daemon writes to the store. */
static uint64_t rotl(uint64_t v, int r) { return (v << r) | (v >> (64 - r)); }
static uint64_t checksum(const uint8_t *p, size_t n) {
  const uint64_t k1 = 0x9e3779b185ebca87ull, k2 = 0xc2b2ae3d27d4eb4full;
  uint64_t v[4] = {k1 + k2, k2, 0, (uint64_t)0 - k1}, h;
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; l++) {
      uint64_t w;
      memcpy(&w, p + i + 8 * l, 8);
      v[l] = rotl(v[l] + w * k2, 31) * k1;
    }
  h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18) + (uint64_t)n;
  for (; i < n; i++)
    h = rotl(h ^ (p[i] * k1), 11) * k2;
  h ^= h >> 33;
  h *= k2;
  h ^= h >> 29;
  return h;
}

/* ---- the store ------------------------------------------------------------------------- */

/* Put fd in the store as GPD_SD_STORE_PREFIX what (e.g. "slab.7"). */
static int store_put_as(gpd_state *st, const char *what, int fd) {
  char msg[128];
  if (st->nstored >= st->info.store_max) {
    if (!st->full_warned)
      GPUPOOL__WARN("the fd store is full (%" PRIu64 " entries): slabs and leases made from now on are not kept "
                    "across a restart; raise FileDescriptorStoreMax= and GPUPOOL_FDSTORE together (or "
                    "gpupoold --supervise's store) if more must survive", st->info.store_max);
    st->full_warned = 1;
    return -1;
  }
  snprintf(msg, sizeof msg, "FDSTORE=1\nFDNAME=" GPD_SD_STORE_PREFIX "%s", what);
  if (gpd_sd_notify_fd(msg, fd) != 0) {
    GPUPOOL__WARN("cannot put %s in the fd store: %s; it does not survive a restart", what, gpupool__errmsg());
    return -1;
  }
  st->nstored++;
  return 0;
}

static int store_put(gpd_state *st, const char *kind, uint64_t id, int fd) {
  char what[64];
  snprintf(what, sizeof what, "%s.%" PRIu64, kind, id);
  return store_put_as(st, what, fd);
}

static void store_remove_as(gpd_state *st, const char *what) {
  char msg[128];
  snprintf(msg, sizeof msg, "FDSTOREREMOVE=1\nFDNAME=" GPD_SD_STORE_PREFIX "%s", what);
  (void)gpd_sd_notify(msg);
  if (st->nstored)
    st->nstored--;
}

static void store_remove(gpd_state *st, const char *kind, uint64_t id) {
  char what[64];
  snprintf(what, sizeof what, "%s.%" PRIu64, kind, id);
  store_remove_as(st, what);
}

/* The name in the store of every delta that follows state gen: "delta.<gen>" (its sequence is
 * in its header). One name for all of them, so that one message takes them all out. */
static void delta_name(char *buf, size_t len, uint64_t gen) { snprintf(buf, len, "delta.%" PRIu64, gen); }

/* ---- the journal: what the next delta carries ------------------------------------------- */

static void journal_add_blob(gpd_state *st, uint32_t op, uint64_t id, const char *key, uint8_t *blob,
                             size_t blen);
static void journal_add(gpd_state *st, uint32_t op, uint64_t id, const char *key) {
  journal_add_blob(st, op, id, key, NULL, 0);
}

/* A delta's records: each an op, then a record as the whole state writes it (a put: it
 * replaces any record of that key) or its key alone (a delete). */
enum {
  OP_SLAB = 1, OP_SLAB_DEL, OP_LAYOUT, OP_LAYOUT_DEL, OP_BUFFER, OP_BUFFER_DEL, OP_NAME, OP_NAME_DEL,
  OP_LEASE, OP_LEASE_DEL, OP_KEEP, OP_KEEP_DEL, /* (format 3) */
  OP_CLIENT = 100 /* (the journal's own: a client whose lease record is written as it is then) */
};

/* The most entries between two writes (each a few bytes, a key at most GPUPOOL_NAME_KEY_MAX),
 * and the most bytes of records taken ahead: past either the next write is a whole state,
 * whatever changed. */
#define JOURNAL_MAX 4096
#define JOURNAL_BYTES_MAX (4u << 20)

static void journal_clear(gpd_state *st) {
  for (uint32_t i = 0; i < st->njournal; i++) {
    free(st->journal[i].key);
    free(st->journal[i].blob);
  }
  st->njournal = 0;
  st->journal_bytes = 0;
  st->mark++;
}

static void journal_add_blob(gpd_state *st, uint32_t op, uint64_t id, const char *key, uint8_t *blob,
                             size_t blen) {
  struct jent *e;
  if (st->need_whole) {
    free(blob);
    return; /* (a whole state carries it) */
  }
  if (st->njournal >= JOURNAL_MAX || st->journal_bytes + blen > JOURNAL_BYTES_MAX ||
      gpd_grow((void **)&st->journal, &st->capjournal, st->njournal + 1, sizeof *st->journal) != 0) {
    free(blob);
    journal_clear(st);
    st->need_whole = 1;
    return;
  }
  e = &st->journal[st->njournal];
  e->op = op;
  e->id = id;
  e->key = NULL;
  e->blob = blob;
  e->blen = blen;
  st->journal_bytes += blen;
  if (key && !(e->key = strdup(key))) {
    free(blob);
    journal_clear(st);
    st->need_whole = 1;
    return;
  }
  st->njournal++;
}

static void keep_slab_new(gpd_registry *reg, gpd_slab *s) {
  gpd_state *st = reg->state;
  if (!st || s->stored || s->bs.fd < 0)
    return;
  s->stored = store_put(st, "slab", s->id, s->bs.fd) == 0;
  if (s->stored)
    journal_add(st, OP_SLAB, s->id, NULL);
}

static void keep_slab_gone(gpd_registry *reg, gpd_slab *s) {
  gpd_state *st = reg->state;
  if (!st || !s->stored || reg->stopped)
    return; /* a stopping daemon leaves its slabs to the next one */
  store_remove(st, "slab", s->id);
  s->stored = 0;
  journal_add(st, OP_SLAB_DEL, s->id, NULL);
}

static void keep_lease_new(gpd_registry *reg, gpd_lease *l) {
  gpd_state *st = reg->state;
  if (!st || l->store_id)
    return;
  l->store_id = gpd_next_id(reg);
  arc4random_buf(l->resume, sizeof l->resume);
  if (store_put(st, "lease", l->store_id, l->fd) != 0)
    l->store_id = 0;
}

static void keep_lease_gone(gpd_registry *reg, gpd_lease *l) {
  if (!reg->state || !l->store_id || reg->stopped)
    return;
  store_remove(reg->state, "lease", l->store_id);
  journal_add(reg->state, OP_LEASE_DEL, l->store_id, NULL);
  l->store_id = 0;
}

static void keep_name_changed(gpd_registry *reg, const char *key) {
  if (reg->state)
    journal_add(reg->state, OP_NAME, 0, key);
}

static void keep_buffer_gone(gpd_registry *reg, uint64_t id) {
  if (reg->state)
    journal_add(reg->state, OP_BUFFER_DEL, id, NULL);
}

static void keep_layout_gone(gpd_registry *reg, uint64_t id) {
  if (reg->state)
    journal_add(reg->state, OP_LAYOUT_DEL, id, NULL);
}

static void keep_buffer_changed(gpd_registry *reg, gpd_buffer *b) {
  if (reg->state)
    journal_add(reg->state, OP_BUFFER, b->id, NULL);
}

static void keep_client_changed(gpd_registry *reg, gpd_client *c) {
  gpd_state *st = reg->state;
  if (!st || !c->lease || !c->lease->store_id || c->state_mark == st->mark + 1)
    return; /* (named once per write: its record is taken as it is then) */
  c->state_mark = st->mark + 1;
  journal_add(st, OP_CLIENT, c->id, NULL);
}

static void put_client_lease(gpd_state *st, const gpd_client *c, int closing);

/* A connection closing while its lease pins what it held and mapped: its record, taken now
 * (before its holds go), is what the next delta says of that lease. */
static void keep_client_gone(gpd_registry *reg, gpd_client *c, gpd_lease *lease, int waiting) {
  gpd_state *st = reg->state;
  gpd_lease *had = c->lease;
  uint8_t *blob;
  if (!st || !lease->store_id || !waiting || st->need_whole)
    return;
  c->lease = lease; /* (put_client_lease reads it there) */
  st->len = 0;
  st->oom = 0;
  put_client_lease(st, c, 1);
  c->lease = had;
  if (st->oom || !(blob = malloc(st->len))) {
    journal_clear(st);
    st->need_whole = 1;
    return;
  }
  memcpy(blob, st->buf, st->len);
  journal_add_blob(st, OP_LEASE, lease->store_id, NULL, blob, st->len);
}

static void keep_share_kept(gpd_registry *reg, const gpd_keep *k) {
  if (reg->state && reg->state->format >= 3)
    journal_add(reg->state, OP_KEEP, k->id, NULL);
}

static void keep_share_gone(gpd_registry *reg, uint64_t id) {
  if (reg->state && reg->state->format >= 3)
    journal_add(reg->state, OP_KEEP_DEL, id, NULL);
}

/* How the registry's files report to the state (reg->keep) without calling up into it. */
static const struct gpd_keep_ops keep_ops = {
    keep_slab_new,    keep_slab_gone,      keep_lease_new,      keep_lease_gone, keep_name_changed,
    keep_buffer_gone, keep_layout_gone,    keep_buffer_changed, keep_client_changed, keep_client_gone,
    keep_share_kept,  keep_share_gone};

/* ---- writing --------------------------------------------------------------------------- */

static void put(gpd_state *st, const void *p, size_t n) {
  if (st->oom)
    return;
  if (st->len + n > st->cap) {
    size_t cap = st->cap ? st->cap : 4096;
    uint8_t *b;
    while (cap < st->len + n)
      cap *= 2;
    if (!(b = realloc(st->buf, cap))) {
      st->oom = 1;
      return;
    }
    st->buf = b;
    st->cap = cap;
  }
  memcpy(st->buf + st->len, p, n);
  st->len += n;
}

static void put64(gpd_state *st, uint64_t v) { put(st, &v, sizeof v); }
/* A count written before what it counts: its place is kept (count_at), then filled in. */
static size_t count_at(gpd_state *st) {
  size_t at = st->len;
  put64(st, 0);
  return at;
}
static void count_set(gpd_state *st, size_t at, uint64_t n) {
  if (!st->oom)
    memcpy(st->buf + at, &n, sizeof n);
}
static void put32(gpd_state *st, uint32_t v) { put(st, &v, sizeof v); }
static void put_str(gpd_state *st, const char *s) {
  uint32_t n = (uint32_t)strlen(s);
  put32(st, n);
  put(st, s, n);
}
static void put_meta(gpd_state *st, int has, const gpupool_tensor_meta *m) {
  put32(st, has ? 1 : 0);
  if (has)
    put(st, m, sizeof *m);
}

/* The lease record of l: its fd's name in the store, who, and then its pins. */
static void put_lease(gpd_state *st, const gpd_lease *l) {
  put64(st, l->store_id);
  put32(st, (uint32_t)l->uid);
  put64(st, l->tenant);
  put32(st, (uint32_t)l->pid);
  put(st, l->resume, sizeof l->resume);
}

/* A pinned buffer: its id, bit 63 set for a read-only hold (ids stay below 2^63). */
#define PIN_RO ((uint64_t)1 << 63)

static void put_slab(gpd_state *st, const gpd_slab *s) {
  put64(st, s->id);
  put_str(st, s->pool->cfg.name);
  put64(st, s->bs.size);
  put64(st, s->owner);
  put32(st, (uint32_t)s->dedicated);
  put32(st, (uint32_t)s->kept);
}

static void put_layout(gpd_state *st, const gpd_layout *l) {
  put64(st, l->id);
  put64(st, l->tenant);
  put32(st, l->nbufs);
  put32(st, l->n);
  for (uint32_t k = 0; k < l->n; k++) {
    put_str(st, l->members[k].name);
    put32(st, l->members[k].buffer);
    put64(st, l->members[k].offset);
    put64(st, l->members[k].size);
    put_meta(st, l->members[k].meta != NULL, l->members[k].meta);
  }
}

static void put_buffer(gpd_state *st, const gpd_buffer *p) {
  put64(st, p->id);
  put64(st, p->slab->id);
  put64(st, p->offset);
  put64(st, p->size);
  put64(st, p->asked);
  put(st, p->secret, sizeof p->secret);
  put(st, p->secret_ro, sizeof p->secret_ro);
  put_meta(st, p->has_meta, &p->meta);
  put32(st, (uint32_t)p->owner_uid);
  put64(st, p->owner_tenant);
  put64(st, p->layout ? p->layout->id : 0);
  put32(st, (uint32_t)p->died_in_use);
}

/* Whether nm goes into the state (published files do not: their fds are not in the store). */
static int name_kept(const gpd_name *nm) { return nm && !nm->file && nm->nbufs > 0; }

static void put_name(gpd_state *st, const gpd_name *nm) {
  put_str(st, nm->name);
  put64(st, nm->version);
  put32(st, nm->nbufs);
  for (uint32_t k = 0; k < nm->nbufs; k++)
    put64(st, nm->bufs[k]->id);
  put64(st, nm->layout ? nm->layout->id : 0);
  put32(st, (uint32_t)nm->uid);
  put64(st, nm->tenant);
  put32(st, (uint32_t)nm->read_only);
  put_meta(st, nm->has_meta, &nm->meta);
}

/* Whether connected client c's lease goes into the state: it holds or maps something. */
static int client_pins(const gpd_client *c) {
  return c->lease && c->lease->store_id && (c->holds || c->mapped.len > 0);
}

/* The lease record of a connected client: its holds and the slabs it maps (all read-only when
 * its connection is closing: how it held them is not known any more once it has gone). */
static void put_client_lease(gpd_state *st, const gpd_client *c, int closing) {
  put_lease(st, c->lease);
  put64(st, c->nholds);
  for (gpd_hold *h = c->holds; h; h = h->next)
    put64(st, h->buf->id | (h->read_only || closing ? PIN_RO : 0));
  put64(st, c->mapped.len);
  for (size_t k = 0; k < c->mapped.cap; k++)
    if (gpupool__hmap_slot_used(&c->mapped, k))
      put64(st, c->mapped.slots[k].ikey);
}

/* A kept share: its token's id and secret, its buffer, kind, tenant and expiry (CLOCK_MONOTONIC,
 * which a restart on the same boot keeps counting; the store does not outlive a reboot). */
static void put_keep(gpd_state *st, const gpd_keep *k) {
  put64(st, k->id);
  put64(st, k->buf->id);
  put(st, k->secret, sizeof k->secret);
  put32(st, (uint32_t)k->read_only);
  put64(st, k->tenant);
  put64(st, k->expires_ns);
}

static void build(gpd_state *st) {
  gpd_registry *reg = st->reg;
  uint64_t n;
  size_t at;

  st->len = 0;
  st->oom = 0;
  put64(st, reg->next_id);
  /* Slabs (those in the store; the rest cannot come back). */
  at = count_at(st);
  n = 0;
  for (int i = 0; i < reg->npools; i++)
    for (gpd_slab *s = reg->pools[i].slabs; s; s = s->next) {
      if (!s->stored)
        continue;
      put_slab(st, s);
      n++;
    }
  count_set(st, at, n);
  /* Layouts. */
  put64(st, reg->layouts.len);
  for (size_t i = 0; i < reg->layouts.cap; i++)
    if (gpupool__hmap_slot_used(&reg->layouts, i))
      put_layout(st, reg->layouts.slots[i].val);
  /* Buffers: live ones, then those waiting to be freed. */
  at = count_at(st);
  n = 0;
  for (size_t i = 0; i < reg->buffers.cap + 1; i++) {
    gpd_buffer *b;
    if (i < reg->buffers.cap) {
      if (!gpupool__hmap_slot_used(&reg->buffers, i))
        continue;
      b = reg->buffers.slots[i].val;
    } else {
      b = NULL;
    }
    for (gpd_buffer *p = b ? b : reg->pending; p; p = b ? NULL : p->pending_next) {
      put_buffer(st, p);
      n++;
    }
  }
  count_set(st, at, n);
  at = count_at(st);
  n = 0;
  for (size_t i = 0; i < reg->names.cap; i++) {
    gpd_name *nm;
    if (!gpupool__smap_slot_used(&reg->names, i))
      continue;
    nm = reg->names.slots[i].val;
    if (!name_kept(nm))
      continue;
    put_name(st, nm);
    n++;
  }
  count_set(st, at, n);
  /* Leases and what each pins: a connected client's holds and mapped slabs; a closed
   * connection's pins as the buffers and slabs record them. Kind 0: a buffer, 1: a slab. */
  at = count_at(st);
  n = 0;
  for (size_t i = 0; i < reg->clients.cap; i++) {
    gpd_client *c;
    if (!gpupool__hmap_slot_used(&reg->clients, i))
      continue;
    c = reg->clients.slots[i].val;
    if (!client_pins(c))
      continue;
    put_client_lease(st, c, 0);
    n++;
  }
  for (gpd_lease *l = reg->waiting; l; l = l->next) {
    uint64_t nb = 0, ns = 0;
    size_t at2;
    if (!l->store_id || l->gone)
      continue;
    put_lease(st, l);
    at2 = count_at(st);
    for (size_t i = 0; i < reg->buffers.cap + 1; i++) {
      gpd_buffer *b;
      if (i < reg->buffers.cap) {
        if (!gpupool__hmap_slot_used(&reg->buffers, i))
          continue;
        b = reg->buffers.slots[i].val;
      } else {
        b = NULL;
      }
      for (gpd_buffer *p = b ? b : reg->pending; p; p = b ? NULL : p->pending_next)
        for (uint32_t k = 0; k < p->nleases; k++)
          if (p->leases[k] == l) {
            put64(st, p->id | PIN_RO); /* (how it was held is not known any more: read-only) */
            nb++;
            break;
          }
    }
    count_set(st, at2, nb);
    at2 = count_at(st);
    for (int i = 0; i < reg->npools; i++)
      for (gpd_slab *s = reg->pools[i].slabs; s; s = s->next)
        for (uint32_t k = 0; k < s->nmappers; k++)
          if (s->mappers[k].lease == l) {
            put64(st, s->id);
            ns++;
            break;
          }
    count_set(st, at2, ns);
    n++;
  }
  count_set(st, at, n);
  /* Kept shares (format 3). */
  if (st->format >= 3) {
    at = count_at(st);
    n = 0;
    for (const gpd_keep *k = reg->keeps_head; k; k = k->next) {
      put_keep(st, k);
      n++;
    }
    count_set(st, at, n);
  }
}

static void maybe_crash(gpd_state *st, long step) {
  if (st->crash_step == step && st->crash_file[0] && unlink(st->crash_file) == 0) {
    GPUPOOL__WARN("GPUPOOL_TEST_STATE_CRASH: killing the daemon at step %ld of state write %" PRIu64, step,
                  step >= 5 && step <= 8 ? st->seq + 1 : st->generation + 1);
    raise(SIGKILL);
  }
}

static int write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

/* st->buf (the payload built) into a new sealed memfd with its header: the fd, or -1 (the
 * reason logged). seq 0: a whole state of generation gen; otherwise delta seq on top of gen.
 * step: the first of the four crash steps of this kind of write (1 or 5). */
static int write_memfd(gpd_state *st, uint64_t gen, uint64_t seq, long step) {
  uint8_t hdr[HEADER_LEN] = {0};
  uint32_t fmt = st->format, hl = HEADER_LEN;
  uint64_t plen = st->len, sum = checksum(st->buf, st->len);
  char name[64];
  int fd;

  memcpy(hdr, seq ? DELTA_MAGIC : MAGIC, 8);
  memcpy(hdr + 8, &fmt, 4);
  memcpy(hdr + 12, &hl, 4);
  memcpy(hdr + 16, &gen, 8);
  memcpy(hdr + 24, &plen, 8);
  if (seq && st->damage_now && !st->damage_drop) {
    GPUPOOL__WARN("GPUPOOL_TEST_STATE_DELTA: delta %" PRIu64 ".%" PRIu64 " is written damaged", gen, seq);
    sum ^= 1;
  }
  memcpy(hdr + 32, &sum, sizeof sum);
  memcpy(hdr + 40, &seq, 8);
  snprintf(name, sizeof name, seq ? "gpupool-delta-%" PRIu64 ".%" PRIu64 : "gpupool-state-%" PRIu64, gen, seq);
  fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    GPUPOOL__WARN("cannot write the daemon's state (memfd_create: %s); what the store has stays", strerror(errno));
    return -1;
  }
  if (write_all(fd, hdr, sizeof hdr) != 0 || write_all(fd, st->buf, st->len / 2) != 0)
    goto fail;
  maybe_crash(st, step);
  if (write_all(fd, st->buf + st->len / 2, st->len - st->len / 2) != 0)
    goto fail;
  maybe_crash(st, step + 1);
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0)
    goto fail;
  maybe_crash(st, step + 2);
  return fd;
fail:
  GPUPOOL__WARN("cannot write the daemon's state: %s; what the store has stays", strerror(errno));
  close(fd);
  return -1;
}

static void wrote(gpd_state *st, uint64_t t0, uint64_t bytes) {
  uint64_t dt = gpd_now_ns() - t0;
  st->info.writes++;
  st->info.write_ns_last = dt;
  st->info.write_bytes_last = bytes;
  if (dt > st->info.write_ns_max)
    st->info.write_ns_max = dt;
}

/* The whole state, as a new generation; once it is in the store the previous generation
 * and its deltas are taken out (a compaction when there were any). */
static int write_state(gpd_state *st) {
  uint64_t gen = st->generation + 1, t0 = gpd_now_ns(), ndeltas = st->seq;
  int fd;

  st->synced = st->reg->state_changes;
  build(st);
  if (st->oom) {
    GPUPOOL__WARN("out of memory writing the daemon's state; the previous one stays in the store");
    return -1;
  }
  if ((fd = write_memfd(st, gen, 0, 1)) < 0)
    return -1;
  if (store_put(st, "state", gen, fd) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  maybe_crash(st, 4);
  if (st->seq) {
    char what[64];
    delta_name(what, sizeof what, st->generation);
    store_remove_as(st, what);
    st->nstored = st->nstored > st->seq - 1 ? st->nstored - (st->seq - 1) : 0;
    maybe_crash(st, 9);
  }
  if (st->generation)
    store_remove(st, "state", st->generation);
  st->generation = gen;
  st->seq = 0;
  st->delta_bytes = 0;
  st->whole_bytes = HEADER_LEN + st->len;
  st->need_whole = 0;
  journal_clear(st);
  st->last_write_ns = gpd_now_ns();
  wrote(st, t0, HEADER_LEN + st->len);
  GPUPOOL__DEBUG("state %" PRIu64 " written: %zu bytes in %.3f ms%s", gen, HEADER_LEN + st->len,
                 st->info.write_ns_last / 1e6, ndeltas ? " (compacted: the deltas before it are dropped)" : "");
  if (ndeltas)
    st->info.compactions++;
  return 0;
}

/* A live or pending buffer by id, or NULL once freed. The pending ones (waiting for a holder's
 * done event or lease) are indexed in *pend the first time one is looked for (once a write). */
static const gpd_buffer *find_buffer(const gpd_registry *reg, uint64_t id, gpupool__hmap *pend, int *indexed) {
  const gpd_buffer *b = gpupool__hmap_get(&reg->buffers, id);
  if (b || !reg->pending)
    return b;
  if (!*indexed) {
    *indexed = 1;
    for (gpd_buffer *p = reg->pending; p; p = p->pending_next)
      if (gpupool__hmap_put(pend, p->id, p) != 0)
        return NULL; /* (out of memory: the caller writes a whole state) */
  }
  return gpupool__hmap_get(pend, id);
}

/* The slabs and layouts a delta being built has written already: each goes in once (a
 * bundle's layout is attached to every one of its buffers, and a layout can have 65,536
 * members). */
typedef struct {
  gpupool__hmap slabs, layouts;
} emitted;

/* Whether id is in m, adding it if not (out of memory: not, so it is written again). */
static int seen(gpupool__hmap *m, uint64_t id) {
  if (gpupool__hmap_get(m, id))
    return 1;
  (void)gpupool__hmap_put(m, id, (void *)1);
  return 0;
}

/* b's record in a delta, after those of its slab and layout unless the delta has them. */
static void put_buffer_with(gpd_state *st, const gpd_buffer *b, emitted *em) {
  if (b->slab->stored && !seen(&em->slabs, b->slab->id)) {
    put32(st, OP_SLAB);
    put_slab(st, b->slab);
  }
  if (b->layout && !seen(&em->layouts, b->layout->id)) {
    put32(st, OP_LAYOUT);
    put_layout(st, b->layout);
  }
  put32(st, OP_BUFFER);
  put_buffer(st, b);
}

/* What the journal names, as a delta's payload: every name changed with the records it
 * refers to (its buffers, their slabs and layouts: a put replaces what the store had), and
 * what is gone. Its size follows what changed, never the size of the state. */
static void build_delta(gpd_state *st) {
  gpd_registry *reg = st->reg;
  gpupool__hmap pend;
  emitted em;
  int indexed = 0;
  gpupool__hmap_init(&pend);
  gpupool__hmap_init(&em.slabs);
  gpupool__hmap_init(&em.layouts);
  st->len = 0;
  st->oom = 0;
  put64(st, reg->next_id);
  for (uint32_t i = 0; i < st->njournal; i++) {
    const struct jent *e = &st->journal[i];
    gpd_name *nm;
    if (e->op == OP_CLIENT) {
      gpd_client *c = gpupool__hmap_get(&reg->clients, e->id);
      if (!c || !c->lease || !c->lease->store_id)
        continue; /* (gone: what its closing left is in the journal after this) */
      if (client_pins(c)) {
        put32(st, OP_LEASE);
        put_client_lease(st, c, 0);
      } else {
        put32(st, OP_LEASE_DEL);
        put64(st, c->lease->store_id);
      }
      continue;
    }
    if (e->op == OP_LEASE) {
      put32(st, OP_LEASE);
      put(st, e->blob, e->blen);
      continue;
    }
    if (e->op == OP_BUFFER) {
      const gpd_buffer *b = find_buffer(reg, e->id, &pend, &indexed);
      if (b)
        put_buffer_with(st, b, &em);
      else if (indexed && pend.len < reg->npending)
        st->oom = 1;
      continue;
    }
    if (e->op == OP_KEEP) {
      const gpd_keep *k = gpupool__hmap_get(&reg->keeps, e->id);
      if (k) {
        put_buffer_with(st, k->buf, &em);
        put32(st, OP_KEEP);
        put_keep(st, k);
      } /* (else gone already: its OP_KEEP_DEL follows in the journal) */
      continue;
    }
    if (e->op == OP_SLAB) {
      const gpd_slab *sl = gpupool__hmap_get(&reg->slabs, e->id);
      if (sl && sl->stored && !seen(&em.slabs, sl->id)) {
        put32(st, OP_SLAB);
        put_slab(st, sl);
      }
      continue;
    }
    if (e->op != OP_NAME) {
      put32(st, e->op);
      put64(st, e->id);
      continue;
    }
    nm = gpupool__smap_get(&reg->names, e->key);
    if (!name_kept(nm)) {
      put32(st, OP_NAME_DEL);
      put_str(st, e->key);
      continue;
    }
    for (uint32_t k = 0; k < nm->nbufs; k++)
      put_buffer_with(st, nm->bufs[k], &em);
    if (nm->layout && !seen(&em.layouts, nm->layout->id)) {
      put32(st, OP_LAYOUT);
      put_layout(st, nm->layout);
    }
    put32(st, OP_NAME);
    put_name(st, nm);
  }
  gpupool__hmap_free(&pend);
  gpupool__hmap_free(&em.slabs);
  gpupool__hmap_free(&em.layouts);
}

static void on_idle(uv_timer_t *t);

/* The changes the journal names as a delta on top of the state in the store; a whole state
 * instead (a compaction) when there is none yet, when the deltas' count or bytes have grown
 * past their bounds (the restore reads each of them), or when the journal cannot say what
 * changed. */
static int write_delta(gpd_state *st) {
  uint64_t seq = st->seq + 1, t0 = gpd_now_ns();
  char what[64];
  int fd;

  if (st->need_whole || !st->generation || st->seq >= st->max_deltas ||
      st->delta_bytes > (st->whole_bytes / 2 > DELTA_BYTES_MIN ? st->whole_bytes / 2 : DELTA_BYTES_MIN) ||
      st->nstored + 2 > st->info.store_max)
    return write_state(st);
  st->synced = st->reg->state_changes;
  build_delta(st);
  if (st->oom) {
    st->need_whole = 1;
    return write_state(st);
  }
  st->damage_now = st->damage_file[0] && access(st->damage_file, F_OK) == 0 &&
                   ++st->damage_seen == st->damage_seq && unlink(st->damage_file) == 0;
  if ((fd = write_memfd(st, st->generation, seq, 5)) < 0) {
    st->need_whole = 1;
    return write_state(st);
  }
  delta_name(what, sizeof what, st->generation);
  if (st->damage_drop && st->damage_now) {
    GPUPOOL__WARN("GPUPOOL_TEST_STATE_DELTA: delta %" PRIu64 ".%" PRIu64 " is left out of the store", st->generation,
                  seq);
    st->nstored++; /* (as if it were there) */
  } else if (store_put_as(st, what, fd) != 0) {
    close(fd);
    st->need_whole = 1;
    return write_state(st);
  }
  close(fd);
  maybe_crash(st, 8);
  st->seq = seq;
  st->delta_bytes += HEADER_LEN + st->len;
  journal_clear(st);
  st->last_write_ns = gpd_now_ns();
  if (st->check_on)
    uv_timer_start(&st->idle, on_idle, st->every_ns * 10 / 1000000 + 1, 0);
  wrote(st, t0, HEADER_LEN + st->len);
  st->info.deltas++;
  GPUPOOL__DEBUG("state %" PRIu64 " delta %" PRIu64 " written: %zu bytes in %.3f ms", st->generation, seq,
                 HEADER_LEN + st->len, st->info.write_ns_last / 1e6);
  return 0;
}

/* What changed since the last write, cheaply: every counter a change moves. */
static int changed(gpd_state *st) {
  gpd_registry *reg = st->reg;
  uint64_t now[8] = {reg->next_id, reg->holds.len, reg->buffers.len, reg->slabs.len,
                     reg->nnames, reg->npending, reg->nwaiting, reg->state_changes};
  if (memcmp(now, st->last, sizeof now) == 0)
    return 0;
  memcpy(st->last, now, sizeof now);
  return 1;
}

/* The leases of before that are gone are let go; once none is left, the slabs are used again. */
static void before_check(gpd_state *st) {
  gpd_registry *reg = st->reg;
  uint32_t k = 0;
  for (uint32_t i = 0; i < st->nbefore; i++) {
    if (st->before[i].l->gone) {
      gpd_lease_unref(st->before[i].l);
      free(st->before[i].pins);
      continue;
    }
    st->before[k++] = st->before[i];
  }
  st->nbefore = k;
  if (st->frozen && st->nbefore == 0) {
    uint32_t n = 0;
    for (int i = 0; i < reg->npools; i++)
      for (gpd_slab *s = reg->pools[i].slabs; s; s = s->next)
        if (s->frozen) {
          s->frozen = 0;
          n++;
          gpd_slab_maybe_retire(reg, s);
        }
    st->frozen = 0;
    reg->memory_returned = 1;
    GPUPOOL__INFO("every client of the previous daemon has let go of its lease: the %u slab(s) restored take "
                  "new buffers again", n);
    if (reg->on_memory)
      reg->on_memory(reg, NULL);
  }
}

/* Turns that change holds, leases or slabs write at most every WRITE_EVERY_NS (a change of names
 * or versions is written at once, before its reply: gpd_state_sync). */
#define WRITE_EVERY_NS (100 * 1000000ull)
/* Something to write: what the journal names, or a whole state owed. */
static int pending(const gpd_state *st) { return st->njournal > 0 || st->need_whole; }

static void on_later(uv_timer_t *t) {
  gpd_state *st = t->data;
  st->later_on = 0;
  if (pending(st))
    (void)write_delta(st);
}

/* Deltas left after a while with nothing to write are compacted: a restart then reads one
 * state, and the store holds one entry for it. */
static void on_idle(uv_timer_t *t) {
  gpd_state *st = t->data;
  if (st->seq > 0)
    (void)write_state(st);
}

static void on_check(uv_check_t *h) {
  gpd_state *st = h->data;
  uint64_t now;
  if (st->nbefore)
    before_check(st);
  if (st->later_on)
    return;
  now = gpd_now_ns();
  if (!pending(st))
    return;
  if (now - st->last_write_ns < st->every_ns) {
    uv_timer_start(&st->later, on_later, (st->every_ns - (now - st->last_write_ns)) / 1000000 + 1, 0);
    st->later_on = 1;
    return;
  }
  (void)write_delta(st);
}

void gpd_state_sync(gpd_registry *reg) {
  gpd_state *st = reg->state;
  if (st && st->synced != reg->state_changes) {
    (void)changed(st); /* (what the write covers: the turn's check need not write it again) */
    (void)write_delta(st);
  }
}

void gpd_state_flush(gpd_registry *reg) {
  gpd_state *st = reg->state;
  if (st && (changed(st) || pending(st) || st->seq > 0))
    (void)write_state(st);
}

static void check_closed(uv_handle_t *h) {
  gpd_state *st = h->data;
  if (--st->handles > 0)
    return;
  free(st->before);
  free(st->buf);
  free(st);
}

void gpd_state_stop(gpd_registry *reg) {
  gpd_state *st = reg->state;
  if (!st)
    return;
  reg->state = NULL; /* what the registry frees from now on stays in the store */
  journal_clear(st);
  free(st->journal);
  st->journal = NULL;
  for (uint32_t i = 0; i < st->nbefore; i++) {
    gpd_lease_unref(st->before[i].l);
    free(st->before[i].pins);
  }
  st->nbefore = 0;
  if (!st->check_on) {
    free(st->before);
    free(st->buf);
    free(st);
    return;
  }
  st->handles = 3;
  uv_check_stop(&st->check);
  uv_close((uv_handle_t *)&st->check, check_closed);
  uv_timer_stop(&st->later);
  uv_close((uv_handle_t *)&st->later, check_closed);
  uv_timer_stop(&st->idle);
  uv_close((uv_handle_t *)&st->idle, check_closed);
}

const gpd_state_info *gpd_state_info_get(const gpd_registry *reg) {
  return reg->state ? &reg->state->info : NULL;
}

void gpd_state_describe(const gpd_registry *reg, char *buf, size_t len) {
  const gpd_state *st = reg->state;
  const gpd_state_info *in;
  size_t at;
  if (!st) {
    snprintf(buf, len, "not kept (%s): names, versions and holds are lost when the daemon stops",
             !reg->be->ops->slab_adopt ? "the backend's memory cannot outlive the daemon"
                                       : "no fd store: run it under systemd with FileDescriptorStoreMax= and "
                                         "GPUPOOL_FDSTORE, or with gpupoold --supervise");
    return;
  }
  in = &st->info;
  at = (size_t)snprintf(buf, len, "kept in the fd store (%" PRIu64 " of %" PRIu64 " entries, %" PRIu64
                        " bytes of state, %" PRIu64 " delta(s) after it)", st->nstored, in->store_max,
                        st->whole_bytes + st->delta_bytes, st->seq);
  if (at >= len)
    return;
  if (!in->found)
    at += (size_t)snprintf(buf + at, len - at, "; started empty");
  else
    at += (size_t)snprintf(buf + at, len - at, "; restored at start: %" PRIu64 " name(s), %" PRIu64
                           " bytes, %" PRIu64 " lease(s) of earlier clients (%u still held), %" PRIu64
                           " kept share(s)", in->names, in->bytes, in->leases, st->nbefore, in->keeps);
  if (at < len && (in->names_lost || in->slabs_lost || in->buffers_lost || in->why[0]))
    snprintf(buf + at, len - at, "; discarded: %" PRIu64 " name(s), %" PRIu64 " slab(s), %" PRIu64
             " buffer(s) (first: %s)", in->names_lost, in->slabs_lost, in->buffers_lost, in->why);
}

/* ---- resuming a client's holds ------------------------------------------------------- */

size_t gpd_state_resume_token(const gpd_lease *l, uint8_t buf[GPD_STATE_RESUME_LEN]) {
  if (!l || !l->store_id || !l->reg || !l->reg->state)
    return 0;
  memcpy(buf, &l->store_id, 8);
  memcpy(buf + 8, l->resume, sizeof l->resume);
  return GPD_STATE_RESUME_LEN;
}

/* b, restored with no holder but its previous connection's lease, back among the live buffers. */
static void unpend(gpd_registry *reg, gpd_buffer *b) {
  for (gpd_buffer **pp = &reg->pending; *pp; pp = &(*pp)->pending_next)
    if (*pp == b) {
      *pp = b->pending_next;
      b->pending_next = NULL;
      reg->npending--;
      break;
    }
  (void)gpupool__hmap_put(&reg->buffers, b->id, b);
}

static gpd_buffer *pending_find(gpd_registry *reg, uint64_t id) {
  for (gpd_buffer *b = reg->pending; b; b = b->pending_next)
    if (b->id == id)
      return b;
  return NULL;
}

int gpd_state_resume(gpd_registry *reg, gpd_client *c, const uint8_t *token, size_t len, gpd_hold ***out,
                     size_t *n) {
  gpd_state *st = reg->state;
  struct before *e = NULL;
  uint64_t store_id;
  gpd_hold **holds;
  int rc = 0;

  *out = NULL;
  *n = 0;
  if (!st || len != GPD_STATE_RESUME_LEN)
    return 0;
  memcpy(&store_id, token, 8);
  for (uint32_t i = 0; i < st->nbefore; i++)
    if (st->before[i].l->store_id == store_id && !st->before[i].l->gone &&
        gpupool__ct_equal(st->before[i].l->resume, token + 8, 16)) {
      e = &st->before[i];
      break;
    }
  /* Only its own uid, and only once: a token seen twice (copied) gives nothing the second time. */
  GPUPOOL__DEBUG("resume: client %" PRIu64 " names lease %" PRIu64 ": %s", c->id, store_id,
                 !e ? "not a lease of the previous daemon's (or a wrong secret)"
                 : e->resumed ? "given back already" : e->l->uid != c->uid ? "another uid's" : "ok");
  if (!e || e->resumed || e->l->uid != c->uid || e->npins == 0)
    return 0;
  e->resumed = 1;
  if (!(holds = calloc(e->npins, sizeof *holds)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory in the daemon");
  for (uint32_t k = 0; k < e->npins; k++) {
    uint64_t id = e->pins[k] & ~PIN_RO;
    gpd_buffer *b = gpupool__hmap_get(&reg->buffers, id);
    if (!b && (b = pending_find(reg, id)))
      unpend(reg, b);
    if (!b)
      continue; /* freed meanwhile (it was never pinned: named, then unpublished) */
    if ((rc = gpd_hold_new(reg, c, b, (e->pins[k] & PIN_RO) != 0, 0, &holds[*n])) != 0) {
      if (b->refs == 0) {
        b->refs = 1; /* back to pending, through the normal path */
        gpd_buffer_unref(reg, b);
      }
      break;
    }
    (*n)++;
  }
  GPUPOOL__INFO("client %" PRIu64 " (pid %d uid %u) took back %zu hold(s) of its connection to the previous "
                "daemon", c->id, (int)c->pid, (unsigned)c->uid, *n);
  *out = holds;
  return rc;
}

/* ---- reading --------------------------------------------------------------------------- */

typedef struct {
  const uint8_t *p;
  size_t left;
  int bad;
} rd;

static void get(rd *r, void *out, size_t n) {
  if (r->bad || r->left < n) {
    r->bad = 1;
    memset(out, 0, n);
    return;
  }
  memcpy(out, r->p, n);
  r->p += n;
  r->left -= n;
}
static uint64_t get64(rd *r) {
  uint64_t v;
  get(r, &v, sizeof v);
  return v;
}
static uint32_t get32(rd *r) {
  uint32_t v;
  get(r, &v, sizeof v);
  return v;
}
/* A count of records of at least `each` bytes: no more than the bytes left can hold. */
static uint64_t get_count(rd *r, size_t each) {
  uint64_t n = get64(r);
  if (n > r->left / each)
    r->bad = 1;
  return r->bad ? 0 : n;
}
/* A string into a new allocation (NULL when malformed or out of memory: r->bad). */
static char *get_str(rd *r, size_t max) {
  uint32_t n = get32(r);
  char *s;
  if (r->bad || n > max || n > r->left || memchr(r->p, '\0', n)) {
    r->bad = 1;
    return NULL;
  }
  if (!(s = malloc((size_t)n + 1))) {
    r->bad = 1;
    return NULL;
  }
  memcpy(s, r->p, n);
  s[n] = '\0';
  r->p += n;
  r->left -= n;
  return s;
}
static int get_meta(rd *r, gpupool_tensor_meta *m) {
  uint32_t has = get32(r);
  memset(m, 0, sizeof *m);
  if (has > 1)
    r->bad = 1;
  if (has == 1) {
    get(r, m, sizeof *m);
    if (m->ndim < 0 || m->ndim > GPUPOOL_MAX_NDIM)
      r->bad = 1;
  }
  return has == 1;
}

static void discard(gpd_state *st, uint64_t *count, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void discard(gpd_state *st, uint64_t *count, const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (count)
    (*count)++;
  if (!st->info.why[0])
    snprintf(st->info.why, sizeof st->info.why, "%s", msg);
  /* The first few in full; the counts in the summary line say how many more. */
  if (st->ndiscards++ < 16)
    GPUPOOL__WARN("restore: %s", msg);
}

/* The stored fd named GPD_SD_STORE_PREFIX kind.id, taken (the caller owns it), or -1. */
static int take_fd(const char *kind, uint64_t id) {
  char want[64];
  int n;
  gpd_sd_stored *s = gpd_sd_stored_fds(&n);
  snprintf(want, sizeof want, GPD_SD_STORE_PREFIX "%s.%" PRIu64, kind, id);
  for (int i = 0; i < n; i++)
    if (s[i].fd >= 0 && strcmp(s[i].name, want) == 0) {
      int fd = s[i].fd;
      s[i].fd = -1;
      return fd;
    }
  return -1;
}

static gpd_pool *pool_named(gpd_registry *reg, const char *name) {
  for (int i = 0; i < reg->npools; i++)
    if (strcmp(reg->pools[i].cfg.name, name) == 0)
      return &reg->pools[i];
  return NULL;
}

static int restore_slabs(gpd_state *st, rd *r) {
  gpd_registry *reg = st->reg;
  uint64_t n = get_count(r, 36);
  for (uint64_t i = 0; i < n && !r->bad; i++) {
    uint64_t id = get64(r);
    char *pname = get_str(r, 255);
    uint64_t size = get64(r), owner = get64(r);
    uint32_t dedicated = get32(r), kept = get32(r);
    gpd_pool *p;
    gpd_slab *s;
    int fd, rc;
    if (r->bad) {
      free(pname);
      break;
    }
    fd = take_fd("slab", id);
    p = pool_named(reg, pname);
    if (fd < 0 && p && !reg->be->desc->every_pool_survives && !p->cfg.survive)
      discard(st, &st->info.slabs_lost, "slab %" PRIu64 " of pool '%s': the pool is not survive=yes, so its "
              "memory went with the daemon that made it", id, pname);
    else if (fd < 0)
      discard(st, &st->info.slabs_lost, "slab %" PRIu64 " of pool '%s': its memory is not in the fd store", id, pname);
    else if (!p)
      discard(st, &st->info.slabs_lost, "slab %" PRIu64 ": pool '%s' is no longer configured", id, pname);
    else if (id == 0 || id > reg->next_id || gpupool__hmap_get(&reg->slabs, id) || dedicated > 1 ||
             kept > GPD_PLACE_ALLOC)
      discard(st, &st->info.slabs_lost, "slab %" PRIu64 " of pool '%s': its record does not check out", id, pname);
    else if ((rc = gpd_slab_adopt(reg, p, id, fd, size, (int)dedicated, owner, &s)) != 0) {
      discard(st, &st->info.slabs_lost, "slab %" PRIu64 " of pool '%s' (%" PRIu64 " bytes): %s", id, pname, size,
              gpupool__errmsg());
      store_remove(st, "slab", id); /* (the fd went with the refusal) */
      st->nstored++;
      fd = -1;
    } else {
      fd = -1; /* the slab's now */
      s->kept = (int)kept;
      s->stored = 1;
      st->nstored++;
      st->info.slabs++;
    }
    if (fd >= 0) {
      close(fd);
      store_remove(st, "slab", id);
      st->nstored++; /* (store_remove counted one this daemon never had) */
    }
    free(pname);
  }
  return r->bad ? -1 : 0;
}

static void layout_drop_ids(gpupool__hmap *ids, gpd_registry *reg) {
  for (size_t i = 0; i < ids->cap; i++)
    if (gpupool__hmap_slot_used(ids, i))
      gpd_layout_unref(reg, ids->slots[i].val);
  gpupool__hmap_free(ids);
}

/* Layouts come back with their ids (clients name them by id); ids maps each to its layout,
 * holding one reference of the restore's. */
static int restore_layouts(gpd_state *st, rd *r, gpupool__hmap *ids) {
  gpd_registry *reg = st->reg;
  uint64_t n = get_count(r, 24);
  for (uint64_t i = 0; i < n && !r->bad; i++) {
    uint64_t id = get64(r), tenant = get64(r);
    uint32_t nbufs = get32(r), nm = get32(r);
    gpd_member *m;
    gpd_layout *l;
    int ok = 1;
    if (r->bad || nm > r->left / 28 || nbufs == 0 || nm == 0 || id == 0 || id > reg->next_id) {
      r->bad = 1;
      break;
    }
    if (!(m = calloc(nm, sizeof *m))) {
      r->bad = 1;
      break;
    }
    for (uint32_t k = 0; k < nm; k++) {
      gpupool_tensor_meta meta;
      m[k].name = get_str(r, GPUPOOL_NAME_MAX);
      m[k].buffer = get32(r);
      m[k].offset = get64(r);
      m[k].size = get64(r);
      if (get_meta(r, &meta) && !r->bad) {
        if (!(m[k].meta = malloc(sizeof meta)))
          r->bad = 1;
        else
          *m[k].meta = meta;
      }
      if (r->bad)
        break;
      if (m[k].buffer >= nbufs || m[k].offset + m[k].size < m[k].offset)
        ok = 0;
    }
    if (r->bad) {
      gpd_members_free(m, nm);
      break;
    }
    if (!ok || gpupool__hmap_get(ids, id)) {
      gpd_members_free(m, nm);
      discard(st, NULL, "layout %" PRIu64 ": its record does not check out", id);
      continue;
    }
    if (gpd_layout_new(reg, tenant, m, nm, nbufs, 0, &l) != 0) {
      discard(st, NULL, "layout %" PRIu64 ": %s", id, gpupool__errmsg());
      continue;
    }
    if (l->refs == 1 && l->id != id && !gpupool__hmap_get(&reg->layouts, id)) {
      gpupool__hmap_del(&reg->layouts, l->id);
      l->id = id;
      (void)gpupool__hmap_put(&reg->layouts, l->id, l);
    }
    if (gpupool__hmap_put(ids, id, l) != 0) {
      gpd_layout_unref(reg, l);
      r->bad = 1;
    }
  }
  return r->bad ? -1 : 0;
}

/* Buffers come back with one reference of the restore's each (dropped at the end: a buffer no
 * name or lease keeps is then freed). */
static int restore_buffers(gpd_state *st, rd *r, gpupool__hmap *layouts) {
  gpd_registry *reg = st->reg;
  uint64_t n = get_count(r, 100);
  for (uint64_t i = 0; i < n && !r->bad; i++) {
    gpd_buffer tmp = {0};
    uint64_t slab_id, layout_id;
    gpd_slab *s;
    gpd_buffer *b;
    tmp.id = get64(r);
    slab_id = get64(r);
    tmp.offset = get64(r);
    tmp.size = get64(r);
    tmp.asked = get64(r);
    get(r, tmp.secret, sizeof tmp.secret);
    get(r, tmp.secret_ro, sizeof tmp.secret_ro);
    tmp.has_meta = get_meta(r, &tmp.meta);
    tmp.owner_uid = (uid_t)get32(r);
    tmp.owner_tenant = get64(r);
    layout_id = get64(r);
    tmp.died_in_use = get32(r) != 0;
    if (r->bad)
      break;
    s = gpupool__hmap_get(&reg->slabs, slab_id);
    if (!s) {
      discard(st, &st->info.buffers_lost, "buffer %" PRIu64 ": its slab %" PRIu64 " was not restored", tmp.id,
              slab_id);
      continue;
    }
    if (tmp.id == 0 || tmp.id > reg->next_id || gpupool__hmap_get(&reg->buffers, tmp.id) || tmp.size == 0 ||
        tmp.asked > tmp.size || tmp.offset >= s->bs.size || tmp.size > s->bs.size - tmp.offset ||
        (layout_id && !gpupool__hmap_get(layouts, layout_id)) ||
        (s->alloc ? gpupool__alloc_take(s->alloc, tmp.offset, tmp.size) != 0
                  : (s->nbuffers > 0 || tmp.offset != 0 || tmp.size != s->bs.size))) {
      discard(st, &st->info.buffers_lost, "buffer %" PRIu64 " in slab %" PRIu64 ": its record does not check out "
              "(a range outside the slab or overlapping another)", tmp.id, slab_id);
      continue;
    }
    if (!(b = malloc(sizeof *b)) || gpupool__hmap_put(&reg->buffers, tmp.id, b) != 0) {
      free(b);
      if (s->alloc)
        gpupool__alloc_put(s->alloc, tmp.offset, tmp.size);
      r->bad = 1;
      break;
    }
    *b = tmp;
    b->slab = s;
    b->refs = 1;
    b->created_ns = gpd_now_ns();
    if (layout_id) {
      b->layout = gpupool__hmap_get(layouts, layout_id);
      b->layout->refs++;
    }
    s->nbuffers++;
    s->pool->used += b->size;
    if (s->pool->used > s->pool->used_high)
      s->pool->used_high = s->pool->used;
    s->pool->nbuffers++;
    gpd_uid_account(reg, b->owner_tenant, (int64_t)b->size, 1);
    st->info.buffers++;
  }
  return r->bad ? -1 : 0;
}

static int restore_names(gpd_state *st, rd *r, gpupool__hmap *layouts) {
  gpd_registry *reg = st->reg;
  uint64_t n = get_count(r, 48);
  for (uint64_t i = 0; i < n && !r->bad; i++) {
    char *key = get_str(r, GPUPOOL_NAME_KEY_MAX);
    uint64_t version = get64(r);
    uint32_t nbufs = get32(r);
    gpd_buffer **bufs = NULL;
    uint64_t layout_id;
    gpd_name *nm = NULL;
    gpd_layout *l;
    int ok = 1;
    if (r->bad || nbufs == 0 || nbufs > r->left / 8 || !(bufs = calloc(nbufs, sizeof *bufs))) {
      free(key);
      r->bad = 1;
      break;
    }
    for (uint32_t k = 0; k < nbufs; k++)
      if (!(bufs[k] = gpupool__hmap_get(&reg->buffers, get64(r))))
        ok = 0;
    layout_id = get64(r);
    if (!(nm = calloc(1, sizeof *nm))) {
      free(bufs);
      free(key);
      r->bad = 1;
      break;
    }
    nm->uid = (uid_t)get32(r);
    nm->tenant = get64(r);
    nm->read_only = get32(r) != 0;
    nm->has_meta = get_meta(r, &nm->meta);
    l = layout_id ? gpupool__hmap_get(layouts, layout_id) : NULL;
    /* Every member inside its buffer, and every buffer of one owner (the name's namespace). */
    for (uint32_t k = 0; ok && k < nbufs; k++)
      if ((l && k < l->nbufs && l->need[k] > bufs[k]->size) || bufs[k]->slab->owner != bufs[0]->slab->owner)
        ok = 0;
    if (r->bad) {
      free(nm);
      free(bufs);
      free(key);
      break;
    }
    if (!ok || version == 0 || (layout_id && (!l || l->nbufs != nbufs)) || (!layout_id && nbufs != 1) ||
        !strchr(key, '/') || gpupool__smap_get(&reg->names, key)) {
      discard(st, &st->info.names_lost, "name '%s' (version %" PRIu64 "): %s", key, version,
              !ok ? "a buffer of it was not restored, or does not hold its members"
                  : "its record does not check out");
      free(nm);
      free(bufs);
      free(key);
      continue;
    }
    nm->name = key;
    nm->version = version;
    nm->bufs = bufs;
    nm->nbufs = nbufs;
    nm->created_ns = gpd_now_ns();
    if (l) {
      l->refs++;
      nm->layout = l;
    }
    if (gpupool__smap_put(&reg->names, key, nm) != 0) {
      gpd_layout_unref(reg, l);
      free(nm);
      free(bufs);
      free(key);
      r->bad = 1;
      break;
    }
    for (uint32_t k = 0; k < nbufs; k++) {
      bufs[k]->refs++;
      bufs[k]->names++;
      st->info.bytes += bufs[k]->size;
    }
    reg->nnames++;
    {
      gpd_uid_usage *u = gpd_uid_usage_get(reg, nm->tenant, 1);
      if (u)
        u->names++;
    }
    st->info.names++;
  }
  return r->bad ? -1 : 0;
}

static int pin_buffer(gpd_buffer *b, gpd_lease *l) {
  for (uint32_t k = 0; k < b->nleases; k++)
    if (b->leases[k] == l)
      return 0;
  if (gpd_grow((void **)&b->leases, &b->capleases, b->nleases + 1, sizeof *b->leases) != 0)
    return GPUPOOL_ENOMEM;
  l->refs++;
  b->leases[b->nleases++] = l;
  return 0;
}

static int pin_slab(gpd_slab *s, gpd_lease *l) {
  for (uint32_t k = 0; k < s->nmappers; k++)
    if (s->mappers[k].lease == l)
      return 0;
  if (gpd_slab_add_mapper(s, 0) != 0)
    return GPUPOOL_ENOMEM;
  s->mappers[s->nmappers - 1].lease = l;
  l->refs++;
  return 0;
}

/* A lease of the previous daemon's from its fd in the store (taken), or NULL (out of memory). */
static gpd_lease *lease_before(gpd_state *st, int fd, uint64_t store_id, uid_t uid, uint64_t tenant, pid_t pid) {
  gpd_lease *l = calloc(1, sizeof *l);
  if (!l) {
    close(fd);
    return NULL;
  }
  l->fd = fd;
  l->refs = 1;
  l->uid = uid;
  l->tenant = tenant;
  l->pid = pid;
  l->reg = st->reg;
  l->store_id = store_id;
  st->nstored++;
  (void)fcntl(fd, F_SETFL, O_NONBLOCK);
  (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
  return l;
}

/* Watch a lease of before (its pins recorded): kept, with the creation's reference, in
 * st->before while some process holds it; let go at once when none does. */
static struct before *lease_watch(gpd_state *st, gpd_lease *l) {
  st->info.leases++;
  if (gpd_lease_wait(st->reg, l) &&
      gpd_grow((void **)&st->before, &st->capbefore, st->nbefore + 1, sizeof *st->before) == 0) {
    struct before *e = &st->before[st->nbefore++];
    memset(e, 0, sizeof *e);
    e->l = l;
    return e;
  }
  gpd_lease_unref(l);
  return NULL;
}

/* The leases of the previous daemon's clients: each back as the lease of a closed connection
 * (its process may still map memory: nothing it pinned is reused until every process holding
 * it has exited or closed it). */
static int restore_leases(gpd_state *st, rd *r) {
  gpd_registry *reg = st->reg;
  uint64_t n = get_count(r, 56);
  for (uint64_t i = 0; i < n && !r->bad; i++) {
    uint64_t store_id = get64(r);
    uid_t uid = (uid_t)get32(r);
    uint64_t tenant = get64(r);
    pid_t pid = (pid_t)get32(r);
    uint8_t secret[16];
    uint64_t nb, ns, *pins = NULL;
    uint32_t npins = 0;
    int fd;
    gpd_lease *l = NULL;
    get(r, secret, sizeof secret);
    fd = r->bad ? -1 : take_fd("lease", store_id);
    if (fd >= 0 && !(l = lease_before(st, fd, store_id, uid, tenant, pid))) {
      r->bad = 1;
      break;
    }
    if (l)
      memcpy(l->resume, secret, sizeof secret);
    GPUPOOL__DEBUG("restore: lease %" PRIu64 " of pid %d uid %u%s", store_id, (int)pid, (unsigned)uid,
                   l ? "" : " (let go before the crash)");
    /* A lease the state names leaves the store only when the daemon let it go (every process
     * holding it had gone, or it pinned nothing) after that state was written: nothing to do. */
    if (fd < 0)
      GPUPOOL__DEBUG("restore: the lease of client pid %d uid %u was let go before the crash", (int)pid,
                     (unsigned)uid);
    nb = get_count(r, 8);
    if (l && nb)
      pins = calloc(nb, sizeof *pins);
    for (uint64_t k = 0; k < nb && !r->bad; k++) {
      uint64_t pin = get64(r);
      gpd_buffer *b = gpupool__hmap_get(&reg->buffers, pin & ~PIN_RO);
      if (l && b && pin_buffer(b, l) != 0)
        b->refs++; /* kept for good rather than reused under the holder */
      if (l && b && pins)
        pins[npins++] = pin;
    }
    ns = get_count(r, 8);
    for (uint64_t k = 0; k < ns && !r->bad; k++) {
      gpd_slab *s = gpupool__hmap_get(&reg->slabs, get64(r));
      if (l && s)
        (void)pin_slab(s, l);
    }
    if (l) {
      struct before *e = lease_watch(st, l);
      if (e) {
        e->pins = pins;
        e->npins = npins;
        pins = NULL;
      }
    }
    free(pins);
  }
  return r->bad ? -1 : 0;
}

/* Parse and check one state's header: 0 and its payload, or a reason. */
static int check_header(const uint8_t *m, size_t size, const char *magic, uint64_t *gen, uint32_t *fmt,
                        const uint8_t **payload, uint64_t *plen, char *why, size_t whylen) {
  uint32_t hl;
  uint64_t sum, want;
  if (size < HEADER_LEN || memcmp(m, magic, 8) != 0) {
    snprintf(why, whylen, "not a gpupoold state");
    return -1;
  }
  memcpy(fmt, m + 8, 4);
  memcpy(&hl, m + 12, 4);
  memcpy(gen, m + 16, 8);
  memcpy(plen, m + 24, 8);
  if (*fmt > GPD_STATE_FORMAT)
    return 1; /* newer: the caller refuses it */
  if (hl != HEADER_LEN || *fmt == 0 || *plen > size - HEADER_LEN) {
    snprintf(why, whylen, "its header does not check out");
    return -1;
  }
  sum = checksum(m + HEADER_LEN, (size_t)*plen);
  memcpy(&want, m + 32, sizeof want);
  if (sum != want) {
    snprintf(why, whylen, "its checksum does not match (a damaged or partly written state)");
    return -1;
  }
  *payload = m + HEADER_LEN;
  return 0;
}

static int restore_keeps(gpd_state *st, rd *r) {
  gpd_registry *reg = st->reg;
  uint64_t n = get_count(r, 52), now = gpd_now_ns();
  for (uint64_t i = 0; i < n && !r->bad; i++) {
    uint8_t secret[16];
    uint64_t id = get64(r), bid = get64(r), tenant, expires;
    uint32_t ro;
    gpd_buffer *b;
    get(r, secret, sizeof secret);
    ro = get32(r);
    tenant = get64(r);
    expires = get64(r);
    if (r->bad)
      break;
    b = gpupool__hmap_get(&reg->buffers, bid);
    if (expires <= now)
      st->info.keeps_expired++; /* (share_keep_ms passed while no daemon ran: as if expired here) */
    else if (!b)
      discard(st, NULL, "kept share %" PRIu64 ": its buffer %" PRIu64 " was not restored", id, bid);
    else if (id == 0 || id > reg->next_id || gpupool__hmap_get(&reg->keeps, id) ||
             gpupool__hmap_get(&reg->buffers, id) || ro > 1)
      discard(st, NULL, "kept share %" PRIu64 " of buffer %" PRIu64 ": its record does not check out (%s)", id, bid,
              id == 0 || id > reg->next_id ? "an id out of range" : ro > 1 ? "an unknown kind" : "a duplicate id");
    else if (gpd_keep_restore(reg, id, b, secret, (int)ro, tenant, expires) != 0)
      r->bad = 1; /* out of memory */
    else
      st->info.keeps++;
  }
  return r->bad ? -1 : 0;
}

static int restore(gpd_state *st, const uint8_t *payload, uint64_t plen) {
  gpd_registry *reg = st->reg;
  gpupool__hmap layouts;
  rd r = {payload, (size_t)plen, 0};
  uint64_t next_id = get64(&r);
  int rc = 0;

  if (r.bad || next_id == 0 || next_id > UINT64_MAX / 2)
    return -1;
  /* Every id the state names is at most next_id (the last one issued); new ones continue above. */
  if (next_id > reg->next_id)
    reg->next_id = next_id;
  gpupool__hmap_init(&layouts);
  if (restore_slabs(st, &r) != 0 || restore_layouts(st, &r, &layouts) != 0 ||
      restore_buffers(st, &r, &layouts) != 0 || restore_names(st, &r, &layouts) != 0 ||
      restore_leases(st, &r) != 0 || (st->info.format >= 3 && restore_keeps(st, &r) != 0))
    rc = -1;
  if (rc != 0)
    discard(st, NULL, "the state's records end early or do not check out; what was read before is kept");
  layout_drop_ids(&layouts, reg);
  /* The restore's references: a buffer no name or lease keeps goes now (out of memory: they
   * stay, never reused, until the daemon's state is discarded). */
  {
    gpd_buffer **all = reg->buffers.len ? malloc(reg->buffers.len * sizeof *all) : NULL;
    size_t n = 0;
    if (all || !reg->buffers.len) {
      for (size_t i = 0; i < reg->buffers.cap; i++)
        if (gpupool__hmap_slot_used(&reg->buffers, i))
          all[n++] = reg->buffers.slots[i].val;
      for (size_t i = 0; i < n; i++)
        gpd_buffer_unref(reg, all[i]);
    } else {
      GPUPOOL__ERROR("restore: out of memory; the %zu buffer(s) restored stay allocated", reg->buffers.len);
    }
    free(all);
  }
  for (int i = 0; i < reg->npools; i++)
    for (gpd_slab *s = reg->pools[i].slabs, *nx; s; s = nx) {
      nx = s->next;
      gpd_slab_maybe_retire(reg, s);
    }
  gpd_sweep(reg);
  return rc;
}

/* ---- deltas at start ------------------------------------------------------------------ */

/* Each record's extent, as restore_* reads it (only what it takes to find where it ends). */
static void skip(rd *r, size_t n) {
  if (r->bad || r->left < n) {
    r->bad = 1;
    return;
  }
  r->p += n;
  r->left -= n;
}
static void skip_str(rd *r) { skip(r, get32(r)); }
static void skip_meta(rd *r) {
  uint32_t has = get32(r);
  if (has > 1)
    r->bad = 1;
  else if (has)
    skip(r, sizeof(gpupool_tensor_meta));
}
static void skip_slab(rd *r) {
  skip(r, 8);
  skip_str(r);
  skip(r, 8 + 8 + 4 + 4);
}
static void skip_layout(rd *r) {
  uint32_t n;
  skip(r, 8 + 8 + 4);
  n = get32(r);
  if (n > r->left / 28)
    r->bad = 1;
  for (uint32_t k = 0; k < n && !r->bad; k++) {
    skip_str(r);
    skip(r, 4 + 8 + 8);
    skip_meta(r);
  }
}
static void skip_buffer(rd *r) {
  skip(r, 5 * 8 + sizeof ((gpd_buffer *)0)->secret + sizeof ((gpd_buffer *)0)->secret_ro);
  skip_meta(r);
  skip(r, 4 + 8 + 8 + 4);
}
static void skip_name(rd *r) {
  uint32_t n;
  skip_str(r);
  skip(r, 8);
  n = get32(r);
  skip(r, (size_t)n * 8);
  skip(r, 8 + 4 + 8 + 4);
  skip_meta(r);
}

static void skip_lease(rd *r) {
  skip(r, 8 + 4 + 8 + 4 + sizeof ((gpd_lease *)0)->resume);
  skip(r, get_count(r, 8) * 8);
  skip(r, get_count(r, 8) * 8);
}

static void skip_keep(rd *r) { skip(r, 8 + 8 + 16 + 4 + 8 + 8); }

/* The sections a delta's records go to, in the state's order (SEC_KEEP: format 3). */
enum { SEC_SLAB, SEC_LAYOUT, SEC_BUFFER, SEC_NAME, SEC_LEASE, SEC_KEEP, NSEC };
static void (*const skip_rec[NSEC])(rd *) = {skip_slab, skip_layout, skip_buffer, skip_name, skip_lease, skip_keep};

/* The sections a state of format fmt has. */
static int nsec_of(uint32_t fmt) { return fmt >= 3 ? NSEC : SEC_KEEP; }

/* What the deltas say of each key: the last record put (n > 0) or deleted (n 0). */
typedef struct {
  const uint8_t *p;
  size_t n;
} span;
typedef struct {
  gpupool__hmap ids[NSEC];     /* id -> index into spans + 1 (all but SEC_NAME) */
  gpupool__smap names;         /* key -> index into spans + 1 */
  span *spans;
  uint32_t nspans, capspans;
  uint64_t next_id;
} merge_t;

/* The key of the record (or the key alone) at p: an id, or a name's key into key. */
static int rec_key(int sec, const uint8_t *p, uint64_t *id, char key[GPUPOOL_NAME_KEY_MAX + 1]) {
  uint32_t n;
  if (sec != SEC_NAME) {
    memcpy(id, p, 8);
    return 0;
  }
  memcpy(&n, p, 4);
  if (n > GPUPOOL_NAME_KEY_MAX)
    return -1;
  memcpy(key, p + 4, n);
  key[n] = '\0';
  return 0;
}

static span *merge_get(const merge_t *mg, int sec, const uint8_t *p) {
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  uint64_t id = 0;
  uintptr_t v;
  if (rec_key(sec, p, &id, key) != 0)
    return NULL;
  v = (uintptr_t)(sec == SEC_NAME ? gpupool__smap_get(&mg->names, key) : gpupool__hmap_get(&mg->ids[sec], id));
  return v ? &mg->spans[v - 1] : NULL;
}

static int merge_set(merge_t *mg, int sec, const uint8_t *p, size_t n) {
  char key[GPUPOOL_NAME_KEY_MAX + 1];
  uint64_t id = 0;
  void *v;
  if (rec_key(sec, p, &id, key) != 0 ||
      gpd_grow((void **)&mg->spans, &mg->capspans, mg->nspans + 1, sizeof *mg->spans) != 0)
    return -1;
  mg->spans[mg->nspans] = (span){p, n};
  v = (void *)(uintptr_t)(++mg->nspans);
  return sec == SEC_NAME ? gpupool__smap_put(&mg->names, key, v) : gpupool__hmap_put(&mg->ids[sec], id, v);
}

static void merge_free(merge_t *mg) {
  for (int i = 0; i < NSEC; i++)
    gpupool__hmap_free(&mg->ids[i]);
  gpupool__smap_free(&mg->names);
  free(mg->spans);
}

/* Walk a delta's records (apply 0: only check that every one reads; 1: into mg). */
static int delta_ops(merge_t *mg, const uint8_t *p, size_t n, int apply) {
  rd r = {p, n, 0};
  uint64_t next_id = get64(&r);
  if (r.bad || next_id == 0 || next_id > UINT64_MAX / 2)
    return -1;
  while (r.left > 0) {
    uint32_t op = get32(&r);
    const uint8_t *at = r.p;
    int sec = (int)(op - 1) / 2, put_op = op % 2;
    if (r.bad || op < OP_SLAB || op > OP_KEEP_DEL)
      return -1;
    if (put_op)
      skip_rec[sec](&r);
    else if (sec == SEC_NAME)
      skip_str(&r);
    else
      skip(&r, 8);
    if (r.bad || (apply && merge_set(mg, sec, at, put_op ? (size_t)(r.p - at) : 0) != 0))
      return -1;
  }
  if (apply && next_id > mg->next_id)
    mg->next_id = next_id;
  return 0;
}

/* The state's payload with the deltas' records in place of those of the same keys, into
 * st->buf: what restore reads, each record checked there as any other. */
static int merge_emit(gpd_state *st, const merge_t *mg, const uint8_t *payload, uint64_t plen) {
  rd r = {payload, (size_t)plen, 0};
  uint64_t next_id = get64(&r);
  st->len = 0;
  st->oom = 0;
  put64(st, next_id > mg->next_id ? next_id : mg->next_id);
  for (int sec = 0; sec < nsec_of(st->info.format); sec++) {
    uint64_t n = get_count(&r, 8), kept = 0;
    size_t at = count_at(st);
    const gpupool__map *m = sec == SEC_NAME ? &mg->names : &mg->ids[sec];
    for (uint64_t i = 0; i < n && !r.bad; i++) {
      const uint8_t *p0 = r.p;
      skip_rec[sec](&r);
      if (!r.bad && !merge_get(mg, sec, p0)) {
        put(st, p0, (size_t)(r.p - p0));
        kept++;
      }
    }
    if (r.bad)
      return -1;
    for (size_t i = 0; i < m->cap; i++) {
      const span *sp;
      if (!gpupool__map_slot_used(m, i))
        continue;
      sp = &mg->spans[(uintptr_t)m->slots[i].val - 1];
      if (sp->n) {
        put(st, sp->p, sp->n);
        kept++;
      }
    }
    count_set(st, at, kept);
  }
  put(st, r.p, r.left); /* (nothing, from this daemon) */
  return st->oom ? -1 : 0;
}

/* Map a stored memfd that must be sealed against writes: its bytes, or NULL with the reason. */
static void *map_sealed(int fd, size_t *size, char *why, size_t whylen) {
  struct stat sb;
  int seals = fcntl(fd, F_GET_SEALS);
  void *m;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size <= 0 || (uint64_t)sb.st_size > STATE_MAX ||
      seals < 0 || !(seals & F_SEAL_WRITE) ||
      (m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0)) == MAP_FAILED) {
    snprintf(why, whylen, "not a sealed memfd that can be read");
    return NULL;
  }
  *size = (size_t)sb.st_size;
  return m;
}

/* Restore state gen (payload) and the deltas that follow it in the store, in sequence from 1,
 * up to the first that is missing or does not check out: that one and every later one are
 * discarded (each is one whole change: what came before it is kept). 0, or GPUPOOL_ECONFIG
 * for a delta written by a newer daemon (nothing restored then). */
static int restore_with_deltas(gpd_state *st, gpd_sd_stored *fds, int n, uint64_t gen, const uint8_t *payload,
                               uint64_t plen) {
  merge_t mg;
  struct cand {
    int i;            /* in fds */
    void *m;
    size_t size;
    uint64_t seq;     /* 0: not known (not even its header reads) */
    const uint8_t *p; /* its payload once it checks out, else NULL */
    uint64_t plen;
    char why[160];
  } *c = NULL;
  uint32_t nc = 0, capc = 0, applied = 0;
  uint64_t seq;
  char what[64], want[80];
  int rc = 0;

  memset(&mg, 0, sizeof mg);
  delta_name(what, sizeof what, gen);
  snprintf(want, sizeof want, GPD_SD_STORE_PREFIX "%s", what);
  for (int i = 0; i < n; i++) {
    struct cand *d;
    uint64_t dgen = 0;
    uint32_t fmt = 0;
    int hc;
    if (fds[i].fd < 0 || strcmp(fds[i].name, want) != 0)
      continue;
    if (gpd_grow((void **)&c, &capc, nc + 1, sizeof *c) != 0) {
      discard(st, NULL, "out of memory reading the deltas of state %" PRIu64 "; the state is restored without the "
              "later ones", gen);
      break;
    }
    d = &c[nc++];
    memset(d, 0, sizeof *d);
    d->i = i;
    if (!(d->m = map_sealed(fds[i].fd, &d->size, d->why, sizeof d->why)))
      continue;
    if (d->size >= HEADER_LEN && memcmp(d->m, DELTA_MAGIC, 8) == 0)
      memcpy(&d->seq, (const uint8_t *)d->m + 40, 8);
    hc = check_header(d->m, d->size, DELTA_MAGIC, &dgen, &fmt, &d->p, &d->plen, d->why, sizeof d->why);
    if (hc == 1) {
      rc = gpupool__err(GPUPOOL_ECONFIG,
                        "a change kept in the fd store (delta %" PRIu64 ".%" PRIu64 ") is in format %u, written by "
                        "a newer gpupoold; this one (%s) reads formats up to %u. Start the newer gpupoold again, or, "
                        "to give up every name and version it kept, empty the store: `systemctl stop gpupoold` then "
                        "start this one (under gpupoold --supervise: stop the supervisor)",
                        gen, d->seq, fmt, GPUPOOL_VERSION_STRING, GPD_STATE_FORMAT);
      goto out;
    }
    if (hc == 0 && dgen != gen) {
      snprintf(d->why, sizeof d->why, "its header names another state");
      hc = -1;
    }
    if (hc == 0 && delta_ops(&mg, d->p, (size_t)d->plen, 0) != 0) {
      snprintf(d->why, sizeof d->why, "its records do not read");
      hc = -1;
    }
    if (hc != 0)
      d->p = NULL;
  }
  /* In sequence: each applied whole, or the first that is not there or not sound ends it. */
  for (seq = 1;; seq++) {
    struct cand *d = NULL, *bad = NULL;
    for (uint32_t k = 0; k < nc && !d; k++)
      if (c[k].seq == seq && c[k].m) {
        if (c[k].p)
          d = &c[k];
        else if (!bad)
          bad = &c[k];
      }
    if (!d) {
      if (bad)
        discard(st, NULL, "delta %" PRIu64 ".%" PRIu64 " of the state: %s; the changes it and any later delta hold are "
                "discarded, the %" PRIu64 " before it are kept", gen, seq, bad->why, seq - 1);
      else if (applied < nc)
        discard(st, NULL, "delta %" PRIu64 ".%" PRIu64 " of the state is missing: the %" PRIu32 " later one(s) are "
                "discarded with the changes they hold, the %" PRIu64 " before it are kept", gen, seq, nc - applied,
                seq - 1);
      break;
    }
    if (delta_ops(&mg, d->p, (size_t)d->plen, 1) != 0) {
      discard(st, NULL, "out of memory replaying delta %" PRIu64 ".%" PRIu64 "; it and the later ones are discarded",
              gen, seq);
      break;
    }
    d->seq = 0; /* (applied: once) */
    st->delta_bytes += d->size;
    applied++;
  }
  st->info.deltas_restored = applied;
  st->info.deltas_dropped = nc - applied;
  /* The replayed ones are taken out of the store with the others of their name, by the first
   * write (a whole state: what the restore dropped is in no delta). Until then they count. */
  st->seq = nc;
  st->whole_bytes = HEADER_LEN + plen;
  st->need_whole = 1;
  if (applied && merge_emit(st, &mg, payload, plen) != 0) {
    discard(st, NULL, "the %" PRIu32 " delta(s) of state %" PRIu64 " could not be applied to it (%s); the state is "
            "restored without them", applied, gen, st->oom ? "out of memory" : "its records do not read");
    applied = 0;
  }
  (void)restore(st, applied ? st->buf : payload, applied ? st->len : plen);
  /* Every delta of this state is closed here: the store keeps them until that first write. */
  for (uint32_t k = 0; k < nc; k++) {
    close(fds[c[k].i].fd);
    fds[c[k].i].fd = -1;
  }
out:
  for (uint32_t k = 0; k < nc; k++)
    if (c[k].m)
      munmap(c[k].m, c[k].size);
  free(c);
  merge_free(&mg);
  journal_clear(st);
  return rc;
}

int gpd_state_init(gpd_registry *reg) {
  gpd_state *st;
  gpd_sd_stored *fds;
  int n, best = -1, rc = 0;
  uint64_t best_gen = 0, t0 = gpd_now_ns();
  const char *env = getenv("FDSTORE"), *crash = getenv("GPUPOOL_TEST_STATE_CRASH");
  uint64_t max;
  char *end = NULL;

  if (!env || !*env)
    env = getenv("GPUPOOL_FDSTORE");
  fds = gpd_sd_stored_fds(&n);
  max = env && *env ? strtoull(env, &end, 10) : 0;
  if (!env || !*env || (end && *end) || max < 8 || !getenv("NOTIFY_SOCKET") || !reg->be->ops->slab_adopt) {
    if (n > 0)
      GPUPOOL__WARN("restore: %d fd(s) came back from an fd store, but this daemon %s; they are closed and "
                    "nothing is restored", n,
                    !reg->be->ops->slab_adopt ? "runs a backend whose memory cannot outlive it"
                                              : "has no fd store to keep its state in (FDSTORE unset)");
    for (int i = 0; i < n; i++)
      if (fds[i].fd >= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
      }
    return 0;
  }
  if (!(st = calloc(1, sizeof *st)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory");
  st->reg = reg;
  st->info.enabled = 1;
  if (!reg->be->desc->every_pool_survives)
    for (int i = 0; i < reg->npools; i++)
      if (!reg->pools[i].cfg.survive)
        GPUPOOL__INFO("state: pool '%s' is not survive=yes: names and versions are kept across a restart, but "
                      "its memory is not, so the names in it are lost when the daemon stops (set survive=yes "
                      "to keep them)", reg->pools[i].cfg.name);
  st->info.store_max = max;
  st->format = GPD_STATE_FORMAT;
  if (crash)
    (void)sscanf(crash, "%ld:%255s", &st->crash_step, st->crash_file);
  if ((env = getenv("GPUPOOL_TEST_STATE_FORMAT")) && *env)
    st->format = (uint32_t)strtoul(env, NULL, 10);
  /* Deltas on one state: each is an entry of the store and a file the restore reads. */
  st->max_deltas = max / 8 < MAX_DELTAS ? max / 8 : MAX_DELTAS;
  st->every_ns = WRITE_EVERY_NS;
  if ((env = getenv("GPUPOOL_TEST_STATE_EVERY_MS")) && *env)
    st->every_ns = strtoull(env, NULL, 10) * 1000000ull;
  if ((env = getenv("GPUPOOL_TEST_STATE_DELTAS")) && *env)
    st->max_deltas = strtoull(env, NULL, 10);
  if ((env = getenv("GPUPOOL_TEST_STATE_DELTA")) && *env) {
    char mode[16] = "";
    if (sscanf(env, "%15[a-z]:%ld:%255s", mode, &st->damage_seq, st->damage_file) == 3)
      st->damage_drop = strcmp(mode, "drop") == 0;
  }
  reg->state = st;
  reg->keep = &keep_ops;

  /* The newest state that checks out; the others go. */
  for (int i = 0; i < n; i++) {
    uint64_t gen;
    if (fds[i].fd < 0 || strncmp(fds[i].name, GPD_SD_STORE_PREFIX "state.", strlen(GPD_SD_STORE_PREFIX "state.")))
      continue;
    gen = strtoull(fds[i].name + strlen(GPD_SD_STORE_PREFIX "state."), NULL, 10);
    if (best < 0 || gen > best_gen) {
      best = i;
      best_gen = gen;
    }
  }
  while (best >= 0) {
    struct stat sb;
    void *m = MAP_FAILED;
    const uint8_t *payload = NULL;
    uint64_t gen = 0, plen = 0;
    uint32_t fmt = 0;
    char why[160] = "";
    int seals = fcntl(fds[best].fd, F_GET_SEALS), hc = -1, next = -1;
    if (fstat(fds[best].fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0 && (uint64_t)sb.st_size <= STATE_MAX &&
        seals >= 0 && (seals & F_SEAL_WRITE) &&
        (m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fds[best].fd, 0)) != MAP_FAILED)
      hc = check_header(m, (size_t)sb.st_size, MAGIC, &gen, &fmt, &payload, &plen, why, sizeof why);
    else
      snprintf(why, sizeof why, "not a sealed memfd that can be read");
    if (hc == 1) {
      rc = gpupool__err(GPUPOOL_ECONFIG,
                        "the state kept in the fd store is in format %u, written by a newer gpupoold; this one "
                        "(%s) reads formats up to %u. Start the newer gpupoold again, or, to give up every "
                        "name and version it kept, empty the store: `systemctl stop gpupoold` then start "
                        "this one (under gpupoold --supervise: stop the supervisor)",
                        fmt, GPUPOOL_VERSION_STRING, GPD_STATE_FORMAT);
      if (m != MAP_FAILED)
        munmap(m, (size_t)sb.st_size);
      return rc; /* every fd stays open: the process exits */
    }
    if (hc == 0) {
      st->info.found = 1;
      st->info.generation = gen;
      st->info.format = fmt;
      st->generation = gen;
      st->nstored++;
      rc = restore_with_deltas(st, fds, n, gen, payload, plen);
      munmap(m, (size_t)sb.st_size);
      if (rc != 0)
        return rc; /* every fd stays open: the process exits */
      close(fds[best].fd); /* the store keeps it until the next write replaces it */
      fds[best].fd = -1;
      st->nstored += st->seq; /* (its deltas, taken out by the next write) */
      break;
    }
    if (m != MAP_FAILED)
      munmap(m, (size_t)sb.st_size);
    discard(st, NULL, "state %s: %s; an older one is tried", fds[best].name, why);
    close(fds[best].fd);
    (void)gpd_sd_notifyf("FDSTOREREMOVE=1\nFDNAME=%s", fds[best].name);
    fds[best].fd = -1;
    fds[best].dropped = 1;
    for (int i = 0; i < n; i++)
      if (fds[i].fd >= 0 && !strncmp(fds[i].name, GPD_SD_STORE_PREFIX "state.", strlen(GPD_SD_STORE_PREFIX "state.")) &&
          (next < 0 || strtoull(fds[i].name + STATE_PREFIX_LEN, NULL, 10) >
                           strtoull(fds[next].name + STATE_PREFIX_LEN, NULL, 10)))
        next = i;
    best = next;
  }
  /* Leases no state names (clients that came in the moment before the crash) count as the
   * others: what they might map is not handed out again while they hold them. */
  for (int i = 0; i < n; i++) {
    const char *pre = GPD_SD_STORE_PREFIX "lease.";
    gpd_lease *l;
    if (fds[i].fd < 0 || strncmp(fds[i].name, pre, strlen(pre)) != 0)
      continue;
    if ((l = lease_before(st, fds[i].fd, strtoull(fds[i].name + strlen(pre), NULL, 10), (uid_t)-1,
                          gpd_tenant_of(reg->cfg, (uid_t)-1, (gid_t)-1), 0)))
      lease_watch(st, l);
    fds[i].fd = -1;
  }
  if (st->nbefore > 0) {
    uint32_t nslabs = 0;
    for (int i = 0; i < reg->npools; i++)
      for (gpd_slab *s = reg->pools[i].slabs; s; s = s->next) {
        s->frozen = 1;
        nslabs++;
      }
    st->frozen = 1;
    if (nslabs)
      GPUPOOL__INFO("restore: %u client lease(s) of the previous daemon are still held: the %u slab(s) restored take "
                    "no new buffers until every one is let go (what those processes map is never handed out "
                    "again under them)", st->nbefore, nslabs);
  }
  /* Whatever is left (older states, slabs no state names): closed, out of the store. */
  for (int i = 0; i < n; i++) {
    if (fds[i].fd < 0)
      continue;
    int taken = 0;
    close(fds[i].fd);
    fds[i].fd = -1;
    if (strncmp(fds[i].name, GPD_SD_STORE_PREFIX "state.", strlen(GPD_SD_STORE_PREFIX "state.")) != 0 &&
        strncmp(fds[i].name, GPD_SD_STORE_PREFIX "delta.", strlen(GPD_SD_STORE_PREFIX "delta.")) != 0)
      st->info.fds_dropped++;
    /* Removal goes by name: not when an entry of the same name was taken (a duplicate). */
    for (int j = 0; j < n; j++)
      taken |= j != i && fds[j].fd < 0 && strcmp(fds[j].name, fds[i].name) == 0 && !fds[j].dropped;
    fds[i].dropped = 1;
    if (!taken)
      (void)gpd_sd_notifyf("FDSTOREREMOVE=1\nFDNAME=%s", fds[i].name);
  }
  st->info.restore_ns = gpd_now_ns() - t0;
  if (st->info.found)
    GPUPOOL__INFO("restored state %" PRIu64 " (format %u) and %" PRIu64 " delta(s) after it in %.1f ms: %" PRIu64
                  " name(s), %" PRIu64 " byte(s) in %"
                  PRIu64 " slab(s), %" PRIu64 " lease(s) of earlier clients, %" PRIu64 " kept share(s) (%" PRIu64
                  " more expired meanwhile); discarded: %" PRIu64 " name(s), %" PRIu64
                  " slab(s), %" PRIu64 " buffer(s), %" PRIu64 " fd(s) no state named%s%s",
                  st->info.generation, st->info.format, st->info.deltas_restored, st->info.restore_ns / 1e6,
                  st->info.names, st->info.bytes,
                  st->info.slabs, st->info.leases, st->info.keeps, st->info.keeps_expired, st->info.names_lost,
                  st->info.slabs_lost, st->info.buffers_lost,
                  st->info.fds_dropped, st->info.why[0] ? "; first reason: " : "",
                  st->info.why);
  else if (n > 0)
    GPUPOOL__WARN("restore: %d fd(s) came back from the fd store but no state that checks out (%s); nothing is "
                  "restored", n, st->info.why[0] ? st->info.why : "none was kept");
  else
    GPUPOOL__INFO("state: kept in the fd store (at most %" PRIu64 " entries); nothing to restore", max);
  /* Slabs made before this point (none on the host backend) and from now on go to the store. */
  for (int i = 0; i < reg->npools; i++)
    for (gpd_slab *s = reg->pools[i].slabs; s; s = s->next)
      keep_slab_new(reg, s);
  uv_check_init(reg->loop, &st->check);
  st->check.data = st;
  uv_check_start(&st->check, on_check);
  uv_unref((uv_handle_t *)&st->check);
  uv_timer_init(reg->loop, &st->later);
  st->later.data = st;
  uv_unref((uv_handle_t *)&st->later);
  uv_timer_init(reg->loop, &st->idle);
  st->idle.data = st;
  uv_unref((uv_handle_t *)&st->idle);
  st->check_on = 1;
  return 0;
}
