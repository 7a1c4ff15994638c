/*
 * GPU check of read-only file objects: a file published under a name is got by two worker
 * processes, each of which reads it from a kernel through the registered mapping's device
 * pointer (in place, over PCIe) and copies it to device memory with cudaMemcpy, and verifies
 * every word against the pattern the file was written with. The range starts off a page
 * boundary, so the library's alignment of the mapping is checked too.
 *
 * Usage: gpupool_gpu_files GPUPOOLD. Exits 77 (skipped) without a GPU.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <gpupool/gpupool.h>

#include "gpu_harness.h"
#include "gpu_kernels.h"

#define SEED 0x5eedf11eu
#define RANGE_OFFSET (3 * 4096 + 256) /* off a page boundary; a multiple of 4 */
#define RANGE_BYTES (96ull << 20)
#define NWORKERS 2
#define STEP_MS 60000

/* The kernels' pattern (gpu_kernels.cu), for writing the file on the host. */
static uint32_t pattern(uint64_t i, uint32_t seed) {
  uint32_t x = (uint32_t)i * 2654435761u ^ seed ^ (uint32_t)(i >> 32) * 0x9e3779b9u;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  return x;
}

static int write_file(const char *path) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  uint32_t *buf = malloc(1 << 20);
  uint8_t head[RANGE_OFFSET];
  int rc = -1;
  if (fd < 0 || !buf)
    goto out;
  memset(head, 0xA5, sizeof head);
  if (gh_full_io(fd, head, sizeof head, 1) != 0)
    goto out;
  for (uint64_t o = 0; o < RANGE_BYTES; o += 1 << 20) {
    for (uint64_t j = 0; j < (1 << 20) / 4; j++)
      buf[j] = pattern(o / 4 + j, SEED);
    if (gh_full_io(fd, buf, 1 << 20, 1) != 0)
      goto out;
  }
  /* A tail after the range, which nothing must read as part of it. */
  if (gh_full_io(fd, head, 100, 1) != 0)
    goto out;
  rc = 0;
out:
  if (fd >= 0)
    close(fd);
  free(buf);
  return rc;
}

/* Worker: get the file, check it through the device pointer and through a copy. */
static int w_reader(char **a) {
  const char *sock = a[0], *name = a[1];
  gpupool_client *c = NULL;
  gpupool_file *f = NULL;
  unsigned long long mm = ~0ull, mm_copy = ~0ull;
  void *dst = NULL;
  const void *dev;
  cudaEvent_t t0, t1;
  float ms = 0;
  int rc;

  if (cudaSetDevice(0) != cudaSuccess || cudaFree(NULL) != cudaSuccess) {
    gh_say("FAIL no CUDA context");
    return 1;
  }
  if ((rc = gpupool_client_connect(sock, "file-reader", GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0 ||
      (rc = gpupool_file_get(c, name, 10000, 0, &f)) != 0) {
    gh_say("FAIL %s: %s", gpupool_err_name(rc), gpupool_last_error());
    return 1;
  }
  dev = gpupool_file_device_ptr(f);
  if (!dev || gpupool_file_size(f) != RANGE_BYTES) {
    gh_say("FAIL device pointer %p, size %zu", dev, gpupool_file_size(f));
    return 1;
  }
  /* In place: a kernel reads the file's pages over PCIe. */
  if (gk_count_mismatches(dev, RANGE_BYTES, SEED, NULL, &mm) != 0) {
    gh_say("FAIL kernel read of the mapping: %s", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  /* A copy to device memory, from the registered (pinned) mapping. */
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  if (cudaMalloc(&dst, RANGE_BYTES) != cudaSuccess) {
    gh_say("FAIL cudaMalloc");
    return 1;
  }
  cudaEventRecord(t0, NULL);
  if (cudaMemcpy(dst, gpupool_file_ptr(f), RANGE_BYTES, cudaMemcpyHostToDevice) != cudaSuccess) {
    gh_say("FAIL cudaMemcpy: %s", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  cudaEventRecord(t1, NULL);
  cudaEventSynchronize(t1);
  cudaEventElapsedTime(&ms, t0, t1);
  if (gk_count_mismatches(dst, RANGE_BYTES, SEED, NULL, &mm_copy) != 0) {
    gh_say("FAIL kernel read of the copy");
    return 1;
  }
  cudaFree(dst);
  gpupool_file_release(f);
  gpupool_client_disconnect(c);
  gh_say("RESULT mismatches %llu copy_mismatches %llu copy_gbps %.1f", mm, mm_copy,
         ms > 0 ? (double)RANGE_BYTES / (ms * 1e6) : 0.0);
  return mm == 0 && mm_copy == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
  gh_daemon d;
  gh_proc w[NWORKERS];
  gpupool_client *c = NULL;
  char path[400], line[256];
  int rc, failed = 0;

  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc == 5 && !strcmp(argv[1], "worker") && !strcmp(argv[2], "reader"))
    return w_reader(argv + 3);
  if (argc != 2) {
    fprintf(stderr, "usage: %s GPUPOOLD\n", argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  gh_gpu_count_or_skip(1, "the file-object GPU check");
  if (gh_daemon_start(&d, argv[1], "name=gpu0,kind=device,device=0,capacity=1G,slab=64M") != 0)
    return 1;
  snprintf(path, sizeof path, "%s/file.bin", d.dir);
  if (write_file(path) != 0) {
    fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
    gh_daemon_stop(&d, 1);
    return 1;
  }
  if ((rc = gpupool_client_connect(d.sock, "file-publisher", GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0 ||
      (rc = gpupool_file_publish(c, "gpufile", path, RANGE_OFFSET, RANGE_BYTES, NULL)) != 0) {
    fprintf(stderr, "publish_file: %s: %s\n", gpupool_err_name(rc), gpupool_last_error());
    gh_daemon_stop(&d, 1);
    return 1;
  }
  for (int i = 0; i < NWORKERS; i++) {
    const char *args[] = {"x", "worker", "reader", d.sock, "gpufile", NULL};
    if (gh_spawn(&w[i], args, NULL, 0) != 0) {
      fprintf(stderr, "cannot start worker %d\n", i);
      failed = 1;
      w[i].pid = 0;
    }
  }
  for (int i = 0; i < NWORKERS; i++) {
    if (!w[i].pid)
      continue;
    if (gh_expect(&w[i], "RESULT", line, sizeof line, STEP_MS) < 0) {
      fprintf(stderr, "worker %d gave no result\n", i);
      failed = 1;
    } else {
      printf("worker %d: %s\n", i, line);
    }
    if (gh_wait(&w[i], STEP_MS) != 0)
      failed = 1;
  }
  if (gpupool_name_unpublish(c, "gpufile") != 0)
    failed = 1;
  gpupool_client_disconnect(c);
  unlink(path);
  if (gh_daemon_stop(&d, failed) != 0)
    failed = 1;
  printf("%s: file objects read in place and copied by %d processes\n", failed ? "FAIL" : "PASS", NWORKERS);
  return failed;
}
