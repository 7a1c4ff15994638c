/*
 * The host pools and backend of the daemon-side fuzz targets (fuzz_pools.h).
 */
#include <stdlib.h>

#include "errors.h"
#include "fuzz.h"
#include "fuzz_pools.h"
#include "log.h"

void fuzz_host_pools(gpd_config *cfg, const char *const *specs, gpupool__backend **be) {
  if (!getenv("GPUPOOL_FUZZ_LOG"))
    gpupool__log_set_level(0);
  for (; *specs; specs++)
    if (gpd_config_add_pool_spec(cfg, *specs) != 0)
      fuzz_fail("config: %s", gpupool__errmsg());
  if (gpd_config_finish(cfg, &gpupool__backend_host) != 0)
    fuzz_fail("config: %s", gpupool__errmsg());
  if (gpupool__backend_host.open(be) != 0)
    fuzz_fail("host backend: %s", gpupool__errmsg());
}
