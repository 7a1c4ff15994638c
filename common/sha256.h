/*
 * SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the peers' challenge-response: small,
 * no dependency, checked against the FIPS and RFC 4231 vectors (tests/unit/test_sha256.c).
 */
#ifndef GPUPOOL_COMMON_SHA256_H
#define GPUPOOL_COMMON_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define GPUPOOL__SHA256_LEN 32

typedef struct {
  uint32_t h[8];
  uint64_t len;       /* bytes hashed so far */
  uint8_t buf[64];
  size_t nbuf;
} gpupool__sha256;

void gpupool__sha256_init(gpupool__sha256 *s);
void gpupool__sha256_update(gpupool__sha256 *s, const void *data, size_t len);
void gpupool__sha256_final(gpupool__sha256 *s, uint8_t out[GPUPOOL__SHA256_LEN]);
void gpupool__sha256_digest(const void *data, size_t len, uint8_t out[GPUPOOL__SHA256_LEN]);

/* HMAC-SHA256 of the concatenation of the n parts (a key of any length). */
void gpupool__hmac_sha256(const void *key, size_t keylen, const void *const *parts, const size_t *lens, size_t n,
                          uint8_t out[GPUPOOL__SHA256_LEN]);

/* 1 when a and b are equal; its time depends on len only, never on where they differ. */
int gpupool__ct_equal(const void *a, const void *b, size_t len);

#endif
