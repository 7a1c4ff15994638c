/*
 * Demo consumer: gets PREFIX0..PREFIX{N-1} by name (waiting for the producer if needed),
 * prints the tensor metadata each was published with, checks every byte against the
 * producer's pattern, and releases. Exit status 0 only if every byte matched.
 *
 *   gpupool-consumer [--socket PATH] [--count N] [--prefix NAME] [--timeout-ms MS] [--id K]
 */
#include <getopt.h>
#include <inttypes.h>

#include "demo_common.h"

int main(int argc, char **argv) {
  static const struct option opts[] = {{"socket", required_argument, NULL, 's'}, {"count", required_argument, NULL, 'n'},
                                       {"prefix", required_argument, NULL, 'p'}, {"timeout-ms", required_argument, NULL, 't'},
                                       {"id", required_argument, NULL, 'i'},     {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  const char *sock = NULL, *prefix = "demo";
  uint32_t count = 4;
  int timeout_ms = 10000, id = 0, opt, rc, bad = 0;
  gpupool_client *c;
  char cname[32];

  while ((opt = getopt_long(argc, argv, "s:n:p:t:i:h", opts, NULL)) != -1) {
    switch (opt) {
    case 's': sock = optarg; break;
    case 'n': count = (uint32_t)strtoul(optarg, NULL, 10); break;
    case 'p': prefix = optarg; break;
    case 't': timeout_ms = atoi(optarg); break;
    case 'i': id = atoi(optarg); break;
    default:
      printf("usage: %s [--socket PATH] [--count N] [--prefix NAME] [--timeout-ms MS] [--id K]\n", argv[0]);
      return opt == 'h' ? 0 : 2;
    }
  }
  snprintf(cname, sizeof cname, "demo-consumer-%d", id);
  if ((rc = gpupool_client_connect(sock, cname, GPUPOOL_TIMEOUT_DEFAULT, &c)) != 0)
    demo_die("connect", rc);
  for (uint32_t i = 0; i < count; i++) {
    gpupool_buffer *b;
    gpupool_tensor_meta meta;
    char name[GPUPOOL_NAME_MAX + 1], shape[64] = "none";
    size_t n;
    uint8_t *tmp;
    uint64_t mismatches = 0;
    snprintf(name, sizeof name, "%s%u", prefix, i);
    if ((rc = gpupool_buffer_get(c, name, 0, timeout_ms, GPUPOOL_READ_ONLY, NULL, &b, NULL)) != 0)
      demo_die("get", rc);
    n = gpupool_buffer_size(b);
    if (gpupool_buffer_tensor(b, &meta) == 0)
      snprintf(shape, sizeof shape, "dtype(code %u, %u bits) shape [%" PRId64 "]", meta.dtype_code, meta.dtype_bits,
               meta.shape[0]);
    tmp = malloc(n ? n : 1);
    if (!tmp || demo_copy(tmp, gpupool_buffer_ptr(b), n, b) != 0)
      return 1;
    for (uint64_t j = 0; j < n; j++)
      mismatches += tmp[j] != demo_byte(i, j);
    printf("consumer %d: %-12s %8zu bytes at %p, tensor %s: %s\n", id, name, n, gpupool_buffer_ptr(b), shape,
           mismatches ? "MISMATCH" : "all bytes match");
    bad += mismatches != 0;
    free(tmp);
    if ((rc = gpupool_buffer_release(b, NULL)) != 0)
      demo_die("release", rc);
  }
  gpupool_client_disconnect(c);
  printf("consumer %d: %s\n", id, bad ? "FAILED" : "ok");
  return bad ? 1 : 0;
}
