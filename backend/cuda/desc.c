/*
 * The CUDA backend's descriptor (see backend.h). Built with or without the CUDA toolkit: a
 * build without it still knows the backend's pools and defaults, and refuses to open it.
 */
#include "cuda.h"
#include "gpupool.pb-c.h"

static const char *cuda_refuse_kind(gpupool_mem_kind kind) {
  (void)kind;
  return "the cuda backend cannot export plain host memory with a POSIX fd (use kind = "
         "host-numa for pinned host memory, or --backend host)";
}

const gpupool__backend_desc gpupool__backend_cuda = {
    .kind = GPUPOOL__WIRE__BACKEND_KIND__BACKEND_CUDA,
    .name = "cuda",
    .what = "CUDA memory pools exported with POSIX fds",
    .mem_kinds = (1u << GPUPOOL_MEM_DEVICE) | (1u << GPUPOOL_MEM_HOST_NUMA),
    .default_mem_kind = GPUPOOL_MEM_DEVICE,
    .default_slab_size = 256ull << 20,
    .default_capacity = 4ull << 30,
    .refuse_kind = cuda_refuse_kind,
    .probe = gpupool__cuda_probe,
    .open = gpupool__cuda_open,
    .default_pools = gpupool__cuda_default_pools,
    .pool_fd_maps_all = 1,
    .pool_keeps_memory = 1,
    .every_pool_survives = 0,
#ifdef GPUPOOL_HAVE_CUDA
    .client = &gpupool__cuda_client_ops,
#else
    .client = NULL, /* this build cannot import CUDA pools */
#endif
};
