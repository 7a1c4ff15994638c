/*
 * A client for the tests of what survives the daemon under systemd (tests/system/inside.sh):
 * publishes N names of SIZE bytes, each filled from its index and SEED, and later checks that
 * every one is there at the version expected with those bytes, bit for bit.
 *
 * Usage: svc_survive SOCKET publish PREFIX N SIZE SEED
 *        svc_survive SOCKET check PREFIX N SIZE SEED VERSION
 *        svc_survive SOCKET unpublish PREFIX N
 * Exit: 0 when all went as said, 1 when a name is missing or differs (the first one is
 *       printed), 2 on a usage or connection error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool/gpupool.h"

static uint8_t byte_at(uint32_t seed, uint64_t j) {
  uint64_t x = (j + 1) ^ ((uint64_t)seed << 32 | seed);
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return (uint8_t)x;
}

int main(int argc, char **argv) {
  gpupool_client *c;
  const char *op;
  int n;
  uint64_t size = 0, want = 0;
  uint32_t seed = 0;
  if (argc < 5) {
    fprintf(stderr, "usage: svc_survive SOCKET publish|check|unpublish PREFIX N [SIZE SEED [VERSION]]\n");
    return 2;
  }
  op = argv[2];
  n = atoi(argv[4]);
  if (argc > 6) {
    size = strtoull(argv[5], NULL, 10);
    seed = (uint32_t)strtoul(argv[6], NULL, 10);
  }
  if (argc > 7)
    want = strtoull(argv[7], NULL, 10);
  if (gpupool_client_connect(argv[1], "svc_survive", GPUPOOL_TIMEOUT_DEFAULT, &c) != 0) {
    fprintf(stderr, "svc_survive: connect: %s\n", gpupool_last_error());
    return 2;
  }
  for (int i = 0; i < n; i++) {
    char name[GPUPOOL_NAME_MAX + 1];
    gpupool_buffer *b;
    uint64_t v = 0;
    snprintf(name, sizeof name, "%s%d", argv[3], i);
    if (strcmp(op, "publish") == 0) {
      if (gpupool_buffer_alloc(c, NULL, size, 0, NULL, &b) != 0)
        goto failed;
      for (uint64_t j = 0; j < size; j++)
        ((uint8_t *)gpupool_buffer_ptr(b))[j] = byte_at(seed + (uint32_t)i, j);
      if (gpupool_buffer_publish(b, name, NULL, NULL, &v) != 0 || gpupool_buffer_release(b, NULL) != 0)
        goto failed;
    } else if (strcmp(op, "check") == 0) {
      if (gpupool_buffer_get(c, name, 0, 0, GPUPOOL_READ_ONLY, NULL, &b, &v) != 0)
        goto failed;
      if (v != want || gpupool_buffer_size(b) < size) {
        printf("svc_survive: %s is at version %llu (%zu bytes), not %llu\n", name, (unsigned long long)v,
               gpupool_buffer_size(b), (unsigned long long)want);
        return 1;
      }
      for (uint64_t j = 0; j < size; j++)
        if (((const uint8_t *)gpupool_buffer_ptr(b))[j] != byte_at(seed + (uint32_t)i, j)) {
          printf("svc_survive: %s differs at byte %llu\n", name, (unsigned long long)j);
          return 1;
        }
      gpupool_buffer_release(b, NULL);
    } else if (strcmp(op, "unpublish") == 0) {
      if (gpupool_name_unpublish(c, name) != 0)
        goto failed;
    } else {
      fprintf(stderr, "svc_survive: unknown operation %s\n", op);
      return 2;
    }
  }
  printf("svc_survive: %s %d name(s): ok\n", op, n);
  gpupool_client_disconnect(c);
  return 0;
failed:
  printf("svc_survive: %s: %s\n", op, gpupool_last_error());
  return 1;
}
