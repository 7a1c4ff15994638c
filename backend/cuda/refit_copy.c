/*
 * Refit copies on the GPU: a plan's copies (client/refit.c) replayed on the engine's stream.
 *
 * Copies within one device go through the gather kernel (refit_gather.cu): up to
 * GPUPOOL__GATHER_OPS copies a launch, so a model's thousand-odd copies cost a few launches
 * instead of a thousand copy-engine operations. Everything else (another GPU's memory over
 * peer access, pinned or pageable host memory) is one cudaMemcpy2DAsync each, with
 * cudaMemcpyDefault letting unified addressing tell where each end lies. A build whose CUDA
 * toolkit has no nvcc has no kernel (GPUPOOL_HAVE_GATHER unset): every copy is a
 * cudaMemcpy2DAsync then, as is every copy when the kernel cannot be loaded or launched here
 * (said once on stderr) or GPUPOOL_REFIT_GATHER=0 asks for it (to compare both ways).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "errors.h"
#include "refit_copy.h"
#include "refit_gather.h"

#ifdef GPUPOOL_HAVE_GATHER
#include "refit_gather_fatbin.h" /* gpupool__gather_fatbin: refit_gather.cu, built by nvcc */
#endif

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static cudaKernel_t gather_kernel;
static int gather_on; /* 1: the kernel is loaded and has not failed */

static void say_off(const char *why, cudaError_t e) {
  fprintf(stderr, "libgpupool-client: refit copies go one by one (cudaMemcpy2DAsync), not through the gather "
          "kernel: %s%s%s%s\n", why, e != cudaSuccess ? ": " : "", e != cudaSuccess ? cudaGetErrorName(e) : "",
          e != cudaSuccess ? " (set GPUPOOL_REFIT_GATHER=0 to choose this and silence this line)" : "");
}

static void load_gather(void) {
#ifdef GPUPOOL_HAVE_GATHER
  cudaLibrary_t lib;
  cudaError_t e = cudaLibraryLoadData(&lib, gpupool__gather_fatbin, NULL, NULL, 0, NULL, NULL, 0);
  if (e == cudaSuccess)
    e = cudaLibraryGetKernel(&gather_kernel, lib, "gpupool_refit_gather");
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    say_off("loading it failed", e);
    return;
  }
  __atomic_store_n(&gather_on, 1, __ATOMIC_RELEASE);
#else
  say_off("this build of gpupool has none (its CUDA toolkit had no nvcc)", cudaSuccess);
#endif
}

static int copy2d(const gpupool__refit_op *o, cudaStream_t s) {
  cudaError_t e;
  if (o->rows == 1)
    e = cudaMemcpyAsync(o->dst, o->src, o->width, cudaMemcpyDefault, s);
  else
    e = cudaMemcpy2DAsync(o->dst, o->dpitch, o->src, o->spitch, o->width, o->rows, cudaMemcpyDefault, s);
  if (e != cudaSuccess)
    return gpupool__err(GPUPOOL_EBACKEND, "refit copy of %zu x %zu bytes: %s (%s)", o->rows, o->width,
                        cudaGetErrorString(e), cudaGetErrorName(e));
  return 0;
}

/* Launch the kernel over a.op[0 .. a.n-1] (their `first` already set), nblocks blocks. */
static cudaError_t launch(gpupool__gather_args *a, uint64_t nblocks, cudaStream_t s) {
  void *args[1] = {a};
  dim3 grid = {(unsigned)nblocks, 1, 1}, block = {256, 1, 1};
  return cudaLaunchKernel((const void *)gather_kernel, grid, block, args, 0, s);
}

static int copy_many(const gpupool__refit_op *ops, size_t n, void *stream, size_t *gathered) {
  cudaStream_t s = (cudaStream_t)stream;
  gpupool__gather_args *a = NULL;
  uint64_t nblocks = 0;
  cudaError_t le = cudaSuccess;
  int rc;
  const char *env = getenv("GPUPOOL_REFIT_GATHER"); /* asked each time: a benchmark compares both */
  *gathered = 0;
  if (!(env && !strcmp(env, "0")))
    pthread_once(&load_once, load_gather);
  if (!(env && !strcmp(env, "0")) && __atomic_load_n(&gather_on, __ATOMIC_ACQUIRE) && !(a = malloc(sizeof *a)))
    return gpupool__err(GPUPOOL_ENOMEM, "out of memory for a refit's copies");
  if (a)
    a->n = 0;
  /* Casts only the kernel does: any it cannot, and nothing is queued. */
  for (size_t i = 0; i < n; i++)
    if (ops[i].sk && ops[i].width && ops[i].rows && (!a || !ops[i].gather || ops[i].rows > UINT32_MAX)) {
      free(a);
      return gpupool__err(GPUPOOL_ENOTSUP, "a refit cast into device memory runs in gpupool's gather kernel, "
                          "which %s: publish the version in the engine's dtype%s",
                          !a ? "is off or cannot run here (see stderr, GPUPOOL_REFIT_GATHER)"
                             : "casts within one GPU only (this copy's source lies on another GPU or in host "
                               "memory, or the stream is another GPU's)",
                          !a ? ", or let the kernel run" : ", or cast on the trainer's GPU");
    }
  for (size_t i = 0; i < n; i++) {
    const gpupool__refit_op *o = &ops[i];
    if (!a || !o->gather || o->width == 0 || o->rows == 0 || o->rows > UINT32_MAX) {
      if (o->width && o->rows && (rc = copy2d(o, s)) != 0)
        goto fail;
      continue;
    }
    gpupool__gather_op *g = &a->op[a->n];
    g->dst = (uint64_t)(uintptr_t)o->dst;
    g->src = (uint64_t)(uintptr_t)o->src;
    g->dpitch = o->dpitch;
    g->spitch = o->spitch;
    g->width = o->width;
    g->rows = o->rows;
    g->first = nblocks;
    g->sk = (uint8_t)o->sk;
    g->dk = (uint8_t)o->dk;
    g->sesz = (uint8_t)o->sesz;
    g->desz = (uint8_t)o->desz;
    g->pad = 0;
    uint64_t chunk = o->sk ? GPUPOOL__GATHER_CAST_CHUNK : GPUPOOL__GATHER_CHUNK;
    if (o->width > chunk) {
      uint64_t bpr = (o->width + chunk - 1) / chunk;
      g->bpr = (uint32_t)bpr;
      g->rpb = 1;
      nblocks += bpr * o->rows;
    } else {
      g->bpr = 1;
      g->rpb = (uint32_t)(chunk / o->width);
      nblocks += (o->rows + g->rpb - 1) / g->rpb;
    }
    if (++a->n == GPUPOOL__GATHER_OPS || nblocks > (1u << 30)) {
      if ((le = launch(a, nblocks, s)) != cudaSuccess)
        goto off;
      *gathered += a->n;
      a->n = 0;
      nblocks = 0;
    }
  }
  if (a && a->n > 0) {
    if ((le = launch(a, nblocks, s)) != cudaSuccess)
      goto off;
    *gathered += a->n;
  }
  free(a);
  return 0;
off:
  /* The kernel cannot run here (no image for this GPU, parameters too large for its driver):
   * every copy it has not done goes one by one, now and from now on. Those it did are done
   * again (same bytes into disjoint targets: harmless). */
  (void)cudaGetLastError();
  __atomic_store_n(&gather_on, 0, __ATOMIC_RELEASE);
  say_off("launching it failed", le);
  free(a);
  *gathered = 0;
  for (size_t i = 0; i < n; i++)
    if (ops[i].sk && ops[i].width && ops[i].rows)
      return gpupool__err(GPUPOOL_EBACKEND, "a refit cast into device memory needs gpupool's gather kernel, "
                          "which failed to launch here (%s); some targets may hold a part of the version: "
                          "publish it in the engine's dtype", cudaGetErrorName(le));
  for (size_t i = 0; i < n; i++)
    if (ops[i].width && ops[i].rows && (rc = copy2d(&ops[i], s)) != 0)
      return rc;
  return 0;
fail:
  free(a);
  return rc;
}

/* The kernel is launched on the stream's device: made current for the call when the caller's
 * current device is another (a launch on another device's stream fails). */
int gpupool__refit_copy_many(const gpupool__refit_op *ops, size_t n, void *stream, size_t *gathered) {
  int cur = -1, want = -1, rc;
  if (stream) {
    if (cudaGetDevice(&cur) != cudaSuccess || cudaStreamGetDevice((cudaStream_t)stream, &want) != cudaSuccess) {
      (void)cudaGetLastError(); /* CUDA cannot say: copy as asked, the copies report what fails */
      want = cur;
    }
    if (want != cur) {
      cudaError_t e = cudaSetDevice(want);
      if (e != cudaSuccess)
        return gpupool__err(GPUPOOL_EBACKEND, "refit: making the stream's device %d current: %s (%s)", want,
                            cudaGetErrorString(e), cudaGetErrorName(e));
      rc = copy_many(ops, n, stream, gathered);
      if (cudaSetDevice(cur) != cudaSuccess)
        (void)cudaGetLastError();
      return rc;
    }
  }
  return copy_many(ops, n, stream, gathered);
}

int gpupool__refit_device_casts(void) {
#ifdef GPUPOOL_HAVE_GATHER
  return 1;
#else
  return 0;
#endif
}

int gpupool__refit_ptr_device(const void *p) {
  struct cudaPointerAttributes at;
  if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return at.type == cudaMemoryTypeDevice ? at.device : -1;
}

int gpupool__refit_stream_device(void *stream) {
  int d = -1;
  cudaError_t e = stream ? cudaStreamGetDevice((cudaStream_t)stream, &d) : cudaGetDevice(&d);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return d;
}
