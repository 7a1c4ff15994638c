/*
 * libgpupool-client: what parts.c (publishing slices) and refit.c (planning copies from them)
 * share: the geometry a slice's member name carries.
 */
#ifndef GPUPOOL_CLIENT_REFIT_INTERNAL_H
#define GPUPOOL_CLIENT_REFIT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "errors.h"
#include "gpupool/gpupool.h"

/* A slice as its member name says: "KEY@PART[S0:E0,...]/G0x...". */
typedef struct {
  size_t keylen; /* the key is the name's first keylen bytes */
  int part;
  int ndim;
  int64_t start[GPUPOOL_MAX_NDIM], shape[GPUPOOL_MAX_NDIM], global[GPUPOOL_MAX_NDIM];
} gpupool__shard;

/* 0 with *out filled when name is a slice's member name, -1 when it is not one. */
int gpupool__shard_parse(const char *name, gpupool__shard *out);

/* One part of a sharded version, for the publishes of bundles.c: sent as PublishPart instead
 * of PublishBundle; complete gets the daemon's answer. */
typedef struct {
  uint64_t version;
  int part, parts;
  int complete;
} gpupool__part;

/* gpupool_bundle_publish_to after its checks (devs already converted), and
 * gpupool_bundle_publish_members, each as a whole version (part NULL) or as one part. A member
 * refused by the checks before sending, or the transport's failure, is told in *err (the caller
 * reports it). */
int gpupool__bundle_publish(gpupool_bundle *b, const char *name, void *stream, const uint32_t *devs, int ndevs,
                            gpupool__part *part, uint64_t *version, gpupool__error *err);
int gpupool__publish_members(gpupool_client *c, const char *name, const gpupool_member_ref *members, int n,
                             void *stream, gpupool__part *part, uint64_t *version, gpupool__error *err);

#endif
