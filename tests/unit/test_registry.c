/*
 * Unit tests of the daemon's registry on the host backend, without sockets: holders and the
 * exactly-once return of memory, names and their visibility, share tokens, slab placement and
 * dedicated slabs, revocation of surplus slabs, limits, dropping a client, the lease that
 * keeps a closed connection's memory until no process holds it, and (with a backend whose
 * pool fd maps every allocation, as CUDA's does) one backend pool per tenant.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmocka.h>
#include <uv.h>

#include "backend.h"
#include "config.h"
#include "errors.h"
#include "frames.h"
#include "registry.h"

/* The registry takes names resolved once (gpd_name_key), as a request's handler resolves
 * them; an error of the resolution is reported by the call that uses the name. */
/* A publish of c's hold id, found as a handler finds it (gpd_hold_of). */
static int publish_id(gpd_registry *reg, gpd_client *c, uint64_t id, const gpd_rname *name,
                      const Gpupool__Wire__TensorMeta *meta, gid_t share_gid, int share_all, uint64_t *version) {
  gpd_hold *h;
  int rc = gpd_hold_of(reg, c, id, &h);
  return rc ? rc : gpd_publish(reg, c, h, name, meta, share_gid, share_all, version);
}

static const gpd_rname *rn(gpd_registry *reg, gpd_client *c, const char *name) {
  static gpd_rname ring[8];
  static unsigned next;
  gpd_rname *r = &ring[next++ % 8];
  gpd_name_key(reg, c, name, r);
  return r;
}

#define MIB (1ull << 20)

typedef struct {
  uv_loop_t loop;
  gpd_config cfg;
  gpupool__backend *be;
  gpd_registry reg;
  gpd_client a, b; /* uids 1000 and 1001: one tenant ("team") */
  gpd_client x;    /* uid 2000: another tenant; with a, in group "ml" */
  int a_peer, b_peer, x_peer; /* the client ends of their leases, as a client process would hold them */
} fixture;

static int g_tenant_pools; /* the next setup uses the per-tenant-pool backend below */
static void use_tenant_pools(gpupool__backend *be);

static void give_lease(fixture *f, gpd_client *c, int *peer) {
  assert_int_equal(gpd_lease_new(&f->reg, c->uid, c->gid, 0, &c->lease, peer), 0);
}

static int setup_with(void **state, void (*tweak)(gpd_config *)) {
  fixture *f = calloc(1, sizeof *f);
  assert_non_null(f);
  uv_loop_init(&f->loop);
  gpd_config_defaults(&f->cfg);
  assert_int_equal(gpd_config_add_pool_spec(&f->cfg, "name=p,kind=host,capacity=64M,slab=8M,keep=1"), 0);
  assert_int_equal(gpd_config_add_pool_spec(&f->cfg, "name=s,kind=host,capacity=16M,slab=4M,keep=1"), 0);
  f->cfg.n_tenants = 1;
  snprintf(f->cfg.tenants[0].name, sizeof f->cfg.tenants[0].name, "team");
  f->cfg.tenants[0].uids[0] = 1000;
  f->cfg.tenants[0].uids[1] = 1001;
  f->cfg.tenants[0].n_uids = 2;
  f->cfg.n_groups = 1;
  snprintf(f->cfg.groups[0].name, sizeof f->cfg.groups[0].name, "ml");
  f->cfg.groups[0].uids[0] = 1000;
  f->cfg.groups[0].uids[1] = 2000;
  f->cfg.groups[0].n_uids = 2;
  snprintf(f->cfg.pool_share_name[1], sizeof f->cfg.pool_share_name[1], "ml");
  if (tweak)
    tweak(&f->cfg);
  assert_int_equal(gpd_config_finish(&f->cfg, &gpupool__backend_host), 0);
  assert_int_equal(gpupool__backend_host.open(&f->be), 0);
  if (g_tenant_pools)
    use_tenant_pools(f->be);
  g_tenant_pools = 0;
  assert_int_equal(gpd_registry_init(&f->reg, &f->loop, &f->cfg, f->be), 0);
  f->a.uid = 1000;
  f->b.uid = 1001;
  f->x.uid = 2000;
  give_lease(f, &f->a, &f->a_peer);
  give_lease(f, &f->b, &f->b_peer);
  give_lease(f, &f->x, &f->x_peer);
  gpd_client_init(&f->reg, &f->a);
  gpd_client_init(&f->reg, &f->b);
  gpd_client_init(&f->reg, &f->x);
  *state = f;
  return 0;
}

static int setup(void **state) { return setup_with(state, NULL); }

static int teardown(void **state) {
  fixture *f = *state;
  if (f->a_peer >= 0)
    close(f->a_peer);
  if (f->b_peer >= 0)
    close(f->b_peer);
  if (f->x_peer >= 0)
    close(f->x_peer);
  gpd_client_drop(&f->reg, &f->a);
  gpd_client_drop(&f->reg, &f->b);
  gpd_client_drop(&f->reg, &f->x);
  gpd_registry_close(&f->reg);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  f->be->ops->close(f->be);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  free(f);
  return 0;
}

static gpd_pool *pool(fixture *f) { return gpd_pool_find(&f->reg, "p", 0); }

static void test_holders_and_exactly_once(void **state) {
  fixture *f = *state;
  gpd_hold *h, *o;
  uint8_t tok[GPUPOOL_TOKEN_SIZE];
  int freed = -1;

  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 1000, 0, &h), 0);
  assert_int_equal(pool(f)->used, 1024); /* rounded to the 256-byte alignment */
  assert_int_equal(gpd_share(&f->reg, &f->a, h->id, 0, tok), 0);
  /* Another tenant's token opens nothing (its holder would get the slab's fd). */
  assert_int_equal(gpd_open(&f->reg, &f->x, tok, sizeof tok, 1, &o), GPUPOOL_ENOENT);
  assert_int_equal(gpd_open(&f->reg, &f->b, tok, sizeof tok, 1, &o), 0);
  assert_ptr_equal(o->buf, h->buf);
  assert_int_equal(h->buf->refs, 2);
  /* b cannot release a's hold, a cannot release b's. */
  assert_int_equal(gpd_release(&f->reg, &f->b, h->id, 0, &freed), GPUPOOL_EPERM);
  assert_int_equal(gpd_release(&f->reg, &f->a, o->id, 0, &freed), GPUPOOL_EPERM);
  uint64_t hid = h->id, oid = o->id;
  assert_int_equal(gpd_release(&f->reg, &f->a, hid, 0, &freed), 0);
  assert_int_equal(freed, 0);
  assert_int_equal(pool(f)->used, 1024); /* the opener still holds it */
  assert_int_equal(gpd_release(&f->reg, &f->b, oid, 0, &freed), 0);
  assert_int_equal(freed, 1);
  assert_int_equal(pool(f)->used, 0);
  assert_int_equal(pool(f)->nbuffers, 0);
  /* Released holds are gone; the token names nothing now. */
  assert_int_equal(gpd_release(&f->reg, &f->b, oid, 0, &freed), GPUPOOL_ENOENT);
  assert_int_equal(gpd_open(&f->reg, &f->b, tok, sizeof tok, 0, &o), GPUPOOL_ENOENT);
  assert_int_equal(f->reg.buffers.len, 0);
  assert_int_equal(f->reg.holds.len, 0);
}

static void test_names(void **state) {
  fixture *f = *state;
  gpd_hold *h, *g, *o;
  int freed;
  Gpupool__Wire__TensorMeta m = GPUPOOL__WIRE__TENSOR_META__INIT;
  int64_t shape[2] = {10, 10};

  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 400, 0, &h), 0);
  ts_tensor_meta(&m, GPUPOOL_DTYPE_FLOAT, 32, 2, shape);
  {
    uint64_t v = 0;
    assert_int_equal(publish_id(&f->reg, &f->a, h->id, rn(&f->reg, &f->a, "t"), &m, 0, 0, &v), 0);
    assert_int_equal(v, 1);
    /* Publishing again makes the next version. */
    assert_int_equal(publish_id(&f->reg, &f->a, h->id, rn(&f->reg, &f->a, "t"), &m, 0, 0, &v), 0);
    assert_int_equal(v, 2);
    assert_int_equal(gpd_get(&f->reg, &f->b, rn(&f->reg, &f->b, "t"), 1, 2, &g, &v), GPUPOOL_ENOENT);
    assert_non_null(strstr(gpupool__errmsg(), "not newer than 2"));
  }
  shape[0] = 11; /* 440 bytes > 400 */
  assert_int_equal(publish_id(&f->reg, &f->a, h->id, rn(&f->reg, &f->a, "u"), &m, 0, 0, NULL), GPUPOOL_EMETA);
  /* Another tenant neither sees it nor learns that it exists; the same tenant does. */
  assert_int_equal(gpd_get(&f->reg, &f->x, rn(&f->reg, &f->x, "t"), 0, 0, &g, NULL), GPUPOOL_ENOENT);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 400, 0, &o), 0);
  assert_int_equal(publish_id(&f->reg, &f->x, o->id, rn(&f->reg, &f->x, "t"), NULL, 0, 0, NULL), 0); /* its own "t" */
  assert_null(strstr(gpupool__errmsg(), "another"));
  assert_int_equal(gpd_release(&f->reg, &f->x, o->id, 0, &freed), 0);
  assert_int_equal(gpd_get(&f->reg, &f->b, rn(&f->reg, &f->b, "t"), 1, 0, &g, NULL), 0);
  assert_ptr_equal(g->buf, h->buf);
  assert_true(g->read_only);
  assert_int_equal(gpd_release(&f->reg, &f->b, g->id, 0, &freed), 0);
  /* Publishing to everyone is gone: it would hand out the slab. */
  assert_int_equal(publish_id(&f->reg, &f->a, h->id, rn(&f->reg, &f->a, "open"), NULL, 0, 1, NULL), GPUPOOL_EINVAL);
  assert_int_equal(publish_id(&f->reg, &f->a, h->id, rn(&f->reg, &f->a, "open"), NULL, 0, 0, NULL), 0);
  /* Across tenants, through a pool shared with a group, under group:GROUP/NAME. */
  {
    gpd_pool *sp = gpd_pool_find(&f->reg, "s", 0);
    gpd_hold *w, *r;
    assert_int_equal(gpd_allocate(&f->reg, &f->b, sp, 100, 0, &w), GPUPOOL_EPERM); /* b is not in ml */
    assert_int_equal(gpd_allocate(&f->reg, &f->a, sp, 100, 0, &w), 0);
    assert_int_equal(publish_id(&f->reg, &f->a, w->id, rn(&f->reg, &f->a, "w"), NULL, 0, 0, NULL), GPUPOOL_EPERM);
    assert_int_equal(publish_id(&f->reg, &f->a, h->id, rn(&f->reg, &f->a, "group:ml/t"), NULL, 0, 0, NULL), GPUPOOL_EPERM);
    assert_int_equal(publish_id(&f->reg, &f->a, w->id, rn(&f->reg, &f->a, "group:ml/w"), NULL, 0, 0, NULL), 0);
    assert_int_equal(gpd_get(&f->reg, &f->x, rn(&f->reg, &f->x, "group:ml/w"), 0, 0, &r, NULL), 0);
    assert_ptr_equal(r->buf, w->buf);
    assert_int_equal(gpd_get(&f->reg, &f->b, rn(&f->reg, &f->b, "group:ml/w"), 0, 0, &r, NULL), GPUPOOL_EPERM);
    assert_int_equal(gpd_get(&f->reg, &f->x, rn(&f->reg, &f->x, "group:nope/w"), 0, 0, &r, NULL), GPUPOOL_EPERM);
    assert_int_equal(gpd_unpublish(&f->reg, &f->x, rn(&f->reg, &f->x, "group:ml/w")), 0);
    assert_int_equal(gpd_release(&f->reg, &f->a, w->id, 0, &freed), 0);
  }
  /* The names keep the buffer after every hold is gone. */
  assert_int_equal(gpd_release(&f->reg, &f->a, h->id, 0, &freed), 0);
  assert_int_equal(freed, 0);
  assert_int_equal(pool(f)->used, 1024); /* this tenant's "t" and the other tenant's "t" */
  assert_int_equal(gpd_unpublish(&f->reg, &f->b, rn(&f->reg, &f->b, "open")), 0); /* one tenant: b may */
  assert_int_equal(pool(f)->used, 1024);
  assert_int_equal(gpd_unpublish(&f->reg, &f->a, rn(&f->reg, &f->a, "t")), 0);
  assert_int_equal(pool(f)->used, 512);
  assert_int_equal(gpd_unpublish(&f->reg, &f->x, rn(&f->reg, &f->x, "t")), 0);
  assert_int_equal(pool(f)->used, 0);
  assert_int_equal(gpupool__wire_check_name(""), GPUPOOL_ENAME);
  assert_int_equal(gpupool__wire_check_name("a\tb"), GPUPOOL_ENAME);
}

static void test_slabs_and_dedicated(void **state) {
  fixture *f = *state;
  gpd_hold *h[4], *big;
  int freed;

  /* Four 3 MiB buffers in 8 MiB slabs: two per slab. */
  for (int i = 0; i < 4; i++)
    assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 3 * MIB, 0, &h[i]), 0);
  assert_int_equal(pool(f)->nslabs, 2);
  assert_ptr_equal(h[0]->buf->slab, h[1]->buf->slab);
  assert_true(h[0]->buf->offset + h[0]->buf->size <= h[1]->buf->offset ||
              h[1]->buf->offset + h[1]->buf->size <= h[0]->buf->offset);
  /* Larger than a slab: a dedicated slab, returned as soon as the buffer goes. */
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 20 * MIB, 0, &big), 0);
  assert_true(big->buf->slab->dedicated);
  assert_int_equal(pool(f)->nslabs, 3);
  assert_int_equal(gpd_release(&f->reg, &f->a, big->id, 0, &freed), 0);
  assert_int_equal(pool(f)->nslabs, 2);
  /* Emptying both regular slabs keeps one (keep_slabs = 1) and returns the other. */
  for (int i = 0; i < 4; i++)
    assert_int_equal(gpd_release(&f->reg, &f->a, h[i]->id, 0, &freed), 0);
  assert_int_equal(pool(f)->nslabs, 1);
  assert_int_equal(pool(f)->reserved, 8 * MIB);
  assert_int_equal(pool(f)->used, 0);
  /* More than 4 GiB or the pool is refused with the reason. */
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 5ull << 30, 0, &big), GPUPOOL_ETOOBIG);
  assert_non_null(strstr(gpupool__errmsg(), "4 GiB"));
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100 * MIB, 0, &big), GPUPOOL_ETOOBIG);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 0, 0, &big), GPUPOOL_EINVAL);
}

static void test_full_pool_message_and_revoke(void **state) {
  fixture *f = *state;
  gpd_hold *h[9], *x;
  gpd_desc_storage ds;
  uint32_t fr, rv;
  int freed;

  /* 64 MiB = 8 slabs of 8 MiB, each filled by one 8 MiB buffer. */
  for (int i = 0; i < 8; i++)
    assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 8 * MIB, 0, &h[i]), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 1, 0, &x), GPUPOOL_ENOSPC);
  assert_non_null(strstr(gpupool__errmsg(), "asked for 1 bytes"));
  assert_non_null(strstr(gpupool__errmsg(), "pool 'p'"));
  /* b maps slab 0 (through an open); a releases everything: the slab b maps stays until b
   * reports it unmapped, and b is asked to. */
  {
    uint8_t tok[GPUPOOL_TOKEN_SIZE];
    gpd_hold *o;
    assert_int_equal(gpd_share(&f->reg, &f->a, h[0]->id, 0, tok), 0);
    assert_int_equal(gpd_open(&f->reg, &f->b, tok, sizeof tok, 0, &o), 0);
    gpd_fill_desc(&f->reg, &f->b, o, NULL, &ds);
    assert_true(ds.slab.export_data.len == 16); /* first time: how to map it */
    gpd_fill_desc(&f->reg, &f->b, o, NULL, &ds);
    assert_int_equal(ds.slab.export_data.len, 0); /* already mapped */
    assert_int_equal(gpd_release(&f->reg, &f->b, o->id, 0, &freed), 0);
  }
  uint64_t slab0 = h[0]->buf->slab->id;
  for (int i = 0; i < 8; i++)
    assert_int_equal(gpd_release(&f->reg, &f->a, h[i]->id, 0, &freed), 0);
  gpd_trim(&f->reg, &fr, &rv);
  assert_int_equal(f->b.nrevoke, 1);
  assert_int_equal(f->b.revoke[0], slab0);
  assert_true(pool(f)->nslabs >= 1);
  gpd_unmapped(&f->reg, &f->b, &slab0, 1);
  assert_int_equal(pool(f)->nslabs, 0);
  assert_int_equal(pool(f)->reserved, 0);
}

static void tweak_limits(gpd_config *c) {
  c->max_allocs_per_client = 2;
  c->max_bytes_per_uid = 3 * MIB;
}

static int setup_limits(void **state) { return setup_with(state, tweak_limits); }

static void test_limits(void **state) {
  fixture *f = *state;
  gpd_hold *h1, *h2, *h3;
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), MIB, 0, &h1), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), MIB, 0, &h2), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), MIB, 0, &h3), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "max_allocs_per_client"));
  /* b is another uid of a's tenant: it shares a's bytes (2 MiB of 3 used). */
  assert_int_equal(gpd_allocate(&f->reg, &f->b, pool(f), 2 * MIB, 0, &h3), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "tenant:team"));
  /* x, of another tenant, has its own budget; the per-tenant bytes still apply. */
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 3 * MIB, 0, &h3), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 1, 0, &h3), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "max_bytes_per_uid"));
}

/* The per-tenant and daemon-wide limits the tests above do not reach: each refusal names its
 * limit, and the tenant, whichever of its uids asks. */
static void tweak_tenant_limits(gpd_config *c) {
  c->max_allocs_per_uid = 2;
  c->max_holds_per_uid = 3;
  c->max_names = 2;
  c->max_names_per_uid = 1;
}

static int setup_tenant_limits(void **state) { return setup_with(state, tweak_tenant_limits); }

static void test_tenant_limits(void **state) {
  fixture *f = *state;
  gpd_pool *sp = gpd_pool_find(&f->reg, "s", 0);
  gpd_hold *h1, *h2, *h3, *o, *w, *v;
  uint8_t tok[GPUPOOL_TOKEN_SIZE];
  int freed;
  /* a and b are one tenant: two allocations between them, then three holds. */
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100, 0, &h1), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->b, pool(f), 100, 0, &h2), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->b, pool(f), 100, 0, &h3), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "tenant:team already has 2 live allocations"));
  assert_non_null(strstr(gpupool__errmsg(), "max_allocs_per_uid"));
  assert_int_equal(gpd_share(&f->reg, &f->a, h1->id, 0, tok), 0);
  assert_int_equal(gpd_open(&f->reg, &f->b, tok, sizeof tok, 0, &o), 0);
  assert_int_equal(gpd_open(&f->reg, &f->a, tok, sizeof tok, 0, &o), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "tenant:team already has 3 holds"));
  assert_non_null(strstr(gpupool__errmsg(), "max_holds_per_uid"));
  /* One name per tenant, two in the daemon. */
  assert_int_equal(publish_id(&f->reg, &f->a, h1->id, rn(&f->reg, &f->a, "n1"), NULL, 0, 0, NULL), 0);
  assert_int_equal(publish_id(&f->reg, &f->b, h2->id, rn(&f->reg, &f->b, "n2"), NULL, 0, 0, NULL), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "max_names_per_uid"));
  assert_int_equal(publish_id(&f->reg, &f->a, h1->id, rn(&f->reg, &f->a, "n1"), NULL, 0, 0, NULL), 0); /* not a new name */
  /* A group's name republished by another tenant of the group moves to that tenant's count. */
  assert_int_equal(gpd_allocate(&f->reg, &f->x, sp, 100, 0, &w), 0);
  assert_int_equal(publish_id(&f->reg, &f->x, w->id, rn(&f->reg, &f->x, "group:ml/w"), NULL, 0, 0, NULL), 0);
  assert_int_equal(gpd_release(&f->reg, &f->b, o->id, 0, &freed), 0);
  assert_int_equal(gpd_release(&f->reg, &f->b, h2->id, 0, &freed), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, sp, 100, 0, &v), 0);
  assert_int_equal(publish_id(&f->reg, &f->a, v->id, rn(&f->reg, &f->a, "group:ml/w"), NULL, 0, 0, NULL), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "republishing 'group:ml/w' would make it one more"));
  /* The daemon's names are all taken: a third tenant's first name is refused too. */
  assert_int_equal(gpd_unpublish(&f->reg, &f->a, rn(&f->reg, &f->a, "n1")), 0);
  assert_int_equal(publish_id(&f->reg, &f->a, h1->id, rn(&f->reg, &f->a, "n3"), NULL, 0, 0, NULL), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 100, 0, &h3), 0);
  assert_int_equal(publish_id(&f->reg, &f->x, h3->id, rn(&f->reg, &f->x, "n4"), NULL, 0, 0, NULL), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "the daemon already holds 2 names, the limit (max_names) is 2"));
}

static void test_drop_client_releases_everything(void **state) {
  fixture *f = *state;
  gpd_hold *h;
  for (int i = 0; i < 5; i++)
    assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100000, 0, &h), 0);
  assert_int_equal(publish_id(&f->reg, &f->a, h->id, rn(&f->reg, &f->a, "kept"), NULL, 0, 0, NULL), 0);
  /* Its process is gone (nobody holds the lease): everything comes back at once. */
  close(f->a_peer);
  f->a_peer = -1;
  gpd_client_drop(&f->reg, &f->a);
  give_lease(f, &f->a, &f->a_peer);
  gpd_client_init(&f->reg, &f->a); /* teardown drops it again */
  assert_int_equal(pool(f)->nbuffers, 1); /* only the named one survives */
  assert_int_equal(f->reg.holds.len, 0);
  assert_int_equal(f->reg.nwaiting, 0);
}

/* The usage record of the tenant of a client of uid (a and b share tenant "team"). */
static gpd_uid_usage *usage(fixture *f, uid_t uid) {
  return gpupool__hmap_get(&f->reg.uids, gpd_tenant_of(&f->cfg, uid, 0));
}

static void test_lease_keeps_memory_until_gone(void **state) {
  fixture *f = *state;
  gpd_hold *h, *x;
  int peer_copy;
  for (int i = 0; i < 3; i++)
    assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100000, 0, &h), 0);
  {
    gpd_desc_storage ds;
    gpd_fill_desc(&f->reg, &f->a, h, NULL, &ds); /* a maps the slab */
  }
  /* A forked child holds a copy of the lease; the connection closes, the parent's copy goes. */
  peer_copy = dup(f->a_peer);
  close(f->a_peer);
  f->a_peer = -1;
  gpd_client_drop(&f->reg, &f->a);
  assert_int_equal(f->reg.nwaiting, 1);
  assert_int_equal(f->reg.npending, 3);
  assert_int_equal(pool(f)->used, 3 * 100096);
  /* Still on the uid's account, and the slab stays mapped. */
  assert_non_null(usage(f, 1000));
  assert_int_equal(usage(f, 1000)->bytes, 3 * 100096);
  assert_int_equal(usage(f, 1000)->allocs, 3);
  assert_int_equal(usage(f, 1000)->leases, 1);
  assert_int_equal(pool(f)->nslabs, 1);
  uv_run(&f->loop, UV_RUN_NOWAIT);
  assert_int_equal(f->reg.npending, 3);
  /* Another tenant is not affected; the same tenant past its limit is refused with the reason. */
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 100, 0, &x), 0);
  f->cfg.max_waiting_leases_per_uid = 1; /* the registry reads the config it was given */
  f->a.uid = 1000;
  give_lease(f, &f->a, &f->a_peer);
  gpd_client_init(&f->reg, &f->a);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100, 0, &x), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "max_waiting_leases_per_uid"));
  assert_int_equal(gpd_get(&f->reg, &f->a, rn(&f->reg, &f->a, "none"), 0, 0, &x, NULL), GPUPOOL_ENOENT);
  /* The last holder exits: the loop sees the lease gone and everything comes back. */
  close(peer_copy);
  for (int i = 0; i < 100 && f->reg.npending; i++)
    uv_run(&f->loop, UV_RUN_NOWAIT);
  assert_int_equal(f->reg.npending, 0);
  assert_int_equal(f->reg.nwaiting, 0);
  assert_null(usage(f, 1000));
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100, 0, &x), 0);
}

/* The host backend with inter-process events, as the CUDA backend has them: every event has
 * completed (what matters here is only that GPU work exists on this backend). */
static gpupool__backend_ops events_ops;

static int fake_event_create(gpupool__backend *be, gpupool__bevent **out, uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE]) {
  (void)be;
  memset(handle, 0, GPUPOOL_EVENT_HANDLE_SIZE);
  *out = malloc(1);
  return *out ? 0 : GPUPOOL_ENOMEM;
}
static int fake_event_query(gpupool__bevent *e) {
  (void)e;
  return 1;
}
static void fake_event_destroy(gpupool__bevent *e) { free(e); }

static int setup_events(void **state) {
  fixture *f;
  setup_with(state, NULL);
  f = *state;
  events_ops = *f->be->ops;
  events_ops.has_events = 1;
  events_ops.event_create = fake_event_create;
  events_ops.event_query = fake_event_query;
  events_ops.event_destroy = fake_event_destroy;
  f->be->ops = &events_ops;
  return 0;
}

static void test_dead_holder_range_not_reused_with_gpu_work(void **state) {
  fixture *f = *state;
  gpd_hold *h1, *h2, *o, *x;
  uint8_t tok[GPUPOOL_TOKEN_SIZE];
  gpd_slab *slab;
  int freed, peer_copy;
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), MIB, 0, &h1), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), MIB, 0, &h2), 0);
  slab = h1->buf->slab;
  assert_ptr_equal(h2->buf->slab, slab);
  assert_int_equal(gpd_share(&f->reg, &f->a, h1->id, 0, tok), 0);
  assert_int_equal(gpd_open(&f->reg, &f->b, tok, sizeof tok, 0, &o), 0);
  /* b's connection closes with work of its own possibly queued on the buffer. */
  peer_copy = dup(f->b_peer);
  close(f->b_peer);
  f->b_peer = -1;
  gpd_client_drop(&f->reg, &f->b);
  give_lease(f, &f->b, &f->b_peer);
  gpd_client_init(&f->reg, &f->b);
  assert_int_equal(gpd_release(&f->reg, &f->a, h1->id, 0, &freed), 0);
  close(peer_copy);
  for (int i = 0; i < 100 && f->reg.npending; i++)
    uv_run(&f->loop, UV_RUN_NOWAIT);
  assert_int_equal(f->reg.npending, 0);
  assert_int_equal(pool(f)->used, MIB);
  /* The slab takes no new buffers; it goes back once its last buffer does. */
  assert_true(slab->retiring);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), MIB, 0, &x), 0);
  assert_ptr_not_equal(x->buf->slab, slab);
  assert_int_equal(pool(f)->nslabs, 2);
  assert_int_equal(gpd_release(&f->reg, &f->a, h2->id, 0, &freed), 0);
  assert_int_equal(pool(f)->nslabs, 1);
}

/* As setup_events, with a backend that makes at most EVENTS_MAX events, as CUDA gives a process
 * 4096: a message of more buffers and holds than that must still go through. */
#define EVENTS_MAX 64
static int events_made;

static int limited_event_create(gpupool__backend *be, gpupool__bevent **out,
                                uint8_t handle[GPUPOOL_EVENT_HANDLE_SIZE]) {
  if (events_made == EVENTS_MAX)
    return gpupool__err(GPUPOOL_EBACKEND, "cudaEventCreateWithFlags: cudaErrorMemoryAllocation (out of memory)");
  events_made++;
  return fake_event_create(be, out, handle);
}

static void limited_event_destroy(gpupool__bevent *e) {
  events_made--;
  fake_event_destroy(e);
}

static int setup_few_events(void **state) {
  setup_events(state);
  events_made = 0;
  events_ops.event_create = limited_event_create;
  events_ops.event_destroy = limited_event_destroy;
  return 0;
}

/* Whether e is one of c's own events. */
static int own_event(const gpd_client *c, const gpd_event *e) {
  for (uint32_t i = 0; i < c->nevents; i++)
    if (c->events[i] == e)
      return 1;
  return 0;
}

static uint32_t idle_events(const fixture *f) {
  uint32_t n = 0;
  for (const gpd_event *e = f->reg.free_events; e; e = e->next_free)
    n++;
  return n;
}

/* Kept shares made by one Share whose client recorded their ready events together carry one
 * ready group, told to each opener (one by one or many at once); another such Share gets
 * another group; a Share that did not record them together, one of a single hold, and a plain
 * (not kept) share carry none. */
static void test_ready_groups_of_kept_shares(void **state) {
  enum { N = 4 };
  fixture *f = *state;
  gpd_hold *hs[N], *os[N], *one = NULL;
  uint64_t ids[N];
  uint8_t t1[N][GPUPOOL_TOKEN_SIZE], t2[N][GPUPOOL_TOKEN_SIZE], t3[N][GPUPOOL_TOKEN_SIZE], t4[1][GPUPOOL_TOKEN_SIZE];
  const uint8_t *tp[N];
  size_t lens[N], opened = 0;
  int freed;

  for (int i = 0; i < N; i++) {
    assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 4096, 0, &hs[i]), 0);
    ids[i] = hs[i]->id;
    lens[i] = GPUPOOL_TOKEN_SIZE;
  }
  assert_int_equal(gpd_share_many(&f->reg, &f->a, ids, N, 1, 1, t1), 0);
  assert_int_equal(gpd_share_many(&f->reg, &f->a, ids, N, 1, 1, t2), 0);
  assert_int_equal(gpd_share_many(&f->reg, &f->a, ids, N, 1, 0, t3), 0);
  assert_int_equal(gpd_share_many(&f->reg, &f->a, ids, 1, 1, 1, t4), 0);
  /* The first Share's tokens opened in one request: one group, the same for all. */
  for (int i = 0; i < N; i++)
    tp[i] = t1[i];
  assert_int_equal(gpd_open_many(&f->reg, &f->b, tp, lens, N, 0, GPUPOOL_WIRE_MAX_FDS, os, &opened), 0);
  assert_int_equal(opened, N);
  uint64_t g1 = os[0]->ready_group;
  assert_true(g1 != 0);
  for (int i = 0; i < N; i++) {
    assert_int_equal(os[i]->ready_group, g1);
    gpd_desc_storage ds;
    gpd_fill_desc(&f->reg, &f->b, os[i], NULL, &ds);
    assert_int_equal(ds.desc.ready_group, g1);
  }
  /* The second Share's, one by one: another group. */
  for (int i = 0; i < N; i++) {
    gpd_hold *h = NULL;
    assert_int_equal(gpd_open(&f->reg, &f->b, t2[i], GPUPOOL_TOKEN_SIZE, 0, &h), 0);
    assert_true(h->ready_group != 0 && h->ready_group != g1);
    if (i > 0)
      assert_int_equal(h->ready_group, one->ready_group);
    one = h;
  }
  /* Not recorded together, or a Share of one hold: no group. */
  for (int i = 0; i < N; i++) {
    gpd_hold *h = NULL;
    assert_int_equal(gpd_open(&f->reg, &f->b, t3[i], GPUPOOL_TOKEN_SIZE, 0, &h), 0);
    assert_int_equal(h->ready_group, 0);
  }
  assert_int_equal(gpd_open(&f->reg, &f->b, t4[0], GPUPOOL_TOKEN_SIZE, 0, &one), 0);
  assert_int_equal(one->ready_group, 0);
  /* A plain share (not kept) names the buffer: no group either. */
  uint8_t plain[GPUPOOL_TOKEN_SIZE];
  assert_int_equal(gpd_share(&f->reg, &f->a, ids[0], 0, plain), 0);
  assert_int_equal(gpd_open(&f->reg, &f->b, plain, GPUPOOL_TOKEN_SIZE, 0, &one), 0);
  assert_int_equal(one->ready_group, 0);
  /* The allocating holds never had one. */
  for (int i = 0; i < N; i++) {
    assert_int_equal(hs[i]->ready_group, 0);
    assert_int_equal(gpd_release(&f->reg, &f->a, ids[i], 1, &freed), 0);
  }
}

static void test_events_shared_past_the_backend_limit(void **state) {
  enum { N = 3 * EVENTS_MAX };
  fixture *f = *state;
  gpd_hold **hs = calloc(N, sizeof *hs), **os = calloc(N, sizeof *os);
  uint8_t (*toks)[GPUPOOL_TOKEN_SIZE] = calloc(N, sizeof *toks);
  const uint8_t **tp = calloc(N, sizeof *tp);
  size_t *lens = calloc(N, sizeof *lens), opened = 0;
  uint64_t *ids = calloc(N, sizeof *ids);
  gpd_hold *x;
  int freed;

  assert_non_null(hs && os && toks && tp && lens && ids);
  /* A message of N buffers (each a ready event and an owner hold's done event) from a... */
  for (int i = 0; i < N; i++) {
    assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 4096, 0, &hs[i]), 0);
    ids[i] = hs[i]->id;
    assert_true(own_event(&f->a, hs[i]->buf->ready));
    assert_true(own_event(&f->a, hs[i]->done));
  }
  assert_true(f->a.nevents <= GPD_EVENTS_PER_CLIENT);
  assert_int_equal(gpd_share_many(&f->reg, &f->a, ids, N, 1, 0, toks), 0);
  /* ...opened by b in one request: its holds share one done event, none of a's. */
  for (int i = 0; i < N; i++) {
    tp[i] = toks[i];
    lens[i] = GPUPOOL_TOKEN_SIZE;
  }
  assert_int_equal(gpd_open_many(&f->reg, &f->b, tp, lens, N, 0, GPUPOOL_WIRE_MAX_FDS, os, &opened), 0);
  assert_int_equal(opened, N);
  for (int i = 0; i < N; i++) {
    assert_ptr_equal(os[i]->done, os[0]->done);
    assert_false(own_event(&f->a, os[i]->done));
  }
  /* The backend has no event left (another user took the rest): a client with events of its
   * own shares them... */
  gpupool__bevent *other[EVENTS_MAX];
  int nother = 0;
  while (events_made < EVENTS_MAX) {
    uint8_t h[GPUPOOL_EVENT_HANDLE_SIZE];
    assert_int_equal(limited_event_create(NULL, &other[nother++], h), 0);
  }
  assert_int_equal(gpd_allocate(&f->reg, &f->b, pool(f), 4096, 0, &x), 0);
  assert_true(own_event(&f->b, x->buf->ready));
  assert_int_equal(gpd_release(&f->reg, &f->b, x->id, 1, &freed), 0);
  /* ...one with none, while every event is in use, gets an error that says why... */
  assert_int_equal(f->x.nevents, 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 4096, 0, &x), GPUPOOL_EBACKEND);
  assert_non_null(strstr(gpupool__errmsg(), "none of its own"));
  /* Every hold released with its done event recorded: the memory comes back... */
  for (int i = 0; i < N; i++) {
    assert_int_equal(gpd_release(&f->reg, &f->b, os[i]->id, 1, &freed), 0);
    assert_int_equal(gpd_release(&f->reg, &f->a, ids[i], 1, &freed), 0);
  }
  gpd_sweep(&f->reg);
  assert_int_equal(f->reg.npending, 0);
  assert_int_equal(pool(f)->used, 0);
  /* ...and the client with none now takes an idle one out of another client's own. */
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 4096, 0, &x), 0);
  assert_true(own_event(&f->x, x->buf->ready));
  assert_false(own_event(&f->a, x->buf->ready) || own_event(&f->b, x->buf->ready));
  assert_int_equal(gpd_release(&f->reg, &f->x, x->id, 1, &freed), 0);
  /* Every event a hold or buffer took goes back to the idle list once its clients let go of
   * their own. */
  /* The clients leave: their own events go back too. */
  for (int k = 0; k < 3; k++) {
    gpd_client *c = k == 0 ? &f->a : k == 1 ? &f->b : &f->x;
    int *peer = k == 0 ? &f->a_peer : k == 1 ? &f->b_peer : &f->x_peer;
    gpd_client_drop(&f->reg, c);
    close(*peer);
    give_lease(f, c, peer);
    gpd_client_init(&f->reg, c);
  }
  assert_int_equal(idle_events(f), f->reg.nevents);
  for (uint32_t i = 0; i < f->reg.nevents; i++)
    assert_int_equal(f->reg.events[i]->refs, 0);
  while (nother > 0)
    limited_event_destroy(other[--nother]);
  free(hs);
  free(os);
  free(toks);
  free(tp);
  free(lens);
  free(ids);
}

/* A client that went away holding a buffer in a slab it mapped, while its process lives on:
 * the registry watches the process (a pidfd on the loop). Closing the registry must let go of
 * that watch, or the daemon's last loop run never ends and SIGTERM hangs until the client
 * exits (found by fuzz_daemon; regression input tests/fuzz/regress/daemon/). */
static void test_close_with_a_live_dead_client(void **state) {
  fixture *f = *state;
  gpd_hold *h;
  gpd_desc_storage ds;
  int rounds;

  /* a's process lives on (its end of the lease stays open) after its connection is gone. */
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 4096, 0, &h), 0);
  gpd_fill_desc(&f->reg, &f->a, h, NULL, &ds); /* a maps the slab */
  assert_non_null(ds.slab.export_data.data);
  gpd_client_drop(&f->reg, &f->a);
  gpd_client_drop(&f->reg, &f->b);
  gpd_client_drop(&f->reg, &f->x);
  assert_int_equal(f->reg.npending, 1); /* waits for a's lease */
  gpd_registry_close(&f->reg);
  for (rounds = 0; rounds < 100 && uv_loop_alive(&f->loop); rounds++)
    uv_run(&f->loop, UV_RUN_NOWAIT);
  assert_false(uv_loop_alive(&f->loop));
  f->be->ops->close(f->be);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  close(f->a_peer);
  close(f->b_peer);
  close(f->x_peer);
  free(f);
}

/* The host backend dressed as the CUDA one where tenants are concerned: a pool has an fd that
 * would map every allocation in it, and keeps what it reserved until it is destroyed. Each
 * backend pool gets a serial and an fd of its own, so tests can tell them apart. */
typedef struct {
  gpupool__bpool *host;
  int fd;
  int serial;
  uint64_t kept;   /* what it reserved and keeps until destroyed */
  uint64_t in_use;
} fake_pool;

static gpupool__backend_desc tenant_desc;
static gpupool__backend_ops tenant_ops;
static const gpupool__backend_ops *host_ops;
static int fake_created, fake_live;

static int fake_pool_create(gpupool__backend *be, const gpupool__pool_config *cfg, gpupool__bpool **out, int *fd) {
  fake_pool *fp = calloc(1, sizeof *fp);
  int hfd, rc;
  assert_non_null(fp);
  rc = host_ops->pool_create(be, cfg, &fp->host, &hfd);
  if (rc != 0) {
    free(fp);
    return rc;
  }
  fp->fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  assert_true(fp->fd >= 0);
  fp->serial = ++fake_created;
  fake_live++;
  *out = (gpupool__bpool *)fp;
  *fd = fp->fd;
  return 0;
}

static void fake_pool_destroy(gpupool__bpool *p) {
  fake_pool *fp = (fake_pool *)p;
  assert_int_equal(fp->in_use, 0); /* every slab was freed first */
  host_ops->pool_destroy(fp->host);
  close(fp->fd);
  free(fp);
  fake_live--;
}

static int fake_slab_alloc(gpupool__bpool *p, uint64_t size, uint64_t filled, gpupool__bslab *out) {
  fake_pool *fp = (fake_pool *)p;
  int rc = host_ops->slab_alloc(fp->host, size, filled, out);
  if (rc == 0) {
    fp->in_use += out->size;
    if (fp->in_use > fp->kept)
      fp->kept = fp->in_use;
  }
  return rc;
}

static void fake_slab_free(gpupool__bpool *p, gpupool__bslab *s) {
  fake_pool *fp = (fake_pool *)p;
  fp->in_use -= s->size;
  host_ops->slab_free(fp->host, s);
}

static int fake_pool_stats(gpupool__bpool *p, gpupool__bpool_stats *out) {
  fake_pool *fp = (fake_pool *)p;
  memset(out, 0, sizeof *out);
  out->reserved_cur = out->reserved_high = fp->kept;
  out->used_cur = fp->in_use;
  return 0;
}

static void use_tenant_pools(gpupool__backend *be) {
  host_ops = be->ops;
  tenant_ops = *be->ops;
  tenant_ops.pool_create = fake_pool_create;
  tenant_ops.pool_destroy = fake_pool_destroy;
  tenant_ops.slab_alloc = fake_slab_alloc;
  tenant_ops.slab_free = fake_slab_free;
  tenant_ops.pool_stats = fake_pool_stats;
  tenant_desc = *be->desc;
  tenant_desc.pool_fd_maps_all = 1;
  tenant_desc.pool_keeps_memory = 1;
  be->ops = &tenant_ops;
  be->desc = &tenant_desc;
}

static int setup_tenant_pools(void **state) {
  g_tenant_pools = 1;
  fake_created = fake_live = 0;
  return setup_with(state, NULL);
}

static int teardown_tenant_pools(void **state) {
  teardown(state);
  assert_int_equal(fake_live, 0); /* every backend pool destroyed */
  return 0;
}

static int fake_serial(const gpd_slab *s) { return ((const fake_pool *)s->inst->bp)->serial; }

static void test_tenant_pools_per_tenant(void **state) {
  fixture *f = *state;
  gpd_hold *ha, *hb, *hx;
  int fa, fb, fx, freed;
  Gpupool__Wire__PoolInfo pi;

  /* The startup check made one and destroyed it: nothing exists before first use. */
  assert_int_equal(fake_live, 0);
  assert_int_equal(pool(f)->ninsts, 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), MIB, 0, &ha), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), MIB, 0, &hx), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->b, pool(f), MIB, 0, &hb), 0);
  /* Two tenants, two backend pools; a and b are one tenant and share theirs. */
  assert_int_equal(pool(f)->ninsts, 2);
  assert_int_equal(fake_live, 2);
  assert_ptr_not_equal(ha->buf->slab->inst, hx->buf->slab->inst);
  assert_int_not_equal(fake_serial(ha->buf->slab), fake_serial(hx->buf->slab));
  assert_ptr_equal(hb->buf->slab->inst, ha->buf->slab->inst);
  /* AttachPool hands each the fd of its own tenant's backend pool, and makes none anew. */
  assert_int_equal(gpd_attach(&f->reg, &f->a, pool(f), &fa), 0);
  assert_int_equal(gpd_attach(&f->reg, &f->b, pool(f), &fb), 0);
  assert_int_equal(gpd_attach(&f->reg, &f->x, pool(f), &fx), 0);
  assert_int_equal(fa, ha->buf->slab->inst->fd);
  assert_int_equal(fb, fa);
  assert_int_equal(fx, hx->buf->slab->inst->fd);
  assert_int_not_equal(fx, fa);
  assert_int_equal(fake_live, 2);
  /* Stats sum the backend pools. */
  gpd_fill_pool_info(&f->reg, pool(f), &pi);
  assert_int_equal(pi.instances, 2);
  assert_int_equal(pi.reserved, 16 * MIB);
  assert_int_equal(pi.backend_reserved, 16 * MIB);
  assert_int_equal(pi.backend_used, 16 * MIB);
  assert_int_equal(gpd_release(&f->reg, &f->a, ha->id, 0, &freed), 0);
  assert_int_equal(gpd_release(&f->reg, &f->b, hb->id, 0, &freed), 0);
  assert_int_equal(gpd_release(&f->reg, &f->x, hx->id, 0, &freed), 0);
}

static void test_tenant_pools_group(void **state) {
  fixture *f = *state;
  gpd_pool *sp = gpd_pool_find(&f->reg, "s", 0);
  gpd_hold *ha, *hx;
  int fa, fx, fb, freed;

  /* A pool shared with group ml: its members (a, x: two tenants) share one backend pool. */
  assert_int_equal(gpd_allocate(&f->reg, &f->a, sp, MIB, 0, &ha), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, sp, MIB, 0, &hx), 0);
  assert_ptr_equal(ha->buf->slab->inst, hx->buf->slab->inst);
  assert_int_equal(sp->ninsts, 1);
  assert_int_equal(gpd_attach(&f->reg, &f->a, sp, &fa), 0);
  assert_int_equal(gpd_attach(&f->reg, &f->x, sp, &fx), 0);
  assert_int_equal(fa, fx);
  assert_int_equal(fa, ha->buf->slab->inst->fd);
  /* A non-member gets no fd of it. */
  assert_int_equal(gpd_attach(&f->reg, &f->b, sp, &fb), GPUPOOL_EPERM);
  assert_int_equal(fb, -1);
  assert_non_null(strstr(gpupool__errmsg(), "group 'ml'"));
  assert_int_equal(sp->ninsts, 1);
  assert_int_equal(gpd_release(&f->reg, &f->a, ha->id, 0, &freed), 0);
  assert_int_equal(gpd_release(&f->reg, &f->x, hx->id, 0, &freed), 0);
}

static void test_tenant_pools_capacity_shared(void **state) {
  fixture *f = *state;
  gpd_hold *ha, *hx;
  int freed;

  /* 64 MiB for both tenants together. */
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 40 * MIB, 0, &ha), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 32 * MIB, 0, &hx), GPUPOOL_ENOSPC);
  assert_non_null(strstr(gpupool__errmsg(), "pool 'p' is out of memory"));
  /* A tenant that failed to get its first slab keeps no backend pool. */
  assert_int_equal(pool(f)->ninsts, 1);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 24 * MIB, 0, &hx), 0);
  assert_int_equal(pool(f)->held, 64 * MIB);
  assert_int_equal(gpd_release(&f->reg, &f->a, ha->id, 0, &freed), 0);
  assert_int_equal(gpd_release(&f->reg, &f->x, hx->id, 0, &freed), 0);
}

static void test_tenant_pools_idle_destroyed(void **state) {
  fixture *f = *state;
  gpd_hold *hx, *ha;
  Gpupool__Wire__PoolInfo pi;
  int fx, freed;

  /* x attaches (its backend pool exists from then on), takes 32 MiB and lets go. */
  assert_int_equal(gpd_attach(&f->reg, &f->x, pool(f), &fx), 0);
  assert_int_equal(fake_live, 1);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 32 * MIB, 0, &hx), 0);
  assert_int_equal(gpd_release(&f->reg, &f->x, hx->id, 0, &freed), 0);
  assert_int_equal(pool(f)->reserved, 0);
  /* Its backend pool lives on while x is connected, and keeps what it reserved: a cannot
   * have that memory yet. */
  assert_int_equal(pool(f)->ninsts, 1);
  assert_int_equal(pool(f)->held, 32 * MIB);
  gpd_fill_pool_info(&f->reg, pool(f), &pi);
  assert_int_equal(pi.held, 32 * MIB);
  assert_int_equal(pi.backend_reserved, 32 * MIB);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 40 * MIB, 0, &ha), GPUPOOL_ENOSPC);
  assert_int_equal(fake_live, 1);
  /* x goes: its backend pool is idle, destroyed, and the memory counts as free again. */
  close(f->x_peer);
  f->x_peer = -1;
  gpd_client_drop(&f->reg, &f->x);
  give_lease(f, &f->x, &f->x_peer);
  gpd_client_init(&f->reg, &f->x);
  assert_int_equal(fake_live, 0);
  assert_int_equal(pool(f)->ninsts, 0);
  assert_int_equal(pool(f)->held, 0);
  gpd_fill_pool_info(&f->reg, pool(f), &pi);
  assert_int_equal(pi.backend_reserved, 0);
  assert_int_equal(pi.backend_reserved_high, 32 * MIB);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 40 * MIB, 0, &ha), 0);
  assert_int_equal(fake_live, 1);
  /* A tenant that never attached loses its backend pool with its last slab. */
  assert_int_equal(gpd_release(&f->reg, &f->a, ha->id, 0, &freed), 0);
  assert_int_equal(fake_live, 0);
  assert_int_equal(pool(f)->held, 0);
  /* A new backend pool for x now: never the old one again (its fd may still be out there). */
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), MIB, 0, &hx), 0);
  assert_int_equal(fake_serial(hx->buf->slab), fake_created);
  assert_true(fake_created >= 4);
  assert_int_equal(gpd_release(&f->reg, &f->x, hx->id, 0, &freed), 0);
  /* Its empty slab is kept (keep_slabs = 1); trimming gives it back and the pool goes. */
  assert_int_equal(fake_live, 1);
  {
    uint32_t fr, rv;
    gpd_trim(&f->reg, &fr, &rv);
  }
  assert_int_equal(fake_live, 0);
}

/* The daemon checks every member of a published bundle itself (a client may send anything):
 * each refusal names the cause and changes nothing; a good one makes a version. */
static void test_bundle_checks(void **state) {
  fixture *f = *state;
  gpd_hold *h1, *h2, *x1, **hs = NULL;
  const gpd_name *nm;
  Gpupool__Wire__BundleMember m[3], *mp[3];
  Gpupool__Wire__TensorMeta tm = GPUPOOL__WIRE__TENSOR_META__INIT;
  int64_t shape[1] = {11};
  uint64_t ids[3], v = 0;

  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100, 0, &h1), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100, 0, &h2), 0);
  assert_int_equal(gpd_allocate(&f->reg, &f->x, pool(f), 100, 0, &x1), 0);
  for (int i = 0; i < 3; i++) {
    gpupool__wire__bundle_member__init(&m[i]);
    mp[i] = &m[i];
    m[i].size = 10;
  }
  m[0].name = (char *)"a";
  m[1].name = (char *)"b";
  m[1].buffer = 1;
  m[2].name = (char *)"c";
  ids[0] = h1->id;
  ids[1] = h2->id;
  /* Member in a buffer that is not listed. */
  m[2].buffer = 2;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "names buffer 2"));
  m[2].buffer = 0;
  /* Range past its buffer, and one whose end overflows. */
  m[2].offset = 95;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "does not fit"));
  m[2].offset = UINT64_MAX - 5;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_EINVAL);
  m[2].offset = 20;
  /* Zero size, no name, duplicate names. */
  m[2].size = 0;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_EINVAL);
  m[2].size = 10;
  m[2].name = NULL;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_ENAME);
  m[2].name = (char *)"a";
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "'a' appears twice"));
  /* Members from a peer's reply (no frame validator saw them) get the whole name check, UTF-8
   * included; members of a client's request (validated) get the rest of it, same messages. */
  m[2].name = (char *)"c\x80";
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_ENAME);
  assert_string_equal(gpupool__errmsg(), "member 2: name is not valid UTF-8 (at byte 1); names are UTF-8 text");
  m[2].name = (char *)"c\x01";
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_ENAME);
  assert_string_equal(gpupool__errmsg(), "member 2: name contains a control character at byte 1");
  assert_int_equal(gpd_publish_bundle_checked(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v),
                   GPUPOOL_ENAME);
  assert_string_equal(gpupool__errmsg(), "member 2: name contains a control character at byte 1");
  m[2].name = (char *)"";
  assert_int_equal(gpd_publish_bundle_checked(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v),
                   GPUPOOL_ENAME);
  assert_string_equal(gpupool__errmsg(), "member 2: empty name; names are 1 to 255 bytes");
  assert_int_equal(f->reg.nnames, 0);
  m[2].name = (char *)"c";
  /* A description larger than its member. */
  ts_tensor_meta(&tm, GPUPOOL_DTYPE_UINT, 8, 1, shape);
  m[2].tensor = &tm;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_EMETA);
  assert_non_null(strstr(gpupool__errmsg(), "member 2 ('c')"));
  shape[0] = 10;
  /* A buffer listed twice, a buffer no member uses, another client's hold, another tenant's. */
  ids[1] = h1->id;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "listed twice"));
  ids[1] = h2->id;
  ids[2] = x1->id;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 3, mp, 3, 0, &v), GPUPOOL_EPERM);
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->x, rn(&f->reg, &f->x, "bb"), ids, 2, mp, 3, 0, &v), GPUPOOL_EPERM);
  assert_int_equal(f->reg.nnames, 0);
  /* Too many holds for the members, none at all. */
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 0, mp, 3, 0, &v), GPUPOOL_EINVAL);
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 0, 0, &v), GPUPOOL_EINVAL);
  /* Good: version 1, then 2 in the same step; the same tenant gets it whole. */
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), 0);
  assert_int_equal(v, 1);
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "bb"), ids, 2, mp, 3, 0, &v), 0);
  assert_int_equal(v, 2);
  assert_int_equal(f->reg.nnames, 1);
  assert_int_equal(gpd_get_bundle(&f->reg, &f->b, rn(&f->reg, &f->b, "bb"), 1, 0, &hs, &nm), 0);
  assert_int_equal(nm->nbufs, 2);
  assert_int_equal(nm->layout->n, 3);
  assert_int_equal(nm->version, 2);
  assert_ptr_equal(hs[0]->buf, h1->buf);
  assert_non_null(nm->layout->members[2].meta);
  gpd_hold_discard(&f->reg, hs[0]);
  gpd_hold_discard(&f->reg, hs[1]);
  free(hs);
  assert_int_equal(gpd_get_bundle(&f->reg, &f->b, rn(&f->reg, &f->b, "bb"), 1, 2, &hs, &nm), GPUPOOL_ENOENT);
  assert_int_equal(gpd_get_bundle(&f->reg, &f->x, rn(&f->reg, &f->x, "bb"), 1, 0, &hs, &nm), GPUPOOL_ENOENT);
  assert_int_equal(gpd_unpublish(&f->reg, &f->a, rn(&f->reg, &f->a, "bb")), 0);
  {
    int freed;
    assert_int_equal(gpd_release(&f->reg, &f->a, h1->id, 0, &freed), 0);
    assert_true(freed);
    assert_int_equal(gpd_release(&f->reg, &f->a, h2->id, 0, &freed), 0);
    assert_int_equal(gpd_release(&f->reg, &f->x, x1->id, 0, &freed), 0);
  }
  assert_int_equal(pool(f)->used, 0);
}

/* A bundle allocation's member table is published by its id alone (no members travel): the
 * holds must be buffers it fits, of the same tenant; the table goes once nothing uses it. */
static void test_layout_by_id(void **state) {
  fixture *f = *state;
  Gpupool__Wire__MemberSpec sp[2], *spp[2];
  gpd_bundle_plan *plan = NULL;
  gpd_hold **hs = NULL, *small, **got = NULL;
  const gpd_name *nm;
  uint64_t id, ids[2], v = 0;
  gpd_uid_usage *u;

  for (int i = 0; i < 2; i++) {
    gpupool__wire__member_spec__init(&sp[i]);
    sp[i].size = 1000;
    spp[i] = &sp[i];
  }
  sp[0].name = (char *)"w";
  sp[1].name = (char *)"b";
  assert_int_equal(gpd_bundle_plan_new(&f->reg, &f->a, pool(f), spp, 2, 0, &plan), 0);
  assert_int_equal(gpd_bundle_allocate(&f->reg, &f->a, plan, &hs), 0);
  id = plan->layout->id;
  gpd_bundle_plan_free(plan);
  assert_non_null(gpupool__hmap_get(&f->reg.layouts, id)); /* the buffer keeps it */
  /* An equal table of the same tenant shares the layout (double buffering: one id for both
   * bundles); another tenant's, or another table, does not. */
  {
    gpd_bundle_plan *p2 = NULL;
    assert_int_equal(gpd_bundle_plan_new(&f->reg, &f->a, pool(f), spp, 2, 0, &p2), 0);
    assert_int_equal(p2->layout->id, id);
    gpd_bundle_plan_free(p2);
    assert_int_equal(gpd_bundle_plan_new(&f->reg, &f->x, pool(f), spp, 2, 0, &p2), 0);
    assert_true(p2->layout->id != id);
    gpd_bundle_plan_free(p2);
    sp[1].size = 1001;
    assert_int_equal(gpd_bundle_plan_new(&f->reg, &f->a, pool(f), spp, 2, 0, &p2), 0);
    assert_true(p2->layout->id != id);
    gpd_bundle_plan_free(p2);
    sp[1].size = 1000;
  }
  ids[0] = hs[0]->id;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "L"), ids, 1, NULL, 0, id, &v), 0);
  assert_int_equal(v, 1);
  assert_int_equal(gpd_get_bundle(&f->reg, &f->b, rn(&f->reg, &f->b, "L"), 1, 0, &got, &nm), 0);
  assert_int_equal(nm->layout->id, id);
  assert_int_equal(nm->layout->n, 2);
  gpd_hold_discard(&f->reg, got[0]);
  free(got);
  /* Wrong: another tenant, a buffer too small, a count of buffers the table does not span, an
   * unknown id, members and an id together. */
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->x, rn(&f->reg, &f->x, "L"), ids, 1, NULL, 0, id, &v), GPUPOOL_ENOENT);
  assert_int_equal(gpd_allocate(&f->reg, &f->a, pool(f), 100, 0, &small), 0);
  ids[1] = small->id;
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "L"), ids + 1, 1, NULL, 0, id, &v), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool__errmsg(), "needs"));
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "L"), ids, 2, NULL, 0, id, &v), GPUPOOL_EINVAL);
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "L"), ids, 1, NULL, 0, id + 1000, &v), GPUPOOL_ENOENT);
  {
    Gpupool__Wire__BundleMember m = GPUPOOL__WIRE__BUNDLE_MEMBER__INIT, *mp = &m;
    m.name = (char *)"x";
    m.size = 10;
    assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "L"), ids, 1, &mp, 1, id, &v), GPUPOOL_EINVAL);
  }
  /* Version 2 by the same id; then everything goes and so does the table and its count. */
  assert_int_equal(gpd_publish_bundle(&f->reg, &f->a, rn(&f->reg, &f->a, "L"), ids, 1, NULL, 0, id, &v), 0);
  assert_int_equal(v, 2);
  u = gpupool__hmap_get(&f->reg.uids, f->a.tenant);
  assert_non_null(u);
  assert_int_equal(u->members, 2);
  assert_int_equal(gpd_unpublish(&f->reg, &f->a, rn(&f->reg, &f->a, "L")), 0);
  {
    int freed;
    assert_int_equal(gpd_release(&f->reg, &f->a, hs[0]->id, 0, &freed), 0);
    assert_true(freed);
    assert_int_equal(gpd_release(&f->reg, &f->a, small->id, 0, &freed), 0);
  }
  free(hs);
  assert_null(gpupool__hmap_get(&f->reg.layouts, id));
  u = gpupool__hmap_get(&f->reg.uids, f->a.tenant);
  assert_true(!u || u->members == 0);
}

/* A bundle whose last chunk does not fit gives back the chunks it took, and that must not count
 * as memory coming back: the waiting allocations would be retried (this one first) and fail
 * the same way, over and over, in one turn of the loop. */
static void test_bundle_rollback_returns_nothing(void **state) {
  fixture *f = *state;
  Gpupool__Wire__MemberSpec sp[2], *spp[2];
  gpd_bundle_plan *plan = NULL;
  gpd_hold **hs = NULL;
  uint64_t used = pool(f)->used;
  for (int i = 0; i < 2; i++) {
    gpupool__wire__member_spec__init(&sp[i]);
    sp[i].size = 1 << 20;
    spp[i] = &sp[i];
  }
  sp[0].name = (char *)"a";
  sp[1].name = (char *)"b";
  assert_int_equal(gpd_bundle_plan_new(&f->reg, &f->a, pool(f), spp, 2, 0, &plan), 0);
  /* Two chunks, the second larger than the pool can hold next to the first. */
  plan->nchunks = 2;
  plan->chunks[0] = 1 << 20;
  plan->chunks[1] = 60ull << 20;
  f->reg.memory_returned = 0;
  assert_int_not_equal(gpd_bundle_allocate(&f->reg, &f->a, plan, &hs), 0);
  assert_int_equal(f->reg.memory_returned, 0);
  assert_int_equal(pool(f)->used, used);
  plan->nchunks = 1;
  gpd_bundle_plan_free(plan);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_holders_and_exactly_once, setup, teardown),
      cmocka_unit_test_setup_teardown(test_names, setup, teardown),
      cmocka_unit_test_setup_teardown(test_bundle_checks, setup, teardown),
      cmocka_unit_test_setup_teardown(test_layout_by_id, setup, teardown),
      cmocka_unit_test_setup_teardown(test_bundle_rollback_returns_nothing, setup, teardown),
      cmocka_unit_test_setup_teardown(test_slabs_and_dedicated, setup, teardown),
      cmocka_unit_test_setup_teardown(test_full_pool_message_and_revoke, setup, teardown),
      cmocka_unit_test_setup_teardown(test_limits, setup_limits, teardown),
      cmocka_unit_test_setup_teardown(test_tenant_limits, setup_tenant_limits, teardown),
      cmocka_unit_test_setup_teardown(test_drop_client_releases_everything, setup, teardown),
      cmocka_unit_test_setup_teardown(test_lease_keeps_memory_until_gone, setup, teardown),
      cmocka_unit_test_setup_teardown(test_dead_holder_range_not_reused_with_gpu_work, setup_events, teardown),
      cmocka_unit_test_setup_teardown(test_events_shared_past_the_backend_limit, setup_few_events, teardown),
      cmocka_unit_test_setup_teardown(test_ready_groups_of_kept_shares, setup, teardown),
      cmocka_unit_test_setup(test_close_with_a_live_dead_client, setup),
      cmocka_unit_test_setup_teardown(test_tenant_pools_per_tenant, setup_tenant_pools, teardown_tenant_pools),
      cmocka_unit_test_setup_teardown(test_tenant_pools_group, setup_tenant_pools, teardown_tenant_pools),
      cmocka_unit_test_setup_teardown(test_tenant_pools_capacity_shared, setup_tenant_pools, teardown_tenant_pools),
      cmocka_unit_test_setup_teardown(test_tenant_pools_idle_destroyed, setup_tenant_pools, teardown_tenant_pools),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
