/*
 * Demo producer: allocates N buffers, fills each with a known pattern, publishes them as
 * PREFIX0..PREFIX{N-1} with a 1-D uint8 tensor description, and releases its own holds (the
 * names keep the buffers alive until consumers are done and the names are unpublished).
 *
 *   gpupool-producer [--socket PATH] [--count N] [--size BYTES] [--prefix NAME] [--pool POOL]
 *                    [--hold-ms MS] [--unpublish]
 */
#include <getopt.h>
#include <inttypes.h>
#include <time.h>
#include <unistd.h>

#include "demo_common.h"

int main(int argc, char **argv) {
  static const struct option opts[] = {{"socket", required_argument, NULL, 's'}, {"count", required_argument, NULL, 'n'},
                                       {"size", required_argument, NULL, 'z'},   {"prefix", required_argument, NULL, 'p'},
                                       {"pool", required_argument, NULL, 'P'},   {"hold-ms", required_argument, NULL, 'w'},
                                       {"unpublish", no_argument, NULL, 'u'},    {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  const char *sock = NULL, *prefix = "demo", *pool = NULL;
  uint32_t count = 4;
  uint64_t size = 1 << 20;
  long hold_ms = 0;
  int opt, rc, unpublish = 0;
  gpupool_client *c;

  while ((opt = getopt_long(argc, argv, "s:n:z:p:P:w:uh", opts, NULL)) != -1) {
    switch (opt) {
    case 's': sock = optarg; break;
    case 'n': count = (uint32_t)strtoul(optarg, NULL, 10); break;
    case 'z': size = strtoull(optarg, NULL, 10); break;
    case 'p': prefix = optarg; break;
    case 'P': pool = optarg; break;
    case 'w': hold_ms = strtol(optarg, NULL, 10); break;
    case 'u': unpublish = 1; break;
    default:
      printf("usage: %s [--socket PATH] [--count N] [--size BYTES] [--prefix NAME] [--pool POOL] "
             "[--hold-ms MS] [--unpublish]\n", argv[0]);
      return opt == 'h' ? 0 : 2;
    }
  }
  if ((rc = gpupool_client_connect(sock, "demo-producer", GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0)
    demo_die("connect", rc);
  uint8_t *tmp = malloc(size);
  if (!tmp) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  for (uint32_t i = 0; i < count; i++) {
    gpupool_buffer *b;
    char name[GPUPOOL_NAME_MAX + 1];
    gpupool_tensor_meta meta = {.dtype_code = GPUPOOL_DTYPE_UINT, .dtype_bits = 8, .dtype_lanes = 1, .ndim = 1};
    if ((rc = gpupool_buffer_alloc(c, pool, size, 1000, NULL, &b)) != 0)
      demo_die("alloc", rc);
    demo_fill(tmp, i, size);
    if (demo_copy(gpupool_buffer_ptr(b), tmp, size, b) != 0)
      return 1;
    snprintf(name, sizeof name, "%s%u", prefix, i);
    meta.shape[0] = (int64_t)size;
    if ((rc = gpupool_buffer_publish(b, name, &meta, NULL, NULL)) != 0)
      demo_die("publish", rc);
    printf("producer: published %-12s %8" PRIu64 " bytes at %p (%s, buffer id %" PRIu64 ")\n", name, size,
           gpupool_buffer_ptr(b), gpupool_buffer_kind(b) == GPUPOOL_MEM_HOST        ? "host memory"
           : gpupool_buffer_kind(b) == GPUPOOL_MEM_HOST_NUMA ? "pinned host memory"
                                                            : "GPU memory",
           gpupool_buffer_id(b));
    if ((rc = gpupool_buffer_release(b, NULL)) != 0)
      demo_die("release", rc);
  }
  if (hold_ms > 0) {
    struct timespec ts = {hold_ms / 1000, (hold_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  if (unpublish)
    for (uint32_t i = 0; i < count; i++) {
      char name[GPUPOOL_NAME_MAX + 1];
      snprintf(name, sizeof name, "%s%u", prefix, i);
      if ((rc = gpupool_name_unpublish(c, name)) != 0)
        demo_die("unpublish", rc);
    }
  free(tmp);
  gpupool_client_disconnect(c);
  printf("producer: done (%u buffers)\n", count);
  return 0;
}
