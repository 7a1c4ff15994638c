/*
 * Bundles, versions and pipelined requests against a real gpupoold (host backend) from real
 * processes: a bundle allocated in one request lies contiguous in one buffer; published in one
 * request, it is got whole by another process, byte-exact with every member's description;
 * republishing makes the next version, which a reader waiting with newer_than gets, while a
 * reader of the previous version keeps reading it; every member of a version is visible at
 * once (never a mix of two versions); a version's memory goes back exactly once, after its
 * last holder (a SIGKILLed one included); bad input is refused with the reason and nothing
 * left behind; several requests from one thread are in flight together.
 */
#include <signal.h>

#include "harness.h"

#define KIB (1u << 10)
#define MIB (1u << 20)

static th_daemon D;

static int setup(void **state) {
  *state = &D;
  th_prepare(&D);
  th_write_conf(&D, "[daemon]\nmax_bundle_members = 2000\n"
                    "[pool default]\nkind = host\ncapacity = 256M\nslab_size = 8M\n");
  th_start(&D, 1, NULL);
  return 0;
}

static int teardown(void **state) { return th_teardown(state); }

/* Member i of the test bundles: its name and size (sizes vary, some not multiples of the
 * alignment), and a 1-D uint8 description of it. */
static uint64_t member_size(int i) { return (uint64_t)(i % 7) * 1000 + 1 + (uint64_t)i * 13; }

static void member_name(int i, char *buf, size_t len) { snprintf(buf, len, "layers.%d.weight", i); }

static void byte_meta(gpupool_tensor_meta *m, uint64_t n) {
  memset(m, 0, sizeof *m);
  m->dtype_code = GPUPOOL_DTYPE_UINT;
  m->dtype_bits = 8;
  m->dtype_lanes = 1;
  m->ndim = 1;
  m->shape[0] = (int64_t)n;
}

/* Allocate a bundle of n members through c; filled with seed (+ member index). */
static int make_bundle(gpupool_client *c, int n, uint32_t seed, gpupool_bundle **out) {
  gpupool_member_spec *specs = calloc((size_t)n, sizeof *specs);
  gpupool_tensor_meta *metas = calloc((size_t)n, sizeof *metas);
  char (*names)[32] = calloc((size_t)n, sizeof *names);
  int rc = -1;
  if (!specs || !metas || !names)
    goto out;
  for (int i = 0; i < n; i++) {
    member_name(i, names[i], sizeof names[i]);
    byte_meta(&metas[i], member_size(i));
    specs[i].name = names[i];
    specs[i].size = member_size(i);
    specs[i].meta = &metas[i];
  }
  if ((rc = gpupool_bundle_alloc(c, NULL, specs, n, 0, 0, NULL, out)) != 0)
    goto out;
  for (int i = 0; i < n; i++) {
    gpupool_member m;
    gpupool_bundle_member(*out, i, &m);
    th_fill(m.ptr, seed + (uint32_t)i, m.size);
  }
out:
  free(specs);
  free(metas);
  free(names);
  return rc;
}

/* Every member of b has the names, sizes, descriptions and bytes make_bundle(seed) gave it. */
static int bundle_ok(const gpupool_bundle *b, int n, uint32_t seed) {
  if (gpupool_bundle_count(b) != n)
    return 0;
  for (int i = 0; i < n; i++) {
    gpupool_member m;
    char name[32];
    member_name(i, name, sizeof name);
    if (gpupool_bundle_member(b, i, &m) != 0 || strcmp(m.name, name) || m.size != member_size(i) ||
        !m.has_meta || m.meta.ndim != 1 || m.meta.shape[0] != (int64_t)member_size(i) ||
        !th_check(m.ptr, seed + (uint32_t)i, m.size) || gpupool_bundle_find(b, name) != i)
      return 0;
  }
  return 1;
}

/* ---- one request each way --------------------------------------------------------------------- */

static int reader_of(const th_daemon *d, int n) {
  gpupool_client *c;
  gpupool_bundle *b;
  CHILD_CHECK(gpupool_client_connect(d->sock, "reader", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_bundle_get(c, "model", 0, 5000, GPUPOOL_READ_ONLY, NULL, &b) == 0, "bundle_get");
  CHILD_CHECK(gpupool_bundle_version(b) == 1, "version %llu", (unsigned long long)gpupool_bundle_version(b));
  CHILD_CHECK(gpupool_bundle_buffers(b) == 1, "%d buffers", gpupool_bundle_buffers(b));
  CHILD_CHECK(bundle_ok(b, n, 100), "bundle contents differ");
  CHILD_CHECK(gpupool_bundle_release(b, NULL) == 0, "release");
  gpupool_client_disconnect(c);
  return 0;
}

static void test_roundtrip(void **state) {
  gpupool_client *c = th_connect(&D, "producer");
  gpupool_bundle *b;
  gpupool_member m0, m;
  uint64_t v = 0, end = 0;
  const int n = 1000;

  assert_int_equal(make_bundle(c, n, 100, &b), 0);
  /* One buffer, members one after the other, each aligned to the pool's 256 bytes. */
  assert_int_equal(gpupool_bundle_buffers(b), 1);
  assert_int_equal(gpupool_bundle_version(b), 0);
  gpupool_bundle_member(b, 0, &m0);
  for (int i = 0; i < n; i++) {
    gpupool_bundle_member(b, i, &m);
    assert_int_equal(m.buffer, 0);
    assert_int_equal(m.offset % 256, 0);
    assert_true(m.offset >= end);
    assert_true(m.offset - end < 256);
    assert_ptr_equal((char *)m.ptr, (char *)m0.ptr + m.offset);
    end = m.offset + m.size;
  }
  assert_true(gpupool_buffer_size(gpupool_bundle_buffer(b, 0)) >= end);
  assert_int_equal(gpupool_bundle_publish(b, "model", NULL, &v), 0);
  assert_int_equal(v, 1);
  assert_int_equal(gpupool_bundle_version(b), 1);
  th_wait_ok(th_spawn(&D, reader_of, n), "reader");
  /* The name keeps the memory: the producer may let go. */
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  th_wait_ok(th_spawn(&D, reader_of, n), "reader after the producer let go");
  /* A bundle is not a single buffer. */
  {
    gpupool_buffer *x;
    assert_int_equal(gpupool_buffer_get(c, "model", 0, 0, 0, NULL, &x, NULL), GPUPOOL_EINVAL);
    assert_non_null(strstr(gpupool_last_error(), "gpupool_bundle_get"));
  }
  assert_int_equal(gpupool_name_unpublish(c, "model"), 0);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 3000);
}

/* Members in separately allocated buffers, and a single buffer got as a bundle. */
static void test_members_and_single(void **state) {
  gpupool_client *c = th_connect(&D, "producer");
  gpupool_buffer *a, *b2;
  gpupool_bundle *g;
  gpupool_member m;
  gpupool_tensor_meta meta;
  gpupool_member_ref refs[3];
  uint64_t v;

  assert_int_equal(gpupool_buffer_alloc(c, NULL, 3000, 0, NULL, &a), 0);
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 20 * MIB, 0, NULL, &b2), 0); /* a dedicated slab */
  th_fill(gpupool_buffer_ptr(a), 1, 3000);
  th_fill(gpupool_buffer_ptr(b2), 2, 20 * MIB);
  byte_meta(&meta, 1000);
  refs[0] = (gpupool_member_ref){.name = "a.lo", .buffer = a, .offset = 0, .size = 1000, .meta = &meta};
  refs[1] = (gpupool_member_ref){.name = "big", .buffer = b2, .offset = 0, .size = 20 * MIB};
  refs[2] = (gpupool_member_ref){.name = "a.hi", .buffer = a, .offset = 1000, .size = 2000};
  assert_int_equal(gpupool_bundle_publish_members(c, "mixed", refs, 3, NULL, &v), 0);
  assert_int_equal(v, 1);
  assert_int_equal(gpupool_buffer_release(a, NULL), 0);
  assert_int_equal(gpupool_buffer_release(b2, NULL), 0);
  {
    gpupool_client *r = th_connect(&D, "reader");
    assert_int_equal(gpupool_bundle_get(r, "mixed", 0, 0, 0, NULL, &g), 0);
    assert_int_equal(gpupool_bundle_count(g), 3);
    assert_int_equal(gpupool_bundle_buffers(g), 2);
    assert_int_equal(gpupool_bundle_member(g, 0, &m), 0);
    assert_string_equal(m.name, "a.lo");
    assert_true(m.has_meta && m.meta.shape[0] == 1000);
    assert_true(th_check(m.ptr, 1, 1000));
    assert_int_equal(gpupool_bundle_member(g, gpupool_bundle_find(g, "a.hi"), &m), 0);
    assert_int_equal(m.size, 2000);
    assert_false(m.has_meta);
    /* The second half of buffer a: the fill pattern from byte 1000 on. */
    {
      uint8_t want[2000];
      th_fill(want, 1, 1000);
      uint8_t full[3000];
      th_fill(full, 1, 3000);
      memcpy(want, full + 1000, 2000);
      assert_memory_equal(m.ptr, want, 2000);
    }
    assert_int_equal(gpupool_bundle_member(g, gpupool_bundle_find(g, "big"), &m), 0);
    assert_true(th_check(m.ptr, 2, 20 * MIB));
    assert_int_equal(gpupool_bundle_find(g, "nope"), GPUPOOL_ENOENT);
    assert_int_equal(gpupool_bundle_member(g, 3, &m), GPUPOOL_EINVAL);
    assert_int_equal(gpupool_bundle_release(g, NULL), 0);
    /* A bundle of one member is still a bundle: a plain get would hand over its whole buffer
     * without the member's range and description. */
    {
      gpupool_buffer *o, *x;
      assert_int_equal(gpupool_buffer_alloc(c, NULL, 64, 0, NULL, &o), 0);
      byte_meta(&meta, 4);
      refs[0] = (gpupool_member_ref){.name = "one", .buffer = o, .offset = 16, .size = 4, .meta = &meta};
      assert_int_equal(gpupool_bundle_publish_members(c, "one-member", refs, 1, NULL, NULL), 0);
      assert_int_equal(gpupool_buffer_get(r, "one-member", 0, 0, 0, NULL, &x, NULL), GPUPOOL_EINVAL);
      assert_non_null(strstr(gpupool_last_error(), "gpupool_bundle_get"));
      assert_int_equal(gpupool_name_unpublish(c, "one-member"), 0);
      /* Two holds of one buffer (the client got its own publish back) are one buffer. */
      assert_int_equal(gpupool_buffer_publish(o, "self", NULL, NULL, NULL), 0);
      assert_int_equal(gpupool_buffer_get(c, "self", 0, 0, 0, NULL, &x, NULL), 0);
      refs[1] = (gpupool_member_ref){.name = "two", .buffer = x, .offset = 32, .size = 8};
      assert_int_equal(gpupool_bundle_publish_members(c, "two-holds", refs, 2, NULL, NULL), 0);
      assert_int_equal(gpupool_bundle_get(r, "two-holds", 0, 0, 0, NULL, &g), 0);
      assert_int_equal(gpupool_bundle_buffers(g), 1);
      assert_int_equal(gpupool_bundle_release(g, NULL), 0);
      assert_int_equal(gpupool_buffer_release(x, NULL), 0);
      assert_int_equal(gpupool_name_unpublish(c, "two-holds"), 0);
      assert_int_equal(gpupool_name_unpublish(c, "self"), 0);
      assert_int_equal(gpupool_buffer_release(o, NULL), 0);
    }
    /* A name published on its own comes as a bundle of one member named "". */
    {
      gpupool_buffer *x;
      assert_int_equal(gpupool_buffer_alloc(c, NULL, 500, 0, NULL, &x), 0);
      th_fill(gpupool_buffer_ptr(x), 3, 500);
      byte_meta(&meta, 500);
      assert_int_equal(gpupool_buffer_publish(x, "single", &meta, NULL, NULL), 0);
      assert_int_equal(gpupool_bundle_get(r, "single", 0, 0, 0, NULL, &g), 0);
      assert_int_equal(gpupool_bundle_count(g), 1);
      assert_int_equal(gpupool_bundle_member(g, 0, &m), 0);
      assert_string_equal(m.name, "");
      assert_int_equal(gpupool_bundle_layout_id(g), 0); /* no member table */
      assert_int_equal(m.size, 500);
      assert_true(m.has_meta && m.meta.shape[0] == 500);
      assert_true(th_check(m.ptr, 3, 500));
      assert_int_equal(gpupool_bundle_release(g, NULL), 0);
      assert_int_equal(gpupool_buffer_release(x, NULL), 0);
    }
    gpupool_client_disconnect(r);
  }
  assert_int_equal(gpupool_name_unpublish(c, "mixed"), 0);
  assert_int_equal(gpupool_name_unpublish(c, "single"), 0);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 3000);
}

/* ---- versions --------------------------------------------------------------------------------- */

/* Publishes versions 2..n+1 of "v" (member bytes all equal to the version), double
 * buffering: each new version in a fresh bundle while the old one may still be read. */
static int version_writer(const th_daemon *d, int n) {
  gpupool_client *c;
  CHILD_CHECK(gpupool_client_connect(d->sock, "writer", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  for (int k = 0; k < n; k++) {
    gpupool_bundle *b;
    uint64_t v;
    CHILD_CHECK(make_bundle(c, 64, 0, &b) == 0, "alloc");
    for (int i = 0; i < 64; i++) {
      gpupool_member m;
      gpupool_bundle_member(b, i, &m);
      memset(m.ptr, (int)(uint8_t)(k + 2), m.size);
    }
    CHILD_CHECK(gpupool_bundle_publish(b, "v", NULL, &v) == 0, "publish");
    CHILD_CHECK(v == (uint64_t)k + 2, "version %llu, expected %d", (unsigned long long)v, k + 2);
    CHILD_CHECK(gpupool_bundle_release(b, NULL) == 0, "release");
    th_sleep_ms(k % 3);
  }
  gpupool_client_disconnect(c);
  return 0;
}

/* All of a version, never a mix: each member's bytes equal the bundle's version. */
static int uniform(const gpupool_bundle *b) {
  uint8_t want = (uint8_t)gpupool_bundle_version(b);
  for (int i = 0; i < gpupool_bundle_count(b); i++) {
    gpupool_member m;
    gpupool_bundle_member(b, i, &m);
    for (uint64_t j = 0; j < m.size; j++)
      if (((uint8_t *)m.ptr)[j] != want)
        return 0;
  }
  return 1;
}

static void test_versions(void **state) {
  gpupool_client *c = th_connect(&D, "first");
  gpupool_bundle *b, *held, *g;
  gpupool_daemon_stats ds;
  gpupool_pool_stats ps0, ps1, ps2;
  uint64_t v, last;
  uint64_t t0;
  const int nversions = 40;

  th_stats(&D, NULL, &ps0);
  assert_int_equal(make_bundle(c, 64, 0, &b), 0);
  for (int i = 0; i < 64; i++) {
    gpupool_member m;
    gpupool_bundle_member(b, i, &m);
    memset(m.ptr, 1, m.size);
  }
  assert_int_equal(gpupool_bundle_publish(b, "v", NULL, &v), 0);
  assert_int_equal(v, 1);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  /* Nothing newer yet: a getter that will not wait is told so, one that waits times out. */
  assert_int_equal(gpupool_bundle_get(c, "v", 1, 0, 0, NULL, &g), GPUPOOL_ENOENT);
  assert_non_null(strstr(gpupool_last_error(), "not newer than 1"));
  t0 = th_now_ms();
  assert_int_equal(gpupool_bundle_get(c, "v", 1, 150, 0, NULL, &g), GPUPOOL_ETIMEDOUT);
  assert_true(th_now_ms() - t0 >= 140);
  assert_non_null(strstr(gpupool_last_error(), "newer than 1"));
  /* A reader keeps version 1 while the writer publishes the others. */
  assert_int_equal(gpupool_bundle_get(c, "v", 0, 0, GPUPOOL_READ_ONLY, NULL, &held), 0);
  th_stats(&D, NULL, &ps1);
  {
    pid_t w = th_spawn(&D, version_writer, nversions);
    gpupool_client *r = th_connect(&D, "follower");
    last = 1;
    while (last < (uint64_t)nversions + 1) {
      assert_int_equal(gpupool_bundle_get(r, "v", last, 5000, GPUPOOL_READ_ONLY, NULL, &g), 0);
      assert_true(gpupool_bundle_version(g) > last);
      assert_true(uniform(g));
      last = gpupool_bundle_version(g);
      assert_int_equal(gpupool_bundle_release(g, NULL), 0);
    }
    th_wait_ok(w, "writer");
    gpupool_client_disconnect(r);
  }
  /* Version 1 is intact under its reader, and still counted. */
  assert_int_equal(gpupool_bundle_version(held), 1);
  assert_true(uniform(held));
  th_stats(&D, &ds, &ps2);
  assert_true(ps2.used > ps1.used - ps0.used); /* version 1 + the latest one */
  assert_int_equal(gpupool_bundle_release(held, NULL), 0);
  /* Only the latest version is left: one bundle's worth. */
  th_stats(&D, &ds, &ps2);
  assert_int_equal(ps2.used - ps0.used, ps1.used - ps0.used);
  assert_int_equal(ds.names, 1);
  assert_int_equal(gpupool_name_unpublish(c, "v"), 0);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 3000);
}

/* Gets version 1, tells the parent (through the pipe fd `arg`), then waits to be killed. */
static int holder_then_killed(const th_daemon *d, int fd) {
  gpupool_client *c;
  gpupool_bundle *b;
  CHILD_CHECK(gpupool_client_connect(d->sock, "doomed", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  CHILD_CHECK(gpupool_bundle_get(c, "k", 0, 5000, GPUPOOL_READ_ONLY, NULL, &b) == 0, "get");
  CHILD_CHECK(write(fd, "x", 1) == 1, "write");
  for (;;)
    pause();
}

static void test_killed_holder(void **state) {
  gpupool_client *c = th_connect(&D, "producer");
  gpupool_bundle *b;
  gpupool_pool_stats ps0, ps;
  int pfd[2];
  char ch;
  pid_t kid;
  uint64_t one, v;

  th_stats(&D, NULL, &ps0);
  assert_int_equal(make_bundle(c, 32, 7, &b), 0);
  assert_int_equal(gpupool_bundle_publish(b, "k", NULL, &v), 0);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  th_stats(&D, NULL, &ps);
  one = ps.used - ps0.used;
  assert_int_equal(pipe(pfd), 0);
  kid = th_spawn(&D, holder_then_killed, pfd[1]);
  assert_int_equal(read(pfd[0], &ch, 1), 1);
  /* Version 2 while the holder of version 1 is alive: both stay. */
  assert_int_equal(make_bundle(c, 32, 8, &b), 0);
  assert_int_equal(gpupool_bundle_publish(b, "k", NULL, &v), 0);
  assert_int_equal(v, 2);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  th_stats(&D, NULL, &ps);
  assert_int_equal(ps.used - ps0.used, 2 * one);
  kill(kid, SIGKILL);
  waitpid(kid, NULL, 0);
  th_track(kid, 0);
  /* Its lease closes with it: version 1 goes, version 2 stays and reads right. */
  {
    uint64_t end = th_now_ms() + 3000;
    do {
      th_stats(&D, NULL, &ps);
      if (ps.used - ps0.used == one)
        break;
      th_sleep_ms(20);
    } while (th_now_ms() < end);
    assert_int_equal(ps.used - ps0.used, one);
  }
  assert_int_equal(gpupool_bundle_get(c, "k", 1, 0, 0, NULL, &b), 0);
  assert_true(bundle_ok(b, 32, 8));
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  assert_int_equal(gpupool_name_unpublish(c, "k"), 0);
  close(pfd[0]);
  close(pfd[1]);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 3000);
}

/* ---- bad input --------------------------------------------------------------------------------- */

static void test_bad_input(void **state) {
  uint64_t fds = th_settled_fds(&D);
  gpupool_client *c = th_connect(&D, "bad");
  gpupool_bundle *b = NULL;
  gpupool_member_spec specs[3];
  gpupool_tensor_meta meta;
  gpupool_buffer *x;
  gpupool_member_ref refs[2];

  /* Duplicate member names. */
  specs[0] = (gpupool_member_spec){.name = "w", .size = 10};
  specs[1] = (gpupool_member_spec){.name = "b", .size = 10};
  specs[2] = (gpupool_member_spec){.name = "w", .size = 10};
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 3, 0, 0, NULL, &b), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "'w' appears twice"));
  assert_null(b);
  /* Empty, missing and over-long names; no members; zero sizes. */
  specs[2] = (gpupool_member_spec){.name = "", .size = 10};
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 3, 0, 0, NULL, &b), GPUPOOL_ENAME);
  assert_non_null(strstr(gpupool_last_error(), "member 2"));
  specs[2] = (gpupool_member_spec){.name = NULL, .size = 10};
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 3, 0, 0, NULL, &b), GPUPOOL_ENAME);
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 0, 0, 0, NULL, &b), GPUPOOL_EINVAL);
  specs[2] = (gpupool_member_spec){.name = "z", .size = 0};
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 3, 0, 0, NULL, &b), GPUPOOL_EINVAL);
  /* Sizes whose sum overflows, and a member larger than one allocation may be. */
  specs[0].size = UINT64_MAX / 2 + 10;
  specs[1].size = UINT64_MAX / 2 + 10;
  assert_int_not_equal(gpupool_bundle_alloc(c, NULL, specs, 2, 0, 0, NULL, &b), 0);
  assert_non_null(strstr(gpupool_last_error(), "larger than one allocation"));
  specs[0].size = 3 * MIB;
  specs[1].size = 300 * MIB; /* over the pool's 256 MiB capacity */
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 2, 0, 0, NULL, &b), GPUPOOL_ETOOBIG);
  /* Too many members: the daemon's max_bundle_members is 2000. */
  {
    const int n = 2001;
    gpupool_member_spec *many = calloc(n, sizeof *many);
    char (*names)[16] = calloc(n, sizeof *names);
    assert_non_null(many);
    assert_non_null(names);
    for (int i = 0; i < n; i++) {
      snprintf(names[i], sizeof names[i], "m%d", i);
      many[i] = (gpupool_member_spec){.name = names[i], .size = 8};
    }
    assert_int_equal(gpupool_bundle_alloc(c, NULL, many, n, 0, 0, NULL, &b), GPUPOOL_ELIMIT);
    assert_non_null(strstr(gpupool_last_error(), "max_bundle_members"));
    assert_int_equal(gpupool_bundle_alloc(c, NULL, many, GPUPOOL_BUNDLE_MAX_MEMBERS + 1, 0, 0, NULL, &b),
                     GPUPOOL_EINVAL);
    free(many);
    free(names);
  }
  /* Metadata that does not fit its member. */
  byte_meta(&meta, 11);
  specs[0] = (gpupool_member_spec){.name = "w", .size = 10, .meta = &meta};
  specs[1] = (gpupool_member_spec){.name = "b", .size = 10};
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 2, 0, 0, NULL, &b), GPUPOOL_EMETA);
  assert_non_null(strstr(gpupool_last_error(), "member 0 ('w')"));
  /* Ranges outside their buffer, duplicate names and foreign buffers in publish_members. */
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 100, 0, NULL, &x), 0);
  refs[0] = (gpupool_member_ref){.name = "a", .buffer = x, .offset = 50, .size = 51};
  refs[1] = (gpupool_member_ref){.name = "b", .buffer = x, .offset = 0, .size = 10};
  assert_int_equal(gpupool_bundle_publish_members(c, "p", refs, 2, NULL, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "does not fit"));
  refs[0] = (gpupool_member_ref){.name = "a", .buffer = x, .offset = UINT64_MAX, .size = 2};
  assert_int_equal(gpupool_bundle_publish_members(c, "p", refs, 2, NULL, NULL), GPUPOOL_EINVAL);
  refs[0] = (gpupool_member_ref){.name = "b", .buffer = x, .offset = 20, .size = 10};
  assert_int_equal(gpupool_bundle_publish_members(c, "p", refs, 2, NULL, NULL), GPUPOOL_EINVAL);
  assert_non_null(strstr(gpupool_last_error(), "appears twice"));
  {
    gpupool_client *o = th_connect(&D, "other");
    gpupool_buffer *y;
    assert_int_equal(gpupool_buffer_alloc(o, NULL, 100, 0, NULL, &y), 0);
    refs[0] = (gpupool_member_ref){.name = "a", .buffer = y, .offset = 0, .size = 10};
    assert_int_equal(gpupool_bundle_publish_members(c, "p", refs, 2, NULL, NULL), GPUPOOL_EINVAL);
    assert_non_null(strstr(gpupool_last_error(), "another client"));
    assert_int_equal(gpupool_buffer_release(y, NULL), 0);
    gpupool_client_disconnect(o);
  }
  {
    gpupool_daemon_stats ds;
    th_stats(&D, &ds, NULL);
    assert_int_equal(ds.names, 0);
  }
  assert_int_equal(gpupool_buffer_release(x, NULL), 0);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 3000);
  th_expect_fds(&D, fds);
}

/* ---- waiting and pipelining ------------------------------------------------------------------- */

/* Asks for an 80 MiB bundle in a full pool, waiting up to 5 s; it must get it once the
 * parent frees memory (after `ms`), not before. */
static int bundle_waiter(const th_daemon *d, int ms) {
  gpupool_client *c;
  gpupool_bundle *b;
  gpupool_member_spec specs[2] = {{.name = "x", .size = 40 * MIB}, {.name = "y", .size = 40 * MIB}};
  uint64_t t0;
  CHILD_CHECK(gpupool_client_connect(d->sock, "waiter", GPUPOOL_TIMEOUT_DEFAULT, &c) == 0, "connect");
  t0 = th_now_ms();
  CHILD_CHECK(gpupool_bundle_alloc(c, NULL, specs, 2, 0, 5000, NULL, &b) == 0, "bundle_alloc");
  CHILD_CHECK(th_now_ms() - t0 >= (uint64_t)ms / 2, "got memory after %llu ms, before any was freed",
              (unsigned long long)(th_now_ms() - t0));
  CHILD_CHECK(gpupool_bundle_count(b) == 2, "count");
  CHILD_CHECK(gpupool_bundle_release(b, NULL) == 0, "release");
  gpupool_client_disconnect(c);
  return 0;
}

static void test_bundle_alloc_waits(void **state) {
  gpupool_client *c = th_connect(&D, "hog");
  gpupool_buffer *hog[4];
  gpupool_bundle *b;
  gpupool_member_spec specs[2] = {{.name = "x", .size = 40 * MIB}, {.name = "y", .size = 40 * MIB}};
  pid_t w;

  for (int i = 0; i < 4; i++)
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 60 * MIB, 0, NULL, &hog[i]), 0);
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 2, 0, 0, NULL, &b), GPUPOOL_ENOSPC);
  assert_int_equal(gpupool_bundle_alloc(c, NULL, specs, 2, 0, 100, NULL, &b), GPUPOOL_ETIMEDOUT);
  assert_non_null(strstr(gpupool_last_error(), "waiting for memory"));
  w = th_spawn(&D, bundle_waiter, 300);
  th_sleep_ms(300);
  for (int i = 0; i < 2; i++)
    assert_int_equal(gpupool_buffer_release(hog[i], NULL), 0);
  th_wait_ok(w, "bundle waiter");
  for (int i = 2; i < 4; i++)
    assert_int_equal(gpupool_buffer_release(hog[i], NULL), 0);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 3000);
}

static void test_pipelining(void **state) {
  gpupool_client *c = th_connect(&D, "pipeline");
  gpupool_client *r = th_connect(&D, "reader");
  gpupool_buffer *b[16], *g[16];
  gpupool_pending *p[16];
  char name[16];
  uint64_t v;

  /* 16 publishes in flight together. */
  for (int i = 0; i < 16; i++) {
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 1000 + (size_t)i, 0, NULL, &b[i]), 0);
    th_fill(gpupool_buffer_ptr(b[i]), 40 + (uint32_t)i, 1000 + (uint64_t)i);
    snprintf(name, sizeof name, "p%d", i);
    assert_int_equal(gpupool_buffer_publish_begin(b[i], name, NULL, NULL, &p[i]), 0);
  }
  for (int i = 15; i >= 0; i--) {
    assert_int_equal(gpupool_pending_end(p[i], &v), 0);
    assert_int_equal(v, 1);
  }
  /* 16 gets in flight, ended in another order than issued; one more is cancelled. */
  for (int i = 0; i < 16; i++) {
    snprintf(name, sizeof name, "p%d", i);
    assert_int_equal(gpupool_buffer_get_begin(r, name, 0, 1000, GPUPOOL_READ_ONLY, &p[i]), 0);
  }
  {
    gpupool_pending *extra;
    assert_int_equal(gpupool_buffer_get_begin(r, "p3", 0, 0, 0, &extra), 0);
    gpupool_pending_cancel(extra);
  }
  for (int i = 0; i < 16; i++) {
    int k = (i * 7) % 16;
    assert_int_equal(gpupool_buffer_get_end(p[k], NULL, &g[k], &v), 0);
    assert_int_equal(v, 1);
    assert_true(th_check(gpupool_buffer_ptr(g[k]), 40 + (uint32_t)k, 1000 + (uint64_t)k));
  }
  /* A get that fails ends with its error. */
  {
    gpupool_buffer *none = (gpupool_buffer *)&v;
    gpupool_pending *q;
    assert_int_equal(gpupool_buffer_get_begin(r, "absent", 0, 0, 0, &q), 0);
    assert_int_equal(gpupool_buffer_get_end(q, NULL, &none, NULL), GPUPOOL_ENOENT);
    assert_null(none);
    assert_non_null(strstr(gpupool_last_error(), "absent"));
  }
  /* Releases in flight together. */
  for (int i = 0; i < 16; i++)
    assert_int_equal(gpupool_buffer_release_begin(g[i], NULL, &p[i]), 0);
  for (int i = 0; i < 16; i++)
    assert_int_equal(gpupool_pending_end(p[i], NULL), 0);
  for (int i = 0; i < 16; i++) {
    snprintf(name, sizeof name, "p%d", i);
    assert_int_equal(gpupool_name_unpublish(c, name), 0);
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  }
  /* A bundle get in flight next to a plain one. */
  {
    gpupool_bundle *bb, *gb;
    gpupool_pending *q1, *q2;
    gpupool_buffer *one;
    assert_int_equal(make_bundle(c, 10, 5, &bb), 0);
    assert_int_equal(gpupool_bundle_publish(bb, "bb", NULL, NULL), 0);
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 64, 0, NULL, &one), 0);
    assert_int_equal(gpupool_buffer_publish(one, "one", NULL, NULL, NULL), 0);
    assert_int_equal(gpupool_bundle_get_begin(r, "bb", 0, 0, 0, &q1), 0);
    assert_int_equal(gpupool_buffer_get_begin(r, "one", 0, 0, 0, &q2), 0);
    assert_int_equal(gpupool_buffer_get_end(q2, NULL, &g[0], NULL), 0);
    assert_int_equal(gpupool_bundle_get_end(q1, NULL, &gb), 0);
    assert_true(bundle_ok(gb, 10, 5));
    assert_int_equal(gpupool_bundle_release(gb, NULL), 0);
    assert_int_equal(gpupool_buffer_release(g[0], NULL), 0);
    assert_int_equal(gpupool_bundle_release(bb, NULL), 0);
    assert_int_equal(gpupool_buffer_release(one, NULL), 0);
    assert_int_equal(gpupool_name_unpublish(c, "bb"), 0);
    assert_int_equal(gpupool_name_unpublish(c, "one"), 0);
  }
  /* A publish whose buffer is released before the publish is ended. */
  {
    gpupool_buffer *x;
    gpupool_pending *q;
    gpupool_tensor_meta meta;
    byte_meta(&meta, 64);
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 64, 0, NULL, &x), 0);
    assert_int_equal(gpupool_buffer_publish_begin(x, "early", &meta, NULL, &q), 0);
    assert_int_equal(gpupool_buffer_release(x, NULL), 0);
    assert_int_equal(gpupool_pending_end(q, &v), 0);
    assert_int_equal(v, 1);
    assert_int_equal(gpupool_name_unpublish(c, "early"), 0);
  }
  /* A pending bundle get answered without members (its table was known when it was sent)
   * still finds that table after the client cached another one for the name. */
  {
    gpupool_bundle *b1, *b2, *g1, *g2;
    gpupool_pending *q;
    gpupool_buffer *o;
    gpupool_member_ref ref;
    assert_int_equal(make_bundle(c, 10, 5, &b1), 0);
    assert_int_equal(gpupool_bundle_publish(b1, "swap", NULL, NULL), 0);
    assert_int_equal(gpupool_bundle_get(r, "swap", 0, 0, 0, NULL, &g1), 0); /* caches table 1 */
    assert_int_equal(gpupool_bundle_release(g1, NULL), 0);
    assert_int_equal(gpupool_bundle_get_begin(r, "swap", 1, 2000, 0, &q), 0);
    assert_int_equal(make_bundle(c, 10, 6, &b2), 0); /* an equal table: the same layout */
    assert_int_equal(gpupool_bundle_publish(b2, "swap", NULL, &v), 0);
    assert_int_equal(v, 2);
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 64, 0, NULL, &o), 0);
    ref = (gpupool_member_ref){.name = "other", .buffer = o, .offset = 0, .size = 64};
    assert_int_equal(gpupool_bundle_publish_members(c, "swap", &ref, 1, NULL, &v), 0);
    assert_int_equal(v, 3);
    assert_int_equal(gpupool_bundle_get(r, "swap", 2, 0, 0, NULL, &g2), 0); /* caches table 2 */
    assert_int_equal(gpupool_bundle_count(g2), 1);
    assert_int_equal(gpupool_bundle_get_end(q, NULL, &g1), 0);
    assert_int_equal(gpupool_bundle_version(g1), 2);
    assert_true(bundle_ok(g1, 10, 6));
    assert_int_equal(gpupool_bundle_release(g1, NULL), 0);
    assert_int_equal(gpupool_bundle_release(g2, NULL), 0);
    assert_int_equal(gpupool_bundle_release(b1, NULL), 0);
    assert_int_equal(gpupool_bundle_release(b2, NULL), 0);
    assert_int_equal(gpupool_buffer_release(o, NULL), 0);
    assert_int_equal(gpupool_name_unpublish(c, "swap"), 0);
  }
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 3000);
}

/* GPUPOOL_KEEP_MAPPED: a dedicated slab stays mapped between versions (the same mapping comes
 * back), and once the daemon frees its buffer the mapping goes at the client's next request,
 * so the memory returns to the pool. */
static void test_keep_mapped(void **state) {
  gpupool_client *c = th_connect(&D, "producer");
  gpupool_client *r = th_connect(&D, "consumer");
  gpupool_bundle *b, *g;
  gpupool_member m;
  gpupool_member_spec spec = {.name = "big", .size = 20 * MIB};
  gpupool_pool_stats ps0, ps;
  void *first;

  th_stats(&D, NULL, &ps0);
  assert_int_equal(gpupool_bundle_alloc(c, NULL, &spec, 1, 0, 0, NULL, &b), 0);
  gpupool_bundle_member(b, 0, &m);
  th_fill(m.ptr, 9, m.size);
  assert_int_equal(gpupool_bundle_publish(b, "kept", NULL, NULL), 0);
  assert_int_equal(gpupool_bundle_get(r, "kept", 0, 0, GPUPOOL_READ_ONLY | GPUPOOL_KEEP_MAPPED, NULL, &g), 0);
  gpupool_bundle_member(g, 0, &m);
  first = m.ptr;
  assert_int_equal(gpupool_bundle_release(g, NULL), 0);
  assert_int_equal(gpupool_bundle_publish(b, "kept", NULL, NULL), 0);
  assert_int_equal(gpupool_bundle_get(r, "kept", 1, 0, GPUPOOL_READ_ONLY | GPUPOOL_KEEP_MAPPED, NULL, &g), 0);
  gpupool_bundle_member(g, 0, &m);
  assert_ptr_equal(m.ptr, first); /* no new mapping */
  /* Same table, same layout id (and the one the allocation had). */
  assert_true(gpupool_bundle_layout_id(g) != 0);
  assert_int_equal(gpupool_bundle_layout_id(g), gpupool_bundle_layout_id(b));
  assert_true(th_check(m.ptr, 9, m.size));
  assert_int_equal(gpupool_bundle_release(g, NULL), 0);
  /* The buffer goes: the daemon revokes the consumer's mapping with its next reply, and the
   * slab goes back once the consumer has said it unmapped it (its request after that). */
  assert_int_equal(gpupool_name_unpublish(c, "kept"), 0);
  assert_int_equal(gpupool_bundle_release(b, NULL), 0);
  th_stats(&D, NULL, &ps);
  assert_true(ps.reserved > ps0.reserved);
  {
    gpupool_daemon_stats ds;
    assert_int_equal(gpupool_client_stats(r, &ds, NULL, 0, NULL), 0);
    assert_int_equal(gpupool_client_stats(r, &ds, NULL, 0, NULL), 0);
  }
  th_stats(&D, NULL, &ps);
  assert_int_equal(ps.reserved, ps0.reserved);
  gpupool_client_disconnect(r);
  gpupool_client_disconnect(c);
  th_wait_idle(&D, 3000);
}

int main(void) {
  return TS_RUN_TESTS(setup, teardown, test_roundtrip, test_members_and_single, test_versions, test_killed_holder,
                      test_bad_input, test_bundle_alloc_waits, test_pipelining, test_keep_mapped);
}
