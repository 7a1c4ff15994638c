/*
 * Slabs made with the driver's virtual memory API, exported as POSIX fds (see vmm.h).
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cuda.h"
#include "errors.h"
#include "vmm.h"

static struct {
  CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*export_fd)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
  CUresult (*import_fd)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
  CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
  CUresult (*props)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
  CUresult (*error_name)(CUresult, const char **);
  CUresult (*error_string)(CUresult, const char **);
} api;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static char why[256];

static void load(void) {
  static const struct {
    const char *name;
    void **fn;
  } calls[] = {
      {"cuMemCreate", (void **)&api.create},
      {"cuMemRelease", (void **)&api.release},
      {"cuMemExportToShareableHandle", (void **)&api.export_fd},
      {"cuMemImportFromShareableHandle", (void **)&api.import_fd},
      {"cuMemAddressReserve", (void **)&api.reserve},
      {"cuMemAddressFree", (void **)&api.address_free},
      {"cuMemMap", (void **)&api.map},
      {"cuMemUnmap", (void **)&api.unmap},
      {"cuMemSetAccess", (void **)&api.set_access},
      {"cuMemGetAllocationGranularity", (void **)&api.granularity},
      {"cuMemGetAllocationPropertiesFromHandle", (void **)&api.props},
      {"cuGetErrorName", (void **)&api.error_name},
      {"cuGetErrorString", (void **)&api.error_string},
  };
  for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSuccess;
    cudaError_t e = cudaGetDriverEntryPointByVersion(calls[i].name, calls[i].fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !*calls[i].fn) {
      (void)cudaGetLastError();
      snprintf(why, sizeof why, "the driver has no %s (%s): surviving pools (survive=yes) need a CUDA "
               "12 or newer driver", calls[i].name, e != cudaSuccess ? cudaGetErrorName(e) : "symbol not found");
      memset(&api, 0, sizeof api);
      return;
    }
  }
}

int gpupool__vmm_load(void) {
  pthread_once(&once, load);
  if (!api.create)
    return gpupool__err(GPUPOOL_ENOTSUP, "%s", why);
  return 0;
}

static int fail(int code, CUresult r, const char *call, int device, const char *fix) {
  const char *name = "?", *str = "?";
  if (api.error_name)
    (void)api.error_name(r, &name);
  if (api.error_string)
    (void)api.error_string(r, &str);
  if (device >= 0)
    return gpupool__err(code, "%s failed on CUDA device %d: %s (%s)%s%s", call, device, name ? name : "?",
                        str ? str : "?", fix ? ": " : "", fix ? fix : "");
  return gpupool__err(code, "%s failed: %s (%s)%s%s", call, name ? name : "?", str ? str : "?",
                      fix ? ": " : "", fix ? fix : "");
}

/* Make device current for a driver call (cudaSetDevice makes its primary context current),
 * remembering the caller's in *prev. */
static int enter(int device, int *prev) {
  cudaError_t e = cudaGetDevice(prev);
  if (e == cudaSuccess && *prev != device)
    e = cudaSetDevice(device);
  if (e != cudaSuccess)
    return gpupool__cuda_fail(GPUPOOL_EBACKEND, e, "cudaSetDevice", device,
                              "the slab lives on a device this process cannot see; check CUDA_VISIBLE_DEVICES");
  return 0;
}

static void leave(int device, int prev) {
  if (prev != device && cudaSetDevice(prev) != cudaSuccess)
    (void)cudaGetLastError();
}

/* Device memory of device (numa < 0), or pinned host memory of NUMA node numa. */
static void alloc_prop(CUmemAllocationProp *prop, int device, int numa) {
  memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = numa < 0 ? CU_MEM_LOCATION_TYPE_DEVICE : CU_MEM_LOCATION_TYPE_HOST_NUMA;
  prop->location.id = numa < 0 ? device : numa;
  prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

int gpupool__vmm_granularity(int device, int numa, uint64_t *out) {
  CUmemAllocationProp prop;
  size_t g = 0;
  CUresult r;
  int rc, prev = -1;
  if ((rc = gpupool__vmm_load()) != 0 || (rc = enter(device, &prev)) != 0)
    return rc;
  alloc_prop(&prop, device, numa);
  r = api.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  leave(device, prev);
  if (r != CUDA_SUCCESS)
    return fail(GPUPOOL_ENOTSUP, r, numa < 0 ? "cuMemGetAllocationGranularity (POSIX-fd device memory)"
                                             : "cuMemGetAllocationGranularity (POSIX-fd host-NUMA memory)", device,
                "this device (or driver, for host-NUMA memory: CUDA 12.2 or newer) cannot make such memory "
                "exportable as a POSIX fd: remove survive=yes from the pool");
  if (g == 0 || (g & (g - 1)))
    return gpupool__err(GPUPOOL_EBACKEND, "CUDA device %d reports an allocation granularity of %zu bytes", device, g);
  *out = g;
  return 0;
}

uint64_t gpupool__vmm_round(uint64_t size, uint64_t gran) { return (size + gran - 1) & ~(gran - 1); }

static int grant(CUdeviceptr va, uint64_t size, int device) {
  CUmemAccessDesc d;
  CUresult r;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = device;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = api.set_access(va, (size_t)size, &d, 1);
  if (r != CUDA_SUCCESS)
    return fail(GPUPOOL_EBACKEND, r, "cuMemSetAccess", device,
                "this device cannot reach the slab's GPU (no peer access): use a pool on this device");
  return 0;
}

/* The CPU's access to pinned host memory mapped at va (the id of a HOST_NUMA access location
 * is ignored). */
static int grant_cpu(CUdeviceptr va, uint64_t size) {
  CUmemAccessDesc d;
  CUresult r;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = api.set_access(va, (size_t)size, &d, 1);
  if (r != CUDA_SUCCESS)
    return fail(GPUPOOL_EBACKEND, r, "cuMemSetAccess (the CPU, on host-NUMA memory)", -1, NULL);
  return 0;
}

/* Map handle at a new address range with access for device, the bits of access and devs (and
 * the CPU for host memory); the handle stays the caller's. With device current. */
static int map_handle(CUmemGenericAllocationHandle h, int device, int host, uint64_t size, uint64_t access,
                      const int *devs, int ndevs, void **out) {
  CUdeviceptr va = 0;
  CUresult r;
  int rc;
  r = api.reserve(&va, (size_t)size, 0, 0, 0);
  if (r != CUDA_SUCCESS)
    return fail(r == CUDA_ERROR_OUT_OF_MEMORY ? GPUPOOL_ENOMEM : GPUPOOL_EBACKEND, r, "cuMemAddressReserve",
                device, "this process is out of GPU virtual address space");
  r = api.map(va, (size_t)size, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    rc = fail(GPUPOOL_EBACKEND, r, "cuMemMap", device,
              "the memory is smaller than its record says, or not device memory of this GPU");
    goto out_free;
  }
  if ((rc = grant(va, size, device)) != 0 || (host && (rc = grant_cpu(va, size)) != 0))
    goto out_unmap;
  for (int d = 0; d < 64; d++)
    if (d != device && (access & (1ull << d)) && (rc = grant(va, size, d)) != 0)
      goto out_unmap;
  for (int i = 0; i < ndevs; i++)
    if (devs[i] != device && (devs[i] >= 64 || !(access & (1ull << devs[i]))) && (rc = grant(va, size, devs[i])) != 0)
      goto out_unmap;
  *out = (void *)(uintptr_t)va;
  return 0;

out_unmap:
  (void)api.unmap(va, (size_t)size);
out_free:
  (void)api.address_free(va, (size_t)size);
  return rc;
}

int gpupool__vmm_create(int device, int numa, uint64_t size, uint64_t access, int *fd, void **va) {
  CUmemAllocationProp prop;
  CUmemGenericAllocationHandle h = 0;
  CUresult r;
  int rc, prev = -1, out_fd = -1;

  *fd = -1;
  *va = NULL;
  if ((rc = gpupool__vmm_load()) != 0 || (rc = enter(device, &prev)) != 0)
    return rc;
  alloc_prop(&prop, device, numa);
  r = api.create(&h, (size_t)size, &prop, 0);
  if (r != CUDA_SUCCESS) {
    rc = fail(r == CUDA_ERROR_OUT_OF_MEMORY ? GPUPOOL_ENOSPC : GPUPOOL_EBACKEND, r,
              numa < 0 ? "cuMemCreate" : "cuMemCreate (host-NUMA memory)", device,
              r == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory; free buffers or lower the pool's capacity"
              : numa >= 0 ? "check that the NUMA node exists and has free memory" : NULL);
    goto out;
  }
  r = api.export_fd(&out_fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) {
    rc = fail(GPUPOOL_EBACKEND, r, "cuMemExportToShareableHandle", device, "check the open-files limit (ulimit -n)");
    goto out_release;
  }
  if ((rc = map_handle(h, device, numa >= 0, size, access, NULL, 0, va)) != 0) {
    close(out_fd);
    goto out_release;
  }
  *fd = out_fd;
out_release:
  /* The mapping and the fd hold the memory from here on. */
  (void)api.release(h);
out:
  leave(device, prev);
  return rc;
}

int gpupool__vmm_import(int fd, int device, int numa, uint64_t size, uint64_t access, const int *devs, int ndevs,
                        void **va) {
  CUmemGenericAllocationHandle h = 0;
  CUmemAllocationProp prop;
  CUresult r;
  int rc, prev = -1;

  *va = NULL;
  if ((rc = gpupool__vmm_load()) != 0 || (rc = enter(device, &prev)) != 0)
    return rc;
  r = api.import_fd(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    rc = fail(GPUPOOL_EBACKEND, r, "cuMemImportFromShareableHandle", device,
              "the fd is not CUDA memory of this machine's driver, or this process cannot use the GPU "
              "(in a container, share the host's /dev/nvidia*)");
    goto out;
  }
  /* The memory must be where the pool says: a slab kept for a pool whose device (or kind, or
   * NUMA node) was changed since would otherwise be served as what it is not. */
  memset(&prop, 0, sizeof prop);
  r = api.props(&prop, h);
  if (r != CUDA_SUCCESS)
    rc = fail(GPUPOOL_EBACKEND, r, "cuMemGetAllocationPropertiesFromHandle", device, NULL);
  else if (numa == GPUPOOL__VMM_DEVICE ? prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device
           : prop.location.type != CU_MEM_LOCATION_TYPE_HOST_NUMA || (numa >= 0 && prop.location.id != numa))
    rc = gpupool__err(GPUPOOL_ENOTSUP, "the memory is %s %d, not %s %d as the pool is: was the pool's device, kind or "
                      "NUMA node changed?", prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? "on device" : "host memory of node",
                      prop.location.id, numa == GPUPOOL__VMM_DEVICE ? "on device" : "host memory of node",
                      numa == GPUPOOL__VMM_DEVICE ? device : numa);
  else
    rc = map_handle(h, device, numa != GPUPOOL__VMM_DEVICE, size, access, devs, ndevs, va);
  (void)api.release(h);
out:
  leave(device, prev);
  return rc;
}

int gpupool__vmm_access(void *va, uint64_t size, int device) {
  int rc, prev = -1;
  if ((rc = gpupool__vmm_load()) != 0 || (rc = enter(device, &prev)) != 0)
    return rc;
  rc = grant((CUdeviceptr)(uintptr_t)va, size, device);
  leave(device, prev);
  return rc;
}

int gpupool__vmm_unmap(void *va, uint64_t size) {
  CUresult r;
  int rc;
  if (!va)
    return 0;
  if ((rc = gpupool__vmm_load()) != 0)
    return rc;
  r = api.unmap((CUdeviceptr)(uintptr_t)va, (size_t)size);
  if (r != CUDA_SUCCESS)
    return fail(GPUPOOL_EBACKEND, r, "cuMemUnmap", -1, NULL);
  r = api.address_free((CUdeviceptr)(uintptr_t)va, (size_t)size);
  if (r != CUDA_SUCCESS)
    return fail(GPUPOOL_EBACKEND, r, "cuMemAddressFree", -1, NULL);
  return 0;
}

static const uint8_t tag[4] = {'G', 'P', 'V', 'M'};

uint32_t gpupool__vmm_export_encode(uint64_t size, uint8_t *out) {
  memcpy(out, tag, 4);
  for (int i = 0; i < 8; i++)
    out[4 + i] = (uint8_t)(size >> (8 * i));
  return GPUPOOL__VMM_EXPORT_LEN;
}

int gpupool__vmm_export_decode(const uint8_t *data, size_t len, uint64_t *size) {
  uint64_t s = 0;
  if (len != GPUPOOL__VMM_EXPORT_LEN || memcmp(data, tag, 4) != 0)
    return 0;
  for (int i = 0; i < 8; i++)
    s |= (uint64_t)data[4 + i] << (8 * i);
  *size = s;
  return 1;
}
