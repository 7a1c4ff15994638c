/*
 * The host backend's copy jobs (replicas between pools): every byte of every segment reaches
 * every destination of the chain, a failing job says so, and copy_free stops a running job
 * and returns only once its thread touches no slab any more.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "../support/run_tests.h"

#include "backend.h"
#include "errors.h"
#include "host/host.h"

#define MIB (1ull << 20)

typedef struct {
  gpupool__backend *be;
  gpupool__bpool *pool;
  gpupool__bslab slab[3];
  uint8_t *map[3];
} fixture;

static void open_fixture(fixture *f, uint64_t size) {
  gpupool__pool_config cfg;
  int fd = -1;
  gpupool__pool_config_init(&cfg);
  snprintf(cfg.name, sizeof cfg.name, "copy");
  cfg.kind = GPUPOOL_MEM_HOST;
  cfg.capacity = 64 * MIB;
  assert_int_equal(gpupool__host_open(&f->be), 0);
  assert_int_equal(f->be->ops->pool_create(f->be, &cfg, &f->pool, &fd), 0);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(f->be->ops->slab_alloc(f->pool, size, 0, &f->slab[i]), 0);
    f->map[i] = mmap(NULL, f->slab[i].size, PROT_READ | PROT_WRITE, MAP_SHARED, f->slab[i].fd, 0);
    assert_true(f->map[i] != MAP_FAILED);
  }
}

static void close_fixture(fixture *f) {
  for (int i = 0; i < 3; i++) {
    munmap(f->map[i], f->slab[i].size);
    f->be->ops->slab_free(f->pool, &f->slab[i]);
  }
  f->be->ops->pool_destroy(f->pool);
  f->be->ops->close(f->be);
}

static uint8_t byte_at(uint64_t j) { return (uint8_t)(j * 2654435761u >> 13); }

/* Segments: [0, 3 MiB + 17) of slab 0 to offset 4096 of slabs 1 and 2, and 100 bytes at 5 MiB
 * to the start of both. */
static void chain_segs(fixture *f, gpupool__bcopy_seg segs[2]) {
  memset(segs, 0, 2 * sizeof *segs);
  segs[0].src = (gpupool__bloc){f->pool, &f->slab[0], 0};
  segs[0].dst[0] = (gpupool__bloc){f->pool, &f->slab[1], 4096};
  segs[0].dst[1] = (gpupool__bloc){f->pool, &f->slab[2], 4096};
  segs[0].len = 3 * MIB + 17;
  segs[1].src = (gpupool__bloc){f->pool, &f->slab[0], 5 * MIB};
  segs[1].dst[0] = (gpupool__bloc){f->pool, &f->slab[1], 0};
  segs[1].dst[1] = (gpupool__bloc){f->pool, &f->slab[2], 0};
  segs[1].len = 100;
}

static int wait_job(fixture *f, gpupool__bcopy *c) {
  int st;
  while ((st = f->be->ops->copy_poll(c)) == 0) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return st;
}

/* First: the failure hook counts jobs from the first one of the process. */
static void test_failing_job_says_so(void **state) {
  fixture f;
  gpupool__bcopy_seg segs[2];
  gpupool__bcopy *c = NULL;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_FAIL", "1", 1);
  open_fixture(&f, 8 * MIB);
  chain_segs(&f, segs);
  assert_int_equal(f.be->ops->copy_start(f.be, segs, 2, 2, &c), 0);
  assert_true(wait_job(&f, c) < 0);
  assert_non_null(strstr(gpupool__errmsg(), "failed"));
  f.be->ops->copy_free(c);
  /* The next job is not asked to fail. */
  assert_int_equal(f.be->ops->copy_start(f.be, segs, 2, 2, &c), 0);
  assert_int_equal(wait_job(&f, c), 1);
  f.be->ops->copy_free(c);
  unsetenv("GPUPOOL_TEST_COPY_FAIL");
  close_fixture(&f);
}

static void test_chain_copies_every_byte(void **state) {
  fixture f;
  gpupool__bcopy_seg segs[2];
  gpupool__bcopy *c = NULL;
  (void)state;
  open_fixture(&f, 8 * MIB);
  for (uint64_t j = 0; j < 8 * MIB; j++)
    f.map[0][j] = byte_at(j);
  chain_segs(&f, segs);
  assert_int_equal(f.be->ops->copy_start(f.be, segs, 2, 2, &c), 0);
  assert_int_equal(wait_job(&f, c), 1);
  f.be->ops->copy_free(c);
  for (int d = 1; d <= 2; d++) {
    for (uint64_t j = 0; j < 3 * MIB + 17; j++)
      if (f.map[d][4096 + j] != byte_at(j))
        fail_msg("destination %d differs at %llu", d, (unsigned long long)j);
    for (uint64_t j = 0; j < 100; j++)
      assert_int_equal(f.map[d][j], byte_at(5 * MIB + j));
    /* Nothing past the segment was written. */
    assert_int_equal(f.map[d][4096 + 3 * MIB + 17], 0);
  }
  close_fixture(&f);
}

static void test_free_stops_a_running_job(void **state) {
  fixture f;
  gpupool__bcopy_seg segs[2];
  gpupool__bcopy *c = NULL;
  (void)state;
  setenv("GPUPOOL_TEST_COPY_DELAY_MS", "50", 1);
  open_fixture(&f, 8 * MIB);
  memset(f.map[0], 0x5a, 8 * MIB);
  chain_segs(&f, segs);
  assert_int_equal(f.be->ops->copy_start(f.be, segs, 2, 2, &c), 0);
  assert_int_equal(f.be->ops->copy_poll(c), 0);
  f.be->ops->copy_free(c); /* joins: from here on no thread writes the slabs */
  unsetenv("GPUPOOL_TEST_COPY_DELAY_MS");
  /* The last chunk of the first segment was never reached. */
  assert_int_equal(f.map[1][4096 + 3 * MIB], 0);
  memset(f.map[1], 0, 8 * MIB);
  usleep(100000);
  for (uint64_t j = 0; j < 8 * MIB; j += 4096)
    assert_int_equal(f.map[1][j], 0);
  close_fixture(&f);
}

static void test_bad_jobs_refused(void **state) {
  fixture f;
  gpupool__bcopy_seg segs[2];
  gpupool__bcopy *c = NULL;
  (void)state;
  open_fixture(&f, 2 * MIB);
  chain_segs(&f, segs);
  assert_int_equal(f.be->ops->copy_start(f.be, segs, 2, 0, &c), GPUPOOL_EINVAL);
  assert_int_equal(f.be->ops->copy_start(f.be, segs, 2, GPUPOOL_COPY_MAX_DSTS + 1, &c), GPUPOOL_EINVAL);
  assert_int_equal(f.be->ops->copy_start(f.be, segs, 0, 1, &c), GPUPOOL_EINVAL);
  close_fixture(&f);
}

int main(void) {
  return TS_RUN_TESTS(NULL, NULL, test_failing_job_says_so, test_chain_copies_every_byte,
                      test_free_stops_a_running_job, test_bad_jobs_refused);
}
