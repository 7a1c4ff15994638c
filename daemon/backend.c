/*
 * Backend selection: --backend auto|cuda|host. auto uses CUDA when the build has it and a
 * usable GPU is present (driver, memory pools, POSIX-fd export), the host backend otherwise,
 * and logs which and why.
 */
#include <stdio.h>

#include "backend.h"
#include "errors.h"
#include "log.h"

#ifndef GPUPOOL_HAVE_CUDA
int gpupool__backend_cuda_probe(void) {
  gpupool__err(GPUPOOL_ENOTSUP, "this gpupoold was built without CUDA (rebuild with the CUDA toolkit installed)");
  return 0;
}
int gpupool__backend_cuda_open(gpupool__backend **out) {
  (void)out;
  return gpupool__err(GPUPOOL_ENOTSUP,
                      "this gpupoold was built without CUDA (rebuild with the CUDA toolkit installed, "
                      "or run with --backend host)");
}
int gpupool__backend_cuda_default_pools(gpupool__config *c) {
  (void)c;
  return gpupool__err(GPUPOOL_ENOTSUP, "this gpupoold was built without CUDA");
}
#endif

int gpupool__backend_open(gpupool__backend_choice choice, gpupool__backend **out) {
  switch (choice) {
  case GPUPOOL_BACKEND_HOST:
    GPUPOOL__INFO("backend: host (memfd shared memory), as configured");
    return gpupool__backend_host_open(out);
  case GPUPOOL_BACKEND_CUDA: {
    int rc = gpupool__backend_cuda_open(out);
    if (rc == 0)
      GPUPOOL__INFO("backend: cuda, as configured");
    return rc;
  }
  case GPUPOOL_BACKEND_AUTO:
  default:
    if (gpupool__backend_cuda_probe()) {
      int rc = gpupool__backend_cuda_open(out);
      if (rc == 0) {
        GPUPOOL__INFO("backend: cuda (auto: a usable GPU is present)");
        return 0;
      }
      GPUPOOL__WARN("backend auto: CUDA looked usable but failed to open (%s); using host memory",
              gpupool__errmsg());
    } else {
      GPUPOOL__INFO("backend: host (auto: %s)", gpupool__errmsg());
    }
    return gpupool__backend_host_open(out);
  }
}
