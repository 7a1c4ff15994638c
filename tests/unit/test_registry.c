/*
 * Unit tests of the daemon's registry on the host backend, without sockets: holders and the
 * exactly-once return of memory, names and their visibility, share tokens, slab placement and
 * dedicated slabs, revocation of surplus slabs, limits, and dropping a client.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmocka.h>

#include "backend.h"
#include "config.h"
#include "errors.h"
#include "registry.h"

#define MIB (1ull << 20)

typedef struct {
  uv_loop_t loop;
  gpupool__config cfg;
  gpupool__backend *be;
  gpupool__registry reg;
  gpupool__client a, b;
} fixture;

static int setup_with(void **state, void (*tweak)(gpupool__config *)) {
  fixture *f = calloc(1, sizeof *f);
  assert_non_null(f);
  uv_loop_init(&f->loop);
  gpupool__config_defaults(&f->cfg);
  assert_int_equal(gpupool__config_add_pool_spec(&f->cfg, "name=p,kind=host,capacity=64M,slab=8M,keep=1"), 0);
  if (tweak)
    tweak(&f->cfg);
  assert_int_equal(gpupool__config_finish(&f->cfg, &gpupool__backend_host), 0);
  assert_int_equal(gpupool__backend_host.open(&f->be), 0);
  assert_int_equal(gpupool__registry_init(&f->reg, &f->loop, &f->cfg, f->be), 0);
  f->a.pidfd = f->b.pidfd = -1;
  f->a.uid = 1000;
  f->b.uid = 1001;
  gpupool__client_init(&f->reg, &f->a);
  gpupool__client_init(&f->reg, &f->b);
  *state = f;
  return 0;
}

static int setup(void **state) { return setup_with(state, NULL); }

static int teardown(void **state) {
  fixture *f = *state;
  gpupool__client_drop(&f->reg, &f->a);
  gpupool__client_drop(&f->reg, &f->b);
  gpupool__registry_close(&f->reg);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  f->be->ops->close(f->be);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  free(f);
  return 0;
}

static gpupool__pool *pool(fixture *f) { return gpupool__pool_find(&f->reg, "p", 0); }

static void test_holders_and_exactly_once(void **state) {
  fixture *f = *state;
  gpupool__hold *h, *o;
  uint8_t tok[GPUPOOL_TOKEN_SIZE];
  int freed = -1;

  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 1000, 0, &h), 0);
  assert_int_equal(pool(f)->used, 1024); /* rounded to the 256-byte alignment */
  assert_int_equal(gpupool__share(&f->reg, &f->a, h->id, tok), 0);
  assert_int_equal(gpupool__open(&f->reg, &f->b, tok, sizeof tok, 1, &o), 0);
  assert_ptr_equal(o->buf, h->buf);
  assert_int_equal(h->buf->refs, 2);
  /* b cannot release a's hold, a cannot release b's. */
  assert_int_equal(gpupool__release(&f->reg, &f->b, h->id, 0, &freed), GPUPOOL_EPERM);
  assert_int_equal(gpupool__release(&f->reg, &f->a, o->id, 0, &freed), GPUPOOL_EPERM);
  uint64_t hid = h->id, oid = o->id;
  assert_int_equal(gpupool__release(&f->reg, &f->a, hid, 0, &freed), 0);
  assert_int_equal(freed, 0);
  assert_int_equal(pool(f)->used, 1024); /* the opener still holds it */
  assert_int_equal(gpupool__release(&f->reg, &f->b, oid, 0, &freed), 0);
  assert_int_equal(freed, 1);
  assert_int_equal(pool(f)->used, 0);
  assert_int_equal(pool(f)->nbuffers, 0);
  /* Released holds are gone; the token names nothing now. */
  assert_int_equal(gpupool__release(&f->reg, &f->b, oid, 0, &freed), GPUPOOL_ENOENT);
  assert_int_equal(gpupool__open(&f->reg, &f->b, tok, sizeof tok, 0, &o), GPUPOOL_ENOENT);
  assert_int_equal(f->reg.buffers.len, 0);
  assert_int_equal(f->reg.holds.len, 0);
}

static void test_names(void **state) {
  fixture *f = *state;
  gpupool__hold *h, *g;
  int freed;
  Gpupool__Wire__TensorMeta m = GPUPOOL__WIRE__TENSOR_META__INIT;
  int64_t shape[2] = {10, 10};

  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 400, 0, &h), 0);
  m.present = 1;
  m.dtype_code = GPUPOOL_DTYPE_FLOAT;
  m.dtype_bits = 32;
  m.dtype_lanes = 1;
  m.n_shape = 2;
  m.shape = shape;
  assert_int_equal(gpupool__publish(&f->reg, &f->a, h->id, "t", &m, 0, 0), 0);
  assert_int_equal(gpupool__publish(&f->reg, &f->a, h->id, "t", NULL, 0, 0), GPUPOOL_EEXIST);
  shape[0] = 11; /* 440 bytes > 400 */
  assert_int_equal(gpupool__publish(&f->reg, &f->a, h->id, "u", &m, 0, 0), GPUPOOL_EMETA);
  /* Another uid does not see it; the same uid does, and so does everyone once shared. */
  assert_int_equal(gpupool__get(&f->reg, &f->b, "t", 0, &g), GPUPOOL_ENOENT);
  assert_int_equal(gpupool__publish(&f->reg, &f->a, h->id, "open", NULL, 0, 1), 0);
  assert_int_equal(gpupool__get(&f->reg, &f->b, "open", 1, &g), 0);
  assert_true(g->read_only);
  assert_int_equal(gpupool__unpublish(&f->reg, &f->b, "open"), GPUPOOL_EPERM);
  /* The names keep the buffer after every hold is gone. */
  assert_int_equal(gpupool__release(&f->reg, &f->b, g->id, 0, &freed), 0);
  assert_int_equal(gpupool__release(&f->reg, &f->a, h->id, 0, &freed), 0);
  assert_int_equal(freed, 0);
  assert_int_equal(pool(f)->used, 512);
  assert_int_equal(gpupool__unpublish(&f->reg, &f->a, "open"), 0);
  assert_int_equal(pool(f)->used, 512);
  assert_int_equal(gpupool__unpublish(&f->reg, &f->a, "t"), 0);
  assert_int_equal(pool(f)->used, 0);
  assert_int_equal(gpupool__check_name(""), GPUPOOL_ENAME);
  assert_int_equal(gpupool__check_name("a\tb"), GPUPOOL_ENAME);
}

static void test_slabs_and_dedicated(void **state) {
  fixture *f = *state;
  gpupool__hold *h[4], *big;
  int freed;

  /* Four 3 MiB buffers in 8 MiB slabs: two per slab. */
  for (int i = 0; i < 4; i++)
    assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 3 * MIB, 0, &h[i]), 0);
  assert_int_equal(pool(f)->nslabs, 2);
  assert_ptr_equal(h[0]->buf->slab, h[1]->buf->slab);
  assert_true(h[0]->buf->offset + h[0]->buf->size <= h[1]->buf->offset ||
              h[1]->buf->offset + h[1]->buf->size <= h[0]->buf->offset);
  /* Larger than a slab: a dedicated slab, returned as soon as the buffer goes. */
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 20 * MIB, 0, &big), 0);
  assert_true(big->buf->slab->dedicated);
  assert_int_equal(pool(f)->nslabs, 3);
  assert_int_equal(gpupool__release(&f->reg, &f->a, big->id, 0, &freed), 0);
  assert_int_equal(pool(f)->nslabs, 2);
  /* Emptying both regular slabs keeps one (keep_slabs = 1) and returns the other. */
  for (int i = 0; i < 4; i++)
    assert_int_equal(gpupool__release(&f->reg, &f->a, h[i]->id, 0, &freed), 0);
  assert_int_equal(pool(f)->nslabs, 1);
  assert_int_equal(pool(f)->reserved, 8 * MIB);
  assert_int_equal(pool(f)->used, 0);
  /* More than 4 GiB or the pool is refused with the reason. */
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 5ull << 30, 0, &big), GPUPOOL_ETOOBIG);
  assert_non_null(strstr(gpupool__errmsg(), "4 GiB"));
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 100 * MIB, 0, &big), GPUPOOL_ETOOBIG);
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 0, 0, &big), GPUPOOL_EINVAL);
}

static void test_full_pool_message_and_revoke(void **state) {
  fixture *f = *state;
  gpupool__hold *h[9], *x;
  gpupool__desc_storage ds;
  uint32_t fr, rv;
  int freed;

  /* 64 MiB = 8 slabs of 8 MiB, each filled by one 8 MiB buffer. */
  for (int i = 0; i < 8; i++)
    assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 8 * MIB, 0, &h[i]), 0);
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 1, 0, &x), GPUPOOL_ENOSPC);
  assert_non_null(strstr(gpupool__errmsg(), "asked for 1 bytes"));
  assert_non_null(strstr(gpupool__errmsg(), "pool 'p'"));
  /* b maps slab 0 (through an open); a releases everything: the slab b maps stays until b
   * reports it unmapped, and b is asked to. */
  {
    uint8_t tok[GPUPOOL_TOKEN_SIZE];
    gpupool__hold *o;
    assert_int_equal(gpupool__share(&f->reg, &f->a, h[0]->id, tok), 0);
    assert_int_equal(gpupool__open(&f->reg, &f->b, tok, sizeof tok, 0, &o), 0);
    gpupool__fill_desc(&f->reg, &f->b, o, NULL, &ds);
    assert_true(ds.slab.export_data.len == 16); /* first time: how to map it */
    gpupool__fill_desc(&f->reg, &f->b, o, NULL, &ds);
    assert_int_equal(ds.slab.export_data.len, 0); /* already mapped */
    assert_int_equal(gpupool__release(&f->reg, &f->b, o->id, 0, &freed), 0);
  }
  uint64_t slab0 = h[0]->buf->slab->id;
  for (int i = 0; i < 8; i++)
    assert_int_equal(gpupool__release(&f->reg, &f->a, h[i]->id, 0, &freed), 0);
  gpupool__trim(&f->reg, &fr, &rv);
  assert_int_equal(f->b.nrevoke, 1);
  assert_int_equal(f->b.revoke[0], slab0);
  assert_true(pool(f)->nslabs >= 1);
  gpupool__unmapped(&f->reg, &f->b, &slab0, 1);
  assert_int_equal(pool(f)->nslabs, 0);
  assert_int_equal(pool(f)->reserved, 0);
}

static void tweak_limits(gpupool__config *c) {
  c->max_allocs_per_client = 2;
  c->max_bytes_per_uid = 3 * MIB;
}

static int setup_limits(void **state) { return setup_with(state, tweak_limits); }

static void test_limits(void **state) {
  fixture *f = *state;
  gpupool__hold *h1, *h2, *h3;
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), MIB, 0, &h1), 0);
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), MIB, 0, &h2), 0);
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), MIB, 0, &h3), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "max_allocs_per_client"));
  /* Another client of another uid has its own budget; the per-uid bytes still apply. */
  assert_int_equal(gpupool__allocate(&f->reg, &f->b, pool(f), 3 * MIB, 0, &h3), 0);
  assert_int_equal(gpupool__allocate(&f->reg, &f->b, pool(f), 1, 0, &h3), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool__errmsg(), "max_bytes_per_uid"));
}

static void test_drop_client_releases_everything(void **state) {
  fixture *f = *state;
  gpupool__hold *h;
  for (int i = 0; i < 5; i++)
    assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 100000, 0, &h), 0);
  assert_int_equal(gpupool__publish(&f->reg, &f->a, h->id, "kept", NULL, 0, 0), 0);
  /* No pidfd: the process cannot be watched, so it counts as gone at once. */
  gpupool__client_drop(&f->reg, &f->a);
  gpupool__client_init(&f->reg, &f->a); /* teardown drops it again */
  assert_int_equal(pool(f)->nbuffers, 1); /* only the named one survives */
  assert_int_equal(f->reg.holds.len, 0);
}

/* A client that went away holding a buffer in a slab it mapped, while its process lives on:
 * the registry watches the process (a pidfd on the loop). Closing the registry must let go of
 * that watch, or the daemon's last loop run never ends and SIGTERM hangs until the client
 * exits (found by fuzz_daemon; regression input tests/fuzz/regress/daemon/). */
static void test_close_with_a_live_dead_client(void **state) {
  fixture *f = *state;
  gpupool__hold *h;
  gpupool__desc_storage ds;
  int rounds;

  f->a.pid = getpid();
  f->a.pidfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
  assert_true(f->a.pidfd >= 0);
  assert_int_equal(gpupool__allocate(&f->reg, &f->a, pool(f), 4096, 0, &h), 0);
  gpupool__fill_desc(&f->reg, &f->a, h, NULL, &ds); /* a maps the slab */
  assert_non_null(ds.slab.export_data.data);
  gpupool__client_drop(&f->reg, &f->a);
  gpupool__client_drop(&f->reg, &f->b);
  assert_int_equal(f->reg.npending, 1); /* waits for this process to exit */
  gpupool__registry_close(&f->reg);
  for (rounds = 0; rounds < 100 && uv_loop_alive(&f->loop); rounds++)
    uv_run(&f->loop, UV_RUN_NOWAIT);
  assert_false(uv_loop_alive(&f->loop));
  f->be->ops->close(f->be);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_holders_and_exactly_once, setup, teardown),
      cmocka_unit_test_setup_teardown(test_names, setup, teardown),
      cmocka_unit_test_setup_teardown(test_slabs_and_dedicated, setup, teardown),
      cmocka_unit_test_setup_teardown(test_full_pool_message_and_revoke, setup, teardown),
      cmocka_unit_test_setup_teardown(test_limits, setup_limits, teardown),
      cmocka_unit_test_setup_teardown(test_drop_client_releases_everything, setup, teardown),
      cmocka_unit_test_setup(test_close_with_a_live_dead_client, setup),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
