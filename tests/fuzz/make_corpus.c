/*
 * Writes the seed corpora of the fuzz targets: valid streams (and a few well-known invalid
 * ones) packed with the project's own wire code, so that the fuzzers start from inputs that
 * reach deep into each parser. The checked-in tests/fuzz/corpus is this program's output;
 * ctest (fuzz_corpus_current) fails when they differ.
 *
 *   fuzz_make_corpus OUT_DIR      # tests/fuzz/corpus to regenerate the checked-in seeds
 *
 * Ids in the daemon's streams follow the registry's numbering for a fresh registry: the
 * client is 1, the first slab 2, then each buffer and hold takes the next number.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "frames.h"
#include "fuzz.h"
#include "host/host.h"
#include "wire.h"

static const char *out_dir;

typedef struct {
  uint8_t *buf;
  size_t len, cap;
} sbuf;

static void put(sbuf *b, const void *p, size_t n) {
  if (b->len + n > b->cap) {
    while (b->len + n > b->cap)
      b->cap = b->cap ? b->cap * 2 : 4096;
    if (!(b->buf = realloc(b->buf, b->cap))) {
      fprintf(stderr, "out of memory\n");
      exit(1);
    }
  }
  memcpy(b->buf + b->len, p, n);
  b->len += n;
}

/* One chunk (fuzz.h): ctl, 16-bit length, bytes. */
static void chunk(sbuf *b, uint8_t ctl, const uint8_t *p, size_t n) {
  uint8_t hdr[FUZZ_CHUNK_HDR] = {ctl, (uint8_t)n, (uint8_t)(n >> 8)};
  if (n > 0xffff) {
    fprintf(stderr, "chunk of %zu bytes is too long\n", n);
    exit(1);
  }
  put(b, hdr, sizeof hdr);
  put(b, p, n);
}

static void emit(const char *target, const char *name, const sbuf *b) {
  char path[512];
  FILE *f;
  snprintf(path, sizeof path, "%s/%s", out_dir, target);
  if (mkdir(path, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "mkdir %s: %s\n", path, strerror(errno));
    exit(1);
  }
  snprintf(path, sizeof path, "%s/%s/%s", out_dir, target, name);
  if (!(f = fopen(path, "wb")) || fwrite(b->buf, 1, b->len, f) != b->len || fclose(f) != 0) {
    fprintf(stderr, "cannot write %s\n", path);
    exit(1);
  }
}

static void emit_free(const char *target, const char *name, sbuf *b) {
  emit(target, name, b);
  free(b->buf);
  memset(b, 0, sizeof *b);
}

/* ---- daemon: request streams -------------------------------------------------------------- */

/* Appends one Request frame as one chunk with ctl (split into pieces of at most `piece` bytes
 * when piece > 0: frames that arrive a few bytes at a time). */
static void req_split(sbuf *b, uint8_t ctl, uint64_t seq, gpupool__req *r, size_t piece) {
  uint8_t *f;
  size_t n;
  r->seq = seq;
  if (gpupool__wire_pack_request(r, &f, &n) != 0) {
    fprintf(stderr, "cannot pack a request\n");
    exit(1);
  }
  if (piece == 0) {
    chunk(b, ctl, f, n);
  } else {
    for (size_t o = 0; o < n; o += piece)
      chunk(b, o == 0 ? ctl : 0, f + o, n - o < piece ? n - o : piece);
  }
  free(f);
}

/* ctl of the chunks req() writes. */
static uint8_t req_ctl;

static void req(sbuf *b, uint64_t seq, gpupool__req *r) { req_split(b, req_ctl, seq, r, 0); }

/* A request whose oneof body is `field` (case GPUPOOL__WIRE__REQUEST__BODY_<CASE>): how each
 * builder below ends once it has filled its message. */
#define REQ(b, seq, CASE, field, body)                                                                     \
  do {                                                                                                      \
    gpupool__req r_ = GPUPOOL__WIRE__REQUEST__INIT;                                                         \
    r_.body_case = GPUPOOL__WIRE__REQUEST__BODY_##CASE;                                                    \
    r_.field = (body);                                                                                      \
    req((b), (seq), &r_);                                                                                   \
  } while (0)

static void hello(sbuf *b, uint32_t version) {
  gpupool__req r;
  Gpupool__Wire__Hello h;
  ts_hello(&r, &h, version, "seed", 1234);
  req(b, 1, &r);
}

static void attach(sbuf *b, uint64_t seq, uint32_t pool) {
  Gpupool__Wire__AttachPool m = GPUPOOL__WIRE__ATTACH_POOL__INIT;
  m.pool_id = pool;
  REQ(b, seq, ATTACH_POOL, attach_pool, &m);
}

static void allocate(sbuf *b, uint64_t seq, const char *pool, uint64_t size, uint64_t align, uint32_t timeout) {
  Gpupool__Wire__Allocate m = GPUPOOL__WIRE__ALLOCATE__INIT;
  m.pool_name = (char *)pool;
  m.size = size;
  m.alignment = align;
  m.timeout_ms = timeout;
  REQ(b, seq, ALLOCATE, allocate, &m);
}

static void release(sbuf *b, uint64_t seq, uint64_t hold, int done) {
  Gpupool__Wire__Release m = GPUPOOL__WIRE__RELEASE__INIT;
  m.hold_id = hold;
  m.done_recorded = done;
  REQ(b, seq, RELEASE, release, &m);
}

static void share(sbuf *b, uint64_t seq, uint64_t hold) {
  Gpupool__Wire__Share m = GPUPOOL__WIRE__SHARE__INIT;
  m.hold_id = hold;
  REQ(b, seq, SHARE, share, &m);
}

static void open_token(sbuf *b, uint64_t seq, uint64_t buffer_id) {
  Gpupool__Wire__Open m = GPUPOOL__WIRE__OPEN__INIT;
  uint8_t tok[GPUPOOL_TOKEN_SIZE] = {0};
  for (int i = 0; i < 8; i++)
    tok[i] = (uint8_t)(buffer_id >> (8 * i));
  m.token.data = tok;
  m.token.len = sizeof tok;
  m.read_only = 1;
  REQ(b, seq, OPEN, open, &m);
}

static int64_t shape2[2] = {10, 25}, strides2[2] = {25, 1};

static void publish(sbuf *b, uint64_t seq, uint64_t hold, const char *name, int with_meta, int share_all) {
  Gpupool__Wire__Publish m = GPUPOOL__WIRE__PUBLISH__INIT;
  Gpupool__Wire__TensorMeta t = GPUPOOL__WIRE__TENSOR_META__INIT;
  /* share_all is field 6, reserved: sent as the unknown field an old client would send. */
  uint8_t one = 1;
  ProtobufCMessageUnknownField uf = {.tag = 6, .wire_type = PROTOBUF_C_WIRE_TYPE_VARINT, .len = 1, .data = &one};
  m.hold_id = hold;
  m.name = (char *)name;
  if (share_all) {
    m.base.n_unknown_fields = 1;
    m.base.unknown_fields = &uf;
  }
  if (with_meta) {
    ts_tensor_meta(&t, GPUPOOL_DTYPE_FLOAT, 32, 2, shape2);
    t.n_strides = with_meta > 1 ? 2 : 0;
    t.strides = strides2;
    m.tensor = &t;
  }
  REQ(b, seq, PUBLISH, publish, &m);
}

static void get(sbuf *b, uint64_t seq, const char *name, uint32_t timeout) {
  Gpupool__Wire__Get m = GPUPOOL__WIRE__GET__INIT;
  m.name = (char *)name;
  m.timeout_ms = timeout;
  m.read_only = 1;
  REQ(b, seq, GET, get, &m);
}

static void unpublish(sbuf *b, uint64_t seq, const char *name) {
  Gpupool__Wire__Unpublish m = GPUPOOL__WIRE__UNPUBLISH__INIT;
  m.name = (char *)name;
  REQ(b, seq, UNPUBLISH, unpublish, &m);
}

/* Requests without fields: Stats, Trim, AdminClients, AdminBuffers. */
static void simple(sbuf *b, uint64_t seq, Gpupool__Wire__Request__BodyCase which) {
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
  Gpupool__Wire__Trim tr = GPUPOOL__WIRE__TRIM__INIT;
  Gpupool__Wire__AdminClients ac = GPUPOOL__WIRE__ADMIN_CLIENTS__INIT;
  Gpupool__Wire__AdminBuffers ab = GPUPOOL__WIRE__ADMIN_BUFFERS__INIT;
  r.body_case = which;
  if (which == GPUPOOL__WIRE__REQUEST__BODY_STATS)
    r.stats = &st;
  else if (which == GPUPOOL__WIRE__REQUEST__BODY_TRIM)
    r.trim = &tr;
  else if (which == GPUPOOL__WIRE__REQUEST__BODY_ADMIN_CLIENTS)
    r.admin_clients = &ac;
  else
    r.admin_buffers = &ab;
  req(b, seq, &r);
}

/* AllocateBundle of n members m0.. (each size bytes; member 1 named like member 0 when dup). */
static void allocate_bundle(sbuf *b, uint64_t seq, int n, uint64_t size, int dup, uint32_t timeout) {
  Gpupool__Wire__AllocateBundle m = GPUPOOL__WIRE__ALLOCATE_BUNDLE__INIT;
  Gpupool__Wire__MemberSpec specs[8], *sp[8];
  Gpupool__Wire__TensorMeta t = GPUPOOL__WIRE__TENSOR_META__INIT;
  char names[8][8];
  ts_tensor_meta(&t, GPUPOOL_DTYPE_FLOAT, 32, 2, shape2);
  for (int i = 0; i < n && i < 8; i++) {
    gpupool__wire__member_spec__init(&specs[i]);
    snprintf(names[i], sizeof names[i], "m%d", dup && i == 1 ? 0 : i);
    specs[i].name = names[i];
    specs[i].size = size;
    specs[i].tensor = i == 0 ? &t : NULL;
    sp[i] = &specs[i];
  }
  m.pool_name = (char *)"a";
  m.n_members = (size_t)(n < 8 ? n : 8);
  m.members = sp;
  m.timeout_ms = timeout;
  REQ(b, seq, ALLOCATE_BUNDLE, allocate_bundle, &m);
}

/* PublishBundle of three members over holds h0 (and h1 when not 0). */
static void publish_bundle(sbuf *b, uint64_t seq, const char *name, uint64_t h0, uint64_t h1, uint64_t off) {
  Gpupool__Wire__PublishBundle m = GPUPOOL__WIRE__PUBLISH_BUNDLE__INIT;
  Gpupool__Wire__BundleMember mm[3], *mp[3];
  uint64_t holds[2] = {h0, h1};
  static const char *const nm[3] = {"w", "b", "norm"};
  for (int i = 0; i < 3; i++) {
    gpupool__wire__bundle_member__init(&mm[i]);
    mm[i].name = (char *)nm[i];
    mm[i].buffer = h1 && i == 2 ? 1 : 0;
    mm[i].offset = off * (uint64_t)i;
    mm[i].size = 100;
    mp[i] = &mm[i];
  }
  m.name = (char *)name;
  m.n_hold_ids = h1 ? 2 : 1;
  m.hold_ids = holds;
  m.n_members = 3;
  m.members = mp;
  REQ(b, seq, PUBLISH_BUNDLE, publish_bundle, &m);
}

static void get_bundle(sbuf *b, uint64_t seq, const char *name, uint64_t newer_than, uint32_t timeout) {
  Gpupool__Wire__GetBundle m = GPUPOOL__WIRE__GET_BUNDLE__INIT;
  m.name = (char *)name;
  m.newer_than = newer_than;
  m.timeout_ms = timeout;
  m.read_only = 1;
  REQ(b, seq, GET_BUNDLE, get_bundle, &m);
}

static void drop_client(sbuf *b, uint64_t seq, int32_t pid) {
  Gpupool__Wire__AdminDropClient m = GPUPOOL__WIRE__ADMIN_DROP_CLIENT__INIT;
  m.pid = pid;
  REQ(b, seq, ADMIN_DROP_CLIENT, admin_drop_client, &m);
}

static void daemon_seeds(void) {
  sbuf b = {0};
  uint8_t raw[16];

  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  emit_free("daemon", "hello", &b);

  /* A producer and a consumer's life on one connection: ids client 1, slab 2, buffer 3,
   * hold 4; the Get's hold is 5. */
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  attach(&b, 2, 1);
  allocate(&b, 3, "a", 1000, 0, 0);
  share(&b, 4, 4);
  publish(&b, 5, 4, "weights", 1, 0);
  get(&b, 6, "weights", 0);
  open_token(&b, 7, 3);
  simple(&b, 8, GPUPOOL__WIRE__REQUEST__BODY_STATS);
  unpublish(&b, 9, "weights");
  release(&b, 10, 5, 1);
  release(&b, 11, 4, 0);
  simple(&b, 12, GPUPOOL__WIRE__REQUEST__BODY_TRIM);
  emit_free("daemon", "flow", &b);

  /* Bundles and versions: ids client 1, slab 2, buffer 3, hold 4 (the bundle's one buffer);
   * then a second allocation (buffer 5, hold 6), versions 1 and 2 of one name, gets at and
   * past each, a waiting get of a version not yet made, and bad member tables. */
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  allocate_bundle(&b, 2, 4, 1000, 0, 0);
  allocate(&b, 3, "a", 1000, 0, 0);
  publish_bundle(&b, 4, "dict", 4, 0, 256);
  publish_bundle(&b, 5, "dict", 4, 6, 200);
  get_bundle(&b, 6, "dict", 0, 0);
  get_bundle(&b, 7, "dict", 1, 0);
  get_bundle(&b, 8, "dict", 2, 50);
  publish_bundle(&b, 9, "bad", 4, 0, 950);
  allocate_bundle(&b, 10, 3, 100, 1, 0);
  allocate_bundle(&b, 11, 2, UINT64_MAX / 2, 0, 0);
  allocate_bundle(&b, 12, 8, 64 << 20, 0, 100);
  get(&b, 13, "dict", 0);
  unpublish(&b, 14, "dict");
  emit_free("daemon", "bundles", &b);

  /* The same frames a few bytes at a time. */
  {
    gpupool__req r;
    Gpupool__Wire__Hello h;
    ts_hello(&r, &h, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, "split", 0);
    req_split(&b, 0, 1, &r, 3);
    allocate(&b, 2, "", 4096, 4096, 0);
    publish(&b, 3, 4, "strided", 2, 1);
    simple(&b, 4, GPUPOOL__WIRE__REQUEST__BODY_STATS);
    emit_free("daemon", "split", &b);
  }

  /* Holds still held when the client hangs up, a slab reported unmapped. */
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  allocate(&b, 2, "a", 100, 0, 0);
  allocate(&b, 3, "a", 3u << 20, 0, 0); /* over the 2 MiB slab: a dedicated one */
  allocate(&b, 4, "b", 5000, 64, 0);
  publish(&b, 5, 4, "kept", 0, 0);
  {
    gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
    Gpupool__Wire__Stats st = GPUPOOL__WIRE__STATS__INIT;
    uint64_t unmapped[2] = {2, 99};
    r.n_unmapped_slabs = 2;
    r.unmapped_slabs = unmapped;
    r.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
    r.stats = &st;
    req(&b, 6, &r);
  }
  emit_free("daemon", "hangup_holding", &b);

  /* Requests that wait: memory (pool b holds one 6 MiB slab) and a name. */
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  allocate(&b, 2, "b", 6u << 20, 0, 0);
  allocate(&b, 3, "b", 6u << 20, 0, 1);
  allocate(&b, 4, "b", 6u << 20, 0, 60000);
  get(&b, 5, "later", 60000);
  allocate(&b, 6, "a", 64, 0, 0);
  publish(&b, 7, 6, "later", 1, 0);
  release(&b, 8, 4, 0);
  emit_free("daemon", "waits", &b);

  /* The operator's requests (the fuzzer runs as root in CI, so they are allowed). */
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  allocate(&b, 2, "a", 4096, 0, 0);
  publish(&b, 3, 4, "listed", 0, 0);
  simple(&b, 4, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_CLIENTS);
  simple(&b, 5, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_BUFFERS);
  drop_client(&b, 6, 1);
  simple(&b, 7, GPUPOOL__WIRE__REQUEST__BODY_TRIM);
  emit_free("daemon", "admin", &b);

  /* Limits: 16 allocations per client, 8 names. */
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  for (int i = 0; i < 17; i++)
    allocate(&b, 2 + (uint64_t)i, "a", 1, 0, 0);
  for (int i = 0; i < 9; i++) {
    char name[8];
    snprintf(name, sizeof name, "n%d", i);
    publish(&b, 20 + (uint64_t)i, 4, name, 0, 0);
  }
  emit_free("daemon", "limits", &b);

  /* Pipelined requests whose replies are not read: the server's reply queue fills. */
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  allocate(&b, 2, "a", 4096, 0, 0);
  publish(&b, 3, 4, "queued", 1, 0);
  req_ctl = 0x40; /* fuzz_daemon.c: no read of the replies after these */
  for (int i = 0; i < 40; i++) {
    get(&b, 4 + 2 * (uint64_t)i, "queued", 0);
    simple(&b, 5 + 2 * (uint64_t)i, GPUPOOL__WIRE__REQUEST__BODY_ADMIN_BUFFERS);
  }
  req_ctl = 0;
  memcpy(raw, "\x05\x00\x00\x00\xff\xff\xff\xff\xff", 9); /* then a malformed frame */
  chunk(&b, 0x40, raw, 9);
  emit_free("daemon", "unread_replies", &b);

  /* Protocol violations, each answered and followed by a hang-up. */
  simple(&b, 1, GPUPOOL__WIRE__REQUEST__BODY_STATS);
  emit_free("daemon", "no_hello", &b);
  hello(&b, 999);
  emit_free("daemon", "wrong_version", &b);
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  emit_free("daemon", "hello_twice", &b);
  {
    gpupool__req r;
    Gpupool__Wire__Hello h;
    ts_hello(&r, &h, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, "", 0);
    req_split(&b, 2, 1, &r, 0); /* two fds with the Hello */
    simple(&b, 2, GPUPOOL__WIRE__REQUEST__BODY_STATS);
    req_split(&b, 6, 3, &r, 0); /* six: more than a frame may carry */
    emit_free("daemon", "fds", &b);
  }
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  memcpy(raw, "\xff\xff\xff\x7f", 4); /* a 2 GiB frame header */
  chunk(&b, 0, raw, 4);
  emit_free("daemon", "oversized", &b);
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  memcpy(raw, "\x05\x00\x00\x00\xff\xff\xff\xff\xff", 9); /* not a Request */
  chunk(&b, 0, raw, 9);
  emit_free("daemon", "malformed", &b);
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  memcpy(raw, "\x00\x00\x00\x00\x08\x00\x00\x00\x08\x01", 10); /* empty frame, cut frame */
  chunk(&b, 0, raw, 10);
  emit_free("daemon", "empty_and_cut", &b);
}

/* ---- client: reply streams -------------------------------------------------------------- */

#define POOL_CAP (64ull << 20)
#define SLAB (2ull << 20)

static void rep(sbuf *b, uint8_t ctl, uint64_t seq, gpupool__rep *r) {
  uint8_t *f;
  size_t n;
  r->seq = seq;
  if (gpupool__wire_pack_reply(r, &f, &n) != 0) {
    fprintf(stderr, "cannot pack a reply\n");
    exit(1);
  }
  chunk(b, ctl, f, n);
  free(f);
}

/* The reply form of REQ, in chunks of ctl. */
#define REP(b, ctl, seq, CASE, field, body)                                                                \
  do {                                                                                                      \
    gpupool__rep r_ = GPUPOOL__WIRE__REPLY__INIT;                                                           \
    r_.body_case = GPUPOOL__WIRE__REPLY__BODY_##CASE;                                                      \
    r_.field = (body);                                                                                      \
    rep((b), (ctl), (seq), &r_);                                                                            \
  } while (0)

static void pool_info(Gpupool__Wire__PoolInfo *p) {
  ts_host_pool_info(p, POOL_CAP);
  p->numa_node = -1;
  p->slab_size = SLAB;
  p->max_alloc = POOL_CAP;
}

static void hello_reply(sbuf *b, uint32_t version, int backend) {
  Gpupool__Wire__HelloReply h = GPUPOOL__WIRE__HELLO_REPLY__INIT;
  Gpupool__Wire__PoolInfo p, *pp = &p;
  pool_info(&p);
  h.protocol_version = version;
  h.daemon_version = (char *)"0.1.0";
  h.backend = backend;
  h.n_pools = 1;
  h.pools = &pp;
  h.client_id = 1;
  h.max_frame = 1u << 20;
  REP(b, 0, 1, HELLO, hello, &h);
}

static void stats_reply(sbuf *b, uint64_t seq, uint64_t revoke) {
  gpupool__rep r = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__StatsReply s = GPUPOOL__WIRE__STATS_REPLY__INIT;
  Gpupool__Wire__PoolInfo p, *pp = &p;
  pool_info(&p);
  s.n_pools = 1;
  s.pools = &pp;
  s.clients = 1;
  s.daemon_version = (char *)"0.1.0";
  s.backend = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST;
  r.body_case = GPUPOOL__WIRE__REPLY__BODY_STATS;
  r.stats = &s;
  if (revoke) {
    r.n_revoke_slabs = 1;
    r.revoke_slabs = &revoke;
  }
  rep(b, 0, seq, &r);
}

static int64_t shape_get[2] = {16, 64};

/* A reply carrying a buffer (Allocate, Open or Get) in slab `slab` at `slab_off` in the pool's
 * memfd; with_export: the slab's export data (the first buffer of a slab this client sees). */
static void buffer_reply(sbuf *b, uint64_t seq, Gpupool__Wire__Reply__BodyCase kind, uint64_t hold, uint64_t slab,
                         uint64_t slab_off, uint64_t slab_size, int with_export, int with_meta) {
  gpupool__rep r = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__AllocateReply ar = GPUPOOL__WIRE__ALLOCATE_REPLY__INIT;
  Gpupool__Wire__OpenReply orp = GPUPOOL__WIRE__OPEN_REPLY__INIT;
  Gpupool__Wire__GetReply gr = GPUPOOL__WIRE__GET_REPLY__INIT;
  Gpupool__Wire__BufferDesc d = GPUPOOL__WIRE__BUFFER_DESC__INIT;
  Gpupool__Wire__SlabRef s = GPUPOOL__WIRE__SLAB_REF__INIT;
  Gpupool__Wire__TensorMeta t = GPUPOOL__WIRE__TENSOR_META__INIT;
  uint8_t ex[GPUPOOL__HOST_EXPORT_LEN];
  d.buffer_id = 3;
  d.hold_id = hold;
  d.pool_id = 1;
  d.offset = 0;
  d.size = 4096;
  d.read_only = kind == GPUPOOL__WIRE__REPLY__BODY_GET;
  s.id = slab;
  s.pool_id = 1;
  s.size = slab_size;
  s.dedicated = slab_size > SLAB;
  if (with_export) {
    s.export_data.data = ex;
    s.export_data.len = gpupool__host_export_encode(&(gpupool__host_export){.offset = slab_off, .size = slab_size}, ex);
  }
  d.slab = &s;
  if (with_meta) {
    ts_tensor_meta(&t, GPUPOOL_DTYPE_FLOAT, 32, 2, shape_get);
    d.tensor = &t;
  }
  r.body_case = kind;
  if (kind == GPUPOOL__WIRE__REPLY__BODY_ALLOCATE) {
    ar.buffer = &d;
    r.allocate = &ar;
  } else if (kind == GPUPOOL__WIRE__REPLY__BODY_OPEN) {
    orp.buffer = &d;
    r.open = &orp;
  } else {
    gr.buffer = &d;
    r.get = &gr;
  }
  rep(b, 0, seq, &r);
}

/* A GetBundle reply: one buffer (hold `hold`, 4 KiB in slab 2, already mapped) and, unless
 * the client has the table (with_members 0), two members, one with a description. */
static void bundle_reply(sbuf *b, uint64_t seq, uint64_t hold, int with_members, int with_export) {
  Gpupool__Wire__GetBundleReply gr = GPUPOOL__WIRE__GET_BUNDLE_REPLY__INIT;
  Gpupool__Wire__Bundle bd = GPUPOOL__WIRE__BUNDLE__INIT;
  Gpupool__Wire__BufferDesc d = GPUPOOL__WIRE__BUFFER_DESC__INIT, *dp = &d;
  Gpupool__Wire__SlabRef s = GPUPOOL__WIRE__SLAB_REF__INIT;
  Gpupool__Wire__BundleMember m[2], *mp[2];
  Gpupool__Wire__TensorMeta t = GPUPOOL__WIRE__TENSOR_META__INIT;
  static int64_t shape1[1] = {256};
  uint8_t ex[GPUPOOL__HOST_EXPORT_LEN];
  if (with_export) {
    /* The slab's own fd rides on this frame (a sealed 2 MiB memfd, as host slabs are). */
    s.export_data.data = ex;
    s.export_data.len = gpupool__host_export_encode(&(gpupool__host_export){.offset = 0, .size = SLAB}, ex);
    s.fd_attached = 1;
  }
  d.buffer_id = 3;
  d.hold_id = hold;
  d.pool_id = 1;
  d.size = 4096;
  d.read_only = 1;
  s.id = 2;
  s.pool_id = 1;
  s.size = SLAB;
  d.slab = &s;
  for (int i = 0; i < 2; i++) {
    gpupool__wire__bundle_member__init(&m[i]);
    mp[i] = &m[i];
  }
  m[0].name = (char *)"w";
  m[0].size = 1024;
  ts_tensor_meta(&t, GPUPOOL_DTYPE_FLOAT, 32, 1, shape1);
  m[0].tensor = &t;
  m[1].name = (char *)"b";
  m[1].offset = 1024;
  m[1].size = 3072;
  bd.n_buffers = 1;
  bd.buffers = &dp;
  bd.n_members = with_members ? 2 : 0;
  bd.members = mp;
  bd.version = 1;
  bd.layout_id = 40;
  gr.bundle = &bd;
  REP(b, with_export ? (1 | FUZZ_CTL_SEALED | (1 << 4)) : 0, seq, GET_BUNDLE, get_bundle, &gr);
}

/* The pool's fd rides on this reply: ctl asks for one sealed memfd of 64 MiB. */
static void attach_reply(sbuf *b, uint64_t seq, uint8_t ctl) {
  Gpupool__Wire__AttachPoolReply a = GPUPOOL__WIRE__ATTACH_POOL_REPLY__INIT;
  Gpupool__Wire__PoolInfo p;
  pool_info(&p);
  a.pool = &p;
  REP(b, ctl, seq, ATTACH_POOL, attach_pool, &a);
}

#define CTL_POOL_FD (1 | FUZZ_CTL_SEALED | (3 << 4))

static void share_reply(sbuf *b, uint64_t seq) {
  Gpupool__Wire__ShareReply s = GPUPOOL__WIRE__SHARE_REPLY__INIT;
  uint8_t tok[GPUPOOL_TOKEN_SIZE] = {3};
  s.token.data = tok;
  s.token.len = sizeof tok;
  REP(b, 0, seq, SHARE, share, &s);
}

/* Replies without fields worth setting. */
static void empty_reply(sbuf *b, uint64_t seq, Gpupool__Wire__Reply__BodyCase kind) {
  gpupool__rep r = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__PublishReply p = GPUPOOL__WIRE__PUBLISH_REPLY__INIT;
  Gpupool__Wire__TrimReply t = GPUPOOL__WIRE__TRIM_REPLY__INIT;
  Gpupool__Wire__UnpublishReply u = GPUPOOL__WIRE__UNPUBLISH_REPLY__INIT;
  Gpupool__Wire__ReleaseReply rl = GPUPOOL__WIRE__RELEASE_REPLY__INIT;
  r.body_case = kind;
  if (kind == GPUPOOL__WIRE__REPLY__BODY_PUBLISH)
    r.publish = &p;
  else if (kind == GPUPOOL__WIRE__REPLY__BODY_TRIM)
    r.trim = &t;
  else if (kind == GPUPOOL__WIRE__REPLY__BODY_UNPUBLISH)
    r.unpublish = &u;
  else {
    rl.freed = seq == 13;
    r.release = &rl;
  }
  rep(b, 0, seq, &r);
}

static void error_reply(sbuf *b, uint64_t seq, int code, const char *msg) {
  gpupool__rep r = GPUPOOL__WIRE__REPLY__INIT;
  Gpupool__Wire__Error e = GPUPOOL__WIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)msg;
  r.error = &e;
  rep(b, 0, seq, &r);
}

static void client_seeds(void) {
  sbuf b = {0};

  /* Every call of the harness answered as gpupoold would (fuzz_client.c lists them). */
  hello_reply(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST);
  stats_reply(&b, 2, 0);
  buffer_reply(&b, 3, GPUPOOL__WIRE__REPLY__BODY_ALLOCATE, 4, 2, 0, SLAB, 1, 0);
  attach_reply(&b, 4, CTL_POOL_FD);
  share_reply(&b, 5);
  empty_reply(&b, 6, GPUPOOL__WIRE__REPLY__BODY_PUBLISH);
  buffer_reply(&b, 7, GPUPOOL__WIRE__REPLY__BODY_OPEN, 5, 2, 0, SLAB, 0, 0);
  buffer_reply(&b, 8, GPUPOOL__WIRE__REPLY__BODY_GET, 6, 2, 0, SLAB, 0, 1);
  empty_reply(&b, 9, GPUPOOL__WIRE__REPLY__BODY_TRIM);
  empty_reply(&b, 10, GPUPOOL__WIRE__REPLY__BODY_UNPUBLISH);
  for (uint64_t s = 11; s <= 13; s++)
    empty_reply(&b, s, GPUPOOL__WIRE__REPLY__BODY_RELEASE);
  emit_free("client", "flow", &b);

  /* Every earlier call refused, then a bundle got twice: with its member table (the pool
   * attached and the slab mapped on the way), then without it (known layout). */
  hello_reply(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST);
  for (uint64_t s = 2; s <= 6; s++)
    error_reply(&b, s, GPUPOOL_EPERM, "refused");
  bundle_reply(&b, 7, 7, 1, 1);
  attach_reply(&b, 8, CTL_POOL_FD);
  empty_reply(&b, 9, GPUPOOL__WIRE__REPLY__BODY_RELEASE);
  bundle_reply(&b, 10, 8, 0, 0);
  empty_reply(&b, 11, GPUPOOL__WIRE__REPLY__BODY_RELEASE);
  emit_free("client", "bundles", &b);

  /* Buffers in different slabs, one of them dedicated, and a revoked slab. */
  hello_reply(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST);
  stats_reply(&b, 2, 7);
  buffer_reply(&b, 3, GPUPOOL__WIRE__REPLY__BODY_ALLOCATE, 4, 2, 2ull << 20, SLAB, 1, 0);
  attach_reply(&b, 4, CTL_POOL_FD);
  share_reply(&b, 5);
  empty_reply(&b, 6, GPUPOOL__WIRE__REPLY__BODY_PUBLISH);
  buffer_reply(&b, 7, GPUPOOL__WIRE__REPLY__BODY_OPEN, 5, 8, 4ull << 20, 8ull << 20, 1, 0);
  buffer_reply(&b, 8, GPUPOOL__WIRE__REPLY__BODY_GET, 6, 9, 16ull << 20, SLAB, 1, 1);
  stats_reply(&b, 9, 2);
  emit_free("client", "slabs", &b);

  /* Errors: a refused connection, an old daemon, a CUDA daemon, failed requests. */
  error_reply(&b, 0, GPUPOOL_ELIMIT, "gpupoold already serves 1024 clients, its limit (max_clients); try later");
  emit_free("client", "refused", &b);
  hello_reply(&b, 99, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST);
  emit_free("client", "wrong_version", &b);
  hello_reply(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_CUDA);
  emit_free("client", "cuda_daemon", &b);
  hello_reply(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST);
  error_reply(&b, 2, GPUPOOL_EPERM, "no stats for you");
  error_reply(&b, 3, GPUPOOL_ENOSPC, "pool 'default' is out of memory");
  error_reply(&b, 4, GPUPOOL_ENOENT, "no buffer is published under 'fuzz'");
  error_reply(&b, 5, -1000, "a code from the future");
  emit_free("client", "errors", &b);

  /* Replies out of order, for no request, and a dropped connection's last word. */
  hello_reply(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST);
  empty_reply(&b, 3, GPUPOOL__WIRE__REPLY__BODY_TRIM);
  stats_reply(&b, 2, 0);
  emit_free("client", "unknown_seq", &b);
  hello_reply(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST);
  error_reply(&b, 0, GPUPOOL_EPROTO, "malformed request frame (not a valid gpupool Request); closing the connection");
  emit_free("client", "dropped", &b);
}

/* ---- config: files and --pool specs ------------------------------------------------------- */

static void text(sbuf *b, const char *s) { put(b, s, strlen(s)); }

/* config/gpupoold.conf, the commented example with every key, is a seed as well: tools/fuzz.sh
 * and ctest pass config/ to fuzz_config next to this corpus, so it is never copied here. */
static void config_seeds(void) {
  sbuf b = {0};

  text(&b, "[daemon]\nsocket = /tmp/g.sock\nbackend = host\nlog_level = debug\nsocket_mode = 0600\n"
           "max_frame = 64K\nallow_uids = 0, 1000 1001\nallow_gids = 100\nbusy_poll_us = 500\n"
           "max_bytes_per_uid = 1T\nmax_allocs_per_uid = 10\n\n; comment\n[pool]\ncapacity = 4GiB\n"
           "slab_size = 3M\nalignment = 4K\nkeep_slabs = 2\nrelease_threshold = 1G\n"
           "reuse_follow_event_deps = yes\nreuse_allow_opportunistic = off\n"
           "[pool second]\nkind = host\ncapacity = 64mb\n");
  emit_free("config", "all_keys", &b);

  put(&b, "", 1);
  text(&b, "name=a,kind=host,capacity=16M,slab=2M,align=256,keep=1");
  put(&b, "", 1);
  text(&b, "name=b, kind=host, capacity=1G, slab=4G");
  put(&b, "", 1);
  text(&b, "capacity=8M,slab=2M,release_threshold=0");
  emit_free("config", "pool_specs", &b);

  text(&b, "[pool x]\nkind = device\ndevice = 3\n[daemon]\nmax_frame = 1K\n");
  emit_free("config", "refused", &b);
}

/* ---- meta: buffer size + TensorMeta ------------------------------------------------------- */

static void meta_seed(const char *name, uint32_t size, uint32_t code, uint32_t bits, uint32_t lanes, size_t ndim,
                      const int64_t *shape, size_t nstrides, const int64_t *strides, uint64_t offset) {
  sbuf b = {0};
  Gpupool__Wire__TensorMeta t = GPUPOOL__WIRE__TENSOR_META__INIT;
  uint8_t hdr[4] = {(uint8_t)size, (uint8_t)(size >> 8), (uint8_t)(size >> 16), (uint8_t)(size >> 24)};
  uint8_t *p;
  size_t n;
  ts_tensor_meta(&t, code, bits, ndim, (int64_t *)shape);
  t.dtype_lanes = lanes;
  t.n_strides = nstrides;
  t.strides = (int64_t *)strides;
  t.byte_offset = offset;
  n = gpupool__wire__tensor_meta__get_packed_size(&t);
  if (!(p = malloc(n ? n : 1))) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  gpupool__wire__tensor_meta__pack(&t, p);
  put(&b, hdr, sizeof hdr);
  put(&b, p, n);
  free(p);
  emit_free("meta", name, &b);
}

static void meta_seeds(void) {
  static const int64_t s2[2] = {16, 64}, st2[2] = {128, 1}, s0[2] = {0, 5}, big[2] = {1ll << 40, 1ll << 40};
  static const int64_t ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, neg[2] = {-1, 1};
  static const int64_t s3[3] = {2, 3, 4}, st3[3] = {0, 4, 1};
  /* The buffer sizes are one less than asked: the harness adds 1. */
  meta_seed("contiguous", 4095, GPUPOOL_DTYPE_FLOAT, 32, 1, 2, s2, 0, NULL, 0);
  meta_seed("strided_offset", 16383, GPUPOOL_DTYPE_INT, 16, 1, 2, s2, 2, st2, 128);
  meta_seed("broadcast", 63, GPUPOOL_DTYPE_UINT, 8, 1, 3, s3, 3, st3, 0);
  meta_seed("scalar", 7, GPUPOOL_DTYPE_COMPLEX, 32, 2, 0, NULL, 0, NULL, 0);
  meta_seed("empty", 0, GPUPOOL_DTYPE_BOOL, 8, 1, 2, s0, 0, NULL, 64);
  meta_seed("bf16x4", 1023, GPUPOOL_DTYPE_BFLOAT, 16, 4, 16, ones, 16, ones, 1016);
  meta_seed("too_big", 4095, GPUPOOL_DTYPE_FLOAT, 32, 1, 2, s2, 0, NULL, 1);
  meta_seed("overflow", 4095, GPUPOOL_DTYPE_FLOAT, 64, 1, 2, big, 0, NULL, 0);
  meta_seed("negative", 4095, GPUPOOL_DTYPE_FLOAT, 32, 1, 2, neg, 0, NULL, 0);
  meta_seed("fp8", (5u << 20) - 1, 7, 8, 1, 2, s2, 2, st2, 0);
}

/* ---- wire: single messages for the pre-unpack check ------------------------------------------ */

/* The frame a builder left as the first chunk of b, as a fuzz_wire input: sel (0 Request,
 * 1 Reply), then the payload; every '#' in it becomes a NUL when nul is set (protobuf-c packs
 * C strings, which cannot hold one). */
static void wire_seed(const char *name, uint8_t sel, sbuf *b, int nul, size_t unknown) {
  sbuf out = {0};
  size_t n = b->len > FUZZ_CHUNK_HDR + GPUPOOL_WIRE_HDR ? (size_t)b->buf[1] | (size_t)b->buf[2] << 8 : 0;
  if (n < GPUPOOL_WIRE_HDR || FUZZ_CHUNK_HDR + n > b->len) {
    fprintf(stderr, "wire seed %s: no frame\n", name);
    exit(1);
  }
  put(&out, &sel, 1);
  put(&out, b->buf + FUZZ_CHUNK_HDR + GPUPOOL_WIRE_HDR, n - GPUPOOL_WIRE_HDR);
  for (size_t i = 1; nul && i < out.len; i++)
    if (out.buf[i] == '#')
      out.buf[i] = '\0';
  for (size_t i = 0; i < unknown; i++) /* field 1000, varint 1 */
    put(&out, "\xc0\x3e\x01", 3);
  emit_free("wire", name, &out);
  free(b->buf);
  memset(b, 0, sizeof *b);
}

static void wire_seeds(void) {
  sbuf b = {0};
  gpupool__req r = GPUPOOL__WIRE__REQUEST__INIT;
  uint64_t slabs[3] = {1, 300, 1ull << 40};
  hello(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION);
  wire_seed("hello", 0, &b, 0, 0);
  publish(&b, 2, 3, "w", 2, 0);
  wire_seed("publish_meta", 0, &b, 0, 0);
  publish(&b, 2, 3, "nul#tail", 0, 0);
  wire_seed("publish_nul", 0, &b, 1, 0);
  publish(&b, 2, 3, "gr\xc3\xbc\xc3\x9f", 0, 0);
  wire_seed("publish_utf8", 0, &b, 0, 0);
  publish(&b, 2, 3, "bad\xc0\xaf", 0, 0);
  wire_seed("publish_overlong", 0, &b, 0, 0);
  allocate_bundle(&b, 3, 3, 64, 0, 0);
  wire_seed("allocate_bundle", 0, &b, 0, 0);
  publish_bundle(&b, 4, "dict", 4, 6, 200);
  wire_seed("publish_bundle", 0, &b, 0, 0);
  get_bundle(&b, 6, "dict", 1, 0);
  wire_seed("get_bundle", 0, &b, 0, 0);
  simple(&b, 5, GPUPOOL__WIRE__REQUEST__BODY_STATS);
  wire_seed("stats_unknown_3", 0, &b, 0, 3);
  simple(&b, 5, GPUPOOL__WIRE__REQUEST__BODY_STATS);
  wire_seed("stats_unknown_65", 0, &b, 0, 65);
  r.n_unmapped_slabs = 3; /* packed repeated varints */
  r.unmapped_slabs = slabs;
  r.body_case = GPUPOOL__WIRE__REQUEST__BODY_STATS;
  r.stats = &(Gpupool__Wire__Stats)GPUPOOL__WIRE__STATS__INIT;
  req(&b, 9, &r);
  wire_seed("unmapped_slabs", 0, &b, 0, 0);
  hello_reply(&b, GPUPOOL__WIRE__VERSION__PROTOCOL_VERSION, GPUPOOL__WIRE__BACKEND_KIND__BACKEND_HOST);
  wire_seed("hello_reply", 1, &b, 0, 0);
  stats_reply(&b, 2, 7);
  wire_seed("stats_reply", 1, &b, 0, 0);
  bundle_reply(&b, 7, 7, 1, 1);
  wire_seed("bundle_reply", 1, &b, 0, 0);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUT_DIR (tests/fuzz/corpus to regenerate the checked-in seeds)\n", argv[0]);
    return 2;
  }
  out_dir = argv[1];
  if (mkdir(out_dir, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "mkdir %s: %s\n", out_dir, strerror(errno));
    return 1;
  }
  daemon_seeds();
  client_seeds();
  config_seeds();
  meta_seeds();
  wire_seeds();
  return 0;
}
