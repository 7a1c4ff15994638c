/*
 * gpupool refit API: sharded versions and refitting an engine's own tensors in place.
 *
 *   sharded versions (a trainer's ranks, each holding a slice of every weight)
 *     gpupool_shard_member_name            the member name a slice is published under
 *     gpupool_bundle_publish_part          publish a bundle as one part of a version
 *     gpupool_bundle_publish_members_part  publish ranges of held buffers as one part
 *   refit (an inference engine's parameters, filled in place)
 *     gpupool_refit_plan                   the copies from a version's layout into targets
 *     gpupool_refit                        replay a plan for a version: copy, in place
 *     gpupool_plan_info_get                what a plan does
 *     gpupool_plan_free                    free a plan
 *
 * A version of a sharded name is made by `parts` publishers (trainer ranks): each allocates a
 * bundle of its slices (gpupool_bundle_alloc, members named by gpupool_shard_member_name: the
 * global tensor's key, the part, the slice and the global shape), fills it, and publishes it
 * with gpupool_bundle_publish_part. The daemon keeps the parts aside and publishes the version
 * (one bundle of every part's members) when its last part is in: a getter sees all of it or
 * nothing. If a publisher's connection closes before every part is in, the version is dropped
 * and its parts released. Readers get it with gpupool_bundle_get (newer_than as always).
 *
 * An engine describes its targets once: for each of its tensors (pointer, dtype, shape,
 * strides), the slices of global tensors it holds, stacked along one dimension (a fused
 * qkv_proj: the q, k and v slices of this tensor-parallel rank, in that order). A plan is the
 * list of copies that fill the targets from a version with a given layout, merged into as few
 * and as large copies as possible; gpupool_refit replays it for each later version with that
 * layout, writing into the targets in place (their addresses never change), with casts where
 * the dtypes differ. See docs/REFIT.md.
 */
#ifndef GPUPOOL_REFIT_H
#define GPUPOOL_REFIT_H

#include "gpupool/gpupool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- sharded versions ------------------------------------------------------------------------- */

/* Most parts a version may have. */
#define GPUPOOL_PARTS_MAX 1024

/* Write into out (len bytes) the member name of the slice of global tensor `key` that part
 * `part` holds: "KEY@PART[S0:E0,S1:E1]/G0xG1" for a slice start[i]..start[i]+shape[i] of a
 * tensor of global_shape (ndim 0..GPUPOOL_MAX_NDIM). The member's tensor description gives
 * its dtype and local shape (which must be `shape`). 0, GPUPOOL_EINVAL (a slice outside the
 * global shape, negative sizes), or GPUPOOL_ENAME when the name would not fit in
 * GPUPOOL_NAME_MAX bytes (use a shorter key). */
GPUPOOL_EXTERN int gpupool_shard_member_name(char *out, size_t len, const char *key, int part, int ndim,
                                             const int64_t *global_shape, const int64_t *start,
                                             const int64_t *shape);

/* Publish bundle b (members named by gpupool_shard_member_name, or any names unique over every
 * part) as part `part` (0..parts-1) of version `version` of `name`. version must be greater
 * than the name's published version, and the same in every part; the first part of a version
 * says how many parts it has. The version is published when its last part is in (*complete,
 * may be NULL, is 1 for the call that completed it); b stays the caller's (release it: the
 * version keeps its own references). Each buffer's ready event is recorded in `stream` first.
 * Errors: GPUPOOL_EINVAL (a version not newer, parts that disagree), GPUPOOL_EEXIST (that part
 * is in already), GPUPOOL_ELIMIT (too many versions waiting for parts), and those of
 * gpupool_bundle_publish. The publisher must stay connected until the version is complete: a
 * part whose connection closes first takes its version with it. */
GPUPOOL_EXTERN int gpupool_bundle_publish_part(gpupool_bundle *b, const char *name, uint64_t version, int part,
                                               int parts, void *stream, int *complete);

/* Publish n members that lie in buffers the caller holds (gpupool_member_ref, as
 * gpupool_bundle_publish_members: zero copy, for slices that already live in gpupool memory)
 * as part `part` of `parts` of version `version` of name, as gpupool_bundle_publish_part. */
GPUPOOL_EXTERN int gpupool_bundle_publish_members_part(gpupool_client *c, const char *name, uint64_t version,
                                                       int part, int parts, const gpupool_member_ref *members,
                                                       int n, void *stream, int *complete);

/* ---- refit ------------------------------------------------------------------------------------ */

/* A slice of a global tensor that a target holds: it starts at start[] in the global tensor
 * and spans the target's extent in every dimension but the target's `dim`, where it spans
 * `length` (0: the rest of the target along dim). */
typedef struct {
  const char *key;                  /* the global tensor (the KEY of its members' names) */
  int64_t start[GPUPOOL_MAX_NDIM];  /* where the slice starts, per dimension */
  int64_t length;                   /* its extent along the target's dim; 0 = the rest */
} gpupool_refit_piece;

/* One of the engine's tensors and what it holds: its pieces one after the other along `dim`. */
typedef struct {
  void *ptr;                        /* the tensor's memory; element 0 at ptr + meta.byte_offset */
  gpupool_tensor_meta meta;         /* its dtype, shape and strides (in elements) */
  int dim;                          /* the dimension the pieces are stacked along */
  const gpupool_refit_piece *pieces;
  int npieces;                      /* 1.. */
} gpupool_refit_target;

/* Flags of gpupool_refit_plan. GPUPOOL_REFIT_DEVICE: the targets are device memory (CUDA
 * builds): the copies run on the stream gpupool_refit is given, those within one GPU in a gather
 * kernel (a few launches for all of them; GPUPOOL_REFIT_GATHER=0: not), the others as
 * cudaMemcpy2DAsync (another GPU's memory over peer access, host memory). Without
 * it, and when every source lies in host memory, the copies are memcpy (and casts) on the
 * calling thread. */
typedef enum { GPUPOOL_REFIT_DEVICE = 0x1 } gpupool_refit_flags;

/* A plan: the copies from a version's layout into the targets. One thread uses a plan at a
 * time (it replans in place). */
typedef struct gpupool_plan gpupool_plan;

/* What a plan does. */
typedef struct {
  uint64_t layout_id;   /* the layout it was made for (gpupool_bundle_layout_id) */
  uint64_t copies;      /* copies it replays (each a 2D copy: rows of contiguous elements) */
  uint64_t bytes;       /* bytes it writes into the targets per refit */
  uint64_t cast_copies; /* of the copies, those that convert a dtype */
  uint64_t plans;       /* times the copies were computed (1, plus one per new layout met) */
  uint64_t refits;      /* times it was replayed */
  uint64_t gathered;    /* of the copies, those the last refit into device memory did in the gather
                         * kernel (within one GPU, a few launches for all); the others were one
                         * cudaMemcpy2DAsync each */
} gpupool_plan_info;

/* Compute the copies that fill the n targets from bundle b's members (a version got with
 * gpupool_bundle_get; members named by gpupool_shard_member_name are slices, others whole
 * tensors named by their member name). Every target element must come from exactly one
 * version element: a piece that is not covered in full, a slice outside its global tensor,
 * shards of a key that overlap (unless identical), shapes that do not add up, or dtypes with
 * no cast (float16, bfloat16, float32 and float64 cast among themselves; other dtypes must be
 * equal) fail with GPUPOOL_EINVAL naming the target, piece and key. The targets are copied
 * (keys included); their memory must stay valid while the plan is used. On success *out is the
 * caller's, freed with gpupool_plan_free. Nothing is copied yet. */
GPUPOOL_EXTERN int gpupool_refit_plan(const gpupool_bundle *b, const gpupool_refit_target *targets, int n,
                                      unsigned flags, gpupool_plan **out);

/* Write version b into the plan's targets in place. A bundle with the plan's layout (the same
 * layout id, through the same connection) replays the copies: nothing is allocated or looked
 * up. A bundle of another layout has the copies computed again first (gpupool_plan_info's
 * plans counts it), with the same checks as gpupool_refit_plan; on failure the targets are
 * unchanged. Host copies are done when it returns; device copies (GPUPOOL_REFIT_DEVICE) are
 * queued on `stream` (release b in that stream). GPUPOOL_ENOTSUP: device copies in a build
 * without CUDA; a cast into device memory that the gather kernel cannot do (it casts within
 * one GPU: source, target and stream on the same device; not with GPUPOOL_REFIT_GATHER=0, nor
 * in a build without nvcc): then nothing was queued. */
GPUPOOL_EXTERN int gpupool_refit(gpupool_plan *p, const gpupool_bundle *b, void *stream);

/* What p does into *out. */
GPUPOOL_EXTERN int gpupool_plan_info_get(const gpupool_plan *p, gpupool_plan_info *out);

/* Free p (NULL is allowed). Copies it queued on a stream must have been waited for. */
GPUPOOL_EXTERN void gpupool_plan_free(gpupool_plan *p);

#ifdef __cplusplus
}
#endif

#endif /* GPUPOOL_REFIT_H */
