/*
 * Fuzz target: gpupoold's configuration parsers. The input up to its first NUL byte is a
 * config file (read through gpd_config_load from a memfd); every NUL-separated piece
 * after it is a --pool spec. When everything parses, the final checks run against the host
 * backend, and a configuration they accept must hold what they promise (the daemon sizes
 * memfds and slabs from it without further checks).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend.h"
#include "config.h"
#include "errors.h"
#include "fuzz.h"
#include "log.h"

static int file_fd = -1;
static char file_path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  if (!getenv("GPUPOOL_FUZZ_LOG"))
    gpupool__log_set_level(0);
  file_fd = memfd_create("gpupoold.conf", MFD_CLOEXEC);
  if (file_fd < 0)
    fuzz_fail("memfd_create: %s", strerror(errno));
  snprintf(file_path, sizeof file_path, "/proc/self/fd/%d", file_fd);
  return 0;
}

static void check_pool(const gpupool__pool_config *p) {
  const uint64_t mib2 = 2ull << 20;
  if (p->kind != GPUPOOL_MEM_HOST)
    fuzz_fail("pool '%s' accepted with kind %d by the host backend", p->name, (int)p->kind);
  if (p->alignment == 0 || (p->alignment & (p->alignment - 1)) || p->alignment > mib2)
    fuzz_fail("pool '%s' accepted with alignment %llu", p->name, (unsigned long long)p->alignment);
  if (p->slab_size == 0 || p->slab_size > GPUPOOL_SLAB_HARD_MAX || p->slab_size % mib2)
    fuzz_fail("pool '%s' accepted with slab_size %llu", p->name, (unsigned long long)p->slab_size);
  if (p->capacity < p->slab_size || p->capacity % mib2)
    fuzz_fail("pool '%s' accepted with capacity %llu for slabs of %llu", p->name,
              (unsigned long long)p->capacity, (unsigned long long)p->slab_size);
  if (!memchr(p->name, '\0', sizeof p->name))
    fuzz_fail("pool name not terminated");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  gpd_config cfg;
  const uint8_t *nul = memchr(data, '\0', size);
  size_t flen = nul ? (size_t)(nul - data) : size;
  char *specs;
  int ok;

  if (ftruncate(file_fd, 0) != 0 || pwrite(file_fd, data, flen, 0) != (ssize_t)flen)
    fuzz_fail("writing the config memfd: %s", strerror(errno));
  gpd_config_defaults(&cfg);
  ok = gpd_config_load(&cfg, file_path) == 0;

  /* The specs, each NUL-terminated in a copy (the input is not). */
  specs = malloc(size - flen + 1);
  if (!specs)
    fuzz_fail("out of memory");
  if (nul) {
    memcpy(specs, nul + 1, size - flen - 1);
    specs[size - flen - 1] = '\0';
    for (char *s = specs; ok && s < specs + (size - flen - 1); s += strlen(s) + 1)
      ok = gpd_config_add_pool_spec(&cfg, s) == 0;
  }
  free(specs);

  if (ok && gpd_config_finish(&cfg, &gpupool__backend_host) == 0) {
    if (cfg.n_pools < 1 || cfg.n_pools > GPUPOOL_MAX_POOLS)
      fuzz_fail("%d pools after finishing", cfg.n_pools);
    for (int i = 0; i < cfg.n_pools; i++)
      check_pool(&cfg.pools[i]);
    if (cfg.max_frame < 4096 || cfg.max_frame > (64u << 20))
      fuzz_fail("max_frame %u accepted", cfg.max_frame);
    if (cfg.n_allow_uids > GPUPOOL_MAX_ALLOW || cfg.n_allow_gids > GPUPOOL_MAX_ALLOW)
      fuzz_fail("allow lists of %d and %d ids", cfg.n_allow_uids, cfg.n_allow_gids);
    if (!memchr(cfg.socket_path, '\0', sizeof cfg.socket_path))
      fuzz_fail("socket path not terminated");
  }
  return 0;
}
